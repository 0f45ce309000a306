"""LoRA adapters to SGLang / vLLM servers (``model.lora.sync=adapter``), against the peer stand-ins
(real processes on 127.0.0.1, ``tests/peers/``): after a training step every server serves the
trainer's adapter, loaded as ``relayrl-<run>-v<version>``, generating what the merged model generates
(the stand-ins merge with peft itself), with the version tagged; the adapter it replaces is
unloaded. Plus the request shapes of each peer and the launch flags."""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import httpx
import pytest
from peft import PeftModel

from relayrl.api.config import InferenceConfig, LoraConfig, ModelConfig
from relayrl.api.io import GenerationConfig
from relayrl.inference.remote import RemoteEngine, sglang, vllm
from relayrl.inference.remote.adapters import adapters_kept
from relayrl.inference.remote.protocol import Server, UnsupportedServer, require_lora
from relayrl.inference.remote.sglang import SGLangBackend
from relayrl.inference.remote.vllm import VLLMBackend
from tests.test_lora import RANK, lora_engine
from tests.test_packing import make_batch
from tests.test_remote import greedy, prompts, reference, run_all
from tests.test_train_engine import LENGTHS, n_loss_tokens, pg_loss

sys.path.insert(0, str(Path(__file__).parent))
from peers import Peer  # noqa: E402

PEERS = Path(__file__).parent / "peers"


def launched(protocol: str, tmp_path: Path) -> RemoteEngine:
    """One stand-in started by RemoteEngine itself (``inference.launch``): the LoRA flags and
    environment are the launcher's."""
    cfg = InferenceConfig(
        backend="remote",
        protocol=protocol,
        launch=protocol,
        n_servers=1,
        launch_command=f"{sys.executable} {PEERS / f'{protocol}_server.py'}",
        launch_log_dir=str(tmp_path / "logs"),
        weight_sync_dir=str(tmp_path / "w"),
        health_interval=0.2,
    )
    eng = RemoteEngine(cfg, model=ModelConfig(path="tiny", lora=LoraConfig(rank=RANK)))
    eng.initialize()
    return eng


def remote(protocol: str, address: str, sync_dir: Path, sync: str = "auto") -> RemoteEngine:
    cfg = InferenceConfig(backend="remote", protocol=protocol, weight_sync_dir=str(sync_dir), health_interval=0.2)
    eng = RemoteEngine(cfg, addresses=[address], model=ModelConfig(lora=LoraConfig(rank=RANK, sync=sync)))
    eng.initialize()
    return eng


def check_serves(remote_eng, trainer, ps, g, version, prefix):
    """The servers generate what the trainer's merged model generates, tagged ``version``."""
    merged = copy.deepcopy(trainer.model).merge_and_unload()
    for out, ref in zip(run_all(remote_eng, ps, g, prefix=prefix), reference(merged, ps, g), strict=True):
        assert out.output_tokens == ref.output_tokens
        assert out.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-4)
        assert out.output_versions == [version] * len(ref.output_tokens)


@pytest.mark.parametrize("peer", ["sglang", "vllm"])
def test_adapters_reach_the_server_under_a_versioned_name(peer, tiny_model, tmp_path):
    trainer = lora_engine(tiny_model, lr=3e-2)
    eng = launched(peer, tmp_path)
    try:
        assert eng.accepts_adapters  # auto: SGLang / vLLM that load adapters, with a shared dir
        url = f"http://{eng.addresses[0]}"
        argv = " ".join(httpx.get(url + "/stand_in", timeout=10).json()["argv"])
        assert f"--enable-lora --max-lora-rank {RANK}" in argv
        ps, g = prompts(6), greedy(6)
        base = [o.output_tokens for o in run_all(eng, ps, g, prefix="base")]
        assert base == [o.output_tokens for o in reference(tiny_model, ps, g)]  # version 0: the base
        trainer.train_batch(make_batch(LENGTHS, seed=2), pg_loss, n_loss_tokens)
        trainer.set_version(3)
        trainer.update_weights(eng)
        assert eng.get_version() == 3
        (saved,) = (tmp_path / "w").glob("relayrl-*-v3")  # the adapter as peft saves it, named per run
        assert json.loads((saved / "adapter_config.json").read_text())["r"] == RANK
        served = PeftModel.from_pretrained(copy.deepcopy(tiny_model), str(saved)).merge_and_unload()
        assert [o.output_tokens for o in reference(served, ps, g)] != base  # the adapter changes generations
        check_serves(eng, trainer, ps, g, 3, "v3-")

        trainer.train_batch(make_batch(LENGTHS, seed=3), pg_loss, n_loss_tokens)
        trainer.set_version(4)
        trainer.update_weights(eng)
        check_serves(eng, trainer, ps, g, 4, "v4-")
        # the adapter it replaced is gone from the server
        old = (SGLangBackend() if peer == "sglang" else VLLMBackend("tiny")).generate(
            "x", ps[0], g, 2, 0, adapter=saved.name
        )
        r = httpx.post(url + old.path, json=old.json, timeout=30)
        assert r.status_code == (400 if peer == "sglang" else 404) and saved.name in r.text
        if peer == "sglang":  # a server that comes back (restarted: no adapter) is given the current one
            eng._launched.procs[0].kill()  # type: ignore[union-attr]
            port = int(eng.addresses[0].rsplit(":", 1)[1])
            back = Peer("sglang", ["--enable-lora", "--max-lora-rank", str(RANK)]).start(port=port)
            try:
                deadline = time.monotonic() + 60
                while eng.counters["readmissions"] < 1 and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert eng.counters["evictions"] == 1 and eng.counters["readmissions"] == 1
                check_serves(eng, trainer, ps, g, 4, "back-")
            finally:
                back.stop()
    finally:
        eng.destroy()


def test_a_server_without_runtime_lora_is_refused_at_start_up():
    """What each peer publishes decides: SGLang's server args, vLLM's routes (attached only with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); payloads as the stand-ins above serve them."""

    def getter(pages):
        return lambda path: (200, pages[path]) if path in pages else (404, None)

    info = {"version": "0.5.2", "tp_size": 1, "enable_lora": False, "max_lora_rank": None}
    sg = sglang.detect("http://a", getter({"/get_server_info": info}))
    with pytest.raises(UnsupportedServer, match="--enable-lora --max-lora-rank R .*model.lora.sync=merged"):
        require_lora(sg, "http://a", 8)
    sg = sglang.detect("http://a", getter({"/get_server_info": {**info, "enable_lora": True, "max_lora_rank": 4}}))
    with pytest.raises(UnsupportedServer, match="up to rank 4"):
        require_lora(sg, "http://a", 8)
    require_lora(sg, "http://a", 4)
    models = {"data": [{"id": "tiny"}]}
    pages = {"/version": {"version": "0.15.0"}, "/v1/models": models, "/openapi.json": {"paths": {"/pause": {}}}}
    with pytest.raises(UnsupportedServer, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
        require_lora(vllm.detect("http://b", getter(pages)), "http://b", 8)
    without = vllm.detect("http://b", getter(pages))
    pages["/openapi.json"] = {"paths": {"/pause": {}, "/v1/load_lora_adapter": {}}}
    with_lora = vllm.detect("http://b", getter(pages))
    require_lora(with_lora, "http://b", 8)

    # sync=auto: adapters only when every server loads them, else merged weights; sync=adapter: refused
    for sync, infos, accepts in [("auto", [with_lora, without], False), ("auto", [with_lora], True)]:
        servers = [Server(f"http://s{i}", info=x) for i, x in enumerate(infos)]
        assert adapters_kept(LoraConfig(rank=8, sync=sync), servers) is accepts
    with pytest.raises(UnsupportedServer, match="http://s does not load LoRA adapters"):
        adapters_kept(LoraConfig(rank=8, sync="adapter"), [Server("http://s", info=without)])


def test_config_errors_name_the_fields(tmp_path):
    model = ModelConfig(lora=LoraConfig(rank=4, sync="adapter"))
    with pytest.raises(ValueError, match="inference.weight_sync_dir"):
        RemoteEngine(InferenceConfig(backend="remote", protocol="sglang"), ["127.0.0.1:1"], model).initialize()
    cfg = InferenceConfig(backend="remote", protocol="relayrl", weight_sync_dir=str(tmp_path))
    with pytest.raises(ValueError, match="model.lora.sync=merged"):
        RemoteEngine(cfg, ["127.0.0.1:1"], model).initialize()


def test_request_shapes():
    g = GenerationConfig(max_new_tokens=4, greedy=True)
    sg = SGLangBackend()
    assert sg.generate("r", [1, 2], g, 4, 0, adapter="relayrl-v7").json["lora_path"] == "relayrl-v7"  # type: ignore[index]
    assert "lora_path" not in sg.generate("r", [1, 2], g, 4, 0).json  # type: ignore[operator]
    [(batched, _)] = sg.batch([sg.generate("a", [1], g, 4, 0, adapter="relayrl-v7"), sg.generate("b", [2], g, 4, 0)])
    assert batched.json["lora_path"] == ["relayrl-v7", None]  # type: ignore[index]
    load = sg.load_adapter("relayrl-v7", "/shared/relayrl-v7")
    assert (load.path, load.json) == (
        "/load_lora_adapter",
        {"lora_name": "relayrl-v7", "lora_path": "/shared/relayrl-v7"},
    )
    assert (sg.unload_adapter("relayrl-v6").path, sg.unload_adapter("relayrl-v6").json) == (
        "/unload_lora_adapter",
        {"lora_name": "relayrl-v6"},
    )
    with pytest.raises(ValueError, match="loaded_adapters"):
        sg.parse_adapter_load("relayrl-v7", {"success": True, "loaded_adapters": {}})

    vl = VLLMBackend("Qwen/Qwen3-0.6B")
    assert vl.generate("r", [1], g, 4, 0, adapter="relayrl-v7").json["model"] == "relayrl-v7"  # type: ignore[index]
    assert vl.generate("r", [1], g, 4, 0).json["model"] == "Qwen/Qwen3-0.6B"  # type: ignore[index]
    assert vl.load_adapter("n", "/p").path == "/v1/load_lora_adapter"
    assert vl.unload_adapter("n").json == {"lora_name": "n"}


def test_launch_flags():
    cfg = InferenceConfig(weight_sync_dir="/shared")
    lora = LoraConfig(rank=12, target_modules=["q_proj", "v_proj"])
    sg = SGLangBackend().server_command(cfg, "M", 30000, lora=lora)
    assert sg[sg.index("--max-lora-rank") + 1] == "12" and "--enable-lora" in sg
    assert sg[sg.index("--lora-target-modules") + 1 : sg.index("--lora-target-modules") + 3] == ["q_proj", "v_proj"]
    assert "all" in SGLangBackend().server_command(cfg, "M", 1, lora=LoraConfig(rank=4))
    vl = VLLMBackend().server_command(cfg, "M", 30000, lora=lora)
    assert vl[vl.index("--max-lora-rank") + 1] == "16"  # rounded up to a rank vLLM accepts
    assert VLLMBackend().server_env(cfg, 0, lora)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "--enable-lora" not in VLLMBackend().server_command(cfg, "M", 1)
