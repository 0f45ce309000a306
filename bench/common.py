"""Helpers shared by the RL benchmarks: the bench model, its SFT warm start, held-out accuracy,
median/spread summaries and the result file.

The RL benchmarks (``grpo_vs_trl``, ``async_vs_sync``, ``overhead``) start from an
SFT-warmed checkpoint of a ~0.6M-parameter Qwen2-style model over the offline character
tokenizer (a random model scores 0 on the tasks, so rewards would mean nothing).
``warm_start()`` trains it once per workload with ``relayrl.sft.run_sft`` on imperfect
demonstrations (30% wrong) and caches it under ``runs/bench/sft-<key>/final``; later runs reuse it.

Two workloads (``WORKLOADS``): ``arithmetic`` (2-digit addition, 3-5 token completions, all
about the same length: the default of every RL benchmark) and ``count`` ("Count to 34700 from
34696:" -> "34696 34697 34698 34699 34700": log-normal completion lengths, median 36 tokens,
longest 180, the long tail of chain-of-thought rollouts; ``grpo_vs_trl --task count``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/x.py` from the repo root

from relayrl.api.commands import SFTConfig, SFTDataConfig  # noqa: E402
from relayrl.api.config import (  # noqa: E402
    InferenceConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    TrainEngineConfig,
)
from relayrl.api.io import GenerationConfig  # noqa: E402
from relayrl.data.models import build_tokenizer  # noqa: E402
from relayrl.data.tasks import demonstrations, make_task  # noqa: E402
from relayrl.demo import DEMO_MODEL, build_demo_model, generation_copy  # noqa: E402
from relayrl.rewards.tasks import task_reward_fn  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CACHE = ROOT / "runs" / "bench"

# The demo's ~0.6M-parameter model (hidden 128, 3 layers): learns 2-digit addition from
# demonstrations in a few hundred SFT steps on one core.
BENCH_MODEL = DEMO_MODEL
TASK = {"name": "arithmetic", "difficulty": 2, "n_train": 2000, "n_eval": 200, "seed": 1}
SFT = {
    "error_rate": 0.3,
    "max_steps": 1000,
    "probe_every": 100,
    "stop_greedy": 0.6,
    "batch_size": 128,
    "lr": 3e-3,
    "warmup_steps": 50,
}
MAX_NEW_TOKENS = 8  # answers are <= 3 digits + EOS
# Per workload: task rows, SFT warm start, generation limit, RL steps of grpo_vs_trl.
WORKLOADS: dict[str, dict] = {
    "arithmetic": {"task": TASK, "sft": SFT, "max_new_tokens": MAX_NEW_TOKENS, "steps": 40},
    # count: completions of 6 tokens per number (5 digits + space / EOS); the longest problem is
    # 30 numbers = 180 tokens, and 192 leaves room for a miscount that runs 2 numbers past the end.
    "count": {
        "task": {**TASK, "name": "count"},
        "max_new_tokens": 192,
        "steps": 12,
        "sft": {**SFT, "max_steps": 400, "probe_every": 50, "stop_greedy": 0.6},
    },
}


def task_rows(workload: str = "arithmetic") -> tuple[list[dict], list[dict]]:
    """(train, held-out) rows of the workload's task."""
    t = WORKLOADS[workload]["task"]
    return make_task(t["name"], t["n_train"], t["n_eval"], t["difficulty"], t["seed"])


def rl_rows(workload: str, seed: int) -> tuple[list[dict], list[dict]]:
    """``task_rows`` with the training rows in the order of run ``seed``: both sides of a comparison
    read them in this order, unshuffled, so every step trains on the same prompts on both sides
    (with long-tailed lengths, different prompts would be different work)."""
    import random

    train, held_out = task_rows(workload)
    random.Random(f"rl-order-{seed}").shuffle(train)
    return train, held_out


def held_out_accuracy(
    model: PreTrainedModel,
    rows: Sequence[dict],
    n_samples: int = 4,
    greedy: bool = False,
    seed: int = 0,
    workload: str = "arithmetic",
    tokenizer=None,  # noqa: ANN001 - the model's own (checkpoint_tokenizer); default: the bench's character tokenizer
) -> float:
    """Mean accuracy of ``n_samples`` temperature-1 samples (or greedy) per held-out prompt,
    scored by the task verifier; decoded by LocalEngine on a copy of ``model``."""
    from relayrl.evaluation import evaluate
    from relayrl.inference.local import LocalEngine
    from relayrl.rollout.workflows.rlvr import RLVRWorkflow

    tokenizer = tokenizer or build_tokenizer()
    engine = LocalEngine(
        InferenceConfig(seed=seed, max_batch_size=256), model=generation_copy(model), tokenizer=tokenizer
    )
    engine.initialize()
    try:
        w = WORKLOADS[workload]
        g = GenerationConfig(max_new_tokens=w["max_new_tokens"], temperature=1.0, top_p=1.0, top_k=0, greedy=greedy)
        n = 1 if greedy else n_samples
        workflow = RLVRWorkflow(task_reward_fn(w["task"]["name"]), g, tokenizer)
        out = evaluate(engine, workflow, list(rows), n_samples=n)
    finally:
        engine.destroy()
    return float(out.get("eval/accuracy_mean", out["eval/accuracy"]))


def warm_start(quick: bool = False, log=print, workload: str = "arithmetic") -> Path:  # noqa: ANN001
    """The SFT-warmed checkpoint directory (HF model + tokenizer) of ``workload``, trained once and
    cached. ``quick`` (smoke tests) uses the untrained model when no SFT checkpoint is cached yet."""
    from relayrl.sft import run_sft

    task, sft = WORKLOADS[workload]["task"], WORKLOADS[workload]["sft"]
    key = hashlib.sha1(json.dumps([BENCH_MODEL, task, sft], sort_keys=True).encode()).hexdigest()[:10]
    run_dir = CACHE / f"sft-{key}"
    final = run_dir / "final"
    if (final / "config.json").exists():
        return final
    if quick:
        path = CACHE / "untrained"
        if not (path / "config.json").exists():
            build_demo_model(TASK["seed"]).save_pretrained(path)
            build_tokenizer().save_pretrained(path)
        log("--quick without a cached SFT checkpoint: using the untrained model (rewards ~0)")
        return path
    t0 = time.monotonic()
    train, held_out = task_rows(workload)
    tokenizer = build_tokenizer()
    cfg = SFTConfig(
        run_dir=str(run_dir),
        seed=task["seed"],
        torch_threads=1,
        total_steps=sft["max_steps"],
        batch_size=sft["batch_size"],
        log_every_n_steps=sft["probe_every"],
        save_final=True,
        model=ModelConfig(path="tiny"),
        train=TrainEngineConfig(
            optimizer=OptimizerConfig(lr=sft["lr"], lr_schedule="constant", warmup_steps=sft["warmup_steps"])
        ),
        data=SFTDataConfig(task=task["name"], difficulty=task["difficulty"], error_rate=sft["error_rate"]),
        logging=LoggingConfig(tensorboard=False),
    )
    probe = train[:100]

    def learned(step: int, model: PreTrainedModel) -> bool:
        acc = held_out_accuracy(model, probe, greedy=True, workload=workload)
        log(f"sft step {step}: probe greedy accuracy {acc:.2f} (stop at {sft['stop_greedy']})")
        return acc >= sft["stop_greedy"]

    demos = demonstrations(train, sft["error_rate"], task["seed"])
    res = run_sft(
        cfg,
        tokenizer=tokenizer,
        model=build_demo_model(task["seed"]),
        train_rows=demos,
        eval_rows=held_out[:64],
        stop_fn=learned,
    )
    log(f"SFT warm start: {res.steps} steps in {time.monotonic() - t0:.0f}s -> {final}")
    return final


def checkpoint_tokenizer(path: Path):  # noqa: ANN201 - a PreTrainedTokenizerFast
    """The tokenizer of checkpoint ``path`` as relayrl's Trainer loads it (``model.path=path``): SmolLM2's
    own for a SmolLM2 directory, the character tokenizer for the bench's SFT checkpoints."""
    from relayrl.data.models import load_tokenizer

    return load_tokenizer(ModelConfig(path=str(path)))


def load_warm(path: Path) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.generation_config.pad_token_id = checkpoint_tokenizer(path).pad_token_id
    return model


def stop_token_ids(model: PreTrainedModel, tokenizer=None) -> list[int]:  # noqa: ANN001
    """The token ids LocalEngine stops a completion on (``relayrl.inference.local.engine``): the generation
    config's ``eos_token_id`` (one or several), else the model config's, else the tokenizer's."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return sorted({eos} if isinstance(eos, int) else set(eos or []))


def end_of_turn_id(tokenizer) -> int | None:  # noqa: ANN001
    """The token the chat template puts right after an assistant message's text (``<|im_end|>`` in
    ChatML): where the template says a turn ends. None without a chat template or such a token."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    full = tokenizer.apply_chat_template(msgs, tokenize=False)
    cut = full.rindex("ok") + len("ok")
    head = tokenizer(full[:cut], add_special_tokens=False)["input_ids"]
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    return int(ids[len(head)]) if len(ids) > len(head) and ids[: len(head)] == head else None


def peak_rss_mb() -> float:
    """Peak resident memory of this process image in MB (``VmHWM``: reset at exec, unlike ``ru_maxrss``,
    which a spawned child can inherit from the process it was forked from)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


# One GRPO step on both sides of grpo_vs_trl (and the base of async_vs_sync / overhead). The prompts per
# step can be lowered for a model whose TRL side would not fit in memory (grpo_vs_trl --prompts-per-step,
# carried to the spawned side processes by this variable).
PROMPTS_ENV = "RELAYRL_BENCH_PROMPTS_PER_STEP"
RL = {
    "prompts_per_step": int(os.environ.get(PROMPTS_ENV, "8")),
    "group_size": 8,
    "max_new_tokens": MAX_NEW_TOKENS,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "lr": 3e-4,
    "steps": 40,
    "eps_clip": 0.2,
    "grad_clip": 1.0,
    "adam": [0.9, 0.999, 1e-8],
    "weight_decay": 0.0,
    "lr_schedule": "constant",
    "kl_coef": 0.0,
    "adv": "(r - group mean) / group std",
    "loss_agg": "token mean over the batch",
    "torch_threads": 1,
}


def relayrl_overrides(ckpt: Path, run_dir: Path, seed: int, steps: int, workload: str = "arithmetic") -> list[str]:
    """The RunConfig of a GRPO run with the ``RL`` settings from ``ckpt`` (synchronous, colocated)."""
    p, g = RL["prompts_per_step"], RL["group_size"]
    w = WORKLOADS[workload]
    return [
        f"run_dir={run_dir}",
        f"seed={seed}",
        f"total_steps={steps}",
        "torch_threads=1",
        f"model.path={ckpt}",
        f"data.task={w['task']['name']}",
        f"data.difficulty={w['task']['difficulty']}",
        f"train.optimizer.lr={RL['lr']}",
        f"train.optimizer.grad_clip={RL['grad_clip']}",
        "train.optimizer.lr_schedule=constant",
        "actor.adv_estimator=grpo",
        "actor.loss=ppo",
        "actor.recompute_logp=false",
        f"actor.eps_clip={RL['eps_clip']}",
        f"gconfig.max_new_tokens={w['max_new_tokens']}",
        "gconfig.temperature=1.0",
        "gconfig.top_p=1.0",
        "gconfig.top_k=0",
        f"rollout.batch_size={p}",
        f"rollout.group_size={g}",
        "rollout.max_staleness=0",
        "data.shuffle=false",  # rows come in rl_rows' order, as on the TRL side
        "logging.tensorboard=false",
        "logging.rollouts_per_step=0",
        "logging.progress=lines",
        "checkpoint.save_final=false",
    ]


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all its threads) so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``): ratios between kernels (oneDNN's packed weights against the
    default ``linear``) differ between CPU makers, so a result says which one it was measured on."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def pin_threads(pid: int, cpu: int) -> None:
    """Every thread of process ``pid`` on one core (``sched_setaffinity`` of a pid moves one thread only)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass


def pin_trainer_and_servers() -> tuple[int, int]:
    """This process (the trainer) on the first allowed core, its child processes (the servers it
    launched) on the second, as separate devices would be; returns the two cores."""
    import psutil

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise RuntimeError(f"pinning needs 2 cores, this process may use {cores}")
    for child in psutil.Process().children(recursive=True):
        pin_threads(child.pid, cores[1])
    pin_threads(os.getpid(), cores[0])
    return cores[0], cores[1]


def run_relayrl(
    overrides: list[str],
    evaluate_after: bool = True,
    inline_reward: bool = False,
    pin: bool = False,
    eval_rows: int = 0,
) -> dict:
    """Build a Trainer from ``overrides``, time ``fit()``, return per-step metrics, the wall and
    CPU time and (optionally) held-out sampled accuracy of the trained policy.

    ``inline_reward``: the RLVR workflow calls the reward fn inline on the rollout loop
    (``reward_timeout=None``) instead of on a reward thread (what ``relayrl train`` does:
    ``rollout.reward_timeout`` must be > 0). The workload is ``data.task``'s. ``pin``: once the
    trainer has launched its servers, trainer and servers run on separate cores. ``eval_rows``: score
    only the first N held-out prompts (0: all; a real model's evaluation is slow on CPU)."""
    import shutil

    from relayrl.api.config import RunConfig, load_config
    from relayrl.data.models import load_tokenizer
    from relayrl.rollout.workflows import RLVRWorkflow
    from relayrl.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(RunConfig, None, overrides)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    train, held_out = rl_rows(cfg.data.task, cfg.seed)
    workflow = None
    if inline_reward:
        workflow = RLVRWorkflow(
            task_reward_fn(cfg.data.task), cfg.gconfig, load_tokenizer(cfg.model), reward_timeout=None
        )
    t_build = time.perf_counter()
    trainer = Trainer(cfg, train_rows=train, eval_rows=held_out, workflow=workflow)
    cores = pin_trainer_and_servers() if pin else None
    c0, t0 = cpu_seconds(), time.perf_counter()
    try:
        trainer.fit()
        seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        model = trainer.actor_engine.model
        tok = load_tokenizer(cfg.model)
        acc = (
            held_out_accuracy(model, held_out[: eval_rows or None], workload=cfg.data.task, tokenizer=tok)
            if evaluate_after
            else None
        )
        stop_ids = sorted(getattr(trainer.engine, "eos_ids", ()))
    finally:
        trainer.close()
    steps = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "perf/samples" in m]
    samples = int(steps[-1]["perf/samples"])
    timed = steps[1:] or steps  # the first step includes warm-up
    phases = {
        k.split("/", 1)[1]: statistics.mean(m.get(k, 0.0) for m in timed) for k in steps[-1] if k.startswith("timing/")
    }
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "build_seconds": t0 - t_build,
        "samples": samples,
        "samples_per_s": samples / seconds,
        "rewards": [m["rollout/reward"] for m in steps],
        "accuracy": acc,
        "steps": steps,
        "phase_s_per_step": phases,
        "threads": torch.get_num_threads(),
        "pinned_cores": cores,
        "stop_token_ids": stop_ids,
        # the packed positions each step's forward/backward computed (actor/n_tokens), mean over steps
        "trained_tokens_per_step": statistics.mean(m.get("actor/n_tokens", 0.0) for m in steps),
    }


def _child(fn, args, queue) -> None:  # noqa: ANN001
    try:
        value = fn(*args)
        if isinstance(value, dict):  # every side's peak memory, measured in its own process
            value.setdefault("peak_rss_mb", peak_rss_mb())
        queue.put(("ok", value))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback

        queue.put(("error", f"{e!r}\n{traceback.format_exc()}"))


def in_child(fn, *args):  # noqa: ANN001, ANN201
    """``fn(*args)`` in a fresh spawned process (own imports, threads and peak memory); its return value."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, queue))
    proc.start()
    import queue as queue_mod

    while True:
        try:
            status, value = queue.get(timeout=5)
            break
        except queue_mod.Empty:
            if not proc.is_alive():
                raise RuntimeError(
                    f"{getattr(fn, '__name__', fn)}: child process died (exit code {proc.exitcode})"
                ) from None
    proc.join()
    if status != "ok":
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed in a child process: {value}")
    return value


def tail_mean(xs: Sequence[float], k: int = 5) -> float:
    return float(statistics.mean(xs[-k:]))


def spread(values: Sequence[float]) -> dict[str, float | list[float]]:
    """Median, min, max and the values themselves (rounded)."""
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "values": [round(v, 4) for v in values],
    }


def results_dir(quick: bool = False) -> Path:
    """``bench/results``; ``--quick`` smoke runs write elsewhere so they never replace recorded figures
    (``BENCH_RESULTS_DIR`` overrides both)."""
    return Path(os.environ.get("BENCH_RESULTS_DIR") or (CACHE / "quick-results" if quick else RESULTS))


def write_result(result: dict, quick: bool = False) -> dict:
    """Add the load average, write ``<results>/<name>.json`` and print the JSON as the last line."""
    result["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    if quick:
        result["quick"] = True
    out = results_dir(quick)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{result['name']}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":  # `python bench/common.py [workload ...]`: train (or find) the SFT warm starts
    for name in sys.argv[1:] or ["arithmetic"]:
        t0 = time.monotonic()
        print(
            json.dumps(
                {
                    "name": "sft_warm_start",
                    "workload": name,
                    "checkpoint": str(warm_start(workload=name)),
                    "seconds": round(time.monotonic() - t0, 1),
                }
            )
        )
