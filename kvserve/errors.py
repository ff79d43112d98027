"""Errors a user can cause: each carries a message meant for that user.

The CLI prints them as one line; the server maps them to HTTP statuses in one place
(``kvserve.server.errors.error_response``).
"""

from __future__ import annotations


class KVServeError(Exception):
    """Base class for user-facing errors."""


class InvalidArgumentError(KVServeError, ValueError):
    """A parameter is out of range or inconsistent (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class NotFoundError(KVServeError):
    """What the request names does not exist: a model, a route (HTTP 404)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class MissingPackageError(KVServeError):
    """A feature needs an optional package that is not installed (HTTP 501); the message names it."""

    CODE = "missing_package"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = self.CODE

    @classmethod
    def of(cls, feature: str, package: str, install: str | None = None, param: str | None = None) -> MissingPackageError:
        """The error for ``feature`` when ``package`` is missing, with the command that installs it."""
        return cls(f"{feature} needs the Python package {package}, which is not installed: "
                   f"{install or 'pip install ' + package}", param=param)


class ModelLoadError(KVServeError):
    """The model could not be found or read."""


class AuthenticationError(KVServeError):
    """A missing or wrong API key (HTTP 401)."""


class RequestTooLargeError(KVServeError):
    """The request body is over the server's limit (HTTP 413)."""


class ServerBusyError(KVServeError):
    """The engine's waiting queue is full; the client should retry later (HTTP 429)."""


class ServiceUnavailableError(KVServeError):
    """The server cannot serve this now, and will again: it sleeps, or a weight update aborted the
    request (HTTP 503); ``code`` says which ("sleeping", "weights_updated")."""

    CODES = ("sleeping", "weights_updated")

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.param = None
        self.code = code


class EngineDeadError(KVServeError):
    """The engine process is gone; nothing can be served until a restart (HTTP 503)."""
