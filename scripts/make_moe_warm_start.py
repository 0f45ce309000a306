"""Make tests/data/moe_sft: the SFT warm start recipes/algorithms/grpo_moe.yaml starts from.

    python scripts/make_moe_warm_start.py [OUT_DIR]        # default tests/data/moe_sft

The demo's warm start (relayrl/demo.py: ``warm_start``) on the ``tiny-moe`` preset instead of the
demo's dense model: a Qwen3-MoE (8 experts, top-2, 3 layers, ~1.3M parameters) over the offline
character tokenizer, SFT on demonstrations of the recipe's own 2-digit addition prompts (seed 1)
of which 30% are plausibly wrong, at a constant 3e-3 after 50 warmup steps, until greedy decoding
answers 60% of 100 training prompts (probed every 100 steps; seed 1 stops at step 400). A random
model never earns a reward on this task, so RL needs such a start. Saved in bfloat16 to keep the
file small (2.7 MB; the recipe loads it in float32), with the tokenizer and chat template, so that
the directory stands alone. About 7 minutes on 2 shared CPU cores (77 s of CPU); a rerun on the
same machine wrote identical bytes.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from relayrl.api.commands import SFTConfig, SFTDataConfig
from relayrl.api.config import LoggingConfig, ModelConfig, OptimizerConfig, TrainEngineConfig
from relayrl.data.models import build_tiny_model, build_tokenizer, save_for_inference
from relayrl.data.tasks import demonstrations, make_task
from relayrl.demo import held_out_accuracy
from relayrl.sft import run_sft

SEED = 1  # recipes/algorithms/grpo_moe.yaml's seed: the same training prompts


def main(out_dir: str = "tests/data/moe_sft") -> Path:
    torch.manual_seed(SEED)
    train_rows, held_out = make_task("arithmetic", 2000, 200, 2, seed=SEED)  # = the recipe's data section
    tokenizer = build_tokenizer()
    probe = train_rows[:100]

    def learned(step: int, model: torch.nn.Module) -> bool:
        if step % 100:
            return False
        acc = held_out_accuracy(model, tokenizer, probe, 1, 8, SEED)  # type: ignore[arg-type]
        print(f"sft step {step}: probe greedy accuracy {acc['greedy']:.2f} (stop at 0.60)", flush=True)
        return acc["greedy"] >= 0.6

    with tempfile.TemporaryDirectory() as tmp:
        cfg = SFTConfig(
            run_dir=tmp,
            seed=SEED,
            total_steps=2000,
            batch_size=128,
            log_every_n_steps=20,
            save_final=False,
            model=ModelConfig(path="tiny-moe"),
            train=TrainEngineConfig(optimizer=OptimizerConfig(lr=3e-3, lr_schedule="constant", warmup_steps=50)),
            data=SFTDataConfig(task="arithmetic", difficulty=2, error_rate=0.3),
            logging=LoggingConfig(tensorboard=False),
        )
        result = run_sft(
            cfg,
            tokenizer=tokenizer,
            model=build_tiny_model("tiny-moe", vocab_size=len(tokenizer), seed=SEED),
            train_rows=demonstrations(train_rows, 0.3, SEED),
            eval_rows=held_out[:64],
            stop_fn=learned,
        )
    out = Path(out_dir)
    model = result.model.to(torch.bfloat16)
    model.save_pretrained(out)
    save_for_inference(out, tokenizer, model)
    acc = held_out_accuracy(model.float(), tokenizer, held_out, 4, 8, SEED)
    print(
        f"saved {out} after {result.steps} SFT steps: held-out sampled {acc['sampled']:.3f}, greedy {acc['greedy']:.3f}"
    )
    return out


if __name__ == "__main__":
    main(*sys.argv[1:2])
