"""Vision-language models in the train engine: images and M-RoPE positions of a packed micro-batch.

A packed micro-batch (``packing.pack``) carries its rows' images end to end. The vision tower
runs on them on its own (so the text's varlen attention arguments never reach it; its
attention is per image, non-causal), and the model scatters its outputs into the image pad
tokens. Positions are the 3D M-RoPE positions of each document, from the model's own
``get_rope_index``; documents without images get their 1D positions on all three axes.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from relayrl.api.engine import TensorDict


def vision_model_inputs(model: PreTrainedModel, packed: TensorDict) -> dict[str, object]:
    """Extra ``model(**...)`` arguments for a packed micro-batch with images (see module doc)."""
    inner = model.model
    grid = packed["image_grid_thw"]
    features = inner.get_image_features(packed["pixel_values"], grid, return_dict=True)
    return {"mm_encoder_outputs": {"image": features}, "position_ids": mrope_positions(model, packed)[:, None, :]}


def mrope_positions(model: PreTrainedModel, packed: TensorDict) -> torch.Tensor:
    """``[3, T]`` M-RoPE positions of the packed documents (each restarts at 0)."""
    ids, text = packed["input_ids"], packed["position_ids"]
    pos = text[None].repeat(3, 1)
    cu = packed["cu_seqlens"].tolist()
    counts = packed["image_rows"].tolist()
    grid, first = packed["image_grid_thw"], 0
    image_token_id = model.config.image_token_id
    for d, n in enumerate(counts):
        if not n:
            continue
        doc = ids[cu[d] : cu[d + 1]][None]
        p, _ = model.model.get_rope_index(
            doc, mm_token_type_ids=(doc == image_token_id).int(), image_grid_thw=grid[first : first + n]
        )
        pos[:, cu[d] : cu[d + 1]] = p[:, 0]
        first += n
    return pos
