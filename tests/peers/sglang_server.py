"""SGLang stand-in: the HTTP surface RemoteEngine depends on, as SGLang's own source defines it.

Follows SGLang v0.5.x, from ``python/sglang/srt/entrypoints/http_server.py`` (routes),
``managers/io_struct.py`` (``GenerateReqInput``, ``UpdateWeightFromDiskReqInput``,
``UpdateWeightsFromDistributedReqInput``, ``InitWeightsUpdateGroupReqInput``,
``PauseGenerationReqInput``), ``managers/tokenizer_manager.py`` (duplicate rids) and
``utils/common.py::init_custom_process_group`` (the weight group, see ``sglang_group.py``).
Two route layouts, picked by ``--version``:

- ``0.5.2`` (and any version below ``0.5.10``): ``/get_server_info``, ``/get_model_info``,
  ``/get_weight_version``;
- ``0.5.15``: ``/server_info``, ``/model_info`` (which carries ``weight_version``); no
  ``/get_weight_version`` (moved, as SGLang did); ``0.5.23`` adds weight-update sessions.

Facts reproduced: ``/health`` and ``/health_generate`` run a one-token generation, so they block
while generation is paused or a weight update holds the model lock, and answer 503 after
``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s); a rid already in flight is refused with 400
``Duplicate request ID detected``; unknown ``sampling_params`` keys are refused (SGLang builds
``SamplingParams(**sampling_params)``); unknown top-level fields are ignored (dataclass body);
``weight_version`` is a string (``"default"`` at start); ``finish_reason`` is ``{"type": ...}``;
``/pause_generation`` modes ``abort`` (default: in-flight requests end as ``abort``), ``retract``,
``in_place``; ``/update_weights_from_disk`` extras (``is_async``, ``torch_empty_cache``,
``keep_pause``, ``recapture_cuda_graph``, ``token_step``, ``flush_cache``); the weight group joins as
``rank_offset + tp_rank`` for every TP rank (ranks > 0 in their own processes, as SGLang's
schedulers are) and each ``/update_weights_from_distributed`` call loads its bucket at once.

Run: ``python tests/peers/sglang_server.py [--port 0] [--version 0.5.2] [--tp-size 1] [--load-delay 0]
[--model-path tiny | tiny-vl]`` (a vision model takes ``GenerateReqInput.image_data``: one image or a list
per request, one entry per item in a batch).

LoRA (SGLang v0.5.x ``managers/io_struct.py``: ``LoadLoRAAdapterReqInput`` / ``UnloadLoRAAdapterReqInput``
``{"lora_name", "lora_path", "pinned"}``, ``LoRAUpdateOutput`` ``{"success", "error_message",
``"loaded_adapters": {name: LoRARef}}`` answered 200 or 400; ``lora/lora_registry.py``): with
``--enable-lora`` (``--max-lora-rank``, ``--lora-target-modules``, ``--max-loras-per-batch`` are
accepted and shown in the server info) adapters load at run time; a name already loaded or a
rank above ``--max-lora-rank`` is refused; ``/generate``'s ``lora_path`` (one name, or one per
item, ``None`` = the base) must name loaded adapters (else 400 ``The following requested LoRA
adapters are not loaded``); an unload waits until no running request uses the adapter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _core import TinyPeer, listen, routed_all_layers  # noqa: E402
from sglang_group import init_custom_process_group, receive  # noqa: E402
from sglang_io import (  # noqa: E402
    SAMPLING_KEYS,
    DestroyWeightsUpdateGroupReqInput,
    GenerateReqInput,
    InitWeightsUpdateGroupReqInput,
    LoadLoRAAdapterReqInput,
    PauseGenerationReqInput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
)

from relayrl.api.io import GenerationConfig  # noqa: E402
from relayrl.inference.remote.protocol import version_tuple  # noqa: E402


def _err(msg: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": msg}}, status_code=status)


def _refused(message: str, **extra: object) -> JSONResponse:
    """A weight route that failed: ``{"success": false, "message"}`` with 400, as SGLang answers."""
    return JSONResponse({"success": False, "message": message, **extra}, status_code=400)


class SGLangStandIn:
    def __init__(
        self, version: str, tp_size: int, load_delay: float, model: str = "tiny", lora: dict[str, object] | None = None
    ) -> None:
        self.version, self.tp_size, self.load_delay = version, tp_size, load_delay
        self.lora = lora or {"enable_lora": False}  # the LoRA server args
        self.lora_use: dict[str, int] = {}  # adapter -> running requests (SGLang's per-adapter counters)
        self.new_layout = tuple(int(x) for x in version.split(".")[:3]) >= (0, 5, 10)
        self.peer = TinyPeer(model=model)
        self.weight_version = "default"
        self.int_version = 0
        self.paused = False
        self.in_flight: set[str] = set()
        self.groups: dict[str, torch.distributed.ProcessGroup] = {}
        self.workers = [self._spawn_worker() for _ in range(tp_size - 1)]  # TP ranks 1..tp_size-1
        self.health_timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
        self.counts = {"aborted": 0, "health_503": 0, "buckets": 0, "abort_rid": 0}
        self.sessions = version_tuple(version) >= (0, 5, 23)  # /begin_weight_update ... /end_weight_update
        self.session_open = False
        self.refuse_flush = 0  # --refuse-flush N: the next N disk updates find requests "still running"

    def _spawn_worker(self) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "sglang_group.py"), "worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def _ask(self, w: subprocess.Popen[str], cmd: dict) -> dict:  # type: ignore[type-arg]
        assert w.stdin is not None and w.stdout is not None
        w.stdin.write(json.dumps(cmd) + "\n")
        w.stdin.flush()
        reply = json.loads(w.stdout.readline())
        if not reply["ok"]:
            raise RuntimeError(reply["error"])
        return reply  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ generation
    def gconfig(self, sp: dict) -> GenerationConfig:  # type: ignore[type-arg]
        unknown = sorted(set(sp) - SAMPLING_KEYS)
        if unknown:
            raise ValueError(f"SamplingParams.__init__() got an unexpected keyword argument '{unknown[0]}'")
        t = float(sp.get("temperature", 1.0))
        stop = sp.get("stop") or []
        return GenerationConfig(
            max_new_tokens=int(sp.get("max_new_tokens", 128)),
            min_new_tokens=int(sp.get("min_new_tokens", 0)),
            greedy=t < 1e-5,
            temperature=1.0 if t < 1e-5 else t,
            top_p=float(sp.get("top_p", 1.0)),
            top_k=max(0, int(sp.get("top_k", -1))),
            stop=[stop] if isinstance(stop, str) else list(stop),
            stop_token_ids=list(sp.get("stop_token_ids") or []),
            ignore_eos=bool(sp.get("ignore_eos", False)),
        )

    async def one(
        self,
        rid: str,
        ids: list[int],
        sp: dict,
        logprob: bool,
        images: list[str],
        lora: str | None,
        routed: bool = False,
    ) -> dict:  # type: ignore[type-arg]
        g = self.gconfig(sp)
        self.lora_use[lora or ""] = self.lora_use.get(lora or "", 0) + 1
        try:
            r = await self.peer.generate(rid, ids, g, images, lora or "")
        finally:
            self.lora_use[lora or ""] -= 1
        text = ""
        finish: dict[str, object] = {"type": r.stop_reason}
        if r.stop_reason == "length":
            finish["length"] = r.output_len
        elif r.stop_reason == "stop":
            finish["matched"] = r.output_tokens[-1] if r.output_tokens else None
        else:
            finish["message"] = "Abort before update weights" if self.paused else "aborted"
        meta: dict[str, object] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "weight_version": self.weight_version,
            "completion_tokens": r.output_len,
            "cached_tokens": 0,
            "e2e_latency": r.latency,
        }
        if logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(r.output_logprobs, r.output_tokens, strict=True)
            ]
        if routed and r.routed_experts is not None:
            meta["routed_experts"] = routed_all_layers(self.peer.model, r.routed_experts)
        return {"text": text, "output_ids": r.output_tokens, "meta_info": meta}

    async def generate(self, obj: GenerateReqInput) -> Response:
        if obj.stream:
            return _err("stream: not reproduced by the stand-in")
        batch = isinstance(obj.input_ids, list) and bool(obj.input_ids) and isinstance(obj.input_ids[0], list)
        prompts = obj.input_ids if batch else [obj.input_ids]
        if prompts is None or prompts == [None]:
            return _err("Either text or input_ids should be provided.")
        n = len(prompts)  # type: ignore[arg-type]
        rids = (
            obj.rid
            if isinstance(obj.rid, list)
            else [obj.rid or uuid.uuid4().hex]
            if n == 1
            else [f"{obj.rid or uuid.uuid4().hex}_{i}" for i in range(n)]
        )
        sps = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params or {}] * n
        lps = obj.return_logprob if isinstance(obj.return_logprob, list) else [obj.return_logprob] * n
        imgs = obj.image_data if batch and isinstance(obj.image_data, list) else [obj.image_data] * n
        imgs = [[x] if isinstance(x, str) else list(x or []) for x in imgs]
        loras = obj.lora_path if isinstance(obj.lora_path, list) else [obj.lora_path] * n
        for name in loras:
            if name is not None and name not in self.peer.adapters:
                return _err(
                    f"The following requested LoRA adapters are not loaded: {name}\n"
                    f"Loaded adapters: {set(self.peer.adapters)}."
                )
        for rid in rids:
            if rid in self.in_flight:
                return _err(f"Duplicate request ID detected: {rid}")
        self.in_flight.update(rids)
        try:
            while self.paused:  # SGLang holds new requests while generation is paused
                await asyncio.sleep(0.01)
            outs = await asyncio.gather(
                *(
                    self.one(r, p, s, lp, im, a, obj.return_routed_experts)
                    for r, p, s, lp, im, a in zip(rids, prompts, sps, lps, imgs, loras, strict=True)
                )
            )  # type: ignore[arg-type]
        except ValueError as e:
            return _err(str(e))
        finally:
            self.in_flight.difference_update(rids)
        return JSONResponse(outs if batch else outs[0])

    async def health(self, request: Request) -> Response:
        """A one-token generation: it waits while paused or while weights load, and gives up after the timeout."""
        deadline = time.monotonic() + self.health_timeout
        while self.paused or self.peer.lock.locked():
            if time.monotonic() > deadline:
                self.counts["health_503"] += 1
                return Response(status_code=503)
            await asyncio.sleep(0.05)
        await self.peer.generate(f"HEALTH_CHECK_{time.time()}", [0], GenerationConfig(max_new_tokens=1, greedy=True))
        return Response(status_code=200)

    # ------------------------------------------------------------------ weights
    async def update_from_disk(self, obj: UpdateWeightFromDiskReqInput) -> Response:
        if obj.abort_all_requests:
            self.counts["aborted"] += await asyncio.to_thread(self.peer.abort_running)
        async with self.peer.lock:
            await asyncio.sleep(self.load_delay)
            v = _as_int(obj.weight_version, self.int_version + 1)
            try:
                n = await asyncio.to_thread(self.peer.load_dir, obj.model_path, v)
            except (OSError, ValueError) as e:
                return _refused(f"Failed to update weights: {e}", num_paused_requests=0)
            self.int_version = v  # new tokens carry it, as SGLang's scheduler records it on loading
        if refused := self.flush_refused(obj.flush_cache):
            return refused  # the reported version stays the old one (0.5.23 sets it on success only)
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
        return JSONResponse(
            {"success": True, "message": f"Succeeded to update model weights ({n} tensors).", "num_paused_requests": 0}
        )

    async def init_group(self, obj: InitWeightsUpdateGroupReqInput) -> Response:
        timeout = timedelta(seconds=60)
        init = f"tcp://{obj.master_address}:{obj.master_port}"

        def join_all() -> None:
            errors: list[BaseException] = []

            def rank0() -> None:
                try:
                    self.groups[obj.group_name] = init_custom_process_group(
                        obj.backend, init, obj.world_size, obj.rank_offset, obj.group_name, timeout
                    )
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            t = threading.Thread(target=rank0)
            t.start()
            for tp_rank, w in enumerate(self.workers, start=1):
                self._ask(
                    w,
                    {
                        "op": "init",
                        "master_address": obj.master_address,
                        "master_port": obj.master_port,
                        "rank": obj.rank_offset + tp_rank,
                        "world_size": obj.world_size,
                        "group_name": obj.group_name,
                        "backend": obj.backend,
                        "timeout": 60,
                    },
                )
            t.join()
            if errors:
                raise errors[0]

        try:
            await asyncio.to_thread(join_all)
        except Exception as e:  # noqa: BLE001 - SGLang answers success=False with the message
            return _refused(f"Failed to initialize custom process group: {e}.")
        return JSONResponse({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_group(self, obj: DestroyWeightsUpdateGroupReqInput) -> Response:
        pg = self.groups.pop(obj.group_name, None)
        if pg is None:
            return _refused(f"Group {obj.group_name} not in model_update_group")
        torch.distributed.destroy_process_group(pg)
        for w in self.workers:
            self._ask(w, {"op": "destroy", "group_name": obj.group_name})
        return JSONResponse({"success": True, "message": "Succeeded to destroy custom process group."})

    async def update_distributed(self, obj: UpdateWeightsFromDistributedReqInput) -> Response:
        if self.sessions and not self.session_open:
            return _refused(
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        pg = self.groups.get(obj.group_name)
        if pg is None:
            return _refused(f"Group {obj.group_name} not in model_update_group")
        if obj.abort_all_requests:
            self.counts["aborted"] += await asyncio.to_thread(self.peer.abort_running)
        async with self.peer.lock:

            def recv_all() -> list[torch.Tensor]:
                for w in self.workers:  # TP ranks > 0 receive the same broadcasts
                    assert w.stdin is not None
                    w.stdin.write(
                        json.dumps(
                            {"op": "recv", "group_name": obj.group_name, "dtypes": obj.dtypes, "shapes": obj.shapes}
                        )
                        + "\n"
                    )
                    w.stdin.flush()
                got = receive(pg, obj.dtypes, obj.shapes)
                for w in self.workers:
                    assert w.stdout is not None
                    if not json.loads(w.stdout.readline())["ok"]:
                        raise RuntimeError("a TP rank failed to receive")
                return got

            got = await asyncio.to_thread(recv_all)
            await asyncio.sleep(self.load_delay)
            v = _as_int(obj.weight_version, self.int_version)
            try:
                await asyncio.to_thread(self.peer.load, dict(zip(obj.names, got, strict=True)), v)
            except ValueError as e:
                return _refused(f"Failed to update parameter online: {e}")
            self.counts["buckets"] += 1
            self.int_version = v  # new tokens carry it, as SGLang's scheduler records it on loading
        if refused := self.flush_refused(obj.flush_cache):
            return refused  # the reported version stays the old one (0.5.23 sets it on success only)
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
        return JSONResponse({"success": True, "message": "Succeeded to update parameter online."})

    def flush_refused(self, flush: bool) -> Response | None:
        """``--refuse-flush N``: the next N loads that flush find requests still winding down and fail
        after loading (SGLang 0.5.23 ``weight_updater.flush_cache_after_weight_update``)."""
        if not flush or self.refuse_flush <= 0:
            return None
        self.refuse_flush -= 1
        return _refused(
            "Weights were updated, but the cache was not flushed because requests are still running or queued. "
            "Retract or finish them, then call /flush_cache."
        )

    async def abort_request(self, request: Request) -> Response:
        """SGLang's ``AbortReq``: ``abort_all`` ends every running request as ``abort``; a rid is only counted."""
        body = await request.json()
        if body.get("abort_all"):
            self.counts["aborted"] += await asyncio.to_thread(self.peer.abort_running)
        else:
            self.counts["abort_rid"] += 1
        return Response(status_code=200)

    def session(self, begin: bool) -> Response:
        """``/begin_weight_update`` / ``/end_weight_update`` (SGLang >= 0.5.23, its PR 28001): distributed
        weights load only inside a session; a second begin, or an end without one, is refused."""
        if self.session_open == begin:
            return _refused("a weight-update session is already open" if begin else "no weight-update session is open")
        self.session_open = begin
        return JSONResponse({"success": True, "message": "Success"})

    async def pause(self, obj: PauseGenerationReqInput) -> Response:
        if obj.mode not in ("abort", "retract", "in_place"):
            return _err(f"Invalid mode: {obj.mode!r}. Expected one of ['abort', 'retract', 'in_place'].")
        self.paused = True
        await asyncio.to_thread(self.peer.engine.pause)
        if obj.mode == "abort":
            self.counts["aborted"] += await asyncio.to_thread(self.peer.abort_running)
        return JSONResponse({})

    async def resume(self) -> Response:
        self.paused = False
        await asyncio.to_thread(self.peer.engine.resume)
        return JSONResponse({})

    # ------------------------------------------------------------------ LoRA
    def _lora_reply(self, error: str | None = None) -> JSONResponse:
        loaded = {
            n: {"lora_id": n, "lora_name": n, "lora_path": p, "pinned": False}
            for n, p in self.peer.adapter_paths.items()
        }
        body = {"success": error is None, "error_message": error, "loaded_adapters": loaded}
        return JSONResponse(body, status_code=200 if error is None else 400)

    async def load_lora(self, obj: LoadLoRAAdapterReqInput) -> Response:
        if not self.lora["enable_lora"]:
            return self._lora_reply("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if obj.lora_name in self.peer.adapters:
            return self._lora_reply(f"Failed to load LoRA adapter {obj.lora_name} because it is already loaded")
        try:
            with open(Path(obj.lora_path) / "adapter_config.json") as fh:
                rank = int(json.load(fh)["r"])
        except (OSError, ValueError, KeyError) as e:
            return self._lora_reply(f"Failed to load LoRA adapter {obj.lora_name}: {e}")
        max_rank = int(self.lora.get("max_lora_rank") or 0)  # type: ignore[call-overload]
        if max_rank and rank > max_rank:
            return self._lora_reply(
                f"LoRA adapter {obj.lora_name} with rank {rank} is incompatible with the current LoRA memory pool "
                f"configuration (max_lora_rank={max_rank})."
            )
        async with self.peer.lock:
            await asyncio.to_thread(self.peer.load_adapter, obj.lora_name, obj.lora_path)
        return self._lora_reply()

    async def unload_lora(self, obj: UnloadLoRAAdapterReqInput) -> Response:
        if obj.lora_name not in self.peer.adapters:
            return self._lora_reply(f"LoRA adapter {obj.lora_name} is not loaded")
        while self.lora_use.get(obj.lora_name, 0) > 0:  # SGLang waits for the requests using it
            await asyncio.sleep(0.01)
        self.peer.unload_adapter(obj.lora_name)
        return self._lora_reply()

    def server_info(self) -> dict[str, object]:
        return {
            **self.lora,
            "version": self.version,
            "tp_size": self.tp_size,
            "dp_size": 1,
            "model_path": "tiny",
            "served_model_name": "tiny",
            "weight_version": self.weight_version,
            "stand_in_counts": self.counts,
        }


def _as_int(v: str | None, default: int) -> int:
    try:
        return int(v) if v is not None else default
    except ValueError:
        return default


def build_app(s: SGLangStandIn) -> FastAPI:
    app = FastAPI()
    app.post("/generate")(s.generate)
    app.get("/health")(s.health)
    app.get("/health_generate")(s.health)
    app.post("/update_weights_from_disk")(s.update_from_disk)
    app.post("/init_weights_update_group")(s.init_group)
    app.post("/update_weights_from_distributed")(s.update_distributed)
    app.post("/destroy_weights_update_group")(s.destroy_group)
    app.post("/pause_generation")(s.pause)
    app.post("/abort_request")(s.abort_request)
    if s.sessions:
        app.post("/begin_weight_update")(lambda: s.session(True))
        app.post("/end_weight_update")(lambda: s.session(False))
    app.post("/continue_generation")(s.resume)
    app.post("/load_lora_adapter")(s.load_lora)
    app.post("/unload_lora_adapter")(s.unload_lora)

    @app.get("/stand_in")
    async def stand_in() -> dict[str, object]:  # test introspection, not an SGLang route: how it was started
        keys = ("CUDA_VISIBLE_DEVICES", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION")
        return {"argv": sys.argv, "env": {k: os.environ.get(k) for k in keys}}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, object]:  # SGLang's UpdateWeightVersionReqInput
        body = await request.json()
        if body.get("abort_all_requests", True):
            s.counts["aborted"] += await asyncio.to_thread(s.peer.abort_running)
        s.weight_version = str(body["new_version"])
        s.int_version = _as_int(s.weight_version, s.int_version)
        return {
            "success": True,
            "message": f"Weight version updated to {s.weight_version}",
            "new_version": s.weight_version,
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        return Response(  # SGLang's plain-text answer (http_server.flush_cache), not JSON
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
            "the operation will not be performed.)\n"
        )

    model_info = {"model_path": "tiny", "tokenizer_path": "tiny", "is_generation": True}
    if s.new_layout:
        app.get("/server_info")(s.server_info)

        @app.get("/model_info")
        async def model_info_new() -> dict[str, object]:
            return {**model_info, "weight_version": s.weight_version}
    else:
        app.get("/get_server_info")(s.server_info)

        @app.get("/get_model_info")
        async def get_model_info() -> dict[str, object]:
            return model_info

        @app.get("/get_weight_version")
        async def get_weight_version() -> dict[str, object]:
            return {"weight_version": s.weight_version}

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--version", default="0.5.2", help="the SGLang version to reproduce (its route layout)")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--load-delay", type=float, default=0.0, help="extra seconds each weight load holds the model lock")
    ap.add_argument("--model-path", default="tiny", help="tiny, or tiny-vl / tiny-vl2.5 (takes image_data)")
    ap.add_argument(
        "--refuse-flush", type=int, default=0, help="the first N disk updates answer 'cache was not flushed'"
    )
    ap.add_argument("--enable-lora", action="store_true")
    ap.add_argument("--max-lora-rank", type=int, default=None)
    ap.add_argument("--lora-target-modules", nargs="*", default=None)
    ap.add_argument("--max-loras-per-batch", type=int, default=8)
    args, _ = ap.parse_known_args()
    lora = {
        "enable_lora": args.enable_lora,
        "max_lora_rank": args.max_lora_rank,
        "lora_target_modules": args.lora_target_modules,
        "max_loras_per_batch": args.max_loras_per_batch,
    }
    stand_in = SGLangStandIn(args.version, args.tp_size, args.load_delay, args.model_path, lora)
    stand_in.refuse_flush = args.refuse_flush
    listen(build_app(stand_in), "sglang stand-in", args.host, args.port)


if __name__ == "__main__":
    main()
