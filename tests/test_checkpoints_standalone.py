"""Every checkpoint relayrl writes stands alone: an RL step's ``actor``, SFT's ``final`` and a LoRA
run's adapter hold the tokenizer, chat template and generation config, so ``from_pretrained``,
``relayrl serve --model CKPT`` and ``relayrl eval`` take the directory as it is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_cli_first_day import FAST
from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.api.config import RunConfig, load_config
from relayrl.data.models import load_tokenizer
from relayrl.trainer import train

RELAYRL = Path(sys.executable).with_name("relayrl")
WARM = Path(__file__).parent / "data" / "demo_sft"
MESSAGES = [{"role": "user", "content": "12+34="}]


def _rl_checkpoint(tmp_path: Path, *extra: str) -> Path:
    cfg = load_config(
        RunConfig,
        None,
        [f"run_dir={tmp_path}", f"model.path={WARM}", *FAST, "data.n_eval=8", "eval.n_samples=1", *extra],
    )
    train(cfg)
    ckpt = sorted((tmp_path / "checkpoints").glob("step_*"))[-1] / "actor"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (ckpt / name).is_file(), f"{ckpt} lacks {name}: {sorted(p.name for p in ckpt.iterdir())}"
    return ckpt


def _takes_it_as_is(ckpt: Path) -> None:
    """The checkpoint's tokenizer renders the run's chat prompt, and a server around it answers."""
    run_tok = load_tokenizer(load_config(RunConfig, None, [f"model.path={WARM}"]).model)
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert tok.vocab_size == run_tok.vocab_size
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True) == run_tok.apply_chat_template(
        MESSAGES, add_generation_prompt=True
    )
    proc = subprocess.Popen(
        [str(RELAYRL), "serve", "--model", str(ckpt), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line, proc.stderr.read() if proc.poll() is not None else line
        url = line.split("listening on")[1].strip()
        r = httpx.post(
            f"{url}/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 4}, timeout=60
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]  # the warm start answers something
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def _eval(run_dir: Path) -> tuple[dict, str]:
    p = subprocess.run([str(RELAYRL), "eval", str(run_dir)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def test_rl_checkpoint_stands_alone(tmp_path):
    ckpt = _rl_checkpoint(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert model.generation_config.eos_token_id == AutoTokenizer.from_pretrained(ckpt).eos_token_id
    _takes_it_as_is(ckpt)
    out, _ = _eval(tmp_path)
    assert out["model"] == str(ckpt) and out["eval/accuracy"] > 0.0  # the warm start's skill survives one step


def test_lora_checkpoint_stands_alone_and_eval_says_so(tmp_path):
    ckpt = _rl_checkpoint(tmp_path, "model.lora.rank=4", "model.lora.alpha=8")
    assert (ckpt / "adapter_config.json").is_file() and not (ckpt / "config.json").exists()
    assert Path(json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"]).is_absolute()
    assert AutoModelForCausalLM.from_pretrained(ckpt).peft_config  # base + adapter, from anywhere
    _takes_it_as_is(ckpt)
    out, err = _eval(tmp_path)
    assert out["adapter"] == str(ckpt)
    assert f"applied the LoRA adapter {ckpt}" in err


@pytest.mark.parametrize("stage", ["sft"])
def test_sft_checkpoint_stands_alone(tmp_path, stage):
    rows = tmp_path / "sft.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+1=", "completion": str(a + 1)}) + "\n" for a in range(10, 30)))
    p = subprocess.run(
        [str(RELAYRL), "sft", f"run_dir={tmp_path / 'run'}", f"model.path={WARM}", "data.task=file",
         f"data.train_path={rows}", "total_steps=2", "logging.tensorboard=false"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    ckpt = Path(json.loads(p.stdout.strip().splitlines()[-1])["checkpoint"])
    assert (ckpt / "generation_config.json").is_file() and (ckpt / "chat_template.jinja").is_file()
    AutoModelForCausalLM.from_pretrained(ckpt)
    _takes_it_as_is(ckpt)
