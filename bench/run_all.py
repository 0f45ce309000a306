"""Run every benchmark, one process each, then regenerate the table in docs/benchmarks.md.

    python bench/run_all.py                 # all (~15 minutes on the 2-core dev machine)
    python bench/run_all.py --only grpo_vs_trl,overhead
    python bench/run_all.py --quick         # smoke: the RL benchmarks with --quick (results elsewhere)
    python bench/run_all.py --docs-only     # just rebuild the table from bench/results/*.json

Each benchmark prints a JSON object as its last line and writes ``bench/results/<name>.json``;
this script adds ``bench/results/run_all.json`` (seconds per benchmark, total, load average).
``gpu`` runs only when CUDA is available. The SFT warm start shared by the RL benchmarks is
trained first (once; cached under ``runs/bench``) so its cost is visible on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
DOCS = BENCH.parent / "docs" / "benchmarks.md"
START, END = "<!-- table:start (bench/run_all.py writes this part) -->", "<!-- table:end -->"
SMOLLM2 = str(Path("~/.cache/relayrl/models/smollm2-135m-instruct").expanduser())  # relayrl models pull
ORDER = [
    "generation",
    "generation_smollm2",
    "families",
    "moe_replay",
    "decode_cost",
    "training",
    "lm_head",
    "shared_prefix",
    "roofline_smollm2",
    "roofline_qwen0_5b_6l",
    "lora",
    "serving",
    "grpo_vs_trl_count",
    "grpo_vs_trl_count_async",
    "grpo_vs_trl_count_seeds3to6",
    "grpo_vs_trl_count_seed2",
    "grpo_vs_trl_count_sampling",
    "grpo_vs_trl",
    "grpo_vs_trl_smollm2",
    "grpo_vs_trl_count_smollm2",
    "async_vs_sync",
    "async_vs_sync_count",
    "weight_sync",
    "overhead",
    "overhead_count",
    "gpu",
    "inspect",
]
OPTIONAL = {
    "decode_cost",
    "grpo_vs_trl_count_async",
    "grpo_vs_trl_count_seeds3to6",
    "grpo_vs_trl_count_seed2",
    "grpo_vs_trl_count_sampling",
    "overhead_count",
    "async_vs_sync_count",
    "lora",
    "lm_head",
    "shared_prefix",
    # the real / 0.5B-shaped model ones (minutes each on one core; the SmolLM2 ones need `relayrl models pull`)
    "generation_smollm2",
    "roofline_smollm2",
    "roofline_qwen0_5b_6l",
    "grpo_vs_trl_smollm2",
    "grpo_vs_trl_count_smollm2",
}  # only with --only: run_all would take past ~15 minutes
QUICK_ARGS = {
    "generation": ["--repeats", "1", "--models", "tiny"],
    "training": ["--repeats", "1"],
    "serving": ["--repeats", "1"],
}
NEW = {
    "grpo_vs_trl_count",
    "grpo_vs_trl_count_async",
    "grpo_vs_trl",
    "async_vs_sync",
    "async_vs_sync_count",
    "weight_sync",
    "overhead",
    "overhead_count",
    "gpu",
    "inspect",
}
SCRIPTS = {  # benchmark -> (script, arguments); default: bench/<benchmark>.py
    "shared_prefix": ("lm_head", ["--shared-prefix"]),
    "grpo_vs_trl_count": ("grpo_vs_trl", ["--task", "count"]),
    "grpo_vs_trl_count_async": (
        "grpo_vs_trl",
        ["--task", "count", "--sides", "relayrl,relayrl_async,trl,trl_2threads", "--tag", "async"],
    ),
    "grpo_vs_trl_count_seeds3to6": (
        "grpo_vs_trl",
        ["--task", "count", "--repeats", "4", "--first-seed", "3", "--tag", "seeds3to6"],
    ),
    # docs/mismatch.md's seed-2 run with the doctor's verdicts, and the same prompts under 7 other sampling seeds
    "grpo_vs_trl_count_seed2": (
        "grpo_vs_trl",
        ["--task", "count", "--first-seed", "2", "--repeats", "1", "--doctor-every", "1", "--tag", "seed2"],
    ),
    "grpo_vs_trl_count_sampling": (
        "grpo_vs_trl",
        ["--task", "count", "--first-seed", "2", "--sampling-seeds", "11,12,13,14,15,16,17", "--doctor-every", "4"]
        + ["--tag", "sampling"],
    ),
    "overhead_count": ("overhead", ["--task", "count", "--steps", "8"]),
    "inspect": ("inspect_load", []),  # not bench/inspect.py: it would shadow the standard library's inspect
    "async_vs_sync_count": ("async_vs_sync", ["--task", "count", "--steps", "12"]),
    "generation_smollm2": ("generation", ["--model", SMOLLM2, "--repeats", "1"]),
    "roofline_smollm2": ("roofline", ["--model", SMOLLM2]),
    "roofline_qwen0_5b_6l": ("roofline", ["--config", "qwen0.5b", "--layers", "6"]),
    "grpo_vs_trl_smollm2": (
        "grpo_vs_trl",
        ["--warm-start", SMOLLM2, "--steps", "2", "--repeats", "1", "--eval-rows", "8", "--tag", "smollm2"],
    ),
    # 4 prompts x 8 samples a step: TRL's padded step of 8 x 8 needs over 22 GB (OOM-killed on the 23 GB machine)
    "grpo_vs_trl_count_smollm2": (
        "grpo_vs_trl",
        ["--task", "count", "--warm-start", SMOLLM2, "--steps", "2", "--repeats", "2", "--eval-rows", "4"]
        + ["--prompts-per-step", "4", "--tag", "smollm2"],
    ),
}
RL_BENCHES = {
    "grpo_vs_trl_count": "count",
    "grpo_vs_trl_count_async": "count",
    "grpo_vs_trl_count_seeds3to6": "count",
    "grpo_vs_trl_count_seed2": "count",
    "grpo_vs_trl_count_sampling": "count",
    "grpo_vs_trl": "arithmetic",
    "async_vs_sync": "arithmetic",
    "async_vs_sync_count": "count",
    "overhead": "arithmetic",
    "overhead_count": "count",
}  # benchmark -> the SFT warm start it needs


def run(name: str, args: list[str]) -> tuple[dict | None, float]:
    """Run ``bench/<name>.py``, echo its output, return (last-line JSON or None, seconds)."""
    print(f"\n=== {name} {' '.join(args)}", flush=True)
    t0 = time.monotonic()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / f"{name}.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=BENCH.parent,
    )
    last = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip():
            last = line
        print(line[:400], end="" if line.endswith("\n") else "\n", flush=True)
    code = proc.wait()
    seconds = time.monotonic() - t0
    try:
        result = json.loads(last) if code == 0 else None
    except json.JSONDecodeError:
        result = None
    print(f"=== {name}: {'ok' if result else f'no result (exit {code})'} in {seconds:.0f}s", flush=True)
    return result, seconds


# ------------------------------------------------------------------ the docs table


def _f(x: object, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def _med(d: dict, *path: str) -> float | None:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d.get("median") if isinstance(d, dict) else d  # type: ignore[return-value]


def describe(r: dict) -> tuple[str, str, str]:
    """(what the headline number is, goal, key figures) of one result."""
    n = r["name"]
    if n == "generation":
        models = ", ".join(
            f"{m}: {v['engine_tok_s']:.0f} vs {v['generate_tok_s']:.0f} tok/s" for m, v in r["models"].items()
        )
        return "LocalEngine ÷ HF `generate` tokens/s (worst model)", "–", models
    if n.startswith("generation_"):  # a real chat model (generation.py --model)
        runs = r["runs"][0]
        return (
            f"LocalEngine ÷ HF `generate` tokens/s, {r['model'].rstrip('/').split('/')[-1]}, 64 chat prompts "
            f"(`--only {n}`)",
            r.get("goal", "–"),
            f"{r['engine_tok_s']:.0f} vs {r['generate_tok_s']:.0f} tok/s; stop ids {r['stop_token_ids']}; ended on "
            f"the template's end of turn: {runs['ended_on_end_of_turn']['engine']} / "
            f"{runs['ended_on_end_of_turn']['generate']} of 64 (engine / generate), the rest at the cap; generate "
            f"samples the raw logits: {r['generate_samples_raw_logits']}",
        )
    if n.startswith("roofline_"):
        rel, hf = r["relayrl"], r["hf"]
        return (
            f"HF padded ÷ relayrl `train_batch` step CPU seconds, {r['model'].split('/')[-1]} (`--only {n}`)",
            "–",
            f"{rel['cpu_s_per_step']:.1f} vs {hf['cpu_s_per_step']:.1f} CPU s/step; useful GFLOP per CPU s {rel['useful_gflop_s']:.1f} "
            f"vs {hf['useful_gflop_s']:.1f} = {rel['useful_fraction_of_peak']:.0%} vs {hf['useful_fraction_of_peak']:.0%} of "
            f"the torch.mm peak {r['peak_gflop_s']:.1f}; peak RSS {rel['peak_rss_mb']:.0f} vs {hf['peak_rss_mb']:.0f} MB",
        )
    if n == "families":
        per = ", ".join(f"{m} {v * 1e3:.1f}" for m, v in r["models"].items())
        return (
            "mean \\|Δ logprob\\| ×1e3, LocalEngine vs train engine in bf16, 12 tiny HF families",
            "–",
            f"{r['device']}: {per}",
        )
    if n == "moe_replay":
        per = ", ".join(
            f"{m}: {v['bfloat16']['no_replay'] * 1e3:.1f} -> {v['bfloat16']['replay'] * 1e3:.1f} "
            f"(flips {v['bfloat16']['flip_rate']:.1%})"
            for m, v in r["results"].items()
        )
        return (
            "bf16 mean \\|Δ logprob\\| generator vs trainer, without ÷ with routed-experts replay (tiny MoE)",
            "> 1",
            f"×1e3 without -> with replay: {per}",
        )
    if n == "decode_cost":
        models = "; ".join(
            f"{m}: measured {v['ratio']:.2f}, engine {v['engine']['seconds']:.2f}s = prefill {v['engine']['prefill']:.2f} "
            f"+ decode {v['engine']['decode']:.2f} + other {v['engine']['other']:.2f}, step {v['fixed_ms']:.1f} ms "
            f"+ {v['per_row_ms']:.2f} ms/row"
            for m, v in r["models"].items()
        )
        return "LocalEngine ÷ HF `generate` with zero engine overhead (worst model; `--only decode_cost`)", "–", models
    if n == "training":
        return (
            "packed ÷ padded train tokens/s",
            "–",
            f"{r['packed_tokens_per_s']:.0f} vs {r['padded_tokens_per_s']:.0f} tok/s; pad fraction {r['padded_pad_fraction']:.0%}",
        )
    if n.startswith("lm_head"):
        f, q = r["full"], r["fast"]
        return (
            "full-logits ÷ LM-head fast path CPU per update step, vocab 49,152, 18% loss tokens "
            + ("(`--only lm_head`)" if n == "lm_head" else "(real SmolLM2-135M; its JSON's `command`)"),
            "–",
            f"{f['cpu_s_per_step']:.2f} vs {q['cpu_s_per_step']:.2f} s/step; peak RSS {f['peak_rss_mb']:.0f} vs "
            f"{q['peak_rss_mb']:.0f} MB; loss {f['loss']:.6f} = {q['loss']:.6f}; {r['model']}",
        )
    if n.startswith("shared_prefix"):
        f, q = r["fast"], r["shared"]
        return (
            "LM-head fast path ÷ with shared-prefix training CPU per update step, 8 groups × 8 rows sharing a "
            "36-token prompt "
            + ("(`--only shared_prefix`)" if n == "shared_prefix" else "(real SmolLM2-135M; its JSON's `command`)"),
            "–",
            f"{f['cpu_s_per_step']:.2f} vs {q['cpu_s_per_step']:.2f} s/step; peak RSS {f['peak_rss_mb']:.0f} vs "
            f"{q['peak_rss_mb']:.0f} MB; tokens computed {f['computed_tokens']} vs {q['computed_tokens']}; loss "
            f"{f['loss']:.6f} / {q['loss']:.6f}, grad norm {f['grad_norm']:.6f} / {q['grad_norm']:.6f}; {r['model']}",
        )
    if n == "lora":
        return (
            "LoRA (rank 16) ÷ full fine-tuning step time, ~30M model (`--only lora`)",
            "≤ 1.1; RSS ≤ 0.6",
            f"peak RSS {r['rss_ratio']:.2f}x ({r['lora_peak_rss_mb']:.0f} vs {r['full_peak_rss_mb']:.0f} MB); "
            f"with gradient checkpointing step {r['ratio_gc']:.2f}x, RSS {r['rss_ratio_gc']:.2f}x",
        )
    if n == "serving":
        return (
            "`relayrl serve` ÷ in-process tokens/s",
            "≥ 0.85",
            f"{r['server_tokens_per_s']:.0f} vs {r['local_tokens_per_s']:.0f} tok/s; p50 {r['latency_p50_s']:.2f}s, p99 {r['latency_p99_s']:.2f}s",
        )
    if n.startswith("grpo_vs_trl"):
        return describe_grpo(r)
    if n.startswith("async_vs_sync"):
        s, a = r["sync"], r["async"]
        unpinned = (
            f"; unpinned {r['ratio_unpinned']:.2f} (ceiling {_med(r, 'overlap_ceiling_unpinned'):.2f})"
            if "ratio_unpinned" in r
            else ""
        )
        share = f" ({r['ratio_of_ceiling']:.0%} of it)" if "ratio_of_ceiling" in r else ""
        pinned = "pinned cores" if r.get("pinned") else "cores shared"
        return (
            f"sync ÷ async wall time (server process, η = 2, {r.get('task', 'arithmetic')}; {pinned})",
            "≥ 0.9 × ceiling",
            f"{_med(s, 'seconds'):.1f}s vs {_med(a, 'seconds'):.1f}s for {s['samples']} samples; perfect-overlap ceiling "
            f"{_med(r, 'overlap_ceiling'):.2f}{share}{unpinned}; held-out accuracy "
            f"{_med(s, 'held_out_accuracy'):.2f} (sync) / {_med(a, 'held_out_accuracy'):.2f} (async)",
        )
    if n == "weight_sync":
        sec = r["seconds"]
        return (
            "server (HTTP) ÷ LocalEngine seconds, ~30M model",
            "–",
            f"LocalEngine {sec['local']['median']:.3f}s, server HTTP {sec['server_http']['median']:.3f}s, "
            f"server disk {sec['server_disk']['median']:.3f}s, server broadcast (gloo) "
            f"{sec.get('server_broadcast', {}).get('median', float('nan')):.3f}s ({r['settings']['bytes'] / 1e6:.0f} MB)",
        )
    if n.startswith("overhead"):

        def step(side: str) -> str:
            s = r[f"{side}_s_per_step"]
            return (
                f"{s['step'] * 1e3:.0f} ms = generation {s.get('generation', 0) * 1e3:.0f} + fwd/bwd/opt "
                f"{(s.get('forward', 0) + s.get('backward', 0) + s.get('optimizer', 0)) * 1e3:.0f} + overhead {s['overhead'] * 1e3:.0f}"
            )

        return (
            f"share of a relayrl step outside model compute ({r.get('task', 'arithmetic')})",
            "–",
            f"share of a step outside model compute: relayrl {r['relayrl_share']['median']:.0%}, TRL "
            f"{r['trl_share']['median']:.0%}; relayrl step {step('relayrl')}; TRL step {step('trl')}",
        )
    if n == "gpu":
        return (
            "LocalEngine ÷ HF `generate` tokens/s, 0.5B bf16, 256 long-tailed requests",
            "≥ 5; batch-1 ≥ 50% roofline; MFU ≥ 35%",
            f"{r['device']}: batch-1 decode {_f(r.get('batch1_roofline'), '{:.0%}')} of the HBM roofline, training packed ÷ "
            f"padded {_f(r.get('training_ratio'))}, train MFU {_f(r.get('train_mfu'), '{:.1%}')}",
        )
    if n == "mismatch":
        m, learn = r["mean_abs_diff"], r.get("learns", {})
        acc = ", ".join(
            f"{d} {v['held_out_accuracy_before']:.2f} → {v['held_out_accuracy_after']:.2f}" for d, v in learn.items()
        )
        return (
            "generator–trainer mean \\|Δ logprob\\| bf16 ÷ fp16, 12 tiny HF families (`python bench/mismatch.py`)",
            "fp16 cuts the bf16 gap several-fold; learns at every dtype",
            f"fp32 {m['float32']:.1e}, bf16 {m['bfloat16']:.1e}, fp16 {m['float16']:.1e}; GRPO recipe from "
            f"tests/data/demo_sft, held-out accuracy {acc}",
        )
    if n == "inspect":
        return (
            "seconds for `relayrl inspect` to show a 10,000-rollout run in headless Chromium",
            "< 1 s",
            f"{r['rollouts']} rollouts, {r['bytes_per_rollout']} B each; opening reads {r['server_open_s'] * 1e3:.1f} ms "
            f"of data vs {r['eager_parse_s']:.2f} s to parse every step ({r['eager_ratio']:.0f}x); page "
            f"{min(r['browser_open_s']):.2f}–{max(r['browser_open_s']):.2f} s over {len(r['browser_open_s'])} opens",
        )
    return "ratio", "–", ""


def describe_grpo(r: dict) -> tuple[str, str, str]:
    """grpo_vs_trl (short answers) and grpo_vs_trl_count (long-tailed completion lengths)."""
    rel, trl = r["relayrl"], r["trl"]
    sides = []
    for key, label in [
        ("ratio_inline_reward", "reward fn inline"),
        ("ratio_relayrl_inline", "reward fn inline"),
        ("ratio_relayrl_async", "relayrl η = 1 ÷ TRL"),
        ("ratio_async_vs_trl_2threads", "relayrl η = 1 ÷ TRL 2 threads"),
        ("ratio_trl_2threads", "TRL 2 threads ÷ 1 thread"),
    ]:
        if key in r:
            sides.append(
                f"{label}: **{_med(r, key):.2f}**" if key != "ratio_trl_2threads" else f"{label}: {_med(r, key):.2f}"
            )
    cpu = f"CPU per sample TRL ÷ relayrl {_med(r, 'cpu_efficiency_ratio'):.2f}; " if "cpu_efficiency_ratio" in r else ""
    lengths = ""
    if rel.get("completion_len_mean") and trl.get("completion_len_max_per_step"):
        lengths = f"completion length mean {trl['completion_len_mean']:.0f}, longest per step {trl['completion_len_max_per_step']:.0f} tokens; "
    what = (
        "relayrl ÷ TRL `GRPOTrainer` samples/s, long-tailed completions (count)"
        if r.get("task") == "count"
        else "relayrl ÷ TRL `GRPOTrainer` samples/s, short answers (arithmetic)"
    )
    goal = "≥ 3, reward no worse"
    real = str(r["settings"].get("warm_start", "")).startswith("/")  # --warm-start DIR: a real model
    if real:
        p, g = r["settings"]["prompts_per_step"], r["settings"]["group_size"]
        what += (
            f", from {r['settings']['warm_start'].rstrip('/').split('/')[-1]}, {p} × {g} a step (`--only {r['name']}`)"
        )
        goal = "≥ 1.5, peak RSS ≤ TRL's"
        cpu += f"peak RSS {_med(rel, 'peak_rss_mb'):.0f} vs {_med(trl, 'peak_rss_mb'):.0f} MB; "
    if "relayrl_async" in r:
        what += ", with relayrl η = 1 and TRL 2 threads (`--only grpo_vs_trl_count_async`)"
    elif r["settings"].get("sampling_seeds"):
        ss = r["settings"]["sampling_seeds"]
        what += f", prompts of seed {r['settings']['seeds'][0]}, sampling seeds {ss[0]}-{ss[-1]} (`--only {r['name']}`)"
    elif r["settings"].get("seeds", [0])[0]:
        seeds = r["settings"]["seeds"]
        which = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}-{seeds[-1]}"
        what += f", {which} (`--only {r['name']}`)"
    return (
        what,
        goal,
        f"{_med(rel, 'samples_per_s'):.3g} vs {_med(trl, 'samples_per_s'):.3g} samples/s; {'; '.join(sides) + '; ' if sides else ''}"
        f"{cpu}{lengths}held-out accuracy {r['held_out_accuracy_before']:.2f} → {_med(rel, 'held_out_accuracy'):.2f} (relayrl) / "
        f"{_med(trl, 'held_out_accuracy'):.2f} (TRL); last-5 train reward {_med(rel, 'final_reward'):.2f} / {_med(trl, 'final_reward'):.2f}",
    )


def render_table(results_dir: Path) -> str:
    results = {}
    for p in sorted(results_dir.glob("*.json")):
        r = json.loads(p.read_text())
        if isinstance(r, dict) and "name" in r and r["name"] != "run_all":
            results[r["name"]] = r
    timing = json.loads((results_dir / "run_all.json").read_text()) if (results_dir / "run_all.json").exists() else {}
    rows = [
        "| benchmark | headline number | median | spread (min–max) | goal | key figures | load avg | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in sorted(results, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER)):
        r = results[name]
        what, goal, key = describe(r)
        head = r.get("ratio") if r.get("ratio") is not None else r.get("figure")
        spread = f"{_f(r.get('ratio_min'))}–{_f(r.get('ratio_max'))}" if "ratio_min" in r else "–"
        load = "–" if "loadavg" not in r else f"{r['loadavg'][0]:.1f}"
        secs = timing.get("seconds", {}).get(name)
        rows.append(
            f"| `{name}` | {what} | **{_f(head)}** | {spread} | {goal} | {key} | {load} | {_f(secs, '{:.0f}')} |"
        )
    total = (
        f"\n\nLast full run: {timing['total_seconds'] / 60:.1f} minutes ({timing.get('date', '')})."
        if timing.get("total_seconds")
        else ""
    )
    return "\n".join(rows) + total


def write_docs(results_dir: Path, docs: Path = DOCS) -> None:
    text = docs.read_text() if docs.exists() else f"# Benchmarks\n\n{START}\n{END}\n"
    if START not in text or END not in text:
        text += f"\n{START}\n{END}\n"
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    docs.write_text(f"{head}{START}\n{render_table(results_dir)}\n{END}{tail}")
    print(f"wrote {docs}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated benchmark names")
    ap.add_argument("--skip", default="", help="comma-separated benchmark names")
    ap.add_argument("--quick", action="store_true", help="smoke run of the RL benchmarks (results under runs/bench)")
    ap.add_argument("--docs-only", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(BENCH))
    import common

    if args.docs_only:
        write_docs(common.results_dir())
        return
    names = (
        args.only.split(",")
        if args.only
        else [n for n in ORDER if n not in OPTIONAL and not (args.quick and n not in NEW)]
    )
    names = [n for n in names if n not in args.skip.split(",")]
    import torch

    if "gpu" in names and not torch.cuda.is_available():
        print("gpu: skipped (no CUDA device)")
        names.remove("gpu")
    t0 = time.monotonic()
    seconds: dict[str, float] = {}
    failed = []
    warm = sorted({RL_BENCHES[n] for n in names if n in RL_BENCHES})
    if warm and not args.quick:  # the SFT warm starts, once (cached), so their cost shows on its own
        _, seconds["sft_warm_start"] = run("common", warm)
    for name in names:
        extra = ["--quick"] if args.quick and name in NEW else QUICK_ARGS.get(name, []) if args.quick else []
        script, script_args = SCRIPTS.get(name, (name, []))
        result, seconds[name] = run(script, [*script_args, *extra])
        if result is None:
            failed.append(name)
    total = time.monotonic() - t0
    summary = {
        "name": "run_all",
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "total_seconds": round(total, 1),
        "failed": failed,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    out = common.results_dir(args.quick)
    out.mkdir(parents=True, exist_ok=True)
    if args.only and (out / "run_all.json").exists():  # a partial run updates its rows, keeps the full run's total
        full = json.loads((out / "run_all.json").read_text())
        summary = {**full, "seconds": {**full.get("seconds", {}), **summary["seconds"]}}
    (out / "run_all.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not args.quick:
        write_docs(out)
    print(f"\nall done in {total / 60:.1f} min; failed: {failed or 'none'}")
    print(json.dumps(summary))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
