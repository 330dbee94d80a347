"""The round loop, shared by the in-process engine and the gateway.

:class:`Decoder` runs speculative decoding over two ports -- a verifier and (optionally) a
drafter -- stated in :mod:`crossdraft.decoding.ports` (``VerifierPort``, ``DrafterPort``). In process the
ports ARE the model workers; in the gateway they are gRPC clients of the drafter and verifier
services. The loop speaks both vocabularies through :class:`crossdraft.vocab.pair.TokenPair`; the
model servers only ever see their own ids.

One round: (apply the pending drafter edit and) draft k tokens -> map them to target ids (and q
to target ids) -> verify in one target forward -> stream the new text -> record the drafter's
edit (accepted proposals + the target's token, or a byte-exact re-tokenised tail).
"""

from __future__ import annotations

import codecs
import json
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from crossdraft.decoding.costmodel import cost_ratio
from crossdraft.decoding.messages import Expect
from crossdraft.decoding.policy import DraftConfig, DraftPolicy
from crossdraft.decoding.ports import DrafterPort, VerifierPort
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable, check_int
from crossdraft.vocab.pair import TokenPair, chat_ids  # noqa: F401  (the pair is the loop's vocabulary; re-exported)


def draws_of(params) -> str:
    """Stats.draws for a request's sampling parameters."""
    return "greedy" if params.greedy else "coupled" if params.coupled else "rejection"


@dataclass
class Stats:
    """Per-call statistics, JSON-friendly."""

    mode: str = "target-only"
    draft_mode: str = ""  # "tli" (drafts from the vocabulary intersection) or "text" (greedy: drafted text re-encoded)
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    resyncs: int = 0
    healed: int = 0  # text mode: blocks whose drafter re-chose its last id (token healing, crossdraft.vocab.healing)
    skipped_rounds: int = 0  # speculative rounds in which the policy drafted nothing (drafting did not pay)
    cost_model: str = ""  # where the draft-length policy took its costs from: "measured" or "static"
    # how each token was chosen: "greedy" (argmax), "coupled" (a function of (seed, position): the same
    # text with or without a drafter) or "rejection" (the classic accept/resample rule)
    draws: str = ""
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0  # time in the rounds outside the two models' forwards (mapping, bookkeeping, RPCs)
    total_s: float = 0.0
    finish_reason: str = "length"
    drafter_fallback: bool = False  # the drafter failed or was too slow: the rest ran target-only
    fallback_reason: str = ""
    reused_target_tokens: int = 0  # verifier KV-cache entries reused from an earlier request
    reused_drafter_tokens: int = 0

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["acceptance_rate"] = self.accepted / self.drafted if self.drafted else 0.0
        d["acceptance_by_position"] = [
            a / n if n else 0.0 for a, n in zip(self.accepted_by_position, self.drafted_by_position, strict=True)
        ]
        d["mean_accepted_per_round"] = self.accepted / self.rounds if self.rounds else 0.0
        d["tokens_per_round"] = self.new_tokens / self.rounds if self.rounds else 0.0
        gen_s = self.total_s - self.prefill_s
        d["tokens_per_s"] = self.new_tokens / self.total_s if self.total_s > 0 else 0.0
        d["decode_tokens_per_s"] = self.new_tokens / gen_s if gen_s > 0 else 0.0
        del d["draft_lengths"]
        d["mean_draft_length"] = float(np.mean(self.draft_lengths)) if self.draft_lengths else 0.0
        return d

    def record_round(self, k: int, n: int) -> None:
        self.rounds += 1
        self.drafted += k
        self.accepted += n
        if k:
            self.draft_lengths.append(k)
        while len(self.drafted_by_position) < k:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)
        for i in range(k):
            self.drafted_by_position[i] += 1
            if i < n:
                self.accepted_by_position[i] += 1


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # target ids of the new tokens (EOS included when it ended the output)
    stats: Stats
    # a stop string ended the output: the stop string and whatever followed it in the same token
    # (not part of ``text``, but part of what ``token_ids`` spell)
    stop_tail: str = ""
    logprobs: list | None = None  # per token of token_ids, when asked for (see RoundEvent.logprobs)

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict()}


@dataclass
class RoundEvent:
    """What one round did; yielded by :meth:`Decoder.run` as soon as the round ends."""

    round_index: int
    requested: int  # block size asked of the drafter
    drafted: int  # drafts verified (target ids)
    accepted: int
    emitted: list[int]  # new target ids (after EOS / budget trimming)
    text: str  # new text (complete UTF-8 characters only)
    draft_s: float
    verify_s: float
    overhead_s: float
    done: bool
    target_ids: list[int] = field(repr=False, default_factory=list)  # the session's ids now (shared, do not mutate)
    drafter_ids: list[int] | None = field(repr=False, default=None)
    batch_size: int = 1  # sessions in the verifier's batched forward that verified this block
    queue_wait_s: float = 0.0  # how long the block waited in the verifier for its batch
    # per emitted token when asked for: (log-probability, top ids, their log-probabilities)
    logprobs: list | None = field(repr=False, default=None)


class Run:
    """An iterator of RoundEvents; ``result`` is set once it is exhausted."""

    def __init__(self, gen):
        self._gen = gen
        self.result: GenerationResult | None = None
        self.target_ids: list[int] = []
        self.drafter_ids: list[int] | None = None
        self.next_round: int = 0

    def __iter__(self):
        return self

    def __next__(self) -> RoundEvent:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()


@dataclass
class DrafterState:
    """The gateway's view of the drafter's session: its ids, and how many of them it holds."""

    ids: list[int]
    sent: int  # ids[:sent] are what the drafter holds; the rest goes with the next Draft as an edit
    prompt_len: int
    gen_lens: list[int] = field(default_factory=list)  # bytes of each generated drafter id
    # False until the drafter has the session: a request that starts target-only (drafting cannot
    # pay at this load) syncs the drafter only if and when it drafts (a short request never does)
    synced: bool = True

    def edit(self, keep: int, append: list[int]) -> None:
        """ids become ids[:keep] + append (sent with the next Draft)."""
        self.ids[keep:] = list(append)
        self.sent = min(self.sent, keep)

    def pending(self):
        """The edit the drafter has not seen yet: (keep, append) or None."""
        return (self.sent, self.ids[self.sent:]) if self.sent < len(self.ids) else None


@dataclass
class _Request:
    """One request's state in the round loop."""

    sid: str
    t_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    seed: int
    draft: DraftConfig
    stats: Stats
    spec: bool
    d: DrafterState | None = None
    mode: str = "tli"  # which drafter mask: "tli" or "text"
    text_mode: bool = False
    policy: DraftPolicy | None = None
    step_s: float = 0.0  # measured seconds of one target decoding step (0.0 with static costs)
    gen: list[int] = field(default_factory=list)
    gen_bytes: bytearray = field(default_factory=bytearray)
    utf8: object = None
    stop: tuple[bytes, ...] = ()  # stop strings (UTF-8)
    fed: int = 0  # gen_bytes[:fed] went out as text (the rest may still turn into a stop string)
    cut: int | None = None  # a stop string starts at gen_bytes[cut]
    top_logprobs: int = -1  # -1: no log-probabilities; n: each token's and the n best
    logprobs: list = field(default_factory=list)
    k: int = 0
    first: bool = True
    prev_drafted: bool = False

    def drafter_failed(self, e: Exception) -> None:
        self.spec = False
        reason = str(e)
        if isinstance(e, InvalidArgument):  # e.g. its context is shorter, or its tokens more, than the target's
            reason = f"the drafter refused the request ({reason})"
        self.stats.drafter_fallback, self.stats.fallback_reason = True, reason


@dataclass
class _Drafted:
    """What the drafting step of a round produced."""

    tokens: list  # DraftTokens (drafter ids)
    target_ids: list[int]  # the block in target ids
    q_rows: list | None  # sampling: the drafter's distributions over target ids
    seconds: float
    healed: bytes = b""  # text mode: the drafter replaced its last id, whose bytes the block spells first


class Decoder:
    """Speculative decoding over a verifier port and an optional drafter port."""

    def __init__(self, pair: TokenPair, verifier: VerifierPort, drafter: DrafterPort | None = None, *, eos_ids=(),
                 max_context: int = 0, check_context: bool = True, drafter_timeout_s: float | None = None,
                 round_log: str | None = None, colocated: bool = True):
        self.pair = pair
        self.verifier = verifier
        self.drafter = drafter if pair.drafter_tok is not None else None
        self.eos = set(int(e) for e in eos_ids)
        self.max_context = max_context
        self.check = check_context
        self.drafter_timeout_s = drafter_timeout_s
        self._mask_sent: set[str] = set()
        self._ratio: dict[tuple, tuple] = {}
        # sessions sharing the verifier's forwards, as the latest round saw it: a new request's
        # policy starts from it instead of from "alone" (its first rounds would price drafting
        # for an idle server)
        self._load = 1.0
        # requests in this Decoder's round loop now (id -> request): their number is a lower bound on
        # the verifier's load that a burst of new requests sees before any of their rounds has
        # reported it (_running), and what the others do (how many draft, their acceptance) is part
        # of what a block costs under load (DraftPolicy.rate)
        self._reqs: dict[int, _Request] = {}
        # whether the drafter computes on the verifier's hardware (its steps then stall every session's
        # verification): in process, or both servers on this host; the gateway's --colocated
        self.colocated = bool(colocated)
        self._lock = threading.Lock()
        # measured/predicted time ratios (drafter, verifier) per drafting mode, as the latest
        # rounds corrected them: a new request starts from there instead of from the cost tables
        self._scales: dict[str, tuple[float, float]] = {}
        # and how often probes found text that pays, what a failed one drafted (DraftPolicy.hit_s,
        # hit_n, probe_sum, probe_n): a pair's drafter gets text right more or less often
        self._probes: dict[str, tuple[float, float, float, float]] = {}
        # round_log (a path): one JSON line per round appended -- the policy's view and the round's
        # times, for tracing what the cost model decided and why (the gateway's --round-log)
        self._round_log = round_log or None

    # ---- port calls with re-sync --------------------------------------------------------------
    def _expect(self, ids) -> Expect | None:
        return Expect.of(ids) if self.check else None

    def _send_mask(self, mode: str) -> None:
        key = self.pair.keys[mode]
        if key not in self._mask_sent:
            mask = self.pair.masks[mode]
            if mode == "tli":  # the target id of each allowed id: coupled draws read its noise there
                self.drafter.set_allowed(key, mask, self.pair.d2t[np.nonzero(mask)[0]])
            else:  # text drafting is greedy only
                self.drafter.set_allowed(key, mask)
            self._mask_sent.add(key)

    def _policy(self, mode: str, draft: DraftConfig, params: SamplingParams) -> tuple[DraftPolicy, float]:
        """The draft-length policy of one request, and the measured seconds of one target step
        (0.0 with static costs). See DraftPolicy for measured vs static costs."""
        # coupled draws make a seeded text independent of the blocks drafted: like greedy decoding,
        # it can be priced at the measured costs and the load without losing its replay
        measured = draft.cost_model == "measured" or (draft.cost_model == "auto" and (params.greedy or params.coupled))
        key = (mode, measured)
        if key not in self._ratio:
            rows = int(self.pair.masks[mode].sum())
            dcost = self.drafter.cost(rows)
            inputs = (cost_ratio(dcost, self.verifier.cost()), None, 0.0, None)
            vt = self.verifier.timings() if measured else []
            dt = self.drafter.timings() if measured else []
            if vt and dt and vt[0] > 0:
                # the drafter's step: its measured 1-token forward, scaled to the pruned head's bytes
                body, row, all_rows = self.drafter.cost()
                frac = (body + row * rows) / max(1, body + row * all_rows)
                inputs = (dt[0] * frac / vt[0], list(vt), vt[0] / 1000.0, list(dt))
            self._ratio[key] = inputs
        c, vt, step_s, dt = self._ratio[key]
        # confident blocks: the drafter's doubt ends each block (greedy by default: replayed traces of
        # sampling were not measured)
        sc = draft.stop_cumulative
        confident = draft.adaptive and (sc > 0 if sc is not None else params.greedy)
        pol = DraftPolicy(draft, c, verify_costs=vt, measured=vt is not None, drafter_costs=dt, confident=confident)
        if pol.costs.measured:
            pol.resume(self._scales.get(mode), self._probes.get(mode))
        return pol, step_s

    def _verify(self, sid, t_ids, drafts, q_rows, round_index, params, seed, top_logprobs=-1):
        kw = {"top_logprobs": top_logprobs} if top_logprobs >= 0 else {}  # ports without it still work
        try:
            return self.verifier.verify(sid, self._expect(t_ids), drafts, q_rows, round_index, params, seed, **kw)
        except (NotFound, FailedPrecondition):
            self.verifier.sync(sid, t_ids)  # the verifier lost or diverged from the session: rebuild
            return self.verifier.verify(sid, self._expect(t_ids), drafts, q_rows, round_index, params, seed, **kw)

    def _draft(self, sid: str, d: DrafterState, k: int, round_index: int, params, seed, stop_below, mode,
               stop_cumulative: float = 0.0, heal: bool = False, position: int = -1):
        """Apply the drafter's pending edit and draft up to k tokens (raises Unavailable). position:
        the target-side position of the first proposal (coupled draws)."""
        key = self.pair.keys[mode]
        kw = dict(k=k, round_index=round_index, params=params, seed=seed, stop_below=stop_below, allowed_key=key,
                  timeout_s=self.drafter_timeout_s)
        if stop_cumulative > 0:  # ports without it still work
            kw["stop_cumulative"] = stop_cumulative
        if heal:
            kw["heal"] = True
        if params.coupled and position >= 0:
            kw["position"] = position
        try:
            toks = self.drafter.draft(sid, d.pending(), self._expect(d.ids), **kw)
        except (NotFound, FailedPrecondition):
            self._mask_sent.discard(key)
            self._send_mask(mode)
            self.drafter.sync(sid, d.ids)
            toks = self.drafter.draft(sid, None, self._expect(d.ids), **kw)
        d.sent = len(d.ids)
        return toks

    # ---- the loop -------------------------------------------------------------------------------
    def run(self, sid: str, target_ids: list[int], drafter_ids: list[int] | None, *, max_new_tokens: int,
            params: SamplingParams, seed: int, draft: DraftConfig, round_start: int = 0,
            use_drafter: bool = True, round_scope=None, stop=(), top_logprobs: int = -1) -> Run:
        """Validate and return the round iterator (its first step syncs both servers).

        stop: up to 4 strings; the output ends before the first one generated (finish_reason
        "stop"), matched on the generated text across token boundaries. Text that could still
        become a stop string is held back from the rounds' ``text`` until it cannot.
        top_logprobs: -1 = none; n in 0..20 = every generated token's log-probability under the
        target (after the request's logits processing) and the n most likely alternatives, exact
        whether the token was an accepted draft, a resample or the bonus token.

        round_scope: optional callable round_index -> context manager yielding record(RoundEvent);
        each round's port calls run inside it (the gateway opens the round's trace span there).
        """
        check_int("max_new_tokens", max_new_tokens, 1)
        check_int("seed", seed, 0, 2**63 - 1)
        if not target_ids:
            raise InvalidArgument("prompt", "must not be empty")
        if self.max_context and len(target_ids) + max_new_tokens > self.max_context:
            raise InvalidArgument(
                "max_new_tokens",
                f"prompt ({len(target_ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                f"exceeds the context ({self.max_context})")
        spec = use_drafter and self.drafter is not None and drafter_ids is not None
        if spec and draft.mode == "text" and not params.greedy:
            raise InvalidArgument("mode", "text drafting is lossless for greedy decoding only (temperature 0)")
        stops = check_stop(stop)
        check_int("top_logprobs", top_logprobs, -1, 20)
        stats = Stats(prompt_tokens=len(target_ids), draws=draws_of(params))
        req = _Request(sid, list(target_ids), max_new_tokens, params, seed, draft, stats,
                       spec, d=DrafterState(list(drafter_ids), len(drafter_ids), len(drafter_ids)) if spec else None,
                       stop=tuple(x.encode("utf-8") for x in stops), top_logprobs=top_logprobs)
        run = Run(None)
        run._gen = self._rounds(run, req, round_start, round_scope)
        return run

    def _start(self, req: _Request, round_index: int = 0) -> None:
        """Sync both servers with the prompt; choose the drafting mode and the policy."""
        stats = req.stats
        t0 = time.perf_counter()
        running0 = self._running
        reused, _ = self.verifier.sync(req.sid, req.t_ids)
        stats.reused_target_tokens = reused
        if req.spec:
            stats.mode = "speculative"
            req.text_mode = req.params.greedy and not self.pair.same_vocab and req.draft.mode in ("auto", "text")
            req.mode = "text" if req.text_mode else "tli"
            stats.draft_mode = req.mode
            try:
                self._send_mask(req.mode)
                req.policy, req.step_s = self._policy(req.mode, req.draft, req.params)
                stats.cost_model = "measured" if req.policy.costs.measured else "static"
            except (Unavailable, ResourceExhausted, InvalidArgument) as e:
                # the drafter is optional: whatever it cannot do, the target does alone (the request
                # itself was checked against the target, which is what decides the output)
                req.drafter_failed(e)
        if not req.spec:
            req.policy, req.step_s = DraftPolicy(req.draft, 1.0), 0.0
        req.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        req.k = req.policy.hi if req.spec and req.policy.confident else req.draft.num_draft_tokens
        pol = req.policy
        # what a first block's drafter forward feeds: the prompt (a session's later request finds
        # most of its history cached on the drafter)
        feed = len(req.d.ids) if req.spec and round_index == 0 else 1
        if req.spec and pol.costs.measured and req.draft.adaptive and req.draft.allow_skip:
            # the load: what the latest rounds saw, at least the requests in this loop now
            pol.expect_load(max(self._load, float(self._running)))
            self._peers(req)
            # a burst (other requests entered the loop moments ago and have not had a round yet): the
            # load this one would price is still climbing, and first blocks decided now would run their
            # drafter prefills on the cores verifying the burst's prompts. Start target-only: the first
            # round's end prices drafting at the load the burst settles at.
            if not pol.first_block_pays(req.max_new_tokens, feed) or self._unsettled(req):
                req.k = 0
        if req.spec and req.k == 0:
            req.d.synced = False  # the drafter gets the prompt if and when the request drafts
            pol.drafter_missed(feed)  # (and a probe's cost counts that feed)
        elif req.spec:
            self._sync_drafter(req)
        if self._round_log and req.spec:
            view = pol.log_fields()
            self._write_log({"t": round(time.time(), 4), "sid": req.sid, "start": round_index, "k": req.k,
                             "feed": feed, "sync_s": round(time.perf_counter() - t0, 4),
                             "running_before_sync": running0, "running": self._running,
                             **{x: view[x] for x in ("load", "others_drafting", "alpha")}})

    def _sync_drafter(self, req: _Request) -> None:
        """Give the drafter the session (its prompt, or the prompt and what was generated since)."""
        try:
            req.stats.reused_drafter_tokens, _ = self.drafter.sync(req.sid, req.d.ids)
            req.d.sent, req.d.synced = len(req.d.ids), True
        except (Unavailable, ResourceExhausted, InvalidArgument) as e:
            req.drafter_failed(e)

    def _rounds(self, run: Run, req: _Request, round_index: int, round_scope):
        t_start = time.perf_counter()
        run.target_ids = req.t_ids
        run.drafter_ids = req.d.ids if req.d else None
        with self._lock:
            self._reqs[id(req)] = req
        try:
            yield from self._loop(run, req, round_index, round_scope, t_start)
        finally:
            with self._lock:
                self._reqs.pop(id(req), None)

    @property
    def _running(self) -> int:
        """Requests in the round loop now."""
        return len(self._reqs)

    def _unsettled(self, req: _Request) -> bool:
        """Whether another request in the loop has not finished its first round yet."""
        with self._lock:
            return any(r is not req and r.first for r in self._reqs.values())

    def _peers(self, req: _Request) -> None:
        """Measured costs: tell the request's policy what the other requests in this loop do now --
        how many draft (their next block is not empty) and their mean acceptance estimate -- and
        whether the drafter shares the verifier's hardware. Sessions of other gateways count as
        not drafting (the verifier's load includes them; their drafting is not known here)."""
        pol = req.policy
        if pol is None or not pol.costs.measured:
            return
        with self._lock:
            others = [r for r in self._reqs.values() if r is not req and r.spec and r.policy is not None]
        peer_alpha = sum(r.policy.acceptance.alpha() for r in others) / len(others) if others else None
        pol.see_peers(float(sum(1 for r in others if r.k > 0)), peer_alpha, self.colocated)

    def _loop(self, run: Run, req: _Request, round_index: int, round_scope, t_start: float):
        self._start(req, round_index)
        while True:
            ev = None
            with (round_scope(round_index) if round_scope is not None else nullcontext(None)) as record:
                done_round = self._round(req, round_index)
                if record is not None:
                    record(done_round)
                ev = done_round
            if ev is None:  # the round scope swallowed an error: the request ends here
                return
            round_index += 1
            run.next_round = round_index
            if req.d is not None:
                run.drafter_ids = req.d.ids
            if ev.done:
                req.stats.new_tokens = len(req.gen)
                req.stats.total_s = time.perf_counter() - t_start
                cut = len(req.gen_bytes) if req.cut is None else req.cut
                text = bytes(req.gen_bytes[:cut]).decode("utf-8", errors="replace")
                tail = bytes(req.gen_bytes[cut:]).decode("utf-8", errors="replace")
                run.result = GenerationResult(text, req.gen, req.stats, stop_tail=tail,
                                              logprobs=req.logprobs if req.top_logprobs >= 0 else None)
            yield ev
            if ev.done:
                return

    def _round(self, req: _Request, round_index: int) -> RoundEvent:
        """One round: draft -> verify -> emit -> commit the drafter's edit and choose the next k."""
        stats = req.stats
        remaining = req.max_new_tokens - len(req.gen)
        kk = min(req.k, remaining - 1) if req.spec else 0
        t_round = time.perf_counter()
        drafted = self._draft_step(req, kk, remaining, round_index)
        draft_wall = time.perf_counter() - t_round
        t_verify = time.perf_counter()
        res = self._verify(req.sid, req.t_ids, drafted.target_ids, drafted.q_rows, round_index, req.params, req.seed,
                           req.top_logprobs)
        verify_wall = time.perf_counter() - t_verify
        kd, n = len(drafted.target_ids), res.num_accepted
        if req.spec:  # the first block's acceptance counts too (only its times include the prefill)
            req.policy.observe(kd, n)
            if req.text_mode and drafted.tokens:  # what one drafted target token costs in drafter steps
                req.policy.observe_steps(len(drafted.tokens), kd)
        if req.first:
            stats.prefill_s += res.forward_s
        else:
            stats.verify_s += res.forward_s
            if req.spec:
                # how many sessions share the verifier's forwards (its recent senders; else this batch's
                # rows), and at least the requests in this loop now: each sends the verifier rows
                # whenever it is not waiting on the drafter, but a session that waits long on a busy
                # drafter drops out of the verifier's count of recent senders, and pricing with that
                # smaller count would have more sessions draft than pays
                load = max(getattr(res, "active_sessions", 0) or getattr(res, "batch_size", 1) or 1, self._running)
                req.policy.observe_batch(load)
                # the average follows the reports; the requests in the loop now are a floor it must not
                # lag below (a burst's first requests start at a small load, and an average climbing 30%
                # a round would price their first rounds far below the load they share)
                req.policy.load_at_least(self._running)
                self._load = req.policy.costs.batch
                # wall-clock corrections (measured costs only). A block after skipped rounds first
                # feeds the drafter what it missed, all in its first step's forward: its other
                # steps still time the drafter (so a probe corrects a wrong cost table too)
                toks = drafted.tokens
                steps, dsec = len(toks), draft_wall
                if not req.prev_drafted:  # (the drafter's own times of its later steps)
                    steps, dsec = max(0, len(toks) - 1), sum(t.forward_s for t in toks[1:])
                # the verification's own time: its wait in the verifier's queue (for other sessions'
                # forwards) is not a cost of this block's size, and read as one it made the target
                # look slow and drafting cheap under load
                vsec = max(1e-6, verify_wall - getattr(res, "queue_wait_s", 0.0))
                req.policy.observe_time(steps, dsec, kd + 1, vsec, req.step_s)
                if req.policy.costs.measured:
                    self._scales[req.mode] = req.policy.scales()
        req.prev_drafted = len(drafted.tokens) > 0
        req.first = False
        stats.record_round(kd, n)
        if req.spec and kd == 0 and remaining > 1:
            stats.skipped_rounds += 1
        out, text, done = self._emit(req, list(drafted.target_ids[:n]) + [res.next_token])
        lps = None
        if req.top_logprobs >= 0:
            lps = list(getattr(res, "logprobs", None) or [])[: len(out)]
            req.logprobs.extend(lps)
        if done and req.d is not None:
            req.d.edit(req.d.prompt_len, self._encode_drafter_bytes(bytes(req.gen_bytes)))
        if not done and req.spec:
            self._commit_drafter(req, drafted, n, res.next_token)
            d = req.d
            # what the drafter would be fed before its next block (all of its ids if it never
            # had the session; else what it does not hold yet)
            feed = len(d.ids) if not d.synced else len(d.ids) - d.sent
            self._peers(req)
            req.k = req.policy.next_k(req.max_new_tokens - len(req.gen), feed)
            if req.policy.costs.measured and kd > 0:
                self._probes[req.mode] = req.policy.probe_record()
        overhead = time.perf_counter() - t_round - res.forward_s - drafted.seconds
        stats.overhead_s += overhead
        if self._round_log:
            self._log_round(req, round_index, kk, kd, n, res, draft_wall, verify_wall)
        return RoundEvent(round_index, kk, kd, n, out, text, drafted.seconds, res.forward_s, overhead, done, req.t_ids,
                          req.d.ids if req.d else None, batch_size=getattr(res, "batch_size", 1),
                          queue_wait_s=getattr(res, "queue_wait_s", 0.0), logprobs=lps)

    def _log_round(self, req: _Request, round_index: int, kk: int, kd: int, n: int, res, draft_s: float,
                   verify_s: float) -> None:
        pol = req.policy
        rec = {"t": round(time.time(), 4), "sid": req.sid, "round": round_index, "mode": req.mode, "requested": kk,
               "drafted": kd, "accepted": n, "next_k": req.k if req.spec else 0,
               "draft_s": round(draft_s, 4), "verify_s": round(verify_s, 4),
               "queue_wait_s": round(getattr(res, "queue_wait_s", 0.0), 4),
               "batch_size": getattr(res, "batch_size", 1), "active_sessions": getattr(res, "active_sessions", 0),
               "running": self._running}
        if req.spec:
            rec.update(pol.log_fields())
        self._write_log(rec)

    def _write_log(self, rec: dict) -> None:
        line = json.dumps(rec) + "\n"
        with self._lock:
            try:
                with open(self._round_log, "a", encoding="utf-8") as f:
                    f.write(line)
            except OSError:
                self._round_log = None  # a log that cannot be written is dropped, never the request

    def _draft_step(self, req: _Request, kk: int, remaining: int, round_index: int) -> _Drafted:
        """Draft up to kk tokens and express them in target ids (nothing when kk == 0)."""
        if kk <= 0:
            return _Drafted([], [], None, 0.0)
        pair = self.pair
        t0 = time.perf_counter()
        toks: list = []
        if not req.d.synced:
            self._sync_drafter(req)
            if not req.spec:  # the drafter failed: the request goes on target-only
                return _Drafted([], [], None, 0.0)
        # token healing (text mode): the drafter may re-choose its last id, one the gateway's
        # re-encoding of the target's text chose (crossdraft.vocab.healing); only a generated one
        d = req.d
        heal = req.text_mode and req.draft.heal and len(d.ids) > d.prompt_len
        healed = b""
        try:
            sc = req.policy.cumulative_stop() if req.policy.confident or req.draft.stop_cumulative else 0.0
            toks = self._draft(req.sid, d, kk, round_index, req.params, req.seed, req.draft.stop_below, req.mode,
                               sc, heal, len(req.t_ids))
        except (Unavailable, ResourceExhausted, InvalidArgument) as e:  # the request goes on target-only
            req.drafter_failed(e)
        if heal and toks and toks[0].heals:  # the drafter dropped its last id: so does our view of it
            healed = pair.d_bytes[d.ids.pop()]
            d.gen_lens.pop()
            d.sent = min(d.sent, len(d.ids))
            req.stats.healed += 1
        seconds = sum(t.forward_s for t in toks) if toks else time.perf_counter() - t0
        d_prop = [t.id for t in toks]
        q_rows = None
        if req.text_mode:
            drafted_bytes = b"".join(pair.d_bytes[x] for x in d_prop)
            # a healed block first spells the replaced id's bytes (all of them unless it ended early)
            drafted_bytes = drafted_bytes[len(healed):] if drafted_bytes.startswith(healed) else b""
            try:
                drafts_t = pair.encode_target_bytes(drafted_bytes)[: remaining - 1] if drafted_bytes else []
            except ValueError:  # the target cannot spell these bytes: nothing to propose
                drafts_t = []
        else:
            drafts_t = [int(pair.d2t[x]) for x in d_prop]
            if not req.params.greedy and not req.params.coupled:  # coupled draws test no distribution
                q_rows = [pair.map_q(t.q_ids, t.q_probs) for t in toks]
        req.stats.draft_s += seconds
        return _Drafted(toks, drafts_t, q_rows, seconds, healed)

    def _emit(self, req: _Request, emitted: list[int]) -> tuple[list[int], str, bool]:
        """Append the round's target tokens (cut after an EOS); (tokens, complete new text, done)."""
        out = emitted
        for j, tok in enumerate(out):
            if tok in self.eos:
                out = out[: j + 1]
                req.stats.finish_reason = "stop"
                break
        if req.stop:
            out = self._find_stop(req, out)
        req.gen.extend(out)
        req.t_ids.extend(out)
        if req.cut is None:
            req.gen_bytes += self.pair.target_text_bytes(out)
        done = req.stats.finish_reason == "stop" or len(req.gen) >= req.max_new_tokens
        # text goes out up to a stop string, else up to what could still become one (all of it at the end)
        end = req.cut if req.cut is not None else len(req.gen_bytes) if done else _safe_end(req.gen_bytes, req.stop)
        piece = bytes(req.gen_bytes[req.fed:end])
        req.fed = max(req.fed, end)
        return out, req.utf8.decode(piece, final=done), done

    def _find_stop(self, req: _Request, out: list[int]) -> list[int]:
        """Look for a stop string in the text so far plus ``out``; if one is there, cut ``out`` after
        the token that completes it, set ``req.cut`` and finish_reason "stop"."""
        base = len(req.gen_bytes)
        pieces = [self.pair.target_text_bytes([t]) for t in out]
        buf = bytes(req.gen_bytes) + b"".join(pieces)
        longest = max(len(x) for x in req.stop)
        start = max(0, base - longest + 1)
        hits = [(i, i + len(x)) for x in req.stop if (i := buf.find(x, start)) >= 0]
        if not hits:
            return out
        cut, end = min(hits)
        n, pos = 0, base
        while pos < end and n < len(out):
            pos += len(pieces[n])
            n += 1
        req.gen_bytes += b"".join(pieces[:n])
        req.cut = cut
        req.stats.finish_reason = "stop"
        return out[:n]

    # ---- drafter bookkeeping (gateway side) ------------------------------------------------------
    def _commit_drafter(self, req: _Request, drafted: _Drafted, n: int, next_token: int) -> None:
        d_prop = [t.id for t in drafted.tokens]
        if req.text_mode:
            self._commit_text(req.d, d_prop, drafted.target_ids[:n], next_token, drafted.healed)
        else:
            self._commit_tli(req.d, d_prop[:n], next_token, bytes(req.gen_bytes), req.draft.resync_window, req.stats)

    def _commit_tli(self, d: DrafterState, accepted_d: list[int], nxt: int, gen_bytes: bytes, window: int,
                    stats: Stats) -> None:
        pair = self.pair
        d_nxt = int(pair.t2d[nxt]) if 0 <= nxt < len(pair.t2d) else -1
        if d_nxt >= 0:
            d.edit(len(d.ids), accepted_d + [d_nxt])
            d.gen_lens.extend(len(pair.d_bytes[t]) for t in accepted_d + [d_nxt])
            return
        d.edit(len(d.ids), accepted_d)
        d.gen_lens.extend(len(pair.d_bytes[t]) for t in accepted_d)
        self._resync(d, gen_bytes, window)
        stats.resyncs += 1

    def _resync(self, d: DrafterState, gen_bytes: bytes, window: int) -> None:
        """Re-tokenise the drafter's last `window` generated tokens plus the target's new text.

        The drafter's generated ids always spell exactly the target's generated bytes (accepted
        drafts and mapped target tokens have identical bytes; re-tokenised tails are encoded
        byte-exactly), so the kept prefix ends at a known byte offset.
        """
        pair = self.pair
        lens = d.gen_lens
        n_gen = len(d.ids) - d.prompt_len
        keep = max(0, n_gen - window)
        tail = gen_bytes[sum(lens[:keep]):]
        new_tail = self._encode_drafter_bytes(tail)
        d.edit(d.prompt_len + keep, new_tail)
        del lens[keep:]
        lens.extend(len(pair.d_bytes[t]) if t < len(pair.d_bytes) else 0 for t in new_tail)

    def _encode_drafter_bytes(self, data: bytes) -> list[int]:
        if not data:
            return []
        try:
            return self.pair.encode_drafter_bytes(data)
        except ValueError:  # the drafter cannot spell these bytes: approximate (quality only)
            text = data.decode("utf-8", errors="ignore")
            return list(self.pair.drafter_tok(text, add_special_tokens=False)["input_ids"]) if text else []

    def _commit_text(self, d: DrafterState, proposals: list[int], accepted_t: list[int], next_t: int,
                     healed: bytes = b"") -> None:
        """Text drafting: keep the drafter proposals lying wholly inside the accepted text, then
        append the rest of the new text (accepted drafts + the target's token) encoded byte-exactly.
        healed: the bytes of the id the drafter replaced (its proposals spell them first)."""
        pair = self.pair
        new_bytes = healed + pair.target_text_bytes(accepted_t)
        agreed = len(new_bytes)
        new_bytes += pair.target_text_bytes([next_t])
        keep, off = 0, 0
        for x in proposals:
            b = pair.d_bytes[x]
            if off + len(b) > agreed or new_bytes[off:off + len(b)] != b:
                break
            off += len(b)
            keep += 1
        tail = self._encode_drafter_bytes(new_bytes[off:])
        d.edit(len(d.ids), proposals[:keep] + tail)
        d.gen_lens.extend(len(pair.d_bytes[t]) if t < len(pair.d_bytes) else 0 for t in proposals[:keep] + tail)


MAX_STOP = 4  # stop strings per request (as the OpenAI API)
MAX_STOP_CHARS = 256


def check_stop(stop) -> list[str]:
    """A request's ``stop``: None, a string, or a list of up to 4 non-empty strings -> list."""
    if stop is None or stop == "":
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise InvalidArgument("stop", "must be a string or a list of strings")
    if len(stop) > MAX_STOP:
        raise InvalidArgument("stop", f"at most {MAX_STOP} stop strings, got {len(stop)}")
    out = []
    for i, x in enumerate(stop):
        if not isinstance(x, str) or not x:
            raise InvalidArgument(f"stop[{i}]", "must be a non-empty string")
        if len(x) > MAX_STOP_CHARS:
            raise InvalidArgument(f"stop[{i}]", f"is longer than {MAX_STOP_CHARS} characters")
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(f"stop[{i}]", "is not valid UTF-8 (unpaired surrogate)") from None
        out.append(x)
    return out


def _safe_end(buf: bytearray, stops: tuple[bytes, ...]) -> int:
    """How much of ``buf`` can go out: all but its longest tail that begins some stop string."""
    n = len(buf)
    for k in range(min(n, max((len(x) for x in stops), default=1) - 1), 0, -1):
        tail = bytes(buf[n - k:])
        if any(x.startswith(tail) for x in stops):
            return n - k
    return n
