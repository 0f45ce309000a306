"""Images in prompts: the Qwen2-VL image processor, vision prompts, and rows with images.

A vision prompt is text with one ``<|vision_start|><|image_pad|><|vision_end|>`` block per
image; the image processor turns each image into patches (``pixel_values [P, C*T*p*p]``) and
a grid (``image_grid_thw [n_images, 3]``), and each block's single ``<|image_pad|>`` expands
to ``t*h*w / merge_size**2`` pad tokens, which the model replaces by the vision tower's
outputs. ``encode_prompt`` does exactly that (our own few lines instead of the HF processor,
whose video half needs torchvision). The generator gets the raw images (``image_data``, PNG
bytes: SGLang's field); the trainer gets the processor outputs (``pixel_values``,
``image_grid_thw``, Hugging Face's names).

Nothing here downloads; the tiny VL models themselves are built in ``relayrl.data.models``, and
dataset rows get their images through ``relayrl.data.datasets.attach_vision``.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import typing
from dataclasses import dataclass

import torch
from PIL import Image
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.image_processing_utils import BaseImageProcessor

from relayrl.data.presets import VL_PRESETS

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
# small images keep the tiny models fast: at most 4x4 merged patches (16 vision tokens) per image
MIN_PIXELS, MAX_PIXELS = 28 * 28, 112 * 112


def is_vision_config(config: object) -> bool:
    """A model config with a vision tower (Qwen2-VL style: image tokens replaced by vision features)."""
    return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None


def build_image_processor(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> BaseImageProcessor:
    """Qwen2-VL's image processor (PIL backend: no torchvision) with small pixel bounds."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, patch_size=14, merge_size=2
    )


def load_image_processor(path: str) -> BaseImageProcessor:
    """The image processor of a model path (a tiny preset's, or a checkpoint's, PIL backend)."""
    if path in VL_PRESETS:
        return build_image_processor()
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path, backend="pil")


MAX_IMAGE_BYTES = 64 << 20  # one encoded image


def inline_image(image: object, where: str) -> bytes:
    """The encoded bytes of an image a client sent (a ``data:`` URL or base64 text): servers never
    read a file a client names (``/etc/shadow``, ``/dev/zero``, a directory). ValueError naming
    ``where`` otherwise, saying nothing about the server's files."""
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    if not isinstance(image, str):
        raise ValueError(f"{where}: an image must be a data: URL or base64 text, got {type(image).__name__}")
    text = image.split(",", 1)[-1] if image.startswith("data:") else image
    if len(text) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ValueError(f"{where}: image over {MAX_IMAGE_BYTES >> 20} MiB")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(
            f"{where}: not a data: URL or base64 image data (servers take no file paths or URLs): {image[:40]!r}"
        ) from None


def load_image(image: object) -> Image.Image:
    """An RGB PIL image from a PIL image, encoded bytes, a file path, a ``data:`` URL or base64 text.

    Raises ``ValueError`` with the reason when it cannot be read."""
    from PIL import UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, dict) and isinstance(image.get("bytes"), bytes):  # HF datasets' Image feature
        image = image["bytes"]
    if isinstance(image, str):
        if image.startswith("data:"):
            image = image.split(",", 1)[-1]
        elif os.path.isfile(image):
            with open(image, "rb") as f:
                image = f.read(MAX_IMAGE_BYTES + 1)
            if len(image) > MAX_IMAGE_BYTES:
                raise ValueError(f"image file over {MAX_IMAGE_BYTES >> 20} MiB")
        elif image.startswith(("http://", "https://")):
            raise ValueError(f"image URLs are not fetched (no network); pass a path or bytes: {image[:80]!r}")
        if isinstance(image, str):
            try:
                image = base64.b64decode(image, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"not an existing file, a data URL or base64 image data: {image[:80]!r}") from None
    if not isinstance(image, (bytes, bytearray)):
        raise ValueError(f"an image must be a PIL image, bytes, a path or base64 text, got {type(image).__name__}")
    try:
        img = Image.open(io.BytesIO(image))
        img.load()
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"unreadable image ({len(image)} bytes): {e}") from None
    return img.convert("RGB")


_COLOURS = ((220, 40, 40), (40, 170, 60), (40, 70, 220))


def squares_image(cells: tuple[int, ...], colours: tuple[int, ...], offsets: tuple[tuple[int, int], ...]) -> object:
    """A white 56x56 image with a 20x20 square of ``_COLOURS[c]`` in each quadrant of ``cells`` (0-3,
    row-major), shifted by ``offsets`` inside the quadrant: the ``count_squares`` task's pictures."""
    img = Image.new("RGB", (56, 56), (255, 255, 255))
    for cell, c, (dx, dy) in zip(cells, colours, offsets, strict=True):
        x, y = 28 * (cell % 2) + dx, 28 * (cell // 2) + dy
        img.paste(_COLOURS[c], (x, y, x + 20, y + 20))
    return img


def png_bytes(image: Image.Image) -> bytes:
    """A PIL image encoded as PNG (what requests carry: lossless, SGLang and vLLM decode it)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class VisionInputs:
    """The processor's outputs for the images of one prompt."""

    pixel_values: torch.Tensor  # [P, C*T*p*p] patches of all images, in order
    image_grid_thw: torch.Tensor  # [n_images, 3] int64


def process_images(image_processor: BaseImageProcessor, images: list[Image.Image]) -> VisionInputs:
    """Run the image processor over decoded images (``ValueError`` with its reason if it rejects them)."""
    try:
        out = image_processor(images=images, return_tensors="pt")
    except Exception as e:  # noqa: BLE001 - any processor failure is a bad input
        raise ValueError(f"the image processor rejected the image: {type(e).__name__}: {e}") from None
    return VisionInputs(out["pixel_values"].float(), out["image_grid_thw"].long())


def images_from_patches(
    image_processor: BaseImageProcessor, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
) -> list[Image.Image]:
    """The images back from one episode's patches (``[P, C*T*p*p]``, zero rows after its own) and grids
    (``[N, 3]``, zero rows after its own): the inverse of Qwen2-VL's patch layout and normalisation,
    for ``relayrl inspect`` to show what the model saw."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD  # Qwen2-VL's defaults

    ps, ms = int(getattr(image_processor, "patch_size", 14)), merge_size(image_processor)
    tps = int(getattr(image_processor, "temporal_patch_size", 1))
    mean = torch.tensor(getattr(image_processor, "image_mean", OPENAI_CLIP_MEAN), dtype=torch.float64)[:, None, None]
    std = torch.tensor(getattr(image_processor, "image_std", OPENAI_CLIP_STD), dtype=torch.float64)[:, None, None]
    scale = float(getattr(image_processor, "rescale_factor", 1 / 255))
    out, start = [], 0
    for t, h, w in image_grid_thw.tolist():
        if t * h * w == 0:
            break
        x = pixel_values[start : start + t * h * w].double()
        start += t * h * w
        c = x.shape[1] // (tps * ps * ps)
        # patches are (t, h/m, w/m, m, m) x (c, tps, p, p): back to frames (t*tps, c, h*p, w*p)
        x = x.reshape(t, h // ms, w // ms, ms, ms, c, tps, ps, ps).permute(0, 6, 5, 1, 3, 7, 2, 4, 8)
        frame = x.reshape(t * tps, c, h * ps, w * ps)[0] * std + mean
        pixels = (frame / scale).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
        out.append(Image.fromarray(pixels))
    return out


def png_data_urls(
    image_processor: BaseImageProcessor, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, longest: int = 384
) -> list[str]:
    """``images_from_patches`` as PNG ``data:`` URLs, shrunk to ``longest`` pixels on their longer side."""
    urls = []
    for image in images_from_patches(image_processor, pixel_values, image_grid_thw):
        image.thumbnail((longest, longest))
        urls.append("data:image/png;base64," + base64.b64encode(png_bytes(image)).decode())
    return urls


def merge_size(image_processor: BaseImageProcessor) -> int:
    return int(getattr(image_processor, "merge_size", 2))


def expand_image_tokens(ids: list[int], grid: torch.Tensor, image_token_id: int, merge: int) -> list[int]:
    """Each single image pad token of ``ids`` becomes as many as its image has merged patches.

    ``ValueError`` when the number of image tokens differs from the number of images."""
    n_blocks = ids.count(image_token_id)
    if n_blocks != grid.shape[0]:
        raise ValueError(f"the prompt has {n_blocks} image placeholders but {grid.shape[0]} images")
    counts = iter((grid.prod(-1) // (merge * merge)).tolist())
    out: list[int] = []
    for t in ids:
        out.extend([t] * int(next(counts)) if t == image_token_id else [t])
    return out


IMAGE_PARTS = ("image", "image_url", "input_image")  # the content part types that carry an image


def messages_with_image_blocks(messages: list[dict[str, object]], n_images: int) -> list[dict[str, str]]:
    """Chat turns with plain-string content: image content parts (``{"type": "image"}`` /
    ``"image_url"``) become ``IMAGE_BLOCK``; with no image parts at all, the blocks of the row's
    ``n_images`` images go before the first user turn's text."""
    out, seen = [], 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                kind = p.get("type") if isinstance(p, dict) else None
                if kind in IMAGE_PARTS:
                    parts.append(IMAGE_BLOCK)
                    seen += 1
                elif kind == "text":
                    parts.append(str(p.get("text", "")))
                else:
                    raise ValueError(f"unknown content part {str(p)[:80]!r} (expected text or image parts)")
            content = "".join(parts)
        if not isinstance(content, str):
            raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")
        out.append({"role": str(m.get("role")), "content": content})
    if seen == 0 and n_images:
        first = next(i for i, m in enumerate(out) if m["role"] == "user")
        out[first] = {"role": "user", "content": IMAGE_BLOCK * n_images + out[first]["content"]}
    return out


def image_parts(messages: list[dict[str, object]]) -> list[object]:
    """The images embedded in content parts (``image`` / ``image_url.url``), in order."""
    found: list[object] = []
    for m in messages:
        content = m.get("content")
        for p in content if isinstance(content, list) else []:
            if not isinstance(p, dict):
                continue
            if p.get("type") == "image" and p.get("image") is not None:
                found.append(p["image"])
            elif p.get("type") in ("image_url", "input_image"):
                url = p.get("image_url")
                found.append(url.get("url") if isinstance(url, dict) else url)
    return found


@dataclass
class VisionPrompt:
    """One prompt with images: expanded token ids, the raw images (PNG) for the generator, the
    processor outputs for the trainer."""

    input_ids: list[int]
    image_data: list[bytes]
    vision: VisionInputs


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    image_processor: BaseImageProcessor,
    messages: list[dict[str, object]],
    images: list[object],
) -> VisionPrompt:
    """A chat prompt with images -> ``VisionPrompt`` (``ValueError`` naming what is wrong)."""
    from relayrl.data.chat import prompt_ids

    images = list(images) + image_parts(messages)
    decoded = []
    for j, img in enumerate(images):
        try:
            decoded.append(load_image(img))
        except ValueError as e:
            raise ValueError(f"image {j}: {e}") from None
    if not decoded:
        raise ValueError("a vision prompt needs at least one image ('images' column or image content parts)")
    vision = process_images(image_processor, decoded)
    ids = prompt_ids(tokenizer, messages_with_image_blocks(messages, len(decoded)), "chat")
    image_token_id = int(typing.cast(int, tokenizer.convert_tokens_to_ids("<|image_pad|>")))
    ids = expand_image_tokens(ids, vision.image_grid_thw, image_token_id, merge_size(image_processor))
    return VisionPrompt(ids, [png_bytes(img) for img in decoded], vision)


def has_images(row: dict[str, object]) -> bool:
    """A row with an ``images`` column or image content parts in ``messages``."""
    messages = row.get("messages")
    return bool(row.get("images")) or bool(image_parts(messages if isinstance(messages, list) else []))


def with_vision(
    row: dict[str, object], tokenizer: PreTrainedTokenizerBase, image_processor: BaseImageProcessor
) -> dict[str, object]:
    """``row`` with ``vision`` (its ``VisionPrompt``) instead of its ``images`` column (kept as PNG in
    the prompt); ``ValueError`` with the reason when an image is unreadable or rejected."""
    images = row.get("images")
    images = [] if images is None else images if isinstance(images, list) else [images]
    vp = encode_prompt(tokenizer, image_processor, typing.cast(list[dict[str, object]], row["messages"]), images)
    return {**{k: v for k, v in row.items() if k != "images"}, "vision": vp}


def image_embeds(
    model: PreTrainedModel, ids: torch.Tensor, image_mask: torch.Tensor, pixel_values: torch.Tensor, grid: torch.Tensor
) -> torch.Tensor:
    """Input embeddings of ``ids`` with the vision tower's outputs at ``image_mask`` (the prompts'
    image pad tokens, in order). Passing embeddings instead of ids keeps a *generated* image pad
    token (a model may sample any id) a plain token, where the model's own placement would
    count it as an image slot and fail."""
    features = model.model.get_image_features(pixel_values, grid, return_dict=True).pooler_output
    embeds = model.get_input_embeddings()(ids)
    feats = torch.cat(list(features)).to(embeds.dtype)
    if int(image_mask.sum()) != feats.shape[0]:
        raise ValueError(f"{int(image_mask.sum())} image pad tokens but {feats.shape[0]} image features")
    return embeds.masked_scatter(image_mask[..., None].to(embeds.device), feats)


def prompt_image_mask(ids: torch.Tensor, image_token_id: int, n_image_tokens: torch.Tensor) -> torch.Tensor:
    """``[B, L]``: the first ``n_image_tokens[b]`` image pad tokens of each row (its prompt's; any later
    one was generated and is an ordinary token)."""
    is_image = ids == image_token_id
    return is_image & (is_image.long().cumsum(-1) <= n_image_tokens.to(ids.device)[:, None])


def row_vision(row: dict[str, object]) -> VisionPrompt | None:
    """The ``VisionPrompt`` a row carries (``datasets.attach_vision``), None for a text-only row."""
    vp = row.get("vision")
    return vp if isinstance(vp, VisionPrompt) else None


def row_to_json(row: dict[str, object]) -> dict[str, object]:
    """``row`` with its ``VisionPrompt`` as JSON (token ids, PNG images in base64), for a checkpoint's
    pending prompts; the processor outputs are recomputed on load (``row_from_json``)."""
    vp = row.get("vision")
    if not isinstance(vp, VisionPrompt):
        return row
    png = [base64.b64encode(b).decode() for b in vp.image_data]
    return {**row, "vision": {"input_ids": vp.input_ids, "png_base64": png}}


def row_from_json(row: dict[str, object], image_processor: BaseImageProcessor | None) -> dict[str, object]:
    """The inverse of ``row_to_json``: PNG is lossless, so the images, and the processor outputs
    computed from them, are the ones the row had when it was saved."""
    saved = row.get("vision")
    if not isinstance(saved, dict):
        return row
    if image_processor is None:
        raise ValueError("a checkpoint's pending prompt has images but model.path takes none")
    data = [base64.b64decode(s) for s in typing.cast(list[str], saved["png_base64"])]
    vision = process_images(image_processor, [load_image(b) for b in data])
    return {**row, "vision": VisionPrompt(list(typing.cast(list[int], saved["input_ids"])), data, vision)}
