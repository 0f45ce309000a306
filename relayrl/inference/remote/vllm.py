"""vLLM (an OpenAI server with its RL routes): everything RemoteEngine knows of it.

- Detection: ``/version``; the served model name from ``/v1/models`` (vLLM answers 404 for any
  other name); the routes from ``/openapi.json``: the RL router (``/pause``, ``/resume``, the
  weight-transfer routes ``/init_weight_transfer_engine`` and ``/update_weights``; later also
  ``/start_weight_update``, ``/finish_weight_update`` and ``/weight_info``, which reports the
  weight version) is attached only with ``VLLM_SERVER_DEV_MODE=1``, as is ``/collective_rpc``
  (the reload fallback for a vLLM without the transfer API); ``/get_world_size`` gives the
  ranks a server's workers take in a transfer group.
- Requests: ``/v1/completions`` with a token-id ``prompt`` and ``logprobs=0``;
  ``return_tokens_as_token_ids`` makes every returned token read ``"token_id:<id>"``. Sampled-token
  logprobs follow the temperature only with ``--logprobs-mode processed_logprobs`` (checked at
  connect). Batches: ``batch``. Images: ``/v1/completions`` takes none with a token-id prompt, so a
  prompt with images is rendered first (``render``), then sent to ``/inference/v1/generate`` with
  the rendered ``features`` placed on our prompt (``image_features``).
- Weights: every update pauses the servers with ``/pause?mode=abort`` (in-flight requests end as
  ``abort`` with the tokens generated so far, which keep the old version, and are continued
  afterwards), opens a session where the server has one (``/start_weight_update``), sends
  ``/update_weights``, closes it with the version (``/finish_weight_update``, reported back by
  ``/weight_info``) and resumes. broadcast: the group of ``vllm_transfer.VLLMTransferGroup``,
  rebuilt when its members change (vLLM replaces a server's group on a new init). disk:
  ``{"path"}`` to the disk backend; on a vLLM without it (checked at connect), the dev-mode
  ``/collective_rpc reload_weights`` fallback. LoRA adapters: ``/v1/load_lora_adapter`` and
  ``/v1/unload_lora_adapter`` ``{"lora_name", "lora_path"}`` (plain-text answers), the adapter named
  as the request's ``model``.
- Launch (``inference.launch=vllm``): ``vllm serve`` with ``server_command``'s flags and
  ``server_env``'s ``VLLM_SERVER_DEV_MODE=1`` (the RL router and ``/collective_rpc``: released vLLMs
  up to 0.33 have no disk backend, so weight_sync=disk reloads through it).
"""

from __future__ import annotations

import functools
import logging
import shlex
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relayrl.api.io import GenerationConfig, StopReason
from relayrl.inference.remote.launch import Launched, PeerServerGroup, gpu_env
from relayrl.inference.remote.protocol import (
    Call,
    Getter,
    JsonDict,
    Parsed,
    PeerInfo,
    ProtocolError,
    Render,
    Server,
    UnsupportedServer,
    sampling_fields,
    version_of,
)
from relayrl.inference.remote.vllm_transfer import VLLMBroadcast, VLLMDisk
from relayrl.inference.remote.weights import Fleet, WeightSync
from relayrl.utils.webguard import is_loopback

if TYPE_CHECKING:
    from relayrl.api.config import InferenceConfig, LoraConfig, ModelConfig

log = logging.getLogger(__name__)

RENDER_CHAT = "/v1/chat/completions/render"  # messages -> token ids + multimodal features
GENERATE_TOKENS = "/inference/v1/generate"  # token ids (+ features) -> token ids + logprobs
IMAGE_ROUTES = (RENDER_CHAT, GENERATE_TOKENS)
LORA_ROUTE = "/v1/load_lora_adapter"
LORA_FLAGS = "--enable-lora --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig accepts only these max ranks


class VLLMBackend:
    """vLLM's OpenAI-compatible server with its RL routes."""

    name = "vllm"
    speaks: tuple[str, ...] = ("vllm",)  # the inference.protocol values its launched servers answer
    loads_adapters = True
    supports_upload = False
    streams_items = False
    answers_while_loading = False  # /health may block during a weight load: not probed then
    return_routed_experts = False

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
            **sampling_fields(g),
            "logprobs": 0,  # the sampled token's logprob only
            "n": 1,
        }
        model = adapter or self.model
        if features is not None:  # the token-in route: choices carry token_ids and chat-style logprobs
            body: JsonDict = {"model": model, "request_id": rid, "token_ids": list(input_ids), "features": features}
            return Call("POST", GENERATE_TOKENS, {**body, "sampling_params": sp, "stream": False})
        body = {"model": model, "prompt": list(input_ids), **sp, "return_tokens_as_token_ids": True}
        return Call("POST", "/v1/completions", {**body, "request_id": rid, "stream": False})

    def ask_routed_experts(self, model: ModelConfig) -> None:
        raise ValueError(
            "inference.return_routed_experts: vLLM's replies carry no routed experts (use sglang or relayrl)"
        )

    def render(self, srv: Server, rid: str, input_ids: list[int], images: list[str]) -> Render:
        """A prompt with images: vLLM renders them once (``render_images``), then every call for it goes to the
        token-in route with those ``features`` placed on ``input_ids`` (``image_features``)."""
        require_image_routes(srv.info, srv.url)
        return Render(self.render_images(images, srv.adapter), functools.partial(self.image_features, rid, input_ids))

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
            hashes = list(feats["mm_hashes"]["image"])
            # null: a cache hit (vLLM 0.32 resolves the items by hash), passed on as it came
            kwargs = None if feats.get("kwargs_data") is None else list(feats["kwargs_data"]["image"])
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"{RENDER_CHAT} features lack image hashes / placeholders / kwargs_data: {e!r}") from e
        if len(ranges) != len(hashes) or (kwargs is not None and len(kwargs) != len(hashes)):
            items = "no" if kwargs is None else len(kwargs)
            raise ProtocolError(f"{RENDER_CHAT}: {len(ranges)} placeholders, {len(hashes)} hashes, {items} items")
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
        data = None if kwargs is None else {"image": kwargs}
        return {"mm_hashes": {"image": hashes}, "mm_placeholders": {"image": placed}, "kwargs_data": data}

    def batch(self, calls: list[Call]) -> list[tuple[Call, list[int]]]:
        """Calls that differ only in their prompt share one call (vLLM takes one set of sampling
        parameters per request): (call, indices of the items it carries)."""
        groups: dict[str, list[int]] = {}
        for i, c in enumerate(calls):
            key = repr([(k, v) for k, v in (c.json or {}).items() if k not in ("prompt", "request_id")])
            # (the token-in route takes one prompt per call: a group of its own)
            groups.setdefault(key if c.path == "/v1/completions" else f"{i}", []).append(i)
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
        if finish not in ("stop", "length", "abort"):
            raise ProtocolError(f"unknown finish_reason {finish!r}")
        return Parsed([int(t) for t in tokens], [float(x) for x in token_logprobs], typing.cast(StopReason, finish))

    def update_from_disk(self, path: str, version: int) -> Call:
        return Call("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})

    def load_adapter(self, name: str, path: str) -> Call:
        """Runtime adapter loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``); vLLM answers plain text."""
        return Call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_adapter(self, name: str) -> Call:
        return Call("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    def parse_adapter_load(self, name: str, body: object) -> None:
        """A 200 is the load (the body is a sentence); refusals are 4xx, raised by the caller."""

    # ------------------------------------------------------------------ detection, weights, launch
    def detect(self, url: str, get: Getter) -> PeerInfo:
        """What the server at ``url`` offers (``get``: GET path -> (status, JSON))."""
        return detect(url, get)

    def connected(self, fleet: Fleet) -> None:
        """Once every server is detected: requests name the one served model; logprobs must follow
        the temperature (vLLM's default reports the raw model's)."""
        names = {s.info.model for s in fleet.servers if s.info is not None}
        if len(names) != 1:
            raise UnsupportedServer(f"the vLLM servers serve different models: {sorted(names)}")
        self.model = names.pop()
        srv = fleet.servers[0]
        if srv.info is None or srv.info.server == "relayrl":  # relayrl's follow the temperature
            return
        tops = [self.top_logprob(fleet, srv, t) for t in (1.0, 0.5)]
        if abs(tops[0] - tops[1]) < 1e-6 and tops[0] < -1e-4:
            raise UnsupportedServer(
                f"{srv.url} returns logprobs that ignore the sampling temperature (vLLM's default raw_logprobs): "
                "start vLLM with --logprobs-mode processed_logprobs (relayrl's importance weights need the "
                "logprobs of the distribution actually sampled)"
            )

    def weight_sync(self, fleet: Fleet, mode: str) -> WeightSync:
        """The sync of weight_sync=``mode``: vLLM's weight-transfer API (disk or broadcast; no http:
        ``supports_upload`` is False)."""
        return VLLMBroadcast(fleet, self) if mode == "broadcast" else VLLMDisk(fleet, self)

    def launch(self, cfg: InferenceConfig, model: ModelConfig, lora: LoraConfig | None, token: str) -> Launched:
        """``inference.launch=vllm``: ``cfg.n_servers`` servers of ``model``, healthy."""
        return PeerServerGroup(self, cfg, model.path, lora=lora, dtype=model.dtype, token=token).start()

    def api_key(self, token: str, folder: Path) -> tuple[list[str], dict[str, str]]:
        """vLLM reads its key from VLLM_API_KEY. It guards only /v1, /v2, /inference and /cohere: the
        dev-mode routes relayrl needs (/pause, /collective_rpc, weight updates) stay open, hence
        loopback only (``server_command``)."""
        return [], {"VLLM_API_KEY": token}

    def server_command(
        self, cfg: InferenceConfig, model: str, port: int, host: str = "127.0.0.1", lora: LoraConfig | None = None
    ) -> list[str]:
        """One launched server's command line (listening on ``host``; ``lora``: the adapters it will load)."""
        if not is_loopback(host):
            raise ValueError(
                f"inference.launch=vllm on {host}: relayrl needs vLLM's dev-mode routes (VLLM_SERVER_DEV_MODE=1: "
                "/pause, /collective_rpc, weight updates), which vLLM's --api-key does not guard, so relayrl "
                "launches vLLM on loopback only. Under Ray use inference.launch=sglang or relayrl, or start vLLM "
                "yourself where only the trainer can reach it and give inference.addresses (docs/security.md)"
            )
        prefix = shlex.split(cfg.launch_command) if cfg.launch_command else ["vllm", "serve"]
        flags = ["--host", host, "--port", str(port), "--tensor-parallel-size", str(cfg.launch_tp_size)]
        flags += ["--logprobs-mode", "processed_logprobs"]
        if cfg.weight_sync == "broadcast":  # vLLM's NCCL weight-transfer engine (0.32: its WeightTransferConfig)
            flags += ["--weight-transfer-config", '{"backend": "nccl"}']
        return [*prefix, model, *flags, *lora_flags(lora), *cfg.launch_args]

    def server_env(self, cfg: InferenceConfig, i: int, lora: LoraConfig | None = None) -> dict[str, str]:
        env = gpu_env(cfg, i)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if lora_flags(lora):
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return env

    def pause(self) -> Call:
        return Call("POST", "/pause?mode=abort")

    def abort_items(self, call: Call, position: int) -> list[Call]:
        """Stop prompt ``position`` of a ``/v1/completions`` call on the server: vLLM names it
        ``cmpl-<request_id>-<position>`` (``/abort_requests``, the RL router's). The token-in route's
        calls carry one prompt each and are never batched: a caller that leaves closes the connection."""
        rid = (call.json or {}).get("request_id")
        if call.path != "/v1/completions" or not isinstance(rid, str):
            return []
        return [Call("POST", "/abort_requests", {"request_ids": [f"cmpl-{rid}-{position}"]})]

    def top_logprob(self, fleet: Fleet, srv: Server, temperature: float) -> float:
        """The top logprob of one token drawn at ``temperature`` by ``srv``: with ``raw_logprobs`` (vLLM's
        default) it does not change with the temperature; with ``processed_logprobs`` it does."""
        body: JsonDict = {
            "model": self.model,
            "prompt": [0, 1, 2],
            "max_tokens": 1,
            "temperature": temperature,
            "logprobs": 1,
            "seed": 0,
            "return_tokens_as_token_ids": True,
        }
        reply = fleet.admin(srv, Call("POST", "/v1/completions", body))
        try:
            top = typing.cast(dict[str, Any], reply)["choices"][0]["logprobs"]["top_logprobs"][0]
            return max(float(v) for v in top.values())
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise ProtocolError(f"/v1/completions reply has no top_logprobs: {str(reply)[:200]}") from e

    def resume(self) -> Call:
        return Call("POST", "/resume")

    def parse_version(self, body: object) -> int | None:
        return version_of(body)

    def parse_update(self, body: object) -> None:
        if isinstance(body, dict) and "error" in body:
            raise RuntimeError(f"weight update refused: {body['error']}")


def detect(url: str, get: Getter) -> PeerInfo:
    """A vLLM server's version, served model, routes and transfer ranks."""
    status, body = get("/version")
    if status != 200 or not isinstance(body, dict):
        raise UnsupportedServer(f"{url} answers no /version ({status}): not a vLLM OpenAI server (`vllm serve`)")
    status, models = get("/v1/models")
    data = models.get("data") if isinstance(models, dict) else None
    if status != 200 or not isinstance(data, list) or not data or not isinstance(data[0], dict):
        raise UnsupportedServer(f"{url}/v1/models lists no served model ({status}); relayrl sends the served name")
    status, spec = get("/openapi.json")
    paths = spec.get("paths") if isinstance(spec, dict) else None
    routes = set(paths) if isinstance(paths, dict) else set()
    ranks = 1
    if "/get_world_size" in routes:  # the server's workers (TP x PP x DP), each a rank of the transfer group
        status, size = get("/get_world_size")
        ranks = int(size.get("world_size", 1)) if status == 200 and isinstance(size, dict) else 1
    lora, max_rank = runtime_lora(get, routes)
    return PeerInfo(
        "vllm",
        str(body.get("version", "")),
        ranks,
        str(data[0]["id"]),
        "/weight_info" if "/weight_info" in routes else None,
        "/health",
        routes,
        server=str(body.get("server", "vllm")),  # by name: disk_transfer comes first
        lora=lora,
        max_lora_rank=max_rank,
        lora_flags=LORA_FLAGS,
    )


def runtime_lora(get: Getter, routes: set[str]) -> tuple[bool | None, int]:
    """(loads adapters at run time, its --max-lora-rank): the adapter routes exist with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True even without --enable-lora, so the engine's config is asked
    too (dev mode's ``/server_info``: ``lora_config`` is null without --enable-lora)."""
    if not routes:
        return None, 0
    if LORA_ROUTE not in routes:
        return False, 0
    if "/server_info" not in routes:
        return True, 0
    status, info = get("/server_info?config_format=json")
    config = info.get("vllm_config") if status == 200 and isinstance(info, dict) else None
    if not isinstance(config, dict) or "lora_config" not in config:
        return True, 0
    lora = config["lora_config"]
    return isinstance(lora, dict), int(lora.get("max_lora_rank") or 0) if isinstance(lora, dict) else 0


def require_image_routes(info: PeerInfo | None, url: str) -> None:
    """A request with images to a vLLM server needs its render and token-in generate routes."""
    if info is None or info.protocol != "vllm" or not info.routes:
        return
    missing = [r for r in IMAGE_ROUTES if r not in info.routes]
    if missing:
        raise UnsupportedServer(
            f"{url} (vLLM {info.version}) lacks {', '.join(missing)}, which requests with images need "
            "(vLLM's render + token-in generate; /v1/completions takes no images with token ids)"
        )


def lora_flags(lora: LoraConfig | None) -> list[str]:
    """The flags that let a server load the trainer's adapters at run time (none without LoRA)."""
    if lora is None or lora.rank <= 0:
        return []
    rank = next((r for r in VLLM_LORA_RANKS if r >= lora.rank), lora.rank)
    return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]
