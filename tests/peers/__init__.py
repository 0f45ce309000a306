"""Peer stand-ins: small servers that speak SGLang's and vLLM's protocols as their own source
defines them (each module names the version and files it follows), for RemoteEngine's tests.

``start("sglang" | "vllm", *args)`` runs one as a real process on 127.0.0.1 and returns a handle
with ``address``, ``kill()``, ``restart()`` (same port) and ``stop()``. The process is a child of a
forkserver that has already imported torch, transformers' model code and relayrl (~8 s of CPU a
start otherwise); it runs the stand-in's script as ``__main__``, and signals reach it as any process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import runpy
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
SCRIPTS = {"sglang": HERE / "sglang_server.py", "vllm": HERE / "vllm_server.py"}


# The same preload as tests/reliability/audit.py's (one forkserver per process serves both).
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["relayrl.trainer", "relayrl.cli", "relayrl.inference.local", "fastapi", "uvicorn"])


def _serve(script: str, args: list[str], log: str, env: dict[str, str]) -> None:
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)  # (stderr stays the suite's, as a subprocess's did)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


class Peer:
    def __init__(self, kind: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.kind, self.args = kind, list(args)
        self.env = dict(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        self.proc: mp.process.BaseProcess | None = None
        self.address = ""

    def start(self, port: int = 0, timeout: float = 120.0) -> Peer:
        args = ["--port", str(port), *self.args]
        log = Path(tempfile.mkstemp(prefix=f"relayrl-{self.kind}-stand-in.", suffix=".log")[1])
        self.proc = _CTX.Process(target=_serve, args=(str(SCRIPTS[self.kind]), args, str(log), self.env), daemon=True)
        self.proc.start()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                lines = log.read_text(errors="replace").splitlines()
                up = [ln for ln in lines if "listening on http://" in ln]
                if up:
                    self.address = up[0].rsplit("http://", 1)[1].strip()
                    return self
                if self.proc.exitcode is not None:
                    raise RuntimeError(
                        f"{self.kind} stand-in exited with {self.proc.exitcode} ({args}): {' | '.join(lines[-20:])}"
                    )
                time.sleep(0.02)
            self.proc.kill()
            raise TimeoutError(f"{self.kind} stand-in did not start within {timeout}s")
        finally:
            log.unlink(missing_ok=True)  # the process goes on writing to the unlinked file

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30)

    def kill(self) -> None:
        if self.proc is not None and self.proc.exitcode is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(timeout=30)

    def restart(self) -> None:
        self.kill()
        self.start(port=int(self.address.rsplit(":", 1)[1]))

    def stop(self) -> None:
        if self.proc is not None and self.proc.exitcode is None:
            self.proc.terminate()
            self.proc.join(timeout=10)
            if self.proc.exitcode is None:
                self.proc.kill()
                self.proc.join(timeout=30)


def start(kind: str, *args: str, env: dict[str, str] | None = None) -> Peer:
    return Peer(kind, list(args), env).start()
