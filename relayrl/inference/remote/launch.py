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
- LoRA adapters (``model.lora.sync=adapter``): SGLang ``--enable-lora --max-lora-rank R
  --lora-target-modules M.. --max-loras-per-batch 2`` (``all`` when model.lora.target_modules is
  empty: every linear projection, as relayrl's default); vLLM ``--enable-lora --max-lora-rank R
  --max-loras 2`` (R rounded up to a rank vLLM accepts) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``
  for the runtime load/unload routes. Two adapters at once: the new one and the one it replaces,
  while requests sent with it finish.
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
from typing import TYPE_CHECKING

import httpx

from relayrl.api.config import InferenceConfig, LoraConfig
from relayrl.inference.server import launcher

if TYPE_CHECKING:  # light to import: Ray's server actors run it
    from relayrl.api.config import InferenceConfig


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig accepts only these max ranks


def lora_flags(kind: str, lora: LoraConfig | None) -> list[str]:
    """The flags that let a server load the trainer's adapters at run time (none without LoRA)."""
    if lora is None or lora.rank <= 0:
        return []
    if kind == "sglang":
        targets = list(lora.target_modules) or ["all"]
        return ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *targets,
                "--max-loras-per-batch", "2"]  # fmt: skip
    rank = next((r for r in VLLM_LORA_RANKS if r >= lora.rank), lora.rank)
    return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]


def server_command(
    kind: str, cfg: InferenceConfig, model: str, port: int, host: str = "127.0.0.1", lora: LoraConfig | None = None
) -> list[str]:
    """The command line of one launched server (listening on ``host``: a Ray node's address under Ray;
    ``lora``: the adapters it will load, if any)."""
    if kind == "sglang":
        prefix = (
            shlex.split(cfg.launch_command) if cfg.launch_command else [sys.executable, "-m", "sglang.launch_server"]
        )
        flags = [
            "--model-path",
            model,
            "--host",
            host,
            "--port",
            str(port),
            "--tp-size",
            str(cfg.launch_tp_size),
        ]
        return [*prefix, *flags, *lora_flags(kind, lora), *cfg.launch_args]
    if kind == "vllm":
        prefix = shlex.split(cfg.launch_command) if cfg.launch_command else ["vllm", "serve"]
        flags = [
            "--host",
            host,
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
        return [*prefix, model, *flags, *lora_flags(kind, lora), *cfg.launch_args]
    raise ValueError(f"inference.launch must be sglang or vllm here, got {kind!r}")


def server_env(kind: str, cfg: InferenceConfig, i: int, lora: LoraConfig | None = None) -> dict[str, str]:
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
        if lora_flags(kind, lora):
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return env


class PeerServerGroup:
    """Launched SGLang / vLLM servers: ``addresses``, ``logs``, ``shutdown()``."""

    def __init__(
        self, kind: str, cfg: InferenceConfig, model: str, host: str = "127.0.0.1", lora: LoraConfig | None = None
    ) -> None:
        self.kind, self.cfg, self.model, self.host, self.lora = kind, cfg, model, host, lora
        self.log_dir = Path(cfg.launch_log_dir or tempfile.mkdtemp(prefix=f"relayrl-{kind}-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.addresses: list[str] = []
        self.logs: list[Path] = []

    def start(self, ports: list[int] | None = None) -> PeerServerGroup:
        """Start ``cfg.n_servers`` servers (on ``ports``, default free ones) and wait until healthy."""
        launcher._install_handlers()  # noqa: SLF001 - the same teardown as `relayrl serve` children
        launcher._groups.add(self)  # type: ignore[arg-type]  # noqa: SLF001
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(self.cfg.n_servers):
                port = ports[i] if ports else _free_port(self.host)
                log = self.log_dir / f"server-{i}.log"
                cmd = server_command(self.kind, self.cfg, self.model, port, self.host, self.lora)
                env = server_env(self.kind, self.cfg, i, self.lora)
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
                self.addresses.append(f"{self.host}:{port}")
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
