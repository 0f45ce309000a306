"""Images in LocalEngine: a request's ``image_data`` -> vision inputs, and the multimodal prefill.

Qwen2-VL / Qwen2.5-VL place every token at a 3D position (M-RoPE: temporal, height, width).
Text tokens have three equal components; the image pad tokens of an image take the grid
positions of its merged patches, so a prompt with images ends at position ``L - 1 + delta``
with ``delta = max position + 1 - L`` (negative: an image of ``h x w`` tokens advances
positions by ``max(h, w)`` only). The prefill computes the 3D positions with the model's own
``get_rope_index`` and runs the vision tower; every later token is text, so decoding goes on
with ordinary 1D positions shifted by ``delta`` (the model broadcasts them to 3D), which is
what ``generate`` does with its cached ``rope_deltas``.
"""

from __future__ import annotations

import hashlib
import typing

import torch
from transformers import DynamicCache, PreTrainedModel

from relayrl.api.io import ModelRequest
from relayrl.data.vision import (
    VisionInputs,
    image_embeds,
    load_image,
    merge_size,
    process_images,
    prompt_image_mask,
)
from relayrl.inference.local.decode import slab_layers

if typing.TYPE_CHECKING:
    from transformers.image_processing_utils import BaseImageProcessor


def image_key(image_data: list[str | bytes]) -> str:
    """A digest of a request's images ("" without): prompts share a prefill only with equal images."""
    if not image_data:
        return ""
    h = hashlib.sha1()
    for img in image_data:
        h.update(img.encode() if isinstance(img, str) else bytes(img))
        h.update(b"\0")
    return h.hexdigest()


def request_vision(
    req: ModelRequest, image_processor: BaseImageProcessor | None, image_token_id: int
) -> VisionInputs | None:
    """The vision inputs of ``req`` (None without images); ``ValueError`` naming the request and
    the image when an image is unreadable, rejected, or does not match the prompt's pad tokens."""
    n_pad = req.input_ids.count(image_token_id) if image_token_id >= 0 else 0
    if not req.image_data:
        if n_pad:
            raise ValueError(f"request {req.rid!r}: input_ids hold {n_pad} image pad tokens but image_data is empty")
        return None
    if image_processor is None:
        raise ValueError(f"request {req.rid!r}: image_data given but the engine's model takes no images")
    images = []
    for j, img in enumerate(req.image_data):
        try:
            images.append(load_image(img))
        except ValueError as e:
            raise ValueError(f"request {req.rid!r}: image_data[{j}]: {e}") from None
    try:
        vision = process_images(image_processor, images)
    except ValueError as e:
        raise ValueError(f"request {req.rid!r}: image_data: {e}") from None
    want = int((vision.image_grid_thw.prod(-1) // merge_size(image_processor) ** 2).sum())
    if n_pad != want:
        raise ValueError(
            f"request {req.rid!r}: input_ids hold {n_pad} image pad tokens but the {len(images)} images of "
            f"image_data need {want} (grids {vision.image_grid_thw.tolist()}); expand each image's pad token "
            "with the model's processor"
        )
    return vision


def vision_prefill(
    model: PreTrainedModel,
    inputs: list[list[int]],
    visions: list[VisionInputs | None],
    device: torch.device,
    extra: dict[str, int],
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor, list[int]]:
    """One left-padded forward over prompts, some with images: per-layer (keys, values), mask
    [n, L], last logits [n, V] and each row's M-RoPE ``delta`` (decode position = length + delta)."""
    cfg = model.config
    length = max(len(x) for x in inputs)
    ids = torch.tensor([[0] * (length - len(x)) + x for x in inputs], device=device)
    mask = torch.tensor([[0] * (length - len(x)) + [1] * len(x) for x in inputs], device=device)
    given = [v for v in visions if v is not None]
    grid = torch.cat([v.image_grid_thw for v in given]).to(device)
    pixels = torch.cat([v.pixel_values for v in given]).to(device)
    merge = int(cfg.vision_config.spatial_merge_size) ** 2
    n_tokens = torch.tensor([0 if v is None else int(v.image_grid_thw.prod(-1).sum()) // merge for v in visions])
    image_mask = prompt_image_mask(ids, cfg.image_token_id, n_tokens)
    pos, deltas = model.model.get_rope_index(
        ids, mm_token_type_ids=image_mask.int(), image_grid_thw=grid, attention_mask=mask
    )
    cache = DynamicCache()
    out = model(
        inputs_embeds=image_embeds(model, ids, image_mask, pixels, grid),
        attention_mask=mask,
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        **extra,
    )
    kv = [(layer.keys, layer.values) for layer in slab_layers(cache)]
    return kv, mask, out.logits[:, -1].float(), [int(d) for d in deltas.view(-1).tolist()]
