"""Real SGLang and vLLM servers for the real-peer tests: processes started from the venvs that
``scripts/peers.sh`` builds (pins in ``scripts/peers.env``), on 127.0.0.1, serving a tiny model
saved to disk, each in a process group of its own (killed whole: no stray engine processes).

Under ``CI=true`` a missing peer env fails the test; elsewhere it skips, naming scripts/peers.sh."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from relayrl.api.io import GenerationConfig, ModelRequest, ModelResponse, WeightUpdate
from relayrl.inference.remote import RemoteEngine
from relayrl.utils.deadline import Stalled

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5  # fp32 server vs fp32 teacher-forced forward


def pins() -> dict[str, str]:
    """``scripts/peers.env``: the peer versions relayrl is tested against."""
    out = {}
    for line in (ROOT / "scripts" / "peers.env").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def peer_env(kind: str) -> Path:
    """The venv of peer ``kind`` (``sglang`` / ``vllm``) built by scripts/peers.sh, else fail (CI) or skip."""
    version = pins()[f"{kind.upper()}_VERSION"]
    root = Path(os.environ.get("RELAYRL_PEERS_DIR") or Path.home() / ".cache" / "relayrl-peers")
    env = root / f"{kind}-{version}"
    if not (env / ".relayrl-peer").is_file():
        why = f"real {kind} {version} not built in {env}: run `bash scripts/peers.sh` (about 3 minutes, once)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)
        pytest.skip(why)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_command(env: Path, model: Path, port: int, *extra: str) -> list[str]:
    """``vllm serve`` on CPU in fp32 with the logprobs relayrl needs (the flags docs/sglang_vllm.md gives)."""
    return [str(env / "bin" / "vllm"), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--logprobs-mode", "processed_logprobs", "--enforce-eager",
            "--max-model-len", "1024", *extra]  # fmt: skip


SGLANG_CPU = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
              "--mem-fraction-static", "0.3", "--max-total-tokens", "8192"]  # fmt: skip


def sglang_command(env: Path, model: Path, port: int, *extra: str) -> list[str]:
    """``python -m sglang.launch_server`` on CPU (through the env's ``sglang-cpu`` wrapper: libcuda stub)."""
    return [str(env / "bin" / "sglang-cpu"), "--model-path", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", *SGLANG_CPU, *extra]  # fmt: skip


def peer_environ(**extra: str) -> dict[str, str]:
    """The environment of a peer server: vLLM's RL routes, 1 GiB of CPU KV cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


class RealServer:
    """One server process (group): ``start()`` waits for ``/health``; ``kill9()``; ``restart(cmd)``; ``stop()``."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path, timeout: float = 300) -> None:
        self.name, self.cmd, self.env, self.log, self.timeout = name, cmd, env, log, timeout
        self.port = int(cmd[cmd.index("--port") + 1])
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s = 0.0

    def start(self) -> RealServer:
        t0 = time.monotonic()
        with open(self.log, "ab") as out:
            out.write(f"$ {' '.join(self.cmd)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)  # fmt: skip
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; {self.log} ends:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > self.timeout:
                self.stop()
                raise TimeoutError(
                    f"{self.name} not healthy after {self.timeout:.0f}s; {self.log} ends:\n{self.tail()}"
                )
            time.sleep(0.5)
        self.startup_s = time.monotonic() - t0
        return self

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def group_pids(self, name: bytes) -> list[int]:
        """The processes of the server's group whose command line holds ``name`` (vLLM's engine core retitles
        itself ``VLLM::EngineCore``)."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or self.proc is None:
                continue
            try:
                if os.getpgid(int(entry)) == self.proc.pid and name in Path(f"/proc/{entry}/cmdline").read_bytes():
                    pids.append(int(entry))
            except (ProcessLookupError, FileNotFoundError, PermissionError):  # gone between the listing and the look
                pass
        return pids

    def kill9(self) -> None:
        """SIGKILL to the whole process group (the server and its engine processes), as a machine loss."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)
        self._wait_port_free()

    def _wait_port_free(self) -> None:
        for _ in range(100):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", self.port))
                    return
                except OSError:
                    time.sleep(0.1)

    def restart(self, cmd: list[str] | None = None) -> RealServer:
        self.kill9()
        self.cmd = cmd or self.cmd
        return self.start()

    def stop(self) -> None:
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._signal(signal.SIGKILL)  # the group: engine processes left behind by the server's own exit
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


def teacher_forced(model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """The logprob of each of ``tokens`` after ``prompt`` under ``model`` at ``temperature`` (one fp32 forward)."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, -1)
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)]


def prompts(k: int) -> list[list[int]]:
    """``k`` distinct short prompts of the tiny tokenizer's ids."""
    return [[3, 10 + i, 20 + 2 * i, 30, 11 + i] for i in range(k)]


def run(eng: RemoteEngine, reqs: list[tuple[list[int], GenerationConfig]], prefix: str = "r") -> list[ModelResponse]:
    """Generate every (prompt, config) at once through ``eng``; the responses in order."""

    async def go() -> list[ModelResponse]:
        return await asyncio.gather(
            *(eng.agenerate(ModelRequest(f"{prefix}{i}", p, g)) for i, (p, g) in enumerate(reqs))
        )

    return asyncio.run(go())


def gap(model: torch.nn.Module, out: ModelResponse, temperature: float) -> float:
    """The largest |server logprob - teacher-forced logprob| over ``out``'s tokens."""
    ref = teacher_forced(model, out.input_tokens, out.output_tokens, temperature)
    return float((ref - torch.tensor(out.output_logprobs)).abs().max())


def in_flight(eng: RemoteEngine, n: int, after_s: float = 0.1, sender: threading.Thread | None = None) -> None:
    """Wait until ``n`` requests are in flight on ``eng``'s servers, then ``after_s`` more (tokens being generated).
    With ``sender`` (the thread sending them), also return once it has finished: its requests came and went
    between two looks (a test that tries again then does; waiting on would only hit the deadline)."""
    deadline = time.monotonic() + 60
    while sum(s.in_flight for s in eng.servers) < n:
        if sender is not None and not sender.is_alive():
            return
        assert time.monotonic() < deadline, "the requests never reached the server"
        time.sleep(0.005)
    time.sleep(after_s)


FREEZE = {"health_timeout": 5.0, "server_wait_timeout": 10.0}  # engine settings of the freeze check


def check_freeze_mid_generation(server: RealServer, eng: RemoteEngine, n_tokens: int) -> float:
    """The server's whole process group SIGSTOPped (it accepts connections and never answers) while two
    long requests generate, on an engine built with ``FREEZE``: the health check evicts it, the requests
    end with ``Stalled`` (one line naming the server and the setting) once ``server_wait_timeout`` has
    passed with no server in service, never hung; SIGCONT: the server is re-admitted and generates
    again. Returns the seconds from the freeze to the error."""
    g = GenerationConfig(max_new_tokens=n_tokens, temperature=1.0, ignore_eos=True)
    errors: list[BaseException] = []
    results: list[ModelResponse] = []

    def send() -> None:
        try:
            results.extend(run(eng, [(p, g) for p in prompts(2)], prefix="frozen"))
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    for _attempt in range(3):
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        in_flight(eng, 2, sender=sender)
        server._signal(signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            sender.join(timeout=180)
            took = time.monotonic() - t0
            assert not sender.is_alive(), "the requests on the frozen server hung"
        finally:
            server._signal(signal.SIGCONT)
        if errors:
            break
        # No error: the server had answered both before the stop took hold (a loaded machine delays the
        # signal and the look at the requests; seen once in CI). A stopped server cannot have written
        # every token, so check that, wait until it is in service again, and freeze it anew.
        assert [len(o.output_tokens) for o in results] == [n_tokens] * 2, "a short answer taken for a finished one"
        results.clear()
        deadline = time.monotonic() + 120
        while not eng.live_servers():
            assert time.monotonic() < deadline, "the server was never back in service"
            time.sleep(0.2)
    else:
        pytest.fail("three times the requests were answered before the freeze took hold")
    assert len(errors) == 1 and isinstance(errors[0], Stalled), errors
    msg = str(errors[0])
    assert "\n" not in msg and server.url in msg and "inference.server_wait_timeout" in msg, msg
    deadline = time.monotonic() + 120
    while not eng.live_servers():  # thawed: the health check re-admits it
        assert time.monotonic() < deadline, "the thawed server was never re-admitted"
        time.sleep(0.2)
    out = run(eng, [(prompts(1)[0], GenerationConfig(max_new_tokens=4, temperature=1.0, ignore_eos=True))], "thawed")
    assert len(out[0].output_tokens) == 4
    return took


# ... and of the update freeze: the load call's deadline; the frozen server never comes back in time, so 5 s of wait
FREEZE_UPDATE = {**FREEZE, "request_timeout": 5.0, "server_wait_timeout": 5.0}


def check_freeze_during_update(server: RealServer, eng: RemoteEngine, new: torch.nn.Module, path: str) -> float:
    """The server's whole process group SIGSTOPped as the weight update sends it the call to ``path`` (the disk
    load, or a broadcast's bucket: the server frozen mid-update, the new weights on their way), on an engine
    built with ``FREEZE_UPDATE``: the call gets no answer within ``request_timeout``, the server is evicted, and
    the update, with no server in service, ends with ``Stalled`` (one line naming the server and the setting)
    once ``server_wait_timeout`` has passed, never hung; SIGCONT: the health check re-admits the server and it
    generates with the new weights, every token tagged with their version. Returns the seconds from the freeze
    to the error."""
    frozen_at: list[float] = []
    real_admin = eng.admin

    def admin(srv, call, timeout=None, content=None):  # noqa: ANN001, ANN202 - RemoteEngine.admin's signature
        if call.path.startswith(path) and not frozen_at:
            server._signal(signal.SIGSTOP)
            frozen_at.append(time.monotonic())
        return real_admin(srv, call, timeout, content)

    version = eng.get_version() + 1
    eng.admin = admin  # type: ignore[method-assign]
    try:
        with pytest.raises(Stalled) as stalled:
            eng.update_weights(WeightUpdate(kind="tensors", version=version, tensors=new.state_dict()))
        took = time.monotonic() - frozen_at[0]
    finally:
        server._signal(signal.SIGCONT)
        del eng.admin
    msg = str(stalled.value)
    assert "\n" not in msg and server.url in msg and "inference.server_wait_timeout" in msg, msg
    deadline = time.monotonic() + 120
    while not eng.live_servers():  # thawed: the health check re-admits it, with the new weights
        assert time.monotonic() < deadline, (
            f"the thawed server was never re-admitted; {server.log} ends:\n{server.tail()}"
        )
        time.sleep(0.2)
    g = GenerationConfig(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    out = run(eng, [(prompts(1)[0], g)], "thawed")[0]
    assert gap(new, out, 1.0) <= TOL and out.output_versions == [version] * 8
    return took


def check_versions(results: list[ModelResponse], models: dict[int, torch.nn.Module], n: int) -> None:
    """Every token's logprob is that of the weights its version names (teacher-forced on its prefix: one
    causal forward of the whole sequence per version gives every prefix's)."""
    for o in results:
        v = o.output_versions
        assert v == sorted(v) and set(v) <= set(models) and len(v) == n
        for version in set(v):
            want = teacher_forced(models[version], o.input_tokens, o.output_tokens, 1.0)
            for i in (i for i, x in enumerate(v) if x == version):
                assert abs(float(want[i]) - o.output_logprobs[i]) <= TOL, (i, version)
    assert any(len(set(o.output_versions)) > 1 for o in results)


def check_teacher_server(url: str, protocol: str, model: torch.nn.Module) -> None:
    """Distillation's served teacher (``actor.teacher.url``): the server's top-5 logprobs of each row's
    positions are a teacher-forced forward's top 5 (the same ids, logprobs within 1e-4), zeros at each
    row's first token and padding; at temperature 0.5 the logprobs are the server's over 0.5."""
    from relayrl.train.teacher_server import server_teacher_targets

    rows = [p + [40 + i, 41, 42 + 2 * i] * (i + 1) for i, p in enumerate(prompts(3))]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.bool)
    got = server_teacher_targets({"input_ids": ids, "attention_mask": mask}, url, protocol, 5, 1.0)
    for i, r in enumerate(rows):
        with torch.inference_mode():
            logp = torch.log_softmax(model(torch.tensor([r])).logits[0].float(), -1)
        n, dist = len(r), logp[:-1]  # position t + 1 is drawn from the distribution after token t
        served_ids, served = got["teacher_ids"][i, 1:n], got["teacher_logp"][i, 1:n]
        assert (dist.gather(-1, served_ids) - served).abs().max() <= 1e-4  # each id's own logprob (ties: any order)
        assert (dist.topk(5, -1).values - served).abs().max() <= 1e-4  # and they are the top 5
        assert not got["teacher_logp"][i, 0].any() and not got["teacher_logp"][i, n:].any()
    half = server_teacher_targets({"input_ids": ids, "attention_mask": mask}, url, protocol, 5, 0.5)
    assert torch.allclose(half["teacher_logp"], got["teacher_logp"] / 0.5)
