"""`--from-verl`: a verl command line's Hydra overrides translated into a scalerl config, key by key.

The table is `scalerl/core/verl_keys.py`. verl's defaults are applied where they differ from scalerl's
(verl's weight decay 0.01, lr 1e-6, gae...), so the scalerl run is the verl run, not scalerl's defaults with
a few keys changed. A key that would change the run and has no equivalent is an error naming it; so is a key
in neither table (add it to one). Torch-free: `scalerl config --from-verl` stays fast.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import re
from dataclasses import dataclass
from typing import Any

import yaml

from scalerl.core.config.tree import (
    ConfigError,
    _all_keys,
    apply_override,
    config_from_dict,
)
from scalerl.core.verl_keys import (
    NO_DEFAULT,
    NO_EFFECT,
    VERL_KEYS,
    is_teacher_entry_key,
    teacher_entries_translation,
)


@dataclass
class Translation:
    """What `--from-verl` made of a command line: the table's rows and the scalerl values set."""

    rows: list[tuple[str, Any, str]]  # (verl key, value, scalerl key or "no effect here: why")
    values: dict[str, Any]  # scalerl dotted key -> value

    def table(self) -> str:
        width = max([len(r[0]) for r in self.rows] + [8])
        shown = [(k, _show(v), t) for k, v, t in self.rows]
        vwidth = min(max([len(v) for _, v, _ in shown] + [5]), 40)
        lines = [f"{'verl key':<{width}}  {'value':<{vwidth}}  scalerl"]
        lines += [f"{k:<{width}}  {v:<{vwidth}}  {t}" for k, v, t in shown]
        return "\n".join(lines)


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def parse_hydra_value(raw: str) -> Any:
    """A Hydra override's value as verl reads it: YAML, with `1e-6` a number (YAML 1.1 reads it as text)."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value):
        return float(value)
    return value


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`key=value` Hydra overrides (`+key=`/`++key=` too) as {dotted key: value}; later ones win."""
    given: dict[str, Any] = {}
    for arg in args:
        if arg.startswith("~") or "=" not in arg:
            raise ConfigError(f"--from-verl: {arg!r} is not a verl key=value override "
                              "(scalerl overrides go after a '--' separator)")
        key, raw = arg.split("=", 1)
        given[key.lstrip("+")] = parse_hydra_value(raw)
    return given


def _no_effect_reason(key: str) -> str | None:
    return next((why for pattern, why in NO_EFFECT if fnmatch.fnmatchcase(key, pattern)), None)


def translate(args: list[str]) -> Translation:
    """The scalerl values and table rows for verl overrides `args`; ConfigError names a key that cannot be."""
    given = parse_overrides(args)
    by_key = {k.verl: k for k in VERL_KEYS}
    known_targets = set(_all_keys(_config_class()))
    unknown = [k for k in given if k not in by_key and _no_effect_reason(k) is None and not is_teacher_entry_key(k)]
    if unknown:
        problems = [_unknown_key_problem(k, known_targets) for k in unknown]
        raise ConfigError("--from-verl: " + (problems[0] if len(problems) == 1 else
                                             f"{len(problems)} keys:\n  " + "\n  ".join(problems)))
    verl = {k.verl: k.default for k in VERL_KEYS if k.default is not NO_DEFAULT} | given
    rows, values = [], {}
    for entry in VERL_KEYS:
        if entry.verl not in verl:
            continue
        value, from_line = verl[entry.verl], entry.verl in given
        label = entry.verl if from_line else f"{entry.verl} (verl default)"
        inert = verl.get(entry.inert[1:]) if isinstance(entry.inert, str) and entry.inert.startswith("$") \
            else entry.inert
        if entry.only_if is not None and not entry.only_if(verl):
            reader = by_key.get(entry.read_by) if entry.read_by else None
            if from_line and reader is not None and reader.target is not None:
                rows.append((label, value, f"{reader.target} (read with {reader.verl})"))
            elif from_line:
                rows.append((label, value, f"no effect here: {entry.note or 'verl ignores it in this run'}"))
            continue
        if entry.target is None or entry.target not in known_targets:
            if inert is not NO_DEFAULT and value != inert:
                raise ConfigError(f"--from-verl: {entry.verl}={_show(value)} changes the run and scalerl has no "
                                  f"equivalent{': ' + entry.note if entry.note else ''} (only {_show(inert)} is "
                                  "accepted)")
            if from_line:
                rows.append((label, value, f"no effect here: {entry.note or 'the same as scalerl'}"))
            continue
        new = entry.transform(value, verl) if entry.transform else value
        values[entry.target] = new
        shown = entry.target if new == value else f"{entry.target}={_show(new)}"
        for target, transform in entry.also:  # further keys the same verl key sets
            values[target] = transform(value, verl)
            shown += f", {target}={_show(values[target])}"
        rows.append((label, value, shown + (f"  ({entry.note})" if entry.note and from_line else "")))
    teacher_rows, teacher_values = teacher_entries_translation(verl, given)  # distillation.teacher_models.<entry>.*
    rows += teacher_rows
    values.update(teacher_values)
    for key, value in given.items():
        if key not in by_key and not is_teacher_entry_key(key):
            rows.append((key, value, f"no effect here: {_no_effect_reason(key)}"))
    return Translation(rows, values)


def _verl_key_names() -> list[str]:
    """Every verl key the tables name literally (a pattern's wildcards match too much to suggest)."""
    return [k.verl for k in VERL_KEYS] + [pattern for pattern, _ in NO_EFFECT if "*" not in pattern]


def _unknown_key_problem(key: str, scalerl_keys: set[str]) -> str:
    """Why ``key`` is not taken: a scalerl key before the '--', or a verl key mistyped (did you mean), or one
    scalerl does not translate."""
    if key in scalerl_keys:
        return (f"{key} is a scalerl key, not one of verl's: scalerl keys go after a '--' "
                f"(--from-verl <verl keys> -- {key}=...)")
    close = difflib.get_close_matches(key, _verl_key_names(), n=1, cutoff=0.85)
    if close:
        return f"unknown verl key '{key}'; did you mean '{close[0]}'?"
    return (f"'{key}' is not a verl key scalerl translates (docs/configuration.md#from-verl lists them); "
            "scalerl keys go after a '--'")


def _config_class() -> type:
    from scalerl.core.config import (
        Config,  # same layer; imported late so the config package may import this module
    )

    return Config


def load_verl_config(args: list[str], scalerl_overrides: list[str] = ()) -> tuple[Any, Translation]:
    """The scalerl config of a verl command line (scalerl defaults <- translation <- `scalerl_overrides`)."""
    translation = translate(args)
    tree: dict[str, Any] = {}
    for key, value in translation.values.items():
        *sections, leaf = key.split(".")
        node = tree
        for s in sections:
            node = node.setdefault(s, {})
        node[leaf] = value
    cfg = config_from_dict(_config_class(), tree)
    for override in scalerl_overrides:
        apply_override(cfg, override)
    cfg.validate()
    return cfg, translation
