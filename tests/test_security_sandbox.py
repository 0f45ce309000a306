"""Model-written code (``rollout.tool=python``) runs isolated: the escapes found in issue #38 reach
nothing of the trainer's (environment, files, network, processes), and where the machine cannot
isolate, the tool refuses with a reason instead of running the code unisolated."""

from __future__ import annotations

import asyncio
import os
import socket
import threading

import pytest

from relayrl.rollout import sandbox, tools
from relayrl.rollout.tools import python_tool

# The escape: a generator's running frame walks back to the child script's globals (os, sys).
ESCAPE = """
def g():
    yield x.gi_frame.f_back
x = g()
f = next(x)
while f.f_back is not None:
    f = f.f_back
os = f.f_globals["sys"].modules["os"]
"""


def run(*codes: str, **kw) -> list[str]:
    tool = python_tool(timeout=kw.get("timeout", 10.0), memory_mb=128)

    async def main():
        return await asyncio.gather(*(tool(c) for c in codes))

    return asyncio.run(main())


def test_escaped_code_sees_no_environment_files_network_or_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAYRL_TEST_SECRET", "hunter2")
    target = tmp_path / "pwned"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                accepted.append(listener.accept())
            except TimeoutError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        out = run(
            ESCAPE + "sorted(os.environ)",
            ESCAPE + f"os.system('touch {target}')",
            ESCAPE + f"open({str(target)!r}, 'w')",
            ESCAPE + f"import subprocess; subprocess.run(['/bin/sh', '-c', 'touch {target}'])",
            ESCAPE + f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)",
            ESCAPE + "[n for d in ('/root', '/home') if os.path.isdir(d) for n in os.listdir(d) if n != '.pyenv']",
            ESCAPE + "os.getuid()",
            "1 + 2 * 3",
        )
    finally:
        stop.set()
        t.join()
        listener.close()
    assert out[0] == "[]", out[0]  # the trainer's environment (tokens) is not inherited
    assert out[1] != "0" and not target.exists()  # no shell: no new processes
    assert out[2].startswith("error: ") and not target.exists()  # (/tmp is a private tmpfs in there)
    assert out[3].startswith("error: ") and not target.exists()
    assert "Network is unreachable" in out[4] and accepted == []
    assert out[5] == "[]"  # home directories hidden
    assert out[6] == "65534"  # user nobody
    assert out[7] == "7"


def test_format_field_walks_reach_nothing():
    out = run("'{0.gi_frame.f_back}'.format((lambda: (yield))())", "import os\nos.environ.get('HOME')")
    assert out[0] == "'None'" and out[1] == ""


def test_tool_refuses_where_the_machine_cannot_isolate(monkeypatch):
    monkeypatch.setattr(tools, "sandbox_unavailable", lambda: "no namespaces here")
    assert run("1 + 1") == ["error: the python tool cannot run on this machine: no namespaces here"]


def test_non_root_is_refused_with_a_reason(monkeypatch):
    sandbox.sandbox_unavailable.cache_clear()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    try:
        why = sandbox.sandbox_unavailable()
    finally:
        sandbox.sandbox_unavailable.cache_clear()
    assert why is not None and "needs root" in why


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root")
def test_sandbox_check_passes_here():
    assert sandbox.sandbox_unavailable() is None
