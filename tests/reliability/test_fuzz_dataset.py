"""Fuzzing dataset rows: missing fields, wrong types, empty and over-long prompts, broken lines.

Loading gives the valid rows, or one ``DatasetError`` naming the file and the first bad row;
with ``data.skip_invalid_rows`` exactly the valid rows are kept, in order. Through the
trainer the same error is one line from ``relayrl train``, and skipping trains on good rows only.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from audit import FAST, metrics_rows, start_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relayrl.api.config import RunConfig, load_config
from relayrl.data.datasets import DatasetError, load_rows_from_file
from relayrl.data.models import build_tokenizer
from relayrl.trainer import train

EXAMPLES = int(os.environ.get("RELAYRL_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TMP = Path(tempfile.mkdtemp(prefix="relayrl-fuzz-data-"))
MAX_LEN = 48
TOK = build_tokenizer()

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=5,
)
TURN = st.fixed_dictionaries(
    {}, optional={"role": st.sampled_from(["user", "system"]) | JSON, "content": st.text(max_size=80) | JSON}
)
PROMPT = st.text(max_size=80) | st.sampled_from(["", "   ", "\n", "1+1=", "x" * 200]) | JSON
RECORD = st.fixed_dictionaries(
    {},
    optional={
        "question": PROMPT,
        "messages": st.lists(TURN, max_size=3) | JSON,
        "answer": st.text(max_size=8) | st.integers() | JSON,
        "id": st.text(max_size=8) | st.integers() | JSON,
        "extra": JSON,
    },
)


def teardown_module() -> None:
    shutil.rmtree(TMP, ignore_errors=True)


def _write(records: list[object], name: str = "rows.jsonl") -> Path:
    path = TMP / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _load(path: Path, prompt_key: str, skip: bool) -> list[dict]:
    return load_rows_from_file(path, prompt_key=prompt_key, tokenizer=TOK, max_prompt_len=MAX_LEN, skip_invalid=skip)


def _valid(record: object, prompt_key: str) -> bool:
    try:
        _load(_write([record], "one.jsonl"), prompt_key, skip=False)
    except DatasetError:
        return False
    return True


@FUZZ
@given(records=st.lists(RECORD | JSON, min_size=1, max_size=5), prompt_key=st.sampled_from(["question", "messages"]))
def test_random_rows_load_or_name_the_first_bad_row(records, prompt_key):
    ok = [_valid(r, prompt_key) for r in records]
    path = _write(records)
    try:
        rows = _load(path, prompt_key, skip=False)
    except DatasetError as e:
        msg = str(e)
        assert "\n" not in msg and msg.startswith(f"{path}: row {ok.index(False)}"), (msg, ok)
    else:
        assert all(ok) and len(rows) == len(records)
        for i, row in enumerate(rows):
            assert isinstance(row["id"], (str, int)) and isinstance(row["answer"], str)
            assert row["messages"] and any(m["content"].strip() for m in row["messages"])
            assert row["id"] == (records[i].get("id") if records[i].get("id") is not None else i)

    # skipping keeps exactly the valid rows, in file order
    try:
        kept = _load(path, prompt_key, skip=True)
    except DatasetError as e:
        assert not any(ok) and str(e) == f"{path}: no valid rows"
    else:
        assert [r["id"] for r in kept] == [
            (r.get("id") if r.get("id") is not None else i) for i, r in enumerate(records) if ok[i]
        ]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"question": "", "answer": "1"}', "row 1 (id=1): the prompt is empty"),
        ('{"question": "   ", "answer": "1", "id": "blank"}', "row 1 (id='blank'): the prompt is empty"),
        ('{"question": "' + "9+" * 60 + '", "answer": "1"}', f"tokens > data.max_prompt_len={MAX_LEN}"),
        ('{"question": "1+1="}', "row 1 (id=1): missing answer field 'answer'"),
        ('{"question": "1+1=", "answer": [2]}', "row 1 (id=1): 'answer' must be a string or number, got list"),
        ('{"question": 7, "answer": "1"}', "row 1 (id=1): 'question' must be a string or a list of chat turns"),
        ('{"question": "1+1=", "answer": "2", "id": [1]}', "row 1 (id=[1]): 'id' must be a string or an integer"),
        ('{"question": [{"role": "user"}], "answer": "2"}', "'question' must be a non-empty list of {role, content}"),
        ("[1, 2]", "row 1: expected an object, got list"),
        ('{"question": "1+1=", "answer": ', "line 2 is not valid JSON"),
    ],
)
def test_each_kind_of_bad_row_is_named(line, needle):
    path = TMP / "bad.jsonl"
    path.write_text('{"question": "2+2=", "answer": "4"}\n' + line + "\n")
    with pytest.raises(DatasetError) as info:
        _load(path, "question", skip=False)
    assert str(info.value).startswith(f"{path}: ") and needle in str(info.value), str(info.value)


def _bad_file(tmp_path: Path) -> Path:
    good = [{"question": f"{i}+1=", "answer": str(i + 1), "id": f"good-{i}"} for i in range(12)]
    bad = [
        {"question": "", "answer": "0", "id": "empty"},
        {"question": "1+1=", "id": "no-answer"},
        {"question": "9+" * 60, "answer": "1", "id": "too-long"},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*good[:5], *bad, *good[5:]]))
    return path


def test_relayrl_train_names_the_bad_row_in_one_line(tmp_path):
    path = _bad_file(tmp_path)
    log = tmp_path / "cli.log"
    proc = start_cli(["train", f"run_dir={tmp_path / 'run'}", "data.task=file", f"data.train_path={path}", *FAST], log)
    proc.join(timeout=120)
    out = log.read_text()
    assert proc.exitcode == 2 and out == f"relayrl train: {path}: row 5 (id='empty'): the prompt is empty\n", out


def test_training_with_skip_invalid_rows_uses_only_good_rows(tmp_path):
    path = _bad_file(tmp_path)
    cfg = load_config(
        RunConfig,
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            *FAST,
            "data.task=file",
            f"data.train_path={path}",
            f"data.max_prompt_len={MAX_LEN}",
            "data.skip_invalid_rows=true",
            "total_steps=4",
        ],
    )
    train(cfg)
    trained = [i for r in metrics_rows(cfg.run_dir) for i in r["prompt_ids"]]
    assert len(trained) == 8 and all(i.startswith("good-") for i in trained)
