"""Tools for agent workflows: a calculator and a restricted Python evaluator.

Both run the model's text in a fresh ``python -I`` subprocess that first lowers its own
limits (address space ``memory_mb``, CPU seconds), so a runaway expression cannot hurt the
trainer; the parent also kills it after ``timeout`` seconds of wall time. Code is checked
before it runs:

- ``calc``: arithmetic only (numbers, + - * / // % **, unary signs, parentheses); exponents
  are capped so ``9**9**9`` is refused rather than computed;
- ``python``: no imports, no dunder names or attributes, a small whitelist of builtins;
  the value of the last expression (or what was printed) is the result.

A tool never raises on bad input: it returns ``"error: ..."`` text for the model to read.
"""

from __future__ import annotations

import asyncio
import sys

# The child program: reads (mode, code) from stdin, sets limits, checks and runs the code.
_CHILD = r"""
import ast, io, json, resource, sys, contextlib
mode, code, mem, cpu = json.loads(sys.stdin.read())
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
ARITH = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div,
         ast.FloorDiv, ast.Mod, ast.Pow, ast.UAdd, ast.USub)
SAFE = {n: __builtins__.__dict__[n] if hasattr(__builtins__, "__dict__") else __builtins__[n] for n in
        ("abs", "min", "max", "sum", "len", "range", "round", "int", "float", "str", "bool", "list", "dict",
         "tuple", "set", "sorted", "enumerate", "zip", "map", "filter", "all", "any", "pow", "divmod", "print")}
def check(tree):
    for node in ast.walk(tree):
        if mode == "calc":
            if not isinstance(node, ARITH) or (isinstance(node, ast.Constant) and type(node.value) not in (int, float)):
                raise ValueError("only arithmetic is allowed")
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
                r = node.right
                if not (isinstance(r, ast.Constant) and abs(r.value) <= 64):
                    raise ValueError("exponents must be literal numbers <= 64")
        else:
            if isinstance(node, (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal)):
                raise ValueError("imports are not allowed")
            name = getattr(node, "id", None) or getattr(node, "attr", None) or ""
            if isinstance(name, str) and name.startswith("__"):
                raise ValueError(f"name {name!r} is not allowed")
try:
    if mode == "calc":
        tree = ast.parse(code.strip(), mode="eval"); check(tree)
        out = repr(eval(compile(tree, "<calc>", "eval"), {"__builtins__": {}}))
    else:
        tree = ast.parse(code); check(tree)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        env = {"__builtins__": SAFE}; buf = io.StringIO()
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
        import json

        payload = json.dumps([self.mode, code, self.memory_mb << 20, max(1, int(self.timeout) + 1)]).encode()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-S",
            "-c",
            _CHILD,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
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


def calculator(timeout: float = 2.0, memory_mb: int = 256) -> SubprocessTool:
    return SubprocessTool("calc", timeout, memory_mb)


def python_tool(timeout: float = 2.0, memory_mb: int = 256) -> SubprocessTool:
    return SubprocessTool("python", timeout, memory_mb)
