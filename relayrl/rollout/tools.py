"""Tools for agent workflows: a calculator and a Python evaluator for model-written code.

Both run the model's text in a fresh ``python -I -S`` child that lowers its own limits
(address space ``memory_mb``, CPU seconds, file size, no new processes) and is killed after
``timeout`` seconds of wall time. What the child may do is decided by isolation, not by
inspecting the code (model code walks past any denylist, e.g. through a generator's frame):

- ``calc``: arithmetic only (numbers, + - * / // % **, unary signs, parentheses), exponents
  capped so ``9**9**9`` is refused rather than computed. Runs in a plain child with an empty
  environment: the check is what keeps it to arithmetic.
- ``python``: any Python, in the sandbox of :mod:`relayrl.rollout.sandbox`; where the machine cannot
  build it the tool refuses to run and says why. The value of the last expression (or what was
  printed) is the result.

A tool never raises on bad input: it returns ``"error: ..."`` text for the model to read.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys

from relayrl.rollout.sandbox import sandbox_command, sandbox_unavailable

# The child program: reads (mode, code, limits) from stdin, sets limits, checks and runs the code.
_CHILD = r"""
import ast, io, json, os, resource, sys, contextlib
os.environ.clear()  # Python's own locale coercion (PEP 538) is all that could be in it
mode, code, mem, cpu, fsize = json.loads(sys.stdin.read())
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
ARITH = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div,
         ast.FloorDiv, ast.Mod, ast.Pow, ast.UAdd, ast.USub)
def check_calc(tree):
    for node in ast.walk(tree):
        if not isinstance(node, ARITH) or (isinstance(node, ast.Constant) and type(node.value) not in (int, float)):
            raise ValueError("only arithmetic is allowed")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            r = node.right
            if not (isinstance(r, ast.Constant) and abs(r.value) <= 64):
                raise ValueError("exponents must be literal numbers <= 64")
try:
    if mode == "calc":
        tree = ast.parse(code.strip(), mode="eval"); check_calc(tree)
        out = repr(eval(compile(tree, "<calc>", "eval"), {"__builtins__": {}}))
    else:
        tree = ast.parse(code)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        env = {"__name__": "__tool__"}; buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(tree, "<tool>", "exec"), env)
            value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), env) if last else None
        out = buf.getvalue() + ("" if value is None else repr(value))
except MemoryError:
    out = "error: memory limit exceeded"
except BaseException as e:
    out = f"error: {type(e).__name__}: {e}"
sys.stdout.write(out)
"""


class SubprocessTool:
    """``await tool(code) -> str``: run ``code`` in a limited subprocess (see module doc)."""

    def __init__(
        self, mode: str = "calc", timeout: float = 2.0, memory_mb: int = 256, max_output_chars: int = 256
    ) -> None:
        if mode not in ("calc", "python"):
            raise ValueError(f"tool mode must be 'calc' or 'python', got {mode!r}")
        if timeout <= 0 or memory_mb < 32:
            raise ValueError(f"tool needs timeout > 0 and memory_mb >= 32, got {timeout}, {memory_mb}")
        self.mode, self.timeout, self.memory_mb, self.max_output_chars = mode, timeout, memory_mb, max_output_chars

    async def __call__(self, code: str) -> str:
        limits = [self.memory_mb << 20, max(1, int(self.timeout) + 1), 1 << 20]
        payload = json.dumps([self.mode, code, *limits]).encode()
        argv = [sys.executable, "-I", "-S", "-c", _CHILD]
        if self.mode == "python":
            why = await asyncio.to_thread(sandbox_unavailable)  # checked once per process (~0.5 s)
            if why is not None:
                return f"error: the python tool cannot run on this machine: {why}"
            argv = sandbox_command(argv)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={},  # nothing of the trainer's environment (tokens, paths) reaches model-written code
            start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(payload), self.timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return f"error: timed out after {self.timeout}s"
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
            return f"error: {tail[0][:200]}"
        return out.decode(errors="replace")[: self.max_output_chars]


calculator = functools.partial(SubprocessTool, "calc")  # calculator(timeout=2.0, memory_mb=256)
python_tool = functools.partial(SubprocessTool, "python")
