"""The one error type of the data package: bad files, bad rows and bad task settings."""


class DataError(ValueError):
    """Input data (a file, a row, or a task setting) cannot be used; the message names it and the fix."""
