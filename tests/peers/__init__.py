"""Peer stand-ins: small servers that speak SGLang's and vLLM's protocols as their own source
defines them (each module names the version and files it follows), for RemoteEngine's tests.

``start("sglang" | "vllm", *args)`` runs one as a real process on 127.0.0.1 and returns a handle
with ``address``, ``kill()``, ``restart()`` (same port) and ``stop()``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
SCRIPTS = {"sglang": HERE / "sglang_server.py", "vllm": HERE / "vllm_server.py"}


class Peer:
    def __init__(self, kind: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.kind, self.args = kind, list(args)
        self.env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""

    def start(self, port: int = 0, timeout: float = 120.0) -> Peer:
        cmd = [sys.executable, str(SCRIPTS[self.kind]), "--port", str(port), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=self.env)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.kind} stand-in exited with {self.proc.wait()} ({cmd})")
            if "listening on http://" in line:
                self.address = line.rsplit("http://", 1)[1].strip()
                threading.Thread(target=lambda p=self.proc: [None for _ in p.stdout], daemon=True).start()  # type: ignore[union-attr]
                return self
        self.proc.kill()
        raise TimeoutError(f"{self.kind} stand-in did not start within {timeout}s")

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def restart(self) -> None:
        self.kill()
        self.start(port=int(self.address.rsplit(":", 1)[1]))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start(kind: str, *args: str, env: dict[str, str] | None = None) -> Peer:
    return Peer(kind, list(args), env).start()
