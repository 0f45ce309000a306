"""How many tokens the shared-prefix layout (relayrl.train.prefix) computes on real chat prompts: the 8
GSM8K questions of tests/data/gsm8k_sample.jsonl through SmolLM2-135M-Instruct's chat template (a system
preamble every prompt shares, then the question), 8 samples each, random completions of a few lengths;
micro-batches of 8,192 computed tokens as the engine plans them. No model runs (tokenizer only).

    python bench/shared_prefix_plan.py --model DIR    # DIR: `relayrl models pull smollm2-135m-instruct`
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch
    from transformers import AutoTokenizer

    from relayrl.train.packing import pack
    from relayrl.train.prefix import plan_micro_batches, shared_layout

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a model directory with a chat template")
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(a.model)
    questions = [json.loads(line)["question"] for line in open(ROOT / "tests/data/gsm8k_sample.jsonl")]
    prompts = [
        list(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)[
                "input_ids"
            ]
        )
        for q in questions
    ]
    g = torch.Generator().manual_seed(0)
    for low, high in ((8, 9), (50, 200), (200, 800)):
        rows = [
            p + torch.randint(3, 40000, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()
            for p in prompts
            for _ in range(8)
        ]
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        att = torch.zeros_like(ids, dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, : len(r)], att[i, : len(r)] = torch.tensor(r), True
        lengths = att.sum(1).tolist()
        start = time.perf_counter()
        plan = plan_micro_batches(ids, lengths, 8192)
        ms = (time.perf_counter() - start) * 1e3
        computed = 0
        for mb in plan:
            layout = shared_layout(pack({"input_ids": ids, "attention_mask": att}, mb))
            computed += sum(lengths[r] for r in mb) if layout is None else int(layout.input_ids.numel())
        print(
            json.dumps(
                {
                    "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
                    "completion_tokens": [low, high - 1],
                    "micro_batches": len(plan),
                    "tokens": sum(lengths),
                    "computed": computed,
                    "computed_fraction": round(computed / sum(lengths), 3),
                    "plan_ms": round(ms, 1),
                }
            )
        )


if __name__ == "__main__":
    main()
