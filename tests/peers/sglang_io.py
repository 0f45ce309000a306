"""The request bodies of the SGLang stand-in (``sglang_server.py``), as SGLang v0.5.x declares them in
``python/sglang/srt/managers/io_struct.py``: the fields RemoteEngine sends, with SGLang's defaults; the
keys ``SamplingParams`` accepts (anything else in ``sampling_params`` is refused, as SGLang does)."""

from __future__ import annotations

from dataclasses import dataclass, field

SAMPLING_KEYS = {
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "n",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "json_schema",
    "regex",
    "ebnf",
    "custom_params",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
}


@dataclass
class GenerateReqInput:  # the fields RemoteEngine uses (others are accepted and ignored, as FastAPI does for SGLang's dataclass)
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None  # type: ignore[type-arg]
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    stream: bool = False
    # SGLang: one image (URL, path, base64 or data: URL) or a list per request; in a batch, one entry per item
    image_data: str | list[str] | list[list[str]] | None = None
    lora_path: str | list[str | None] | None = None
    return_routed_experts: bool = False


@dataclass
class LoadLoRAAdapterReqInput:
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


@dataclass
class UnloadLoRAAdapterReqInput:
    lora_name: str
    lora_id: str | None = None


@dataclass
class UpdateWeightFromDiskReqInput:
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True


@dataclass
class InitWeightsUpdateGroupReqInput:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@dataclass
class UpdateWeightsFromDistributedReqInput:
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


@dataclass
class DestroyWeightsUpdateGroupReqInput:
    group_name: str = "weight_update_group"


@dataclass
class PauseGenerationReqInput:
    mode: str = "abort"
