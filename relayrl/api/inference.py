"""The ``inference:`` section of a run config: the generators (the in-process ``LocalEngine``, or
HTTP servers through ``RemoteEngine``: which peer, how they are launched, how weights reach them) and
every deadline a run waits on them with (docs/reliability.md lists what happens when each expires).

Importable from ``relayrl.api.config`` with the other sections (``RunConfig.inference``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from relayrl.api.fields import f


@dataclass
class InferenceConfig:
    backend: str = f(
        "local", help="'local': in-process LocalEngine; 'remote': HTTP servers.", choices=["local", "remote"]
    )
    max_batch_size: int = f(
        0,
        help="LocalEngine: most sequences decoded together; 0 (default) = as many as the KV cache budget holds, so a "
        "training step's whole batch decodes in one wave.",
        ge=0,
    )
    max_tokens_in_flight: int = f(
        65536, help="LocalEngine on CPU: KV cache budget in tokens (rows x columns of the running batch).", ge=16
    )
    seed: int = f(0, help="Sampling seed of the engine.")
    fast_decode: bool = f(
        True, help="LocalEngine: lean decode step for Llama/Qwen2-style models (else the generic HF forward)."
    )
    device: str = f(
        "auto", help="LocalEngine / `relayrl serve`: 'auto' (cuda when available, else cpu), 'cpu', 'cuda' or 'cuda:N'."
    )
    cuda_graphs: bool = f(
        True,
        help="LocalEngine on CUDA: capture the lean decode step as CUDA graphs at bucketed batch sizes (ignored on "
        "CPU and for models without the lean step).",
    )
    kv_cache_fraction: float = f(
        0.5,
        help="LocalEngine on CUDA: KV cache budget as a fraction of the free GPU memory after the "
        "weights are loaded (on CPU max_tokens_in_flight is the budget).",
        gt=0.0,
        le=1.0,
    )
    admit_window_ms: float = f(
        5.0,
        help="LocalEngine: an idle engine waits up to this long while requests keep arriving, so a burst is "
        "prefilled in one forward (0 = admit at once).",
        ge=0.0,
        le=1000.0,
    )
    shared_prefix_min: int = f(
        16,
        help="LocalEngine, models with the lean decode step (Llama, Qwen2, Qwen3): requests prefilled together whose "
        "prompts all start with the same tokens (a system prompt, a chat template's header) compute that prefix "
        "once when it is at least this long (0 = never).",
        ge=0,
    )
    protocol: str = f("relayrl", help="Remote server protocol.", choices=["relayrl", "sglang", "vllm"])
    return_routed_experts: bool = f(
        False,
        help="RemoteEngine (relayrl / sglang protocol), MoE models: ask each /generate for the routed experts so "
        "trajectories carry them for actor.replay_routing (SGLang needs --enable-return-routed-experts; a relayrl "
        "server refuses it for a dense model). LocalEngine records them for MoE models always.",
    )
    addresses: list[str] = f([], help="Remote servers as host:port; empty with n_servers > 0 launches local servers.")
    n_servers: int = f(0, help="Servers to launch for backend=remote when no addresses are given (see launch).", ge=0)
    launch: str = f(
        "relayrl",
        help="Who starts the n_servers servers: relayrl (`relayrl serve`), sglang "
        "(`python -m sglang.launch_server`), vllm (`vllm serve`), none (never: addresses are required).",
        choices=["none", "relayrl", "sglang", "vllm"],
    )
    launch_command: str = f(
        "",
        help="launch=sglang|vllm: the command run instead of `python -m sglang.launch_server` / "
        "`vllm serve` (a wrapper script, a container entry point).",
    )
    launch_args: list[str] = f(
        [], help="launch=sglang|vllm: extra server flags, e.g. ['--mem-fraction-static', '0.7']."
    )
    launch_gpus: list[int] = f(
        [],
        help="launch=sglang|vllm: GPUs handed out in order, launch_tp_size per server "
        "(CUDA_VISIBLE_DEVICES); empty = the servers' own default.",
    )
    launch_tp_size: int = f(1, help="launch=sglang|vllm: tensor-parallel size of each launched server.", ge=1)
    launch_log_dir: str = f(
        "", help="launch=sglang|vllm: where server-<i>.log files go (empty: a temporary directory)."
    )
    launch_timeout: float = f(
        900.0,
        help="Seconds servers may take at start-up to load and answer /health (launched by any peer, or given in "
        "addresses); past it the run stops naming the servers that did not answer.",
        gt=0.0,
    )
    server_threads: int = f(1, help="torch threads of each launched server.", ge=1)
    request_timeout: float = f(
        300.0,
        help="Seconds before one HTTP call to a server is abandoned: an admin call (a weight load, pause) evicts "
        "the server; a generation request is retried on another server, its deadline being request_timeout + "
        "token_timeout x its max_new_tokens.",
        gt=0.0,
    )
    token_timeout: float = f(
        0.25,
        help="Seconds per requested token added to a generation request's deadline (request_timeout + "
        "token_timeout x max_new_tokens; the default allows 4 tokens/s per request).",
        ge=0.0,
    )
    connect_timeout: float = f(
        10.0, help="Seconds to open a connection to a server (a server that takes longer is evicted).", gt=0.0
    )
    health_timeout: float = f(
        5.0,
        help="Seconds a health check may take: a server that answers no /health within it is evicted, and the "
        "requests in flight on it are re-issued to the others at once.",
        gt=0.0,
    )
    server_wait_timeout: float = f(
        60.0,
        help="Seconds requests and weight updates wait for a server to come back when every server is out "
        "(dead, frozen, evicted); past it the run stops with one line naming the servers.",
        gt=0.0,
    )
    max_retries: int = f(5, help="Retries of a request on connection errors and 5xx (with backoff).", ge=0)
    admin_token: str = f(
        "",
        help="Bearer token for admin endpoints of servers (also read from RELAYRL_ADMIN_TOKEN; launched servers get "
        "a random one when empty). Never written to config.yaml or metric sinks.",
        secret=True,
    )
    weight_sync: str = f(
        "auto",
        help="How weights reach servers: 'disk' (versioned dir), 'http' (upload), 'broadcast' "
        "(a process group with the servers: NCCL on GPUs, gloo on CPU), 'auto' (disk if weight_sync_dir, else http).",
        choices=["auto", "disk", "http", "broadcast"],
    )
    weight_sync_dir: str = f(
        "", help="Shared directory for weight_sync=disk (versioned safetensors dirs); auto uses disk when set."
    )
    health_interval: float = f(
        1.0, help="Seconds between health checks of remote servers (dead ones are re-admitted).", gt=0.0
    )
    batch_window_ms: float = f(
        1.0,
        help="RemoteEngine: generation requests headed to the same server within this many "
        "milliseconds go out as one batched HTTP call (each still retried, continued and balanced on its "
        "own); 0 = one call per request.",
        ge=0.0,
        le=1000.0,
    )
    batch_max_requests: int = f(256, help="RemoteEngine: most generation requests in one batched HTTP call.", ge=1)
    weight_bucket_mb: float = f(
        512.0,
        help="weight_sync=broadcast: most megabytes of tensors per update call (servers "
        "allocate one bucket of receive buffers at a time).",
        gt=0.0,
    )

    def validate(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda|cuda:\d+", self.device):
            raise ValueError(f"device={self.device!r} is not one of 'auto', 'cpu', 'cuda', 'cuda:N'")
