"""``inference.launch=sglang|vllm``: start real SGLang or vLLM servers for the user.

Each server runs on 127.0.0.1 on a free port with the flags relayrl needs, its GPUs chosen by
``CUDA_VISIBLE_DEVICES`` (``launch_tp_size`` of ``launch_gpus`` each), its output captured in
``<launch_log_dir>/server-<i>.log``. ``start`` returns once every server answers ``/health``
(a server that exits or times out is an error quoting the end of its log). Servers are stopped by
``shutdown()``, at interpreter exit, on SIGTERM and with a SIGKILLed parent, as ``relayrl serve``
children are (``launcher``'s machinery).

Flags:
- SGLang: ``python -m sglang.launch_server --model-path M --host 127.0.0.1 --port P --tp-size K``;
  ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`` keeps ``/health`` from generating.
- vLLM: ``vllm serve M --host 127.0.0.1 --port P --tensor-parallel-size K --logprobs-mode
  processed_logprobs`` (logprobs of the distribution sampled), ``--weight-transfer-backend nccl``
  for weight_sync=broadcast, ``disk`` for weight_sync=disk; ``VLLM_SERVER_DEV_MODE=1`` for the RL
  router (pause, resume, weight transfer) and the ``/collective_rpc`` reload fallback.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from relayrl.api.config import InferenceConfig
from relayrl.inference import launcher


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def server_command(kind: str, cfg: InferenceConfig, model: str, port: int) -> list[str]:
    """The command line of one launched server."""
    if kind == "sglang":
        prefix = (
            shlex.split(cfg.launch_command) if cfg.launch_command else [sys.executable, "-m", "sglang.launch_server"]
        )
        flags = [
            "--model-path",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--tp-size",
            str(cfg.launch_tp_size),
        ]
        return [*prefix, *flags, *cfg.launch_args]
    if kind == "vllm":
        prefix = shlex.split(cfg.launch_command) if cfg.launch_command else ["vllm", "serve"]
        flags = [
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--tensor-parallel-size",
            str(cfg.launch_tp_size),
            "--logprobs-mode",
            "processed_logprobs",
        ]
        sync = cfg.weight_sync if cfg.weight_sync != "auto" else ("disk" if cfg.weight_sync_dir else "http")
        transfer = {"broadcast": "nccl", "disk": "disk"}.get(sync)  # vLLM's weight-transfer engine for the mode
        flags += ["--weight-transfer-backend", transfer] if transfer else []
        return [*prefix, model, *flags, *cfg.launch_args]
    raise ValueError(f"inference.launch must be sglang or vllm here, got {kind!r}")


def server_env(kind: str, cfg: InferenceConfig, i: int) -> dict[str, str]:
    env = dict(os.environ)
    k = cfg.launch_tp_size
    if cfg.launch_gpus:
        gpus = cfg.launch_gpus[i * k : (i + 1) * k]
        if len(gpus) < k:
            raise ValueError(
                f"inference.launch_gpus={cfg.launch_gpus} has no {k} GPUs left for server {i} "
                f"(n_servers={cfg.n_servers}, launch_tp_size={k} need {cfg.n_servers * k})"
            )
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    if kind == "sglang":
        env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
    else:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


class PeerServerGroup:
    """Launched SGLang / vLLM servers: ``addresses``, ``logs``, ``shutdown()``."""

    def __init__(self, kind: str, cfg: InferenceConfig, model: str) -> None:
        self.kind, self.cfg, self.model = kind, cfg, model
        self.log_dir = Path(cfg.launch_log_dir or tempfile.mkdtemp(prefix=f"relayrl-{kind}-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.addresses: list[str] = []
        self.logs: list[Path] = []

    def start(self) -> PeerServerGroup:
        launcher._install_handlers()  # noqa: SLF001 - the same teardown as `relayrl serve` children
        launcher._groups.add(self)  # type: ignore[arg-type]  # noqa: SLF001
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(self.cfg.n_servers):
                port = _free_port()
                log = self.log_dir / f"server-{i}.log"
                cmd = server_command(self.kind, self.cfg, self.model, port)
                env = server_env(self.kind, self.cfg, i)
                with open(log, "wb") as out:
                    out.write(f"$ {shlex.join(cmd)}\n".encode())
                    out.flush()
                    self.procs.append(
                        launcher._spawner.submit(  # noqa: SLF001 - PDEATHSIG needs a long-lived thread
                            subprocess.Popen,
                            cmd,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            env=env,
                            preexec_fn=launcher._die_with_parent,
                        ).result()
                    )  # noqa: SLF001
                self.addresses.append(f"127.0.0.1:{port}")
                self.logs.append(log)
            for i in range(len(self.procs)):
                self._wait_healthy(i)
        except BaseException:
            self.shutdown()
            raise
        return self

    def _wait_healthy(self, i: int) -> None:
        deadline = time.monotonic() + self.cfg.launch_timeout
        while True:
            code = self.procs[i].poll()
            if code is not None:
                raise RuntimeError(
                    f"{self.kind} server {i} exited with code {code} before it was healthy; "
                    f"{self.logs[i]} ends with:\n{self.tail(i)}"
                )
            try:
                if httpx.get(f"http://{self.addresses[i]}/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.kind} server {i} not healthy after {self.cfg.launch_timeout:.0f}s "
                    f"(inference.launch_timeout); {self.logs[i]} ends with:\n{self.tail(i)}"
                )
            time.sleep(0.25)

    def tail(self, i: int, n: int = 20) -> str:
        try:
            return "\n".join(self.logs[i].read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def shutdown(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
