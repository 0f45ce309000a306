#!/usr/bin/env bash
# Fetch, here, exactly the wheels relayrl needs on the lent GPU machines beyond what their image has
# (scripts/gpu_image.txt), for that platform (CPython 3.12, manylinux x86_64), into .gpu-wheels/
# (git-ignored; the device tool's `carry` takes it along: docs/devices.md). scripts/gpu_check.sh installs
# them there with no index. How: pip resolves relayrl's dependencies (pyproject.toml) for that platform
# with the image's known versions as constraints (--dry-run --report: nothing installed); what the
# image lacks is downloaded. torch and CUDA libraries are never among them (checked).
#   bash scripts/gpu_wheels.sh [DIR]      # ~10 s with a warm pip cache; DIR defaults to .gpu-wheels
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.gpu-wheels}"
py="${PYTHON312:-$(ls -d "$HOME"/.pyenv/versions/3.12.*/bin/python3 2>/dev/null | tail -n 1 || true)}"
py="${py:-python3.12}"
"$py" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null ||
  { echo "gpu_wheels: needs a Python 3.12 (set PYTHON312)" >&2; exit 2; }
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
for n in $(seq 17 39); do platform+=(--platform "manylinux_2_${n}_x86_64"); done  # the image's glibc is 2.39
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
grep '==' scripts/gpu_image.txt >"$work/image-pins.txt"
# relayrl's requirements from pyproject.toml, plus the build backend for installing relayrl there
"$py" - >"$work/requirements.txt" <<'EOF'
import tomllib
meta = tomllib.load(open("pyproject.toml", "rb"))
print("\n".join(meta["project"]["dependencies"] + meta["build-system"]["requires"]))
EOF
echo "gpu_wheels: resolving relayrl's needs for cp312 manylinux x86_64 against scripts/gpu_image.txt"
"$py" -m pip install -q --disable-pip-version-check --dry-run --ignore-installed --target "$work/none" \
  "${platform[@]}" -c "$work/image-pins.txt" -r "$work/requirements.txt" --report "$work/report.json" 2>&1 |
  { grep -v "^WARNING: Location 'file:" || true; }
# what the image lacks, as name==version (one per line)
# and what relayrl takes from the image, at the versions the resolution assumed (scripts/gpu_proof.sh
# builds a stand-in of the image from it)
"$py" - "$work/report.json" scripts/gpu_image.txt "$work/image-side.txt" >"$work/missing.txt" <<'EOF'
import json, re, sys
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
image = {norm(line.strip().split("==")[0]) for line in open(sys.argv[2]) if line.strip() and not line.startswith("#")}
picked = [(norm(i["metadata"]["name"]), i["metadata"]["version"]) for i in json.load(open(sys.argv[1]))["install"]]
missing = sorted((n, v) for n, v in picked if n not in image or n == "setuptools")  # setuptools: relayrl's build
bad = [n for n, _ in missing if n in ("torch", "triton") or n.startswith(("nvidia-", "cuda-"))]
if bad:
    sys.exit(f"gpu_wheels: the image would need {bad} replaced: relayrl's ranges exclude the image's torch stack")
print("\n".join(f"{n}=={v}" for n, v in missing))
open(sys.argv[3], "w").write("".join(f"{n}=={v}\n" for n, v in sorted(picked) if n in image))
EOF
rm -rf "$dest"
mkdir -p "$dest"
"$py" -m pip download -q --disable-pip-version-check --no-deps "${platform[@]}" -d "$dest" -r "$work/missing.txt" 2>&1 |
  { grep -v "^WARNING: Location 'file:" || true; }
cp "$work/missing.txt" "$dest/MANIFEST.txt"
cp "$work/image-side.txt" "$dest/FROM_IMAGE.txt"
n=$(ls "$dest"/*.whl | wc -l)
[ "$n" = "$(wc -l <"$work/missing.txt")" ] || { echo "gpu_wheels: $n wheels for $(wc -l <"$work/missing.txt") packages" >&2; exit 1; }
size=$(du -sm "$dest" | cut -f1)
echo "gpu_wheels: $n wheels, ${size} MiB in $dest: $(tr '\n' ' ' <"$dest/MANIFEST.txt")"
[ "$size" -le 48 ] || { echo "gpu_wheels: over 48 MiB: the device tool carries 64 MiB with the tree" >&2; exit 1; }
