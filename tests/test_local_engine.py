"""LocalEngine: exact logprobs, greedy == HF generate, continuous batching, interruption.

Every check runs the real engine thread over the tiny Qwen2 model and compares with an
independent computation: a teacher-forced forward pass of the same model (logprobs under
softmax(logits / T), with top-k / top-p renormalisation done by a plain per-row loop) or
``model.generate`` for greedy decoding.
"""

from __future__ import annotations

import asyncio
import copy
import math
import threading

import pytest
import torch

from relayrl.api.config import InferenceConfig
from relayrl.api.io import GenerationConfig, ModelRequest, ModelResponse, WeightUpdate
from relayrl.inference.local import LocalEngine
from relayrl.utils.batching import length_groups

EOS = 1


def make_engine(model, tokenizer=None, **cfg) -> LocalEngine:
    engine = LocalEngine(InferenceConfig(**cfg), model, tokenizer)
    engine.initialize()
    return engine


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(8, 90, (n_,), generator=g).tolist() for n_ in lens]


def gather(engine: LocalEngine, reqs: list[ModelRequest]):
    async def go():
        return await asyncio.gather(*[engine.agenerate(r) for r in reqs])

    return asyncio.run(go())


def reference_logprobs(model, prompt: list[int], out: list[int], temperature=1.0, top_k=0, top_p=1.0) -> list[float]:
    """Teacher-forced log pi(out_t | prefix) with a plain per-position top-k/top-p filter."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].double()
    result = []
    for t, tok in enumerate(out):
        z = logits[t] / temperature
        probs = torch.softmax(z, -1)
        keep = torch.ones_like(probs, dtype=torch.bool)
        order = torch.argsort(probs, descending=True).tolist()
        if top_k > 0:
            keep[:] = False
            keep[order[:top_k]] = True
        if top_p < 1.0:
            mass, nucleus = 0.0, []
            for i in order:
                if not keep[i]:
                    continue
                if mass >= top_p * probs[keep].sum().item():
                    break
                nucleus.append(i)
                mass += probs[i].item()
            keep[:] = False
            keep[nucleus] = True
        assert keep[tok], f"sampled token {tok} at step {t} is outside the top-k/top-p set"
        result.append(math.log(probs[tok].item() / probs[keep].sum().item()))
    return result


@pytest.mark.parametrize(
    "knobs",
    [
        dict(temperature=1.0),
        dict(temperature=0.7),
        dict(temperature=0.9, top_k=10),
        dict(temperature=1.0, top_p=0.8),
        dict(top_k=20, top_p=0.9),
    ],
)
def test_logprobs_match_teacher_forcing(tiny_model, knobs):
    engine = make_engine(tiny_model, seed=3)
    try:
        ps = prompts(6, seed=1)
        g = GenerationConfig(max_new_tokens=24, ignore_eos=True, **knobs)
        resps = gather(engine, [ModelRequest(str(i), p, g) for i, p in enumerate(ps)])
    finally:
        engine.destroy()
    for p, r in zip(ps, resps, strict=True):
        assert r.output_len == 24 and r.stop_reason == "length"
        assert r.output_versions == [0] * 24
        ref = reference_logprobs(tiny_model, p, r.output_tokens, **knobs)
        assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref, strict=True)) < 1e-4


def test_greedy_equals_hf_generate_mixed_lengths(tiny_model):
    engine = make_engine(tiny_model)
    try:
        ps = prompts(8, seed=2, lo=2, hi=40)
        g = GenerationConfig(max_new_tokens=30, greedy=True, ignore_eos=True)
        resps = gather(engine, [ModelRequest(str(i), p, g) for i, p in enumerate(ps)])
    finally:
        engine.destroy()
    for p, r in zip(ps, resps, strict=True):
        with torch.no_grad():
            ref = tiny_model.generate(
                torch.tensor([p]),
                do_sample=False,
                max_new_tokens=30,
                top_k=None,
                top_p=None,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
        assert r.output_tokens == ref
        # greedy logprobs are those of softmax(logits) at temperature 1
        lp = reference_logprobs(tiny_model, p, r.output_tokens)
        assert max(abs(a - b) for a, b in zip(r.output_logprobs, lp, strict=True)) < 1e-4


@pytest.mark.parametrize("seed", range(5))
def test_length_groups_cover_every_index_and_bound_padding(seed):
    import random

    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 80))]
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        padded, real = max(lengths[i] for i in g) * len(g), sum(lengths[i] for i in g)
        assert padded <= 1.25 * real or len(g) == 1
    assert length_groups([10] * 64) == [list(range(64))]  # equal lengths: one forward
    assert len(length_groups([8, 40] * 32)) == 2


def test_concurrent_requests_join_and_leave(tiny_model):
    """Requests of mixed lengths and budgets share a small batch; each matches a solo run."""
    engine = make_engine(tiny_model, max_batch_size=4, seed=7)
    ps = prompts(10, seed=3)
    budgets = [3, 17, 8, 25, 1, 12, 30, 5, 9, 20]
    try:
        reqs = [
            ModelRequest(str(i), p, GenerationConfig(max_new_tokens=b, ignore_eos=True))
            for i, (p, b) in enumerate(zip(ps, budgets, strict=True))
        ]
        resps = gather(engine, reqs)
        steps_together = engine.counters["steps"]
    finally:
        engine.destroy()
    assert [r.output_len for r in resps] == budgets
    assert steps_together < sum(budgets)  # rows really shared decode steps
    for p, r in zip(ps, resps, strict=True):
        ref = reference_logprobs(tiny_model, p, r.output_tokens)
        assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref, strict=True)) < 1e-4
    # sampling streams are per request: the same requests one by one give the same tokens
    solo = make_engine(tiny_model, max_batch_size=4, seed=7)
    try:
        for req, r in zip(reqs, resps, strict=True):
            assert asyncio.run(solo.agenerate(req)).output_tokens == r.output_tokens
    finally:
        solo.destroy()


def test_seed_reproducibility(tiny_model):
    g = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    ps = prompts(4, seed=4)
    outs = []
    for seed in (5, 5, 6):
        engine = make_engine(tiny_model, seed=seed)
        try:
            outs.append(
                [r.output_tokens for r in gather(engine, [ModelRequest(str(i), p, g) for i, p in enumerate(ps)])]
            )
        finally:
            engine.destroy()
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]


def perturbed(model, scale: float = 0.05) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def pause_at_step(
    engine: LocalEngine, model: torch.nn.Module, step: int
) -> tuple[threading.Event, torch.utils.hooks.RemovableHandle]:
    """Pause ``engine`` in its decode step ``step`` and set the returned event (remove the handle when done
    if ``model`` is shared). A pre-hook on the input embeddings (every forward, the lean decode step's too)
    calls ``pause()`` on the loop thread, where it only marks the engine paused: the loop stops when this step
    ends, however late the test thread runs, so what the test does next (a weight update, a memory release)
    lands after exactly ``step`` sampled tokens per running row. Needs eager decode steps: CUDA graphs replay
    without calling modules."""
    reached = threading.Event()

    def hook(_module: torch.nn.Module, _args: tuple[torch.Tensor, ...]) -> None:
        if engine.counters["steps"] == step and not reached.is_set():  # once: not the prefills that continue
            engine.pause()
            reached.set()

    return reached, model.get_input_embeddings().register_forward_pre_hook(hook)


def test_weight_update_interrupts_and_continues(tiny_model):
    model = copy.deepcopy(tiny_model)
    engine = make_engine(model, seed=1, device="cpu")  # cpu: the pause hook needs eager decode steps
    reached, _ = pause_at_step(engine, model, 10)
    new_state = perturbed(tiny_model)
    prompt = prompts(1, seed=5)[0]
    g = GenerationConfig(max_new_tokens=60, ignore_eos=True)
    try:

        async def go():
            task = asyncio.create_task(engine.agenerate(ModelRequest("a", prompt, g)))
            assert await asyncio.to_thread(reached.wait, 60), "decode step 10 never ran"
            await asyncio.to_thread(engine.update_weights, WeightUpdate(kind="tensors", tensors=new_state, version=1))
            engine.resume()
            return await task

        r = asyncio.run(go())
        assert engine.counters["aborts"] == 1
        assert engine.get_version() == 1
    finally:
        engine.destroy()
    assert r.stop_reason == "length" and r.output_len == 60
    split = r.output_versions.index(1)
    assert split == 10  # paused after step 10: its 10 tokens are version 0, every later one version 1
    assert r.output_versions == [0] * split + [1] * (60 - split)
    old = reference_logprobs(tiny_model, prompt, r.output_tokens)
    new_model = copy.deepcopy(tiny_model)
    new_model.load_state_dict(new_state)
    new = reference_logprobs(new_model, prompt, r.output_tokens)
    assert max(abs(a - b) for a, b in zip(r.output_logprobs[:split], old[:split], strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(r.output_logprobs[split:], new[split:], strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(new[split:], old[split:], strict=True)) > 1e-3  # the weights did change


def test_update_from_disk_and_pause(tiny_model, tmp_path):
    model = copy.deepcopy(tiny_model)
    new_model = copy.deepcopy(tiny_model)
    new_model.load_state_dict(perturbed(tiny_model))
    new_model.save_pretrained(tmp_path)  # tied lm_head is not written: the engine re-ties it
    engine = make_engine(model)
    prompt = prompts(1, seed=6)[0]
    g = GenerationConfig(max_new_tokens=12, greedy=True, ignore_eos=True)
    try:
        engine.pause()

        async def go():
            task = asyncio.create_task(engine.agenerate(ModelRequest("p", prompt, g)))
            await asyncio.sleep(0.2)
            assert not task.done()  # paused: nothing is decoded
            await asyncio.to_thread(engine.update_weights, WeightUpdate(kind="disk", path=str(tmp_path), version=4))
            engine.resume()
            return await task

        r = asyncio.run(go())
    finally:
        engine.destroy()
    assert r.output_versions == [4] * 12
    assert r.output_tokens == reference_greedy(new_model, prompt, 12)
    for name, value in new_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=n,
            top_k=None,
            top_p=None,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()


def test_stop_conditions(tiny_model, tokenizer):
    engine = make_engine(tiny_model, tokenizer)
    p = tokenizer.encode("hello there")
    base = GenerationConfig(max_new_tokens=40, greedy=True, ignore_eos=True)
    try:
        free = asyncio.run(engine.agenerate(ModelRequest("free", p, base))).output_tokens
        # a stop token id ends at its first occurrence (included)
        stop_tok = free[5]
        r = asyncio.run(engine.agenerate(ModelRequest("s", p, base.new(stop_token_ids=[stop_tok]))))
        assert r.stop_reason == "stop" and r.output_tokens == free[: free.index(stop_tok) + 1]
        # min_new_tokens masks it until enough tokens exist
        r = asyncio.run(
            engine.agenerate(
                ModelRequest("m", p, base.new(stop_token_ids=[stop_tok], min_new_tokens=free.index(stop_tok) + 1))
            )
        )
        assert r.output_len > free.index(stop_tok) + 1 and stop_tok not in r.output_tokens[:-1]
        # a stop string ends once the decoded text contains it
        text = tokenizer.decode(free[3:6])
        r = asyncio.run(engine.agenerate(ModelRequest("t", p, base.new(stop=[text]))))
        assert r.stop_reason == "stop" and text in tokenizer.decode(r.output_tokens)
        assert text not in tokenizer.decode(r.output_tokens[:-1])
        # max_new_tokens
        r = asyncio.run(engine.agenerate(ModelRequest("l", p, base.new(max_new_tokens=7))))
        assert r.stop_reason == "length" and r.output_tokens == free[:7]
        # EOS (not ignored) ends sampling; min_new_tokens holds it off
        gs = GenerationConfig(max_new_tokens=300, temperature=1.0)
        rs = gather(engine, [ModelRequest(str(i), p, gs.new(min_new_tokens=m)) for i, m in enumerate([0, 0, 0, 50])])
        for r in rs[:3]:
            assert (r.stop_reason == "stop") == (r.output_tokens[-1] == EOS) and EOS not in r.output_tokens[:-1]
        assert rs[3].output_len >= 50 and EOS not in rs[3].output_tokens[:50]
    finally:
        engine.destroy()


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(input_ids=[]), "input_ids"),
        (dict(input_ids=[5, 10_000]), "input_ids[1]"),
        (dict(gconfig=GenerationConfig(max_new_tokens=0)), "max_new_tokens"),
        (dict(gconfig=GenerationConfig(stop="\n")), "stop"),  # type: ignore[arg-type]
        (dict(gconfig=GenerationConfig(stop_token_ids=[-1])), "stop_token_ids"),
    ],
)
def test_bad_input_fails_alone(tiny_model, bad, field):
    engine = make_engine(tiny_model)
    good = ModelRequest("good", [5, 6, 7], GenerationConfig(max_new_tokens=40, ignore_eos=True))
    try:

        async def go():
            task = asyncio.create_task(engine.agenerate(good))
            await asyncio.sleep(0.01)
            with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
                await engine.agenerate(ModelRequest("bad", **{"input_ids": [5, 6], **bad}))
            return await task

        r = asyncio.run(go())
    finally:
        engine.destroy()
    assert r.output_len == 40 and r.stop_reason == "length"


def test_many_threads_with_own_loops(tiny_model):
    engine = make_engine(tiny_model, max_batch_size=8, seed=2)
    ps = prompts(12, seed=8)
    results: dict[int, ModelResponse] = {}
    errors: list[BaseException] = []

    def worker(idx: list[int]) -> None:
        try:
            g = GenerationConfig(max_new_tokens=15, ignore_eos=True)

            async def go():
                return await asyncio.wait_for(
                    asyncio.gather(*[engine.agenerate(ModelRequest(str(i), ps[i], g)) for i in idx]), 60
                )

            out = asyncio.run(go())
            results.update(dict(zip(idx, out, strict=True)))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=([j for j in range(12) if j % 4 == t],)) for t in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine.destroy()
    assert not errors
    assert sorted(results) == list(range(12)) and all(r.output_len == 15 for r in results.values())
    for i, r in results.items():
        ref = reference_logprobs(tiny_model, ps[i], r.output_tokens)
        assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref, strict=True)) < 1e-4


def test_default_batch_decodes_a_whole_grpo_step_in_one_wave(tiny_model):
    """16 prompts x 8 samples with the default config decode together: max_new_tokens decode steps,
    not two waves (the old default max_batch_size=64 split them: 2x the steps)."""
    engine = make_engine(tiny_model, seed=0)  # InferenceConfig defaults
    n_new = 6
    g = GenerationConfig(max_new_tokens=n_new, ignore_eos=True, top_k=0)
    reqs = [
        ModelRequest(rid=f"{i}-{j}", input_ids=p, gconfig=g)
        for i, p in enumerate(prompts(16, seed=1))
        for j in range(8)
    ]

    async def run():
        return await asyncio.gather(*(engine.agenerate(r) for r in reqs))

    try:
        engine.pause()  # every request is queued before the first admission
        loop = asyncio.new_event_loop()
        task = loop.create_task(run())
        loop.run_until_complete(asyncio.sleep(0.2))
        engine.resume()
        out = loop.run_until_complete(task)
        loop.close()
    finally:
        engine.destroy()
    assert [r.output_len for r in out] == [n_new] * 128
    assert engine.counters["steps"] <= n_new  # one wave: the first token comes from the prefill


def generate_paused(engine: LocalEngine, reqs: list[ModelRequest]) -> list[ModelResponse]:
    """Queue every request before the engine admits any (one prefill for all), then generate."""

    async def run():
        return await asyncio.gather(*(engine.agenerate(r) for r in reqs))

    engine.pause()
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(run())
        loop.run_until_complete(asyncio.sleep(0.2))
        engine.resume()
        return loop.run_until_complete(task)
    finally:
        loop.close()


@pytest.mark.parametrize("head_len", [20, 10])
def test_a_prompt_prefix_every_request_shares_is_prefilled_once_and_changes_nothing(tiny_model, head_len):
    """A system prompt / chat header every prompt starts with is computed once (``inference.shared_prefix_min``,
    default 16) and the prefilled rows are laid out as an unshared prefill lays them out: the same greedy tokens,
    logprobs within 1e-5 of the unshared engine's and 1e-4 of a teacher-forced forward. Tails of 1 to 15 tokens,
    a prompt that is the head plus one token, and a GRPO-style repeated prompt (deduplicated first)."""
    head = torch.randint(8, 90, (head_len,), generator=torch.Generator().manual_seed(4)).tolist()
    ps = [head + tail for tail in prompts(6, seed=5, lo=1, hi=15)] + [head + [7]]
    ps.append(ps[0])
    g = GenerationConfig(max_new_tokens=10, greedy=True, ignore_eos=True)
    reqs = [ModelRequest(str(i), p, g) for i, p in enumerate(ps)]
    out = {}
    for least in (16, 0):
        model = copy.deepcopy(tiny_model)
        rows_at_head: list[int] = []  # positions a prefill's LM head is computed at (decode steps: [B, H])

        def count(_m: torch.nn.Module, args: tuple[torch.Tensor], _out: torch.Tensor, seen=rows_at_head) -> None:
            if args[0].dim() == 3:
                seen.append(args[0].shape[1])

        model.lm_head.register_forward_hook(count)
        engine = make_engine(model, shared_prefix_min=least)
        try:
            out[least] = generate_paused(engine, reqs)
        finally:
            engine.destroy()
        assert set(rows_at_head) == {1}, rows_at_head  # only the last: the shared head's forward keeps none either
        counts = {k: engine.counters[k] for k in ("prefills", "prefill_unique", "prefill_shared_tokens")}
        assert counts["prefill_unique"] == len(ps) - 1  # the repeated prompt is computed once
        # each prefill (a length group) computes the head once for its rows
        if least and head_len >= least:
            assert counts["prefill_shared_tokens"] == head_len * (counts["prefill_unique"] - counts["prefills"]) > 0
        else:
            assert counts["prefill_shared_tokens"] == 0, counts
    for p, a, b in zip(ps, out[16], out[0], strict=True):
        assert a.output_tokens == b.output_tokens
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs, strict=True)) < 1e-5
        ref = reference_logprobs(tiny_model, p, a.output_tokens)
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, ref, strict=True)) < 1e-4
