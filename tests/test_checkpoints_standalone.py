"""Every checkpoint relayrl writes stands alone: an RL step's ``actor``, SFT's ``final`` and a LoRA
run's adapter hold the tokenizer, chat template and generation config, so ``from_pretrained``,
``relayrl serve --model CKPT``, ``relayrl eval`` and ``relayrl train model.path=CKPT`` take the
directory as it is, even once the run directory and the model the run started from are gone."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from test_cli_first_day import FAST
from transformers import AutoImageProcessor, AutoModelForCausalLM, AutoProcessor, AutoTokenizer

from relayrl.api.config import ModelConfig, RunConfig, load_config
from relayrl.data.models import load_tokenizer, vision_processor
from relayrl.data.vision import build_image_processor
from relayrl.trainer import train
from tests.reliability.audit import run_cli, start_cli

WARM = Path(__file__).parent / "data" / "demo_sft"
MESSAGES = [{"role": "user", "content": "12+34="}]
EVAL = ["data.n_eval=8", "eval.n_samples=1"]  # greedy (eval's default): the same weights score the same


def _eval_of(rows: list[dict], step: int) -> dict[str, float]:
    (row,) = [r for r in rows if r["step"] == step and "eval/accuracy" in r]
    return {k: v for k, v in row.items() if k.startswith("eval/")}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _rl_checkpoint(tmp_path: Path, lora: bool = False) -> tuple[Path, dict[str, float]]:
    """A one-step RL run from a copy of the warm start (deleted afterwards, unless a LoRA adapter
    needs it as its base): its checkpoint and the run's own eval of that step."""
    base = tmp_path / "base"
    shutil.copytree(WARM, base)
    run = tmp_path / "run"
    lora_args = ["model.lora.rank=4", "model.lora.alpha=8"] if lora else []
    cfg = load_config(
        RunConfig, None, [f"run_dir={run}", f"model.path={base}", *FAST, *EVAL, "eval.every_n_steps=1", *lora_args]
    )
    train(cfg)
    if not lora:
        shutil.rmtree(base)  # from here on, only the checkpoint's own tokenizer and config can serve
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1] / "actor"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (ckpt / name).is_file(), f"{ckpt} lacks {name}: {sorted(p.name for p in ckpt.iterdir())}"
    return ckpt, _eval_of(_metrics(run), 1)


def _greedy_answer(ckpt: Path) -> str:
    """What ``from_pretrained`` makes of the checkpoint answers to MESSAGES (greedy, 4 tokens)."""
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    return tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def _takes_it_as_is(ckpt: Path) -> str:
    """The checkpoint's tokenizer renders the run's chat prompt, and a server around it answers what
    ``from_pretrained`` answers (greedy); returns the answer."""
    run_tok = load_tokenizer(load_config(RunConfig, None, [f"model.path={WARM}"]).model)
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert tok.vocab_size == run_tok.vocab_size
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert ids == run_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    log = Path(tempfile.mkdtemp(prefix="relayrl-serve.")) / "out"
    proc = start_cli(["serve", "--model", str(ckpt), "--port", "0"], log)  # a real process, the trainer pre-imported
    try:
        deadline = time.monotonic() + 120
        while "listening on" not in (text := log.read_text() if log.exists() else ""):
            assert proc.exitcode is None and time.monotonic() < deadline, text[-3000:]
            time.sleep(0.05)
        url = text.split("listening on")[1].split()[0].strip()
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        proc.join(timeout=30)
        shutil.rmtree(log.parent)
    assert answer == _greedy_answer(ckpt)
    return answer


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    p = run_cli(list(args))  # `relayrl ARGS` in a process forked with the trainer imported
    assert p.returncode == 0, p.stderr[-2000:]
    return p


def _eval(*args: str) -> tuple[dict, str]:
    p = _cli("eval", *args)
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def _first_eval_of_a_run_from(tmp_path: Path, ckpt: Path) -> dict[str, float]:
    """``relayrl train model.path=CKPT`` (a demo's second stage), evaluated before its first step."""
    run = tmp_path / "next"
    _cli("train", f"run_dir={run}", f"model.path={ckpt}", *FAST, *EVAL, "eval.before_training=true")
    return _eval_of(_metrics(run), 0)


def test_rl_checkpoint_stands_alone_in_a_fresh_directory(tmp_path):
    ckpt, in_run = _rl_checkpoint(tmp_path)
    assert in_run["eval/n_prompts"] == 8.0 and in_run["eval/accuracy"] == 0.75  # measured: 6 of 8 sums
    config = tmp_path / "config.yaml"
    shutil.copy(tmp_path / "run" / "config.yaml", config)
    moved = tmp_path / "moved" / "policy"
    shutil.copytree(ckpt, moved)
    shutil.rmtree(tmp_path / "run")  # the run directory is gone too
    model = AutoModelForCausalLM.from_pretrained(moved)
    assert model.generation_config.eos_token_id == AutoTokenizer.from_pretrained(moved).eos_token_id
    assert _takes_it_as_is(moved) == "46"  # the warm start's skill survives one step
    out, _ = _eval(str(config), f"model.path={moved}")
    assert out.pop("model") == str(moved) and out == in_run  # the checkpoint scores what the run scored
    assert _first_eval_of_a_run_from(tmp_path, moved) == in_run  # and a run started from it starts there


def test_lora_checkpoint_stands_alone_and_eval_says_so(tmp_path):
    ckpt, in_run = _rl_checkpoint(tmp_path, lora=True)
    assert (ckpt / "adapter_config.json").is_file() and not (ckpt / "config.json").exists()
    assert Path(json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"]).is_absolute()
    assert AutoModelForCausalLM.from_pretrained(ckpt).peft_config  # base + adapter, from anywhere
    _takes_it_as_is(ckpt)
    out, err = _eval(str(tmp_path / "run"))
    assert out.pop("adapter") == str(ckpt) and out.pop("model") != str(ckpt)
    assert f"applied the LoRA adapter {ckpt}" in err
    assert out == in_run  # the merged adapter scores what the run's unmerged one did
    assert _first_eval_of_a_run_from(tmp_path, ckpt) == in_run  # model.path=ADAPTER: its base, merged


def test_sft_checkpoint_stands_alone(tmp_path):
    rows = tmp_path / "sft.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+1=", "completion": str(a + 1)}) + "\n" for a in range(10, 30)))
    p = _cli("sft", f"run_dir={tmp_path / 'run'}", f"model.path={WARM}", "data.task=file", f"data.train_path={rows}",
             "total_steps=2", "logging.tensorboard=false")  # fmt: skip
    ckpt = Path(json.loads(p.stdout.strip().splitlines()[-1])["checkpoint"])
    assert (ckpt / "generation_config.json").is_file() and (ckpt / "chat_template.jinja").is_file()
    trained = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    start = load_file(str(WARM / "model.safetensors"))
    assert trained.keys() >= start.keys() and any(not torch.equal(trained[k], start[k]) for k in start)  # 2 steps
    _takes_it_as_is(ckpt)
    out, _ = _eval(f"model.path={ckpt}", *EVAL, "gconfig.max_new_tokens=4")  # no config: the task's defaults
    assert out["model"] == str(ckpt) and out["eval/n_prompts"] == 8.0 and out["eval/failed"] == 0.0
    assert out["eval/accuracy"] == 0.875  # measured: 7 of 8 sums right, two small SFT steps after the warm start


VL = ["model.path=tiny-vl", "data.task=count_squares", "data.difficulty=2", "data.n_train=16", "data.n_eval=4",
      "total_steps=2", "rollout.batch_size=2", "rollout.group_size=2", "gconfig.max_new_tokens=2",
      "eval.gconfig.max_new_tokens=2", "eval.every_n_steps=2", "checkpoint.every_n_steps=1", "checkpoint.keep_last=3",
      "logging.tensorboard=false", "logging.progress=off"]  # fmt: skip


def test_vision_checkpoint_has_its_image_processor_and_resumes_exactly(tmp_path):
    """A Qwen2-VL run's checkpoint holds its image processor (``preprocessor_config.json``) and its
    pending prompts with their images (as PNG): resuming from step 1 ends where the straight run does."""
    straight = tmp_path / "straight"
    train(load_config(RunConfig, None, [f"run_dir={straight}", *VL]))
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000002")
    state = json.loads((resumed / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    pending = state["executor"]["pending"]
    assert pending and all(len(p["data"]["vision"]["png_base64"]) == 1 for p in pending)  # one picture a prompt
    train(load_config(RunConfig, None, [f"run_dir={resumed}", *VL, "recover=auto"]))
    a, b = (
        load_file(str(r / "checkpoints" / "step_000002" / "actor" / "model.safetensors")) for r in (straight, resumed)
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = {r: [x for x in _metrics(r) if x["step"] == 2] for r in (straight, resumed)}
    assert rows[straight][-1]["prompt_ids"] == rows[resumed][-1]["prompt_ids"]

    ckpt = resumed / "checkpoints" / "step_000002" / "actor"
    expected = build_image_processor().to_dict()
    assert json.loads((ckpt / "preprocessor_config.json").read_text())["patch_size"] == 14
    assert AutoImageProcessor.from_pretrained(ckpt, backend="pil").to_dict() == expected
    assert vision_processor(ModelConfig(path=str(ckpt))).to_dict() == expected  # what relayrl serve / eval load
    try:
        import torchvision  # noqa: F401
    except ImportError:  # transformers' Qwen2-VL processor always builds its video processor, which needs it
        with pytest.raises(ImportError, match="Torchvision"):
            AutoProcessor.from_pretrained(ckpt)
    else:
        processor = AutoProcessor.from_pretrained(ckpt)
        assert processor.image_processor.patch_size == 14 and processor.tokenizer.chat_template
    out, _ = _eval(str(resumed))  # the checkpoint's processor and tokenizer score the step as the run did
    assert out.pop("model") == str(ckpt) and out == _eval_of(_metrics(resumed), 2)
    assert out["eval/n_prompts"] == 4.0 and out["eval/failed"] == 0.0
