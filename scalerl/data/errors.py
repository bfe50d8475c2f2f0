"""The one error type of the data package: bad files, bad rows and bad task settings."""

from scalerl.core.errors import UserError


class DataError(UserError, ValueError):
    """Input data (a file, a row, or a task setting) cannot be used; the message names it and the fix."""
