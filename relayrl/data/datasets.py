"""Datasets from files, validated row by row, and a resumable shuffling dataloader.

Rows hold ``id``, ``messages`` (chat turns ending with the user's) and
``answer``; other columns pass through to workflows and reward functions untouched.
"""

from __future__ import annotations

import json
import random
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from relayrl.api.engine import DataItem
from relayrl.data.models import chat_ids
from relayrl.data.vision import has_images, row_vision, with_vision
from relayrl.utils.logging import get_logger

logger = get_logger("data")

if typing.TYPE_CHECKING:
    from transformers.image_processing_utils import BaseImageProcessor


class DatasetError(ValueError):
    """A dataset row is missing a field, has a wrong type, or an empty / over-long prompt."""


def read_records(path: str | Path) -> list[dict[str, object]]:
    """Raw records of a ``.jsonl``, ``.json`` (a list of objects) or ``.parquet`` file."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"dataset file not found: {p}")
    if p.suffix == ".jsonl":
        out = []
        for n, line in enumerate(p.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{p}: line {n + 1} is not valid JSON ({e.msg})") from None
        return out
    if p.suffix == ".json":
        data = json.loads(p.read_text())
        if not isinstance(data, list):
            raise DatasetError(f"{p}: a .json dataset must hold a list of objects, got {type(data).__name__}")
        return data
    if p.suffix == ".parquet":
        import datasets

        return [dict(r) for r in datasets.Dataset.from_parquet(str(p))]
    raise DatasetError(f"{p}: unsupported dataset format {p.suffix!r} (use .jsonl, .json or .parquet)")


def gsm8k_answer(text: str) -> str:
    """The final answer of a GSM8K solution: the text after ``####`` (commas dropped)."""
    return text.split("####")[-1].strip().replace(",", "") if "####" in text else text.strip()


def _is_parts(content: object) -> bool:
    """Chat content as a list of typed parts (text and images: ``relayrl.data.vision``)."""
    return isinstance(content, list) and bool(content) and all(isinstance(p, dict) and "type" in p for p in content)


def to_row(record: dict[str, object], index: int, prompt_key: str, answer_key: str) -> DataItem:
    """One validated row (``id``, ``messages``, ``answer``); DatasetError names the row and the field otherwise."""
    if not isinstance(record, dict):
        raise DatasetError(f"row {index}: expected an object, got {type(record).__name__}")
    where = f"row {index} (id={record.get('id', index)!r})"
    if prompt_key not in record:
        raise DatasetError(f"{where}: missing prompt field {prompt_key!r} (has {sorted(record)})")
    prompt = record[prompt_key]
    if prompt_key == "messages" or isinstance(prompt, list):
        ok = (
            isinstance(prompt, list)
            and prompt
            and all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and (isinstance(m.get("content"), str) or _is_parts(m.get("content")))
                for m in prompt
            )
        )
        if not ok:
            raise DatasetError(
                f"{where}: {prompt_key!r} must be a non-empty list of {{role, content}} with string content "
                "(or a list of text / image parts)"
            )
        messages = typing.cast(list[dict[str, object]], prompt)
    elif isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        raise DatasetError(
            f"{where}: {prompt_key!r} must be a string or a list of chat turns, got {type(prompt).__name__}"
        )
    if not any(_is_parts(m["content"]) or str(m["content"]).strip() for m in messages):
        raise DatasetError(f"{where}: the prompt is empty")
    if answer_key not in record:
        raise DatasetError(f"{where}: missing answer field {answer_key!r} (has {sorted(record)})")
    answer = record[answer_key]
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise DatasetError(f"{where}: {answer_key!r} must be a string or number, got {type(answer).__name__}")
    rid = index if record.get("id") is None else record["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise DatasetError(f"{where}: 'id' must be a string or an integer, got {type(rid).__name__}")
    row: DataItem = {k: v for k, v in record.items() if k not in (prompt_key, answer_key)}
    row.update({"id": rid, "messages": messages, "answer": gsm8k_answer(str(answer))})
    return row


def _checked(
    source: str, rows: list[DataItem], check: Callable[[int, DataItem], DataItem], skip: bool
) -> list[DataItem]:
    """``check(i, row)`` of every row: a ``DatasetError`` stops naming ``source``, or with ``skip``
    the row is skipped (and counted in a warning); no valid row at all is a DatasetError."""
    out, skipped = [], []
    for i, row in enumerate(rows):
        try:
            out.append(check(i, row))
        except DatasetError as e:
            if not skip:
                raise DatasetError(f"{source}: {e}") from None
            skipped.append(str(e))
    if skipped:
        logger.warning("%s: skipped %d invalid rows (first: %s)", source, len(skipped), skipped[0])
    if not out:
        raise DatasetError(f"{source}: no valid rows")
    return out


def _with_images(
    i: int, row: DataItem, tokenizer: PreTrainedTokenizerBase | None, image_processor: BaseImageProcessor | None
) -> DataItem:
    """``row`` with its ``vision`` prompt when it has images; DatasetError naming the row when it cannot."""
    if not has_images(row):
        return row
    if image_processor is None or tokenizer is None:
        raise DatasetError(f"row {i} (id={row['id']!r}) has images but the model takes none")
    try:
        return with_vision(row, tokenizer, image_processor)
    except (ValueError, KeyError) as e:
        raise DatasetError(f"row {i} (id={row.get('id', i)!r}): {e}") from None


def load_rows_from_file(
    path: str | Path,
    prompt_key: str = "question",
    answer_key: str = "answer",
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_prompt_len: int = 0,
    skip_invalid: bool = False,
    image_processor: BaseImageProcessor | None = None,
) -> list[DataItem]:
    """Validated rows of a file. Bad rows raise DatasetError, or are skipped (and counted in
    a warning) with ``skip_invalid``. With a tokenizer, prompts over ``max_prompt_len``
    tokens are bad rows too. Rows with images (``images`` column, image content parts) need
    the model's ``image_processor`` and get their ``vision`` prompt (``relayrl.data.vision``);
    an unreadable or rejected image makes a bad row."""

    def check(i: int, record: DataItem) -> DataItem:
        row = _with_images(i, to_row(record, i, prompt_key, answer_key), tokenizer, image_processor)
        if tokenizer is not None and max_prompt_len:
            vp = row_vision(row)
            messages = typing.cast(list[dict[str, object]], row["messages"])
            n = len(vp.input_ids) if vp is not None else len(chat_ids(tokenizer, messages))
            if n > max_prompt_len:
                raise DatasetError(
                    f"row {i} (id={row['id']!r}): prompt has {n} tokens > data.max_prompt_len={max_prompt_len}"
                )
        return row

    return _checked(str(path), read_records(path), check, skip_invalid)


def attach_vision(
    rows: list[dict[str, object]],
    tokenizer: PreTrainedTokenizerBase,
    image_processor: BaseImageProcessor,
    skip_invalid: bool = False,
    source: str = "dataset",
) -> list[dict[str, object]]:
    """``with_vision`` over in-memory rows (an ``images`` column: paths, bytes or PIL images, and/or
    image content parts). A bad image raises ``DatasetError`` naming the row, its id and the reason,
    or the row is skipped (and counted in a warning) with ``skip_invalid`` (``data.skip_invalid_rows``).
    Rows without images pass unchanged."""
    return _checked(source, rows, lambda i, row: _with_images(i, row, tokenizer, image_processor), skip_invalid)


class RLDataLoader:
    """Batches of rows forever, reshuffled each epoch from ``seed``; resumable exactly.

    ``state_dict()`` records (epoch, position); a loader restored from it yields exactly
    the batches the original would have yielded next, so a resumed run neither loses nor
    repeats prompts.
    """

    def __init__(self, rows: list[DataItem], batch_size: int, shuffle: bool = True, seed: int = 0) -> None:
        if not rows:
            raise ValueError("RLDataLoader needs at least one row")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.rows, self.batch_size, self.shuffle, self.seed = rows, batch_size, shuffle, seed
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def __iter__(self) -> Iterator[list[DataItem]]:
        return self

    def __next__(self) -> list[DataItem]:
        batch: list[DataItem] = []
        while len(batch) < self.batch_size:
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            batch.append(self.rows[self._order[self.position]])
            self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)
