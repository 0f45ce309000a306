"""Distillation's teacher on a server: the top-k logprobs a real SGLang or vLLM server gives for every
position of the student's sequences (``actor.teacher.url``; docs/distillation.md).

Each row's tokens (prompt + the student's completion, exactly as sampled) go to the server as a prompt
to score, nothing generated:

- **SGLang** ``POST /generate`` with ``input_ids``, ``max_new_tokens: 0``, ``return_logprob: true``,
  ``logprob_start_len: 0`` and ``top_logprobs_num: k``: ``meta_info.input_top_logprobs[t]`` is the top-k
  ``(logprob, id, text)`` of the distribution token ``t`` was drawn from (``None`` at ``t = 0``).
- **vLLM** ``POST /v1/completions`` with the ids as ``prompt``, ``max_tokens: 1`` and
  ``prompt_logprobs: k``: ``choices[0].prompt_logprobs[t]`` maps token ids to ``{"logprob", "rank"}``,
  the top-k plus the scored token itself (kept only when its rank is within k).

The answers become the batch keys a local teacher gives (``relayrl.train.distill``): ``teacher_logp
[B, L, k]`` and ``teacher_ids [B, L, k]``, token-aligned, zeros where the server gives nothing (the
first token, padding). A server's logprobs are at temperature 1; at another actor temperature they are
divided by it, which on the k tokens the KL renormalises over is exactly the tempered teacher there.
"""

from __future__ import annotations

import concurrent.futures
import functools

import httpx
import torch

from relayrl.api.engine import TensorDict


def _sglang_row(client: httpx.Client, url: str, ids: list[int], k: int) -> list[list[tuple[float, int]]]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": k,
    }
    r = client.post(f"{url}/generate", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"teacher {url}/generate answered {r.status_code}: {r.text[:300]}")
    positions = r.json()["meta_info"]["input_top_logprobs"]
    return [[(float(e[0]), int(e[1])) for e in (p or [])] for p in positions]


def _vllm_row(client: httpx.Client, url: str, ids: list[int], k: int, model: str) -> list[list[tuple[float, int]]]:
    body = {"model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": k, "temperature": 1.0}
    r = client.post(f"{url}/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"teacher {url}/v1/completions answered {r.status_code}: {r.text[:300]}")
    positions = r.json()["choices"][0]["prompt_logprobs"]
    return [
        sorted(((float(v["logprob"]), int(t)) for t, v in (p or {}).items() if int(v.get("rank") or k + 1) <= k),
               reverse=True)
        for p in positions
    ]  # fmt: skip


def _served_model(client: httpx.Client, url: str) -> str:
    r = client.get(f"{url}/v1/models")
    if r.status_code != 200 or not r.json().get("data"):
        raise RuntimeError(f"teacher {url}/v1/models answered {r.status_code}: {r.text[:300]}")
    return str(r.json()["data"][0]["id"])


@torch.no_grad()
def server_teacher_targets(
    batch: TensorDict,
    url: str,
    protocol: str,
    top_k: int,
    temperature: float,
    timeout: float = 300.0,
    token: str = "",
    workers: int = 8,
) -> TensorDict:
    """``teacher_logp`` / ``teacher_ids`` ``[B, L, top_k]`` for ``batch`` from the server at ``url``."""
    if top_k < 1:
        raise ValueError("a teacher on a server gives top-k logprobs: set actor.teacher.top_k >= 1")
    if protocol not in ("sglang", "vllm"):
        raise ValueError(f"actor.teacher.protocol must be sglang or vllm, got {protocol!r}")
    url = url if url.startswith(("http://", "https://")) else f"http://{url}"
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    b, length = ids.shape
    logp = torch.zeros(b, length, top_k)
    top_ids = torch.zeros(b, length, top_k, dtype=torch.long)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(timeout=timeout, headers=headers) as client:
        fetch = functools.partial(_vllm_row, model=_served_model(client, url)) if protocol == "vllm" else _sglang_row
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            rows = list(pool.map(lambda i: fetch(client, url, ids[i][mask[i]].tolist(), top_k), range(b)))
    for i, positions in enumerate(rows):
        n = int(mask[i].sum())
        if len(positions) != n:
            raise RuntimeError(f"teacher {url} scored {len(positions)} positions of a {n}-token sequence")
        for t, entries in enumerate(positions[:n]):
            if not entries:
                continue
            if len(entries) < top_k and t > 0:
                raise RuntimeError(f"teacher {url} gave {len(entries)} logprobs at position {t}, not top_k={top_k}")
            values, idx = zip(*entries[:top_k], strict=True)
            logp[i, t] = torch.tensor(values) / temperature
            top_ids[i, t] = torch.tensor(idx)
    return {"teacher_logp": logp, "teacher_ids": top_ids}
