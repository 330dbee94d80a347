"""The batching scheduler of a model server: many sessions' forwards in ONE model forward.

Callers (the gRPC handler threads of a verifier or drafter, one per in-flight request) submit a
row -- a session's KV-pool handle, the position it starts at, the tokens to feed, how many of the
last rows of logits it needs, and optionally a pruned LM head -- and block until it has run. One
loop thread takes the first waiting row, gathers more until a row cap, a token cap or a short
wait is reached, runs ONE :func:`crossdraft.runtime.kvpool.batched_forward` and hands each caller its
rows. A session is in a batch at most once (its caller waits for its row). Long feeds (a prefill,
a sync after a cache miss) are cut into chunks of ``prefill_chunk`` tokens, each a separate row,
so one long prompt delays other sessions' rounds by at most one chunk's share of a forward. The
forward pads rows to the longest, so a long row batches only with rows of about its length
(:func:`_mixes`): a prompt's chunk never pads other sessions' one-token steps to its length.

The first row waits for more only while others are about to come: rows of callers inside the
worker (``busy()`` counts them: a drafter's next step), and rows of sessions expected back from
their clients soon (:mod:`crossdraft.runtime.returns`: sessions answered by one forward come back
spread over their clients' round trips, and a forward that starts without the late ones splits the
sessions into groups that each pay a whole forward from then on). With one client a row runs at
once, so batching costs a single user nothing. On a CPU whose cores other model servers compute on
too (a drafter beside its verifier), each forward runs in a turn (:mod:`crossdraft.runtime.turns`,
the servers' ``--cpu-turns``): one server's forward at a time, each at its speed alone.

Memory: the KV pool (paged, preallocated) holds every session's keys and values. When a row
cannot get blocks, the worker's ``evict`` callback drops idle sessions, least recently used
first (they re-sync later: slower, never different); if nothing can be evicted the row fails with
:class:`crossdraft.errors.ResourceExhausted` (gRPC RESOURCE_EXHAUSTED, HTTP 429 at the gateway).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from crossdraft.errors import InvalidArgument, NotFound, ResourceExhausted
from crossdraft.runtime.kvpool import KVPool, PoolFull, Row, batched_forward
from crossdraft.runtime.price import PriceModel
from crossdraft.runtime.returns import Returns
from crossdraft.runtime.rowmix import SHORT_ROW, _split, take_rows
from crossdraft.runtime.turns import Turns, lock_path

log = logging.getLogger("crossdraft.runtime.batching")


@dataclass(frozen=True)
class BatchConfig:
    """How a model server batches the forwards of its sessions."""

    enabled: bool = True  # False: one forward at a time, each session with its own cache
    max_rows: int = 32  # sessions in one forward at most
    max_tokens: int = 4096  # tokens in one forward at most (rows x the longest row: the padded forward)
    # how long the first row may wait for others in flight or expected back (None = automatic: 15% of
    # the mean forward time, 1 to 30 ms, for rows in flight; the base of the fitted price of a forward,
    # at most 250 ms, for sessions expected back from their clients)
    max_wait_ms: float | None = None
    prefill_chunk: int = 512  # long feeds run in chunks of this many tokens
    kv_cache_tokens: int = 0  # KV pool size in tokens (0 = automatic, see pool_tokens)
    kv_cache_memory_fraction: float = 0.0  # automatic size's memory share (0 = 0.2 on CPU, 0.8 on CUDA)
    block_size: int = 16  # tokens per KV block
    # shape buckets replayed as captured CUDA graphs (crossdraft.runtime.graphs): None = on for a CUDA
    # device, off elsewhere; True on a CPU runs the same bucketed path without graphs (a check of
    # the padding; slower: there is nothing to capture)
    cuda_graphs: bool | None = None
    # CPU servers whose forwards take turns with the other servers on the same cores
    # (crossdraft.runtime.turns.lock_path: "auto", "off" or a lock file's path; None = off)
    cpu_turns: str | None = None
    name: str = ""  # the server's kind (names its mark beside the turns' lock file)

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_tokens", "prefill_chunk", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgument(name, f"must be an integer >= 1, got {v!r}")
        if self.max_wait_ms is not None and not 0 <= self.max_wait_ms <= 1000:
            raise InvalidArgument("max_wait_ms", f"must be in [0, 1000], got {self.max_wait_ms}")
        if self.kv_cache_tokens < 0:
            raise InvalidArgument("kv_cache_tokens", "must be >= 0 (0 = automatic)")
        if not 0 <= self.kv_cache_memory_fraction <= 0.95:
            raise InvalidArgument("kv_cache_memory_fraction", "must be in [0, 0.95] (0 = automatic)")
        if self.max_tokens < self.prefill_chunk:
            raise InvalidArgument("max_tokens", "must be >= prefill_chunk")


class KVSlot:
    """One session's place in the pool. ``handle`` is assigned and freed on the loop thread only."""

    __slots__ = ("handle", "closed")

    def __init__(self):
        self.handle: int | None = None
        self.closed = False


class _Job:
    __slots__ = ("slot", "start", "tokens", "keep", "head", "done", "result", "error", "t_submit", "wait_s",
                 "batch_rows", "batch_tokens", "final", "more")

    def __init__(self, slot: KVSlot, start: int, tokens: list[int], keep: int, head, final: bool = True,
                 more: bool = False):
        self.slot = slot
        self.start = start
        self.tokens = tokens
        self.keep = keep
        self.head = head
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None
        self.t_submit = time.perf_counter()
        self.wait_s = 0.0
        self.batch_rows = 0
        self.batch_tokens = 0
        self.final = final  # the last chunk of the caller's feed: its answer sends the session out
        self.more = more  # and its caller may send the next row at once (a drafter's block goes on)


@dataclass
class ForwardInfo:
    """What one caller's forward looked like from inside the scheduler."""

    queue_wait_s: float = 0.0  # waiting for a batch to start (all chunks)
    batch_rows: int = 1  # rows of the batch that computed the caller's logits
    batch_tokens: int = 0
    chunks: int = 0
    active_sessions: int = 1  # sessions sending rows to this scheduler lately (the caller's included)


class BatchStats:
    """Counters and histograms (plain numbers; the servers export them to Prometheus)."""

    ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

    def __init__(self):
        self.batches = 0
        self.rows = 0
        self.tokens = 0
        self.rows_hist = [0] * (len(self.ROW_BUCKETS) + 1)
        self.evictions = 0
        self.exhausted = 0
        self.forward_s = 0.0
        self.queue_wait_s = 0.0
        self.observers: list = []  # callables(rows, tokens, queue_waits_s) run after each batch

    def record(self, rows: int, tokens: int, waits: list[float], forward_s: float) -> None:
        self.batches += 1
        self.rows += rows
        self.tokens += tokens
        self.forward_s += forward_s
        self.queue_wait_s += sum(waits)
        i = next((j for j, b in enumerate(self.ROW_BUCKETS) if rows <= b), len(self.ROW_BUCKETS))
        self.rows_hist[i] += 1
        for fn in self.observers:
            try:
                fn(rows, tokens, waits)
            except Exception:  # metrics must never break a forward
                log.exception("batch observer failed")


class BatchScheduler:
    """One loop thread running batched forwards of one model over one :class:`KVPool`."""

    gang_wait_s = 0.02  # the longest a forward waits for the rows of a gang (expect_gang)

    def __init__(self, model, pool: KVPool, cfg: BatchConfig, *, threads: int | None = None, evict=None,
                 busy=None):
        self.model = model
        self.pool = pool
        self.cfg = cfg
        self.evict = evict  # callable(blocks_needed) -> bool: free idle sessions' blocks
        self.busy = busy or (lambda: 0)  # callable: callers inside the worker right now
        # the forwards' intra-op threads (set on the loop thread)
        self.threads = threads or torch.get_num_threads()
        self.stats = BatchStats()
        self._q: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._releases: list[KVSlot] = []
        self._ops: list = []  # pool operations callers asked the loop thread to run (forks)
        # when each session's rows arrive: id(slot) -> [last submit time, mean gap between its rows]
        self._seen: dict[int, list] = {}
        # when each answered session's next row is expected back (the wait for rows about to come)
        self._returns = Returns()
        self._forward_s = 0.0  # running mean of a forward's time (the automatic wait is a share of it)
        # the model's measured ms per forward of 1, 2, ... tokens (crossdraft.runtime.costs; set by the worker
        # once timed): whether padding short rows to a longer one costs more than a forward of its own
        self.cost_ms: list[float] | None = None
        # the price of a batched forward by rows and tokens, fitted from the forwards run (published
        # in the replies: crossdraft.runtime.price)
        self.prices = PriceModel()
        self.graphs = None
        # CPU servers sharing cores take turns at forwards (crossdraft.runtime.turns); None: no turns
        self.turns = None
        self._turn_t0 = None  # when the turn held now began (None: none held between forwards)
        # rows a client said it sends together (expect_gang): the next forward waits briefly until it has as many
        self._gang_rows, self._gang_until = 0, 0.0
        path = lock_path(cfg.cpu_turns) if pool.device.type == "cpu" else None
        if path:
            self.turns = Turns(path, cfg.name)
        use = cfg.cuda_graphs if cfg.cuda_graphs is not None else pool.device.type == "cuda"
        if use:
            from crossdraft.runtime.graphs import ForwardGraphs

            # row buckets: powers of two up to the row cap, and the cap itself
            rows = sorted({r for r in (1, 2, 4, 8, 16, 32, 64, 128) if r < cfg.max_rows} | {cfg.max_rows})
            self.graphs = ForwardGraphs(model, pool, backend="cuda" if pool.device.type == "cuda" else "emulate",
                                        rows=rows)
        self._thread = threading.Thread(target=self._loop, name="crossdraft-batcher", daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        """The loop thread (the one that runs the forwards)."""
        return self._thread

    # ---- slots: a session's place in the pool -------------------------------------------------------
    # Every pool mutation happens on the loop thread (between or inside batches), so the pool
    # needs no lock and callers never wait for a forward just to roll back or to leave.
    def release(self, slot: "KVSlot") -> None:
        """The session is gone: free its blocks (now on the loop thread, else before the next batch)."""
        slot.closed = True
        if threading.current_thread() is self._thread:
            self._free(slot)
        else:
            with self._cv:
                self._releases.append(slot)
                self._cv.notify()

    def fork(self, src: "KVSlot", dst: "KVSlot", n: int) -> int:
        """Make the empty slot ``dst`` share the first ``n`` tokens of ``src``'s keys and values
        (pool blocks shared, copied only when written; run on the loop thread, between batches).
        Returns the tokens shared: fewer than ``n`` only when the source holds fewer."""
        done = threading.Event()
        box: dict = {}

        def op():
            try:
                if src.closed:
                    raise NotFound("source_session_id", "the session's KV slot was released (evicted)")
                if dst.handle is not None:
                    raise ValueError("fork into a slot that already holds keys and values")
                if src.handle is not None and n > 0:
                    m = min(n, self.pool.length(src.handle))
                    if m > 0:
                        dst.handle = self.pool.fork(src.handle, m)
                        box["n"] = m
            except BaseException as e:  # handed to the caller
                box["error"] = e
            finally:
                done.set()

        if threading.current_thread() is self._thread:
            op()
        else:
            with self._cv:
                if self._stop:
                    raise ResourceExhausted("the model server is shutting down")
                self._ops.append(op)
                self._cv.notify()
            done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("n", 0)

    def _free(self, slot: "KVSlot") -> None:
        self._seen.pop(id(slot), None)
        self._returns.forget(id(slot))
        if slot.handle is not None:
            self.pool.free(slot.handle)
            slot.handle = None

    # ---- the callers' side ----------------------------------------------------------------------
    def expect_gang(self, rows: int) -> None:
        """A client sends ``rows`` rows at once (one round loop's sessions whose blocks were ready together,
        crossdraft.decoding.gang): the next forward waits until it holds that many, at most the base of a
        forward's price (what a row that misses the forward costs again) and ``gang_wait_s``."""
        with self._cv:
            self._gang_rows = max(self._gang_rows, min(int(rows), self.cfg.max_rows))
            self._gang_until = time.perf_counter() + min(self.gang_wait_s, self._return_wait_s())

    def forward(self, slot: "KVSlot", start: int, tokens: list[int], keep: int,
                head=None, more: bool = False) -> tuple[torch.Tensor, ForwardInfo]:
        """Feed tokens at positions start..; block until done; (logits [keep, V or A] float32, info).

        The slot's KV entries from ``start`` on are replaced (a rollback is just a smaller start).
        ``more``: the caller may send its next row as soon as it has this answer (a drafter's block
        goes on), so a turn on shared CPUs may run on into that row's forward."""
        if slot.closed:
            raise NotFound("session_id", "the session's KV slot was released (evicted); re-sync")
        info = ForwardInfo()
        out = None
        pos = start
        for piece, last in _chunks(tokens, self.cfg.prefill_chunk, keep):
            job = _Job(slot, pos, piece, keep if last else 1, head if last else None, last, more and last)
            with self._cv:
                if self._stop:
                    raise ResourceExhausted("the model server is shutting down")
                self._returns.sent(id(slot), job.t_submit)
                seen = self._seen.get(id(slot))
                if seen is None:
                    self._seen[id(slot)] = [job.t_submit, None]
                else:
                    gap = job.t_submit - seen[0]
                    seen[0], seen[1] = job.t_submit, gap if seen[1] is None else 0.7 * seen[1] + 0.3 * gap
                self._q.append(job)
                self._cv.notify()
            job.done.wait()
            if job.error is not None:
                raise job.error
            info.queue_wait_s += job.wait_s
            info.batch_rows, info.batch_tokens = job.batch_rows, job.batch_tokens
            info.chunks += 1
            info.active_sessions = self.active_sessions()
            out = job.result
            pos += len(piece)
        return out, info

    def active_sessions(self) -> int:
        """Sessions whose rows keep coming: each sent one within twice its usual gap between rows (or
        within the last second, before a gap is known). How many sessions a round's forwards are
        shared by when every one of them sends its rows -- what the draft-length policy prices
        drafting against, whatever the batches look like at the moment."""
        now = time.perf_counter()
        with self._cv:
            return max(1, sum(1 for last, gap in self._seen.values()
                              if now - last <= (max(2.0 * gap, 0.05) if gap is not None else 1.0)))

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(5)
        if self.turns is not None and not self._thread.is_alive():
            self.turns.close()

    # ---- the loop -------------------------------------------------------------------------------
    def _gather(self) -> list[_Job] | None:
        cfg = self.cfg
        with self._cv:
            while not self._q and not self._stop and not self._releases and not self._ops:
                self._cv.wait()
            releases, self._releases = self._releases, []
            for slot in releases:
                self._free(slot)
            ops, self._ops = self._ops, []
            for op in ops:
                op()
            if self._stop:
                return None
            if not self._q:
                return []
            batch = [self._q.popleft()]
            t_pick = time.perf_counter()
            # (a turn kept from the last forward waits for nobody: the other servers sharing the cores wait for it)
            deadline = t_pick + (self._max_wait_s() if self._turn_t0 is None else 0.0)  # (callers inside the worker)
            returning = t_pick + (self._return_wait_s() if self._turn_t0 is None else 0.0)  # (sessions due back)
            while len(batch) < cfg.max_rows:
                batch += take_rows(self._q, batch, cfg.max_rows, cfg.max_tokens)
                if self._q:  # a row set aside (or the batch full): it runs in the next forward
                    break
                slots = {id(j.slot) for j in batch}
                # nothing queued: wait a little, only while other rows may be about to come: rows of callers
                # inside the worker (a drafter's next step), or of sessions expected back from their clients
                now = time.perf_counter()
                inside = deadline if now < deadline and self.busy() > len(batch) else None
                gang = self._gang_until if len(batch) < self._gang_rows and now < self._gang_until else None
                until = max((t for t in (inside, gang, self._returns.wait_until(slots, now, returning))
                             if t is not None), default=now)
                if until <= now:
                    break
                self._cv.wait(until - now)
            batch, later = _split(batch, self.cost_ms)
            self._q.extendleft(reversed(later))
            self._gang_rows = 0
            return batch

    def _join_turn(self, batch: list[_Job]) -> list[_Job]:
        """The batch after a wait for its turn: the rows queued meanwhile that join it (where the split by
        length keeps the batch's own rows), given their KV blocks. Sessions whose rows came together but
        just after the batch was gathered (blocks sent at once by one round loop, one after another) would
        otherwise each wait a turn for a forward of their own."""
        with self._cv:
            more = take_rows(self._q, batch, self.cfg.max_rows, self.cfg.max_tokens)
            now, later = _split(batch + more, self.cost_ms)
            if {id(j) for j in batch} - {id(j) for j in now}:
                now, later = batch, more
            self._q.extendleft(reversed(later))
        kept = {id(j) for j in now}
        return batch + self._reserve([j for j in more if id(j) in kept])

    def _end_turn_unless_row(self, linger_s: float | None = None) -> None:
        """A turn kept from the last forward ends unless a row comes within ``linger_s`` (the turns' linger)."""
        if self._turn_t0 is None:
            return
        with self._cv:
            if not self._q and not self._stop:
                self._cv.wait(self.turns.linger_s if linger_s is None else linger_s)
            if self._q and not self._stop:
                return
        self._turn_t0 = None
        self.turns.release()

    def _max_wait_s(self) -> float:
        if self.cfg.max_wait_ms is not None:
            return self.cfg.max_wait_ms / 1000.0
        return min(0.030, max(0.001, 0.15 * self._forward_s))

    def _return_wait_s(self) -> float:
        """How long the first row may wait for sessions expected back from their clients. Rows that
        miss a forward run in one of their own, which costs the fixed part of a forward again (the
        base of the server's fitted price: weights read, kernels launched) -- and the sessions
        served apart then come back apart again -- while the wait leaves the device idle. So
        waiting pays up to that base (one split avoided pays it back; a split that would persist,
        more), at most 250 ms (the configured --batch-wait-ms where one is set). Where a forward's
        cost is mostly per row (a large vocabulary's head on a CPU), merging saves little and the
        wait is short."""
        if self.cfg.max_wait_ms is not None:
            return self.cfg.max_wait_ms / 1000.0
        return min(0.25, 1e-3 * self.prices.price().base_ms)

    def _reserve(self, batch: list[_Job]) -> list[_Job]:
        """Give every row a handle and its blocks (evicting idle sessions if needed); fail rows that
        cannot get them."""
        ok = []
        pool = self.pool
        for job in batch:
            try:
                if job.slot.closed:
                    raise NotFound("session_id", "the session was dropped (evicted); re-sync")
                if job.slot.handle is None:
                    job.slot.handle = pool.alloc()
                h = job.slot.handle
                if job.start > pool.length(h):
                    raise InvalidArgument("start", f"row starts at {job.start}, the slot holds {pool.length(h)}")
                if job.start < pool.length(h):
                    pool.truncate(h, job.start)
                end = job.start + len(job.tokens)
                if -(-end // pool.block_size) > pool.blocks_total:
                    raise InvalidArgument(
                        "tokens", f"the session would hold {end} tokens; this server's KV cache holds "
                        f"{pool.blocks_total * pool.block_size} (--kv-cache-tokens)")
                # new blocks, plus private copies of blocks shared with a fork that this row writes into
                need = max(0, -(-end // pool.block_size) - len(pool.block_table(h))) + pool.shared_blocks(h, job.start)
                if need > pool.blocks_free:
                    if self.evict is None or not self.evict(need):
                        raise PoolFull(f"need {need} more blocks, {pool.blocks_free} free of {pool.blocks_total}")
                    self.stats.evictions += 1
                pool.make_writable(h, job.start)
                pool.ensure(h, end)
                ok.append(job)
            except PoolFull:
                self.stats.exhausted += 1
                job.error = ResourceExhausted(
                    f"kv cache full: {pool.blocks_used} of {pool.blocks_total} blocks held by busy sessions; "
                    "retry later")
                job.done.set()
            except Exception as e:  # a slot released meanwhile and the like
                job.error = e
                job.done.set()
        return ok

    def _loop(self) -> None:
        if self.threads:  # (read first: torch would give the thread the process-wide count on first use)
            torch.get_num_threads()
            torch.set_num_threads(self.threads)
        while True:
            self._end_turn_unless_row()
            batch = self._gather()
            if batch is None:
                self._end_turn_unless_row(0.0)
                with self._cv:
                    for job in self._q:
                        job.error = ResourceExhausted("the model server is shutting down")
                        job.done.set()
                    self._q.clear()
                return
            batch = self._reserve(batch)
            if not batch:
                continue
            turns = self.turns
            if turns is not None and self._turn_t0 is None:
                if turns.acquire() > 0.001:
                    batch = self._join_turn(batch)
                self._turn_t0 = time.perf_counter()
            t0 = time.perf_counter()
            waits = [t0 - j.t_submit for j in batch]
            tokens = sum(len(j.tokens) for j in batch)
            rows = [Row(j.slot.handle, j.start, j.tokens, j.keep) for j in batch]
            try:
                outs = batched_forward(self.model, self.pool, rows, head=[j.head for j in batch], graphs=self.graphs)
            except BaseException as e:  # never leave a caller waiting
                log.exception("batched forward failed")
                for j in batch:
                    j.error = e
                    j.done.set()
                continue
            finally:
                # a turn runs on into the next forward where a caller of this one sends its next row at
                # once (a drafter's block: its steps then run one after another, as the draft-length policy
                # prices them, instead of each waiting for a verifier forward), for at most run_on_s
                if turns is not None and not (any(j.more for j in batch) and self._turn_t0 is not None
                                              and time.perf_counter() - self._turn_t0 < turns.run_on_s):
                    self._turn_t0 = None
                    turns.release()
            dt = time.perf_counter() - t0
            self._forward_s = dt if not self._forward_s else 0.8 * self._forward_s + 0.2 * dt
            self.stats.record(len(batch), tokens, waits, dt)
            longest = max(len(j.tokens) for j in batch)
            if longest <= SHORT_ROW:  # (the price is of decoding rounds' forwards)
                # in the tokens the forward computed: its rows padded to the longest (a sync of 20 tokens
                # beside three single steps costs 80, and fitted as 23 it would read as a dear row)
                self.prices.observe(len(batch), len(batch) * longest, dt)
            t_done = time.perf_counter()
            with self._cv:
                for j in batch:
                    if j.final:
                        self._returns.answered(id(j.slot), t_done)
            for j, out, w in zip(batch, outs, waits, strict=True):
                j.result = out
                j.wait_s = w
                j.batch_rows = len(batch)
                j.batch_tokens = tokens
                j.done.set()


class PooledKV:
    """A session's KV cache as a slot in a model server's shared pool; its forwards are batched
    with other sessions' by the :class:`BatchScheduler` (the counterpart of
    :class:`crossdraft.runtime.sessions.OwnKV`). The session's length is kept here: a rollback only moves
    it, and the pool follows at the session's next forward."""

    def __init__(self, scheduler: BatchScheduler):
        self.sched = scheduler
        self.slot = KVSlot()
        self.n = 0
        self.last = ForwardInfo()  # how the latest forward was batched

    def length(self) -> int:
        return self.n

    def crop(self, n: int) -> None:
        if n > self.n:
            raise ValueError(f"cannot crop a cache of {self.n} tokens to {n}")
        self.n = n

    def run(self, start: int, feed: list[int], keep: int, head: torch.Tensor | None = None,
            more: bool = False) -> torch.Tensor:
        out, self.last = self.sched.forward(self.slot, start, feed, keep, head, more)
        self.n = start + len(feed)
        return out

    def fork(self) -> "PooledKV":
        """A new slot sharing this one's keys and values (pool blocks, copied only when written)."""
        other = PooledKV(self.sched)
        other.n = self.sched.fork(self.slot, other.slot, self.n)
        return other

    def close(self) -> None:
        self.sched.release(self.slot)


def _chunks(tokens: list[int], chunk: int, keep: int):
    """(piece, is_last) of at most `chunk` tokens each; the last piece holds at least `keep`
    tokens (the rows whose logits are wanted are computed in one forward)."""
    sizes = [chunk] * (len(tokens) // chunk)
    if len(tokens) % chunk:
        sizes.append(len(tokens) % chunk)
    if len(sizes) > 1 and sizes[-1] < keep:
        move = min(keep - sizes[-1], sizes[-2])
        sizes[-2] -= move
        sizes[-1] += move
        if sizes[-2] == 0:
            del sizes[-2]
    i = 0
    for j, n in enumerate(sizes):
        yield tokens[i:i + n], j == len(sizes) - 1
        i += n


def pool_tokens(cfg: BatchConfig, max_sessions: int, max_context: int, bytes_per_token: int = 0,
                available_bytes: int = 0, device_type: str = "cpu") -> int:
    """The KV pool's size in tokens: the flag when set; else room for max_sessions sessions of
    min(context, 4096) tokens, capped to a share of the memory available now (0.2 of the host's on
    CPU, where other processes live beside the server; 0.8 of the GPU's free memory on CUDA), and
    never below one session's worth."""
    if cfg.kv_cache_tokens:
        return cfg.kv_cache_tokens
    per = min(max_context or 4096, 4096)
    want = max(1, max_sessions) * per
    if bytes_per_token > 0 and available_bytes > 0:
        share = cfg.kv_cache_memory_fraction or (0.8 if device_type == "cuda" else 0.2)
        want = min(want, int(share * available_bytes) // bytes_per_token)
    return max(per, want)


__all__ = ["BatchConfig", "BatchScheduler", "BatchStats", "ForwardInfo", "KVSlot", "PooledKV", "pool_tokens"]
