"""Errors a user can cause: each carries a message meant for that user.

The CLI prints them as one line; the server maps them to HTTP 4xx in one place.
"""


class KVServeError(Exception):
    """Base class for user-facing errors."""


class InvalidArgumentError(KVServeError, ValueError):
    """A parameter is out of range or inconsistent (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelLoadError(KVServeError):
    """The model could not be found or read."""
