"""How relayrl's configs are declared, read and checked: typed dataclass fields with help text and
rules, YAML files plus dotted command-line overrides, one-line errors naming the field.

Rules are declared next to each field (``ge``/``gt``/``le``/``lt``/``choices``) and checked
for every field on load; an error names the dotted field, the value and what is allowed,
in one line (``ConfigError``). Unknown keys are rejected with a did-you-mean. YAML 1.1 words
(``on``/``off``/``yes``/``no``/``~``) keep the word typed in string fields. A config class may
declare ``inherit(values)`` (defaults drawn from other sections before building) and
``validate()`` (rules across fields). The classes themselves live in ``relayrl.api.config``.

Not OmegaConf's structured configs (2.4, used below for ``${...}`` interpolation only): they check
types but no ranges or choices, refuse ``n_servers: 3.0``, read ``progress: off`` as ``"False"``,
answer in multi-line errors, and cannot build ``RunConfig`` (``OmegaConf.structured`` fails on it). Not
pydantic either (here through FastAPI): its strict mode refuses ``n_servers: 3.0``, its lax mode takes the
string ``"3"`` for a number and ``"yes"`` for a bool, and its errors would need translating, type by type,
into the one-line messages users and tests read: that translation is the code below. So coercion, rules
and the one-line errors stay here.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Literal, TypeVar, Union, get_args, get_origin

if typing.TYPE_CHECKING:
    from _typeshed import DataclassInstance

import yaml

T = TypeVar("T")
Scalar = str | int | float | bool | None
# A YAML value as loaded: scalars, lists and mappings of them.
YamlValue = Scalar | list["YamlValue"] | dict[str, "YamlValue"]


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or out of range."""


class YamlWord(str):
    """A scalar YAML 1.1 reads as a bool or null (``on``, ``off``, ``yes``, ``n``, ``~``, ``null`` ...),
    kept as the word typed: a string field gets the word (``logging.progress=off`` means "off",
    not False), a bool or optional field gets ``value``."""

    value: bool | None

    def __new__(cls, word: str, value: bool | None) -> YamlWord:
        obj = super().__new__(cls, word)
        obj.value = value
        return obj

    def resolve(self, tp: object) -> YamlValue:
        args = get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)
        if self.value is None and type(None) in args:
            return None
        return str(self) if str in args else self.value


def _word_loader(base: type[yaml.SafeLoader]) -> type[yaml.SafeLoader]:
    """``base`` with bools and nulls read as ``YamlWord``; the value is resolved by the field's type."""

    class Loader(base):
        pass

    def word(loader: yaml.SafeLoader, node: yaml.Node) -> YamlWord:
        is_bool = node.tag == "tag:yaml.org,2002:bool"
        return YamlWord(
            str(node.value), loader.construct_yaml_bool(node) if is_bool else loader.construct_yaml_null(node)
        )

    for tag in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:null"):
        Loader.add_constructor(tag, word)
    return Loader


_LOADERS = [_word_loader(base) for base in (getattr(yaml, "CSafeLoader", None), yaml.SafeLoader) if base is not None]


def f(default: T, help: str = "", **rules: object) -> T:
    """A dataclass field with help text and validation rules.

    Rules: ``ge``, ``gt``, ``le``, ``lt`` (numeric bounds), ``choices`` (allowed values).
    List, dict and dataclass defaults are copied per instance.
    """
    meta = {"help": help, **rules}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def _plain(value: YamlValue) -> YamlValue:
    """A loaded YAML value with its bool / null words resolved as YAML reads them (``yes`` -> True)."""
    if isinstance(value, YamlWord):
        return value.value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _type_name(tp: object) -> str:
    if get_origin(tp) in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if get_origin(tp) is list:
        return f"list[{_type_name(get_args(tp)[0])}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: YamlValue, tp: object, name: str) -> object:
    """Convert a YAML value to ``tp`` or raise ConfigError naming the field."""
    if isinstance(value, YamlWord):
        try:
            return _coerce(value.resolve(tp), tp, name)
        except ConfigError:  # name the word typed ('on'), not what YAML made of it (True)
            raise ConfigError(f"{name}: expected a {_type_name(tp)}, got {str(value)!r}") from None
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{name}: {value!r} is not a {_type_name(tp)}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return [_coerce(v, get_args(tp)[0], f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is dict:  # free-form arguments (workflow_kwargs, reward_kwargs): YAML values as loaded
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping, got {value!r}")
        return {str(k): _plain(v) for k, v in value.items()}
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{name}: {value!r} is not one of {list(get_args(tp))}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping of fields, got {value!r}")
        return _build(typing.cast(type, tp), value, name + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):  # YAML reads "1e-5" as a string
            try:
                return float(value)
            except OverflowError:  # an int too large for a float
                raise ConfigError(f"{name}: {value!r} is too large for a number") from None
            except ValueError:  # a string that is not a number
                pass
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate (e.g. undecodable bytes in argv)
                raise ConfigError(f"{name}: {value!r} is not valid UTF-8 text") from None
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    raise ConfigError(f"{name}: unsupported field type {_type_name(tp)}")


def _check_rules(value: object, meta: typing.Mapping[str, object], name: str) -> None:
    if value is None:
        return
    choices = meta.get("choices")
    if choices is not None and value not in typing.cast(list, choices):
        raise ConfigError(f"{name}={value!r} is not allowed; choose one of {choices}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name}={value!r} is not a finite number")
        for rule, ok, word in (
            ("ge", lambda v, b: v >= b, ">="),
            ("gt", lambda v, b: v > b, ">"),
            ("le", lambda v, b: v <= b, "<="),
            ("lt", lambda v, b: v < b, "<"),
        ):
            bound = meta.get(rule)
            if bound is not None and not ok(value, bound):
                raise ConfigError(f"{name}={value!r} is out of range: must be {word} {bound} ({_range_text(meta)})")


def _range_text(meta: typing.Mapping[str, object]) -> str:
    lo = f"[{meta['ge']}" if "ge" in meta else f"({meta['gt']}" if "gt" in meta else "(-inf"
    hi = f"{meta['le']}]" if "le" in meta else f"{meta['lt']})" if "lt" in meta else "inf)"
    return f"allowed range {lo}, {hi}"


def _build(cls: type[T], values: typing.Mapping[str, YamlValue], prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    fields = {fl.name: fl for fl in dataclasses.fields(typing.cast("type[DataclassInstance]", cls))}
    for key in values:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; known fields: {', '.join(fields)}"
            shown = f"{prefix}{key}"
            shown = shown if shown.isprintable() else shown.encode("unicode_escape").decode()  # one line, always
            raise ConfigError(f"unknown config key '{shown}'{hint}")
    kwargs: dict[str, object] = {}
    for name in [n for n in fields if n in values]:  # in declaration order: the first bad field is reported
        value, tp = values[name], hints[name]
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            fl = fields[name]  # the section's own default (not cls()'s, which may be resolved against others)
            default = fl.default_factory() if fl.default_factory is not dataclasses.MISSING else None
            merged = {**to_plain_dict(default), **value} if default is not None else value
            kwargs[name] = _build(typing.cast(type, tp), merged, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, tp, f"{prefix}{name}")
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{prefix or 'config'}: {e}") from None
    validate_config(obj, prefix)
    return obj


def to_plain_dict(obj: object) -> dict[str, YamlValue]:
    return typing.cast(dict[str, YamlValue], dataclasses.asdict(typing.cast("DataclassInstance", obj)))


def validate_config(obj: object, prefix: str = "") -> None:
    """Check every field's type-independent rules (ranges, choices) recursively."""
    for fl in dataclasses.fields(typing.cast("DataclassInstance", obj)):
        value = getattr(obj, fl.name)
        name = f"{prefix}{fl.name}"
        if dataclasses.is_dataclass(value):
            validate_config(value, name + ".")
        else:
            _check_rules(value, fl.metadata, name)
    check = getattr(obj, "validate", None)  # cross-field rules of a section
    if check is not None:
        try:
            check()
        except ValueError as e:
            raise ConfigError(f"{prefix}{e}") from None


def parse_override(text: str) -> tuple[list[str], YamlValue]:
    """``"actor.lr=1e-5"`` -> (["actor", "lr"], 1e-5). Values are parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.field=value")
    key, raw = text.split("=", 1)
    if not key or any(not part.isidentifier() for part in key.split(".")):
        raise ConfigError(f"override {text!r}: {key!r} is not a dotted field name")
    try:
        value = _load_yaml(raw) if raw.strip() else ""
    except (yaml.YAMLError, ValueError):  # ValueError: an integer literal too long to convert
        value = raw
    return key.split("."), value


def _load_yaml(text: str) -> YamlValue:
    """YAML through libyaml when PyYAML has it (~9x faster on a full config), bools and nulls as ``YamlWord``.

    libyaml rejects a few escapes PyYAML accepts (surrogate ``\\uD800``), so a file it refuses
    is read again by the pure-Python loader, whose error (if any) is the one reported.
    """
    for loader in _LOADERS[:-1]:
        try:
            return typing.cast(YamlValue, yaml.load(text, Loader=loader))  # noqa: S506 (a SafeLoader)
        except (yaml.YAMLError, ValueError):
            pass
    return typing.cast(YamlValue, yaml.load(text, Loader=_LOADERS[-1]))  # noqa: S506


def _yaml_where(e: Exception) -> str:
    """``" at line L, column C: problem"`` from PyYAML's marks (1-based, as editors count)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    if mark is None:
        return f": {problem}"
    return f" at line {mark.line + 1}, column {mark.column + 1}: {problem}"


def load_config(cls: type[T], path: str | os.PathLike[str] | None = None, overrides: list[str] | None = None) -> T:
    """Build ``cls`` from a YAML file (optional) and dotted overrides, fully validated."""
    values: dict[str, YamlValue] = {}
    if path is not None:
        try:
            loaded = _load_yaml(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
        except OSError as e:  # a directory, no permission ...
            raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
        except (yaml.YAMLError, ValueError) as e:  # ValueError: an integer literal too long to convert
            raise ConfigError(f"config file {path} is not valid YAML{_yaml_where(e)}") from None
        if isinstance(loaded, YamlWord) and loaded.value is None:  # a file holding only "~" or "null"
            loaded = None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(loaded).__name__}")
        values = loaded or {}
    for text in overrides or []:
        keys, value = parse_override(text)
        node: dict[str, YamlValue] = values
        for part in keys[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[keys[-1]] = value
    values = _interpolate(values, cls)
    inherit = getattr(cls, "inherit", None)  # a config's own defaults drawn from other sections
    if inherit is not None:
        inherit(values)
    return _build(cls, values)


def _interpolate(values: dict[str, YamlValue], cls: type) -> dict[str, YamlValue]:
    """Resolve ``${section.field}`` references (OmegaConf's interpolation, against the file and
    overrides laid over ``cls``'s defaults), e.g. ``actor.loss_norm_len: ${gconfig.max_new_tokens}``.

    OmegaConf is used for this one thing it does better than hand-written code (nested and
    relative references, ``${oc.env:VAR}`` resolvers, cycle detection); loading, types and
    validation stay here, and leaves without ``${`` keep their YAML 1.1 words as typed."""
    refs = [(p, v) for p, v in _leaves(values) if isinstance(v, str) and "${" in v]
    if not refs:
        return values
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = to_plain_dict(cls()) if dataclasses.is_dataclass(cls) else {}
    conf = OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(typing.cast(dict[str, object], _plain(values))))
    for path, raw in refs:
        try:
            resolved = OmegaConf.select(conf, ".".join(path), throw_on_missing=True)
        except OmegaConfBaseException as e:
            raise ConfigError(f"{'.'.join(path)}: cannot resolve {raw!r}: {str(e).splitlines()[0]}") from None
        node = values
        for key in path[:-1]:
            node = typing.cast(dict[str, YamlValue], node[key])
        node[path[-1]] = typing.cast(
            YamlValue, OmegaConf.to_container(resolved) if OmegaConf.is_config(resolved) else resolved
        )
    return values


def _leaves(value: YamlValue, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], YamlValue]]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, (*path, str(k)))]
    return [(path, value)]


def public_dict(obj: object) -> dict[str, YamlValue]:
    """``to_plain_dict`` with every field marked ``secret=True`` emptied: what may be written to disk
    or sent to a metric sink (a config reloaded from it takes the secret from the environment again)."""
    out: dict[str, YamlValue] = {}
    for fl in dataclasses.fields(typing.cast("DataclassInstance", obj)):
        value = getattr(obj, fl.name)
        if fl.metadata.get("secret"):
            out[fl.name] = ""
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            out[fl.name] = typing.cast(YamlValue, public_dict(value))
        else:
            out[fl.name] = typing.cast(YamlValue, copy.deepcopy(value))
    return out


def save_config(cfg: object, run_dir: str | os.PathLike[str]) -> Path:
    """Write the resolved config to ``run_dir/config.yaml`` (what the run really used)."""
    out = Path(run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(public_dict(cfg), sort_keys=False))
    return out


def config_reference(classes: tuple[type, ...]) -> str:
    """Markdown reference of every field (the content of ``docs/config.md``)."""
    lines = [
        "# Config reference",
        "",
        "Generated by `relayrl config-reference > docs/config.md`; a test keeps it in sync.",
        "Set fields in a YAML file or on the command line as dotted overrides (`train.optimizer.lr=1e-5`).",
        "",
    ]

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        nested: list[tuple[type, str]] = []
        rows = []
        for fl in dataclasses.fields(cls):
            tp = hints[fl.name]
            if dataclasses.is_dataclass(tp):
                nested.append((typing.cast(type, tp), f"{prefix}{fl.name}."))
                continue
            default = fl.default if fl.default_factory is dataclasses.MISSING else fl.default_factory()
            rules = []
            if "choices" in fl.metadata:
                rules.append("one of " + ", ".join(f"`{c}`" for c in fl.metadata["choices"]))
            if any(k in fl.metadata for k in ("ge", "gt", "le", "lt")):
                rules.append(_range_text(fl.metadata).removeprefix("allowed range "))
            rows.append(
                f"| `{prefix}{fl.name}` | {_type_name(tp).replace('|', 'or')} | `{default!r}` | {'; '.join(rules)} | {str(fl.metadata.get('help', '')).replace('|', '/')} |"
            )
        if rows:
            lines.extend(
                [
                    f"## `{prefix.rstrip('.') or cls.__name__}`",
                    "",
                    "| field | type | default | allowed | help |",
                    "|---|---|---|---|---|",
                    *rows,
                    "",
                ]
            )
        for sub, sub_prefix in nested:
            walk(sub, sub_prefix)

    for cls in classes:
        lines.extend([f"# {cls.__name__}", "", (cls.__doc__ or "").strip(), ""])
        walk(cls, "")
    return "\n".join(lines).rstrip() + "\n"
