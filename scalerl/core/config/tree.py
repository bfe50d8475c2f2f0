"""Configuration trees of dataclasses: YAML files, `key.sub=value` overrides, type checks, validation.

Generic over any tree of dataclasses whose sections derive from `Section`; scalerl's own schema is the rest
of this package (`scalerl.core.config`: a module per section, `root` for the whole run). Every error is a
`ConfigError` naming the full dotted key, with the closest valid key for a misspelling. Numbers are checked
here for every key alike: a float must be finite (`inf`, `nan` and their YAML spellings are refused) and
within the bounds its field declares (`opt(..., above=0)`), so no section can forget a check and every
message reads the same.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from scalerl.core.config.numbers import describe_bounds, number_problems
from scalerl.core.config.numbers import (
    opt as opt,  # re-exported: sections declare fields with it
)
from scalerl.core.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration the run cannot start with; the message names the offending dotted key."""


class Section:
    """Mixin for config sections: `problems()` lists impossible combinations (cross-key checks), `validate()`
    raises on them after the generic number checks of every field (finite, within its declared bounds)."""

    name = ""  # the section's key in `Config`, used to build dotted names in messages

    def problems(self) -> list[str]:
        return []

    def number_problems(self) -> list[str]:
        """Non-finite numbers and numbers outside their field's bounds, for this section's own fields."""
        return [msg for f in dataclasses.fields(self)
                for msg in number_problems(self._key(f.name), getattr(self, f.name), f.metadata.get("bounds", {}))]

    def all_problems(self) -> list[str]:
        """Number problems first; a section's own checks only run on numbers that are sane."""
        return self.number_problems() or self.problems()

    def validate(self) -> None:
        _raise_problems(self.all_problems())

    def _key(self, attr: str) -> str:
        return f"{self.name}.{attr}" if self.name else attr


def _raise_problems(problems: list[str]) -> None:
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"invalid config ({len(problems)} problems):\n  " + "\n  ".join(problems))


def _check(problems: list[str], ok: bool, key: str, requirement: str, value: Any) -> None:
    if not ok:
        problems.append(f"{key} must be {requirement}, got {value!r}")


def _check_choice(problems: list[str], key: str, value: Any, choices: typing.Iterable[str]) -> None:
    choices = list(choices)
    if value not in choices:
        problems.append(f"{key} must be one of {', '.join(choices)}; got {value!r}")



# ----------------------------------------------------------------------------------- generic machinery

# YAML 1.1 reads "1e-6" as a string, and "inf"/"nan" too (only ".inf"/".nan" are floats): all are numbers
# here, so that `actor.lr=inf` is refused as not finite rather than as not a number.
_FLOAT_TEXT = re.compile(r"[+-]?((\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|\.?(inf|infinity|nan))", re.IGNORECASE)


def _field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a dataclass (they are strings under `from __future__ import annotations`)."""
    return typing.get_type_hints(cls)


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _type_name(tp: Any) -> str:
    if _is_union(tp):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _article(name: str) -> str:
    return ("an " if name[0] in "aeiou" else "a ") + name


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return `value` as type `tp`, or raise ConfigError naming `key`."""
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
            return float(re.sub(r"\.(?=[a-zA-Z])", "", value.strip()))  # YAML's ".inf" is Python's "inf"
    elif tp is int or tp is str or tp is bool:
        if type(value) is tp:  # exact: a bool is not accepted as an int
            return value
    elif typing.get_origin(tp) is list:
        if isinstance(value, (list, tuple)):
            (item_tp,) = typing.get_args(tp)
            return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    elif typing.get_origin(tp) is dict or tp is dict:
        if isinstance(value, dict):
            return dict(value)
    elif tp is Any:
        return value
    raise ConfigError(f"{key} must be {_article(_type_name(tp))}, got {value!r} ({type(value).__name__})")


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key (sections and leaves) of a dataclass tree."""
    keys = []
    for name, tp in _field_types(cls).items():
        key = f"{prefix}{name}"
        keys.append(key)
        if dataclasses.is_dataclass(tp):
            keys += _all_keys(tp, key + ".")
    return keys


def _unknown_key_error(root: type, key: str) -> ConfigError:
    valid = _all_keys(root)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if not close:  # e.g. "lr" given without its section: suggest keys with that leaf name
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in valid if k.rsplit(".", 1)[-1] == leaf][:3]
    hint = f"; did you mean {' or '.join(repr(k) for k in close)}?" if close else ""
    return ConfigError(f"unknown key {key!r}{hint}")


def config_from_dict(cls: type, d: dict[str, Any] | None, *, _root: type | None = None, _prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict, type-checking every value; missing keys keep defaults."""
    root = _root or cls
    if d is None:  # an empty YAML section (`actor:`) means "all defaults"
        d = {}
    if not isinstance(d, dict):
        where = _prefix.rstrip(".") or "the config"
        raise ConfigError(f"{where} must be a mapping of keys to values, got {d!r} ({type(d).__name__})")
    types_by_name = _field_types(cls)
    kwargs = {}
    for name, value in d.items():
        key = f"{_prefix}{name}"
        if name not in types_by_name:
            raise _unknown_key_error(root, key)
        tp = types_by_name[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = config_from_dict(tp, value, _root=root, _prefix=key + ".")
        else:
            kwargs[name] = _coerce(value, tp, key)
    return cls(**kwargs)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts/lists/scalars (YAML- and JSON-ready)."""
    return dataclasses.asdict(cfg)


def _parse_override_value(raw: str, tp: Any, key: str) -> Any:
    """Parse the text after '=' with YAML, keeping the raw text where the field wants a string."""
    wants_str = tp is str or (_is_union(tp) and str in typing.get_args(tp))
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        if not wants_str:
            raise ConfigError(f"{key}: cannot parse {raw!r} as a YAML value") from None
        value = raw
    if wants_str and not isinstance(value, str):
        # `trainer.output_dir=2024` or `data.prompt_template=Q: {q}` are strings, not a number/mapping;
        # `null`/`~` still mean None for optional strings
        if value is None and (raw.strip() or type(None) in typing.get_args(tp)):
            return None  # the type check then accepts it only where null is allowed
        return raw
    if typing.get_origin(tp) is list and isinstance(value, str):
        # `trainer.logger=console,tensorboard` as a shorthand for a YAML list
        return [yaml.safe_load(item) for item in value.split(",") if item.strip()]
    return value


def apply_override(cfg: Any, override: str) -> None:
    """Set one `key.sub=value` override on a config tree in place."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} has no '='; write key=value, e.g. actor.lr=1e-6")
    key, raw = override.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {override!r} has an empty key; write key=value, e.g. actor.lr=1e-6")
    root = type(cfg)
    node, parts = cfg, key.split(".")
    for depth, part in enumerate(parts):
        types_by_name = _field_types(type(node))
        if part not in types_by_name:
            walked = ".".join(parts[:depth])
            if walked and not dataclasses.is_dataclass(node):
                raise ConfigError(f"{walked!r} is a value, not a section; cannot set {key!r}")
            raise _unknown_key_error(root, key)
        tp = types_by_name[part]
        if depth == len(parts) - 1:
            if dataclasses.is_dataclass(tp):
                example = next(iter(_field_types(tp)))
                raise ConfigError(f"{key!r} is a section, not a value; set one of its keys, "
                                  f"e.g. {key}.{example}=...")
            setattr(node, part, _coerce(_parse_override_value(raw, tp, key), tp, key))
            return
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"{'.'.join(parts[:depth + 1])!r} is a value, not a section; cannot set {key!r}")
        node = getattr(node, part)


def load_config(path: str | Path | None, overrides: typing.Sequence[str], cls: type) -> Any:
    """Defaults <- YAML file at `path` (if any) <- `overrides` in order; then validate everything.

    Raises FileNotFoundError for a missing file and ConfigError for anything else wrong.
    """
    data: Any = {}
    if path is not None:
        data = read_yaml_file(Path(path))
    cfg = config_from_dict(cls, data)
    for override in overrides:
        apply_override(cfg, override)
    if isinstance(cfg, Section):
        cfg.validate()
    return cfg


def read_yaml_file(path: Path) -> Any:
    """A config file's content; a missing file is FileNotFoundError, anything else wrong a ConfigError
    naming the file (not UTF-8 text, not YAML, not a mapping of sections)."""
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); a config is a YAML text "
                          "file (is it the right file?)") from None
    except OSError as e:
        raise ConfigError(f"{path} cannot be read: {e.strerror or e}") from None
    if "\x00" in text:
        raise ConfigError(f"{path} holds NUL bytes: it is a binary file, not a YAML config")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections (model:, data:, actor:, ...), "
                          f"got {type(data).__name__} {data!r:.60}")
    return data


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the config as YAML (loadable again with `load_config`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_to_yaml(cfg))


class _ConfigDumper(yaml.SafeDumper):
    """YAML with one key per line but lists inline (`betas: [0.9, 0.999]`), the way configs are written."""


_ConfigDumper.add_representer(
    list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True))


def config_to_yaml(cfg: Any) -> str:
    """The config as YAML text, sections in schema order."""
    return yaml.dump(config_to_dict(cfg), Dumper=_ConfigDumper, sort_keys=False, width=120)


def format_config(cfg: Any) -> str:
    """The resolved config as printed at the start of a run."""
    return "resolved config:\n" + "\n".join("  " + line for line in config_to_yaml(cfg).splitlines())


def describe_keys(cls: type, prefix: str = "") -> str:
    """Every settable key with its type, default and help text (for `scalerl config --keys`)."""
    lines = []
    defaults = cls()
    for f in dataclasses.fields(cls):
        tp = _field_types(cls)[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            doc = (tp.__doc__ or "").strip()
            header = f"{key}:" if doc.startswith(tp.__name__ + "(") else f"{key}:  # {doc.splitlines()[0]}"
            lines += ["", header, describe_keys(tp, key + ".")]
            continue
        default = yaml.safe_dump(getattr(defaults, f.name), default_flow_style=True).strip()
        default = default.removesuffix("\n...").removesuffix("...").strip()
        bounds = f.metadata.get("bounds")
        kind = f"{_type_name(tp)} {describe_bounds(bounds)}" if bounds else _type_name(tp)
        lines.append(f"  {key} ({kind}, default {default}): {f.metadata.get('help', '')}")
    return "\n".join(lines).lstrip("\n")


def split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """Split positional args into (YAML path or None, overrides).

    The first arg is the config file if it is an existing file or ends with .yaml/.yml and has no '=';
    every other arg must be a key=value override.
    """
    path = None
    if args and (Path(args[0]).is_file() or ("=" not in args[0] and args[0].endswith((".yaml", ".yml")))):
        path, args = args[0], args[1:]
    for arg in args:
        if "=" not in arg:
            if arg.endswith((".yaml", ".yml")):
                raise ConfigError(f"unexpected config file {arg!r}: the config file must come first, "
                                  "before any key=value override")
            raise ConfigError(f"{arg!r} is neither a YAML config file (.yaml/.yml) nor a key=value override "
                              "(e.g. actor.lr=1e-6)")
    return path, args
