"""Dataset rows with images: an ``images`` column (paths, bytes, PIL, base64) or image content parts,
turned into vision prompts by the processor; a bad image fails its row with index and reason, or is
skipped with ``data.skip_invalid_rows``."""

from __future__ import annotations

import base64
import io
import json

import pytest
import torch

from relayrl.data.datasets import DatasetError, attach_vision, load_rows_from_file
from relayrl.data.models import build_vl_tokenizer
from relayrl.data.vision import IMAGE_BLOCK, build_image_processor, encode_prompt, squares_image
from relayrl.rollout.workflows.rlvr import RLVRWorkflow
from tests.test_vision import squares


@pytest.fixture(scope="module")
def tp():
    return build_vl_tokenizer(), build_image_processor()


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_every_image_form_gives_the_same_prompt(tp, tmp_path):
    tok, proc = tp
    img = squares(2, (84, 56), seed=1)
    path = tmp_path / "a.png"
    img.save(path)
    b64 = base64.b64encode(png(img)).decode()
    user = [{"role": "user", "content": "how many?"}]
    forms = [img, png(img), str(path), b64, f"data:image/png;base64,{b64}"]
    vps = [encode_prompt(tok, proc, user, [f]) for f in forms]
    parts = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": b64}}, {"type": "text", "text": "how many?"}],
        }
    ]
    vps.append(encode_prompt(tok, proc, parts, []))
    for vp in vps[1:]:
        assert vp.input_ids == vps[0].input_ids
        assert torch.equal(vp.vision.pixel_values, vps[0].vision.pixel_values)
    grid = vps[0].vision.image_grid_thw
    assert grid.tolist() == [[1, 4, 6]]  # 56 x 84 pixels: 4 x 6 patches of 14
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert vps[0].input_ids.count(pad) == 6  # 24 patches / merge 2x2
    text = tok.decode(vps[0].input_ids)
    assert text.startswith("<|user|><|vision_start|>" + "<|image_pad|>" * 6 + "<|vision_end|>how many?")
    assert IMAGE_BLOCK in tok.decode(encode_prompt(tok, proc, user, [img, img]).input_ids).replace(
        "<|image_pad|>" * 6, "<|image_pad|>"
    )


def test_file_rows_with_images_and_bad_rows(tp, tmp_path):
    tok, proc = tp
    good = base64.b64encode(png(squares(1))).decode()
    rows = [
        {"id": "a", "question": "count", "images": [good], "answer": "1"},
        {"id": "b", "question": "count", "images": ["bm90IGFuIGltYWdl"], "answer": "2"},
        {
            "id": "c",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": good}}]}],
            "answer": "1",
        },
        {"id": "d", "question": "no picture", "answer": "3"},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DatasetError, match=r"row 1 \(id='b'\): image 0: unreadable image"):
        load_rows_from_file(path, tokenizer=tok, image_processor=proc)
    with pytest.raises(DatasetError, match=r"row 0 \(id='a'\) has images but the model takes none"):
        load_rows_from_file(path, tokenizer=tok)
    ok = load_rows_from_file(path, tokenizer=tok, image_processor=proc, skip_invalid=True, prompt_key="question")
    assert [r["id"] for r in ok] == ["a", "d"]  # b: bad image, c: no 'question'
    assert "vision" in ok[0] and "images" not in ok[0] and "vision" not in ok[1]


def test_attach_vision_skips_or_names_the_bad_row(tp):
    tok, proc = tp
    rows = [
        {"id": 0, "messages": [{"role": "user", "content": "n?"}], "images": [squares_image((0,), (0,), ((0, 0),))]},
        {"id": 1, "messages": [{"role": "user", "content": "n?"}], "images": [b"\x89PNG broken"]},
    ]
    with pytest.raises(DatasetError, match=r"task t: row 1 \(id=1\): image 0: unreadable image"):
        attach_vision(rows, tok, proc, source="task t")
    assert [r["id"] for r in attach_vision(rows, tok, proc, skip_invalid=True)] == [0]


def test_rlvr_episode_carries_vision_inputs(tp):
    """The workflow sends image_data and the trajectory carries the processor's outputs (a real LocalEngine)."""
    import asyncio

    from relayrl.api.config import InferenceConfig
    from relayrl.api.io import GenerationConfig
    from relayrl.api.workflow import validate_trajectory
    from relayrl.data.models import build_tiny_vl_model
    from relayrl.inference.local import LocalEngine

    tok, proc = tp
    row = attach_vision(
        [{"id": 0, "messages": [{"role": "user", "content": "n?"}], "images": [squares(2)], "answer": "2"}], tok, proc
    )[0]
    engine = LocalEngine(InferenceConfig(), build_tiny_vl_model("tiny-vl").eval(), tok, image_processor=proc)
    engine.initialize()
    try:
        seen = {}

        def reward(prompt, completions, prompt_ids, completion_ids, answer, **data):
            seen.update(data, prompt_ids=prompt_ids)
            return 1.0

        wf = RLVRWorkflow(reward, GenerationConfig(max_new_tokens=3, ignore_eos=True), tok)
        traj = asyncio.run(wf.arun_episode(engine, row))
    finally:
        engine.destroy()
    validate_trajectory(traj)
    vp = row["vision"]
    assert traj["input_ids"][0, : len(vp.input_ids)].tolist() == vp.input_ids
    assert torch.equal(traj["pixel_values"][0], vp.vision.pixel_values)
    assert torch.equal(traj["image_grid_thw"][0], vp.vision.image_grid_thw)
    assert "vision" not in seen and seen["prompt_ids"] == vp.input_ids  # reward fns get no tensors


def test_a_picture_task_needs_a_vision_model():
    from relayrl.api.config import RunConfig, load_config
    from relayrl.data.models import load_tokenizer
    from relayrl.wiring import load_rows

    cfg = load_config(RunConfig, None, ["data.task=count_squares", "data.n_train=8", "data.n_eval=2"])
    with pytest.raises(ValueError, match="data.task='count_squares' has images but model.path='tiny' takes none"):
        load_rows(cfg, load_tokenizer(cfg.model))
    cfg.model.path = "tiny-vl"
    train, evals = load_rows(cfg, load_tokenizer(cfg.model))
    assert len(train) == 8 and len(evals) == 2 and all("vision" in r for r in train + evals)
    counts = {r["answer"] for r in train + evals}
    assert counts <= {"1", "2", "3"}
