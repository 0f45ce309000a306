"""Request/response mapping for the servers RemoteEngine talks to: relayrl, SGLang, vLLM.

Pure functions over JSON-like dicts (no I/O), so each protocol is unit-tested against the
payloads documented by its project:

- SGLang native API: ``POST /generate`` with ``input_ids``, ``sampling_params`` and
  ``return_logprob``; the reply's ``meta_info`` holds ``output_token_logprobs`` as
  ``[logprob, token_id, text]`` triples, ``finish_reason`` ``{"type": ...}`` and
  ``weight_version``. Weights: ``/update_weights_from_disk`` ``{"model_path", ...}``.
- relayrl: the SGLang protocol plus per-token ``output_token_versions``, an HTTP weight
  upload (``/update_weights_from_tensor``, a safetensors body), and batches answered item by
  item as they finish (``stream_items``: NDJSON lines ``{"index": i, ...}``).
- vLLM: OpenAI ``/v1/completions`` with token-id ``prompt`` and ``logprobs=0``;
  ``return_tokens_as_token_ids`` makes every returned token read ``"token_id:<id>"``. Pause
  and resume are the RL routes ``/pause?mode=abort`` (in-flight requests end with
  ``finish_reason`` ``abort`` and their partial tokens, so every token's version is known) and
  ``/resume``; weights go through vLLM's weight-transfer API (``/init_weight_transfer_engine``,
  ``/update_weights``, and ``/start_weight_update`` / ``/finish_weight_update`` where the server
  has them), or, on a vLLM without it, a disk reload through the dev-mode ``/collective_rpc``.
  Sampled-token logprobs follow the temperature only with ``--logprobs-mode processed_logprobs``
  (``logprob_probe`` checks it at connect).
- LoRA adapters (``model.lora.sync=adapter``): SGLang ``/load_lora_adapter`` and
  ``/unload_lora_adapter`` ``{"lora_name", "lora_path"}``, the adapter named per request in
  ``/generate``'s ``lora_path``; vLLM ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
  (same fields), the adapter named as the request's ``model``.
- Images: SGLang (and relayrl) take ``image_data`` beside ``input_ids``. vLLM's ``/v1/completions``
  takes none with a token-id prompt, so a prompt with images is two calls: ``/v1/chat/completions/render``
  of a message holding only the images (its ``features``: per image a hash, a placeholder range and
  the processed tensors, opaque here), then ``/inference/v1/generate`` with our ``token_ids``, those
  features placed on our prompt's placeholder runs, and vLLM's ``sampling_params``.

Batches (``batch`` / ``split``): several generate calls to one server become one HTTP call in
each project's documented batch form. SGLang's ``/generate`` takes lists (``rid``,
``input_ids`` as a list of lists, one ``sampling_params`` dict per item) and answers a list
of per-item replies; vLLM's ``/v1/completions`` takes a list of token-id prompts sharing one
set of sampling parameters and answers one choice per prompt, in prompt order.
"""

from __future__ import annotations

import base64
import typing
from dataclasses import dataclass
from typing import Any

import torch

from relayrl.api.io import GenerationConfig, StopReason
from relayrl.utils.moe import decode_routed_experts

JsonDict = dict[str, object]


class ProtocolError(ValueError):
    """A server reply that does not have the documented shape."""


class ServerError(RuntimeError):
    """A server answered 5xx (retried elsewhere)."""


@dataclass
class Parsed:
    """One /generate reply, protocol-independent."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    versions: list[int] | None = None  # per-token versions when the server reports them
    weight_version: int | None = None  # the server's version when it answered
    routed_experts: torch.Tensor | None = None  # MoE: [input + output - 1, layers, top_k] when asked and given


@dataclass
class Call:
    """An HTTP call: method, path (with query), JSON body."""

    method: str
    path: str
    json: JsonDict | None = None


WEIGHT_GROUP = "weight_update_group"  # SGLang's default group name
RENDER_CHAT = "/v1/chat/completions/render"  # vLLM: messages -> token ids + multimodal features
GENERATE_TOKENS = "/inference/v1/generate"  # vLLM: token ids (+ features) -> token ids + logprobs


def wire_image(image: str | bytes) -> str:
    """An image of ``ModelRequest.image_data`` as JSON text: encoded bytes become a base64 ``data:`` URL
    (SGLang, vLLM and relayrl all read those); text (a data: URL, base64, a server-side path) is sent as is."""
    if isinstance(image, str):
        return image
    kind = "png" if image[:4] == b"\x89PNG" else "jpeg" if image[:2] == b"\xff\xd8" else "octet-stream"
    mime = f"image/{kind}" if kind != "octet-stream" else "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(bytes(image)).decode()}"


def _int_or_none(v: object) -> int | None:
    if not isinstance(v, (int, float, str)):
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _penalties(g: GenerationConfig) -> JsonDict:
    """OpenAI's penalties under SGLang's and vLLM's names, sent only when set."""
    return {k: getattr(g, k) for k in ("frequency_penalty", "presence_penalty") if getattr(g, k)}


class SGLangBackend:
    """SGLang's native HTTP protocol."""

    name = "sglang"
    supports_upload = False
    streams_items = False  # batched replies come as one list
    return_routed_experts = False  # ask for the routed experts (inference.return_routed_experts)

    def sampling_params(self, g: GenerationConfig, max_new_tokens: int, min_new_tokens: int) -> JsonDict:
        return {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": min_new_tokens,
            "temperature": 0.0 if g.greedy else g.temperature,
            "top_p": g.top_p,
            "top_k": -1 if g.top_k == 0 else g.top_k,  # SGLang: -1 = off
            "stop": list(g.stop),
            "stop_token_ids": list(g.stop_token_ids),
            "ignore_eos": g.ignore_eos,
            "skip_special_tokens": False,
            **_penalties(g),
        }

    def generate(
        self,
        rid: str,
        input_ids: list[int],
        g: GenerationConfig,
        max_new: int,
        min_new: int,
        images: list[str] | None = None,
        adapter: str = "",
        features: JsonDict | None = None,
    ) -> Call:
        """``adapter``: the name of a loaded LoRA adapter to generate with (SGLang's ``lora_path``).
        ``features`` is vLLM's (rendered images); SGLang takes the images themselves."""
        body: JsonDict = {
            "rid": rid,
            "input_ids": list(input_ids),
            "sampling_params": self.sampling_params(g, max_new, min_new),
            "return_logprob": True,
            "stream": False,
        }
        if self.return_routed_experts:
            body["return_routed_experts"] = True
        if images:  # SGLang's image_data: the prompt's images in order (data: URLs), pad tokens already expanded
            body["image_data"] = list(images)
        if adapter:
            body["lora_path"] = adapter
        return Call("POST", "/generate", body)

    def parse_generate(self, body: object) -> Parsed:
        if isinstance(body, list) and len(body) == 1:
            body = body[0]
        if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
            raise ProtocolError(f"/generate reply lacks meta_info: {str(body)[:200]}")
        meta = body["meta_info"]
        triples = meta.get("output_token_logprobs") or []
        tokens = body.get("output_ids")
        if tokens is None:
            tokens = [int(t[1]) for t in triples]
        if len(triples) != len(tokens):
            raise ProtocolError(f"{len(tokens)} output_ids but {len(triples)} output_token_logprobs")
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind not in ("stop", "length", "abort"):
            raise ProtocolError(f"unknown finish_reason {finish!r}")
        versions = meta.get("output_token_versions")
        routed = None
        if isinstance(meta.get("routed_experts"), str) and isinstance(meta.get("routed_experts_shape"), list):
            try:
                routed = decode_routed_experts(meta["routed_experts"], meta["routed_experts_shape"])
            except (ValueError, TypeError) as e:
                raise ProtocolError(f"/generate reply has malformed routed_experts: {e}") from None
        return Parsed(
            tokens=[int(t) for t in tokens],
            logprobs=[float(t[0]) for t in triples],
            stop_reason=kind,
            versions=[int(v) for v in versions] if isinstance(versions, list) else None,
            weight_version=_int_or_none(meta.get("weight_version")),
            routed_experts=routed,
        )

    def batch(self, calls: list[Call]) -> list[tuple[Call, list[int]]]:
        """``generate`` calls merged into batched calls: (call, indices of the items it carries).
        One item keeps the single form."""
        if len(calls) == 1:
            return [(calls[0], [0])]
        bodies = [c.json or {} for c in calls]
        body: JsonDict = {
            "rid": [b["rid"] for b in bodies],
            "input_ids": [b["input_ids"] for b in bodies],
            "sampling_params": [b["sampling_params"] for b in bodies],
            "return_logprob": True,
            "stream": False,
        }
        if self.return_routed_experts:
            body["return_routed_experts"] = True
        if any("image_data" in b for b in bodies):  # one list of images per item ([] for a text-only one)
            body["image_data"] = [b.get("image_data", []) for b in bodies]
        if any("lora_path" in b for b in bodies):  # one adapter name (or None: the base) per item
            body["lora_path"] = [b.get("lora_path") for b in bodies]
        return [(Call("POST", "/generate", body), list(range(len(calls))))]

    def split(self, body: object, n: int) -> list[object]:
        """The per-item replies of a batched call's reply (each one for ``parse_generate``)."""
        if not isinstance(body, list) or len(body) != n:
            got = f"{len(body)} items" if isinstance(body, list) else type(body).__name__
            raise ProtocolError(f"batched /generate of {n} items answered {got}")
        return body

    def update_from_disk(self, path: str, version: int) -> Call:
        # abort_all_requests: in-flight requests end with finish_reason "abort" and the client
        # resubmits prompt + partial tokens under the new weights (interruptible rollout).
        body: JsonDict = {"model_path": path, "weight_version": str(version), "abort_all_requests": True}
        return Call("POST", "/update_weights_from_disk", body)

    def upload(self, version: int) -> Call:
        raise NotImplementedError(
            f"{self.name} servers take no safetensors upload; use inference.weight_sync=disk with a shared weight_sync_dir"
        )

    def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str) -> Call:
        body: JsonDict = {
            "master_address": host,
            "master_port": port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": WEIGHT_GROUP,
            "backend": backend,
        }
        return Call("POST", "/init_weights_update_group", body)

    def destroy_weight_group(self) -> Call:
        return Call("POST", "/destroy_weights_update_group", {"group_name": WEIGHT_GROUP})

    def update_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int | None, abort: bool = True
    ) -> Call:
        """One bucket of a broadcast update: the version goes with the last bucket only (the server
        reports it once every bucket is loaded), the abort of in-flight requests with the first."""
        body: JsonDict = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": WEIGHT_GROUP,
            "abort_all_requests": abort,
        }
        if version is not None:
            body["weight_version"] = str(version)
        return Call("POST", "/update_weights_from_distributed", body)

    def load_adapter(self, name: str, path: str) -> Call:
        """Load the peft adapter at ``path`` (read by the server) under ``name``."""
        return Call("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_adapter(self, name: str) -> Call:
        return Call("POST", "/unload_lora_adapter", {"lora_name": name})

    def parse_adapter_load(self, name: str, body: object) -> None:
        """SGLang answers ``{"success", "error_message", "loaded_adapters": {name: path}}``."""
        loaded = body.get("loaded_adapters") if isinstance(body, dict) else None
        if not isinstance(loaded, dict) or name not in loaded:
            raise ProtocolError(f"/load_lora_adapter of {name!r} answered without it in loaded_adapters: {body!r:.200}")

    def pause(self) -> Call:
        return Call("POST", "/pause_generation", {})

    def resume(self) -> Call:
        return Call("POST", "/continue_generation", {})

    def get_version(self) -> Call:
        return Call("GET", "/get_weight_version")

    def parse_version(self, body: object) -> int | None:
        return _int_or_none(body.get("weight_version")) if isinstance(body, dict) else None

    def parse_update(self, body: object) -> None:
        if isinstance(body, dict) and body.get("success") is False:
            raise RuntimeError(f"weight update refused: {body.get('message')}")

    health_path = "/health"


class RelayrlBackend(SGLangBackend):
    """relayrl's server: SGLang's protocol, per-token versions, and an HTTP weight upload."""

    name = "relayrl"
    supports_upload = True
    streams_items = True  # batched replies come item by item as they finish (NDJSON)

    def batch(self, calls: list[Call]) -> list[tuple[Call, list[int]]]:
        groups = super().batch(calls)
        for call, idx in groups:
            if len(idx) > 1 and call.json is not None:
                call.json["stream_items"] = True
        return groups

    def update_from_disk(self, path: str, version: int) -> Call:
        return Call("POST", "/update_weights_from_disk", {"model_path": path, "weight_version": version})

    def pause(self) -> Call:
        return Call(
            "POST", "/pause_generation", {"mode": "in_place"}
        )  # in-flight requests are interrupted by the update

    def upload(self, version: int) -> Call:
        return Call("POST", f"/update_weights_from_tensor?weight_version={version}")


class VLLMBackend:
    """vLLM's OpenAI-compatible server with its RL routes."""

    name = "vllm"
    supports_upload = False
    streams_items = False
    health_path = "/health"
    reload_method = "reload_weights"
    return_routed_experts = False  # vLLM's replies carry no routed experts; RemoteEngine refuses the option

    def __init__(self, model: str = "default") -> None:
        self.model = model

    def generate(
        self,
        rid: str,
        input_ids: list[int],
        g: GenerationConfig,
        max_new: int,
        min_new: int,
        images: list[str] | None = None,
        adapter: str = "",
        features: JsonDict | None = None,
    ) -> Call:
        """``adapter``: a loaded LoRA adapter to generate with (vLLM serves it as a model of that name).
        A prompt with images goes to the token-in route with their rendered ``features``
        (``render_images`` then ``image_features``): ``/v1/completions`` takes no images with token ids."""
        if images and features is None:
            raise ValueError(f"request {rid!r}: images go to vLLM as rendered features (render_images first)")
        sp: JsonDict = {  # vLLM's SamplingParams fields, also CompletionRequest's
            "max_tokens": max_new,
            "min_tokens": min_new,
            "temperature": 0.0 if g.greedy else g.temperature,
            "top_p": g.top_p,
            "top_k": -1 if g.top_k == 0 else g.top_k,
            "stop": list(g.stop),
            "stop_token_ids": list(g.stop_token_ids),
            "ignore_eos": g.ignore_eos,
            **_penalties(g),
            "logprobs": 0,  # the sampled token's logprob only
            "skip_special_tokens": False,
            "n": 1,
        }
        model = adapter or self.model
        if features is not None:  # the token-in route: choices carry token_ids and chat-style logprobs
            body: JsonDict = {"model": model, "request_id": rid, "token_ids": list(input_ids), "features": features}
            return Call("POST", GENERATE_TOKENS, {**body, "sampling_params": sp, "stream": False})
        body = {"model": model, "prompt": list(input_ids), **sp, "return_tokens_as_token_ids": True}
        return Call("POST", "/v1/completions", {**body, "request_id": rid, "stream": False})

    def render_images(self, images: list[str], adapter: str = "") -> Call:
        """vLLM's render step for a prompt's images (one user message of image content parts): its
        ``features`` carry each image's hash, placeholder range and processed tensors."""
        parts: list[object] = [{"type": "image_url", "image_url": {"url": u}} for u in images]
        messages: list[object] = [{"role": "user", "content": parts}]
        return Call("POST", RENDER_CHAT, {"model": adapter or self.model, "messages": messages})

    @staticmethod
    def image_features(rid: str, input_ids: list[int], body: object) -> JsonDict:
        """The rendered ``features`` placed on this prompt: image ``j``'s range is the ``j``-th run of its
        placeholder token in ``input_ids`` (the render's own prompt is vLLM's chat template, not ours),
        which must be as long as vLLM's (same processor); else a ``ValueError`` naming the image."""
        feats = body.get("features") if isinstance(body, dict) else None
        ids = body.get("token_ids") if isinstance(body, dict) else None
        if not isinstance(feats, dict) or not isinstance(ids, list):
            raise ProtocolError(f"{RENDER_CHAT} reply lacks token_ids / features: {str(body)[:200]}")
        try:
            ranges = [(int(p["offset"]), int(p["length"])) for p in feats["mm_placeholders"]["image"]]
            hashes, kwargs = list(feats["mm_hashes"]["image"]), list(feats["kwargs_data"]["image"])
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"{RENDER_CHAT} features lack image hashes / placeholders / kwargs_data: {e!r}") from e
        if not len(ranges) == len(hashes) == len(kwargs):
            raise ProtocolError(f"{RENDER_CHAT}: {len(ranges)} placeholders, {len(hashes)} hashes, {len(kwargs)} items")
        placed: list[object] = []
        pos = 0
        for j, (offset, length) in enumerate(ranges):
            token = int(ids[offset])
            start = next((i for i in range(pos, len(input_ids)) if input_ids[i] == token), len(input_ids))
            end = start
            while end < len(input_ids) and input_ids[end] == token:
                end += 1
            if end - start != length:
                got = f"{end - start} tokens" if end > start else "none"
                raise ValueError(
                    f"request {rid!r}: image {j} takes {length} placeholder tokens (id {token}) in vLLM's render, "
                    f"the prompt's next run has {got} (a different image processor or too few image blocks)"
                )
            placed.append({"offset": start, "length": length})
            pos = end
        return {"mm_hashes": {"image": hashes}, "mm_placeholders": {"image": placed}, "kwargs_data": {"image": kwargs}}

    def batch(self, calls: list[Call]) -> list[tuple[Call, list[int]]]:
        """Calls that differ only in their prompt share one call (vLLM takes one set of sampling
        parameters per request): (call, indices of the items it carries)."""
        groups: dict[str, list[int]] = {}
        for i, c in enumerate(calls):
            if c.path != "/v1/completions":  # the token-in route takes one prompt per call
                groups[f"{i}"] = [i]
                continue
            key = repr([(k, v) for k, v in (c.json or {}).items() if k not in ("prompt", "request_id")])
            groups.setdefault(key, []).append(i)
        out = []
        for idx in groups.values():
            if len(idx) == 1:
                out.append((calls[idx[0]], idx))
                continue
            first = calls[idx[0]].json or {}
            body: JsonDict = {
                **first,
                "prompt": [(calls[i].json or {})["prompt"] for i in idx],
                "request_id": f"{first.get('request_id')}+{len(idx) - 1}",
            }
            out.append((Call("POST", "/v1/completions", body), idx))
        return out

    def split(self, body: object, n: int) -> list[object]:
        """One reply per prompt: choice ``i`` (n=1 per prompt) is prompt ``i``'s."""
        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or len(choices) != n:
            got = len(choices) if isinstance(choices, list) else "no"
            raise ProtocolError(f"batched /v1/completions of {n} prompts answered {got} choices")
        order = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
        assert isinstance(body, dict)
        return [{**body, "choices": [c]} for c in order]

    def parse_generate(self, body: object) -> Parsed:
        if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or not body["choices"]:
            raise ProtocolError(f"/v1/completions reply lacks choices: {str(body)[:200]}")
        choice = body["choices"][0]
        lp = choice.get("logprobs") or {}
        token_logprobs = lp.get("token_logprobs") or []
        if "content" in lp:  # the token-in route: chat-style entries, one per output token
            token_logprobs = [c.get("logprob") for c in lp["content"] or []]
        tokens = choice.get("token_ids")
        if tokens is None:
            texts = lp.get("tokens") or []
            if not all(isinstance(t, str) and t.startswith("token_id:") for t in texts):
                raise ProtocolError("vLLM reply has no token_ids; start the server so that tokens read 'token_id:<id>'")
            tokens = [int(t.split(":", 1)[1]) for t in texts]
        if len(tokens) != len(token_logprobs):
            raise ProtocolError(f"{len(tokens)} tokens but {len(token_logprobs)} token_logprobs")
        finish = choice.get("finish_reason")
        kind = {"stop": "stop", "length": "length", "abort": "abort"}.get(str(finish))
        if kind is None:
            raise ProtocolError(f"unknown finish_reason {finish!r}")
        return Parsed([int(t) for t in tokens], [float(x) for x in token_logprobs], typing.cast(StopReason, kind))

    def update_from_disk(self, path: str, version: int) -> Call:
        return Call("POST", "/collective_rpc", {"method": self.reload_method, "kwargs": {"weights_path": path}})

    def load_adapter(self, name: str, path: str) -> Call:
        """Runtime adapter loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``); vLLM answers plain text."""
        return Call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_adapter(self, name: str) -> Call:
        return Call("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    def parse_adapter_load(self, name: str, body: object) -> None:
        """A 200 is the load (the body is a sentence); refusals are 4xx, raised by the caller."""

    def upload(self, version: int) -> Call:
        raise NotImplementedError("vLLM servers take no safetensors upload; use inference.weight_sync=disk")

    def init_transfer(self, host: str, port: int, rank_offset: int, world_size: int) -> Call:
        """Join vLLM's weight-transfer group (``--weight-transfer-backend nccl``): this server's
        workers take ranks ``rank_offset`` .. ``rank_offset + world size - 1``."""
        info: JsonDict = {
            "master_address": host,
            "master_port": port,
            "rank_offset": rank_offset,
            "world_size": world_size,
        }
        return Call("POST", "/init_weight_transfer_engine", {"init_info": info})

    def init_disk_transfer(self) -> Call:
        """vLLM's disk transfer backend (``--weight-transfer-backend disk``) takes no init fields."""
        return Call("POST", "/init_weight_transfer_engine", {"init_info": {}})

    def transfer_update(self, names: list[str], dtypes: list[str], shapes: list[list[int]], bucket: int) -> Call:
        """Every tensor in one call, sent in packed buffers of ``bucket`` bytes (bounded receive memory)."""
        info: JsonDict = {
            "names": names,
            "dtype_names": dtypes,
            "shapes": shapes,
            "packed": True,
            "packed_buffer_size_bytes": bucket,
        }
        return Call("POST", "/update_weights", {"update_info": info})

    def disk_update(self, path: str) -> Call:
        return Call("POST", "/update_weights", {"update_info": {"path": path}})

    def start_update(self) -> Call:
        return Call("POST", "/start_weight_update")

    def finish_update(self, version: int) -> Call:
        return Call("POST", "/finish_weight_update", {"weight_version": str(version)})

    def set_version(self, version: int) -> Call:
        return Call("POST", "/update_weight_version", {"new_version": str(version)})

    def pause(self) -> Call:
        return Call("POST", "/pause?mode=abort")

    def logprob_probe(self, temperature: float) -> Call:
        """One greedy-free token with the top logprob: with ``raw_logprobs`` (vLLM's default) its value
        does not change with the temperature; with ``processed_logprobs`` it does."""
        body: JsonDict = {
            "model": self.model,
            "prompt": [0, 1, 2],
            "max_tokens": 1,
            "temperature": temperature,
            "logprobs": 1,
            "seed": 0,
            "return_tokens_as_token_ids": True,
        }
        return Call("POST", "/v1/completions", body)

    @staticmethod
    def top_logprob(body: object) -> float:
        try:
            top = typing.cast(dict[str, Any], body)["choices"][0]["logprobs"]["top_logprobs"][0]
            return max(float(v) for v in top.values())
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise ProtocolError(f"/v1/completions reply has no top_logprobs: {str(body)[:200]}") from e

    def resume(self) -> Call:
        return Call("POST", "/resume")

    def get_version(self) -> Call | None:
        return Call("GET", "/weight_info")  # vLLM's RL router since 0100a212; before it, none (the client's count)

    def parse_version(self, body: object) -> int | None:
        return _int_or_none(body.get("weight_version")) if isinstance(body, dict) else None

    def parse_update(self, body: object) -> None:
        if isinstance(body, dict) and "error" in body:
            raise RuntimeError(f"weight update refused: {body['error']}")


Backend = SGLangBackend | VLLMBackend


def make_backend(protocol: str) -> Backend:
    if protocol == "relayrl":
        return RelayrlBackend()
    if protocol == "sglang":
        return SGLangBackend()
    if protocol == "vllm":
        return VLLMBackend()
    raise ValueError(f"inference.protocol must be relayrl, sglang or vllm, got {protocol!r}")
