"""Replay a recorded step and attribute the generator–trainer gap to its causes.

The observed gap is ``mean |g - t|`` over the loss tokens (``g`` the generator's logprobs, ``t`` the
trainer's from the update). The step's tokens are rescored at the recorded weights by plain
forwards: ``r``, the exact reference (fp32, eval mode, the model's own routing, full softmax at the
sampling temperature), and one variant per cause with only that cause switched on. Each cause's
contribution, as a share of the gap:

- staleness: the whole gap of tokens a stale version generated (the weights that made them are gone);
- token drift: tokens the generator cannot have scored as the trainer's input holds them (its
  logprob is over 1 nat from every variant: a workflow re-tokenised or edited the text);
- temperature (the logprobs of the raw distribution, temperature 1, as a server reporting
  unprocessed logprobs gives them; or of the sampling temperature where the trainer's differs),
  sampling renormalisation (top-p / top-k), dtype and autocast (the body at ``model.dtype``, bf16
  when the run is fp32), LM-head precision (logits rounded to that dtype), MoE routing (the
  generator's recorded experts instead of the trainer's own): how much closer the variant brings
  the reference to the generator's logprobs, plus to the trainer's;
- dropout: the change dropout makes to the trainer's logprobs when the update ran with it;
- unexplained: what the causes above leave.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from relayrl.doctor.record import record_dir
from relayrl.utils.moe import RoutingReplay, routing_shape
from relayrl.utils.safeload import load_state_file

HEALTHY = 1e-4  # mean |Δ logprob| below this: the two sides agree (fp32 kernels differ by ~1e-6)
DRIFT_NATS = 1.0
CAUSES = (
    "staleness",
    "token drift",
    "temperature",
    "sampling renormalisation",
    "dtype / autocast",
    "LM-head precision",
    "MoE routing",
    "dropout",
    "unexplained",
)


def latest_step(run_dir: str | Path) -> int:
    steps = [int(p.parent.name.removeprefix("step_")) for p in (Path(run_dir) / "doctor").glob("step_*/record.pt")]
    if not steps:
        raise FileNotFoundError(
            f"{run_dir} has no doctor records (RUN_DIR/doctor/step_N/record.pt); train with logging.doctor_every > 0"
        )
    return max(steps)


def _filtered(logits: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Logits with everything outside top-k / the top-p nucleus at -inf (as the generator samples)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        srt, idx = logits.sort(-1, descending=True)
        probs = srt.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return logits


class _Scorer:
    """Token logprobs ``[B, L]`` of the recorded batch under the recorded weights, one knob at a time."""

    def __init__(self, model: PreTrainedModel, batch: dict[str, torch.Tensor], temperature: float):
        self.model, self.batch, self.temperature = model, batch, temperature
        self.moe = RoutingReplay(model) if routing_shape(model) is not None else None

    def logits(self, dtype: torch.dtype = torch.float32, train: bool = False, experts: bool = False) -> torch.Tensor:
        model = typing.cast(nn.Module, self.model).to(dtype)
        model.train(train)
        ids, am = self.batch["input_ids"], self.batch["attention_mask"]
        if self.moe is not None:
            rec = self.batch.get("routed_experts") if experts else None
            self.moe.ids = None if rec is None else rec[am.bool()].view(-1, *rec.shape[2:])
        with torch.no_grad():
            pos = (am.long().cumsum(1) - 1).clamp(min=0)
            out = model(input_ids=ids, attention_mask=am.long(), position_ids=pos).logits
        typing.cast(nn.Module, self.model).to(torch.float32).eval()
        return out

    def logp(
        self,
        logits: torch.Tensor,
        top_p: float = 1.0,
        top_k: int = 0,
        round_to: torch.dtype | None = None,
        temperature: float | None = None,
    ) -> torch.Tensor:
        """``[B, L]`` logprobs at ``temperature`` (default: the trainer's), after top-k / top-p."""
        lg = logits.float()
        if round_to is not None:
            lg = lg.to(round_to).float()
        lg = _filtered(lg / (self.temperature if temperature is None else temperature), top_p, top_k)
        ids = self.batch["input_ids"]
        lp = lg[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return torch.cat([torch.zeros_like(lp[:, :1]), lp], 1)


def diagnose(run_dir: str | Path, step: int | None = None) -> dict:
    """The report of step ``step`` (default: the latest recorded): the observed gap, each cause's
    contribution and share, the top cause, and whether the run is healthy."""
    step = latest_step(run_dir) if step is None else step
    where = record_dir(run_dir, step)
    if not (where / "record.pt").exists():
        raise FileNotFoundError(f"no doctor record for step {step} in {run_dir}/doctor (have: {latest_step(run_dir)})")
    rec = load_state_file(where / "record.pt")
    batch = rec["batch"]
    model = AutoModelForCausalLM.from_pretrained(str(where / "model"), dtype=torch.float32)
    s = _Scorer(model, batch, float(rec["temperature"]))
    mask = batch["loss_mask"].bool()
    g, t = batch["logprobs"].double(), rec["trainer_logp"].double()
    n = max(int(mask.sum()), 1)
    observed = float((g - t).abs()[mask].sum()) / n
    low = getattr(torch, rec["dtype"]) if rec["dtype"] != "float32" else torch.bfloat16
    base = s.logits()
    r = s.logp(base).double()
    # temperatures a generator may have reported at instead of the trainer's: the raw distribution's
    # (1.0) and the sampling temperature; the one that explains more of the gap is the variant
    temps = {1.0, 1.0 if rec["gconfig"]["greedy"] else float(rec["gconfig"]["temperature"])} - {s.temperature}
    variants = {
        "sampling renormalisation": s.logp(base, rec["top_p"], rec["top_k"]),
        "dtype / autocast": s.logp(s.logits(low)),
        "LM-head precision": s.logp(base, round_to=low),
    }
    if s.moe is not None and "routed_experts" in batch:
        variants["MoE routing"] = s.logp(s.logits(experts=True))
    temp_variants = {temp: s.logp(base, temperature=temp) for temp in sorted(temps)}
    lag = rec["version"] - batch["versions"].long() if "versions" in batch else torch.zeros_like(g, dtype=torch.long)
    stale = mask & (lag > 0)
    fresh = mask & ~stale
    closest = torch.stack([(g - v.double()).abs() for v in [r, *variants.values(), *temp_variants.values()]])
    closest = closest.min(0).values
    drift = fresh & (closest > DRIFT_NATS)
    keep = fresh & ~drift
    gap = (g - t).abs()
    contrib = {c: 0.0 for c in CAUSES}
    contrib["staleness"] = float(gap[stale].sum()) / n
    contrib["token drift"] = float(gap[drift].sum()) / n

    def closed(v: torch.Tensor) -> float:
        """How much closer ``v`` brings the reference to the generator's logprobs, plus to the trainer's."""
        v = v.double()
        gen_side = float(((g - r).abs() - (g - v).abs())[keep].sum())
        trainer_side = float(((t - r).abs() - (t - v).abs())[keep].sum())
        return (max(0.0, gen_side) + max(0.0, trainer_side)) / n

    for cause, v in variants.items():
        contrib[cause] = closed(v)
    by_temp = {temp: closed(v) for temp, v in temp_variants.items()}
    contrib["temperature"] = max(by_temp.values(), default=0.0)
    if rec["dropout"]:
        contrib["dropout"] = float((s.logp(s.logits(train=True)).double() - r).abs()[keep].sum()) / n
    explained = sum(contrib.values())
    contrib["unexplained"] = max(0.0, observed - explained)
    total = max(observed, explained + contrib["unexplained"], 1e-30)
    ranked = sorted(CAUSES, key=lambda c: -contrib[c])
    return {
        "run_dir": str(run_dir),
        "step": step,
        "tokens": n,
        "observed_abs_diff_mean": observed,
        "healthy": observed < HEALTHY,
        "top_cause": None if observed < HEALTHY else ranked[0],
        "causes": {c: {"abs_diff": contrib[c], "share": contrib[c] / total} for c in ranked},
        "settings": {k: rec[k] for k in ("dtype", "bf16_autocast", "dropout", "top_p", "top_k", "temperature")},
        # the temperature the generator's logprobs look like, when one of the candidates closes part of the gap
        "generator_temperature": max(by_temp, key=lambda k: by_temp[k]) if contrib["temperature"] > 0 else None,
        "stale_tokens": int(stale.sum()),
        "drifted_tokens": int(drift.sum()),
    }


def report_text(rep: dict) -> str:
    lines = [
        f"relayrl doctor: {rep['run_dir']} step {rep['step']}: mean |Δ logprob| generator vs trainer "
        f"{rep['observed_abs_diff_mean']:.3g} over {rep['tokens']} tokens"
    ]
    if rep["healthy"]:
        lines.append(f"healthy: the generator and the trainer agree (below {HEALTHY:g}); nothing to correct")
        return "\n".join(lines)
    lines.append(f"{'cause':<26} {'mean |Δ|':>10} {'share':>7}")
    for cause, v in rep["causes"].items():
        if v["share"] >= 0.005:
            lines.append(f"{cause:<26} {v['abs_diff']:>10.3g} {100 * v['share']:>6.1f}%")
    lines.append(f"top cause: {rep['top_cause']} (docs/mismatch.md says what to do about it)")
    if rep["top_cause"] == "temperature":
        lines.append(
            f"the generator's logprobs look like temperature {rep['generator_temperature']:g}; "
            f"the trainer's are at {rep['settings']['temperature']:g}"
        )
    return "\n".join(lines)


def run(run_dir: str, step: int | None = None) -> dict:
    """Diagnose, print the table, write ``RUN_DIR/doctor/report_step_N.json``; returns the report."""
    rep = diagnose(run_dir, step)
    print(report_text(rep))
    out = Path(run_dir) / "doctor" / f"report_step_{rep['step']}.json"
    out.write_text(json.dumps(rep, indent=2))
    print(f"wrote {out}")
    return rep
