"""Asynchronous vs synchronous RL with a separate inference server: wall-time ratio.

The same GRPO run (``common.RL``: same SFT-warmed model, task, prompts per step, group size,
completion length, lr; 30 steps in both modes, so the same number of trained samples) with generation in one
``relayrl serve`` process and training in the trainer process, one torch thread each:

- sync: ``rollout.max_staleness=0``, ``actor.loss=ppo`` with the generator's logprobs as the
  old policy (``actor.recompute_logp=false``, the default);
- async: ``rollout.max_staleness=2`` (eta) and the same loss: the clip is a trust region
  around the policy that generated each token, however stale; the executor keeps generating
  while the trainer trains. (``actor.loss=decoupled_ppo`` at one optimizer step per batch has
  no trust region and collapses here: ``--async-loss decoupled_ppo`` measures it.)

ratio = sync wall seconds / async wall seconds of ``Trainer.fit`` (server start-up and model
loading excluded). Each run launches a fresh server of the checkpoint
(``inference.backend=remote``, ``inference.n_servers=1``, ``inference.server_threads=1``);
repeats alternate the modes. Pinned runs put the trainer process on one core and the server on
the other (``os.sched_setaffinity`` of every thread), as separate devices would be; unpinned
runs let them compete for both cores with each other's helper threads and any other load.
``ratio`` is the pinned figure, ``ratio_unpinned`` the other (``--pin both``, the default). Also reported: the reward reached (last-5-step training reward
and held-out sampled accuracy of the final policy), the staleness actually seen, and the
phase timings (``timing/*`` from metrics.jsonl) that explain the ratio. Goal (pinned): ratio >=
0.9 x the overlap ceiling measured in the same run.

    python bench/async_vs_sync.py [--repeats 3] [--steps 30] [--task arithmetic|count] [--pin both|on|off] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics

import common
import torch

ETA = 2


def run_mode(
    ckpt: str, mode: str, seed: int, steps: int, task: str = "arithmetic", pin: bool = False, async_loss: str = "ppo"
) -> dict:
    """One run; the trainer launches its own ``relayrl serve`` process of the checkpoint."""
    where = f"{mode}-{seed}" + ("-pinned" if pin else "")
    overrides = common.relayrl_overrides(ckpt, common.CACHE / f"async_vs_sync-{task}" / where, seed, steps, task)
    overrides += ["inference.backend=remote", "inference.n_servers=1", "inference.server_threads=1"]
    if mode == "async":
        overrides += [f"rollout.max_staleness={ETA}", f"actor.loss={async_loss}"]
    return common.run_relayrl(overrides, pin=pin)


def phases(steps: list[dict]) -> dict[str, float]:
    """Mean seconds per step of each ``timing/*`` phase and of the whole step (first step excluded)."""
    rows = steps[1:] or steps
    keys = sorted({k for s in rows for k in s if k.startswith("timing/")} | {"perf/step_seconds"})
    return {k.removeprefix("timing/"): round(statistics.mean(s.get(k, 0.0) for s in rows), 4) for k in keys}


def ceiling(sync_run: dict) -> float:
    """Perfect overlap hides the shorter of (generation, trainer-side work) of a sync step: the best any overlap can do."""
    ph = sync_run["phases"]
    return ph["perf/step_seconds"] / max(ph["rollout"], ph["perf/step_seconds"] - ph["rollout"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--steps", type=int, default=30, help="fewer than grpo_vs_trl's 40: server runs are ~6x slower per step"
    )
    ap.add_argument(
        "--task",
        default="arithmetic",
        choices=sorted(common.WORKLOADS),
        help="the grpo_vs_trl workload (result: async_vs_sync_<task> unless arithmetic)",
    )
    ap.add_argument(
        "--pin",
        default="both",
        choices=["both", "on", "off"],
        help="pin trainer and server to separate cores (on), share both cores (off), or run each way (both)",
    )
    ap.add_argument("--async-loss", default="ppo", choices=["ppo", "decoupled_ppo"], help="the async side's loss")
    ap.add_argument("--quick", action="store_true", help="1 repeat of 3 steps (smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.steps = 1, 3
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    ckpt = str(common.warm_start(args.quick, workload=args.task))
    pins = {"both": (True, False), "on": (True,), "off": (False,)}[args.pin]
    runs: dict[tuple[bool, str], list[dict]] = {(p, m): [] for p in pins for m in ("sync", "async")}
    for r in range(args.repeats):
        for pin in pins:
            for mode in ("sync", "async"):
                res = common.in_child(run_mode, ckpt, mode, r, args.steps, args.task, pin, args.async_loss)
                res["phases"] = phases(res.pop("steps"))
                runs[(pin, mode)].append(res)
            s, a = runs[(pin, "sync")][-1], runs[(pin, "async")][-1]
            print(
                f"repeat {r} {'pinned' if pin else 'unpinned'}: sync {s['seconds']:.1f}s (reward "
                f"{common.tail_mean(s['rewards']):.3f}, held-out {s['accuracy']:.3f}) | async {a['seconds']:.1f}s (reward "
                f"{common.tail_mean(a['rewards']):.3f}, held-out {a['accuracy']:.3f}) | ratio {s['seconds'] / a['seconds']:.2f} "
                f"(ceiling {ceiling(s):.2f})",
                flush=True,
            )

    def side(pin: bool, name: str) -> dict:
        rs = runs[(pin, name)]
        return {
            "seconds": common.spread([x["seconds"] for x in rs]),
            "samples_per_s": common.spread([x["samples_per_s"] for x in rs]),
            "final_reward": common.spread([common.tail_mean(x["rewards"]) for x in rs]),
            "held_out_accuracy": common.spread([x["accuracy"] for x in rs]),
            "phases_s_per_step": rs[len(rs) // 2]["phases"],
            "samples": rs[0]["samples"],
        }

    out: dict = {}
    for pin in pins:
        tag = "" if pin or len(pins) == 1 else "_unpinned"
        ratios = common.spread(
            [s["seconds"] / a["seconds"] for s, a in zip(runs[(pin, "sync")], runs[(pin, "async")], strict=True)]
        )
        ceil = common.spread([ceiling(x) for x in runs[(pin, "sync")]])
        out.update(
            {
                f"ratio{tag}": ratios["median"],
                f"ratio_min{tag}": ratios["min"],
                f"ratio_max{tag}": ratios["max"],
                f"ratios{tag}": ratios["values"],
                f"overlap_ceiling{tag}": ceil,
                f"ratio_of_ceiling{tag}": round(ratios["median"] / ceil["median"], 4),
                f"sync{tag}": side(pin, "sync"),
                f"async{tag}": side(pin, "async"),
            }
        )
    if pins[0]:
        out["goal_met"] = out["ratio_of_ceiling"] >= 0.9
    common.write_result(
        {
            "name": ("async_vs_sync" if args.task == "arithmetic" else f"async_vs_sync_{args.task}")
            + ("" if args.async_loss == "ppo" else f"_{args.async_loss}"),
            "task": args.task,
            "pinned": pins[0],
            **out,
            "goal": "pinned (trainer and server on separate cores, as separate devices): sync wall time / async wall time "
            ">= 0.9 x the overlap ceiling measured in the same run",
            "overlap_ceiling_is": "sync step / max(sync rollout phase, rest of the sync step): the best any overlap can do",
            "settings": {
                **common.RL,
                "max_new_tokens": common.WORKLOADS[args.task]["max_new_tokens"],
                "steps": args.steps,
                "repeats": args.repeats,
                "eta": ETA,
                "servers": 1,
                "server_threads": 1,
                "trainer_threads": 1,
                "weight_sync": "http upload (safetensors)",
                "sync": "max_staleness=0, loss=ppo, recompute_logp=false",
                "async": f"max_staleness={ETA}, loss={args.async_loss}, recompute_logp=false",
            },
        },
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
