"""Two ways to attend over one shared-prefix tree (relayrl.train.prefix), forward + backward, one CPU thread:
"concat" (what relayrl does: each segment's queries over the prefix's keys/values concatenated before its
own, one SDPA call on ``[n, H, W, D]`` x ``[n, H_kv, P + W, D]``) against "tree mask" (one SDPA call over
the whole tree document ``P + n W`` with a boolean tree-shaped mask). SmolLM2-135M's attention widths
(9 heads, 3 KV heads, head dim 64).

    python bench/tree_attention.py     # prints one JSON line per shape
"""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F

H, KV, D = 9, 3, 64


def concat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: int, n: int, w: int) -> torch.Tensor:
    seg = torch.arange(p, p + n * w).view(n, w)
    kidx = torch.cat([torch.arange(p).expand(n, -1), seg], 1)
    pos_k = torch.cat([torch.arange(p), p + torch.arange(w)])
    mask = pos_k[None, :] <= (p + torch.arange(w))[:, None]
    qs, ks, vs = q[:, seg].transpose(0, 1), k[:, kidx].transpose(0, 1), v[:, kidx].transpose(0, 1)
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
    pre = F.scaled_dot_product_attention(
        q[None, :, :p], k[None, :, :p], v[None, :, :p], is_causal=True, enable_gqa=True
    )
    return torch.cat([pre[0], out.transpose(0, 1).reshape(H, n * w, D)], 1)


def tree_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: int, n: int, w: int) -> torch.Tensor:
    t = p + n * w
    doc = torch.cat([torch.full((p,), -1), torch.arange(n).repeat_interleave(w)])
    i = torch.arange(t)
    mask = (i[None, :] <= i[:, None]) & ((doc[None, :] == -1) | (doc[None, :] == doc[:, None]))
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]


def timed(fn, p: int, n: int, w: int, reps: int) -> float:  # noqa: ANN001
    g = torch.Generator().manual_seed(0)
    t = p + n * w
    q, k, v = (torch.randn(h, t, D, generator=g, requires_grad=True) for h in (H, KV, KV))
    fn(q, k, v, p, n, w).sum().backward()  # warm-up
    start = time.process_time()
    for _ in range(reps):
        fn(q, k, v, p, n, w).sum().backward()
    return (time.process_time() - start) / reps * 1e3


def main() -> None:
    torch.set_num_threads(1)
    for p, n, w, reps in ((35, 8, 9, 200), (200, 8, 128, 20), (200, 8, 500, 5)):
        a, b = timed(concat, p, n, w, reps), timed(tree_mask, p, n, w, reps)
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(h, p + n * w, D, generator=g) for h in (H, KV, KV))
        err = float((concat(q, k, v, p, n, w) - tree_mask(q, k, v, p, n, w)).abs().max())
        shape = {"prefix": p, "segments": n, "segment_len": w}
        print(json.dumps({**shape, "concat_ms": round(a, 3), "tree_mask_ms": round(b, 3), "max_diff": err}))


if __name__ == "__main__":
    main()
