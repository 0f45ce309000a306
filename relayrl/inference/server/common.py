"""Helpers shared by the routes of ``relayrl serve``: errors, JSON replies, disk-path confinement.

Error bodies follow OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}`` (what the
OpenAI SDK and SGLang's OpenAI routes give; the SDK shows ``message``), plus ``detail`` (FastAPI's
key, which older clients of this server read).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, object]:
    """OpenAI's error object (``type`` the SDK's error class name, ``code`` the HTTP status)."""
    err = {"message": message, "type": _TYPES.get(status, "Error"), "param": param, "code": status}
    return {"error": err, "detail": message}


def _bad(msg: str, status: int = 400) -> HTTPException:
    return HTTPException(status_code=status, detail=msg)


def _path(loc: tuple[object, ...]) -> str:
    """``("body", "<batch>", "sampling_params", "<many>", 3, "top_p")`` -> ``sampling_params[3].top_p``
    (union tags ``<...>`` dropped)."""
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p != "body" and not str(p).startswith("<"):
            out += f".{p}" if out else str(p)
    return out


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    """One readable line per problem, naming the field: ``sampling_params.top_p: ...``."""
    assert isinstance(exc, RequestValidationError)
    msgs = []
    for err in exc.errors():
        loc = _path(err.get("loc", ()))
        if err.get("type") == "json_invalid":
            msgs.append(f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
        elif err.get("type") == "extra_forbidden":
            msgs.append(f"unknown field '{loc}'")
        else:
            msgs.append(f"{loc or 'body'}: {err.get('msg')} (got {str(err.get('input'))[:80]!r})")
    first = _path(exc.errors()[0].get("loc", ())) if exc.errors() else None
    return JSONResponse(status_code=400, content=error_body("; ".join(msgs), 400, first or None))


def confine_path(path: str, roots: list[str]) -> Path:
    """``path`` resolved (symlinks followed) if it lies inside one of ``roots``, else 403."""
    if not roots:
        raise _bad("loading weights from disk is disabled: the server has no allowed_weight_roots", 403)
    if "\x00" in path:
        raise _bad(f"model_path {path!r}: NUL characters are refused")
    if ".." in Path(path).parts:
        raise _bad(f"model_path {path!r}: '..' components are refused", 403)
    try:
        real = Path(path).resolve()
    except (OSError, RuntimeError) as e:  # e.g. a name too long for the OS
        raise _bad(f"model_path {path!r} cannot be resolved: {e}") from None
    if not any(real.is_relative_to(Path(r).resolve()) for r in roots):
        raise _bad(f"model_path {path!r} resolves outside the allowed weight roots", 403)
    try:
        is_dir = real.is_dir()
    except OSError as e:  # e.g. a name too long for the OS
        raise _bad(f"model_path {path!r} cannot be read: {e.strerror}") from None
    if not is_dir:
        raise _bad(f"model_path {path!r} is not a directory", 400)
    return real


def confine_file(path: Path, roots: list[str]) -> Path:
    """A file found inside an allowed root, by its real path (symlinks followed): 403 if that lies
    outside every root, 400 if it is not a regular file."""
    real = path.resolve()
    if not any(real.is_relative_to(Path(r).resolve()) for r in roots):
        raise _bad(f"model_path: {path.name} links outside the allowed weight roots", 403)
    if not real.is_file():
        raise _bad(f"model_path: {path.name} is not a regular file")
    return real


def _version(v: int | str | None) -> int | None:
    """A request's ``weight_version`` (SGLang sends a string; validated by pydantic or a query string)."""
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise _bad(f"weight_version must be an integer, got {v!r}") from None


def _per_item(value: object, n: int, field: str) -> list:
    """A batch field: one value per item (checked), or one value for all ``n`` items."""
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise _bad(f"{field}: {len(value)} values for {n} prompts (give one per prompt, or one for all)")
    return value


def _dumps(content: object) -> bytes:
    """Compact JSON; a non-finite float (a degenerate sampling setting can yield a -inf logprob)
    is written as null, as FastAPI's own encoder does, never as invalid JSON."""
    try:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except ValueError:
        return json.dumps(_finite(content), ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _finite(x: object) -> object:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def _json(content: object) -> Response:
    """A JSON reply written directly (no FastAPI encoder pass over every token and logprob)."""
    return Response(_dumps(content), media_type="application/json")


def trim_stop(text: str, stops: list[str], reason: str) -> str:
    """``text`` cut before the first stop string it holds if one ended it (``reason`` "stop"): SGLang's
    and vLLM's default, the stop string is not part of the output text; its tokens stay in ``output_ids``."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    return text if reason != "stop" or cut < 0 else text[:cut]
