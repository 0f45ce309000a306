"""Rollout workflows, the Trajectory format, and sample status accounting.

A **Trajectory** is a dict of tensors describing one or more episodes, right-padded:

================  =========  ==========  ===============================================
key               shape      dtype       meaning
================  =========  ==========  ===============================================
input_ids         [B, L]     int64       prompt + completion tokens
attention_mask    [B, L]     bool        1 on real tokens, 0 on right padding
loss_mask         [B, L]     bool/int    1 on tokens the policy generated (trained on)
logprobs          [B, L]     float32     behaviour logprob of each generated token, 0 elsewhere
versions          [B, L]     int64       weight version that generated the token, -1 elsewhere
rewards           [B]        float32     one scalar reward per sequence
================  =========  ==========  ===============================================

Every other key is carried through untouched (token-level extras must be ``[B, L]``,
sequence-level extras ``[B]``). The trainer adds ``old_logp``, ``ref_logp``, ``values``,
``advantages`` and ``returns``.

Episodes with images carry the processor's outputs (Hugging Face names), right-padded with
zeros per row like the token keys but along their own length:

================  ===========  =======  =============================================
pixel_values      [B, P, D]    float    the patches of the row's images, then zeros
image_grid_thw    [B, N, 3]    int64    (t, h, w) patches of each image, then (0, 0, 0)
================  ===========  =======  =============================================

A row's images are its grid rows with ``t*h*w > 0``; its patches are the first
``sum(t*h*w)`` rows of ``pixel_values``; its prompt holds ``t*h*w / merge**2`` image pad
tokens per image (never in the loss: they are prompt tokens).
"""

from __future__ import annotations

import abc
import enum
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch.nn import functional

from relayrl.api.engine import DataItem, TensorDict
from relayrl.api.io import ModelResponse

if TYPE_CHECKING:
    from relayrl.api.engine import InferenceEngine

Trajectory = TensorDict
# A reward function: ``(prompt, completions, prompt_ids, completion_ids, **row) -> float`` (the row's
# other fields, e.g. ``answer``, as keywords); declared here once, used by workflows, pools and wiring.
RewardFn = Callable[..., float]

REQUIRED_KEYS: dict[str, tuple[str, tuple[torch.dtype, ...]]] = {
    # key: (level, allowed dtypes)
    "input_ids": ("token", (torch.int64, torch.int32)),
    "attention_mask": ("token", (torch.bool, torch.int64, torch.int32)),
    "loss_mask": ("token", (torch.bool, torch.int64, torch.int32)),
    "logprobs": ("token", (torch.float32, torch.float64)),
    "versions": ("token", (torch.int64, torch.int32)),
    "rewards": ("seq", (torch.float32, torch.float64)),
}
# Per-episode vision inputs: [B, N, ...] right-padded with zeros to the batch's largest N.
VISION_KEYS = ("pixel_values", "image_grid_thw")
# Keys the trainer adds; validated for shape when present.
TOKEN_KEYS = ("old_logp", "ref_logp", "values", "advantages", "returns", "prox_logp")


class TrajectoryError(ValueError):
    """A trajectory has a missing key, wrong shape, wrong dtype or inconsistent masks."""


def validate_trajectory(traj: Trajectory, vocab_size: int | None = None) -> None:
    """Raise ``TrajectoryError`` naming the key and what was expected, or return None
    (``vocab_size``: token ids must be below it, when known)."""
    if not isinstance(traj, dict):
        raise TrajectoryError(f"trajectory must be a dict of tensors, got {type(traj).__name__}")
    for key, (_, dtypes) in REQUIRED_KEYS.items():
        if key not in traj:
            raise TrajectoryError(f"trajectory is missing key {key!r} (required: {sorted(REQUIRED_KEYS)})")
        if not isinstance(traj[key], torch.Tensor):
            raise TrajectoryError(f"trajectory[{key!r}] must be a torch.Tensor, got {type(traj[key]).__name__}")
        if traj[key].dtype not in dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise TrajectoryError(f"trajectory[{key!r}] has dtype {traj[key].dtype}, expected one of: {names}")
    ids = traj["input_ids"]
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise TrajectoryError(f"trajectory['input_ids'] must be [B, L] with L > 0, got shape {tuple(ids.shape)}")
    bsz, seqlen = ids.shape
    for key, value in traj.items():
        if not isinstance(value, torch.Tensor):
            continue
        level = REQUIRED_KEYS[key][0] if key in REQUIRED_KEYS else ("token" if key in TOKEN_KEYS else None)
        if level == "token" and tuple(value.shape) != (bsz, seqlen):
            raise TrajectoryError(
                f"trajectory[{key!r}] must have shape [B, L] = {[bsz, seqlen]}, got {list(value.shape)}"
            )
        if level == "seq" and tuple(value.shape) != (bsz,):
            raise TrajectoryError(f"trajectory[{key!r}] must have shape [B] = {[bsz]}, got {list(value.shape)}")
        if level is None and (value.dim() == 0 or value.shape[0] != bsz):
            raise TrajectoryError(f"extra key {key!r} must have batch size {bsz} in dim 0, got {list(value.shape)}")
    attn = traj["attention_mask"].bool()
    loss = traj["loss_mask"].bool()
    if not bool(attn[:, 0].all()):
        raise TrajectoryError("trajectory['attention_mask'] must start with 1 on every row (right padding only)")
    lengths = attn.sum(1)
    positions = torch.arange(seqlen).unsqueeze(0)
    if not torch.equal(attn, positions < lengths.unsqueeze(1)):
        raise TrajectoryError("trajectory['attention_mask'] must be 1s then 0s on every row (right padding only)")
    if bool((loss & ~attn).any()):
        raise TrajectoryError("trajectory['loss_mask'] is 1 on a padding position (attention_mask == 0)")
    if bool(loss[:, 0].any()):
        raise TrajectoryError("trajectory['loss_mask'] is 1 on the first token; a sequence needs a prompt token")
    if not bool(loss.any(1).all()):
        row = int((~loss.any(1)).nonzero()[0])
        raise TrajectoryError(f"trajectory['loss_mask'] selects no token in row {row}; every row needs a completion")
    if bool((traj["logprobs"][~loss] != 0).any()):
        raise TrajectoryError("trajectory['logprobs'] must be 0 where loss_mask is 0 (prompt, tool output, padding)")
    if bool((ids < 0).any()) or (vocab_size is not None and bool((ids >= vocab_size).any())):
        worst = int(ids.max()) if bool((ids >= 0).all()) else int(ids.min())
        raise TrajectoryError(
            f"trajectory['input_ids'] holds {worst}, outside the vocabulary [0, {vocab_size or '...'})"
        )
    if not bool(traj["logprobs"].isfinite().all()):
        raise TrajectoryError("trajectory['logprobs'] contains NaN or inf")
    if bool((traj["logprobs"][loss] > 1e-4).any()):
        raise TrajectoryError("trajectory['logprobs'] has a positive value; logprobs must be <= 0")
    if bool((traj["versions"][~loss] != -1).any()):
        raise TrajectoryError("trajectory['versions'] must be -1 where loss_mask is 0")
    if bool((traj["versions"][loss] < 0).any()):
        raise TrajectoryError("trajectory['versions'] must be >= 0 on generated tokens")
    if not bool(torch.isfinite(traj["rewards"]).all()):
        raise TrajectoryError("trajectory['rewards'] contains NaN or inf")
    if ("pixel_values" in traj) != ("image_grid_thw" in traj):
        raise TrajectoryError("trajectory needs both 'pixel_values' and 'image_grid_thw' (or neither)")
    if "image_grid_thw" in traj:
        grid, pixels = traj["image_grid_thw"], traj["pixel_values"]
        if grid.dim() != 3 or grid.shape[2] != 3 or pixels.dim() != 3:
            raise TrajectoryError(
                f"trajectory['image_grid_thw'] must be [B, N, 3] and 'pixel_values' [B, P, D], got "
                f"{list(grid.shape)} and {list(pixels.shape)}"
            )
        need = grid.prod(-1).sum(1)
        if bool((need > pixels.shape[1]).any()):
            row = int((need > pixels.shape[1]).nonzero()[0])
            raise TrajectoryError(
                f"trajectory row {row}: image_grid_thw needs {int(need[row])} patches, pixel_values has {pixels.shape[1]}"
            )


def trajectory_from_response(resp: ModelResponse, reward: float, **extras: torch.Tensor) -> Trajectory:
    """A one-row Trajectory for a single-turn episode: prompt then completion (with
    ``routed_experts [1, L, n_moe_layers, top_k]`` when the generator recorded them, -1 on the last token)."""
    n_in, n_out = resp.input_len, resp.output_len
    if resp.routed_experts is not None:
        extras = {"routed_experts": routed_experts_row(resp.routed_experts, n_in + n_out), **extras}
    return {
        "input_ids": torch.tensor([resp.input_tokens + resp.output_tokens], dtype=torch.int64),
        "attention_mask": torch.ones(1, n_in + n_out, dtype=torch.bool),
        "loss_mask": torch.tensor([[0] * n_in + [1] * n_out], dtype=torch.bool),
        "logprobs": torch.tensor([[0.0] * n_in + list(resp.output_logprobs)], dtype=torch.float32),
        "versions": torch.tensor([[-1] * n_in + list(resp.output_versions)], dtype=torch.int64),
        "rewards": torch.tensor([float(reward)], dtype=torch.float32),
        **extras,
    }


def routed_experts_row(ids: torch.Tensor, length: int) -> torch.Tensor:
    """``[1, length, n_moe_layers, top_k]`` from a response's ``[n, n_moe_layers, top_k]`` ids of its
    first ``n`` tokens (-1 where nothing was recorded)."""
    n = min(ids.shape[0], length)
    row = torch.full((1, length, *ids.shape[1:]), -1, dtype=torch.int32)
    row[0, :n] = ids[:n]
    return row


def concat_trajectories(trajs: Sequence[Trajectory]) -> Trajectory:
    """Concatenate along the batch dimension, right-padding token-level keys to the longest.

    Padding values: 0 for every key except ``versions`` and ``routed_experts`` (-1).
    """
    if not trajs:
        raise ValueError("concat_trajectories needs at least one trajectory")
    keys = set(trajs[0]) - set(VISION_KEYS)
    for i, t in enumerate(trajs):
        if set(t) - set(VISION_KEYS) != keys:
            raise TrajectoryError(f"trajectory {i} has keys {sorted(t)}, expected {sorted(keys)}")
    seqlen = max(t["input_ids"].shape[1] for t in trajs)
    out: Trajectory = {}
    for key in VISION_KEYS:  # episodes without images get none (a text-only episode among image ones)
        have = [t[key] for t in trajs if key in t]
        if have:
            width = max(v.shape[1] for v in have)
            parts = [
                t[key] if key in t else have[0].new_zeros(t["input_ids"].shape[0], 0, *have[0].shape[2:]) for t in trajs
            ]
            out[key] = torch.cat([functional.pad(v, (0, 0, 0, width - v.shape[1])) for v in parts])
    for key in trajs[0]:
        if key in VISION_KEYS:
            continue
        parts = []
        for t in trajs:
            v = t[key]
            is_token = v.dim() >= 2 and v.shape[1] == t["input_ids"].shape[1] and key != "rewards"
            if is_token and v.shape[1] < seqlen:  # right-pad dim 1 (pad's spec runs from the last dim)
                fill = -1 if key in ("versions", "routed_experts") else 0
                v = functional.pad(v, (0, 0) * (v.dim() - 2) + (0, seqlen - v.shape[1]), value=fill)
            parts.append(v)
        out[key] = torch.cat(parts, dim=0)
    return out


class RolloutWorkflow(abc.ABC):
    """How one episode is generated and rewarded.

    ``arun_episode`` runs on the executor's event loop; it awaits ``engine.agenerate`` as
    often as it likes (several samples, several turns, tool calls) and returns a
    Trajectory (one or more rows) or ``None`` to reject the episode.
    """

    @abc.abstractmethod
    async def arun_episode(self, engine: InferenceEngine, data: DataItem) -> Trajectory | None: ...


class SampleStatus(enum.Enum):
    """How a submitted episode ended (exactly one per episode)."""

    COMPLETED = "completed"  # accepted into a batch
    FILTERED = "filtered"  # rejected by the workflow (None) or by the group accept function
    FAILED = "failed"  # the workflow raised
    ABORTED = "aborted"  # cancelled (shutdown, tail-batch discard)
    EXPIRED = "expired"  # too stale to train on when it came out


class StatusCounter:
    """Counts episodes by status and checks that they reconcile with what was submitted."""

    def __init__(self) -> None:
        self.submitted = 0
        self.counts: Counter[SampleStatus] = Counter()

    def submit(self, n: int = 1) -> None:
        self.submitted += n

    def finish(self, status: SampleStatus, n: int = 1) -> None:
        if self.finished + n > self.submitted:
            raise RuntimeError(
                f"status accounting broken: {self.finished + n} episodes finished but only {self.submitted} submitted"
            )
        self.counts[status] += n

    @property
    def finished(self) -> int:
        return sum(self.counts.values())

    @property
    def in_flight(self) -> int:
        return self.submitted - self.finished

    def reconcile(self) -> None:
        """Raise if some submitted episode has no final status."""
        if self.in_flight != 0:
            raise RuntimeError(
                f"status accounting: {self.submitted} submitted but {self.finished} finished ({self.as_dict()})"
            )

    def as_dict(self) -> dict[str, int]:
        return {"submitted": self.submitted, **{s.value: self.counts[s] for s in SampleStatus}}

    def state_dict(self) -> dict[str, int]:
        return self.as_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.submitted = int(state["submitted"])
        self.counts = Counter({s: int(state.get(s.value, 0)) for s in SampleStatus})
