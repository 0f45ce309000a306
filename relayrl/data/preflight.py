"""Checks of what a config points at on this machine (model directories, data files, devices),
made before anything loads, so a wrong path fails in one line naming its field instead of a
traceback from deep inside transformers or torch. It imports neither (``relayrl train`` runs it
before importing the trainer, so a wrong path is reported in a second or two, not after ~10 s of
imports)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from relayrl.api.config import ConfigError, ModelConfig, RunConfig
from relayrl.data.presets import CHAT_TEMPLATES, TINY_PRESETS, VL_PRESETS
from relayrl.data.real_models import is_gguf, resolve_model_path


def _hub_cached(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def check_model_dir(field: str, path: str, adapter: bool = False, need: str = "config.json") -> None:
    """``path`` is a tiny preset, a directory holding a model (or a peft adapter), or a Hugging Face id
    that can be fetched (or is cached when ``HF_HUB_OFFLINE=1``)."""
    if not path or path in TINY_PRESETS or path in VL_PRESETS:
        return
    need = "adapter_config.json" if adapter else need
    where = Path(path).expanduser()
    if where.is_dir():
        if not (where / need).is_file():
            raise ConfigError(f"{field}={path!r} is a directory without {need}: give a directory Hugging Face saved")
        return
    hub_shaped = path.count("/") == 1 and not path.startswith((".", "/", "~")) and not where.parent.is_dir()
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    if adapter or not hub_shaped or (offline and not _hub_cached(path)):
        presets = ", ".join(sorted(TINY_PRESETS))
        kind = (
            "a peft adapter directory" if adapter else f"a model directory, a Hugging Face id or a preset ({presets})"
        )
        raise ConfigError(f"{field}={path!r}: no such directory{' (and offline)' if hub_shaped else ''}; give {kind}")


def check_model(model: ModelConfig) -> None:
    """``model.path``, ``model.tokenizer_path`` and ``model.lora.adapter_path``.

    A peft adapter directory given as ``model.path`` (a LoRA run's checkpoint) is read as what it
    is: its base model (``base_model_name_or_path``) with the adapter merged, and its tokenizer. A GGUF
    file is read as the Hugging Face directory it converts to (once, into the cache: docs/real_models.md)."""
    if is_gguf(model.path):
        if not Path(model.path).expanduser().is_file():
            raise ConfigError(f"model.path={model.path!r}: no such GGUF file")
        model.path = resolve_model_path(model.path)
    adapter = Path(model.path) / "adapter_config.json"
    if adapter.is_file() and not (Path(model.path) / "config.json").is_file() and not model.lora.adapter_path:
        base = json.loads(adapter.read_text()).get("base_model_name_or_path") or ""
        if not base:
            raise ConfigError(f"model.path={model.path!r} is a peft adapter that names no base model")
        if (Path(model.path) / "tokenizer_config.json").is_file():
            model.tokenizer_path = model.tokenizer_path or model.path
        model.path, model.lora.adapter_path = base, model.path
    check_model_dir("model.path", model.path)
    template = model.chat_template
    if template and template not in CHAT_TEMPLATES and not Path(template).expanduser().is_file():
        raise ConfigError(f"model.chat_template={template!r}: give hermes, llama3 or a Jinja file's path")
    if model.tokenizer_path:
        check_model_dir("model.tokenizer_path", model.tokenizer_path, need="tokenizer_config.json")
    if model.lora.adapter_path:
        check_model_dir("model.lora.adapter_path", model.lora.adapter_path, adapter=True)


def check_files(files: dict[str, str]) -> None:
    """Each non-empty ``{field: path}`` names an existing file."""
    for field, path in files.items():
        if path and not Path(path).expanduser().is_file():
            what = "is a directory, not a file" if Path(path).is_dir() else "does not exist"
            raise ConfigError(f"{field}={path!r} {what} (relative paths start from {os.getcwd()})")


def check_device(field: str, device: str) -> None:
    """``cuda`` / ``cuda:N`` needs torch to see that device (``auto`` falls back to the CPU)."""
    if not device.startswith("cuda"):
        return
    import torch  # here, not at the top: the other checks run before anything heavy is imported

    n = torch.cuda.device_count()
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= n:
        seen = f"{n} CUDA device(s)" if n else f"no CUDA device (torch {torch.__version__})"
        raise ConfigError(f"{field}={device!r} but torch sees {seen}; use {field}=auto or cpu")


def check_run(cfg: RunConfig) -> None:
    """Everything a training or evaluation run reads from this machine."""
    check_model(cfg.model)
    check_model_dir("actor.teacher.path", cfg.actor.teacher.path)
    if cfg.data.task == "file":
        check_files({"data.train_path": cfg.data.train_path, "data.eval_path": cfg.data.eval_path})
    if cfg.inference.backend == "local":
        check_device("inference.device", cfg.inference.device)
