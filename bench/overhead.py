"""Framework overhead: the share of an RL step spent outside model forward / backward /
optimizer / generation.

The grpo_vs_trl run (``common.RL``, synchronous, colocated, one torch thread) with clocks
around the model's compute, installed by patching the classes in the benchmark process:

- generation: ``LocalEngine._step`` (relayrl: admission, prefill, decode step, sampling) or
  ``GenerationMixin.generate`` (TRL: HF generate);
- forward: ``Qwen2ForCausalLM.forward`` (training / logprob forwards);
- backward: ``torch.Tensor.backward``; optimizer: ``AdamW.step``.

Nested calls count once (a forward inside generate is generation). Everything else in the
training loop is overhead: scheduling rollouts, rewards, assembling and packing batches,
log-softmax and loss math, advantages, weight hand-over, logging. overhead share =
1 - compute seconds / loop wall seconds, median over repeats; TRL's share is measured the
same way for reference, and relayrl's ``timing/*`` phases say where the rest goes.

    python bench/overhead.py [--repeats 3] [--steps 20] [--task arithmetic|count] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

import common
import torch


class ComputeClock:
    """Seconds spent inside wrapped methods, by kind; only the outermost wrapped call counts."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self._local = threading.local()

    def wrap(self, owner: type, name: str, kind: str) -> None:
        orig = getattr(owner, name)
        clock = self

        @functools.wraps(orig)
        def timed(*args: object, **kwargs: object) -> object:
            if getattr(clock._local, "busy", False):
                return orig(*args, **kwargs)
            clock._local.busy = True
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                clock.seconds[kind] += time.perf_counter() - t0
                clock._local.busy = False

        setattr(owner, name, timed)


def install() -> ComputeClock:
    from transformers import GenerationMixin
    from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM, Qwen2Model

    from relayrl.inference.local import LocalEngine

    clock = ComputeClock()
    clock.wrap(LocalEngine, "_step", "generation")
    clock.wrap(GenerationMixin, "generate", "generation")
    clock.wrap(Qwen2ForCausalLM, "forward", "forward")
    clock.wrap(Qwen2Model, "forward", "forward")  # TRL calls the base model and lm_head itself
    clock.wrap(torch.Tensor, "backward", "backward")
    clock.wrap(torch.optim.AdamW, "step", "optimizer")
    return clock


def measure_relayrl(ckpt: str, seed: int, steps: int, task: str = "arithmetic") -> dict:
    from relayrl.api.config import RunConfig, load_config
    from relayrl.trainer import Trainer

    torch.set_num_threads(1)
    clock = install()
    run_dir = common.CACHE / f"overhead-{task}" / f"relayrl-{seed}"
    cfg = load_config(RunConfig, None, common.relayrl_overrides(Path(ckpt), run_dir, seed, steps, task))
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    train, held_out = common.rl_rows(task, seed)  # the TRL side's prompts, step for step
    trainer = Trainer(cfg, train_rows=train, eval_rows=held_out)
    clock.seconds.clear()
    t0 = time.perf_counter()
    try:
        trainer.fit()
        wall = time.perf_counter() - t0
    finally:
        trainer.close()
    rows = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_seconds" in r]
    phases = {
        k.removeprefix("timing/"): statistics.mean(r.get(k, 0.0) for r in rows)
        for k in sorted({k for r in rows for k in r if k.startswith("timing/")})
    }
    return {"wall": wall, "compute": dict(clock.seconds), "phases": phases}


def measure_trl(ckpt: str, seed: int, steps: int, task: str = "arithmetic") -> dict:
    import grpo_vs_trl

    clock = install()
    res = grpo_vs_trl.run_trl(
        ckpt, str(common.CACHE / f"overhead-{task}" / f"trl-{seed}"), seed, steps, evaluate_after=False, workload=task
    )
    return {"wall": res["seconds"], "compute": dict(clock.seconds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--task",
        default="arithmetic",
        choices=sorted(common.WORKLOADS),
        help="the grpo_vs_trl workload (result: overhead_<task> unless arithmetic)",
    )
    ap.add_argument("--quick", action="store_true", help="1 repeat of 3 steps (smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.steps = 1, 3
    torch.set_num_threads(1)
    ckpt = str(common.warm_start(args.quick, workload=args.task))
    runs: dict[str, list[dict]] = {"relayrl": [], "trl": []}
    for r in range(args.repeats):
        for name, fn in (("relayrl", measure_relayrl), ("trl", measure_trl)):
            res = common.in_child(fn, ckpt, r, args.steps, args.task)
            res["share"] = 1.0 - sum(res["compute"].values()) / res["wall"]
            runs[name].append(res)
        print(
            f"repeat {r}: overhead share relayrl {runs['relayrl'][-1]['share']:.1%}, TRL {runs['trl'][-1]['share']:.1%}",
            flush=True,
        )

    def per_step(name: str) -> dict[str, float]:
        rs = runs[name]
        kinds = sorted({k for x in rs for k in x["compute"]})
        out = {k: statistics.median(x["compute"].get(k, 0.0) / args.steps for x in rs) for k in kinds}
        out["overhead"] = statistics.median((x["wall"] - sum(x["compute"].values())) / args.steps for x in rs)
        out["step"] = statistics.median(x["wall"] / args.steps for x in rs)
        return {k: round(v, 4) for k, v in out.items()}

    rel = common.spread([x["share"] for x in runs["relayrl"]])
    trl = common.spread([x["share"] for x in runs["trl"]])
    phases = runs["relayrl"][len(runs["relayrl"]) // 2]["phases"]
    common.write_result(
        {
            "name": "overhead" if args.task == "arithmetic" else f"overhead_{args.task}",
            "task": args.task,
            "figure": rel["median"],
            "figure_is": "relayrl: share of a step outside model compute",
            "ratio_min": rel["min"],
            "ratio_max": rel["max"],  # spread of the figure (the table reads these keys)
            "relayrl_share": rel,
            "trl_share": trl,
            "relayrl_s_per_step": per_step("relayrl"),
            "trl_s_per_step": per_step("trl"),
            "relayrl_phases_s_per_step": {k: round(v, 4) for k, v in phases.items()},
            "settings": {
                **common.RL,
                "max_new_tokens": common.WORKLOADS[args.task]["max_new_tokens"],
                "steps": args.steps,
                "repeats": args.repeats,
                "compute": "LocalEngine._step / GenerationMixin.generate, Qwen2ForCausalLM.forward, Tensor.backward, AdamW.step",
            },
        },
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
