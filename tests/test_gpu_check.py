"""relayrl's install metadata and the GPU check (docs/devices.md, README "Install"): pyproject.toml's
ranges admit CI's pins (constraints.txt) and the GPU image's versions (scripts/gpu_image.txt); the
long test runs scripts/gpu_proof.sh, gpu_check.sh on a Python 3.12 stand-in of the GPU image."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> list[Requirement]:
    """Every requirement pyproject.toml states: the core and each extra's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for reqs in project["optional-dependencies"].values() for r in reqs]
    return [Requirement(r) for r in project["dependencies"] + extras]


def pins(path: Path) -> dict[str, str]:
    """``name==version`` lines of a constraints-style file, by normalised name."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            out[norm(name)] = version.strip()
    return out


def test_every_requirement_is_a_range_with_its_pin_inside():
    """A dependency is stated twice: its range in pyproject.toml, its exact pin in constraints.txt (what
    CI installs); the pin lies in the range. Only the linters are exact (their output is their version's)."""
    constraints = pins(ROOT / "constraints.txt")
    for req in requirements():
        name = norm(req.name)
        assert name in constraints, f"{req} has no pin in constraints.txt"
        assert req.specifier.contains(constraints[name]), (
            f"constraints.txt's {name}=={constraints[name]} is outside {req}"
        )
        exact = any(s.operator == "==" for s in req.specifier)
        assert not exact or name in ("ruff", "mypy"), f"{req}: pyproject.toml states ranges; pins go in constraints.txt"
    assert "torch" in constraints  # scripts/setup.sh installs the CPU build first from this pin


def test_the_gpu_image_versions_satisfy_relayrls_ranges():
    """The GPU image's torch 2.11, transformers 5.17, tokenizers 0.23.2, numpy 2.5.2 ... are inside
    relayrl's ranges: scripts/gpu_check.sh installs relayrl there without touching them."""
    image = pins(ROOT / "scripts" / "gpu_image.txt")
    assert image["torch"] == "2.11.0" and image["transformers"] == "5.17.0"
    checked = []
    for req in requirements():
        if norm(req.name) in image:
            assert req.specifier.contains(image[norm(req.name)]), f"the GPU image's {req.name}=={image[norm(req.name)]}"
            checked.append(norm(req.name))
    assert {"torch", "transformers", "tokenizers", "safetensors", "numpy", "accelerate"} <= set(checked)


@pytest.mark.long  # ~3 GB of downloads the first time (PyPI's torch 2.11 is its CUDA build), then ~5 minutes
def test_gpu_check_installs_relayrl_onto_the_gpu_images_torch_with_no_index(tmp_path):
    """scripts/gpu_proof.sh: gpu_check.sh on a Python 3.12 venv with torch 2.11.0 and transformers 5.17.0,
    no index: relayrl and only the missing wheels install, torch is untouched, pip check finds nothing
    new, `relayrl selftest` passes on CPU, the gpu tests skip and bench/gpu.py exits 0."""
    done = subprocess.run(["bash", "scripts/gpu_proof.sh", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["ok"] and summary["torch_untouched"] and summary["torch_after"].startswith("2.11.0")
    assert summary["pip_check_new_problems"] == []
    assert any(name.startswith("relayrl-") for name in summary["installed"])
    assert summary["stages"]["selftest"]["counts"]["fail"] == 0 and summary["stages"]["selftest"]["counts"]["pass"] >= 5
    assert summary["stages"]["pytest_gpu"]["counts"]["failed"] == 0
