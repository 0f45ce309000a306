"""How long `relayrl inspect` takes to open a 10,000-rollout run (goal: under a second).

A run directory is written with the trainer's own writer (``relayrl.utils.rollouts.RolloutWriter``)
from synthetic batches: ``--steps`` steps of ``--rollouts`` rollouts (GRPO groups of 8, long-tailed
completion lengths up to ``--max-len`` tokens, generator and trainer logprobs, advantages,
versions), plus a metrics.jsonl. Then:

- figure: seconds from navigation to the page showing its rollouts (``body[data-ready]``:
  manifest, curves, the last step's rollouts rendered), in headless Chromium against a real
  ``relayrl inspect`` server, median of ``--repeats`` fresh pages;
- eager_ratio: reading and parsing every step file (what a viewer without the index and lazy steps
  would do) ÷ what opening reads (the manifest and one step), in this process.

    python bench/inspect_load.py [--steps 40] [--rollouts 250] [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import write_result

from relayrl.data.models import build_tokenizer
from relayrl.inspector.data import manifest_script, step_script
from relayrl.inspector.headless import CHROMIUM, chromium
from relayrl.utils.rollouts import RolloutWriter, read_index, step_file


def synthetic_batch(step: int, n: int, max_len: int, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``n`` rollouts as the trainer holds them after ``compute_advantages`` (prompt of 12 tokens)."""
    prompt = 12
    lengths = (torch.rand(n, generator=gen) ** 3 * (max_len - 4)).long() + 4  # long-tailed
    width = prompt + int(lengths.max())
    pos = torch.arange(width)[None]
    attn = pos < (prompt + lengths)[:, None]
    loss = attn & (pos >= prompt)
    logp = -torch.rand(n, width, generator=gen) * 3 * loss
    rewards = (torch.rand(n, generator=gen) < 0.4).float()
    group = torch.arange(n) // 8
    mean = torch.zeros(n).index_add_(0, group, rewards) / torch.bincount(group).float()[group]
    return {
        "input_ids": torch.randint(5, vocab, (n, width), generator=gen) * attn,
        "attention_mask": attn,
        "loss_mask": loss.long(),
        "logprobs": logp,
        "prox_logp": logp + torch.randn(n, width, generator=gen) * 0.01 * loss,
        "versions": torch.where(loss, (step - 1 - (torch.rand(n, width, generator=gen) < 0.2).long()).clamp(min=0), -1),
        "advantages": ((rewards - mean)[:, None] * loss).float(),
        "rewards": rewards,
        "group_id": group + step * 1000,
        "truncated": lengths == max_len - 1,
    }


def write_run(run_dir: Path, steps: int, n: int, max_len: int) -> int:
    tok = build_tokenizer()
    writer = RolloutWriter(run_dir, tok)
    gen = torch.Generator().manual_seed(0)
    with (run_dir / "metrics.jsonl").open("w") as fh:
        for step in range(1, steps + 1):
            batch = synthetic_batch(step, n, max_len, len(tok), gen)
            writer.write(step, batch, n)
            fh.write(json.dumps({"step": step, "rollout/reward": float(batch["rewards"].mean())}) + "\n")
    return steps * n


def parse_seconds(run_dir: Path) -> tuple[float, float]:
    """(open: manifest + last step, eager: every step file parsed)."""
    t0 = time.perf_counter()
    steps = read_index(run_dir)
    manifest_script([run_dir])
    step_script([run_dir], 0, int(str(steps[-1]["step"])))
    lazy = time.perf_counter() - t0
    t0 = time.perf_counter()
    for entry in read_index(run_dir):
        [json.loads(line) for line in step_file(run_dir, int(str(entry["step"]))).read_text().splitlines()]
    return lazy, time.perf_counter() - t0


def browser_seconds(run_dir: Path, repeats: int) -> list[float]:
    server = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", "inspect", str(run_dir), "--port", "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        url = re.search(r"http://\S+/", server.stdout.readline())
        assert url, "relayrl inspect printed no URL"
        out = []
        with chromium() as ctx:
            for _ in range(repeats + 1):  # the first warms Chromium up and is not counted
                page = ctx.new_page()
                t0 = time.perf_counter()
                page.goto(url.group(0))
                page.wait_for_selector("body[data-ready='1']", timeout=60_000)
                out.append(time.perf_counter() - t0)
                page.close()
        return out[1:]
    finally:
        server.terminate()
        server.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rollouts", type=int, default=250, help="rollouts per step")
    ap.add_argument("--max-len", type=int, default=256, help="longest completion (tokens)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="4 steps, 2 repeats (smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.repeats = 4, 2
    run_dir = Path(tempfile.mkdtemp(prefix="relayrl-inspect-bench-"))
    try:
        t0 = time.perf_counter()
        total = write_run(run_dir, args.steps, args.rollouts, args.max_len)
        write_s = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in (run_dir / "rollouts").iterdir())
        lazy, eager = zip(*(parse_seconds(run_dir) for _ in range(args.repeats)), strict=True)
        result: dict = {
            "name": "inspect",
            "rollouts": total,
            "steps": args.steps,
            "bytes_per_rollout": round(size / total),
            "write_seconds_per_step": round(write_s / args.steps, 4),
            "server_open_s": round(statistics.median(lazy), 4),
            "eager_parse_s": round(statistics.median(eager), 4),
            "eager_ratio": round(statistics.median(eager) / statistics.median(lazy), 2),
        }
        if Path(CHROMIUM).exists():
            seconds = browser_seconds(run_dir, args.repeats)
            result["figure"] = round(statistics.median(seconds), 3)
            result["browser_open_s"] = [round(s, 3) for s in seconds]
        else:
            result["figure"] = None
            result["note"] = f"{CHROMIUM} missing: no browser figure (apt-get install chromium)"
        print(
            f"{total} rollouts ({result['bytes_per_rollout']} B each): page shows them in "
            f"{result['figure']} s (median); opening reads {result['server_open_s']} s of data vs "
            f"{result['eager_parse_s']} s to parse every step ({result['eager_ratio']}x)",
            flush=True,
        )
        write_result(result, quick=args.quick)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
