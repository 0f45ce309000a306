"""relayrl installs into the real vLLM and SGLang environments (scripts/peers.sh) without changing any of
their packages (how: tests/real_peers/install.py), and runs there with their torch and transformers.
Training from inside them against their own server, on the real SmolLM2, is
``test_smollm2_peers.py::test_the_recipe_runs_through_a_launched_real_server_in_sync``."""

from __future__ import annotations

import subprocess

import pytest

pytestmark = pytest.mark.real_peers


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_relayrl_installs_into_the_real_peer_env(kind, installed, tmp_path, tiny_dir):
    """The install as above; relayrl imports from its folder with the environment's own torch and
    transformers, and builds, saves and reloads a model there."""
    env, site = installed(kind)
    script = (
        "import relayrl, torch, transformers, sys; from relayrl.api.config import ModelConfig; "
        "from relayrl.data.models import build_tiny_model, load_model; "
        "build_tiny_model('tiny', seed=0).save_pretrained(sys.argv[1]); load_model(ModelConfig(path=sys.argv[1])); "
        "print(relayrl.__file__, torch.__file__, transformers.__file__)"
    )
    where = subprocess.run([str(env / "bin" / "python"), "-c", script, str(tmp_path / "m")], capture_output=True,
                           text=True, timeout=300, cwd=tmp_path, env={"PYTHONPATH": str(site)})  # fmt: skip
    assert where.returncode == 0, where.stderr[-3000:]
    relayrl_file, torch_file, transformers_file = where.stdout.split()
    assert relayrl_file == str(site / "relayrl" / "__init__.py"), where.stdout
    assert torch_file.startswith(str(env)) and transformers_file.startswith(str(env)), where.stdout
