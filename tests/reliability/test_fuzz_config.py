"""Fuzzing config files: whatever a YAML file or an override holds, loading gives a valid
config or one ``ConfigError`` line naming the field, never a traceback from deep inside.

(tests/test_config.py fuzzes single leaf values; this goes for whole documents: unknown keys
at any depth, sections of the wrong type, raw bytes, undecodable text, odd YAML.)
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
import typing
from pathlib import Path

import pytest
import yaml
from audit import start_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relayrl.api.config import ConfigError, RunConfig, load_config, parse_override, save_config
from relayrl.api.fields import YamlWord, public_dict

EXAMPLES = int(os.environ.get("RELAYRL_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TMP = Path(tempfile.mkdtemp(prefix="relayrl-fuzz-cfg-"))


def teardown_module() -> None:
    shutil.rmtree(TMP, ignore_errors=True)


def _fields(cls: type) -> dict[str, object]:
    """Field name -> sub-dataclass (a section) or None (a leaf)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else None for f in dataclasses.fields(cls)}


SCALAR = (
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(["1e-5", "nan", "-inf", "ppo", "remote", "requeue", "tiny", "", "0x10", "1_000"])
)
JUNK = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def document(draw: st.DrawFn, cls: type = RunConfig, depth: int = 0) -> dict[str, object]:
    """A mapping of real field names (and now and then an unknown one) to values of any type."""
    fields = _fields(cls)
    names = draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True))
    doc: dict[str, object] = {}
    for name in names:
        sub = fields[name]
        if sub is not None and depth < 3 and draw(st.integers(0, 3)):
            doc[name] = draw(document(sub, depth + 1))  # type: ignore[arg-type]
        else:
            doc[name] = draw(JUNK)
    if draw(st.integers(0, 5)) == 0:
        doc[draw(st.text(min_size=1, max_size=8))] = draw(JUNK)
    return doc


def _paths(doc: object, prefix: str = "") -> set[str]:
    """Every dotted key path in a nested mapping."""
    if not isinstance(doc, dict):
        return set()
    out = set()
    for k, v in doc.items():
        out |= {f"{prefix}{k}"} | _paths(v, f"{prefix}{k}.")
    return out


def _load(path: Path | None, overrides: list[str] | None = None) -> RunConfig | ConfigError:
    try:
        return load_config(RunConfig, path, overrides)
    except ConfigError as e:
        assert "\n" not in str(e), f"config errors are one line: {e!r}"
        return e


@FUZZ
@given(doc=document())
def test_random_documents_load_or_name_the_field(doc):
    path = TMP / "doc.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    out = _load(path)
    if isinstance(out, ConfigError):
        msg = str(out)
        seen = yaml.safe_load(path.read_text())  # YAML may normalise a key (U+0085 is a line break to it)
        named = {p if p.isprintable() else p.encode("unicode_escape").decode() for p in _paths(seen)}  # one line
        assert any(p in msg for p in named), f"{msg!r} names none of {sorted(named)}"
    else:
        assert public_dict(load_config(RunConfig, save_config(out, TMP / "run"))) == public_dict(
            out
        )  # secrets come back empty


@FUZZ
@given(data=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_random_bytes_never_crash_the_loader(data):
    path = TMP / "raw.yaml"
    path.write_bytes(data)
    out = _load(path)  # a config or one ConfigError line; any other exception fails the test
    if not isinstance(out, ConfigError):
        assert yaml.safe_load(data.decode()) in (None, {}) and out == RunConfig()  # only an empty document loads


def _leaves(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf field of ``cls``."""
    out: list[str] = []
    for name, sub in _fields(cls).items():
        out += _leaves(sub, f"{prefix}{name}.") if sub is not None else [f"{prefix}{name}"]  # type: ignore[arg-type]
    return out


LEAVES = _leaves()
# Raw text (rarely a dotted field name), or a real field with a value of any shape.
OVERRIDE = st.text(max_size=30) | st.builds(
    "{}={}".format, st.sampled_from(LEAVES), st.text(max_size=12) | SCALAR.map(str) | JUNK.map(yaml.safe_dump)
)


def _flat(obj: object, prefix: str = "") -> dict[str, object]:
    if dataclasses.is_dataclass(obj):
        out: dict[str, object] = {}
        for f in dataclasses.fields(obj):
            out |= _flat(getattr(obj, f.name), f"{prefix}{f.name}.")
        return out
    return {prefix[:-1]: obj}


def _same(a: object, b: object) -> bool:
    """Equal as a config value (1 and 1.0, "1e-5" and 1e-05, the word ``Null`` and None)."""
    if isinstance(a, YamlWord) and _same(a.value, b):
        return True
    try:
        return a == b or str(a) == str(b) or float(a) == float(b)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


@FUZZ
@given(overrides=st.lists(OVERRIDE, max_size=3))
def test_random_overrides_load_or_name_the_override(overrides):
    out = _load(None, overrides)
    given_keys = {o.split("=", 1)[0] for o in overrides}
    if isinstance(out, ConfigError):  # the one line quotes an override, or names a key (or its first unknown part)
        msg = str(out)
        parts = {k.rsplit(".", i)[0] for k in given_keys for i in range(k.count(".") + 1)}
        named = any(re.search(rf"(?<![\w.]){re.escape(p)}(?![\w.])", msg) for p in parts)  # a whole dotted name
        assert named or any(repr(o) in msg for o in overrides), f"{msg!r} names none of {overrides}"
        return
    # A config that loads changed the fields it was given and nothing else (but what follows them, as documented:
    # eval.gconfig's unset fields follow gconfig's, actor.temperature the sampling temperature), and survives a
    # save / load.
    follow = {f"eval.{k}" for k in given_keys if k.startswith("gconfig.")}
    follow |= {"actor.temperature"} if given_keys & {"gconfig.temperature", "gconfig.greedy"} else set()
    changed = {k for k, v in _flat(out).items() if v != _flat(RunConfig())[k]}
    assert changed <= given_keys | follow, f"{overrides} changed {sorted(changed - given_keys - follow)} too"
    last = {".".join(k): v for k, v in map(parse_override, overrides)}  # the last override of a key wins
    for key, value in last.items():  # ... and was applied: a value other than the default changed the field
        assert key in changed or _same(value, _flat(RunConfig())[key]), f"{key}={value!r} left {key} at its default"
    # ... and survives a save / load, secrets (never written to disk) coming back empty
    assert public_dict(load_config(RunConfig, save_config(out, TMP / "run"))) == public_dict(out)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"actor:\n  lr: 1e-5\n", "unknown config key 'actor.lr'; known fields: adv_estimator"),
        (b"rollout: 8\n", "rollout: expected a mapping of fields, got 8"),
        (b"rollout:\n  batch_size: [8]\n", "rollout.batch_size: expected an integer, got [8]"),
        (b"train:\n  optimizer:\n    lr: -1\n", "train.optimizer.lr=-1.0 is out of range"),
        (b"\xff\xfeseed: 1\n", "is not UTF-8 text"),
        (b"seed: 1" + b"0" * 5000 + b"\n", "is not valid YAML"),
        (b"- just\n- a list\n", "must hold a mapping of sections, got list"),
    ],
)
def test_cli_prints_one_line_naming_the_field_and_no_traceback(tmp_path, content, needle):
    cfg = tmp_path / "bad.yaml"
    cfg.write_bytes(content)
    log = tmp_path / "cli.log"
    proc = start_cli(["train", str(cfg), f"run_dir={tmp_path / 'run'}"], log)
    proc.join(timeout=120)
    out = log.read_text()
    assert proc.exitcode == 2, out
    assert out.startswith("relayrl train: ") and out.count("\n") == 1 and needle in out, out
    assert not (tmp_path / "run").exists()  # nothing was started


def test_undecodable_text_is_refused_naming_the_field(tmp_path):
    """Lone surrogates (undecodable argv bytes, or a YAML escape) would crash saving the config later."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text('run_dir: "\\ud800"\n')
    for path, overrides in ((cfg, []), (None, ["run_dir=\udcff"]), (None, ["actor.loss=pp\udcff"])):
        out = _load(path, overrides)
        assert isinstance(out, ConfigError) and "is not valid UTF-8 text" in str(out), out
        assert str(out).startswith(("run_dir:", "actor.loss:")), str(out)
