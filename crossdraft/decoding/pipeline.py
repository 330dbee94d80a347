"""Pipelined rounds: the next block is drafted while the verifier checks this one.

A serial round drafts a block, then verifies it: each model waits while the other computes. A
pipelined round sends its block to the verifier and, at the same moment, asks the drafter for the
block after it, drafted on the assumption that this block is accepted whole (the drafter continues
from its own proposals). When the verification accepts the whole block, the next block is ready and
goes to the verifier at once; the target's own token of the finished round (the "bonus" token) is
not emitted, since the ready block starts at that position and checks it -- the target still
decides that position, through the next round's acceptance rule, so the output keeps the target's
distribution (greedy: the same tokens). The next Verify asks the verifier to drop that token
(``drop_last``). When the block is rejected at some position, the block drafted ahead is dropped and
the drafter rolls it back with the next edit (its keys and values past the kept prefix are cut).

Whether dropping or taking the bonus token depends only on whether the block was accepted whole
and whether the block ahead is ready, never on the bonus token's value: that is why the rule stays
lossless for rejection sampling, coupled draws and greedy decoding alike.

:class:`Ahead` is one block drafted ahead (a call on a worker thread); :func:`can_draft_ahead` says
whether a round's block can have a successor drafted before its outcome is known.

A branch (greedy TLI rounds, the gateway's ``--branch``) covers the likeliest way the block is NOT
accepted whole: from the drafter's own probabilities, the position j where the verification most
likely first disagrees with it and the drafter's second choice there (the correction it expects);
beside the block ahead, the drafter drafts the block after that correction on a fork of its session
(the two calls share the drafter's batched steps). If the verification accepts exactly the proposals
before j and the target's token at j is that second choice, the branch is the next block (the
drafter's session becomes the fork); otherwise it is dropped. The round's own token is emitted as
always: the branch only chooses what the next round verifies, and the target decides every token.

The same overlap serves a drafter that is not drafting. While drafting does not pay, the drafter is
fed nothing (target-only rounds), and the probe that re-measures it would first feed it every token
it missed -- on the probe's critical path. So in the round before a probe is due, the drafter gets
that history while the verifier checks the round (:class:`CatchUp`: a sync that computes its keys
and values), and the probe's first forward feeds only the round's own token.
"""

from __future__ import annotations

import contextvars
import hashlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress

from crossdraft.decoding.drafter_view import block_in_target_ids
from crossdraft.decoding.request import Drafted, Request
from crossdraft.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from crossdraft.vocab.pair import TokenPair

# one worker thread per session drafting ahead at once: a gateway's sessions each have at most one
# block in flight ahead of their verification
MAX_AHEAD_THREADS = 256

PIPELINE_CHOICES = ("auto", "on", "off")

# a branch is drafted where the drafter's probabilities give it at least this chance of being the next
# block (below it, its share of the drafter's steps slows the block ahead for little)
BRANCH_MIN_HIT = 0.1


def pipeline_on(setting: str, colocated: bool) -> bool:
    """``--pipeline``: "on", "off", or "auto" -- on where the drafter computes on hardware of its own
    (drafting ahead on the verifier's cores takes their time from the verification it overlaps)."""
    if setting not in PIPELINE_CHOICES:
        raise ValueError(f"pipeline must be one of {', '.join(PIPELINE_CHOICES)}; got {setting!r}")
    return setting == "on" or (setting == "auto" and not colocated)


class Stop:
    """The cancel signal of a call drafting ahead (DrafterPort.draft's ``cancel``, whose ``is_set()`` the
    drafter calls once after each token it drafts): after :meth:`set` the block ends once it holds at
    least ``floor`` tokens."""

    def __init__(self):
        self._lock = threading.Lock()
        self._floor: int | None = None
        self._tokens = 0

    def set(self, floor: int = 1) -> None:
        with self._lock:
            floor = max(1, floor)
            self._floor = floor if self._floor is None else min(self._floor, floor)

    @property
    def requested(self) -> bool:
        with self._lock:
            return self._floor is not None

    def is_set(self) -> bool:
        """(Called by the drafter after each token: counts them.)"""
        with self._lock:
            self._tokens += 1
            return self._floor is not None and self._tokens >= self._floor


class Ahead:
    """One block drafted ahead: the drafter call runs on a worker thread (in the caller's context, so
    its trace span is a child of the round's) while the caller verifies."""

    _pool: ThreadPoolExecutor | None = None
    _pool_lock = threading.Lock()

    def __init__(self, call, proposals: list[int], position: int, round_index: int,
                 cancel: Stop | None = None):
        self.proposals = list(proposals)  # the drafter ids the block ahead continues from (this block's)
        self.position = position  # the target position of its first token
        self.round_index = round_index  # the round that verifies it
        self.cancelled = cancel if cancel is not None else Stop()  # the drafter call's cancel
        self.t_start = time.perf_counter()
        self.t_end = 0.0
        self.waited_s = 0.0  # how long the caller blocked on it after its verification came back
        self.model_s = 0.0  # the drafter's forward time of the tokens it returned
        ctx = contextvars.copy_context()
        self._future: Future = self._executor().submit(ctx.run, self._timed, call)

    @classmethod
    def _executor(cls) -> ThreadPoolExecutor:
        with cls._pool_lock:
            if cls._pool is None:
                cls._pool = ThreadPoolExecutor(max_workers=MAX_AHEAD_THREADS, thread_name_prefix="draft-ahead")
            return cls._pool

    def _timed(self, call):
        try:
            return call()
        finally:
            self.t_end = time.perf_counter()

    def cancel(self, floor: int = 1) -> None:
        """End the block after the token in progress, once it holds at least ``floor`` tokens: it is not
        needed (floor 1: the block before it was rejected, and the next Draft must not queue behind the
        rest of this one), or it is needed now (the block before it was accepted whole)."""
        self.cancelled.set(floor)

    def wait(self):
        """The drafted tokens (DraftTokens); raises what the drafter call raised. Records how long the
        caller waited."""
        t0 = time.perf_counter()
        try:
            return self._future.result()
        finally:
            self.waited_s = time.perf_counter() - t0

    def on_path_s(self) -> float:
        """The part of this block's drafter time on the round's critical path: the caller's wait for it,
        at most the drafter's own forward time (the rest of the wait is the drafter's overhead). A
        cancelled block's wait is the token in progress when it was cancelled: model time too."""
        return min(self.waited_s, self.model_s)


class CatchUp:
    """The drafter catching up on the tokens it missed (a sync with prefill of ``ids``), on a worker
    thread while the caller verifies a round that drafted nothing; or (``is_drafter`` False, ``port`` the
    verifier) the target computing the prompt's keys and values while the first block is drafted."""

    def __init__(self, port, sid: str, ids: list[int], is_drafter: bool = True):
        self.n = len(ids)
        self.waited_s = 0.0
        self.is_drafter = is_drafter
        ctx = contextvars.copy_context()
        self._future: Future = Ahead._executor().submit(ctx.run, port.sync, sid, list(ids), True)

    def wait(self) -> bool:
        """Whether the drafter now holds the ids (False: the call failed; the probe's own draft then
        feeds them, or finds the drafter gone, as without a catch-up). Records the caller's wait."""
        t0 = time.perf_counter()
        try:
            self._future.result()
            return True
        except (Unavailable, ResourceExhausted, InvalidArgument, NotFound, FailedPrecondition):
            return False
        finally:
            self.waited_s = time.perf_counter() - t0


def branch_sid(sid: str) -> str:
    """The drafter session id of `sid`'s branch (a valid session id whatever the length of `sid`)."""
    return "b" + hashlib.blake2b(sid.encode(), digest_size=16).hexdigest()


def likeliest_miss(toks: list) -> tuple[int, float]:
    """(j, chance) of a greedy block's likeliest miss with a known correction: the first j proposals
    accepted, the target's token at j the drafter's second choice there -- chance prod(prob[:j]) *
    alt_prob[j] by the drafter's own probabilities ((-1, 0.0) where the tokens carry no second choice)."""
    best, chance, kept = -1, 0.0, 1.0
    for j, t in enumerate(toks):
        if t.alt < 0:
            return -1, 0.0
        if kept * t.alt_prob > chance:
            best, chance = j, kept * t.alt_prob
        kept *= t.prob
    return best, chance


class Branch:
    """A block drafted beside the block ahead, on the fork ``sid`` of the drafter's session, after the
    proposals before ``j`` and the drafter's second choice at ``j`` (target id ``alt_t``); ``ids`` the
    drafter's history it continues."""

    def __init__(self, ahead: Ahead, sid: str, j: int, alt_t: int, ids: list[int]):
        self.ahead, self.sid, self.j, self.alt_t, self.ids = ahead, sid, j, alt_t, ids


def _beside(req: Request, call: Ahead, toks: list) -> Drafted:
    """The block a call beside a verification drafted (its target ids still to fill in): its drafter time,
    counted in the request's stats and on the call (what of it the round waited for is on its path)."""
    seconds = call.model_s = sum(t.forward_s for t in toks)
    queued = sum(t.queue_s for t in toks)
    req.stats.draft_s += seconds - queued
    req.stats.draft_queue_s += queued
    return Drafted(toks, [], None, seconds, wall=max(0.0, call.t_end - call.t_start), queue_s=queued)


def can_draft_ahead(pair: TokenPair, proposals: list[int], target_ids: list[int], healed: bytes, text_mode: bool,
                    eos: set[int], remaining: int) -> bool:
    """Whether a block can have its successor drafted before it is verified: it ends no output (no EOS
    in it, and at least two tokens of the budget left after it: one for the block ahead, and the
    round's own token when that block is dropped), and its target ids spell exactly the drafter's
    proposals (TLI: one target id per proposal; text mode: the same bytes, not cut short by the budget
    or by bytes the target cannot spell), so that accepting it whole leaves both sides on the same text.
    """
    if not proposals or not target_ids or remaining - len(target_ids) < 2:
        return False
    if any(t in eos for t in target_ids):
        return False
    if not text_mode:
        return len(target_ids) == len(proposals)
    drafted = b"".join(pair.d_bytes[x] for x in proposals)
    return drafted.startswith(healed) and pair.target_text_bytes(target_ids) == drafted[len(healed):]


class Pipelining:
    """The round loop's pipelined steps (mixed into :class:`crossdraft.decoding.decode.Decoder`, whose
    ports, vocabulary pair and policy helpers they use)."""

    def _draft_ahead(self, req: Request, drafted: Drafted, remaining: int, round_index: int) -> Ahead | None:
        """Start drafting the block after this one, as if this one were accepted whole (None where it
        cannot be: see can_draft_ahead, or the policy drafts no next block)."""
        if not req.spec or req.k <= 0 or not drafted.tokens or req.policy is None:
            return None
        # other sessions share the verifier (serial rounds interleave), or the block's rate is better serial
        if not req.policy.ahead_pays(req.k):
            return None
        proposals = [t.id for t in drafted.tokens]
        kd = len(drafted.target_ids)
        if not can_draft_ahead(self.pair, proposals, drafted.target_ids, drafted.healed, req.text_mode, self.eos,
                               remaining):
            return None
        d, params, cancel = req.d, req.params, Stop()
        kw = dict(k=min(req.k, remaining - kd - 1, 64), round_index=round_index + 1, params=params, seed=req.seed,
                  stop_below=req.draft.stop_below, allowed_key=self.pair.keys[req.mode],
                  timeout_s=self.drafter_timeout_s, cancel=cancel)
        sc = req.policy.cumulative_stop() if req.policy.confident or req.draft.stop_cumulative else 0.0
        if sc > 0:
            kw["stop_cumulative"] = sc
        position = len(req.t_ids) + kd
        if params.coupled:
            kw["position"] = position
        # the drafter holds d.ids (and this block's proposals in its cache): the edit commits them
        edit, expect = (len(d.ids), proposals), self._expect(d.ids + proposals)
        sid, drafter = req.sid, self.drafter
        if self._branching(req):
            kw["runner_up"] = True
            self._branch(req, drafted, remaining, round_index, dict(kw))
        return Ahead(lambda: drafter.draft(sid, edit, expect, **kw), proposals, position, round_index + 1, cancel)

    def _branching(self, req: Request) -> bool:
        """Whether the request's blocks carry the drafter's second choices for branches (``--branch``,
        greedy TLI rounds: a text-mode correction is a re-encoded tail, not one drafter id)."""
        return self.branch and self.pipeline and req.params.greedy and not req.text_mode

    def _branch(self, req: Request, drafted: Drafted, remaining: int, round_index: int, kw: dict) -> None:
        """Start the branch of this block where its likeliest miss is likely enough (see Branch)."""
        j, chance = likeliest_miss(drafted.tokens)
        budget = remaining - (j + 1) - 1  # after the j kept proposals and the correction, one token kept
        if j < 0 or chance < BRANCH_MIN_HIT or budget < 1:
            return
        alt = drafted.tokens[j].alt
        alt_t = int(self.pair.d2t[alt])
        if alt_t in self.eos:
            return
        d, sid, bsid, drafter = req.d, req.sid, branch_sid(req.sid), self.drafter
        ids = d.ids + [t.id for t in drafted.tokens[:j]] + [alt]
        edit, expect = (len(d.ids), ids[len(d.ids):]), self._expect(ids)
        kw.update(k=min(req.k, budget, 64), cancel=Stop())

        def call():
            drafter.fork(sid, bsid)  # (the fork shares the session's cache: only the branch's own steps cost)
            return drafter.draft(bsid, edit, expect, **kw)

        req.branch = Branch(Ahead(call, [], len(req.t_ids) + j + 1, round_index + 1, kw["cancel"]), bsid, j, alt_t,
                            ids)
        req.branch_on = drafter
        req.stats.branches += 1

    def _take_branch(self, req: Request, n: int, next_token: int, done: bool) -> bool:
        """After the round's drafter edit: the branch is the next block if the verification kept exactly
        its proposals and chose its correction (the drafter's session then becomes the branch's); else it
        is dropped. Whether it was taken."""
        br, req.branch = req.branch, None
        if done or not req.spec or n != br.j or next_token != br.alt_t or req.d.ids != br.ids:
            br.ahead.cancel()  # (not waited for: it drafts on its own session, which the next branch replaces)
            return False
        try:
            toks = br.ahead.wait()
            drafts_t, _ = block_in_target_ids(self.pair, toks, b"", req.remaining() - 1, False, False)
            if not drafts_t or any(t in self.eos for t in drafts_t[:-1]):
                return False
            self.drafter.fork(br.sid, req.sid)
        except (Unavailable, ResourceExhausted, InvalidArgument, NotFound, FailedPrecondition):
            return False  # the next round drafts as it would have
        req.d.sent = len(req.d.ids)
        req.ready = _beside(req, br.ahead, toks)
        req.ready.target_ids = drafts_t
        req.stats.branch_blocks += 1
        return True

    def _end_calls(self, req: Request) -> None:
        """A run ends (closed mid-round, too): its calls beside the rounds -- a block drafted ahead, its
        branch, a prefill beside a first block -- end before the session's next use, and the drafter drops
        the branch's session."""
        for call in (req.ahead, req.branch.ahead if req.branch is not None else None):
            if call is not None:
                call.cancel()
                with suppress(Exception):  # (its outcome no longer matters, only that it ended)
                    call.wait()
        req.ahead = req.branch = None
        if req.prefill is not None:
            with suppress(Exception):
                req.prefill.wait()
        if req.branch_on is not None:
            with suppress(Exception):
                req.branch_on.end(branch_sid(req.sid))
            req.branch_on = None

    def _prefill_beside(self, req: Request) -> CatchUp | None:
        """A request that drafts its first block where the drafter computes on hardware of its own (not
        colocated): the verifier computes the prompt's keys and values meanwhile -- a sync with prefill
        -- instead of after the block arrives, so the two prefills overlap (None where that does not
        apply)."""
        if self.colocated or not req.spec or req.k <= 0 or len(req.t_ids) < 2:
            return None
        return CatchUp(self.verifier, req.sid, req.t_ids, is_drafter=False)

    def _catch_up(self, req: Request, kk: int) -> CatchUp | None:
        """A round that drafts nothing, after which the policy's next choice is a probe: feed the drafter
        what it missed while this round is verified (None where nothing needs catching up). The first
        round of a request whose prompt the verifier prefills beside the first block waits for that
        prefill here, before its verification (the wait is verifier time on the round's critical path)."""
        if req.prefill is not None:
            catch, req.prefill = req.prefill, None
            catch.wait()
            return catch
        if not (self.pipeline and req.spec and kk == 0 and req.d is not None and req.policy is not None):
            return None
        # (a history the drafter would take longer to take in than the target verifies one token is not
        # caught up: the wait would be on this round's path, and the probe then prices that feed itself)
        if req.d.unfed() <= 1 or not req.policy.probe_next() or not req.policy.costs.feed_fits(req.d.unfed()):
            return None
        return CatchUp(self.drafter, req.sid, req.d.ids)

    def _caught_up(self, req: Request, catch: CatchUp) -> None:
        """After the verification: the drafter holds the ids it was sent (unless the call failed)."""
        if catch.is_drafter and catch.wait():
            req.d.sent, req.d.synced = catch.n, True
            req.stats.caught_up += 1

    def _take_ahead(self, req: Request, ahead: Ahead, kd: int, n: int, remaining: int) -> "Drafted | None":
        """Wait for the block drafted ahead; it is the next block if this one was accepted whole, else it
        is dropped (the drafter's next edit cuts it from its cache) and its drafting cancelled.

        A block accepted whole keeps the block ahead at its planned length: ending it when the
        verification is back (drafting to fill the verification's time) makes shorter blocks, and
        where a verification costs about the same for 1 token as for 10 (bf16 on AMX, a GPU) more
        verifications cost more than the drafting they save."""
        if n < kd or not req.spec:
            ahead.cancel()
        try:
            toks = ahead.wait()
        except (Unavailable, ResourceExhausted, InvalidArgument) as e:
            req.drafter_failed(e)  # the request goes on target-only, as when a serial draft fails
            return None
        except (NotFound, FailedPrecondition):  # the drafter lost the session: the next draft re-syncs it
            req.stats.dropped_blocks += 1
            return None
        block = _beside(req, ahead, toks)
        with_q = not req.params.greedy and not req.params.coupled
        block.target_ids, block.q_rows = (
            block_in_target_ids(self.pair, toks, b"", remaining - kd - 1, req.text_mode, with_q)
            if n == kd and toks and req.spec else ([], None))
        if not block.target_ids:
            req.stats.dropped_blocks += 1
            return None
        return block

    def _follow(self, req: Request, drafted: Drafted, following: Drafted) -> None:
        """The block was accepted whole and the next one is ready: the drafter's view takes this block's
        proposals (the call that drafted ahead applied that edit), the verifier drops the round's own
        token with the next Verify, and the policy chooses the block after the ready one."""
        d, proposals = req.d, [t.id for t in drafted.tokens]
        d.edit(len(d.ids), proposals)
        d.gen_lens.extend(len(self.pair.d_bytes[t]) for t in proposals)
        d.sent = len(d.ids)
        req.ready, req.drop_bonus = following, True
        req.stats.pipelined_blocks += 1
        self._peers(req)
        req.k = req.policy.next_k(req.remaining(), d.unfed())
        if req.policy.costs.measured:
            self._probes[req.mode] = req.policy.probe_record()
