"""Vision-language models in the train engine: images and M-RoPE positions of a packed micro-batch.

A packed micro-batch (``packing.pack``) carries its rows' images end to end. The vision tower
runs on them without the text's varlen attention arguments (its attention is per image,
non-causal), and its outputs replace the embeddings of each document's prompt image pad
tokens (a generated pad token stays a token). Positions are the 3D M-RoPE positions of each document, from the model's own
``get_rope_index``; documents without images get their 1D positions on all three axes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from relayrl.api.engine import TensorDict
from relayrl.data.vision import prompt_image_mask


@contextlib.contextmanager
def vision_forward(model: PreTrainedModel, packed: TensorDict) -> Iterator[dict[str, object]]:
    """While open, ``model(**model_inputs(packed), **extra)`` (``extra`` yielded: the ``[3, 1, T]``
    M-RoPE positions) runs with the packed images: the vision tower runs and its features replace the
    embeddings of each document's prompt image pad tokens (a generated pad token stays a token).
    Both happen inside the model's own forward (a pre-hook on its text model), as in Hugging Face's
    forward, so FSDP2 gathers the tower and the embeddings as usual."""
    image_mask, pos = _layout(model, packed)
    pixels, grid = packed["pixel_values"], packed["image_grid_thw"]

    def place_images(_: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[object, ...]:
        embeds = kwargs["inputs_embeds"]
        assert isinstance(embeds, torch.Tensor)
        if grid.shape[0]:
            out = model.model.get_image_features(pixels, grid, return_dict=True)
            feats = torch.cat(list(out.pooler_output)).to(embeds.dtype)
            kwargs["inputs_embeds"] = embeds.masked_scatter(image_mask[None, :, None], feats)
        else:  # no image here: the tower still runs, on a blank image weighted 0, so that FSDP2 ranks gather alike
            m = int(model.config.vision_config.spatial_merge_size)
            blank = pixels.new_zeros(m * m, pixels.shape[1])
            out = model.model.get_image_features(
                blank, torch.tensor([[1, m, m]], device=pixels.device), return_dict=True
            )
            kwargs["inputs_embeds"] = embeds + 0.0 * torch.cat(list(out.pooler_output)).sum().to(embeds.dtype)
        return args, kwargs

    handle = model.model.language_model.register_forward_pre_hook(place_images, with_kwargs=True)
    try:
        yield {"position_ids": pos[:, None, :]}
    finally:
        handle.remove()


def _layout(model: PreTrainedModel, packed: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T]`` the prompt image pad tokens of the packed documents, and their ``[3, T]`` M-RoPE positions
    (each document restarts at 0; one without images has its 1D positions on all three axes)."""
    ids, grid = packed["input_ids"], packed["image_grid_thw"]
    merge = int(model.config.vision_config.spatial_merge_size) ** 2
    cu = packed["cu_seqlens"].tolist()
    image_mask = torch.zeros_like(ids, dtype=torch.bool)
    pos = packed["position_ids"][None].repeat(3, 1)
    first = 0
    for d, n in enumerate(packed["image_rows"].tolist()):
        if not n:
            continue
        doc, doc_grid = ids[cu[d] : cu[d + 1]][None], grid[first : first + n]
        mask = prompt_image_mask(doc, model.config.image_token_id, doc_grid.prod(-1).sum()[None] // merge)
        image_mask[cu[d] : cu[d + 1]] = mask[0]
        p, _ = model.model.get_rope_index(doc, mm_token_type_ids=mask.int(), image_grid_thw=doc_grid)
        pos[:, cu[d] : cu[d + 1]] = p[:, 0]
        first += n
    return image_mask, pos
