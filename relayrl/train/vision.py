"""Vision-language models in the train engine: images and M-RoPE positions of a packed micro-batch.

A packed micro-batch (``packing.pack``) carries its rows' images end to end. The vision tower
runs on them on its own (so the text's varlen attention arguments never reach it; its
attention is per image, non-causal), and its outputs replace the embeddings of each
document's prompt image pad tokens (a generated pad token stays a token). Positions are the 3D M-RoPE positions of each document, from the model's own
``get_rope_index``; documents without images get their 1D positions on all three axes.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from relayrl.api.engine import TensorDict
from relayrl.data.vision import image_embeds, prompt_image_mask


def vision_model_inputs(model: PreTrainedModel, packed: TensorDict) -> dict[str, object]:
    """``model(**...)`` arguments for a packed micro-batch with images (see module doc): input
    embeddings with the vision features in place, and ``[3, 1, T]`` M-RoPE positions."""
    ids = packed["input_ids"]
    grid = packed["image_grid_thw"]
    merge = int(model.config.vision_config.spatial_merge_size) ** 2
    cu = packed["cu_seqlens"].tolist()
    counts = packed["image_rows"].tolist()
    image_mask = torch.zeros_like(ids, dtype=torch.bool)
    pos = packed["position_ids"][None].repeat(3, 1)  # documents without images: 1D positions on all axes
    first = 0
    for d, n in enumerate(counts):
        if not n:
            continue
        doc, doc_grid = ids[cu[d] : cu[d + 1]][None], grid[first : first + n]
        mask = prompt_image_mask(doc, model.config.image_token_id, doc_grid.prod(-1).sum()[None] // merge)
        image_mask[cu[d] : cu[d + 1]] = mask[0]
        p, _ = model.model.get_rope_index(doc, mm_token_type_ids=mask.int(), image_grid_thw=doc_grid)
        pos[:, cu[d] : cu[d + 1]] = p[:, 0]
        first += n
    embeds = image_embeds(model, ids[None], image_mask[None], packed["pixel_values"], grid)
    return {"input_ids": None, "inputs_embeds": embeds, "position_ids": pos[:, None, :]}
