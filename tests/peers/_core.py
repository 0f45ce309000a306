"""What both stand-ins share: the tiny model generating through relayrl's LocalEngine (what
must be faithful is the protocol around it), logprobs recomputed from the logits (raw or after
temperature, as vLLM's ``--logprobs-mode`` picks), weight loading, LoRA adapters, and serving on
127.0.0.1 with the port announced on stdout (``<name> listening on http://127.0.0.1:PORT``).

An adapter is served by a model of its own: the current base weights with the adapter merged in
by peft itself (``PeftModel.from_pretrained(base, dir).merge_and_unload()``), so what a server
generates with an adapter is independent of relayrl's own merge code."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from relayrl.api.config import InferenceConfig  # noqa: E402
from relayrl.api.io import GenerationConfig, ModelRequest, ModelResponse  # noqa: E402
from relayrl.data.models import build_tiny_model, build_tiny_vl_model  # noqa: E402
from relayrl.data.vision import VL_PRESETS, build_image_processor  # noqa: E402
from relayrl.inference.local import LocalEngine  # noqa: E402
from relayrl.inference.local.seq import load_hf_state_dict  # noqa: E402


class TinyPeer:
    """The model behind a stand-in: generation, weights (a full CPU copy, so a bucket of some
    tensors can be loaded on its own, as SGLang's ``load_weights`` does), abort of running requests."""

    def __init__(self, seed: int = 0, model: str = "tiny") -> None:
        torch.set_num_threads(1)
        processor = None
        self.seed, self.model_name = seed, model
        if model in VL_PRESETS:  # a vision-language model: requests may carry images
            self.model, processor = build_tiny_vl_model(model, seed=seed).eval(), build_image_processor()
        else:
            self.model = build_tiny_model(model, seed=seed).eval()
        self.adapters: dict[str, tuple[torch.nn.Module, LocalEngine]] = {}  # name -> (merged model, its engine)
        self.adapter_paths: dict[str, str] = {}
        self.state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.engine = LocalEngine(InferenceConfig(), model=self.model, image_processor=processor)
        self.engine.initialize()
        self.vocab = int(self.model.config.get_text_config().vocab_size)
        self.lock = asyncio.Lock()  # held while weights load (SGLang: the model-update writer lock)

    async def generate(
        self, rid: str, ids: list[int], g: GenerationConfig, images: list[str] | None = None, adapter: str = ""
    ) -> ModelResponse:
        """One pass: an interrupted request ends as ``abort`` with its partial output, as the peers answer."""
        engine = self.adapters[adapter][1] if adapter else self.engine
        req = ModelRequest(rid=rid, input_ids=ids, gconfig=g, image_data=list(images or []))
        return await engine.agenerate_once(req)

    def hold_once(self, rows: int, tokens: int, on_hold: Callable[[], None]) -> None:
        """Test hook (``--hold-rows`` / ``--hold-after-tokens``): the first time ``rows`` requests are
        running with ``tokens`` output tokens each, generation pauses in place at that step boundary
        (as a pause that keeps requests) and ``on_hold`` is called: a test's pause or update then lands
        mid-generation whatever the machine's load. The next resume lets them go on."""
        engine = self.engine
        step = engine._step  # noqa: SLF001 - one decode step, on the engine's loop thread

        def step_then_hold() -> None:
            step()
            live = [s for s, alive in zip(engine._rows, engine._alive, strict=True) if alive]  # noqa: SLF001
            if len(live) >= rows and min(len(s.out) for s in live) >= tokens:
                engine._step = step  # noqa: SLF001 - once
                with engine._wake:  # noqa: SLF001 - what LocalEngine.pause sets; the loop waits at its next turn
                    engine._paused = True  # noqa: SLF001
                on_hold()

        engine._step = step_then_hold  # noqa: SLF001

    def load_adapter(self, name: str, path: str) -> int:
        """Serve the peft adapter at ``path`` as ``name``; returns its rank."""
        import json

        from peft import PeftModel

        with open(Path(path) / "adapter_config.json") as fh:
            rank = int(json.load(fh)["r"])
        base = build_tiny_model(self.model_name, seed=self.seed)
        base.load_state_dict(self.state)
        merged = PeftModel.from_pretrained(base, path).merge_and_unload().eval()
        engine = LocalEngine(InferenceConfig(), model=merged)
        engine.initialize()
        self.adapters[name] = (merged, engine)
        self.adapter_paths[name] = path
        return rank

    def unload_adapter(self, name: str) -> None:
        """Forget ``name`` (requests already running on it keep their engine to the end)."""
        self.adapters.pop(name)
        self.adapter_paths.pop(name)

    def abort_running(self) -> int:
        before = self.engine.counters["aborts"]
        self.engine.abort_running()
        return int(self.engine.counters["aborts"] - before)

    def load(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load ``tensors`` (all or some of the model's) and set the engine's version."""
        unknown = sorted(set(tensors) - set(self.state))
        if unknown:
            raise ValueError(f"unknown parameters {unknown[:3]}")
        for k, v in tensors.items():
            if tuple(v.shape) != tuple(self.state[k].shape):
                raise ValueError(f"{k}: shape {tuple(v.shape)}, model has {tuple(self.state[k].shape)}")
            self.state[k] = v.to(self.state[k].dtype)
        from relayrl.api.io import WeightUpdate

        self.engine.update_weights(WeightUpdate(kind="tensors", version=version, tensors=dict(self.state)))

    def load_dir(self, path: str, version: int) -> int:
        tensors = load_hf_state_dict(path)
        self.load(tensors, version)
        return len(tensors)

    @torch.inference_mode()
    def logits(self, ids: list[int], out: list[int], adapter: str = "") -> torch.Tensor:
        """Logits that produced each of ``out`` (one row per output token)."""
        seq = torch.tensor([ids + out])
        model = self.adapters[adapter][0] if adapter else self.model
        return model(seq).logits[0, len(ids) - 1 : len(ids) + len(out) - 1].float()


def listen(app: object, name: str, host: str = "127.0.0.1", port: int = 0) -> None:
    """Serve ``app`` until killed; print the bound address once listening."""
    import contextlib

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    bound = sock.getsockname()[1]

    @contextlib.asynccontextmanager
    async def lifespan(_: object):  # type: ignore[no-untyped-def]
        print(f"{name} listening on http://{host}:{bound}", flush=True)
        yield

    app.router.lifespan_context = lifespan  # type: ignore[attr-defined]
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])


def routed_all_layers(model: torch.nn.Module, routed: torch.Tensor) -> str:
    """SGLang 0.5.23's ``meta_info.routed_experts``: base64 int32 ``[seqlen - 1, num_hidden_layers, top_k]``
    (every decoder layer, a dense one's left 0; ``state_capturer/routed_experts.py``), sent with no shape."""
    from relayrl.utils.moe import encode_routed_experts, moe_layer_indices

    cfg = model.config.get_text_config()  # type: ignore[operator]
    out = torch.zeros(routed.shape[0], int(cfg.num_hidden_layers), routed.shape[2], dtype=torch.int32)
    out[:, moe_layer_indices(model)] = routed.to(torch.int32)
    return encode_routed_experts(out)
