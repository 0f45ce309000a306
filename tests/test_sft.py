"""SFT: the completion-only token-mean loss (checked against a plain padded computation),
that training lowers it, data formats and errors, the checkpoint, and ``relayrl sft``."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.api.commands import SFTConfig, SFTDataConfig
from relayrl.api.config import ModelConfig, TrainEngineConfig, load_config
from relayrl.data.models import chat_ids
from relayrl.sft import collate, encode_row, encode_rows, run_sft, sft_loss_fn, sft_loss_weight
from relayrl.train.engine import TorchTrainEngine

DATA = SFTDataConfig()
ROWS = [
    {"prompt": "12+7=", "completion": "19"},
    {"messages": [{"role": "user", "content": "3+4="}], "answer": "7"},
    {"messages": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi there"}]},
]


def reference_loss(model: torch.nn.Module, examples: list[tuple[list[int], list[int]]]) -> float:
    """Plain loop: each sequence alone through the model, NLL summed over completion tokens,
    divided by the number of completion tokens of all sequences."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in examples:
            logits = model(input_ids=torch.tensor([ids])).logits[0]
            logp = F.log_softmax(logits.float(), -1)
            for t in range(1, len(ids)):
                if mask[t]:
                    total -= float(logp[t - 1, ids[t]])
                    count += 1
    return total / count


def test_encode_formats(tokenizer):
    (ids0, m0), (ids1, m1), (ids2, m2) = encode_rows(ROWS, tokenizer, DATA, "train")
    eos = tokenizer.eos_token_id
    # raw prompt: tokenized as is, completion + EOS is the loss part
    assert ids0 == tokenizer.encode("12+7=", add_special_tokens=False) + tokenizer.encode(
        "19", add_special_tokens=False
    ) + [eos]
    assert m0 == [0] * 5 + [1, 1, 1]
    # chat prompt (template ends with the assistant tag), answer as completion
    prompt = chat_ids(tokenizer, [{"role": "user", "content": "3+4="}])
    assert ids1 == prompt + tokenizer.encode("7", add_special_tokens=False) + [eos]
    assert m1 == [0] * len(prompt) + [1, 1]
    # last assistant turn is the completion
    prompt2 = chat_ids(tokenizer, [{"role": "user", "content": "say hi"}])
    assert ids2[: len(prompt2)] == prompt2 and sum(m2) == len("hi there") + 1
    assert tokenizer.decode([t for t, m in zip(ids2, m2, strict=True) if m]) == "hi there<eos>"


def test_bad_rows_name_the_row(tokenizer):
    rows = [ROWS[0], {"prompt": "x"}, {"question": "y", "completion": "z"}]
    with pytest.raises(ValueError, match=r"train row 1: needs a 'completion'"):
        encode_rows(rows, tokenizer, DATA, "train")
    with pytest.raises(ValueError, match=r"row 0: .* longer than data.max_seq_len=4"):
        encode_rows(rows, tokenizer, SFTDataConfig(max_seq_len=4), "train")
    kept = encode_rows(rows, tokenizer, SFTDataConfig(skip_invalid_rows=True), "train")
    assert len(kept) == 1
    with pytest.raises(ValueError, match="'messages' must be a list"):
        encode_row({"messages": "hi", "answer": "1"}, tokenizer, DATA)


def test_loss_is_completion_token_mean(tokenizer, tiny_model):
    """Packed engine loss == plain per-sequence reference over completion tokens only, and
    differs from the loss over all tokens (so prompt tokens really are ignored)."""
    examples = encode_rows(ROWS, tokenizer, DATA, "train")
    ref_model = copy.deepcopy(tiny_model).eval()
    engine = TorchTrainEngine(TrainEngineConfig(mb_max_tokens=32), ModelConfig(), model=copy.deepcopy(tiny_model))
    engine.initialize()
    batch = collate(examples)
    got = engine.eval_batch(batch, sft_loss_fn, sft_loss_weight)  # budget 32 -> several micro-batches
    assert got == pytest.approx(reference_loss(ref_model, examples), rel=1e-4)
    all_tokens = [(ids, [0] + [1] * (len(ids) - 1)) for ids, _ in examples]
    assert abs(got - reference_loss(ref_model, all_tokens)) > 1e-2
    # the packed micro-batch split does not change the value (token-mean over the whole batch)
    big = TorchTrainEngine(TrainEngineConfig(mb_max_tokens=4096), ModelConfig(), model=copy.deepcopy(tiny_model))
    big.initialize()
    assert big.eval_batch(batch, sft_loss_fn, sft_loss_weight) == pytest.approx(got, rel=1e-5)


def test_sft_lowers_loss_and_checkpoint_reloads(tmp_path, tokenizer, tiny_model):
    cfg = load_config(
        SFTConfig,
        overrides=[
            f"run_dir={tmp_path / 'run'}",
            "total_steps=25",
            "batch_size=16",
            "data.n_train=48",
            "data.n_eval=16",
            "data.error_rate=0.25",
            "train.optimizer.lr=2e-3",
            "train.optimizer.warmup_steps=2",
            "train.optimizer.lr_schedule=cosine",
            "log_every_n_steps=5",
        ],
    )
    from relayrl.data.tasks import make_task

    _, held_out = make_task("arithmetic", 48, 16, 2, cfg.seed)
    before = reference_loss(tiny_model, encode_rows(held_out, tokenizer, cfg.data, "eval"))
    res = run_sft(cfg, tokenizer=tokenizer, model=copy.deepcopy(tiny_model))
    assert res.steps == 25 and res.eval_loss is not None
    assert res.eval_loss < 0.6 * before  # ~4.5 nats (uniform over the vocab) -> well below
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 26))
    assert rows[-1]["sft/loss"] < 0.6 * rows[0]["sft/loss"]
    assert rows[-1]["eval/loss"] == pytest.approx(res.eval_loss)
    assert rows[-1]["sft/lr"] < rows[3]["sft/lr"]  # cosine decay after warmup
    # the checkpoint is a plain HF model + tokenizer
    reloaded = AutoModelForCausalLM.from_pretrained(res.checkpoint).eval()
    tok2 = AutoTokenizer.from_pretrained(res.checkpoint)
    ids = encode_rows(held_out[:4], tokenizer, cfg.data, "eval")
    assert tok2.encode("12+7=", add_special_tokens=False) == tokenizer.encode("12+7=", add_special_tokens=False)
    assert reference_loss(reloaded, ids) == pytest.approx(reference_loss(res.model.eval(), ids), rel=1e-5)


def test_cli_sft_from_jsonl(tmp_path, capsys):
    from relayrl.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(12)))
    rc = main(
        [
            "sft",
            f"run_dir={tmp_path / 'run'}",
            "data.task=file",
            f"data.train_path={data}",
            "batch_size=4",
            "epochs=2",
            "model.path=tiny",
            "train.optimizer.lr=1e-3",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["steps"] == 6 and out["checkpoint"] == str(tmp_path / "run" / "final")
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
    assert main(["sft", "batch_size=0"]) == 2
    assert "batch_size=0 is out of range" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": 3, "completion": "2"}\n')
    assert main(["sft", f"run_dir={tmp_path / 'r2'}", "data.task=file", f"data.train_path={bad}"]) == 2
    assert "train row 1: 'prompt' must be a string" in capsys.readouterr().err


def test_stop_fn_ends_training_early(tmp_path, tokenizer, tiny_model):
    cfg = load_config(
        SFTConfig, overrides=[f"run_dir={tmp_path}", "total_steps=10", "batch_size=4", "log_every_n_steps=2"]
    )
    asked: list[int] = []
    res = run_sft(
        cfg,
        tokenizer=tokenizer,
        model=copy.deepcopy(tiny_model),
        train_rows=ROWS * 4,
        eval_rows=ROWS,
        stop_fn=lambda step, model: asked.append(step) or step >= 4,
    )
    assert asked == [2, 4] and res.steps == 4
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 4]  # the last row: eval/loss at the stop
    assert {k: v for k, v in rows[-1].items() if k != "time"} == {"step": 4, "eval/loss": pytest.approx(res.eval_loss)}
    assert 0 < res.eval_loss < 10  # a loss in nats, not a placeholder


def test_parquet_json_and_jsonl_files_read_the_same(tmp_path, capsys):
    """The GSM8K recipe's local files: .parquet, .json and .jsonl give the same rows, for RL
    (``load_rows_from_file``) and for ``relayrl sft``."""
    import datasets

    from relayrl.cli import main
    from relayrl.data.datasets import load_rows_from_file, read_records

    src = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"
    records = [json.loads(line) for line in src.read_text().splitlines()]
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "rows.parquet"))
    (tmp_path / "rows.json").write_text(json.dumps(records))
    assert (
        read_records(tmp_path / "rows.parquet") == read_records(tmp_path / "rows.json") == read_records(src) == records
    )
    rl = load_rows_from_file(tmp_path / "rows.parquet", "question", "answer")
    assert [r["answer"] for r in rl] == [r["answer"] for r in load_rows_from_file(src, "question", "answer")] and len(
        rl
    ) == len(records)
    rc = main(
        [
            "sft",
            f"run_dir={tmp_path / 'run'}",
            "data.task=file",
            f"data.train_path={tmp_path / 'rows.parquet'}",
            "data.prompt_key=question",
            "data.completion_key=answer",
            "batch_size=4",
            "total_steps=2",
            "model.path=tiny",
        ]
    )
    assert rc == 0 and json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 2
