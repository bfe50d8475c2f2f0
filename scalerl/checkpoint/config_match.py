"""Does a checkpoint's saved config fit the run that resumes it? Dotted-key comparison with clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scalerl.checkpoint.layout import CheckpointError

_MISSING = "<absent>"


def canonical_json(obj: Any) -> str:
    """Key-sorted JSON; non-JSON leaves (paths, enums) become strings so the fingerprint is stable."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def check_config(path: Path, saved: dict | None, expected: dict, keys: list[str] | None) -> None:
    """``keys`` (dotted; all keys when None) must be equal in the saved and the expected config."""
    saved = saved or {}
    expected = json.loads(canonical_json(expected))  # tuples -> lists etc., as the saved copy went
    if keys is None:
        keys = sorted(set(_flatten(saved)) | set(_flatten(expected)))
    mismatches = [
        f"{key!r}: saved {_lookup(saved, key)!r}, current {_lookup(expected, key)!r}"
        for key in keys
        if _lookup(saved, key) != _lookup(expected, key)
        # a key the saving version did not have matches that feature left off (null, 0, false, empty)
        and not (_lookup(saved, key) is _MISSING and _lookup(expected, key) in (None, 0, False, {}, [], ""))
    ]
    if mismatches:
        raise CheckpointError(f"config of checkpoint {path} does not match: " + "; ".join(mismatches))


def _flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _lookup(config: dict, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value
