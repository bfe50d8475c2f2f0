"""The two kinds of error a run ends with that are not bugs in scalerl, and how the CLI reports them.

- `UserError`: the input cannot be used (a config key, a file, a data row, a flag, the environment a
  launcher set). Its message names the bad thing and the fix; the CLI prints `error: <message>` and exits 2,
  without a traceback. Every package's own input-error class derives from it (`ConfigError`, `DataError`,
  `CheckpointError`, `LayoutError`, ...), so the CLI needs no list of them and imports no torch to know them.
- `RunFailure`: a run that started and cannot go on (a rank that froze or died, repeated skipped optimizer
  steps). Its message says what happened and where the last good checkpoint is; the CLI prints
  `error: <message>` and exits 1.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: the message names the file, key or value at fault and how to fix it (exit code 2)."""

    exit_code = 2


class RunFailure(RuntimeError):
    """A started run that cannot continue; the message names the cause and the last good checkpoint (exit 1)."""

    exit_code = 1
