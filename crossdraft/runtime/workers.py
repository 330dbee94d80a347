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

import threading
import time
import uuid
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from crossdraft.decoding.messages import DraftToken, Expect, VerifyReply, ids_crc32
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.errors import FailedPrecondition, InvalidArgument, NotFound, check_int, check_session_id
from crossdraft.runtime.sessions import AllowedSet, DrafterSession, TargetSession, cost_numbers

# optional behaviours both model servers implement (ModelInfo.features)
FEATURES = ("coupled_draws",)


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
    """The model sessions (ids + KV cache) a worker holds, in memory: a bounded map with LRU
    eviction beyond max_sessions and expiry after ttl_s unused. ``on_drop(value)`` runs for every
    session dropped by eviction or expiry (the worker releases its KV cache there)."""

    def __init__(self, max_sessions: int, ttl_s: float, clock=time.monotonic, on_drop=None):
        self.max = max_sessions
        self.ttl = ttl_s
        self.clock = clock
        self.on_drop = on_drop or (lambda value: None)
        self._d: OrderedDict[str, tuple[float, object]] = OrderedDict()
        self.evicted = 0
        self.expired = 0

    def _expire(self) -> None:
        now = self.clock()
        for sid in [s for s, (t, _) in self._d.items() if now - t > self.ttl]:
            _, value = self._d.pop(sid)
            self.expired += 1
            self.on_drop(value)

    def oldest_first(self) -> list[tuple[str, object]]:
        """(sid, value) from the least recently used on."""
        return [(sid, v) for sid, (_, v) in self._d.items()]

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
            _, (_, old) = self._d.popitem(last=False)
            self.evicted += 1
            self.on_drop(old)

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


def _check_draws(round_index: int, seed: int) -> None:
    """The random draws hash (seed, round, position, stream) as signed 64-bit integers: the upper half
    of the wire's uint64 has no draws (the gateway's seeds are < 2^63 too)."""
    check_int("round_index", round_index, 0, 2**63 - 1)
    check_int("seed", seed, 0, 2**63 - 1)


class _Worker:
    """One model and its sessions.

    Without batching (the in-process engine; ``--batching off``) every call holds ``lock`` for its
    whole length: one forward at a time, each session with its own cache. With a
    :class:`~crossdraft.runtime.batching.BatchConfig`, the sessions' KV caches are slots of one
    preallocated pool and their forwards are batched by a scheduler thread; a call then holds only
    its own session's lock, and ``lock`` guards the session map for a moment.
    """

    kind = "model"

    def __init__(self, loaded, cfg: WorkerConfig | None = None, batch=None):
        self.loaded = loaded
        self.cfg = cfg or WorkerConfig()
        self.sessions = ModelSessionCache(self.cfg.max_sessions, self.cfg.session_ttl_s, on_drop=self._dropped)
        self.lock = threading.RLock()
        self.instance_id = uuid.uuid4().hex[:12]
        self.vocab = int(loaded.vocab_size)
        limit = getattr(loaded.model.config, "max_position_embeddings", 0) or 0
        ctx = self.cfg.max_context_tokens
        self.max_context = min(x for x in (limit, ctx) if x) if (limit or ctx) else 0
        self._cost = None
        self._timings: list[float] | None = None
        self._busy = 0  # calls inside the worker now (the scheduler waits for rows only while > its batch)
        self.evicted_for_memory = 0
        self.batch = batch if batch is not None and batch.enabled else None
        self.scheduler = None
        self.kv_pool_bytes = 0
        if self.batch is not None:
            from crossdraft.runtime.batching import BatchScheduler, pool_tokens
            from crossdraft.runtime.kvpool import KVPool, available_memory, kv_bytes_per_token

            per_token = kv_bytes_per_token(loaded.model)
            device = next(loaded.model.parameters()).device
            tokens = pool_tokens(self.batch, self.cfg.max_sessions, self.max_context, per_token,
                                 available_memory(device), device.type)
            pool = KVPool(loaded.model, max_tokens=tokens, block_size=self.batch.block_size)
            self.kv_pool_bytes = pool.blocks_total * pool.block_size * per_token
            self.scheduler = BatchScheduler(loaded.model, pool, self.batch, evict=self._evict_for,
                                            busy=lambda: self._busy)

    def _new_session(self, ids):
        raise NotImplementedError

    def _kv(self):
        """Where a new session keeps its keys and values (None: its own cache)."""
        if self.scheduler is None:
            return None
        from crossdraft.runtime.batching import PooledKV

        return PooledKV(self.scheduler)

    @staticmethod
    def _dropped(sess) -> None:
        sess.close()

    def _evict_for(self, blocks: int) -> bool:
        """Scheduler thread, KV pool full: drop idle sessions, least recently used first, until
        `blocks` blocks are free. A busy session (its call holds its lock) is never dropped."""
        pool = self.scheduler.pool
        with self.lock:
            for sid, sess in self.sessions.oldest_first():
                if pool.blocks_total - pool.blocks_used >= blocks:
                    break
                if not sess.lock.acquire(blocking=False):
                    continue
                try:
                    self.sessions.pop(sid)
                    sess.close()
                    self.evicted_for_memory += 1
                finally:
                    sess.lock.release()
        return pool.blocks_total - pool.blocks_used >= blocks

    @contextmanager
    def _using(self, sid: str, create_ids=None):
        """Hold session `sid` for one call (NotFound if it is not held; created from create_ids)."""
        check_session_id(sid)
        with self._counted():
            with self.lock:
                sess = self.sessions.get(sid)
                created = False
                if sess is None:
                    if create_ids is None:
                        raise NotFound("session_id", f"session {sid!r} is not held by this {self.kind} "
                                                     f"(instance {self.instance_id})")
                    sess = self._new_session(create_ids)
                    sess.lock = threading.Lock()
                    self.sessions.put(sid, sess)
                    created = True
            guard = self.lock if self.scheduler is None else sess.lock
            with guard:
                if sess.closed:  # evicted between the lookup and the lock: the caller re-syncs
                    raise NotFound("session_id", f"session {sid!r} was evicted from this {self.kind} "
                                                 f"(instance {self.instance_id}) to free KV memory")
                yield sess, created

    @contextmanager
    def _counted(self):
        with self.lock:
            self._busy += 1
        try:
            yield
        finally:
            with self.lock:
                self._busy -= 1

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
        """Measured ms of one forward of 1..M tokens (crossdraft.runtime.costs); [] when measuring is off."""
        if self._timings is None:
            from crossdraft.runtime import costs

            with self.lock:
                if self._timings is None:
                    m = costs.VERIFIER_MAX if self.kind == "verifier" else costs.DRAFTER_MAX
                    self._timings = costs.forward_ms(self.loaded, m)
                    if self.scheduler is not None and self._timings:
                        self.scheduler.cost_ms = list(self._timings)  # (it cuts batches by their cost)
                        self.scheduler.prices.set_prior(self._timings)  # (the price's prior)
        return self._timings

    def price(self):
        """The batch scheduler's current price of a forward (crossdraft.runtime.price); None unbatched."""
        return self.scheduler.prices.price() if self.scheduler is not None else None

    def info(self) -> dict:
        if getattr(self, "_digest", None) is None:
            from crossdraft.vocab.tokenbytes import tokenizer_digest

            self._digest = tokenizer_digest(self.loaded.tokenizer)
        if getattr(self, "_files_digest", None) is None:
            import hashlib

            h = hashlib.sha256()
            for name, content in self.tokenizer_files().items():  # sorted by name
                h.update(name.encode() + b"\0" + len(content).to_bytes(8, "little") + content)
            self._files_digest = h.hexdigest()
        body, row, rows = self.cost()
        by_name = getattr(self.loaded, "kind", "") in ("catalog", "hub")  # a Hub model is named by its repo id
        return dict(
            model_name=self.loaded.name if by_name else str(getattr(self.loaded, "path", self.loaded.name)),
            revision=getattr(self.loaded, "revision", "") or "",
            vocab_size=self.vocab, dtype=str(self.loaded.dtype).replace("torch.", ""),
            device=str(self.loaded.device), body_bytes=body, head_row_bytes=row, max_context_tokens=self.max_context,
            eos_token_ids=sorted(self.loaded.eos_token_ids), tokenizer_digest=self._digest,
            tokenizer_files_digest=self._files_digest,
            max_sessions=self.cfg.max_sessions,
            active_sessions=len(self.sessions), instance_id=self.instance_id, forward_ms=self.timings(),
            features=list(FEATURES), **self._kv_info(),
        )

    def _kv_info(self) -> dict:
        if self.scheduler is None:
            return {}
        pool = self.scheduler.pool
        return dict(kv_blocks_total=pool.blocks_total, kv_blocks_used=pool.blocks_used, kv_block_size=pool.block_size,
                    max_batch_rows=self.batch.max_rows)

    @staticmethod
    def _check(sess, expect: Expect | None, what: str) -> None:
        if expect is None:
            return
        if len(sess.ids) != expect.length or ids_crc32(sess.ids) != expect.crc32:
            raise FailedPrecondition(
                f"{what}: session holds {len(sess.ids)} tokens, caller expected {expect.length} "
                "(or a different history)")

    @staticmethod
    def _check_dropping(sess, expect: Expect | None) -> None:
        """drop_last_token: the session must hold the expected history plus one id (else nothing is
        dropped and the caller re-syncs)."""
        if expect is not None and (len(sess.ids) != expect.length + 1 or ids_crc32(sess.ids[:-1]) != expect.crc32):
            raise FailedPrecondition(
                f"verify: drop_last_token needs the expected {expect.length} tokens plus one; the session "
                f"holds {len(sess.ids)} (or a different history)")

    def _check_len(self, n: int, field: str = "token_ids") -> None:
        """`field`: the request's field that made the history too long (errors name it)."""
        if self.max_context and n > self.max_context:
            raise InvalidArgument(field, f"{n} tokens exceed the model's context ({self.max_context})")

    def sync(self, sid: str, ids, prefill: bool = False) -> tuple[int, Expect]:
        """Create or align a session with the full history; returns (reused cache entries, state).
        prefill: also compute the keys and values of all ids but the last now (a prompt that
        :meth:`fork` then shares); otherwise the next verify or draft feeds them."""
        check_session_id(sid)
        ids = _check_ids("token_ids", ids, self.vocab)
        if not ids:
            raise InvalidArgument("token_ids", "must not be empty")
        self._check_len(len(ids))
        with self._using(sid, create_ids=ids) as (sess, created):
            reused = 0 if created else sess.sync(ids)
            if prefill:
                sess.prefill()
            return reused, Expect.of(sess.ids)

    def fork(self, src: str, dst: str) -> tuple[int, Expect]:
        """Session `dst` becomes a copy of `src`: the same history and the same cached keys and
        values, shared in the batched KV pool until either session writes (copied otherwise).
        An existing `dst` is replaced. Returns (cache entries shared, dst's state)."""
        check_session_id(src, "source_session_id")
        check_session_id(dst)
        if src == dst:
            raise InvalidArgument("session_id", "must differ from source_session_id")
        try:
            with self._using(src) as (sess, _):
                new = sess.fork()
        except NotFound as e:
            raise NotFound("source_session_id", str(e).split(": ", 1)[-1]) from None
        new.lock = threading.Lock()
        with self.lock:
            old = self.sessions.pop(dst)
            self.sessions.put(dst, new)
        if old is not None:
            with (self.lock if self.scheduler is None else old.lock):
                old.close()
        return new.cache_len, Expect.of(new.ids)

    def end(self, sid: str) -> bool:
        check_session_id(sid)
        with self.lock:
            sess = self.sessions.pop(sid)
        if sess is None:
            return False
        with (self.lock if self.scheduler is None else sess.lock):
            sess.close()
        return True

    def batch_info(self) -> dict:
        """KV pool occupancy and batching counters (empty without batching)."""
        if self.scheduler is None:
            return {}
        pool, st = self.scheduler.pool, self.scheduler.stats
        return dict(kv_blocks_total=pool.blocks_total, kv_blocks_used=pool.blocks_used, kv_block_size=pool.block_size,
                    kv_occupancy=pool.occupancy, batches=st.batches, batch_rows=st.rows, batch_tokens=st.tokens,
                    evictions=self.evicted_for_memory, exhausted=st.exhausted)


class VerifierWorker(_Worker):
    """The target model: verify blocks of drafts for many sessions."""

    kind = "verifier"

    def _new_session(self, ids):
        return TargetSession(self.loaded.model, ids, self.loaded.device, kv=self._kv())

    def verify(self, sid: str, expect: Expect | None, drafts, q_rows, round_index: int, params: SamplingParams,
               seed: int, top_logprobs: int = -1, drop_last: bool = False, gang: int = 0) -> VerifyReply:
        """drop_last: first drop the session's last id (pipelined rounds: TargetSession.drop_last);
        ``expect`` is the history after the drop. gang: the rows the client sends together with this one
        (the batch waits briefly for them: BatchScheduler.expect_gang)."""
        drafts = _check_ids("draft_token_ids", drafts, self.vocab)
        _check_draws(round_index, seed)
        from crossdraft.runtime.sessions import MAX_TOP_LOGPROBS

        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or \
                not -1 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}] (or -1: none), "
                                                  f"got {top_logprobs!r}")
        with self._using(sid) as (sess, _):
            if drop_last:
                self._check_dropping(sess, expect)
                sess.drop_last()
            self._check(sess, expect, "verify")
            self._check_len(len(sess.ids) + len(drafts) + 1, "draft_token_ids")
            if gang > 1 and self.scheduler is not None:
                self.scheduler.expect_gang(gang)
            res = sess.verify(drafts, q_rows if q_rows else None, round_index, params, seed, top_logprobs)
            o = res.outcome
            last = getattr(sess.kv, "last", None)
            return VerifyReply(o.num_accepted, o.next_token, list(o.accepted), res.forward_s, Expect.of(sess.ids),
                               batch_size=last.batch_rows if last else 1,
                               queue_wait_s=last.queue_wait_s if last else 0.0,
                               active_sessions=last.active_sessions if last else 1, logprobs=res.logprobs,
                               price=self.price())


class DrafterWorker(_Worker):
    """The drafter model: propose drafts restricted to registered allowed-id masks."""

    kind = "drafter"
    max_masks = 16

    def __init__(self, loaded, cfg: WorkerConfig | None = None, batch=None):
        super().__init__(loaded, cfg, batch)
        self.masks: OrderedDict[str, AllowedSet] = OrderedDict()
        self._all: AllowedSet | None = None
        self._token_bytes = None  # crossdraft.vocab.healing.TokenBytes, built at the first healing request

    def token_bytes(self):
        """This vocabulary's id -> bytes table for token healing (the same table the gateway's
        vocabulary pair uses: crossdraft.vocab.tokenbytes.token_bytes of the served tokenizer)."""
        if self._token_bytes is None:
            from crossdraft.vocab.healing import TokenBytes
            from crossdraft.vocab.tokenbytes import token_bytes

            table = TokenBytes(token_bytes(self.loaded.tokenizer))
            with self.lock:
                self._token_bytes = self._token_bytes or table
        return self._token_bytes

    def _new_session(self, ids):
        return DrafterSession(self.loaded.model, ids, self.loaded.device, kv=self._kv())

    def set_allowed(self, key: str, mask, target_ids=None) -> int:
        """Register `mask` under `key`; target_ids: the target id of each allowed id, ascending
        drafter-id order (coupled draws; None = unknown)."""
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
            allowed = AllowedSet(self.loaded.model, full, self.loaded.device, target_ids)
            self.masks[key] = allowed
            self.masks.move_to_end(key)
            while len(self.masks) > self.max_masks:
                self.masks.popitem(last=False)
            return allowed.count

    def allowed(self, key: str) -> AllowedSet:
        if not key:
            if self._all is None:
                # no mask: the same vocabulary, each id its own target id
                self._all = AllowedSet(self.loaded.model, np.ones(self.vocab, dtype=bool), self.loaded.device,
                                       np.arange(self.vocab))
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
            self._check_len(keep + len(append), "edit.append")
            new = sess.ids[:keep] + append
            if expect is not None and (len(new) != expect.length or ids_crc32(new) != expect.crc32):
                raise FailedPrecondition(f"edit: the result would hold {len(new)} tokens, caller expected "
                                         f"{expect.length} (or a different history)")
            sess.edit(keep, append)
        else:
            self._check(sess, expect, "draft")

    def commit(self, sid: str, edit, expect: Expect | None) -> Expect:
        with self._using(sid) as (sess, _):
            self._edit(sess, edit, expect)
            sess.calls += 1
            return Expect.of(sess.ids)

    def draft_iter(self, sid: str, edit, expect: Expect | None, k: int, round_index: int, params: SamplingParams,
                   seed: int, stop_below: float, allowed_key: str, stop_cumulative: float = 0.0, heal: bool = False,
                   position: int = -1, runner_up: bool = False, gang: int = 0):
        """Apply the edit, then yield up to k DraftTokens (holding the model lock while drafting).

        heal: token healing of the session's last id (greedy only; crossdraft.vocab.healing). position: the
        target-side position of the first proposal (coupled draws; -1 = unknown). runner_up (greedy): each
        token also carries its probability and the drafter's second choice (DraftRequest.runner_up). gang:
        the sessions the client starts drafting with this one (BatchScheduler.expect_gang)."""
        check_int("num_draft_tokens", k, 1, 64)
        if heal and not params.greedy:
            raise InvalidArgument("heal", "token healing is for greedy drafting only (temperature 0)")
        _check_draws(round_index, seed)
        # proposal i of the block draws at position + i, hashed as a signed 64-bit integer
        check_int("position", position, -1, 2**62)
        if not 0.0 <= stop_below < 1.0:
            raise InvalidArgument("stop_below", f"must be in [0, 1), got {stop_below}")
        if not 0.0 <= stop_cumulative < 1.0:
            raise InvalidArgument("stop_cumulative_below", f"must be in [0, 1), got {stop_cumulative}")
        with self.lock:
            allowed = self.allowed(allowed_key)
        t_enter = time.perf_counter()
        with self._using(sid) as (sess, _):
            # the wait for the session (its previous block's step in progress, e.g. a block drafted ahead
            # and cancelled) is the drafter's compute on this call's path: its first token reports it as
            # queue wait, part of its forward time
            held = time.perf_counter() - t_enter
            self._edit(sess, edit, expect)
            self._check_len(len(sess.ids) + k, "num_draft_tokens")
            if gang > 1 and self.scheduler is not None:
                self.scheduler.expect_gang(gang)
            it = sess.draft_iter(k, round_index, params, seed, allowed, stop_below, stop_cumulative,
                                 heal=self.token_bytes() if heal else None, position=position, runner_up=runner_up)
            sess.calls += 1
            mine = sess.calls
        # the session is held per token, never across a yield: a consumer that stops reading (a
        # cancelled stream) blocks nothing, and a later call on the session ends this block
        while True:
            with self._using(sid) as (now, _):
                if now is not sess:
                    raise FailedPrecondition(f"session {sid!r} was replaced while drafting")
                if now.calls != mine:
                    return
                tok = next(it, None)
            if tok is None:
                return
            if held:
                tok.forward_s += held
                tok.queue_s += held
                held = 0.0
            yield tok

    def draft(self, sid: str, edit, expect: Expect | None, k: int, round_index: int, params: SamplingParams,
              seed: int, stop_below: float, allowed_key: str, timeout_s: float | None = None,
              stop_cumulative: float = 0.0, heal: bool = False, position: int = -1, cancel=None,
              runner_up: bool = False, gang: int = 0) -> list[DraftToken]:
        """The whole block at once (the round loop's DrafterPort.draft; timeout_s is for remote
        drafters: in process there is no wire to wait on). cancel: ``is_set()`` is asked once after each
        token (DrafterPort.draft); True ends the block there."""
        toks = []
        for tok in self.draft_iter(sid, edit, expect, k, round_index, params, seed, stop_below, allowed_key,
                                   stop_cumulative, heal, position, runner_up, gang):
            toks.append(tok)
            if cancel is not None and cancel.is_set():
                break
        return toks


__all__ = ["DrafterWorker", "Expect", "ModelSessionCache", "VerifierWorker", "VerifyReply", "WorkerConfig", "ids_crc32"]
