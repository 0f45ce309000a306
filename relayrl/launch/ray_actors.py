"""The two Ray actors of ``launcher=ray``: one trainer rank, one inference server.

Both run relayrl's ordinary parts: a ``TrainerRank`` joins the torch.distributed group with the
environment torchrun would give it and calls ``relayrl.trainer.train``; a ``ServerActor`` runs
one ``relayrl serve`` process on its node (the launcher's machinery: the process dies with the
actor) and dies with it, so that Ray restarts both on the same port.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

import ray

from relayrl.inference.remote.adapters import adapter_mode
from relayrl.inference.remote.launch import PeerServerGroup
from relayrl.inference.remote.peers import make_backend
from relayrl.inference.server.launcher import ServerGroup

if TYPE_CHECKING:  # server actors stay light (the trainer ranks import the trainer when they run)
    from relayrl.api.config import InferenceConfig, ModelConfig, RunConfig


def node_port() -> tuple[str, int]:
    """This node's IP address and a TCP port free on it now."""
    import socket

    ip = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return ip, int(s.getsockname()[1])


class TrainerRank:
    """One rank of the trainer: ``train(cfg)`` with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set."""

    def __init__(self) -> None:
        import relayrl.trainer  # noqa: F401  # the slow imports, while the servers start

    def where(self) -> tuple[str, int, str, int]:
        """(node IP, a free port there, Ray node id, process id): rank 0's IP and port are the
        group's rendezvous. Asked before ``run``, which keeps the actor busy until the end."""
        ip, port = node_port()
        return ip, port, ray.get_runtime_context().get_node_id(), os.getpid()

    def run(self, cfg: RunConfig, rank: int, world: int, master: tuple[str, int], token: str) -> dict[str, float]:
        # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES: the local device is always 0
        os.environ.update(
            RELAYRL_ADMIN_TOKEN=token,  # the servers' admin token: RemoteEngine reads it here
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
        )
        from relayrl.trainer import train

        return train(cfg)


class ServerActor:
    """One server on this actor's node at ``port``: ``relayrl serve`` (``args`` are its overrides), or
    SGLang / vLLM when ``peer`` = (kind, InferenceConfig, model) says so (the peer module's command
    line and flags, GPUs from Ray). The actor exits when its server does."""

    def __init__(
        self,
        args: list[str],
        token: str,
        port: int,
        startup_timeout: float,
        peer: tuple[str, InferenceConfig, ModelConfig] | None = None,
    ) -> None:
        host = ray.util.get_node_ip_address()
        self.group: ServerGroup | PeerServerGroup
        if peer is not None:
            kind, inf, model = peer
            backend = make_backend(kind)  # the flags RemoteEngine's own launch would give: dtype, LoRA
            lora = model.lora if adapter_mode(model.lora, inf, backend) else None
            group = PeerServerGroup(backend, inf, model.path, host=host, lora=lora, dtype=model.dtype, token=token)
            self.group = group.start(ports=[port])
        else:
            env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
            if token:  # in the environment, never on a command line
                env["RELAYRL_ADMIN_TOKEN"] = token
            self.group = ServerGroup([*args, f"host={host}"], env, startup_timeout)
            self.group.start(1, ports=[port])
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        self.group.procs[0].wait()
        os._exit(1)  # the server died: so does the actor, and Ray restarts both

    def address(self) -> str:
        return self.group.addresses[0]

    def pids(self) -> tuple[int, int]:
        """(actor process, server process)."""
        return os.getpid(), self.group.procs[0].pid
