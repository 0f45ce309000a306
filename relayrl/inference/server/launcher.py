"""Start N local ``relayrl serve`` processes, wait until healthy, never leave orphans.

Each child runs ``python -m relayrl.cli serve ... port=0`` and announces its port on stdout.
Children are torn down by ``shutdown()``, at interpreter exit (atexit, which also covers
Ctrl-C: SIGINT stays Python's KeyboardInterrupt so the trainer can save its final checkpoint
first), on SIGTERM, and -- when the parent is SIGKILLed -- by the kernel: every child is
started with ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux), so it dies with the thread that
spawned it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import secrets
import selectors
import signal
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import httpx

from relayrl.inference.server import LISTEN_PREFIX

_PR_SET_PDEATHSIG = 1
_groups: weakref.WeakSet[ServerGroup] = weakref.WeakSet()
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relayrl-launcher")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _shutdown_all() -> None:
    for group in list(_groups):
        group.shutdown()


def _on_signal(signum: int, frame: object) -> None:
    _shutdown_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


@functools.cache  # once per process
def _install_handlers() -> None:
    atexit.register(_shutdown_all)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_signal)


class ServerGroup:
    """Handles to launched servers: ``addresses``, ``kill(i)``, ``restart(i)``, ``shutdown()``."""

    def __init__(self, args: list[str], env: dict[str, str], startup_timeout: float) -> None:
        self.args, self.env, self.startup_timeout = args, env, startup_timeout
        self.admin_token = env.get("RELAYRL_ADMIN_TOKEN", "")  # the servers' (launch_servers always gives one)
        self.procs: list[subprocess.Popen[str]] = []
        self.addresses: list[str] = []

    def _popen(self, port: int = 0) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "relayrl.cli", "serve", *self.args, f"port={port}"]
        # Spawned from one long-lived thread: PDEATHSIG fires when the *thread* that forked exits.
        return _spawner.submit(
            subprocess.Popen, cmd, stdout=subprocess.PIPE, text=True, env=self.env, preexec_fn=_die_with_parent
        ).result()

    def _await_address(self, proc: subprocess.Popen[str]) -> str:
        """Read the child's stdout until it announces ``relayrl server listening on http://H:P``."""
        assert proc.stdout is not None
        deadline = time.monotonic() + self.startup_timeout
        ready = selectors.DefaultSelector()  # a child that prints nothing must not block past the deadline
        ready.register(proc.stdout, selectors.EVENT_READ)
        while (remaining := deadline - time.monotonic()) > 0:
            if not ready.select(remaining):
                continue
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"server exited with code {proc.wait()} before announcing its port ({self.args})")
            if line.startswith(LISTEN_PREFIX):
                threading.Thread(target=_drain, args=(proc,), daemon=True).start()
                return line[len(LISTEN_PREFIX) :].strip().removeprefix("http://")
        proc.kill()
        raise TimeoutError(f"server did not start within {self.startup_timeout}s (inference.launch_timeout)")

    def wait_healthy(self, i: int) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):  # not listening yet
                if httpx.get(f"http://{self.addresses[i]}/health", timeout=2.0).status_code == 200:
                    return
            if self.procs[i].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"server {i} at {self.addresses[i]} is not healthy after {self.startup_timeout:.0f}s "
                    "(inference.launch_timeout)"
                )
            time.sleep(0.1)

    def start(self, n: int, ports: list[int] | None = None) -> None:
        """Start ``n`` servers on ``ports`` (default: free ones each picks) and wait until healthy."""
        self.procs = [self._popen(p) for p in (ports or [0] * n)]  # all boot in parallel
        try:
            self.addresses = [self._await_address(p) for p in self.procs]
            for i in range(n):
                self.wait_healthy(i)
        except BaseException:
            self.shutdown()
            raise

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Kill server ``i`` (for reliability tests); its address stays reserved for restart."""
        proc = self.procs[i]
        if proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(timeout=30)

    def restart(self, i: int) -> None:
        """Kill server ``i`` if running and start a fresh one on the same port."""
        self.kill(i)
        port = int(self.addresses[i].rsplit(":", 1)[1])
        self.procs[i] = self._popen(port)
        self.addresses[i] = self._await_address(self.procs[i])
        self.wait_healthy(i)

    def shutdown(self) -> None:
        stop(self.procs, timeout=10)


def _drain(proc: subprocess.Popen[str]) -> None:
    """Keep reading the child's stdout so a full pipe never blocks it."""
    assert proc.stdout is not None
    for _ in proc.stdout:
        pass


def launch_servers(
    n: int,
    model: str = "tiny",
    threads: int = 1,
    overrides: list[str] | None = None,
    admin_token: str = "",
    startup_timeout: float = 120.0,
) -> ServerGroup:
    """Start ``n`` servers on 127.0.0.1 (free ports) and wait until all answer /health.

    ``overrides`` are ServerConfig dotted overrides (``inference.max_batch_size=32``). The
    admin token (``admin_token``, else RELAYRL_ADMIN_TOKEN, else a random one: ``group.admin_token``)
    travels in the environment, not on the command line.
    """
    _install_handlers()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads))
    env["RELAYRL_ADMIN_TOKEN"] = admin_token or env.get("RELAYRL_ADMIN_TOKEN") or secrets.token_urlsafe(32)
    args = [f"model.path={model}", f"torch_threads={threads}", "host=127.0.0.1", *(overrides or [])]
    group = ServerGroup(args, env, startup_timeout)
    _groups.add(group)
    group.start(n)
    return group


def stop(procs: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM every process still running, SIGKILL those that have not exited ``timeout`` s later."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.send_signal(signal.SIGCONT)  # a stopped (frozen) server takes the SIGTERM only once running
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
