"""relayrl installs into the real vLLM and SGLang environments (scripts/peers.sh) without changing any of
their packages, and trains from inside them against their own server.

Copying an environment (SGLang's is 11 GB) per run is too dear, so the install is proven without writing
to it: pip resolves relayrl's wheel against the environment's own interpreter (``--dry-run --report``:
what pip would install, nothing installed); not one of the environment's packages may be in that list,
only packages it lacks. relayrl and exactly those go with ``--no-deps --target`` into a folder put on
the interpreter's PYTHONPATH: the combined set is what an install would make, ``pip check`` runs over
it (no problem the environment did not already have), and ``relayrl train`` runs 3 GRPO steps with
the environment's python, importing relayrl from that folder, against the environment's server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.real_peers.servers import ROOT, peer_env
from tests.real_peers.test_train import check, launch, train

pytestmark = pytest.mark.real_peers


@pytest.fixture(scope="module")
def relayrl_wheel(tmp_path_factory) -> Path:
    """relayrl's wheel, built from a copy of the sources (no build/ or egg-info left in the tree)."""
    src = tmp_path_factory.mktemp("relayrl-src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "relayrl", src / "relayrl", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    pip(sys.executable, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src))
    (wheel,) = dist.glob("relayrl-*.whl")
    return wheel


def pip(python: str, *args: str) -> str:
    """pip of ``python`` on its own packages (this process's PYTHONPATH, relayrl's tree, left out)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([python, "-m", "pip", "--disable-pip-version-check", *args], capture_output=True,
                          text=True, timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, f"pip {' '.join(args)}: {done.stderr[-3000:]}"
    return done.stdout


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def pip_check(python: str, path: Path | None = None) -> set[str]:
    """``pip check``'s problems in the interpreter's packages (plus ``path``'s, on PYTHONPATH)."""
    env = {"PATH": "/usr/bin:/bin", **({"PYTHONPATH": str(path)} if path else {})}
    out = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True, timeout=120, env=env)
    return {line for line in out.stdout.splitlines() if line and line != "No broken requirements found."}


@pytest.fixture(scope="module")
def installed(relayrl_wheel, tmp_path_factory):
    """``installed(kind)``: relayrl installed beside peer ``kind``'s environment, as proven below (cached)."""
    done: dict[str, tuple[Path, Path]] = {}

    def install(kind: str) -> tuple[Path, Path]:
        if kind not in done:
            done[kind] = (peer_env(kind), install_beside(peer_env(kind), relayrl_wheel, tmp_path_factory.mktemp(kind)))
        return done[kind]

    return install


def install_beside(env: Path, wheel: Path, tmp: Path) -> Path:
    """Prove that ``wheel`` installs into ``env`` changing none of its packages and adding no ``pip check``
    problem; the folder holding relayrl and what ``env`` lacked (for the interpreter's PYTHONPATH)."""
    python = str(env / "bin" / "python")
    have = {norm(p["name"]): p["version"] for p in json.loads(pip(python, "list", "--format=json"))}
    report = tmp / "report.json"
    pip(python, "install", "-q", "--dry-run", "--report", str(report), str(wheel))
    plan = {norm(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    replaced = {n: f"{have[n]} -> {v}" for n, v in plan.items() if n in have}
    assert not replaced, f"installing relayrl into {env} would change {replaced}"
    assert plan.pop("relayrl") == "0.1.0"
    print(f"{env.name}: relayrl adds {sorted(f'{n}=={v}' for n, v in plan.items())}; changes none of {len(have)}")

    site = tmp / "site"
    pip(python, "install", "-q", "--no-deps", "--no-compile", "--target", str(site), str(wheel),
        *(f"{n}=={v}" for n, v in plan.items()))  # fmt: skip
    assert pip_check(python, site) <= pip_check(python), f"pip check in {env} with relayrl"
    return site


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


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_relayrl_trains_from_inside_the_real_peer_env(kind, installed, tmp_path, tiny_dir):
    """``relayrl train`` with the environment's python (relayrl from its folder) runs 3 GRPO steps against
    the environment's own server, launched by the trainer, with the checks of test_train.py."""
    env, site = installed(kind)
    route, update_route, args = launch(kind, env, tmp_path)
    rows, seen = train(tmp_path, tiny_dir, route, *args, python=str(env / "bin" / "python"), path=site)
    check(rows, seen, tmp_path, kind, update_route)
