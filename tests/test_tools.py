"""The calculator and the Python tool run in limited subprocesses (isolation: tests/test_security_sandbox.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from relayrl.rollout.tools import SubprocessTool, calculator, python_tool


def run(*coros):
    async def main():
        return await asyncio.gather(*coros)

    return asyncio.run(main())


def test_calculator_arithmetic_and_refusals():
    c = calculator(timeout=60.0)  # none of these may time out: the child starts within it however loaded
    out = run(c("2*(3+4)"), c(" 7 // 2 + 2**10"), c("1/0"), c("9**9**9"), c("__import__('os').system('x')"), c("2+"))
    assert out[0] == "14" and out[1] == str(7 // 2 + 2**10)
    assert out[2] == "error: ZeroDivisionError: division by zero"
    assert out[3].startswith("error: ValueError: exponents")
    assert out[4] == "error: ValueError: only arithmetic is allowed"
    assert out[5].startswith("error: SyntaxError")


def test_python_tool_runs_code_isolated_and_limited():
    p = python_tool(timeout=20.0, memory_mb=128)
    spin = python_tool(timeout=1.5, memory_mb=128)
    t0 = time.monotonic()
    out = run(
        p("xs = [i * i for i in range(5)]\nsum(xs)"),
        p("print('a'); 3"),
        p("import math\nmath.factorial(5)"),
        p("open('notes', 'w').write('hi'); open('notes').read()"),
        p("open('/etc/passwd', 'a')"),
        spin("while True: pass"),
        p("s = ' ' * (10**9)"),
    )
    assert out[0] == "30" and out[1] == "a\n3" and out[2] == "120"
    assert out[3] == "'hi'"  # the scratch directory is writable
    assert "Permission denied" in out[4] or "Read-only file system" in out[4], out[4]
    assert out[5] == "error: timed out after 1.5s"
    assert out[6] == "error: memory limit exceeded"
    assert time.monotonic() - t0 < 60


def test_bad_tool_config():
    with pytest.raises(ValueError, match="mode"):
        SubprocessTool("shell")
