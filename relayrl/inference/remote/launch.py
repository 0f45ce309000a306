"""``inference.launch=sglang|vllm``: start real SGLang or vLLM servers for the user.

Each server runs on 127.0.0.1 on a free port with the command line and environment its peer
module gives (``server_command`` / ``server_env``: the flags relayrl needs), its GPUs chosen by
``CUDA_VISIBLE_DEVICES`` (``launch_tp_size`` of ``launch_gpus`` each), its output captured in
``<launch_log_dir>/server-<i>.log``. ``start`` returns once every server answers ``/health``
(a server that exits or times out is an error quoting the end of its log). Servers are stopped by
``shutdown()``, at interpreter exit, on SIGTERM and with a SIGKILLed parent, as ``relayrl serve``
children are (``server.launcher``'s machinery).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import httpx

from relayrl.inference.server import launcher

if TYPE_CHECKING:  # light to import: Ray's server actors run it
    from relayrl.api.config import InferenceConfig, LoraConfig


class Launched(Protocol):
    """Servers started for a RemoteEngine: where they listen, and how they stop."""

    addresses: list[str]

    def shutdown(self) -> None: ...


class LaunchablePeer(Protocol):
    """What a peer module gives to launch its servers."""

    name: str

    def server_command(
        self, cfg: InferenceConfig, model: str, port: int, host: str = ..., lora: LoraConfig | None = ...
    ) -> list[str]: ...

    def server_env(self, cfg: InferenceConfig, i: int, lora: LoraConfig | None = ...) -> dict[str, str]: ...

    def api_key(self, token: str, folder: Path) -> tuple[list[str], dict[str, str]]:
        """The arguments and environment that give a server ``token`` as its API key, never on its
        command line (``folder``: a private directory for a file holding it)."""
        ...


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def gpu_env(cfg: InferenceConfig, i: int) -> dict[str, str]:
    """Server ``i``'s environment: this one, with its ``launch_tp_size`` GPUs of ``launch_gpus``."""
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
    return env


class PeerServerGroup:
    """Launched servers of one peer (``peer``: its module's backend): ``addresses``, ``logs``, ``shutdown()``."""

    def __init__(
        self,
        peer: LaunchablePeer,
        cfg: InferenceConfig,
        model: str,
        host: str = "127.0.0.1",
        lora: LoraConfig | None = None,
        dtype: str = "",
        token: str = "",
    ) -> None:
        """``dtype``: the trainer's (``model.dtype``), served unless ``launch_args`` name a ``--dtype``
        (SGLang would serve an fp32 checkpoint in fp16, vLLM in bf16: logprobs off the trainer's).
        ``token``: the servers' API key (the run's random credential)."""
        self.peer, self.cfg, self.model, self.host, self.lora, self.dtype = peer, cfg, model, host, lora, dtype
        self.token = token
        self.key_dir: Path | None = None  # 0700, holds a key file where the peer reads its key from one
        self.log_dir = Path(cfg.launch_log_dir or tempfile.mkdtemp(prefix=f"relayrl-{self.peer.name}-"))
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
                cmd = self.command(port)
                env = self.peer.server_env(self.cfg, i, self.lora)
                if self.token:
                    self.key_dir = self.key_dir or Path(tempfile.mkdtemp(prefix="relayrl-key-"))
                    key_args, key_env = self.peer.api_key(self.token, self.key_dir)
                    cmd, env = [*cmd, *key_args], {**env, **key_env}
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

    def command(self, port: int) -> list[str]:
        """One server's command line: the peer's, then the trainer's ``--dtype`` unless it names one
        already (``--dtype X`` or ``--dtype=X``, in ``launch_args`` or ``launch_command``)."""
        cmd = self.peer.server_command(self.cfg, self.model, port, self.host, self.lora)
        if self.dtype and not any(a == "--dtype" or a.startswith("--dtype=") for a in cmd):
            cmd += ["--dtype", self.dtype]
        return cmd

    def _wait_healthy(self, i: int) -> None:
        deadline = time.monotonic() + self.cfg.launch_timeout
        while True:
            code = self.procs[i].poll()
            if code is not None:
                raise RuntimeError(
                    f"{self.peer.name} server {i} exited with code {code} before it was healthy; "
                    f"{self.logs[i]} ends with:\n{self.tail(i)}"
                )
            auth = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://{self.addresses[i]}/health", headers=auth, timeout=5.0).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.peer.name} server {i} not healthy after {self.cfg.launch_timeout:.0f}s "
                    f"(inference.launch_timeout); {self.logs[i]} ends with:\n{self.tail(i)}"
                )
            time.sleep(0.25)

    def tail(self, i: int, n: int = 20) -> str:
        try:
            return "\n".join(self.logs[i].read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def shutdown(self) -> None:
        if self.key_dir is not None:
            shutil.rmtree(self.key_dir, ignore_errors=True)
        launcher.stop(self.procs, timeout=30)
