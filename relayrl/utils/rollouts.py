"""Saved rollouts: one JSON line per rollout in ``RUN_DIR/rollouts/step_NNNNNN.jsonl`` plus one index
line per step in ``RUN_DIR/rollouts/index.jsonl``.

A line holds what ``relayrl show`` prints (``prompt``, ``completion``, ``reward``, ``versions``) and
what ``relayrl inspect`` colours tokens by: from the first generated token to the end of the
episode, per token its id, decoded piece, loss mask (0 on tool / environment tokens between turns),
the generator's logprob, the trainer's when the batch holds one (``trainer_logp``: the update's own
forward; else a recomputed ``prox_logp`` / ``old_logp``), the
advantage, the weight version and the entropy (the update's own forward records it). Floats are rounded (4 decimals) to keep
the files small; an advantage that is the same on every token (GRPO's) is stored once as a number. The index lets a viewer list steps and their sizes without opening them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the inspector reads saved rollouts without loading torch
    import torch
    from transformers import PreTrainedTokenizerBase

    TensorDict = dict[str, torch.Tensor]
Row = dict[str, object]
# batch key -> saved token field; trainer logprobs: the first of these the batch holds
TOKEN_FIELDS = {"logprobs": "logp", "advantages": "adv", "versions": "ver", "entropy": "ent"}
TRAINER_LOGP = ("trainer_logp", "prox_logp", "old_logp")


def run_names(run_dirs: list[Path]) -> list[str]:
    """Short distinct labels of runs (``relayrl inspect``'s and ``relayrl plot``'s): the last path parts
    that tell them apart (``demo/grpo``)."""
    for depth in range(1, 6):
        names = ["/".join(p.resolve().parts[-depth:]) for p in run_dirs]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in run_dirs]


def step_file(run_dir: Path, step: int) -> Path:
    return run_dir / "rollouts" / f"step_{step:06d}.jsonl"


def sample_rows(batch: TensorDict, k: int) -> list[int]:
    """The rows to save: whole groups (``group_id``) in batch order until ``k`` rows, then a cut."""
    n = int(batch["rewards"].shape[0])
    if "group_id" not in batch:
        return list(range(min(k, n)))
    order: dict[int, list[int]] = {}
    for i, g in enumerate(batch["group_id"].tolist()):
        order.setdefault(int(g), []).append(i)
    return [i for members in order.values() for i in members][:k]


def _rounded(values: list[float], once: bool = False) -> list[float] | float:
    """Floats to 4 decimals; with ``once``, a list of one repeated value as that value."""
    out = [round(v, 4) for v in values]
    return out[0] if once and out and all(v == out[0] for v in out) else out


class RolloutWriter:
    """Writes a step's sampled rollouts (``sample_rows``) and its index line; token pieces are decoded
    once per token id."""

    def __init__(
        self,
        run_dir: Path,
        tokenizer: PreTrainedTokenizerBase,
        images: Callable[[torch.Tensor, torch.Tensor], list[str]] | None = None,
    ) -> None:
        """``images``: an episode's ``pixel_values`` and ``image_grid_thw`` -> image URLs to save
        (``relayrl.data.vision.png_data_urls``); without it, vision episodes save their image count."""
        self.dir = run_dir / "rollouts"
        self.tokenizer = tokenizer
        self.images = images
        self._pieces: dict[int, str] = {}
        self._seen: dict[str, int] = {}  # digest of an episode's patches -> the row holding its images

    def piece(self, token_id: int) -> str:
        if token_id not in self._pieces:
            self._pieces[token_id] = str(self.tokenizer.decode([token_id]))
        return self._pieces[token_id]

    def rollout(self, batch: TensorDict, i: int, step: int) -> Row | None:
        """Rollout ``i`` of ``batch`` trained at ``step`` as a saved line (None without generated tokens)."""
        attn = batch["attention_mask"][i].bool()
        end = int(attn.nonzero().max()) + 1 if bool(attn.any()) else 0
        gen = batch["loss_mask"][i][:end].bool()
        if "logprobs" in batch:  # a token masked out of the loss later (mask_truncated) is still generated
            gen = gen | (batch["versions"][i][:end] >= 0)
        if not bool(gen.any()):
            return None
        first = int(gen.nonzero()[0])
        ids = batch["input_ids"][i][:end].tolist()
        versions = batch["versions"][i][first:end].tolist()
        generated = [int(v) for v, m in zip(versions, gen[first:end].tolist(), strict=True) if m and v >= 0]
        tokens: dict[str, object] = {
            "ids": ids[first:],
            "text": [self.piece(t) for t in ids[first:]],
            "mask": [int(m) for m in batch["loss_mask"][i][first:end].tolist()],
        }
        for key, name in TOKEN_FIELDS.items():
            if key in batch and batch[key].dim() == 2:
                values = batch[key][i][first:end].tolist()
                tokens[name] = [int(v) for v in values] if key == "versions" else _rounded(values, key == "advantages")
        trainer = next((k for k in TRAINER_LOGP if k in batch and batch[k] is not batch.get("logprobs")), None)
        if trainer is not None:
            tokens["tlogp"] = _rounded(batch[trainer][i][first:end].tolist())
        row: Row = {
            "i": i,
            "prompt": self.tokenizer.decode(ids[:first]),
            "completion": self.tokenizer.decode(ids[first:]),
            "reward": round(float(batch["rewards"][i]), 6),
            "versions": sorted(set(generated)),
            "len": len(generated),
            "lag": (step - 1) - min(generated) if generated else 0,  # versions behind the weights it trained
            "stop": "length" if "truncated" in batch and bool(batch["truncated"][i]) else "stop",
            "tokens": tokens,
        }
        for key in ("group_id", "prompt_index", "num_turns", "raw_rewards"):
            if key in batch and batch[key].dim() == 1:
                row[key] = round(float(batch[key][i]), 6) if batch[key].is_floating_point() else int(batch[key][i])
        if "image_grid_thw" in batch:
            grid = batch["image_grid_thw"][i]
            row["n_images"] = int((grid.prod(-1) > 0).sum())
            pixels = batch["pixel_values"][i][: int(grid.prod(-1).sum())]
            seen = hashlib.sha1(pixels.contiguous().numpy().tobytes()).hexdigest()
            if seen in self._seen:  # a group's members share their prompt's images: saved once a step
                row["images_of"] = self._seen[seen]
            elif self.images is not None:
                row["images"] = self.images(pixels, grid)
                self._seen[seen] = i
        return row

    def write(self, step: int, batch: TensorDict, k: int) -> Path | None:
        """Save up to ``k`` rollouts of ``batch`` as ``step_NNNNNN.jsonl`` and append its index line."""
        self._seen.clear()
        picked = [(i, r) for i in sample_rows(batch, k) if (r := self.rollout(batch, i, step)) is not None]
        rows = [r for _, r in picked]
        if not rows:
            return None
        self.dir.mkdir(parents=True, exist_ok=True)
        out = step_file(self.dir.parent, step)
        out.write_text("".join(json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n" for r in rows))
        summary = {
            "step": step,
            "file": out.name,
            "n": len(rows),
            "of": int(batch["rewards"].shape[0]),
            "reward": round(sum(float(batch["rewards"][i]) for i, _ in picked) / len(rows), 6),
        }
        with (self.dir / "index.jsonl").open("a") as fh:
            fh.write(json.dumps(summary) + "\n")
        return out


def read_index(run_dir: Path) -> list[Row]:
    """One entry per saved step, latest write of a step winning (a resumed run re-does steps); runs
    saved before the index existed are listed from their step files."""
    index = run_dir / "rollouts" / "index.jsonl"
    steps: dict[int, Row] = {}
    if index.exists():
        for line in index.read_text().splitlines():
            try:
                entry = json.loads(line)
                steps[int(entry["step"])] = entry
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
    for path in (run_dir / "rollouts").glob("step_*.jsonl"):
        step = int(path.stem.removeprefix("step_"))
        steps.setdefault(step, {"step": step, "file": path.name})
    return [steps[s] for s in sorted(steps) if step_file(run_dir, s).exists()]


def read_step(run_dir: Path, step: int) -> Iterator[Row]:
    """The saved rollouts of one step, in saved order."""
    for line in step_file(run_dir, step).read_text().splitlines():
        if line.strip():
            yield json.loads(line)
