"""relayrl installed beside a real peer's environment (scripts/peers.sh) without writing to it.

Copying an environment (SGLang's is 11 GB) per run is too dear, so the install is proven without writing
to it: pip resolves relayrl's wheel against the environment's own interpreter (``--dry-run --report``:
what pip would install, nothing installed); not one of the environment's packages may be in that list,
only packages it lacks. relayrl and exactly those go with ``--no-deps --target`` into a folder put on
the interpreter's PYTHONPATH: the combined set is what an install would make, and ``pip check`` runs over
it (no problem the environment did not already have). The fixtures are in conftest.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.real_peers.servers import ROOT


def build_wheel(dist: Path, src: Path) -> Path:
    """relayrl's wheel in ``dist``, built from a copy of the sources in ``src`` (no build/ or egg-info left in the tree)."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "relayrl", src / "relayrl", ignore=shutil.ignore_patterns("__pycache__"))
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
