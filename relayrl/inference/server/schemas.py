"""Request bodies of ``relayrl serve`` (pydantic models: validation and the OpenAPI schema).

SGLang's ``/generate`` (single and batch form), OpenAI's completions and chat, the admin
bodies. Unknown fields are refused. Unions whose members differ by shape (one prompt or a
list of prompts; one sampling dict or one per item) are tagged unions: a body is validated
only against the form it was sent in, so an error is reported once, at its own path (tags read
``<...>`` and are dropped from the paths shown to users).
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictInt, Tag, model_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


TokenId = StrictInt  # JSON true/false or "5" are not token ids (lax ints would read them as 1/0/5)


class SamplingParams(_Body):
    max_new_tokens: int = Field(
        128, ge=0, description="0: score the prompt only (single /generate; see logprob_start_len)"
    )
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 or 0 = off")
    stop: str | list[str] = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = Field(False, description="keep the matched stop string in the text (SGLang's name)")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    n: int = Field(1, ge=1, le=1, description="one sample per request")


def _one_or_many_tag(v: object) -> str:
    return "<many>" if isinstance(v, list) else "<one>"


_T = TypeVar("_T")
# ``T`` or a list of ``T`` (SGLang batch fields: one value for all items, or one per item)
OneOrMany = Annotated[Annotated[_T, Tag("<one>")] | Annotated[list[_T], Tag("<many>")], Discriminator(_one_or_many_tag)]


MAX_TOP_LOGPROBS = 100  # top_logprobs_num: a distillation teacher's top-k (the full vocabulary is a local teacher's)
ImageData = str  # SGLang's image item: base64 text, a data: URL or a file path on the server


class GenerateRequest(_Body):
    input_ids: list[TokenId] | None = None
    text: str | None = None
    image_data: ImageData | list[ImageData] | None = Field(
        None, description="SGLang: the prompt's images in order (input_ids hold their expanded pad tokens)"
    )
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = Field(
        -1,
        ge=-1,
        description="SGLang: with return_logprob, meta_info.input_token_logprobs of the prompt from this position "
        "(-1: none); the first token's is null. With max_new_tokens 0 nothing is generated: a distillation "
        "teacher's prompt scoring (actor.teacher.url)",
    )
    top_logprobs_num: int = Field(
        0,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="SGLang: with logprob_start_len, meta_info.input_top_logprobs: the k most likely "
        "[logprob, id, null] of the distribution each prompt token was drawn from (temperature 1)",
    )
    return_routed_experts: bool = Field(
        False,
        description="MoE models: meta_info.routed_experts, base64 of int32 [prompt + output - 1, n_moe_layers, "
        "top_k] expert ids (SGLang's format; relayrl adds meta_info.routed_experts_shape)",
    )
    rid: str | None = None
    stream: bool = Field(False, description="streaming is not supported")


MAX_BATCH_ITEMS = 4096  # prompts in one /generate batch (the engine queues them all at once)


class GenerateBatchRequest(_Body):
    """SGLang's batch form of /generate: one reply per prompt, in order."""

    input_ids: list[list[TokenId]] | None = Field(None, min_length=1, max_length=MAX_BATCH_ITEMS)
    text: list[str] | None = Field(None, min_length=1, max_length=MAX_BATCH_ITEMS)
    image_data: list[ImageData | list[ImageData] | None] | None = Field(None, description="one entry per item")
    sampling_params: OneOrMany[SamplingParams] = Field(default_factory=SamplingParams)
    return_logprob: OneOrMany[bool] = False
    return_routed_experts: OneOrMany[bool] = False
    rid: OneOrMany[str] | None = Field(None, description="one per item, or a prefix (item i gets '<rid>-<i>')")
    stream: bool = Field(False, description="streaming is not supported")
    stream_items: bool = Field(
        False,
        description="relayrl: answer NDJSON, one line {'index': i, ...item's reply} (or "
        "{'index': i, 'error': ...}) per item as soon as it finishes, instead of one list",
    )


def _body_form(v: object) -> str:
    """'<batch>' when the prompts are a list of prompts (SGLang's batch form), else '<single>'."""
    if isinstance(v, dict):
        ids, text = v.get("input_ids"), v.get("text")
        if isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)):
            return "<batch>"
    return "<single>"


GenerateBody = Annotated[
    Annotated[GenerateRequest, Tag("<single>")] | Annotated[GenerateBatchRequest, Tag("<batch>")],
    Discriminator(_body_form),
]


class _WeightLoad(_Body):
    """The fields SGLang's weight loads share (all but the version accepted with nothing to do here)."""

    weight_version: int | str | None = None
    load_format: str | None = None
    abort_all_requests: bool = False  # in-flight requests are continued under the new weights anyway
    flush_cache: bool = True


class DiskUpdate(_WeightLoad):
    """SGLang's ``UpdateWeightFromDiskReqInput``; the CUDA-side switches are accepted and have nothing to do here."""

    model_path: str
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0


class InitWeightGroup(_Body):
    """SGLang's ``/init_weights_update_group``: join the trainer's weight group as ``rank_offset``."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, lt=1 << 16)
    world_size: int = Field(ge=2, le=1 << 16)
    group_name: str = "weight_update_group"
    backend: Literal["nccl", "gloo"] = "nccl"

    @model_validator(mode="after")
    def _rank_in_group(self) -> InitWeightGroup:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset={self.rank_offset} must be below world_size={self.world_size}")
        return self


class DistributedUpdate(_WeightLoad):
    """SGLang's ``/update_weights_from_distributed``: receive these tensors, in this order, by broadcast."""

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[Annotated[StrictInt, Field(ge=0)]]]
    group_name: str = "weight_update_group"


class DestroyWeightGroup(_Body):
    group_name: str = "weight_update_group"


class PauseRequest(_Body):
    """SGLang's ``PauseGenerationReqInput``: ``abort`` (default) ends in-flight requests; the others keep them."""

    mode: Literal["abort", "in_place", "retract"] = "abort"


class AbortRequest(_Body):
    """SGLang's ``/abort_request`` body."""

    rid: str = ""
    abort_all: bool = False


def _prompt_form(v: object) -> str:
    if isinstance(v, str):
        return "<text>"
    if isinstance(v, list) and v and isinstance(v[0], list):
        return "<id lists>"
    if isinstance(v, list) and v and isinstance(v[0], str):
        return "<texts>"
    return "<ids>"


Prompt = Annotated[
    Annotated[str, Tag("<text>")]
    | Annotated[list[TokenId], Tag("<ids>")]
    | Annotated[list[list[TokenId]], Tag("<id lists>")]
    | Annotated[list[str], Tag("<texts>")],
    Discriminator(_prompt_form),
]


class CompletionRequest(_Body):
    model: str | None = None
    prompt: Prompt = Field(description="text, token ids, or a list of either (one choice per prompt and sample)")
    max_tokens: int | None = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    logprobs: int | None = Field(None, ge=0, le=5, description="the sampled tokens' logprobs and the k best")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream_options: dict[str, bool] | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    seed: int | None = None  # accepted for SDK compatibility; the engine's seed is used
    user: str | None = None
    stream: bool = Field(False, description="server-sent events, token by token (one prompt)")
    echo: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    request_id: str | None = None
