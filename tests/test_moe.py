"""Mixture-of-experts models end to end: routed experts recorded by the generator, carried in
trajectories through packing and micro-batches, replayed by the trainer; the load-balancing
loss; FSDP2 over MoE decoder layers (2 gloo ranks == 1 process).

References are independent of relayrl's router hooks: the experts a plain Hugging Face forward
chooses come from its ``output_router_logits`` (top-k of their softmax), the auxiliary loss from
transformers' own ``load_balancing_loss_func``.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
import torch.multiprocessing as mp
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from relayrl.api.config import ActorConfig, InferenceConfig, ModelConfig, OptimizerConfig, TrainEngineConfig
from relayrl.api.io import GenerationConfig, ModelRequest, ModelResponse
from relayrl.api.workflow import concat_trajectories, trajectory_from_response
from relayrl.data.families import build_tiny_family
from relayrl.inference.local import LocalEngine
from relayrl.train.actor import PPOActor
from relayrl.train.engine import TorchTrainEngine
from relayrl.train.packing import pack
from relayrl.utils.moe import routing_shape

MOE = ["qwen3_moe", "mixtral"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 50)), [3, 4, 5, 6]]
NEW = [12, 5, 9, 14]


def generate(model, **cfg) -> list[ModelResponse]:
    engine = LocalEngine(InferenceConfig(device="cpu", seed=5, **cfg), model)
    engine.initialize()

    async def go():
        return await asyncio.gather(
            *[
                engine.agenerate(
                    ModelRequest(str(i), p, GenerationConfig(max_new_tokens=n, temperature=1.0, ignore_eos=True))
                )
                for i, (p, n) in enumerate(zip(PROMPTS, NEW, strict=True))
            ]
        )

    try:
        return asyncio.run(go())
    finally:
        engine.destroy()


def hf_experts(model, seq: list[int]) -> torch.Tensor:
    """[len(seq), n_layers, top_k] sorted expert ids a plain HF forward picks (from its router logits)."""
    k = routing_shape(model)[1]
    with torch.no_grad():
        out = model(torch.tensor([seq]), output_router_logits=True)
    return torch.stack([lg.float().softmax(-1).topk(k, -1).indices for lg in out.router_logits], 1).sort(-1).values


def trainer(model, mb_max_tokens: int = 8192, lr: float = 1e-3) -> TorchTrainEngine:
    eng = TorchTrainEngine(
        TrainEngineConfig(mb_max_tokens=mb_max_tokens, optimizer=OptimizerConfig(lr=lr)), ModelConfig(), model=model
    )
    eng.initialize()
    return eng


@pytest.mark.parametrize("family", MOE)
def test_generator_records_the_experts_of_every_token_it_runs(family):
    """Prompt and output tokens (all but the last), rows joining a running batch and rows
    preempted and re-prefilled (a 64-token KV budget) alike: the ids a plain forward picks."""
    model = build_tiny_family(family, seed=1)
    resps = generate(model, max_tokens_in_flight=64, admit_window_ms=0)
    assert routing_shape(model) == (2, 2)
    for r in resps:
        seq = r.input_tokens + r.output_tokens
        assert r.routed_experts is not None and r.routed_experts.dtype == torch.int32
        assert r.routed_experts.shape == (len(seq) - 1, 2, 2)
        assert torch.equal(r.routed_experts.long().sort(-1).values, hf_experts(model, seq[:-1]))
    dense = generate(build_tiny_family("llama", seed=1))
    assert all(r.routed_experts is None for r in dense)


def test_multi_turn_trajectories_carry_the_latest_turns_routing():
    """Multi-turn / tool episodes (``TokenBuffer``): the last turn's request ran the whole context,
    so its routing covers every token before its last one; context appended after it is -1.
    Replaying it reproduces both turns' logprobs."""
    from relayrl.rollout.workflows.multi_turn import TokenBuffer

    model = build_tiny_family("qwen3_moe", seed=1)
    engine = LocalEngine(InferenceConfig(device="cpu", seed=5), model)
    engine.initialize()
    g = GenerationConfig(max_new_tokens=6, temperature=1.0, ignore_eos=True)
    buf = TokenBuffer(PROMPTS[0])
    try:
        for turn in range(2):
            resp = asyncio.run(engine.agenerate(ModelRequest(f"t{turn}", list(buf.ids), g)))
            buf.add_generated(resp.output_tokens, resp.output_logprobs, resp.output_versions, resp.routed_experts)
            buf.add_context([40, 41, 42])  # feedback / tool output after each turn
    finally:
        engine.destroy()
    traj = buf.trajectory(1.0)
    n = len(buf.ids)
    ran = n - 3 - 1  # the last turn ran everything before its own last token
    assert traj["routed_experts"].shape == (1, n, 2, 2) and (traj["routed_experts"][0, ran:] == -1).all()
    assert torch.equal(traj["routed_experts"][0, :ran].long().sort(-1).values, hf_experts(model, buf.ids[:ran]))
    logp = trainer(model).forward(traj)
    mask = traj["loss_mask"]
    torch.testing.assert_close(logp[mask], traj["logprobs"][mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", MOE)
def test_replay_of_the_generators_routing_reproduces_its_logprobs(family):
    """fp32: the trainer replaying the recorded experts (through concat padding, packing and
    3 micro-batches) gives the generator's logprobs within 1e-4. Changing the recorded experts
    of the prompt changes the trainer's logprobs (replay is in effect) unless replay is off."""
    model = build_tiny_family(family, seed=1)
    resps = generate(model)
    batch = concat_trajectories([trajectory_from_response(r, 1.0) for r in resps])
    assert batch["routed_experts"].shape == (4, 29, 2, 2)
    width = [len(r.input_tokens) + len(r.output_tokens) for r in resps]
    assert (batch["routed_experts"][1, width[1] - 1 :] == -1).all()  # last token and padding: not recorded
    packed = pack(batch, [2, 0])
    assert packed["routed_experts"].shape == (width[2] + width[0], 2, 2)
    eng = trainer(model, mb_max_tokens=29)
    logp = eng.forward(batch)
    mask = batch["loss_mask"]
    torch.testing.assert_close(logp[mask], batch["logprobs"][mask], atol=1e-4, rtol=0)
    # other experts for the prompt tokens of every row: replay follows them, own routing ignores them
    moved = dict(batch)
    moved["routed_experts"] = batch["routed_experts"].clone()
    moved["routed_experts"][:, :3] = torch.tensor([2, 3], dtype=torch.int32)
    shifted = eng.forward(moved)
    assert (shifted[mask] - logp[mask]).abs().max() > 1e-2
    actor = PPOActor(ActorConfig(replay_routing=False), eng)
    torch.testing.assert_close(actor.compute_logp(moved)[mask], logp[mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", MOE)
def test_replayed_gate_weights_carry_the_routers_gradient(family):
    """Replaying the model's own choice is the same function of the router weights: same loss,
    same router gradient as routing freely. Replaying other experts still trains the router."""
    model = build_tiny_family(family, seed=2)
    eng = trainer(model)
    seq = list(range(10, 40))
    batch = {
        "input_ids": torch.tensor([seq]),
        "attention_mask": torch.ones(1, len(seq), dtype=torch.bool),
        "loss_mask": torch.tensor([[0] * 5 + [1] * (len(seq) - 5)], dtype=torch.bool),
        "advantages": torch.linspace(-1, 1, len(seq))[None],
    }
    from tests.test_train_engine import pg_loss

    def router_grads(b):
        eng.optimizer.zero_grad()
        packed = pack(b)
        loss = pg_loss(eng._logits(packed), packed)
        loss.backward()
        return loss.detach(), [r.weight.grad.clone() for r in eng._moe.routers]

    own = torch.stack([x.int() for x in hf_experts(model, seq).unbind(1)], 1)[None]  # [1, L, layers, k]
    free_loss, free_g = router_grads(batch)
    same_loss, same_g = router_grads({**batch, "routed_experts": own})
    torch.testing.assert_close(same_loss, free_loss, atol=1e-6, rtol=0)
    for a, b in zip(same_g, free_g, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    other = torch.randint(0, 4, own.shape, generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    _, other_g = router_grads({**batch, "routed_experts": other})
    assert all(g.abs().sum() > 0 for g in other_g)


@pytest.mark.parametrize("family", MOE)
def test_load_balancing_loss_matches_transformers_and_is_logged(family):
    model = build_tiny_family(family, seed=3)
    eng = trainer(model)
    seq = list(range(20, 45))
    with torch.no_grad():
        ref_logits = model(torch.tensor([seq]), output_router_logits=True).router_logits
    packed = pack({"input_ids": torch.tensor([seq]), "attention_mask": torch.ones(1, len(seq), dtype=torch.bool)})
    with torch.no_grad():
        eng._logits(packed)
    expected = load_balancing_loss_func(tuple(ref_logits), 4, 2)
    torch.testing.assert_close(packed["moe_aux_loss"], expected, atol=1e-6, rtol=1e-6)
    # through the actor: logged, and added to the loss with its coefficient
    resps = generate(model)
    batch = concat_trajectories([trajectory_from_response(r, float(i)) for i, r in enumerate(resps)])
    batch["advantages"] = torch.zeros_like(batch["logprobs"])  # the policy loss is 0: what is left is the aux term
    stats = {}
    for coef in (0.0, 0.5):
        eng = trainer(build_tiny_family(family, seed=3), lr=0.0)
        actor = PPOActor(ActorConfig(moe_aux_loss_coef=coef, recompute_logp=False), eng)
        stats[coef] = actor.ppo_update(dict(batch))[0]
    assert stats[0.0]["moe_aux_loss"] > 0 and abs(stats[0.0]["loss"]) < 1e-7
    assert stats[0.5]["loss"] == pytest.approx(0.5 * stats[0.5]["moe_aux_loss"], rel=1e-5)


@pytest.mark.slow
def test_replay_narrows_the_bf16_gap():
    """bf16 on CPU: with replay the trainer's logprobs are closer to the generator's than without
    (the figures per family are recorded by bench/moe_replay.py)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from moe_replay import build, gaps, generate

    model = build("qwen3_moe", torch.bfloat16, seed=1)
    res = gaps(model, generate(model, 8, 32, seed=1))
    # replay removes the routing flips' share of the gap: 0.81x of no-replay on this CI machine's CPU (its bf16
    # kernels round differently from the CPU that measured less); without replay it would be 1.0x
    assert res["flip_rate"] > 0 and res["replay"] < 0.9 * res["no_replay"], res


# ---------------------------------------------------------------------------- FSDP2

LENGTHS = [20, 37, 9, 50, 33, 16, 41, 12]


def moe_batch(seed: int) -> dict[str, torch.Tensor]:
    from tests.test_packing import make_batch

    b = make_batch(LENGTHS, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 4, (*b["input_ids"].shape, 2, 2), generator=g, dtype=torch.int32)
    ids[:, ::5] = -1  # some tokens unrecorded: the router picks their experts
    b["routed_experts"] = ids
    return b


def moe_loss(logits, packed):
    """The policy loss, with the aux loss in the graph at weight 0: it pools router statistics over
    one forward, so its value depends on how the batch is cut into micro-batches (which differs
    between 2 ranks and 1 process), as every per-forward load-balancing loss does."""
    from tests.test_train_engine import pg_loss

    return pg_loss(logits, packed) + 0.0 * packed["moe_aux_loss"]


def moe_engine() -> TorchTrainEngine:
    cfg = TrainEngineConfig(mb_max_tokens=64, optimizer=OptimizerConfig(lr=1e-3), total_steps=10)
    eng = TorchTrainEngine(cfg, ModelConfig(), model=build_tiny_family("qwen3_moe", seed=0))
    eng.initialize()
    return eng


def moe_steps(eng: TorchTrainEngine) -> list[dict[str, float]]:
    from tests.test_train_engine import n_loss_tokens

    out = []
    for s in range(2):
        stats = eng.train_batch(moe_batch(s), moe_loss, n_loss_tokens)
        stats.pop("n_mbs")
        out.append(stats)
    return out


def _moe_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    from torch.distributed.fsdp import FSDPModule
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

    eng = moe_engine()
    layers = [m for m in eng.model.modules() if isinstance(m, Qwen3MoeDecoderLayer)]
    assert len(layers) == 2 and all(isinstance(m, FSDPModule) for m in layers)
    stats = moe_steps(eng)
    state = eng.state_dict()
    if rank == 0:
        torch.save({"stats": stats, "state": state}, os.path.join(out_dir, "moe.pt"))
    dist.barrier()  # tear down together: a rank leaving while its peer still saves aborted gloo once
    dist.destroy_process_group()


def test_fsdp2_two_ranks_equal_one_process_with_replay(tmp_path):
    """Qwen3-MoE decoder layers are FSDP2 units; replayed routing (some tokens unrecorded) trains
    the same on 2 gloo ranks as on one process."""
    from tests.test_train_distributed import free_port

    mp.spawn(_moe_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "moe.pt", weights_only=False)
    single = moe_engine()
    expected = moe_steps(single)
    for a, b in zip(got["stats"], expected, strict=True):
        for k in b:
            assert abs(a[k] - b[k]) <= 1e-6 * max(1.0, abs(b[k])), (k, a[k], b[k])
    for k, v in single.state_dict().items():
        assert (got["state"][k] - v).abs().max() <= 1e-5, k


# ---------------------------------------------------------------------------- relayrl serve


def test_serve_returns_routed_experts_in_sglangs_format(tmp_path):
    """`relayrl serve` on a Qwen3-MoE checkpoint: ``return_routed_experts`` gives base64 int32
    ``[prompt + output - 1, layers, top_k]`` (single and batch form, per item), equal to the
    experts a plain forward of the checkpoint picks."""
    import time

    import httpx
    from transformers import AutoModelForCausalLM

    from relayrl.data.families import save_tiny_family
    from relayrl.inference.server import LISTEN_PREFIX
    from relayrl.utils.moe import decode_routed_experts
    from tests.reliability.audit import start_cli

    path = save_tiny_family("qwen3_moe", tmp_path / "moe", seed=1)
    argv = ["serve", "--model", str(path), "--device", "cpu", "--port", "0", "model.tokenizer_path=tiny"]
    log = tmp_path / "serve.log"
    proc = start_cli(argv, log)  # `relayrl serve` in a real process forked with the trainer imported
    sp = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    try:
        deadline = time.monotonic() + 120
        while not (up := [ln for ln in log.read_text().splitlines() if ln.startswith(LISTEN_PREFIX)]):
            assert proc.exitcode is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        url = up[0].strip()[len(LISTEN_PREFIX) :]
        one = httpx.post(
            url + "/generate",
            json={"input_ids": PROMPTS[0], "sampling_params": sp, "return_routed_experts": True},
            timeout=60,
        ).json()
        many = httpx.post(
            url + "/generate",
            json={"input_ids": PROMPTS[1:3], "sampling_params": sp, "return_routed_experts": [False, True]},
            timeout=60,
        ).json()
        remote = remote_generate(url.removeprefix("http://"))
    finally:
        proc.terminate()
        proc.join(timeout=30)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert "routed_experts" not in many[0]["meta_info"]
    for prompt, reply in ((PROMPTS[0], one), (PROMPTS[2], many[1])):
        meta = reply["meta_info"]
        seq = prompt + reply["output_ids"]
        assert meta["routed_experts_shape"] == [len(seq) - 1, 2, 2]
        ids = decode_routed_experts(meta["routed_experts"], meta["routed_experts_shape"])
        assert torch.equal(ids.long().sort(-1).values, hf_experts(model, seq[:-1]))
    for r in remote:  # RemoteEngine with inference.return_routed_experts: the same in ModelResponse
        seq = r.input_tokens + r.output_tokens
        assert r.routed_experts.shape == (len(seq) - 1, 2, 2)
        assert torch.equal(r.routed_experts.long().sort(-1).values, hf_experts(model, seq[:-1]))


def remote_generate(address: str) -> list[ModelResponse]:
    """All PROMPTS through a RemoteEngine asking for routed experts (one batched HTTP call)."""
    from relayrl.inference.remote import RemoteEngine

    eng = RemoteEngine(
        InferenceConfig(backend="remote", request_timeout=60, return_routed_experts=True), addresses=[address]
    )
    eng.initialize()
    g = GenerationConfig(max_new_tokens=5, temperature=1.0, ignore_eos=True)

    async def go():
        return await asyncio.gather(*[eng.agenerate(ModelRequest(f"m{i}", p, g)) for i, p in enumerate(PROMPTS)])

    try:
        return asyncio.run(go())
    finally:
        eng.destroy()


def test_sglang_routed_experts_over_every_layer_without_a_shape_reach_the_trajectory():
    """SGLang 0.5.23 sends ``meta_info.routed_experts`` as base64 int32 over every decoder layer
    (``state_capturer/routed_experts.py``) and no shape; its stand-in does the same. RemoteEngine reshapes
    it by the served model's layout (``model.path``) and keeps the MoE layers: the experts a plain forward picks."""
    import sys
    from pathlib import Path

    from relayrl.data.models import build_tiny_model
    from relayrl.inference.remote import RemoteEngine

    sys.path.insert(0, str(Path(__file__).parent))
    from peers import start

    peer = start("sglang", "--model-path", "tiny-moe", "--version", "0.5.23")
    cfg = InferenceConfig(backend="remote", protocol="sglang", request_timeout=60, return_routed_experts=True)
    eng = RemoteEngine(cfg, addresses=[peer.address], model=ModelConfig(path="tiny-moe"))
    eng.initialize()
    g = GenerationConfig(max_new_tokens=5, temperature=1.0, ignore_eos=True)
    try:
        outs = [asyncio.run(eng.agenerate(ModelRequest(f"m{i}", p, g))) for i, p in enumerate(PROMPTS[:2])]
    finally:
        eng.destroy()
        peer.stop()
    model = build_tiny_model("tiny-moe", seed=0).eval()
    for r in outs:
        seq = r.input_tokens + r.output_tokens
        assert r.routed_experts is not None and r.routed_experts.shape == (len(seq) - 1, 3, 2)
        assert torch.equal(r.routed_experts.long().sort(-1).values, hf_experts(model, seq[:-1]))


def test_a_peer_without_routed_experts_refuses_the_option():
    """vLLM's replies carry no routed experts: the engine refuses inference.return_routed_experts at
    construction, naming it, instead of training on missing routing."""
    from relayrl.inference.remote import RemoteEngine

    cfg = InferenceConfig(backend="remote", protocol="vllm", return_routed_experts=True)
    with pytest.raises(ValueError, match=r"^inference.return_routed_experts: vLLM's replies carry no routed experts"):
        RemoteEngine(cfg, addresses=["127.0.0.1:1"])
    sglang = RemoteEngine(InferenceConfig(backend="remote", protocol="sglang", return_routed_experts=True), ["h:1"])
    assert sglang.backend.return_routed_experts and sglang.backend.routing is None  # tiny is dense: no MoE layout
