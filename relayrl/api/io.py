"""Data that crosses the boundary between generation, rollout and training.

Plain dataclasses: a request for tokens, the tokens that came back (with the logprob and
the weight version of every generated token), and a weight update sent to generators.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import torch

from relayrl.api.fields import f

StopReason = Literal["stop", "length", "abort"]


@dataclass
class GenerationConfig:
    """How to sample one completion for a prompt (n samples are n requests; see ``InferenceEngine.agenerate``).

    Every sampling knob is explicit: engines never fall back on library defaults such as
    transformers' ``top_k=50``. ``top_k=0`` and ``top_p=1.0`` mean "off", so logprobs are
    then exact under ``softmax(logits / temperature)``.
    """

    max_new_tokens: int = f(128, "Upper bound on generated tokens.", ge=1)
    min_new_tokens: int = f(0, "EOS and stop tokens are masked until this many tokens exist.", ge=0)
    greedy: bool = f(False, "Argmax decoding; logprobs are then those of softmax(logits).")
    temperature: float = f(1.0, "Softmax temperature for sampling.", gt=0.0)
    top_p: float = f(1.0, "Nucleus sampling mass; 1.0 disables it.", gt=0.0, le=1.0)
    top_k: int = f(0, "Keep the k most likely tokens; 0 disables it.", ge=0)
    stop_token_ids: list[int] = f([], "Token ids that end a completion (besides EOS).")
    stop: list[str] = f([], "Strings that end a completion when decoded.")
    ignore_eos: bool = f(False, "Keep generating past EOS until max_new_tokens.")
    frequency_penalty: float = f(
        0.0,
        "OpenAI's: each token's logit is lowered by this times its count in the output so far "
        "(before temperature; logprobs are those of the penalised distribution).",
        ge=-2.0,
        le=2.0,
    )
    presence_penalty: float = f(
        0.0, "OpenAI's: a token's logit is lowered by this once it occurs in the output.", ge=-2.0, le=2.0
    )

    def new(self, **changes: object) -> GenerationConfig:
        """A copy with some fields changed, e.g. ``gconfig.new(greedy=True)``.

        List fields are copied, so changing the copy's ``stop`` never changes the original.
        """
        lists = {"stop_token_ids": list(self.stop_token_ids), "stop": list(self.stop)}
        return dataclasses.replace(self, **{**lists, **changes})  # type: ignore[arg-type]

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}"
            )
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")


@dataclass
class ModelRequest:
    """One generation request. ``rid`` identifies the episode; engines may use it for
    session affinity (all turns of a multi-turn episode go to the same server).

    ``image_data`` (SGLang's name) holds the prompt's images for vision-language models, in the
    order of their blocks in ``input_ids``: encoded image bytes, a file path, a ``data:`` URL or
    base64 text. ``input_ids`` then already hold each image's pad tokens expanded by the model's
    processor (``relayrl.data.vision.encode_prompt``)."""

    rid: str
    input_ids: list[int]
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    metadata: dict[str, str | int | float | bool] = field(default_factory=dict)
    image_data: list[str | bytes] = field(default_factory=list)


@dataclass
class ModelResponse:
    """The result of one request: one sample.

    ``output_logprobs[i]`` is log pi(token_i) under the distribution actually sampled from;
    ``output_versions[i]`` is the weight version that produced token i. A response that was
    interrupted by a weight update and continued carries several versions.

    ``routed_experts`` (MoE models; None otherwise): int32 ``[input_len + output_len - 1,
    n_moe_layers, top_k]``, the expert ids each MoE layer chose for every token the generator
    ran (prompt and output; the last output token was never run), SGLang's layout.
    """

    input_tokens: list[int]
    output_tokens: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: StopReason
    latency: float = 0.0
    ttft: float = 0.0
    routed_experts: torch.Tensor | None = None

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)


@dataclass
class StreamChunk:
    """Part of a streamed completion (``InferenceEngine.astream``): the tokens generated since the
    previous chunk; the last chunk also carries the whole ``final`` response."""

    tokens: list[int]
    final: ModelResponse | None = None


WeightKind = Literal["tensors", "disk", "adapter"]


@dataclass
class WeightUpdate:
    """New policy weights for generators.

    - ``tensors``: an in-memory state dict (in-process engines copy it; remote engines send it
      as ``inference.weight_sync`` says: HTTP upload, a versioned dir on shared disk, or a
      collective broadcast to the servers, NCCL on GPUs);
    - ``disk``: a Hugging Face checkpoint directory at ``path`` (shared filesystem);
    - ``adapter``: a LoRA adapter as peft saves it (``tensors`` named as in
      ``adapter_model.safetensors``, ``adapter_config`` the text of ``adapter_config.json``), for
      engines that declare ``accepts_adapters`` (SGLang / vLLM servers with LoRA on): they load it
      next to the base weights they keep, instead of receiving merged full weights.

    ``version`` is the version the generators report once the update is applied.
    """

    kind: WeightKind
    version: int
    path: str = ""
    tensors: dict[str, torch.Tensor] | None = None
    adapter_config: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("tensors", "disk", "adapter"):
            raise ValueError(f"WeightUpdate.kind must be 'tensors', 'disk' or 'adapter', got {self.kind!r}")
        if self.kind in ("tensors", "adapter") and self.tensors is None:
            raise ValueError(f"WeightUpdate(kind={self.kind!r}) needs `tensors` (a state dict)")
        if self.kind == "adapter" and not self.adapter_config:
            raise ValueError("WeightUpdate(kind='adapter') needs `adapter_config` (the adapter_config.json text)")
        if self.kind == "disk" and not self.path:
            raise ValueError(f"WeightUpdate(kind={self.kind!r}) needs `path`")


@dataclass
class SaveLoadMeta:
    """Where and what a TrainEngine saves or loads.

    ``weights`` are always written in Hugging Face format (safetensors + config.json);
    ``with_optim`` adds the full training state (optimizer, scheduler, step, version, RNG)
    needed for an exact resume.
    """

    path: str
    with_optim: bool = False
