"""The calculator and restricted Python evaluator run in limited subprocesses."""

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
    c = calculator(timeout=3.0)
    out = run(c("2*(3+4)"), c(" 7 // 2 + 2**10"), c("1/0"), c("9**9**9"), c("__import__('os').system('x')"), c("2+"))
    assert out[0] == "14" and out[1] == str(7 // 2 + 2**10)
    assert out[2] == "error: ZeroDivisionError: division by zero"
    assert out[3].startswith("error: ValueError: exponents")
    assert out[4] == "error: ValueError: only arithmetic is allowed"
    assert out[5].startswith("error: SyntaxError")


def test_python_tool_restrictions_and_limits():
    p = python_tool(timeout=1.5, memory_mb=128)
    t0 = time.monotonic()
    out = run(
        p("xs = [i * i for i in range(5)]\nsum(xs)"),
        p("print('a'); 3"),
        p("import os"),
        p("().__class__.__bases__"),
        p("open('/etc/passwd')"),
        p("while True: pass"),
        p("s = ' ' * (10**9)"),
    )
    assert out[0] == "30" and out[1] == "a\n3"
    assert out[2] == "error: ValueError: imports are not allowed"
    assert out[3].startswith("error: ValueError: name '__") and out[3].endswith("is not allowed")
    assert out[4] == "error: NameError: name 'open' is not defined"
    assert out[5] == "error: timed out after 1.5s"
    assert out[6] == "error: memory limit exceeded"
    assert time.monotonic() - t0 < 10


def test_bad_tool_config():
    with pytest.raises(ValueError, match="mode"):
        SubprocessTool("shell")
