"""relayrl's packed PPO gradient vs a plain padded HF forward with TRL's GRPO loss (dapo, one
iteration: ratio = exp(logp - sg(logp)), token mean over the batch), on one batch of the count
workload sampled by LocalEngine from the SFT warm start: is an update relayrl's or the algorithm's?

    python bench/grad_check.py runs/bench/sft-<key>/final [attn_impl]

Prints the largest relative gradient difference over the parameters (1e-5 = the same update).
"""

import asyncio
import copy
import sys

import torch

sys.path.insert(0, "bench")
import common

from relayrl.api.config import ActorConfig, InferenceConfig, ModelConfig, OptimizerConfig, TrainEngineConfig
from relayrl.api.io import GenerationConfig, ModelRequest
from relayrl.api.workflow import concat_trajectories, trajectory_from_response
from relayrl.data.models import build_tokenizer, chat_ids
from relayrl.inference.local import LocalEngine
from relayrl.train.actor import PPOActor
from relayrl.train.engine import TorchTrainEngine

torch.set_num_threads(1)
ckpt = sys.argv[1]
attn = sys.argv[2] if len(sys.argv) > 2 else "auto"
model = common.load_warm(ckpt)
tok = build_tokenizer()
train, _ = common.rl_rows("count", 2)
eng = LocalEngine(InferenceConfig(device="cpu", seed=2), copy.deepcopy(model), tokenizer=tok)
eng.initialize()
g = GenerationConfig(max_new_tokens=192, temperature=1.0, top_p=1.0, top_k=0)


async def go():
    reqs = [
        ModelRequest(rid=f"{i}-{j}", input_ids=chat_ids(tok, r["messages"]), gconfig=g)
        for i, r in enumerate(train[:8])
        for j in range(8)
    ]
    return await asyncio.gather(*[eng.agenerate(q) for q in reqs])


resps = asyncio.run(go())
eng.destroy()
torch.manual_seed(0)
batch = concat_trajectories([trajectory_from_response(r, float(torch.rand(()) < 0.5)) for r in resps])
batch["group_id"] = torch.arange(64) // 8
cfg = TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-12, grad_clip=0.0), mb_max_tokens=8192)
te = TorchTrainEngine(cfg, ModelConfig(path=ckpt, attn_impl=attn), model=copy.deepcopy(model))
te.initialize()
actor = PPOActor(ActorConfig(adv_estimator="grpo", loss="ppo", recompute_logp=False), te)
actor.prepare(batch)
actor.ppo_update(batch)
ours = {n: p.grad.clone() for n, p in te.model.named_parameters()}
# reference: padded batch, HF default attention with attention_mask, TRL dapo loss
ref = copy.deepcopy(model)
ref.train()
ids, am = batch["input_ids"], batch["attention_mask"]
logits = ref(input_ids=ids, attention_mask=am.long()).logits[:, :-1].float()
lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
m = batch["loss_mask"][:, 1:].float()
adv = batch["advantages"][:, 1:]
ratio = torch.exp(lp - lp.detach())
loss = (-(ratio * adv) * m).sum() / m.sum()
loss.backward()
worst = 0.0
for n, p in ref.named_parameters():
    d = (p.grad - ours[n]).norm() / p.grad.norm().clamp(min=1e-12)
    worst = max(worst, float(d))
print("attn", attn, "max relative grad diff", worst, "mismatch", actor.mismatch.get("abs_diff_max"))
