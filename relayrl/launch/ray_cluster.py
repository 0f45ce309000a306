"""``launcher=ray``: ``relayrl train`` with its trainer ranks and inference servers as Ray actors.

``RayRun(cfg)`` (``run_on_ray`` is start, wait, close):

1. joins ``ray.address`` (checked to answer first: Ray itself retries for minutes), the
   cluster of ``RAY_ADDRESS`` (``ray job submit``), or a new local instance; a process that is
   already connected keeps its connection;
2. checks the cluster can hold one bundle per trainer rank and per server, naming what is
   missing, then places them as one placement group (``ray.strategy``), failing after
   ``ray.placement_timeout`` rather than waiting forever;
3. starts ``inference.n_servers`` server actors (``relayrl serve``, or SGLang / vLLM for
   ``inference.launch=sglang|vllm``), each serving on a port fixed at its first start,
   so that one Ray restarts (``ray.server_max_restarts``) comes back at the same address and
   RemoteEngine's health loop re-admits it; their addresses become ``inference.addresses``;
4. starts the trainer ranks: rank 0's node and a free port there are the torch.distributed
   rendezvous (gloo on CPU, NCCL on GPUs), and every rank runs the ordinary ``train(cfg)``;
5. waits. A rank that dies stops the run: the other ranks are killed (they would wait in a
   collective), and ``TrainerRankDied`` says the checkpoints are intact and ``recover=auto``
   resumes (checkpoints are only ever committed whole, so a kill mid-save leaves the last one).

The run directory is written by rank 0 and read by every rank when resuming: on several nodes
it must be on a shared filesystem, as with multi-node torchrun.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import secrets
import signal
import socket
from dataclasses import replace
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from relayrl.api.config import RayConfig, RunConfig
from relayrl.inference.remote.relayrl import serve_overrides
from relayrl.launch import RayLaunchError, TrainerRankDied
from relayrl.launch.ray_actors import ServerActor, TrainerRank, node_port
from relayrl.utils.checkpoint import CheckpointManager
from relayrl.utils.interrupt import Interrupted
from relayrl.utils.logging import get_logger

log = get_logger("launch")
_node_port = ray.remote(num_cpus=0)(node_port)


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}


def connect(rc: RayConfig) -> bool:
    """Join the cluster ``rc`` names; True when this call connected (and ``close`` disconnects)."""
    if ray.is_initialized():
        return False
    address = rc.address or os.environ.get("RAY_ADDRESS", "")
    if address and address != "auto":
        hostport = address.split("://", 1)[-1].rstrip("/")
        host, _, port = hostport.rpartition(":")
        try:
            socket.create_connection((host or hostport, int(port or 6379)), timeout=5.0).close()
        except (OSError, ValueError) as e:
            raise RayLaunchError(f"ray.address={address}: no Ray cluster answers there ({e})") from None
    log.info(
        "set-up: %s Ray (about a minute on a small machine)", f"joining {address}" if address else "starting a local"
    )
    # a new instance is "local", not None: Ray would otherwise join whatever /tmp/ray/ray_current_cluster
    # names, a file a crashed `ray start` or test cluster leaves behind, and refuse num_cpus for it
    new: dict[str, Any] = {} if address else {"num_cpus": rc.num_cpus or None, "include_dashboard": False}
    try:
        ray.init(address=address or "local", logging_level=logging.ERROR, **new)
    except ConnectionError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RayLaunchError(f"ray.address={address}: {first}") from None
    return True


def check_resources(cfg: RunConfig, n_servers: int) -> None:
    """Fail now, naming what is missing, when the cluster cannot hold the run's bundles."""
    r = cfg.ray
    total = ray.cluster_resources()
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    missing, needs = [], {}
    for res, key in (("CPU", "cpus"), ("GPU", "gpus")):
        per_rank, per_server = getattr(r, f"trainer_{key}"), getattr(r, f"server_{key}")
        needs[res] = need = r.trainer_ranks * per_rank + n_servers * per_server
        if need > total.get(res, 0.0) + 1e-9:
            missing.append(
                f"{need:g} {res} (ray.trainer_ranks={r.trainer_ranks} x ray.trainer_{key}={per_rank:g} + "
                f"inference.n_servers={n_servers} x ray.server_{key}={per_server:g}) but the cluster has "
                f"{total.get(res, 0.0):g}"
            )
    if not missing:  # each bundle must fit on one node (all of them on one for STRICT_PACK)
        kinds = [("a trainer rank", _bundle(r.trainer_cpus, r.trainer_gpus))]
        kinds += [("a server", _bundle(r.server_cpus, r.server_gpus))] if n_servers else []
        if r.strategy == "STRICT_PACK":
            kinds = [("the whole run (ray.strategy=STRICT_PACK)", _bundle(needs["CPU"], needs["GPU"]))]
        for what, bundle in kinds:
            if not any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items()) for node in nodes):
                missing.append(f"{bundle} for {what} on one node, and no node has it")
        if r.strategy == "STRICT_SPREAD" and r.trainer_ranks + n_servers > len(nodes):
            missing.append(f"{r.trainer_ranks + n_servers} nodes (ray.strategy=STRICT_SPREAD) but it has {len(nodes)}")
    if missing:
        raise RayLaunchError("ray: the cluster cannot hold this run: it needs " + "; ".join(missing))


class RayRun:
    """One ``relayrl train`` on Ray: ``start()``, ``wait()`` (the driver rank's last metrics), ``close()``."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = copy.deepcopy(cfg)
        inf = cfg.inference
        launches = inf.backend == "remote" and not inf.addresses and inf.launch != "none"
        self.n_servers = inf.n_servers if launches else 0
        self.token = inf.admin_token or os.environ.get("RELAYRL_ADMIN_TOKEN", "") or secrets.token_hex(16)
        self.pg: PlacementGroup | None = None
        self.servers: list[ray.actor.ActorHandle] = []
        self.ranks: list[ray.actor.ActorHandle] = []
        self.refs: list[ray.ObjectRef] = []
        self.rank_nodes: list[str] = []  # Ray node id of each trainer rank
        self.rank_pids: list[int] = []
        self._owns_connection = False

    def _in_bundle(self, i: int) -> PlacementGroupSchedulingStrategy:
        assert self.pg is not None, "place() first"
        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=i)

    def start(self) -> None:
        """Place the bundles, start the servers and the trainer ranks (which begin training)."""
        self.place()
        r = self.cfg.ray
        rank = ray.remote(TrainerRank)
        options = {"num_cpus": r.trainer_cpus, "num_gpus": r.trainer_gpus, "max_restarts": 0}
        self.ranks = [  # their processes start (and import the trainer) while the servers boot
            rank.options(**options, scheduling_strategy=self._in_bundle(i)).remote()  # type: ignore[misc]
            for i in range(r.trainer_ranks)
        ]
        self.start_servers()
        where: list[tuple[str, int, str, int]] = ray.get([a.where.remote() for a in self.ranks])
        self.rank_nodes, self.rank_pids = [w[2] for w in where], [w[3] for w in where]
        master = where[0][:2]
        log.info("ray: %d trainer ranks, rendezvous at %s:%d", r.trainer_ranks, *master)
        self.refs = [a.run.remote(self.cfg, i, r.trainer_ranks, master, self.token) for i, a in enumerate(self.ranks)]

    def place(self) -> None:
        """Connect, check the cluster's resources, and place the placement group (or fail, in one line)."""
        r = self.cfg.ray
        self._owns_connection = connect(r)
        check_resources(self.cfg, self.n_servers)
        bundles = [_bundle(r.trainer_cpus, r.trainer_gpus)] * r.trainer_ranks
        bundles += [_bundle(r.server_cpus, r.server_gpus)] * self.n_servers
        if not all(bundles):
            raise RayLaunchError("ray: a trainer rank or server reserves nothing: set ray.*_cpus or ray.*_gpus above 0")
        self.pg = placement_group(bundles, strategy=r.strategy)
        try:
            ray.get(self.pg.ready(), timeout=r.placement_timeout)
        except GetTimeoutError:
            raise RayLaunchError(
                f"ray: {len(bundles)} bundles {bundles} (ray.strategy={r.strategy}) were not placed within "
                f"ray.placement_timeout={r.placement_timeout:g}s; free now: {ray.available_resources()}"
            ) from None

    def start_servers(self) -> None:
        """The ``n_servers`` server actors, healthy; their addresses become ``cfg.inference.addresses``."""
        r, cfg = self.cfg.ray, self.cfg
        if not self.n_servers:
            return
        inf = cfg.inference
        args = serve_overrides(inf, cfg.model)
        server = ray.remote(ServerActor)
        for i in range(self.n_servers):
            # SGLang / vLLM: one server per actor, its GPUs from Ray, its log in a directory of its own
            logs = os.path.join(inf.launch_log_dir, f"ray-server-{i}") if inf.launch_log_dir else ""
            one = replace(inf, n_servers=1, launch_gpus=[], launch_log_dir=logs)
            peer = None if inf.launch == "relayrl" else (inf.launch, one, cfg.model)
            where = self._in_bundle(r.trainer_ranks + i)
            _, port = ray.get(_node_port.options(scheduling_strategy=where).remote())
            options = {"num_cpus": r.server_cpus, "num_gpus": r.server_gpus, "max_restarts": r.server_max_restarts}
            self.servers.append(
                server.options(**options, scheduling_strategy=where).remote(  # type: ignore[arg-type]
                    args, self.token, port, inf.launch_timeout, peer
                )
            )
        try:
            cfg.inference.addresses = ray.get([s.address.remote() for s in self.servers])
        except RayActorError as e:  # its __init__ raised: the error is the last line that names one
            why = [line for line in str(e).splitlines() if re.match(r"[\w.]*(Error|Exception): ", line)]
            raise RayLaunchError(f"ray: a server actor did not start: {why[-1] if why else e}") from None
        log.info("ray: servers at %s", cfg.inference.addresses)

    def wait(self) -> dict[str, float]:
        """Rank 0's last metrics once every rank is done; the first failure stops the run."""
        pending = list(self.refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except RayError:
                self._fail()
        return ray.get(self.refs[0])

    def _fail(self) -> None:
        """Report the root cause: a dead rank before the lost-peer errors of the ranks that survived it."""
        ray.wait(self.refs, num_returns=len(self.refs), timeout=5.0)
        errors: list[tuple[int, RayError]] = []
        for i, ref in enumerate(self.refs):
            try:
                ray.get(ref, timeout=0)
            except RayError as e:  # GetTimeoutError: still running (blocked in a collective)
                if not isinstance(e, GetTimeoutError):
                    errors.append((i, e))
        dead = [(i, e) for i, e in errors if isinstance(e, RayActorError)]
        if dead:
            i, death = dead[0]
            reason = str(death).strip().splitlines()[0] if str(death).strip() else type(death).__name__
            ckpts = os.path.join(self.cfg.run_dir, "checkpoints")
            raise TrainerRankDied(
                f"trainer rank {i} died ({reason}); the run stopped with its checkpoints intact in {ckpts}: "
                "run the same command with recover=auto to resume"
            )
        first = errors[0][1]
        if isinstance(first, RayTaskError) and isinstance(first.cause, Exception):
            raise first.cause  # the trainer's own error (ConfigError, NonFiniteError, ...), as in one process
        raise first

    def close(self) -> None:
        """Kill the ranks and servers, free the placement group; disconnect if ``start`` connected."""
        if not ray.is_initialized():
            return
        for actor in [*self.ranks, *self.servers]:
            ray.kill(actor, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)
        self.ranks, self.servers, self.pg = [], [], None
        if self._owns_connection:
            ray.shutdown()


def run_on_ray(cfg: RunConfig) -> dict[str, float]:
    """``relayrl train ... launcher=ray``: the run on Ray; returns the driver rank's last metrics."""
    run = RayRun(cfg)
    try:
        run.start()
        return run.wait()
    except KeyboardInterrupt as e:  # the driver took Ctrl-C / SIGTERM; close() kills the ranks mid-step
        latest = CheckpointManager(cfg.run_dir, cfg.checkpoint).latest()
        where = "during training; nothing saved at the interrupt" + (
            f"; latest checkpoint {latest}; continue from it with: relayrl train {cfg.run_dir}/config.yaml --recover"
            if latest is not None
            else " and no checkpoint written yet"
        )
        raise Interrupted(getattr(e, "signum", signal.SIGINT), where=where) from None
    finally:
        run.close()
