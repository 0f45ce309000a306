"""GRPO samples/s: relayrl ÷ TRL ``GRPOTrainer`` on the same work, same run, on CPU.

Two workloads (``--task``; ``common.WORKLOADS``), each from its own SFT-warmed checkpoint of
the same ~0.6M Qwen2-style model (``common.warm_start``):

- ``count`` (``bench/results/grpo_vs_trl_count.json``, the headline): "Count to 34700 from
  34696:" -> "34696 34697 34698 34699 34700", exact match. Completion lengths are log-normal
  (median 36 tokens, mean ~49, 90th percentile ~100, longest correct one 180; cap 192), the
  long tail of chain-of-thought rollouts: HF ``generate`` keeps every row until the longest
  finishes and TRL trains on rows padded to the longest, where relayrl's LocalEngine drops
  finished rows and its trainer packs documents. 12 steps.
- ``arithmetic`` (``grpo_vs_trl.json``): 2-digit addition, completions of 3-5 tokens, all about
  the same length: nothing for continuous batching or packing to save, so both sides are bound
  by the same forward/backward compute. 40 steps.

Both sides run the same GRPO: ``RL`` in ``bench/common.py`` (prompts per step, group size =
TRL ``num_generations``, max completion length, temperature 1, top_k off, top_p 1, lr,
constant schedule, clip 0.2, grad clip 1, no KL, group-std advantages, token-mean loss over the
batch, one optimizer step per batch) with the same reward function (``task_reward_fn(task)``).

Sides (``--sides``, default ``relayrl,trl``; each run in its own process, order rotated
between repeats, seed = repeat; both sides read the training rows in the same order,
``common.rl_rows``, so every step trains on the same prompts):

- ``relayrl``: ``Trainer`` synchronous (eta = 0), colocated ``LocalEngine``, one torch thread;
  the ratio's old policy is the generator's logprobs (``actor.recompute_logp=false``), like
  TRL's single-iteration path. The reward fn runs on the RLVR workflow's reward thread, as
  ``relayrl train`` does. The headline ``ratio`` is relayrl ÷ ``trl``.
- ``relayrl_inline``: the same with ``RLVRWorkflow(reward_timeout=None)``, the reward fn
  called inline as TRL does.
- ``relayrl_async``: eta = 1 (``rollout.max_staleness=1``), the same PPO loss on the
  generator's logprobs: the engine thread generates the next batch while the main thread
  trains, so up to two threads compute at once (one torch thread each). Compared with
  ``trl_2threads`` (``ratio_async_vs_trl_2threads``) as well as ``trl``.
- ``trl``: ``GRPOTrainer`` with its fastest CPU settings for this work: fp32 (no bf16
  autocast on CPU), no gradient checkpointing (TRL's default is on), the whole generation batch
  in one forward/backward (``per_device_train_batch_size = prompts * group``, no
  accumulation), ``num_iterations=1`` and ``steps_per_generation=1`` (no old-logprob pass),
  ``beta=0`` (no reference model), HF ``generate`` with KV cache (transformers' continuous
  batching measured slower here; ``--trl-cb`` to try it), ``loss_type="dapo"`` (token mean
  over the batch, as relayrl's ``token-mean``), no logging sinks, no checkpoints; one torch thread.
- ``trl_2threads``: the same with ``torch.set_num_threads(2)`` and ``OMP_WAIT_POLICY=PASSIVE``
  (OpenMP's default spin-waiting at every op's barrier made it 10-17x slower than one thread
  on the shared 2-core machine: 134 s vs 7.6 s for 3 steps; passive: 8.2 s).

samples/s = trained samples / wall seconds of the training loop (``Trainer.fit`` /
``GRPOTrainer.train``; model loading excluded on both sides). Also the CPU seconds per sample
of each side (all threads; less sensitive to a busy machine than wall time), relayrl's phase
seconds per step (``timing/*``), mean and per-step longest completion lengths, and the reward
reached: the mean training reward of the last 5 steps and held-out sampled accuracy (4 samples
per prompt, 200 prompts) of each final policy, scored by the same evaluator.

Sampling seeds (``--sampling-seeds 11,12,...``): one run per sampling seed on the prompts of
``--first-seed`` (the same training rows in the same order), to tell an unlucky sample path from
a defect: relayrl's ``inference.seed`` (LocalEngine's sampling stream; the run's ``seed`` stays
``--first-seed``) and TRL's ``seed`` (its sampling; its prompts are ``common.rl_rows``' order, not
shuffled). ``--doctor-every N`` has relayrl's runs save ``relayrl doctor`` records every N steps
(``logging.doctor_every``; the last 3 kept) and puts the doctor's verdict on each run's recorded
steps in the result (``doctor``). ``--warm-start DIR`` starts both sides from another checkpoint
(e.g. SmolLM2-135M-Instruct: ``--tag smollm2``; ``--eval-rows 8`` keeps its held-out scoring short).

The same work on both sides: both load the checkpoint's own tokenizer (``common.checkpoint_tokenizer``,
what relayrl's Trainer loads; SmolLM2's ChatML one, never the bench's character tokenizer) and stop
completions on the same token ids, the model's generation-config EOS (``common.stop_token_ids``, what
LocalEngine stops on; SmolLM2: ``<|im_end|>``): the TRL side raises if ``GRPOTrainer`` would stop on
any other set. Each side records its stop ids, mean completion length, trained tokens per step
(relayrl: the packed positions, ``actor/n_tokens``; TRL: the padded ``[B, L]`` positions of its
training forwards, and the real tokens among them) and peak RSS (its own process). When the mean
completion lengths differ by more than 10% (``LENGTH_TOLERANCE``) the result has no ``ratio`` (the
measured one is kept as ``ratio_unmatched``, with a warning on stderr): the sides did different work.

    python bench/grpo_vs_trl.py [--task count|arithmetic] [--repeats 3] [--steps N] [--sides a,b] [--tag T] [--quick]
    python bench/grpo_vs_trl.py --task count --sides relayrl,relayrl_async,trl,trl_2threads --tag async
    python bench/grpo_vs_trl.py --task count --first-seed 2 --sampling-seeds 11,12,13,14,15,16,17 --tag sampling
    python bench/grpo_vs_trl.py --warm-start ~/.cache/relayrl/models/smollm2-135m-instruct --steps 2 --repeats 1 \
        --eval-rows 8 --tag smollm2
    python bench/grpo_vs_trl.py --task count --warm-start ~/.cache/relayrl/models/smollm2-135m-instruct --steps 2 \
        --repeats 1 --eval-rows 4 --prompts-per-step 4 --tag smollm2   # TRL's padded step fits in 23 GB
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import common
import torch


def run_trl(
    ckpt: str,
    run_dir: str,
    seed: int,
    steps: int,
    continuous_batching: bool = False,
    evaluate_after: bool = True,
    workload: str = "arithmetic",
    threads: int = 1,
    sampling_seed: int | None = None,
    eval_rows: int = 0,
) -> dict:
    """One TRL GRPOTrainer run with the ``common.RL`` settings on the prompts of run ``seed``, sampling
    with ``sampling_seed`` (default ``seed``); wall time of ``train()``.

    The checkpoint's own tokenizer (as relayrl's Trainer loads it), and TRL must stop completions on
    exactly the token ids LocalEngine stops on (``common.stop_token_ids``): it raises otherwise."""
    torch.set_num_threads(threads)
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from relayrl.rewards.tasks import task_reward_fn

    rl, w = common.RL, common.WORKLOADS[workload]
    reward_fn = task_reward_fn(w["task"]["name"])

    def task_reward(prompts: list, completions: list, completion_ids: list, answer: list, **_: object) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [
            float(reward_fn(prompt="", completions=t, prompt_ids=[], completion_ids=ids, answer=a))
            for t, ids, a in zip(texts, completion_ids, answer, strict=True)
        ]

    train, held_out = common.rl_rows(workload, seed)  # the prompts of each step are relayrl's
    dataset = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in train])
    n = rl["prompts_per_step"] * rl["group_size"]
    args = GRPOConfig(
        output_dir=run_dir,
        seed=seed if sampling_seed is None else sampling_seed,
        max_steps=steps,
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        num_generations=rl["group_size"],
        max_completion_length=w["max_new_tokens"],
        temperature=rl["temperature"],
        top_p=rl["top_p"],
        top_k=rl["top_k"],
        learning_rate=rl["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=rl["weight_decay"],
        adam_beta1=rl["adam"][0],
        adam_beta2=rl["adam"][1],
        adam_epsilon=rl["adam"][2],
        max_grad_norm=rl["grad_clip"],
        beta=rl["kl_coef"],
        epsilon=rl["eps_clip"],
        num_iterations=1,
        steps_per_generation=1,
        loss_type="dapo",
        scale_rewards="group",
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        use_transformers_continuous_batching=continuous_batching,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
        shuffle_dataset=False,
    )
    model = common.load_warm(Path(ckpt))
    tokenizer = common.checkpoint_tokenizer(Path(ckpt))
    stop_ids = common.stop_token_ids(model, tokenizer)  # before TRL / transformers touch the model's config
    trainer = GRPOTrainer(
        model=model, reward_funcs=task_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trl_stop = sorted(set(trainer.eos_token_ids) | set(_ids(trainer.generation_config.eos_token_id)))
    if trl_stop != stop_ids:  # e.g. a tokenizer whose eos differs from the model's end of turn
        raise RuntimeError(f"TRL would stop on {trl_stop}, relayrl's LocalEngine on {stop_ids}: not the same work")
    positions = [0, 0]  # [padded positions, real tokens] of the training forwards (grad on; generation is no_grad)

    def count(_mod, _args, kwargs):  # noqa: ANN001, ANN202
        if torch.is_grad_enabled() and kwargs.get("input_ids") is not None:
            positions[0] += kwargs["input_ids"].numel()
            mask = kwargs.get("attention_mask")
            positions[1] += int(mask.sum()) if mask is not None else kwargs["input_ids"].numel()

    hook = trainer.model.register_forward_pre_hook(count, with_kwargs=True)
    c0, t0 = common.cpu_seconds(), time.perf_counter()
    trainer.train()
    seconds, cpu = time.perf_counter() - t0, common.cpu_seconds() - c0
    hook.remove()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    acc = (
        common.held_out_accuracy(trainer.model, held_out[: eval_rows or None], workload=workload, tokenizer=tokenizer)
        if evaluate_after
        else None
    )
    return {
        "stop_token_ids": sorted(set(trainer.eos_token_ids) | set(_ids(trainer.generation_config.eos_token_id))),
        "trained_tokens_per_step": positions[0] / steps,  # the padded [B, prompt + completion] it computes
        "real_tokens_per_step": positions[1] / steps,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "samples": steps * n,
        "samples_per_s": steps * n / seconds,
        "rewards": [h["reward"] for h in logs],
        "accuracy": acc,
        "threads": torch.get_num_threads(),
        "completion_len": [h.get("completions/mean_length") for h in logs],
        "completion_len_max": [h.get("completions/max_length") for h in logs],
    }


def _ids(x: int | list[int] | None) -> list[int]:
    return [] if x is None else [x] if isinstance(x, int) else list(x)


def run_side(
    name: str, ckpt: Path, out: Path, seed: int, args: argparse.Namespace, sampling_seed: int | None = None
) -> dict:
    """One run of side ``name`` in a fresh process, on the prompts of run ``seed``; ``sampling_seed``:
    relayrl's ``inference.seed`` / TRL's ``seed`` (None: the defaults, 0 / ``seed``)."""
    run = f"{name}-{seed}" + ("" if sampling_seed is None else f"-s{sampling_seed}")
    if name in ("trl", "trl_2threads"):
        threads = 2 if name == "trl_2threads" else 1
        before = os.environ.get("OMP_WAIT_POLICY")
        if threads > 1:  # OpenMP threads that spin at barriers: 10-17x slower on the shared 2-core machine
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # read by the child's OpenMP runtime at start
        try:
            return common.in_child(
                run_trl,
                str(ckpt),
                str(out / run),
                seed,
                args.steps,
                args.trl_cb,
                True,
                args.task,
                threads,
                sampling_seed,
                args.eval_rows,
            )
        finally:
            os.environ.pop("OMP_WAIT_POLICY", None) if before is None else os.environ.update(OMP_WAIT_POLICY=before)
    overrides = common.relayrl_overrides(ckpt, out / run, seed, args.steps, args.task)
    if name == "relayrl_async":
        overrides.append("rollout.max_staleness=1")
    if sampling_seed is not None:
        overrides.append(f"inference.seed={sampling_seed}")
    if args.doctor_every:
        overrides.append(f"logging.doctor_every={args.doctor_every}")
    res = common.in_child(common.run_relayrl, overrides, True, name == "relayrl_inline", False, args.eval_rows)
    res["completion_len"] = [m.get("rollout/completion_len") for m in res.pop("steps")]
    if args.doctor_every:
        res["doctor"] = doctor_verdicts(out / run)
    return res


def doctor_verdicts(run_dir: Path) -> dict:
    """``relayrl doctor``'s verdict on each step recorded in ``run_dir``: the observed gap, whether
    it is healthy, the top cause and each cause's share."""
    from relayrl.doctor.replay import diagnose

    out = {}
    for step in sorted(int(p.parent.name.removeprefix("step_")) for p in (run_dir / "doctor").glob("step_*/record.pt")):
        rep = diagnose(run_dir, step)
        out[f"step_{rep['step']}"] = {
            "observed_abs_diff_mean": rep["observed_abs_diff_mean"],
            "healthy": rep["healthy"],
            "top_cause": rep["top_cause"],
            "shares": {k: round(v["share"], 4) for k, v in rep["causes"].items() if v["share"] > 0},
        }
    return out


LENGTH_TOLERANCE = 0.10  # the largest relative gap in mean completion length for a ratio to be reported
SIDES = ["relayrl", "relayrl_inline", "relayrl_async", "trl", "trl_2threads"]
DEFAULT_SIDES = "relayrl,trl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--task", default="arithmetic", choices=sorted(common.WORKLOADS), help="the workload (see the module doc)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="RL steps (0 = the workload's)")
    ap.add_argument("--sides", default=DEFAULT_SIDES, help=f"comma-separated, of {SIDES}")
    ap.add_argument("--first-seed", type=int, default=0, help="repeat r runs with seed first_seed + r")
    ap.add_argument(
        "--sampling-seeds",
        default="",
        help="comma-separated: one run per sampling seed, all on the prompts of --first-seed (replaces --repeats)",
    )
    ap.add_argument("--doctor-every", type=int, default=0, help="relayrl: logging.doctor_every (0: the default)")
    ap.add_argument(
        "--warm-start", default="", help="checkpoint directory to start from instead of common.warm_start's cached one"
    )
    ap.add_argument("--eval-rows", type=int, default=0, help="held-out prompts scored before and after (0: all 200)")
    ap.add_argument("--tag", default="", help="suffix of the result name (e.g. 'async' for a run with extra sides)")
    ap.add_argument("--trl-cb", action="store_true", help="TRL: transformers continuous batching instead of generate")
    ap.add_argument("--quick", action="store_true", help="1 repeat of 3 steps (smoke test)")
    ap.add_argument(
        "--prompts-per-step",
        type=int,
        default=0,
        help="prompts per step on both sides (0: common.RL's 8); fewer lets TRL fit a long-tailed real-model step in memory",
    )
    args = ap.parse_args()
    if args.prompts_per_step < 0:
        ap.error(f"--prompts-per-step must be >= 0, got {args.prompts_per_step}")
    if args.prompts_per_step:  # the side processes are spawned: they read it from the environment
        os.environ[common.PROMPTS_ENV] = str(args.prompts_per_step)
        common.RL["prompts_per_step"] = args.prompts_per_step
    args.steps = args.steps or common.WORKLOADS[args.task]["steps"]
    if args.quick:
        args.repeats, args.steps = 1, 3
    try:
        sampling = [int(x) for x in args.sampling_seeds.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sampling-seeds must be comma-separated integers, got {args.sampling_seeds!r}")
    if sampling:
        args.repeats = len(sampling)
    # (prompt seed, sampling seed) of each repeat
    args.plan = [(args.first_seed, s) for s in sampling] or [(args.first_seed + r, None) for r in range(args.repeats)]
    names = args.sides.split(",")
    if set(names) - set(SIDES) or "trl" not in names:
        ap.error(f"--sides must name 'trl' and others of {SIDES}, got {names}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    ckpt = Path(args.warm_start) if args.warm_start else common.warm_start(args.quick, workload=args.task)
    if not (ckpt / "config.json").is_file():
        ap.error(f"--warm-start {ckpt} holds no config.json (a Hugging Face checkpoint directory)")
    _, held_out = common.task_rows(args.task)
    acc_before = common.held_out_accuracy(
        common.load_warm(ckpt),
        held_out[: args.eval_rows or None],
        workload=args.task,
        tokenizer=common.checkpoint_tokenizer(ckpt),
    )
    args.name = "grpo_vs_trl" + "".join(f"_{x}" for x in (args.task, args.tag) if x and x != "arithmetic")
    out = common.CACHE / args.name
    runs: dict[str, list[dict]] = {k: [] for k in names}
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order: no side always runs first
            load, t0 = os.getloadavg()[0], time.perf_counter()
            seed, sampling_seed = args.plan[r]
            res = run_side(name, ckpt, out, seed, args, sampling_seed)
            res["load1"], res["process_seconds"] = round(load, 2), round(time.perf_counter() - t0, 1)
            runs[name].append(res)
        line = " | ".join(
            f"{k} {v[-1]['samples_per_s']:.0f} samples/s ({v[-1]['seconds']:.1f}s, cpu {v[-1]['cpu_seconds']:.1f}s, "
            f"last-5 reward {common.tail_mean(v[-1]['rewards']):.3f}, held-out {v[-1]['accuracy']:.3f})"
            for k, v in runs.items()
        )
        print(f"repeat {r}: {line}", flush=True)
    common.write_result(summarize(runs, args, acc_before), quick=args.quick)


def summarize(runs: dict[str, list[dict]], args: argparse.Namespace, acc_before: float) -> dict:
    """The result JSON: ratios against ``trl`` per repeat (median, spread) and each side's figures."""

    def ratio(a: str, b: str = "trl", key: str = "samples_per_s") -> dict:
        return common.spread([x[key] / y[key] for x, y in zip(runs[a], runs[b], strict=True)])

    def mean_len(xs: list) -> float | None:
        xs = [x for x in xs if x is not None]
        return round(sum(xs) / len(xs), 1) if xs else None

    def side(name: str) -> dict:
        rs = runs[name]
        out = {
            "samples_per_s": common.spread([x["samples_per_s"] for x in rs]),
            "seconds": common.spread([x["seconds"] for x in rs]),
            "cpu_ms_per_sample": common.spread([1e3 * x["cpu_seconds"] / x["samples"] for x in rs]),
            "final_reward": common.spread([common.tail_mean(x["rewards"]) for x in rs]),
            "held_out_accuracy": common.spread([x["accuracy"] for x in rs]),
            "completion_len_mean": mean_len([v for x in rs for v in x.get("completion_len", [])]),
            "completion_len_max_per_step": mean_len([v for x in rs for v in x.get("completion_len_max", [])]),
            "load1_at_start": [x["load1"] for x in rs],
            "process_seconds": [x["process_seconds"] for x in rs],
            "reward_curves": [[round(v, 3) for v in x["rewards"]] for x in rs],
            **({"doctor": [x["doctor"] for x in rs]} if "doctor" in rs[0] else {}),
            "torch_threads": rs[0]["threads"],
            "stop_token_ids": rs[0].get("stop_token_ids"),
            "trained_tokens_per_step": round(statistics.mean(x["trained_tokens_per_step"] for x in rs), 1),
            **(
                {"real_tokens_per_step": round(statistics.mean(x["real_tokens_per_step"] for x in rs), 1)}
                if "real_tokens_per_step" in rs[0]
                else {}
            ),
            "peak_rss_mb": common.spread([x["peak_rss_mb"] for x in rs]),
        }
        if "phase_s_per_step" in rs[0]:
            out["phase_s_per_step"] = {
                k: round(statistics.median(x["phase_s_per_step"][k] for x in rs), 4) for k in rs[0]["phase_s_per_step"]
            }
        return out

    s = ratio("relayrl") if "relayrl" in runs else {"median": None, "min": None, "max": None, "values": []}
    result = {k: side(k) for k in runs}
    acc = {k: v["held_out_accuracy"]["median"] for k, v in result.items()}
    extra: dict = {f"ratio_{k}": ratio(k) for k in runs if k not in ("relayrl", "trl")}
    if {"relayrl_async", "trl_2threads"} <= set(runs):
        extra["ratio_async_vs_trl_2threads"] = ratio("relayrl_async", "trl_2threads")
    if "relayrl" in runs:  # CPU seconds per sample, TRL / relayrl: less sensitive to a busy machine than wall time
        extra["cpu_efficiency_ratio"] = common.spread(
            [
                y["cpu_seconds"] / y["samples"] / (x["cpu_seconds"] / x["samples"])
                for x, y in zip(runs["relayrl"], runs["trl"], strict=True)
            ]
        )
    # The same work on both sides: the same stop tokens, and mean completion lengths within LENGTH_TOLERANCE
    # (a side whose completions end earlier trains on fewer tokens; its samples/s means something else).
    same_work = {}
    for k in (k for k in runs if k.startswith("relayrl")):
        a, b = result[k]["completion_len_mean"], result["trl"]["completion_len_mean"]
        gap = abs(a - b) / max(a, b) if a and b else None
        same_work[k] = {
            "completion_len_gap": None if gap is None else round(gap, 4),
            "same_stop_tokens": result[k]["stop_token_ids"] == result["trl"]["stop_token_ids"],
            "ok": gap is not None
            and gap <= LENGTH_TOLERANCE
            and result[k]["stop_token_ids"] == result["trl"]["stop_token_ids"],
        }
    headline_ok = same_work.get("relayrl", {}).get("ok", True)
    if not headline_ok:
        print(
            f"WARNING: relayrl and TRL did not do the same work ({same_work['relayrl']}): no ratio reported "
            "(ratio_unmatched keeps the measured one)",
            file=sys.stderr,
            flush=True,
        )
    w = common.WORKLOADS[args.task]
    return {
        "name": args.name,
        "task": args.task,
        "ratio": s["median"] if headline_ok else None,
        **(
            {}
            if headline_ok
            else {"ratio_unmatched": s["median"], "warning": "completion lengths or stop tokens differ"}
        ),
        "same_work": same_work,
        "ratio_min": s["min"],
        "ratio_max": s["max"],
        "ratios": s["values"],
        "ratio_is": "relayrl (synchronous, one torch thread, relayrl train's defaults) / TRL (one torch thread) samples/s",
        **extra,
        "goal": "relayrl >= 3x TRL samples/s with reward no worse",
        # 0.03 ~ 1.5 standard errors of an accuracy near 0.45 over 200 prompts x 4 samples
        "reward_no_worse": {k: acc[k] >= acc["trl"] - 0.03 for k in runs if k.startswith("relayrl")},
        "held_out_accuracy_before": round(acc_before, 4),
        **result,
        "settings": {
            **common.RL,
            "max_new_tokens": w["max_new_tokens"],
            "steps": args.steps,
            "repeats": args.repeats,
            "seeds": [seed for seed, _ in args.plan],
            "sampling_seeds": [s for _, s in args.plan] if args.plan[0][1] is not None else None,
            "doctor_every": args.doctor_every or None,
            "eval_rows": args.eval_rows or len(common.task_rows(args.task)[1]),
            "warm_start": args.warm_start or "common.warm_start (cached under runs/bench/sft-<key>/final)",
            "sides": list(runs),
            "model": common.BENCH_MODEL,
            "task": w["task"],
            "sft": w["sft"],
            "relayrl": "Trainer, eta=0 (relayrl_async: eta=1), LocalEngine, actor.loss=ppo, actor.recompute_logp=false",
            "trl": f"trl GRPOTrainer, fp32, no grad checkpointing, per_device_train_batch_size=prompts*group, "
            f"num_iterations=1, steps_per_generation=1, beta=0, loss_type=dapo, scale_rewards=group, logging_steps=1, "
            f"shuffle_dataset=False (both sides read common.rl_rows' order: the same prompts every step), "
            f"{'transformers continuous batching' if args.trl_cb else 'HF generate with KV cache'}",
        },
    }


if __name__ == "__main__":
    main()
