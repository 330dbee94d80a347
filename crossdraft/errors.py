"""Error types shared by the core, the CLI and (later) the services.

Every user-facing error names what was wrong, so that a gRPC service can map it to
INVALID_ARGUMENT / NOT_FOUND and a REST API to a 4xx with the field in the message.
"""

from __future__ import annotations


class CrossdraftError(Exception):
    """Base class of every error crossdraft raises on purpose."""


class InvalidArgument(CrossdraftError, ValueError):
    """A caller-supplied value is out of range or malformed. ``field`` names the argument."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class ModelError(CrossdraftError):
    """A model could not be found, downloaded, assembled, converted or loaded."""


class UnknownModel(ModelError, KeyError):
    """A model name is neither in the catalog nor an existing local path."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown model"


class NotFound(CrossdraftError, KeyError):
    """A named thing (a session, an allowed-token mask) does not exist. ``what`` names it."""

    def __init__(self, what: str, message: str):
        self.what = what
        super().__init__(f"{what}: {message}")

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


class FailedPrecondition(CrossdraftError):
    """The caller's view of a session disagrees with the server's (re-sync and retry)."""


class Unavailable(CrossdraftError):
    """A dependency (Redis, the verifier, the drafter) cannot be reached right now."""


class ResourceExhausted(CrossdraftError):
    """A bounded resource (sessions, request size) is full."""


class Unauthenticated(CrossdraftError):
    """The caller did not present a valid credential."""
