"""Vision-language generation: LocalEngine on tiny Qwen2-VL / Qwen2.5-VL with image prompts.

References are independent of LocalEngine: Hugging Face ``generate`` (which computes M-RoPE
positions itself from ``mm_token_type_ids``) for greedy tokens, and one teacher-forced forward
over prompt + completion for logprobs.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from relayrl.api.config import InferenceConfig
from relayrl.api.io import GenerationConfig, ModelRequest, WeightUpdate
from relayrl.data.models import build_tiny_vl_model, build_vl_tokenizer
from relayrl.data.vision import build_image_processor, encode_prompt
from relayrl.inference.local import LocalEngine
from tests.test_local_engine import pause_at_step

PRESETS = ["tiny-vl", "tiny-vl2.5"]


def squares(n: int, size: tuple[int, int] = (56, 56), seed: int = 0) -> Image.Image:
    """``n`` red squares on a white image (deterministic)."""
    g = torch.Generator().manual_seed(seed)
    img = Image.new("RGB", size, (255, 255, 255))
    for _ in range(n):
        x, y = (int(v) for v in torch.randint(0, max(1, min(size) - 10), (2,), generator=g))
        img.paste((220, 30, 30), (x, y, x + 9, y + 9))
    return img


@pytest.fixture(scope="module")
def vl():
    tok, proc = build_vl_tokenizer(), build_image_processor()
    models = {}
    for preset in PRESETS:
        m = build_tiny_vl_model(preset, seed=1)
        with torch.no_grad():  # larger weights than the init's: distinct logits, no near-ties in argmax
            for p in m.parameters():
                if p.dim() == 2:
                    p.mul_(8.0)
        models[preset] = m.eval()
    return tok, proc, models


def prompts(tok, proc):
    sizes = [(56, 56), (112, 42), (28, 84)]
    out = [
        encode_prompt(tok, proc, [{"role": "user", "content": f"how many squares{'?' * i}"}], [squares(i + 1, s, i)])
        for i, s in enumerate(sizes)
    ]
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    out.append(encode_prompt(tok, proc, two, [squares(1, (56, 56), 7), squares(3, (84, 56), 8)]))
    return out


def hf_generate(model, vp, n):
    """Greedy ``n`` tokens by transformers (EOS is just a token: the engine runs with ignore_eos)."""
    ids = torch.tensor([vp.input_ids])
    model.generation_config.eos_token_id = None
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        pixel_values=vp.vision.pixel_values,
        image_grid_thw=vp.vision.image_grid_thw,
        mm_token_type_ids=(ids == model.config.image_token_id).int(),
        max_new_tokens=n,
        do_sample=False,
        top_k=None,
        top_p=None,
    )
    return out[0, ids.shape[1] :].tolist()


def teacher_forced_logprobs(model, vp, completion, temperature=1.0):
    """Log-probs of ``completion`` after the image prompt ``vp``, by one Hugging Face forward. A sampled
    image pad id in the completion is an ordinary token, which the model's own placement cannot take:
    then the embeddings are built from its public pieces (vision features at the prompt's pads only)."""
    ids = torch.tensor([vp.input_ids + completion])
    n = len(vp.input_ids)
    types = (ids == model.config.image_token_id).int()
    types[0, n:] = 0
    with torch.no_grad():
        if model.config.image_token_id not in completion:
            kwargs = {"input_ids": ids, "pixel_values": vp.vision.pixel_values, "mm_token_type_ids": types}
        else:
            feats = model.model.get_image_features(vp.vision.pixel_values, vp.vision.image_grid_thw).pooler_output
            embeds = model.get_input_embeddings()(ids)
            embeds[types.bool()] = torch.cat(list(feats))
            pos, _ = model.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=vp.vision.image_grid_thw)
            kwargs = {"inputs_embeds": embeds, "position_ids": pos}
        out = model(attention_mask=torch.ones_like(ids), image_grid_thw=vp.vision.image_grid_thw, **kwargs)
    logp = F.log_softmax(out.logits[0].float()[n - 1 : -1] / temperature, -1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def run_all(engine, reqs):
    async def go():
        return await asyncio.gather(*(engine.agenerate(r) for r in reqs))

    return asyncio.run(go())


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_equals_hf_generate_and_logprobs_teacher_forced(vl, preset):
    tok, proc, models = vl
    model = models[preset]
    vps = prompts(tok, proc)
    engine = LocalEngine(InferenceConfig(seed=0), model, tok, image_processor=proc)
    engine.initialize()
    try:
        n = 12
        g = GenerationConfig(max_new_tokens=n, greedy=True, ignore_eos=True)
        text_ids = tok("<|user|>no image here<|assistant|>")["input_ids"]
        reqs = [ModelRequest(f"r{i}", vp.input_ids, g, image_data=vp.image_data) for i, vp in enumerate(vps)]
        reqs.append(ModelRequest("text", text_ids, g))
        outs = run_all(engine, reqs)  # one batch: left-padded rows with different M-RoPE shifts
        for vp, resp in zip(vps, outs, strict=False):
            ref = hf_generate(model, vp, n)
            assert resp.output_tokens == ref
            tf = teacher_forced_logprobs(model, vp, resp.output_tokens)
            assert torch.allclose(torch.tensor(resp.output_logprobs), tf, atol=1e-4)
        assert len({tuple(r.output_tokens) for r in outs[:-1]}) > 2  # the prompts lead to different completions
        ids = torch.tensor([text_ids])
        ref_text = model.generate(input_ids=ids, max_new_tokens=n, do_sample=False, top_k=None, top_p=None)
        assert outs[-1].output_tokens == ref_text[0, len(text_ids) :].tolist()
        # sampled with temperature: logprobs are those of softmax(logits / T) of a teacher-forced forward
        gs = GenerationConfig(max_new_tokens=10, temperature=0.7, ignore_eos=True)
        outs = run_all(
            engine, [ModelRequest(f"s{i}", vp.input_ids, gs, image_data=vp.image_data) for i, vp in enumerate(vps)]
        )
        for vp, resp in zip(vps, outs, strict=True):
            tf = teacher_forced_logprobs(model, vp, resp.output_tokens, temperature=0.7)
            assert torch.allclose(torch.tensor(resp.output_logprobs), tf, atol=1e-4)
        # the same prompt with a different image is a different input (no prefill sharing across images)
        other = encode_prompt(tok, proc, [{"role": "user", "content": "how many squares"}], [squares(4, (56, 56), 3)])
        assert other.input_ids == vps[0].input_ids and other.image_data != vps[0].image_data
        a, b = run_all(engine, [reqs[0], ModelRequest("o", other.input_ids, g, image_data=other.image_data)])
        assert a.output_tokens == hf_generate(model, vps[0], n) and b.output_tokens == hf_generate(model, other, n)
    finally:
        engine.destroy()


def test_generation_continues_across_weight_update(vl):
    """A weight update interrupts running rows; they continue from prompt + output with their images."""
    tok, proc, models = vl
    model = models["tiny-vl"]
    vps = prompts(tok, proc)
    engine = LocalEngine(InferenceConfig(seed=0), model, tok, image_processor=proc)
    engine.initialize()
    reached, hook = pause_at_step(engine, model, 5)  # the generic forward: eager on any device
    try:
        g = GenerationConfig(max_new_tokens=40, greedy=True, ignore_eos=True)
        state = {k: v.clone() for k, v in model.state_dict().items()}

        async def go():
            # every request is queued (its images processed in a thread) before the engine admits any: the rows
            # decode together, and the update after step 5 interrupts all of them with 5 tokens each
            engine.pause()
            tasks = [
                asyncio.create_task(engine.agenerate(ModelRequest(f"r{i}", vp.input_ids, g, image_data=vp.image_data)))
                for i, vp in enumerate(vps)
            ]
            while engine._waiting.qsize() < len(vps):
                await asyncio.sleep(0.001)
            engine.resume()
            assert await asyncio.to_thread(reached.wait, 60), "decode step 5 never ran"
            await asyncio.to_thread(engine.update_weights, WeightUpdate("tensors", 1, tensors=state))
            engine.resume()
            return await asyncio.gather(*tasks)

        outs = asyncio.run(go())
        assert engine.counters["aborts"] == len(vps)
        for vp, resp in zip(vps, outs, strict=True):
            assert resp.output_versions == [0] * 5 + [1] * 35  # each token tagged with the weights that made it
            assert resp.output_tokens == hf_generate(model, vp, 40)
    finally:
        hook.remove()  # the model is the module fixture's
        engine.destroy()


def test_bad_images_fail_the_request_with_reason(vl):
    tok, proc, models = vl
    vp = prompts(tok, proc)[0]
    engine = LocalEngine(InferenceConfig(seed=0), models["tiny-vl"], tok, image_processor=proc)
    engine.initialize()
    try:
        g = GenerationConfig(max_new_tokens=2)
        with pytest.raises(ValueError, match=r"request 'bad': image_data\[0\]: unreadable image"):
            run_all(engine, [ModelRequest("bad", vp.input_ids, g, image_data=[b"not an image"])])
        with pytest.raises(ValueError, match=r"request 'few': input_ids hold 4 image pad tokens but .* need 8"):
            two = vp.image_data * 2
            run_all(engine, [ModelRequest("few", vp.input_ids, g, image_data=two)])
        with pytest.raises(
            ValueError, match=r"request 'none': input_ids hold 4 image pad tokens but image_data is empty"
        ):
            run_all(engine, [ModelRequest("none", vp.input_ids, g)])
        ok = run_all(engine, [ModelRequest("ok", vp.input_ids, g, image_data=vp.image_data)])[0]  # still serving
        assert ok.output_len == 2
    finally:
        engine.destroy()


@pytest.mark.gpu
def test_generation_on_cuda_matches_the_cpu_references(vl):
    """The same engine code on a GPU: greedy tokens and logprobs against the CPU references."""
    import copy

    tok, proc, models = vl
    model = models["tiny-vl"]
    torch.backends.cudnn.allow_tf32 = False  # the patch embedding is a convolution: keep it fp32
    vps = prompts(tok, proc)
    engine = LocalEngine(InferenceConfig(seed=0, device="cuda"), copy.deepcopy(model), tok, image_processor=proc)
    engine.initialize()
    try:
        g = GenerationConfig(max_new_tokens=12, greedy=True, ignore_eos=True)
        outs = run_all(
            engine, [ModelRequest(f"r{i}", vp.input_ids, g, image_data=vp.image_data) for i, vp in enumerate(vps)]
        )
        for vp, resp in zip(vps, outs, strict=True):
            assert resp.output_tokens == hf_generate(model, vp, 12)
            tf = teacher_forced_logprobs(model, vp, resp.output_tokens)
            assert torch.allclose(torch.tensor(resp.output_logprobs), tf, atol=1e-4)
    finally:
        engine.destroy()
