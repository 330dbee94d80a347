"""Model workers: one model, many sessions -- what a drafter or verifier server wraps.

A worker holds per-session state (token ids + KV cache) in a bounded store (LRU + TTL). Every
call names the session and, where state matters, the caller's expectation of it (length and
CRC-32 of the ids): a missing session is :class:`NotFound`, a disagreeing one
:class:`FailedPrecondition`, and the caller answers both by re-sending the whole history with
``sync`` -- a cache miss costs a prefill, never a wrong token.

Workers are plain Python (no gRPC): the in-process engine calls them directly and the servers
translate messages to these calls, so both paths run the same code.
"""

from __future__ import annotations

import array
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .sessions import AllowedSet, DraftToken, DrafterSession, TargetSession, cost_numbers
from .errors import FailedPrecondition, InvalidArgument, NotFound, check_int, check_session_id
from .sampling import SamplingParams

def ids_crc32(ids) -> int:
    """CRC-32 of token ids as int32 little-endian bytes (the ContextCheck digest)."""
    a = array.array("i", ids)
    if array.array("i", [1]).tobytes()[0] != 1:  # big-endian host
        a.byteswap()
    return zlib.crc32(a.tobytes()) & 0xFFFFFFFF


@dataclass(frozen=True)
class WorkerConfig:
    """Limits of one model worker."""

    max_sessions: int = 64  # sessions kept (KV caches); the least recently used is dropped beyond this
    session_ttl_s: float = 600.0  # a session unused this long is dropped
    max_context_tokens: int = 0  # longest history accepted (0 = the model's own limit)

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise InvalidArgument("max_sessions", "must be >= 1")
        if not self.session_ttl_s > 0:
            raise InvalidArgument("session_ttl_s", "must be > 0")


class ModelSessionCache:
    """The model sessions (ids + KV cache) a worker holds, in memory: a bounded map with LRU eviction beyond max_sessions, expiry after ttl_s unused."""

    def __init__(self, max_sessions: int, ttl_s: float, clock=time.monotonic):
        self.max = max_sessions
        self.ttl = ttl_s
        self.clock = clock
        self._d: OrderedDict[str, tuple[float, object]] = OrderedDict()
        self.evicted = 0
        self.expired = 0

    def _expire(self) -> None:
        now = self.clock()
        for sid in [s for s, (t, _) in self._d.items() if now - t > self.ttl]:
            del self._d[sid]
            self.expired += 1

    def get(self, sid: str):
        self._expire()
        item = self._d.get(sid)
        if item is None:
            return None
        self._d[sid] = (self.clock(), item[1])
        self._d.move_to_end(sid)
        return item[1]

    def put(self, sid: str, value) -> None:
        self._expire()
        self._d[sid] = (self.clock(), value)
        self._d.move_to_end(sid)
        while len(self._d) > self.max:
            self._d.popitem(last=False)
            self.evicted += 1

    def pop(self, sid: str):
        item = self._d.pop(sid, None)
        return None if item is None else item[1]

    def __len__(self) -> int:
        self._expire()
        return len(self._d)


def _check_ids(name: str, ids, vocab: int) -> list[int]:
    ids = list(ids)
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        raise InvalidArgument(name, f"token ids must be in [0, {vocab})")
    return ids


@dataclass
class Expect:
    """The caller's view of a session: number of ids and their CRC-32."""

    length: int
    crc32: int

    @classmethod
    def of(cls, ids) -> "Expect":
        return cls(len(ids), ids_crc32(ids))


class _Worker:
    kind = "model"

    def __init__(self, loaded, cfg: WorkerConfig | None = None):
        self.loaded = loaded
        self.cfg = cfg or WorkerConfig()
        self.sessions = ModelSessionCache(self.cfg.max_sessions, self.cfg.session_ttl_s)
        self.lock = threading.RLock()  # one forward at a time per model
        self.instance_id = uuid.uuid4().hex[:12]
        self.vocab = int(loaded.vocab_size)
        limit = getattr(loaded.model.config, "max_position_embeddings", 0) or 0
        self.max_context = min(x for x in (limit, self.cfg.max_context_tokens) if x) if (limit or self.cfg.max_context_tokens) else 0
        self._cost = None
        self._timings: list[float] | None = None

    def _new_session(self, ids):
        raise NotImplementedError

    def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer as Hugging Face files (save_pretrained), computed once."""
        if getattr(self, "_tok_files", None) is None:
            import tempfile
            from pathlib import Path

            with tempfile.TemporaryDirectory() as d:
                self.loaded.tokenizer.save_pretrained(d)
                self._tok_files = {p.name: p.read_bytes() for p in sorted(Path(d).iterdir()) if p.is_file()}
        return self._tok_files

    def cost(self, head_rows: int | None = None) -> tuple[int, int, int]:
        if self._cost is None:
            self._cost = cost_numbers(self.loaded.model)
        body, row, rows = self._cost
        return body, row, rows if head_rows is None else head_rows

    def timings(self) -> list[float]:
        """Measured ms of one forward of 1..M tokens (crossdraft.costs); [] when measuring is off."""
        if self._timings is None:
            from . import costs

            with self.lock:
                if self._timings is None:
                    m = costs.VERIFIER_MAX if self.kind == "verifier" else costs.DRAFTER_MAX
                    self._timings = costs.forward_ms(self.loaded, m)
        return self._timings

    def info(self) -> dict:
        if getattr(self, "_digest", None) is None:
            from .vocab import tokenizer_digest

            self._digest = tokenizer_digest(self.loaded.tokenizer)
        body, row, rows = self.cost()
        return dict(
            model_name=self.loaded.name if getattr(self.loaded, "kind", "") == "catalog" else str(getattr(self.loaded, "path", self.loaded.name)),
            vocab_size=self.vocab, dtype=str(self.loaded.dtype).replace("torch.", ""),
            device=str(self.loaded.device), body_bytes=body, head_row_bytes=row, max_context_tokens=self.max_context,
            eos_token_ids=sorted(self.loaded.eos_token_ids), tokenizer_digest=self._digest, max_sessions=self.cfg.max_sessions,
            active_sessions=len(self.sessions), instance_id=self.instance_id, forward_ms=self.timings(),
        )

    def _get(self, sid: str):
        sess = self.sessions.get(check_session_id(sid))
        if sess is None:
            raise NotFound("session_id", f"session {sid!r} is not held by this {self.kind} (instance {self.instance_id})")
        return sess

    @staticmethod
    def _check(sess, expect: Expect | None, what: str) -> None:
        if expect is None:
            return
        if len(sess.ids) != expect.length or ids_crc32(sess.ids) != expect.crc32:
            raise FailedPrecondition(
                f"{what}: session holds {len(sess.ids)} tokens, caller expected {expect.length} (or a different history)")

    def _check_len(self, n: int) -> None:
        if self.max_context and n > self.max_context:
            raise InvalidArgument("token_ids", f"{n} tokens exceed the model's context ({self.max_context})")

    def sync(self, sid: str, ids) -> tuple[int, Expect]:
        """Create or align a session with the full history; returns (reused cache entries, state)."""
        check_session_id(sid)
        ids = _check_ids("token_ids", ids, self.vocab)
        if not ids:
            raise InvalidArgument("token_ids", "must not be empty")
        self._check_len(len(ids))
        with self.lock:
            sess = self.sessions.get(sid)
            if sess is None:
                sess = self._new_session(ids)
                self.sessions.put(sid, sess)
                reused = 0
            else:
                reused = sess.sync(ids)
            return reused, Expect.of(sess.ids)

    def end(self, sid: str) -> bool:
        with self.lock:
            return self.sessions.pop(check_session_id(sid)) is not None


@dataclass
class VerifyReply:
    num_accepted: int
    next_token: int
    accepted: list[bool]
    forward_s: float
    context: Expect


class VerifierWorker(_Worker):
    """The target model: verify blocks of drafts for many sessions."""

    kind = "verifier"

    def _new_session(self, ids):
        return TargetSession(self.loaded.model, ids, self.loaded.device)

    def verify(self, sid: str, expect: Expect | None, drafts, q_rows, round_index: int, params: SamplingParams,
               seed: int) -> VerifyReply:
        drafts = _check_ids("draft_token_ids", drafts, self.vocab)
        if round_index < 0:
            raise InvalidArgument("round_index", "must be >= 0")
        with self.lock:
            sess = self._get(sid)
            self._check(sess, expect, "verify")
            self._check_len(len(sess.ids) + len(drafts) + 1)
            res = sess.verify(drafts, q_rows if q_rows else None, round_index, params, seed)
            o = res.outcome
            return VerifyReply(o.num_accepted, o.next_token, list(o.accepted), res.forward_s, Expect.of(sess.ids))


class DrafterWorker(_Worker):
    """The drafter model: propose drafts restricted to registered allowed-id masks."""

    kind = "drafter"
    max_masks = 16

    def __init__(self, loaded, cfg: WorkerConfig | None = None):
        super().__init__(loaded, cfg)
        self.masks: OrderedDict[str, AllowedSet] = OrderedDict()
        self._all: AllowedSet | None = None

    def _new_session(self, ids):
        return DrafterSession(self.loaded.model, ids, self.loaded.device)

    def set_allowed(self, key: str, mask) -> int:
        if not isinstance(key, str) or not key or len(key) > 256:
            raise InvalidArgument("allowed_key", "must be a non-empty string of at most 256 characters")
        mask = np.asarray(mask, dtype=bool)
        if mask.ndim != 1:
            raise InvalidArgument("mask", "must be one-dimensional")
        if len(mask) > self.vocab:
            if mask[self.vocab:].any():
                raise InvalidArgument("mask", f"allows ids >= the drafter's vocabulary size ({self.vocab})")
            mask = mask[: self.vocab]
        full = np.zeros(self.vocab, dtype=bool)
        full[: len(mask)] = mask
        with self.lock:
            allowed = AllowedSet(self.loaded.model, full, self.loaded.device)
            self.masks[key] = allowed
            self.masks.move_to_end(key)
            while len(self.masks) > self.max_masks:
                self.masks.popitem(last=False)
            return allowed.count

    def allowed(self, key: str) -> AllowedSet:
        if not key:
            if self._all is None:
                self._all = AllowedSet(self.loaded.model, np.ones(self.vocab, dtype=bool), self.loaded.device)
            return self._all
        a = self.masks.get(key)
        if a is None:
            raise FailedPrecondition(f"allowed_key: unknown mask {key!r} (send SetAllowedTokens first)")
        return a

    def _edit(self, sess, edit, expect: Expect | None) -> None:
        if edit is not None:
            keep, append = edit
            append = _check_ids("edit.append", append, self.vocab)
            if keep > len(sess.ids):
                raise FailedPrecondition(f"edit: keep={keep} but the session holds {len(sess.ids)} tokens")
            self._check_len(keep + len(append))
            new = sess.ids[:keep] + append
            if expect is not None and (len(new) != expect.length or ids_crc32(new) != expect.crc32):
                raise FailedPrecondition(f"edit: the result would hold {len(new)} tokens, caller expected {expect.length} (or a different history)")
            sess.edit(keep, append)
        else:
            self._check(sess, expect, "draft")

    def commit(self, sid: str, edit, expect: Expect | None) -> Expect:
        with self.lock:
            sess = self._get(sid)
            self._edit(sess, edit, expect)
            return Expect.of(sess.ids)

    def draft_iter(self, sid: str, edit, expect: Expect | None, k: int, round_index: int, params: SamplingParams,
                   seed: int, stop_below: float, allowed_key: str):
        """Apply the edit, then yield up to k DraftTokens (holding the model lock while drafting)."""
        check_int("num_draft_tokens", k, 1, 64)
        if not 0.0 <= stop_below < 1.0:
            raise InvalidArgument("stop_below", f"must be in [0, 1), got {stop_below}")
        with self.lock:
            allowed = self.allowed(allowed_key)
            sess = self._get(sid)
            self._edit(sess, edit, expect)
            self._check_len(len(sess.ids) + k)
            it = sess.draft_iter(k, round_index, params, seed, allowed, stop_below)
        # the lock is taken per token, never held across a yield: a consumer that stops reading
        # (a cancelled stream) cannot block the model
        while True:
            with self.lock:
                tok = next(it, None)
            if tok is None:
                return
            yield tok

    def draft(self, sid: str, edit, expect: Expect | None, k: int, round_index: int, params: SamplingParams,
              seed: int, stop_below: float, allowed_key: str, timeout_s: float | None = None) -> list[DraftToken]:
        """The whole block at once (the round loop's DrafterPort.draft; timeout_s is for remote
        drafters: in process there is no wire to wait on)."""
        return list(self.draft_iter(sid, edit, expect, k, round_index, params, seed, stop_below, allowed_key))


__all__ = ["DrafterWorker", "Expect", "ModelSessionCache", "VerifierWorker", "VerifyReply", "WorkerConfig", "ids_crc32"]
