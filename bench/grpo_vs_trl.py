"""GRPO samples/s: relayrl ÷ TRL ``GRPOTrainer`` on the same work, same run, on CPU.

Both sides start from the same SFT-warmed checkpoint (``common.warm_start``: a ~0.6M Qwen2-style
model that half-knows 2-digit addition) and run the same GRPO: ``RL`` in ``bench/common.py``
(prompts per step, group size = TRL ``num_generations``, max completion length, temperature 1,
top_k off, top_p 1, lr, constant schedule, steps, clip 0.2, grad clip 1, no KL, group-std
advantages, token-mean loss over the batch, one optimizer step per batch) with the same reward
function (``task_reward_fn("arithmetic")``) and one torch thread each.

relayrl: ``Trainer`` synchronous (eta = 0), colocated ``LocalEngine``; the ratio's old policy
is the generator's logprobs (``actor.recompute_logp=false``), like TRL's single-iteration
path, which never recomputes old logprobs. Two relayrl sides: ``relayrl`` as ``relayrl train``
runs it (the RLVR workflow calls the reward fn in a new thread per episode, for its timeout;
``rollout.reward_timeout`` cannot be turned off from the config) -- the headline ``ratio`` --
and ``relayrl_inline``, the same run with ``RLVRWorkflow(reward_timeout=None)`` passed to the
``Trainer``, which calls the reward fn inline as TRL does (``ratio_inline_reward``).

TRL (``trl`` is the ``bench`` extra): its fastest CPU settings for this work: fp32 (no bf16
autocast on CPU), no gradient checkpointing (TRL's default is on), the whole generation batch
in one forward/backward (``per_device_train_batch_size = prompts * group``, no accumulation),
``num_iterations=1`` and ``steps_per_generation=1`` (no old-logprob pass), ``beta=0`` (no
reference model), HF ``generate`` with KV cache (transformers' continuous batching measured
slower here; ``--trl-cb`` to try it), ``loss_type="dapo"`` (token mean over the batch, as
relayrl's ``token-mean``), no logging sinks, no checkpoints.

samples/s = trained samples / wall seconds of the training loop (``Trainer.fit`` /
``GRPOTrainer.train``; model loading excluded on both sides). Each side runs in its own
process; each repeat runs every side (order rotated) with seed = repeat. Also the CPU seconds
per sample of each side (all threads; less sensitive to a busy machine than wall time). The
reward reached: the mean training
reward of the last 5 steps, and held-out sampled accuracy (4 samples per prompt, 200 prompts)
of each final policy, scored by the same evaluator.

    python bench/grpo_vs_trl.py [--repeats 3] [--steps 30] [--quick]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import common
import torch


def run_trl(ckpt: str, run_dir: str, seed: int, steps: int, continuous_batching: bool = False, evaluate_after: bool = True) -> dict:
    """One TRL GRPOTrainer run with the ``common.RL`` settings; wall time of ``train()``."""
    torch.set_num_threads(1)
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from relayrl.data.models import build_tokenizer
    from relayrl.rewards.tasks import task_reward_fn

    rl = common.RL
    reward_fn = task_reward_fn("arithmetic")

    def arithmetic_reward(prompts: list, completions: list, completion_ids: list, answer: list, **_: object) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(reward_fn(prompt="", completions=t, prompt_ids=[], completion_ids=ids, answer=a))
                for t, ids, a in zip(texts, completion_ids, answer, strict=True)]

    train, held_out = common.task_rows()
    dataset = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in train])
    n = rl["prompts_per_step"] * rl["group_size"]
    args = GRPOConfig(
        output_dir=run_dir, seed=seed, max_steps=steps, per_device_train_batch_size=n, gradient_accumulation_steps=1,
        num_generations=rl["group_size"], max_completion_length=rl["max_new_tokens"], temperature=rl["temperature"],
        top_p=rl["top_p"], top_k=rl["top_k"], learning_rate=rl["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=rl["weight_decay"], adam_beta1=rl["adam"][0], adam_beta2=rl["adam"][1], adam_epsilon=rl["adam"][2],
        max_grad_norm=rl["grad_clip"], beta=rl["kl_coef"], epsilon=rl["eps_clip"], num_iterations=1, steps_per_generation=1,
        loss_type="dapo", scale_rewards="group", gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
        use_transformers_continuous_batching=continuous_batching, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )
    model = common.load_warm(Path(ckpt))
    trainer = GRPOTrainer(model=model, reward_funcs=arithmetic_reward, args=args, train_dataset=dataset,
                          processing_class=build_tokenizer())
    c0, t0 = common.cpu_seconds(), time.perf_counter()
    trainer.train()
    seconds, cpu = time.perf_counter() - t0, common.cpu_seconds() - c0
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    acc = common.held_out_accuracy(trainer.model, held_out) if evaluate_after else None
    return {"seconds": seconds, "cpu_seconds": cpu, "samples": steps * n, "samples_per_s": steps * n / seconds, "rewards": rewards,
            "accuracy": acc, "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=common.RL["steps"])
    ap.add_argument("--trl-cb", action="store_true", help="TRL: transformers continuous batching instead of generate")
    ap.add_argument("--quick", action="store_true", help="1 repeat of 3 steps (smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.steps = 1, 3
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    ckpt = common.warm_start(args.quick)
    _, held_out = common.task_rows()
    acc_before = common.held_out_accuracy(common.load_warm(ckpt), held_out)
    out = common.CACHE / "grpo_vs_trl"
    sides = {
        "relayrl": lambda r: common.in_child(common.run_relayrl, common.relayrl_overrides(ckpt, out / f"relayrl-{r}", r, args.steps)),
        "relayrl_inline": lambda r: common.in_child(
            common.run_relayrl, common.relayrl_overrides(ckpt, out / f"relayrl_inline-{r}", r, args.steps), True, True),
        "trl": lambda r: common.in_child(run_trl, str(ckpt), str(out / f"trl-{r}"), r, args.steps, args.trl_cb),
    }
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for r in range(args.repeats):
        names = list(sides)[r % 3:] + list(sides)[: r % 3]  # rotate the order: no side always runs first
        for name in names:
            load = os.getloadavg()[0]
            res = sides[name](r)
            res.pop("steps", None)
            res["load1"] = round(load, 2)
            runs[name].append(res)
        line = " | ".join(f"{k} {v[-1]['samples_per_s']:.0f} samples/s ({v[-1]['seconds']:.1f}s, cpu {v[-1]['cpu_seconds']:.1f}s, "
                          f"last-5 reward {common.tail_mean(v[-1]['rewards']):.3f}, held-out {v[-1]['accuracy']:.3f})" for k, v in runs.items())
        print(f"repeat {r}: {line}", flush=True)

    def ratio(a: str, key: str = "samples_per_s") -> dict:
        return common.spread([x[key] / y[key] for x, y in zip(runs[a], runs["trl"], strict=True)])

    def side(name: str) -> dict:
        rs = runs[name]
        return {"samples_per_s": common.spread([x["samples_per_s"] for x in rs]),
                "seconds": common.spread([x["seconds"] for x in rs]),
                "cpu_ms_per_sample": common.spread([1e3 * x["cpu_seconds"] / x["samples"] for x in rs]),
                "final_reward": common.spread([common.tail_mean(x["rewards"]) for x in rs]),
                "held_out_accuracy": common.spread([x["accuracy"] for x in rs]),
                "load1_at_start": [x["load1"] for x in rs],
                "reward_curves": [[round(v, 3) for v in x["rewards"]] for x in rs], "torch_threads": rs[0]["threads"]}

    for rs in runs.values():
        for x in rs:
            x["cpu_per_sample"] = x["cpu_seconds"] / x["samples"]
    s = ratio("relayrl")
    result = {k: side(k) for k in runs}
    acc = {k: v["held_out_accuracy"]["median"] for k, v in result.items()}
    common.write_result({
        "name": "grpo_vs_trl", "ratio": s["median"], "ratio_min": s["min"], "ratio_max": s["max"], "ratios": s["values"],
        "ratio_is": "relayrl (relayrl train's defaults: reward fn in a thread per call) / TRL samples/s",
        "ratio_inline_reward": ratio("relayrl_inline"),
        "ratio_inline_reward_is": "relayrl with the reward fn called inline (RLVRWorkflow(reward_timeout=None)) / TRL samples/s",
        # CPU seconds per sample, TRL / relayrl: the work each does, less sensitive to a busy machine than wall time
        "cpu_efficiency_ratio": common.spread([y["cpu_per_sample"] / x["cpu_per_sample"] for x, y in zip(runs["relayrl"], runs["trl"], strict=True)]),
        "goal": "relayrl >= 3x TRL samples/s with reward no worse",
        # 0.03 ~ 1.5 standard errors of an accuracy near 0.45 over 200 prompts x 4 samples
        "reward_no_worse": acc["relayrl"] >= acc["trl"] - 0.03 and acc["relayrl_inline"] >= acc["trl"] - 0.03,
        "held_out_accuracy_before": round(acc_before, 4), **result,
        "settings": {**common.RL, "steps": args.steps, "repeats": args.repeats, "model": common.BENCH_MODEL, "task": common.TASK,
                     "sft": common.SFT, "relayrl": "Trainer, eta=0, LocalEngine, actor.loss=ppo, actor.recompute_logp=false",
                     "trl": f"trl GRPOTrainer, fp32, no grad checkpointing, per_device_train_batch_size=prompts*group, "
                            f"num_iterations=1, steps_per_generation=1, beta=0, loss_type=dapo, scale_rewards=group, logging_steps=1, "
                            f"{'transformers continuous batching' if args.trl_cb else 'HF generate with KV cache'}"},
    }, quick=args.quick)

if __name__ == "__main__":
    main()
