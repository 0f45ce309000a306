"""RemoteEngine: generation on one or many HTTP servers (relayrl, SGLang or vLLM).

- Balancing: each request goes to the live server with the fewest requests in flight;
  requests sharing a ``rid`` (the turns of one episode) stick to the same server.
- Failures: connection errors and 5xx are retried on another server with exponential
  backoff; a server that refuses connections or answers no ``/health`` within
  ``health_timeout`` (dead or frozen) is evicted, its requests in flight re-issued elsewhere at
  once (``inflight.InFlight``), and re-admitted once ``/health`` answers again (given the current
  weights). A request past ``request_timeout + token_timeout x max_new_tokens`` is retried elsewhere.
  With every server out for ``server_wait_timeout``, a request or weight update raises ``Stalled``.
- Interruption: a reply that ends with ``abort`` (weights changing) is resubmitted as
  prompt + partial output; every token keeps the version that produced it.
- Peers (``peers.make_backend``, by ``inference.protocol``) map requests and replies, detect each
  server, pick the weight sync (``weights``, ``adapters``) and launch servers.
- Batching: requests headed to the same server within ``batch_window_ms`` share one HTTP
  call (``batcher.MicroBatcher``); everything above still happens per request.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import random
import secrets
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable

import httpx
import torch

from relayrl.api.config import InferenceConfig, ModelConfig
from relayrl.api.engine import InferenceEngine
from relayrl.api.io import ModelRequest, ModelResponse, StopReason, WeightUpdate
from relayrl.inference.remote.adapters import AdapterSync, adapter_mode, adapters_kept
from relayrl.inference.remote.batcher import MicroBatcher
from relayrl.inference.remote.inflight import InFlight, RequestDeadline, ServerEvicted, fan_out
from relayrl.inference.remote.launch import Launched
from relayrl.inference.remote.peers import make_backend
from relayrl.inference.remote.protocol import (
    DEAD_ERRORS,
    AdminError,
    Call,
    Getter,
    JsonDict,
    Server,
    ServerError,
    wire_image,
)
from relayrl.inference.remote.transport import Clients, base_url, naming_timeout
from relayrl.inference.remote.weights import WeightSync
from relayrl.utils.deadline import Stalled

log = logging.getLogger(__name__)


class RemoteEngine(InferenceEngine):
    """InferenceEngine over HTTP servers (``config.addresses``, or ``n_servers`` launched
    serving ``model``, the policy's ModelConfig, so that its weights fit them)."""

    def __init__(
        self, config: InferenceConfig, addresses: list[str] | None = None, model: ModelConfig | None = None
    ) -> None:
        self.config = config
        self.model = model or ModelConfig()
        self.addresses = list(addresses if addresses is not None else config.addresses)
        self.backend = make_backend(config.protocol)
        if config.return_routed_experts:  # a peer whose replies carry none refuses, naming the option
            self.backend.ask_routed_experts(self.model)
        self.http = Clients(config.connect_timeout, config.admin_token or os.environ.get("RELAYRL_ADMIN_TOKEN", ""))
        self.servers: list[Server] = []
        self._lock = threading.Lock()  # server table and counters (agenerate runs on many threads)
        self._update_lock = threading.Lock()
        self._affinity: collections.OrderedDict[str, Server] = collections.OrderedDict()
        self._batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, MicroBatcher] = weakref.WeakKeyDictionary()
        # the syncs: full weights by weight_sync mode (disk, http, broadcast; made at first use, or at connect
        # when inference.weight_sync says which), adapters (model.lora.sync=adapter)
        self._syncs: dict[str, WeightSync] = {}
        self._adapters: AdapterSync | None = None
        self._last: tuple[WeightSync, object] | None = None  # the last update's sync and data: a returning server's
        self._stop = threading.Event()
        self._health: threading.Thread | None = None
        self._launched: Launched | None = None
        self._rr = 0
        self._inflight = InFlight()
        self._wire_ids = itertools.count()
        self.paused = False  # generation paused by the trainer
        # requests: generation requests sent (continuations and retries included); http_calls: the
        # HTTP calls that carried them (fewer when batched)
        keys = ("evictions", "readmissions", "reissued", "retried", "interrupted", "requests", "http_calls")
        self.counters = collections.Counter[str]({k: 0 for k in keys})

    # ------------------------------------------------------------------ lifecycle
    def initialize(self, wait_timeout: float | None = None) -> None:
        """Connect (launching servers first if asked); every server must answer /health within
        ``wait_timeout`` (default ``inference.launch_timeout``)."""
        launch = self.config.launch
        wait_timeout = self.config.launch_timeout if wait_timeout is None else wait_timeout
        self.accepts_adapters = adapter_mode(self.model.lora, self.config, self.backend)
        if not self.addresses and self.config.n_servers > 0 and launch != "none":
            peer = make_backend(launch)  # the peer whose servers are started
            if self.backend.name not in peer.speaks:
                raise ValueError(
                    f"inference.launch={launch} starts {launch} servers: set inference.protocol={launch} "
                    f"(it is {self.backend.name})"
                )
            lora = self.model.lora if self.accepts_adapters else None
            self.http.token = self.http.token or secrets.token_urlsafe(32)  # launched servers are never open
            self._launched = peer.launch(self.config, self.model, lora, self.http.token)
            self.addresses = self._launched.addresses
        if not self.addresses:
            raise ValueError(
                "RemoteEngine needs inference.addresses (host:port of servers), or inference.n_servers > 0 "
                f"with inference.launch=relayrl|sglang|vllm (it is {launch})"
            )
        self.servers = [Server(base_url(a)) for a in self.addresses]
        deadline = time.monotonic() + wait_timeout
        pending = list(self.servers)
        while pending := [s for s in pending if not self._probe(s)]:
            if time.monotonic() > deadline:
                raise Stalled(
                    f"RemoteEngine start-up waited {wait_timeout:.0f}s for servers {[s.url for s in pending]} to answer "
                    f"/health (each check given inference.health_timeout={self.config.health_timeout}s): they are "
                    "down, frozen or still loading; check them, or give them longer with inference.launch_timeout"
                )
            time.sleep(0.2)
        self._connect_all()
        for s in self.servers:  # now that each server's version route is known
            self._probe(s)
            s.version = max(s.version, 0)  # none reported (vLLM, SGLang's "default"): its start-up weights, version 0
        self._version = max(s.version for s in self.servers)
        self._health = threading.Thread(target=self._health_loop, name="relayrl-health", daemon=True)
        self._health.start()

    def _get(self, srv: Server) -> Getter:
        """GET ``path`` of ``srv`` (detection at connect and re-admission), within inference.request_timeout."""
        return lambda path: self.http.request(srv, Call("GET", path), self.config.request_timeout)

    def _connect_all(self) -> None:
        """Read every server's version and routes; refuse, naming what is missing, those that
        cannot serve this run; pick the weight syncs."""
        for srv in self.servers:
            srv.info = self.backend.detect(srv.url, self._get(srv))
        if self.accepts_adapters:
            self.accepts_adapters = adapters_kept(self.model.lora, self.servers)
        if self.accepts_adapters:  # the adapter routes are what is needed, not the full-weight ones
            self._adapters = AdapterSync(self, self.backend)
        elif self._mode_set():
            sync = self._sync(self._sync_mode())
            for srv in self.servers:
                sync.connect(srv)
        self.backend.connected(self)

    def destroy(self) -> None:
        self._stop.set()
        if self._health is not None:
            self._health.join(timeout=5)
            self._health = None
        self.http.close()
        if self._launched is not None:
            self._launched.shutdown()
            self._launched = None

    # ------------------------------------------------------------------ routing
    def _choose(self, rid: str) -> Server | None:
        with self._lock:
            srv = self._affinity.get(rid)
            if srv is None or not srv.alive:
                live = [s for s in self.servers if s.alive]
                if not live:
                    return None
                self._rr += 1
                low = min(s.in_flight for s in live)
                ties = [s for s in live if s.in_flight == low]
                srv = ties[self._rr % len(ties)]
                self._affinity[rid] = srv
                if len(self._affinity) > 100_000:
                    self._affinity.popitem(last=False)
            else:
                self._affinity.move_to_end(rid)
            srv.in_flight += 1
            return srv

    def _release(self, srv: Server) -> None:
        with self._lock:
            srv.in_flight -= 1

    def evict(self, srv: Server, why: object) -> None:
        with self._lock:
            if not srv.alive:
                return
            srv.alive = False
            self.counters["evictions"] += 1
            srv.evictions += 1  # a weight group it was in is rebuilt at its next use
            self._inflight.why[srv.url] = str(why)
            log.warning("server %s evicted: %s", srv.url, why)
        cancelled = self._inflight.cancel(srv.url)  # its requests go elsewhere now, not at their deadline
        for loop, batcher in list(self._batchers.items()):
            if not loop.is_closed():
                loop.call_soon_threadsafe(batcher.cancel, srv.url)
        if cancelled:
            log.info("server %s: %d requests in flight re-issued to the other servers", srv.url, cancelled)

    def describe(self) -> str:
        return f"RemoteEngine at v{self._version}{', paused' if self.paused else ''}: {self._inflight.describe(self.servers)}"

    def live_servers(self) -> list[str]:
        return [s.url for s in self.servers if s.alive]

    def stats(self) -> dict[str, float]:
        return {**{k: float(v) for k, v in self.counters.items()}, "live_servers": float(len(self.live_servers()))}

    # ------------------------------------------------------------------ HTTP
    async def _send(self, url: str, call: Call) -> object:
        self.counters["http_calls"] += 1
        return await self.http.send(url, call)

    def _stream(self, url: str, call: Call) -> AsyncGenerator[object, None]:
        self.counters["http_calls"] += 1
        return self.http.stream(url, call)

    async def _abort_item(self, url: str, call: Call) -> None:
        """Stop a request its caller gave up on (best effort: it may have ended already; an evicted
        server is not asked)."""
        if not any(s.alive for s in self.servers if s.url == url):
            return
        try:
            await self.http.current().request(call.method, url + call.path, json=call.json, timeout=10)
        except httpx.HTTPError as e:
            log.info("%s%s failed: %r", url, call.path, e)

    def _generate_call(self, srv: Server, call: Call) -> Awaitable[object]:
        """``call`` sent alone (``batch_window_ms=0``) or batched with others to the same server."""
        if self.config.batch_window_ms <= 0:
            return self._send(srv.url, call)
        loop = asyncio.get_running_loop()
        batcher = self._batchers.get(loop)
        if batcher is None:
            batcher = MicroBatcher(
                self.backend,
                self._send,
                self._stream,
                self.config.batch_window_ms / 1000,
                self.config.batch_max_requests,
                self._abort_item,
            )
            self._batchers[loop] = batcher
        return batcher.submit(srv.url, call)

    # ------------------------------------------------------------------ generation
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        g = req.gconfig
        g.validate()
        images = [wire_image(x) for x in req.image_data]
        t0 = time.perf_counter()
        tokens: list[int] = []
        logps: list[float] = []
        versions: list[int] = []
        routed: torch.Tensor | None = None
        features: JsonDict | None = None  # vLLM: the images rendered by the server (once per request)
        ttft, attempt = 0.0, 0
        stop: StopReason | None = None
        no_server_since: float | None = None
        while stop is None:
            remaining = g.max_new_tokens - len(tokens)
            if remaining <= 0:
                stop = "length"
                break
            srv = self._choose(req.rid)
            if srv is None:  # every server is out: wait for one to come back, up to server_wait_timeout
                no_server_since = no_server_since or time.monotonic()
                self._inflight.check_wait(self.servers, req.rid, no_server_since, self.config.server_wait_timeout)
                await asyncio.sleep(min(0.2, self.config.server_wait_timeout / 10))
                continue
            no_server_since = None
            # held here while weights change: a request runs under the version it is sent under
            if self.paused or srv.updating:
                self._release(srv)
                await asyncio.sleep(0.005)
                continue
            sent_version = srv.version  # what produced these tokens when the server reports no version
            adapter = srv.adapter  # with an adapter, its name carries the version (the server's is the base's)
            self.counters["requests"] += 1
            try:
                # the images rendered once (vLLM), then sent with every continuation
                if images and features is None and (render := self.backend.render(srv, req.rid, req.input_ids, images)):
                    rendered = self._send(srv.url, render.call)
                    features = render.features(await self._inflight.run(srv, rendered, self.config.request_timeout))
                # a fresh wire id per request: SGLang refuses an id already in flight (ReMax sends two at once)
                call = self.backend.generate(
                    f"{req.rid}-{next(self._wire_ids)}",
                    req.input_ids + tokens,
                    g,
                    remaining,
                    max(0, g.min_new_tokens - len(tokens)),
                    images,
                    srv.adapter,
                    features,
                )
                deadline = self.config.request_timeout + self.config.token_timeout * remaining
                body = await self._inflight.run(srv, self._generate_call(srv, call), deadline)
            except ServerEvicted as e:  # frozen or dead, found by the health check: re-issue now
                attempt = self._count_failure(attempt, req.rid, str(e), "reissued")
                continue
            except RequestDeadline as e:  # request_timeout + token_timeout x tokens: try another server
                log.warning(
                    "request %s: %s (inference.request_timeout + token_timeout x %d); retrying", req.rid, e, remaining
                )
                with self._lock:
                    self._affinity.pop(req.rid, None)  # rebalanced: another server if one is less loaded
                attempt = self._count_failure(attempt, req.rid, str(e), "retried")
                continue
            except (*DEAD_ERRORS, httpx.TimeoutException, ServerError) as e:  # dead: evicted, re-issued elsewhere
                dead = isinstance(e, DEAD_ERRORS)
                if dead:
                    self.evict(srv, repr(e))
                attempt = self._count_failure(attempt, req.rid, repr(e), "reissued" if dead else "retried")
                await asyncio.sleep(min(0.05 * 2**attempt, 5.0) * (0.5 + random.random()))  # backoff, jittered
                continue
            finally:
                self._release(srv)
            part = self.backend.parse_generate(body)
            if part.tokens and not tokens:
                ttft = time.perf_counter() - t0
            v = part.weight_version if part.weight_version is not None and not adapter else sent_version
            tokens += part.tokens
            logps += part.logprobs
            routed = part.routed_experts  # the last call ran prompt + all output so far: its routing covers them
            versions += part.versions if part.versions is not None else [v] * len(part.tokens)
            if part.stop_reason == "abort":  # interrupted by a weight update: continue under the new weights
                self.counters["interrupted"] += 1
                await asyncio.sleep(0.01)
                continue
            stop = part.stop_reason
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=tokens,
            output_logprobs=logps,
            output_versions=versions,
            stop_reason=stop,
            latency=time.perf_counter() - t0,
            ttft=ttft,
            routed_experts=routed,
        )

    def _count_failure(self, attempt: int, rid: str, why: str, counter: str) -> int:
        """One more failed attempt (counted under ``counter``: retried or reissued); past
        ``max_retries`` the request fails."""
        self.counters[counter] += 1
        attempt += 1
        if attempt > self.config.max_retries:
            raise ConnectionError(f"request {rid} failed after {attempt} attempts: {why}")
        return attempt

    # ------------------------------------------------------------------ admin (sync, fanned out)
    def admin(self, srv: Server, call: Call, timeout: float | None = None, content: bytes | None = None) -> object:
        """``call`` to ``srv`` within ``timeout`` (default inference.request_timeout); a timeout is
        raised as the same httpx exception, its message naming the call and the setting. A JSON body is
        returned parsed, any other as ``{"text": body}`` (SGLang's ``/flush_cache`` answers plain text)."""
        timeout = timeout or self.config.request_timeout
        with naming_timeout(call, srv, timeout), self.http.sync(timeout) as c:
            r = c.request(
                call.method, srv.url + call.path, json=call.json if content is None else None, content=content
            )
        if r.status_code >= 400:
            raise AdminError(srv.url + call.path, r.status_code, r.text[:500])
        if not r.content:
            return {}
        try:
            return r.json()
        except ValueError:
            return {"text": r.text}

    def fan_out(self, fn: Callable[[Server], object], servers: list[Server]) -> None:
        """Run ``fn(server)`` on all servers at once; dead ones and those that time out (frozen) are
        evicted, other errors raised. A server evicted meanwhile (the health check) is not waited for."""
        errors: list[BaseException] = []

        def failed(s: Server, e: BaseException) -> None:
            if isinstance(e, (*DEAD_ERRORS, httpx.TimeoutException)):
                self.evict(
                    s, f"no answer to an admin call: {e!r} (inference.request_timeout={self.config.request_timeout}s)"
                )
            elif s.alive:
                errors.append(e)

        fan_out(fn, servers, failed)
        if errors:
            raise errors[0]

    def pause(self) -> None:
        self.fan_out(lambda s: self.admin(s, self.backend.pause()), [s for s in self.servers if s.alive])
        self.paused = True

    def resume(self) -> None:
        self.fan_out(lambda s: self.admin(s, self.backend.resume()), [s for s in self.servers if s.alive])
        self.paused = False

    # ------------------------------------------------------------------ health
    def _probe(self, srv: Server, record_version: bool = True) -> bool:
        """True when ``srv`` answers /health (and records its weight version when asked: not for a
        server in service, whose version only ``update_weights`` sets; a probe racing an update
        would write back the version from before it)."""
        try:
            with self.http.sync(self.config.health_timeout) as c:
                r = c.get(srv.url + (srv.info.live_path if srv.info is not None else "/health"))
                if r.status_code != 200:
                    return False
                path = srv.info.version_path if srv.info is not None else None
                if record_version:  # -1: unknown (no version route, or none set yet): it is given the weights on return
                    v = self.backend.parse_version(c.get(srv.url + path).json()) if path is not None else None
                    srv.version = v if v is not None else -1
            return True
        except (httpx.HTTPError, ValueError):
            return False

    def _health_loop(self) -> None:
        while not self._stop.wait(self.config.health_interval):
            for srv in list(self.servers):
                if srv.updating and not self.backend.answers_while_loading:  # SGLang blocks while loading weights
                    continue
                ok = self._probe(srv, record_version=not srv.alive)
                if srv.alive and not ok:
                    self.evict(srv, "health check failed")
                elif not srv.alive and ok:
                    self._readmit(srv)

    def _readmit(self, srv: Server) -> None:
        with self._update_lock:
            try:
                srv.info = self.backend.detect(srv.url, self._get(srv))  # it may be a new release
                if not self.accepts_adapters and self._mode_set():
                    self._sync(self._sync_mode()).connect(srv)
                if srv.version == -1 and self._last is None and self._version == 0:
                    srv.version = 0  # no update yet: its start-up weights are the engine's
                if srv.version != self._version:
                    if self._last is None:  # stale weights and nothing to push: keep it out
                        log.warning(
                            "server %s is back at weight version %d (engine at %d) and no weights are "
                            "known to push; not re-admitted",
                            srv.url,
                            srv.version,
                            self._version,
                        )
                        return
                    sync, data = self._last
                    sync.rejoin(srv, data, self._version)
            except (httpx.HTTPError, RuntimeError, ConnectionError, ValueError) as e:
                log.warning("server %s answered but could not take weights v%d: %s", srv.url, self._version, e)
                return
            with self._lock:
                srv.alive = True
                self.counters["readmissions"] += 1
            log.warning("server %s re-admitted at weight version %d", srv.url, srv.version)

    # ------------------------------------------------------------------ weights
    def update_weights(self, update: WeightUpdate) -> None:
        """Every live server loads ``update``. When none confirms it (every server died, before or
        during the update), these become the weights a returning server is given, and the update
        waits for one for up to ``server_wait_timeout`` seconds (then ``Stalled``)."""
        with self._update_lock:
            sync = self._sync_for(update)
            data = sync.prepare(update)
            live = [s for s in self.servers if s.alive]
            for s in self.servers:
                s.updating = True
            try:
                if live:
                    sync.send(data, update.version, live)
            except (ConnectionError, *DEAD_ERRORS) as e:  # the last servers died mid-way (evicted)
                log.warning("weight update v%d: %r; waiting for a server to come back", update.version, e)
            finally:
                for s in self.servers:
                    s.updating = False
            self._version = update.version
            self._last = (sync, data)
        since = time.monotonic()
        while not any(s.alive and s.version == update.version for s in self.servers):
            self._inflight.check_wait(
                self.servers, f"weight update v{update.version}", since, self.config.server_wait_timeout
            )
            time.sleep(min(0.2, self.config.server_wait_timeout / 10))

    def _sync_for(self, update: WeightUpdate) -> WeightSync:
        if update.kind == "adapter":
            if self._adapters is None:
                raise ValueError("WeightUpdate(kind='adapter') needs model.lora.sync=adapter and SGLang / vLLM servers")
            return self._adapters
        return self._sync("disk" if update.kind == "disk" else self._sync_mode())

    def _sync(self, mode: str) -> WeightSync:
        if mode not in self._syncs:
            self._syncs[mode] = self.backend.weight_sync(self, mode)
        return self._syncs[mode]

    def _mode_set(self) -> bool:
        """Whether the run names its weight sync (then servers are checked for it at connect)."""
        return self.config.weight_sync != "auto" or bool(self.config.weight_sync_dir)

    def _sync_mode(self) -> str:
        """inference.weight_sync resolved (auto: disk with a weight_sync_dir, else an HTTP upload)."""
        mode = self.config.weight_sync
        if mode == "auto":
            mode = "disk" if self.config.weight_sync_dir else "http"
        if mode == "disk" and not self.config.weight_sync_dir:
            raise ValueError(
                "inference.weight_sync=disk needs inference.weight_sync_dir (a directory all servers can read)"
            )
        if mode == "http" and not self.backend.supports_upload:
            raise ValueError(
                f"{self.backend.name} servers take no HTTP upload: set inference.weight_sync=disk and weight_sync_dir"
            )
        return mode
