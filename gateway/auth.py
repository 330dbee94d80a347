"""API keys: who may call the gateway (``Authorization: Bearer <key>``) and who owns the sessions a
caller creates (a hash of its key, so that Redis never holds a key)."""

from __future__ import annotations

import hashlib
import hmac
from typing import TYPE_CHECKING

from crossdraft.errors import Unauthenticated

if TYPE_CHECKING:
    from .config import GatewayConfig


def _bearer(authorization: str | None) -> str:
    """The key of an "Authorization: Bearer <key>" header ("" if it is not one)."""
    token = (authorization or "").strip()
    return token[7:].strip() if token[:7].lower() == "bearer " else ""


def check_api_key(cfg: GatewayConfig, authorization: str | None) -> None:
    """Raise Unauthenticated unless keys are off or `authorization` is "Bearer <a configured key>"."""
    if not cfg.api_keys:
        return
    token = _bearer(authorization)
    if not token or not any(hmac.compare_digest(token, k) for k in cfg.api_keys):
        raise Unauthenticated("authorization: missing or invalid API key (send 'Authorization: Bearer <key>')")


def key_owner(cfg: GatewayConfig, authorization: str | None) -> str:
    """Who owns the sessions a caller creates: a hash of its API key ("" with keys off). Redis
    stores this, never the key."""
    if not cfg.api_keys:
        return ""
    token = _bearer(authorization)
    return hashlib.sha256(b"crossdraft-session-owner\0" + token.encode("utf-8", "replace")).hexdigest()
