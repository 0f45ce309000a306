"""``relayrl selftest [--out FILE]``: a minute-long check of this machine's engine, training and
weight-sync paths on a tiny model, with figures.

Each check compares a path against the tested one it must agree with: LocalEngine's static
decode steps, CUDA graphs and flash-attn decode against eager steps; packed training against one
forward per sequence; the generator's bf16 logprobs against the trainer's; a weight broadcast
(NCCL with two GPUs, else gloo) between two processes; release/resume of GPU memory; the KV budget
(preempting and continuing rows gives the same tokens). A fast path that fell back at first use
(``relayrl.utils.failsafe``) fails its check. Paths this machine lacks are skipped with the reason.
The table goes to stdout, everything to ``--out`` as JSON; the exit code is 1 when a check failed.
``bench/gpu.py`` is the performance counterpart.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import importlib.util
import json
import platform
import sys
import time
import typing
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn
from transformers import PreTrainedModel

from relayrl.api.config import InferenceConfig, ModelConfig, OptimizerConfig, TrainEngineConfig
from relayrl.api.io import GenerationConfig, ModelRequest, ModelResponse
from relayrl.api.workflow import concat_trajectories, trajectory_from_response
from relayrl.data.models import build_tiny_model
from relayrl.inference.local import LocalEngine
from relayrl.inference.local.device import resolve_device
from relayrl.inference.weight_group import WeightBroadcastGroup
from relayrl.train.engine import TorchTrainEngine
from relayrl.utils import failsafe

PROMPTS = [[3, 10 + i, 20 + 2 * i, 7, 9 + i, 40 - i][: 2 + i % 5] for i in range(8)]  # lengths 2..6: left padding
GEN = GenerationConfig(max_new_tokens=24, greedy=True, ignore_eos=True)
BF16_MEAN, BF16_MAX = 0.01, 0.05  # generator (bf16 weights) vs trainer, nats per token (CPU: 0.0025, 0.008)


@dataclasses.dataclass
class Check:
    """One row of the table: ``status`` is pass, fail or skip."""

    name: str
    status: str
    figure: str
    detail: str = ""
    values: dict[str, float] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


def engine(model: PreTrainedModel, device: str, static: bool | None = None, **cfg: object) -> LocalEngine:
    """A LocalEngine over a copy of ``model`` (``with engine(...)`` initializes and destroys it)."""
    return LocalEngine(InferenceConfig(device=device, **cfg), model=copy.deepcopy(model), static_steps=static)  # type: ignore[arg-type]


def answers(eng: LocalEngine) -> list[ModelResponse]:
    """``eng``'s responses to every prompt of ``PROMPTS``, requested at once."""

    async def go() -> list[ModelResponse]:
        return list(
            await asyncio.gather(*(eng.agenerate(ModelRequest(f"r{i}", p, GEN)) for i, p in enumerate(PROMPTS)))
        )

    return asyncio.run(go())


def generate(
    model: PreTrainedModel, device: str, static: bool, **cfg: object
) -> tuple[list[ModelResponse], LocalEngine]:
    """Greedy responses of a LocalEngine over a copy of ``model`` (destroyed before returning)."""
    with engine(model, device, static, **cfg) as eng:
        return answers(eng), eng


def verdict(
    name: str, ok: bool, figure: str, detail: str, values: dict[str, float], t0: float, before: set[str] | None = None
) -> Check:
    """The row of a check that passes when ``ok``, timed from ``t0``; with ``before`` (the fast paths
    that had fallen back when it started), one that fell back since fails, naming it."""
    new = {k: v for k, v in failsafe.FALLBACKS.items() if before is not None and k not in before}
    fell = "; ".join(f"{k} fell back: {v}" for k, v in new.items())
    return Check(name, "pass" if ok and not fell else "fail", figure, fell or detail, values, time.perf_counter() - t0)


def as_dtype(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A copy of ``model`` in ``dtype``."""
    return typing.cast(PreTrainedModel, typing.cast(nn.Module, copy.deepcopy(model)).to(dtype))


def compare(a: list[ModelResponse], b: list[ModelResponse]) -> tuple[int, float]:
    """(rows whose tokens are identical, largest logprob difference over the tokens they share)."""
    same, gap = 0, 0.0
    for x, y in zip(a, b, strict=True):
        same += x.output_tokens == y.output_tokens
        n = next(
            (i for i, (s, t) in enumerate(zip(x.output_tokens, y.output_tokens, strict=False)) if s != t),
            len(x.output_tokens),
        )
        if n:
            gap = max(
                gap, float((torch.tensor(x.output_logprobs[:n]) - torch.tensor(y.output_logprobs[:n])).abs().max())
            )
    return same, gap


def check_decode(model: PreTrainedModel, device: torch.device, eager: list[ModelResponse]) -> list[Check]:
    """Static decode steps (and on CUDA the captured graphs, flash-attn) against ``eager`` steps' responses."""
    dev = str(device)
    out: list[Check] = []
    graphs_skip = "" if device.type == "cuda" else "no CUDA device"
    flash_skip = graphs_skip or ("" if importlib.util.find_spec("flash_attn") else "flash-attn is not installed")
    half = as_dtype(model, torch.bfloat16)
    variants = [  # (name, model, CUDA graphs, why skipped)
        ("decode: static steps = eager", model, False, ""),
        ("decode: CUDA graphs = eager", model, True, graphs_skip),
        ("decode: flash-attn = SDPA (bf16)", half, True, flash_skip),
    ]
    for name, m, graphs, skip in variants:
        if skip:
            out.append(Check(name, "skip", "-", skip))
            continue
        t0, before = time.perf_counter(), set(failsafe.FALLBACKS)
        got, eng = generate(m, dev, True, cuda_graphs=graphs)
        flash = m is half  # compared with eager steps on the same bf16 weights
        same, gap = compare(got, generate(half, dev, False, cuda_graphs=False)[0] if flash else eager)
        tol = 0.1 if flash else 1e-4
        need = len(PROMPTS) - (1 if flash else 0)  # bf16: a near-tie may flip one greedy row
        static = eng._static
        used = f"attention={static.attention}, graphs captured={static.captures}" if static is not None else ""
        figure = f"{same}/{len(PROMPTS)} rows equal, max |dlogp| {gap:.2g} (bound {tol:g})"
        values = {"rows_equal": same, "max_logprob_gap": gap}
        out.append(verdict(name, same >= need and gap <= tol, figure, used, values, t0, before))
    return out


def train_engine(model: PreTrainedModel, attn: str = "varlen", bf16: bool = False) -> TorchTrainEngine:
    cfg = TrainEngineConfig(mb_max_tokens=4096, optimizer=OptimizerConfig(lr=1e-4), total_steps=1, bf16=bf16)
    eng = TorchTrainEngine(cfg, ModelConfig(attn_impl=attn), model=copy.deepcopy(model))
    eng.initialize()
    return eng


def batch_of(responses: list[ModelResponse]) -> dict[str, torch.Tensor]:
    return concat_trajectories([trajectory_from_response(r, 0.0) for r in responses])


def check_packed(model: PreTrainedModel, device: torch.device, batch: dict[str, torch.Tensor]) -> Check:
    """Packed micro-batches (relayrl_varlen attention) against one plain forward per sequence."""
    t0 = time.perf_counter()
    packed = train_engine(model).forward(batch)
    ref = typing.cast(nn.Module, copy.deepcopy(model)).to(device).eval()
    gap = 0.0
    with torch.no_grad():
        for i, n in enumerate(batch["attention_mask"].sum(1).tolist()):
            ids = batch["input_ids"][i : i + 1, :n].to(device)
            logp = torch.log_softmax(ref(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            gap = max(gap, float((packed[i, 1:n] - logp.cpu()).abs().max()))
    tol = 1e-4
    figure, detail = f"max |dlogp| {gap:.2g} (bound {tol:g})", f"{len(batch['input_ids'])} sequences"
    return verdict("train: packed = per sequence", gap <= tol, figure, detail, {"max_logprob_gap": gap}, t0)


def check_bf16_gap(model: PreTrainedModel, device: torch.device) -> Check:
    """The generator on bf16 weights against the trainer (bf16 autocast on CUDA, fp32 elsewhere)."""
    t0, before = time.perf_counter(), set(failsafe.FALLBACKS)
    responses, _ = generate(as_dtype(model, torch.bfloat16), str(device), False, cuda_graphs=False)
    batch = batch_of(responses)
    trainer = train_engine(model, attn="auto", bf16=True).forward(batch)
    mask = batch["loss_mask"].bool()
    diff = (trainer[mask] - batch["logprobs"][mask]).abs()
    mean, top = float(diff.mean()), float(diff.max())
    ok = mean <= BF16_MEAN and top <= BF16_MAX
    figure = f"mean |dlogp| {mean:.3g} (bound {BF16_MEAN:g}), max {top:.3g} (bound {BF16_MAX:g})"
    values = {"mean_gap": mean, "max_gap": top}
    return verdict("logprobs: generator bf16 vs trainer", ok, figure, f"{int(mask.sum())} tokens", values, t0, before)


def _receiver(port: int, backend: str, result: mp.SimpleQueue) -> None:
    """Rank 1 of the weight group: receives into a differently seeded model, reports the largest difference."""
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(1)
    model = build_tiny_model("tiny", seed=1)
    group = WeightBroadcastGroup("127.0.0.1", port, 2, 1, backend=backend, timeout_s=60)
    state = dict(model.state_dict())
    group.broadcast(state)
    sent = build_tiny_model("tiny", seed=0).state_dict()
    result.put(max(float((state[k] - v).abs().max()) for k, v in sent.items()))


def check_broadcast() -> Check:
    """A weight broadcast from this process (rank 0, the trainer) to a second one (rank 1, a server)."""
    t0 = time.perf_counter()
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    why = "NCCL between 2 GPUs" if backend == "nccl" else "gloo (NCCL needs 2 GPUs: one per rank)"
    ctx = mp.get_context("spawn")
    result = ctx.SimpleQueue()
    model = build_tiny_model("tiny", seed=0)
    group = WeightBroadcastGroup("127.0.0.1", 0, 2, 0, backend=backend, timeout_s=60)
    child = ctx.Process(target=_receiver, args=(group.port, backend, result), daemon=True)
    child.start()
    try:
        t1 = time.perf_counter()
        group.broadcast(dict(model.state_dict()))
        sent_s = time.perf_counter() - t1
        child.join(timeout=120)
        gap = result.get() if child.exitcode == 0 else float("inf")
    finally:
        if child.is_alive():
            child.kill()
    mb = sum(p.numel() * p.element_size() for p in model.state_dict().values()) / 2**20
    figure = f"{mb:.1f} MB in {sent_s:.2f}s (the receiver's start included), max |diff| after {gap:g}"
    values = {"mb": mb, "seconds": sent_s, "max_diff": gap}
    return verdict(f"weights: broadcast ({backend})", gap == 0.0, figure, why, values, t0)


def check_release(model: PreTrainedModel, device: torch.device) -> Check:
    """release_memory(weights=True) then resume_memory(): the same tokens, memory freed on CUDA."""
    t0, before = time.perf_counter(), set(failsafe.FALLBACKS)
    with engine(model, str(device)) as eng:
        first = answers(eng)
        held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        eng.release_memory(weights=True)
        freed = (held - torch.cuda.memory_allocated(device)) / 2**20 if device.type == "cuda" else 0.0
        eng.resume_memory()
        again = answers(eng)
    same, gap = compare(again, first)
    ok = same == len(PROMPTS) and gap <= 1e-5 and (device.type != "cuda" or freed > 0)
    where = f"{freed:.1f} MB freed while released" if device.type == "cuda" else "CPU: weights stay in place"
    figure = f"{same}/{len(PROMPTS)} rows equal after resume, {where}"
    return verdict("memory: release/resume", ok, figure, "", {"rows_equal": same, "freed_mb": freed}, t0, before)


def check_kv_budget(model: PreTrainedModel, device: torch.device) -> Check:
    """The KV budget this machine gets, and a budget too small for the batch: rows are preempted and
    continued with the same tokens."""
    t0 = time.perf_counter()
    full, eng = generate(model, str(device), False)
    capacity, by = eng.kv_capacity, eng.kv_capacity_by
    with engine(model, str(device)) as small:
        small.kv_capacity = 96  # fewer cells than the 8 rows need: some wait or are preempted
        tight = answers(small)
    same, gap = compare(tight, full)
    peak, pre = small.counters["kv_peak"], small.counters["preemptions"]
    ok = same == len(PROMPTS) and gap <= 1e-4 and peak <= 96 + len(PROMPTS)
    figure = (
        f"budget {capacity} tokens ({by}); at 96: peak {peak} cells, {pre} preempted, {same}/{len(PROMPTS)} rows equal"
    )
    return verdict("KV budget", ok, figure, "", {"capacity": capacity, "peak": peak, "preemptions": pre}, t0)


def run_checks(device: torch.device) -> list[Check]:
    model = build_tiny_model("tiny", seed=0).eval()
    responses, _ = generate(model, str(device), False, cuda_graphs=False)
    checks = check_decode(model, device, responses)
    steps: list[tuple[str, Callable[[], Check]]] = [
        ("train: packed = per sequence", lambda: check_packed(model, device, batch_of(responses))),
        ("logprobs: generator bf16 vs trainer", lambda: check_bf16_gap(model, device)),
        ("weights: broadcast", check_broadcast),
        ("memory: release/resume", lambda: check_release(model, device)),
        ("KV budget", lambda: check_kv_budget(model, device)),
    ]
    for name, step in steps:
        try:
            checks.append(step())
        except Exception as e:  # noqa: BLE001 - a check that crashes is a failed check, the others still run
            checks.append(Check(name, "fail", "raised", failsafe.reason(e)))
    return checks


def table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    rows = [
        f"{c.status.upper():5} {c.name:<{width}}  {c.figure}" + (f"  [{c.detail}]" if c.detail else "") for c in checks
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="relayrl selftest", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="relayrl-selftest.json", help="where the JSON report goes")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)
    device = resolve_device(ns.device)
    t0 = time.perf_counter()
    print(f"relayrl selftest on {device} (torch {torch.__version__}); about a minute", flush=True)
    checks = run_checks(device)
    failed = [c.name for c in checks if c.status == "fail"]
    report = {
        "ok": not failed,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "flash_attn": importlib.util.find_spec("flash_attn") is not None,
        "seconds": time.perf_counter() - t0,
        "fallbacks": dict(failsafe.FALLBACKS),
        "checks": [dataclasses.asdict(c) for c in checks],
    }
    Path(ns.out).write_text(json.dumps(report, indent=2) + "\n")
    print(table(checks))
    print(
        f"{len(checks) - len(failed)} of {len(checks)} checks passed or skipped in {report['seconds']:.0f}s; report: {ns.out}"
    )
    if failed:
        print(
            f"FAILED: {', '.join(failed)}. Please attach {ns.out} to a relayrl issue (it names the machine and every figure)",
            file=sys.stderr,
        )
        return 1
    return 0
