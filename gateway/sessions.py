"""Sessions in Redis: one JSON document per session (written whole, so every update is atomic)
plus a short lease that keeps two requests from running one session at the same time.

A turn changes the document once, when it completes (:meth:`RedisSessionStore.commit`: one SET of
the whole document, made only while the turn's request still holds the lease). A turn that fails
or is cancelled part-way writes nothing, so the session stays exactly as it was before that turn.

Redis errors become :class:`Unavailable` (HTTP 503 / gRPC UNAVAILABLE); nothing is half-written
because each write is a single SET of the whole document.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import redis

from crossdraft.errors import FailedPrecondition, NotFound, Unavailable, check_session_id

_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
_RENEW = ("if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) "
          "else return 0 end")
# KEYS: document, lease; ARGV: document, lease token, TTL in ms. 0: the session is gone (deleted or
# expired: it stays so); -1: the lease is no longer this request's; 1: written
_COMMIT = """
if redis.call('exists', KEYS[1]) == 0 then return 0 end
if redis.call('get', KEYS[2]) ~= ARGV[2] then return -1 end
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
"""


@dataclass
class Session:
    """One session as stored in Redis: its options, both token histories, messages, totals and placement."""

    session_id: str
    created_unix_s: float
    updated_unix_s: float
    options: dict = field(default_factory=dict)  # defaults for this session's requests
    kind: str = ""  # "" (nothing generated yet) | "text" | "chat"
    turns: int = 0
    target_ids: list[int] = field(default_factory=list)
    drafter_ids: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    text: str = ""
    round_index: int = 0  # rounds run so far: random draws of later turns never repeat earlier ones
    stats: dict = field(default_factory=dict)  # totals over the session's requests
    drafter_instance: str = ""  # instance id of the drafter process that holds the session's cache
    verifier_instance: str = ""
    drafter_address: str = ""  # the pod (host:port) the session's rounds go to while it is ready
    verifier_address: str = ""
    # a pool of drafter kinds (gateway/pool.py): the kind the session drafts with (its drafter_ids are in
    # that kind's vocabulary; "" = the gateway's first kind) and what each kind was worth to it
    drafter_kind: str = ""
    pool: dict = field(default_factory=dict)
    # with API keys on: a hash of the key that created the session (never the key); only that key
    # may read, continue or delete it -- others get NOT_FOUND, as for a session that does not exist
    owner: str = ""

    def to_json(self) -> str:
        # token ids as base64 of int32 little-endian: ~20x faster than a JSON list, and smaller
        """The session as one compact JSON document (token ids packed by _pack_ids)."""
        d = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}  # (not the store's bookkeeping)
        d["target_ids"] = _pack_ids(self.target_ids)
        d["drafter_ids"] = _pack_ids(self.drafter_ids)
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str | bytes) -> "Session":
        """Parse a to_json document (plain id lists are accepted too); unknown keys are dropped."""
        d = json.loads(s)
        for k in ("target_ids", "drafter_ids"):
            if isinstance(d.get(k), str):
                d[k] = _unpack_ids(d[k])
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def _pack_ids(ids) -> str:
    """Token ids as base64 of int32 little-endian."""
    return base64.b64encode(np.asarray(ids, dtype="<i4").tobytes()).decode("ascii")


def _unpack_ids(s: str) -> list[int]:
    """The inverse of _pack_ids."""
    return np.frombuffer(base64.b64decode(s), dtype="<i4").tolist()


def redact_url(url: str) -> str:
    """The URL without its user and password (safe for logs and error messages)."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid URL>"
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def server_session_id(sid: str, owner: str = "") -> str:
    """The id a session has on the model servers. With API keys on, two keys may each have a session
    of the same id (each key's sessions are a namespace of their own), so the key's owner hash goes
    into it: their caches on a verifier or drafter must never meet. At most 64 characters of the
    session id alphabet, one per (owner, id): an id longer than 47 characters keeps its first 30
    and a hash of the whole."""
    if not owner:
        return sid
    if len(sid) > 47:
        sid = f"{sid[:30]}-{hashlib.sha256(sid.encode()).hexdigest()[:16]}"
    return f"{sid}-{owner[:16]}"


class RedisSessionStore:
    """Session documents and per-session leases in Redis; a session expires ttl_s after its last write."""

    def __init__(self, url: str, ttl_s: float = 3600.0, prefix: str = "crossdraft:", lease_s: float = 600.0,
                 password: str = "", tls_ca_file: str = ""):
        """url: redis://host:port/db or rediss:// (TLS; the server is verified with tls_ca_file, or the
        system roots); password: Redis AUTH (overrides one in the URL). Messages never show either."""
        self.url = redact_url(url)
        self.ttl_ms = int(ttl_s * 1000)
        self.lease_ms = int(lease_s * 1000)
        self.prefix = prefix
        kw = {}
        if password:
            kw["password"] = password
        if tls_ca_file:
            kw["ssl_ca_certs"] = tls_ca_file
        self.r = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0, **kw)

    def _key(self, sid: str, owner: str = "") -> str:
        """The Redis key of session `sid`'s document (its lease is this key + ':lease'). With API keys
        on, each key's sessions live under its owner hash: another key may use the same id, and
        learns nothing about this one's sessions (a create of a taken id is not refused). A session
        id has no ':', so the two forms never meet."""
        return f"{self.prefix}session:{sid}" if not owner else f"{self.prefix}session:{owner[:32]}:{sid}"

    def _doc_key(self, s: Session) -> str:
        """Where session `s` was read from: a session created with a key before per-key namespaces
        existed stays at its old key (its owner is checked on reading it)."""
        return getattr(s, "_store_key", None) or self._key(s.session_id, s.owner)

    def _do(self, fn, *args):
        """Run one Redis call; a Redis error becomes Unavailable."""
        try:
            return fn(*args)
        except redis.RedisError as e:
            raise Unavailable(f"session store (Redis at {self.url}) unavailable: {type(e).__name__}: {e}") from None

    def ping(self) -> bool:
        """Whether Redis answers; never raises."""
        try:
            return bool(self.r.ping())
        except redis.RedisError:
            return False

    def create(self, options: dict, session_id: str | None = None, owner: str = "") -> Session:
        """Store a new empty session (the given id, else a random one); FailedPrecondition if it exists."""
        sid = check_session_id(session_id) if session_id else uuid.uuid4().hex
        now = time.time()
        s = Session(sid, now, now, options=options, owner=owner)
        ok = self._do(lambda: self.r.set(self._key(sid, owner), s.to_json(), px=self.ttl_ms, nx=True))
        if not ok:
            raise FailedPrecondition(f"session_id: session {sid!r} already exists")
        return s

    def get(self, sid: str, owner: str | None = None) -> Session:
        """Load session `sid`; NotFound if it was never created, was deleted or has expired -- or,
        when ``owner`` is given, belongs to another API key (indistinguishable on purpose)."""
        check_session_id(sid)
        key = self._key(sid, owner or "")
        raw = self._do(self.r.get, key)
        if raw is None and owner:  # created with this key before keys had namespaces: its old place
            key = self._key(sid)
            raw = self._do(self.r.get, key)
        s = Session.from_json(raw) if raw is not None else None
        if s is None or (owner is not None and s.owner != owner):
            raise NotFound("session_id", f"no session {sid!r} (never created, deleted, or expired)")
        s._store_key = key
        return s

    def save(self, s: Session) -> bool:
        """Write the whole session back, stamping updated_unix_s and restarting its TTL -- only if it
        still exists: a session deleted while a request on it runs stays deleted. Whether it was saved."""
        s.updated_unix_s = time.time()
        key = self._doc_key(s)
        return bool(self._do(lambda: self.r.set(key, s.to_json(), px=self.ttl_ms, xx=True)))

    def commit(self, s: Session, lease: str) -> bool:
        """Write a completed turn: the whole session in one SET, stamping updated_unix_s and
        restarting its TTL, only while ``lease`` (the token :meth:`acquire` gave this request) still
        holds the session's lease. Whether it was written: False when the session was deleted (or
        expired) while the turn ran -- it stays deleted. FailedPrecondition, with nothing written,
        when the lease expired and may belong to another request now: that request's turn is not
        overwritten by one that started from an older state."""
        s.updated_unix_s = time.time()
        key = self._doc_key(s)
        r = self._do(lambda: self.r.eval(_COMMIT, 2, key, f"{key}:lease", s.to_json(), lease, self.ttl_ms))
        if int(r) < 0:
            raise FailedPrecondition(f"session_id: session {s.session_id!r} was not updated: this request's lease "
                                     "on it expired before the turn completed (retry the turn)")
        return bool(r)

    def renew(self, s: Session, lease: str) -> bool:
        """Restart the lease's expiry (lease_s) if ``lease`` still holds it. Whether it does;
        Redis errors count as not renewed (the turn's commit reports them)."""
        try:
            return bool(self.r.eval(_RENEW, 1, f"{self._doc_key(s)}:lease", lease, self.lease_ms))
        except redis.RedisError:
            return False

    def delete(self, s: Session) -> bool:
        """Delete session `s` (as :meth:`get` returned it); whether it still existed."""
        return bool(self._do(self.r.delete, self._doc_key(s)))

    def acquire(self, s: Session) -> str:
        """Take the session's lease (one request at a time); returns its token; FailedPrecondition if busy."""
        token = uuid.uuid4().hex
        ok = self._do(lambda: self.r.set(f"{self._doc_key(s)}:lease", token, px=self.lease_ms, nx=True))
        if not ok:
            raise FailedPrecondition(f"session_id: session {s.session_id!r} is busy with another request")
        return token

    def release(self, s: Session, token: str) -> None:
        """Drop the lease if `token` still holds it; Redis errors are ignored (the lease expires)."""
        try:
            self.r.eval(_RELEASE, 1, f"{self._doc_key(s)}:lease", token)
        except redis.RedisError:
            pass  # the lease expires by itself
