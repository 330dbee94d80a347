"""Error types shared by the core, the CLI and (later) the services.

Every user-facing error names what was wrong, so that a gRPC service can map it to
INVALID_ARGUMENT / NOT_FOUND and a REST API to a 4xx with the field in the message.
"""

from __future__ import annotations

import re


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


# ---- argument checks shared by every entry point (one rule each) --------------------------------


def check_int(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    """An integer (bool is not one) within [lo, hi]; InvalidArgument naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(name, f"must be an integer, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise InvalidArgument(name, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise InvalidArgument(name, f"must be <= {hi}, got {value}")
    return value


def check_number(name: str, value) -> float:
    """A real number (bool is not one), returned as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(name, f"must be a number, got {type(value).__name__}")
    return float(value)


# One rule for session ids, everywhere (the gateway's sessions and the model servers' sessions):
# 1-64 letters, digits, '-' or '_'.
SESSION_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_session_id(sid, field: str = "session_id") -> str:
    """A valid session id (see SESSION_ID_RE); InvalidArgument naming the field otherwise."""
    if not isinstance(sid, str) or not SESSION_ID_RE.match(sid):
        raise InvalidArgument(field, "must be 1-64 characters of letters, digits, '-' or '_'")
    return sid
