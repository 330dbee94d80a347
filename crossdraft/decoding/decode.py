"""The round loop, shared by the in-process engine and the gateway.

:class:`Decoder` runs speculative decoding over two ports -- a verifier and (optionally) a
drafter -- stated in :mod:`crossdraft.decoding.ports` (``VerifierPort``, ``DrafterPort``). In process the
ports ARE the model workers; in the gateway they are gRPC clients of the drafter and verifier
services. The loop speaks both vocabularies through :class:`crossdraft.vocab.pair.TokenPair`; the
model servers only ever see their own ids.

One round (:meth:`Decoder._round`): 1. (apply the pending drafter edit and) draft k tokens, in
target ids (and q over target ids) -> 2. verify them in one target forward -> 3. the policy learns
what the round showed -> 4. emit the new tokens and text -> 5. record the drafter's edit (accepted
proposals + the target's token, or a byte-exact re-tokenised tail) and choose the next k.
What a request generated lives in :mod:`crossdraft.decoding.output`, the loop's view of the drafter
in :mod:`crossdraft.decoding.drafter_view`, what a run reports in :mod:`crossdraft.decoding.stats`.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext, suppress

import numpy as np

from crossdraft.decoding.costmodel import CarriedScales, cost_ratio
from crossdraft.decoding.drafter_view import DrafterState, block_in_target_ids, encode_drafter_bytes
from crossdraft.decoding.gang import Gang
from crossdraft.decoding.gate import LoadGate
from crossdraft.decoding.messages import Expect
from crossdraft.decoding.output import Output, check_stop
from crossdraft.decoding.pipeline import Pipelining
from crossdraft.decoding.policy import DraftConfig, DraftPolicy
from crossdraft.decoding.ports import DrafterPort, VerifierPort
from crossdraft.decoding.request import Drafted, Request, Run
from crossdraft.decoding.roundlog import RoundLog, round_record, start_record
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.decoding.stats import RoundEvent, Stats, draws_of
from crossdraft.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable, check_int
from crossdraft.vocab.pair import TokenPair


class Decoder(Pipelining):
    """Speculative decoding over a verifier port and an optional drafter port."""

    def __init__(self, pair: TokenPair, verifier: VerifierPort, drafter: DrafterPort | None = None, *, eos_ids=(),
                 max_context: int = 0, check_context: bool = True, drafter_timeout_s: float | None = None,
                 round_log: str | None = None, colocated: bool = True, pipeline: bool = False, name: str = "",
                 gate: LoadGate | None = None, branch: bool = False):
        self.pair = pair
        # the drafter kind this Decoder drafts with, in a gateway's pool of kinds ("" = the only one)
        self.name = name
        self.verifier = verifier
        self.drafter = drafter if pair.drafter_tok is not None else None
        self.eos = set(int(e) for e in eos_ids)
        self.max_context = max_context
        self.check = check_context
        self.drafter_timeout_s = drafter_timeout_s
        self._mask_sent: set[str] = set()
        self._ratio: dict[tuple, tuple] = {}
        # sessions sharing the verifier's forwards, as the latest round saw it: a new request's policy starts
        # from it instead of from "alone" (its first rounds would price drafting for an idle server)
        self._load = 1.0
        # requests in this Decoder's round loop now (id -> request): their number is a lower bound on
        # the verifier's load that a burst of new requests sees before any of their rounds has
        # reported it (_running), and what the others do (how many draft, their acceptance) is part
        # of what a block costs under load (CostModel.rate)
        self._reqs: dict[int, Request] = {}
        # whether the drafter computes on the verifier's hardware (its steps then stall every session's
        # verification): in process, or both servers on this host; the gateway's --colocated
        self.colocated = bool(colocated)
        # pipelined rounds (crossdraft.decoding.pipeline): each block's successor is drafted while it is verified
        self.pipeline = bool(pipeline)
        self.branch = bool(branch)  # and (greedy TLI) a branch beside the block ahead (pipeline.Branch)
        self._lock = threading.Lock()
        # the cost scales the latest rounds corrected, per drafting mode and load band (a new request starts there)
        self._scales = CarriedScales()
        # and how often probes found text that pays, what a failed one drafted (DraftPolicy.probe_record):
        # a pair's drafter gets text right more or less often
        self._probes: dict[str, tuple[float, float, float, float]] = {}
        # the verifier's and the drafter's latest published prices of a batched forward (crossdraft.runtime.price):
        # a new request prices rows with them before its own rounds report any
        self._price = self._dprice = None
        # round_log (a path): one JSON line per round appended (the gateway's --round-log)
        self.log = RoundLog(round_log)
        # whether drafting pays at the load now, measured (crossdraft.decoding.gate; experimental, off unless
        # given one that is on); a gateway shares one among the Decoders over the same verifier
        self.gate = gate if gate is not None else LoadGate(enabled=False)
        self.gang = Gang()  # the blocks drafted now: a ready one waits for them (crossdraft.decoding.gang)

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
        (0.0 with static costs). See CostModel for measured vs static costs."""
        # coupled draws make a seeded text independent of the blocks drafted: like greedy decoding,
        # it can be priced at the measured costs and the load without losing its replay
        measured = draft.measures(params)
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
        # confident blocks: the drafter's doubt ends each block (greedy by default: the recorded traces
        # that tune them are greedy)
        sc = draft.stop_cumulative
        confident = draft.adaptive and (sc > 0 if sc is not None else params.greedy)
        pol = DraftPolicy(draft, c, verify_costs=vt, measured=vt is not None, drafter_costs=dt, confident=confident)
        pol.costs.pipelined = self.pipeline
        if pol.costs.measured:
            pol.resume(self._scales.get(mode, max(self._load, float(self._running))), self._probes.get(mode))
            pol.see_price(self._price, self._dprice)
        return pol, step_s

    def _verify(self, req: Request, drafted: Drafted, round_index: int):
        top = req.out.top_logprobs
        kw = {"top_logprobs": top} if top >= 0 else {}  # ports without it still work
        args = (drafted.target_ids, drafted.q_rows, round_index, req.params, req.seed)
        kw |= {"gang": req.gang_n} if req.gang_n > 1 else {}  # (blocks sent with this one: crossdraft.decoding.gang)
        if req.drop_bonus:  # (pipelined) the verifier drops the previous round's own token first
            req.drop_bonus = False
            kw["drop_last"] = True
        try:
            return self.verifier.verify(req.sid, self._expect(req.t_ids), *args, **kw)
        except (NotFound, FailedPrecondition):  # the verifier lost or diverged from the session (or cannot drop
            kw.pop("drop_last", None)  # a token): rebuild it -- again if a full KV pool evicts it before the verify
        for _ in range(3):
            self.verifier.sync(req.sid, req.t_ids)
            with suppress(NotFound):
                return self.verifier.verify(req.sid, self._expect(req.t_ids), *args, **kw)
        raise ResourceExhausted("kv cache full: the session was evicted between its sync and its verification")

    def _draft(self, req: Request, k: int, round_index: int, stop_cumulative: float, heal: bool):
        """Apply the drafter's pending edit and draft up to k tokens (raises Unavailable)."""
        d, params, key = req.d, req.params, self.pair.keys[req.mode]
        kw = dict(k=k, round_index=round_index, params=params, seed=req.seed, stop_below=req.draft.stop_below,
                  allowed_key=key, timeout_s=self.drafter_timeout_s, **({"gang": req.gang_n} if req.gang_n > 1 else {}))
        if stop_cumulative > 0:  # ports without it still work
            kw["stop_cumulative"] = stop_cumulative
        if heal:
            kw["heal"] = True
        if params.coupled:  # the target-side position of the first proposal (coupled draws)
            kw["position"] = len(req.t_ids)
        if self._branching(req):  # (the drafter's second choices: a pipelined block's branch)
            kw["runner_up"] = True
        try:
            toks = self.drafter.draft(req.sid, d.pending(), self._expect(d.ids), **kw)
        except (NotFound, FailedPrecondition):
            self._mask_sent.discard(key)
            self._send_mask(req.mode)
            self.drafter.sync(req.sid, d.ids)
            toks = self.drafter.draft(req.sid, None, self._expect(d.ids), **kw)
        d.sent = len(d.ids)
        return toks

    def _sync_drafter(self, req: Request) -> None:
        """Give the drafter the session (its prompt, or the prompt and what was generated since)."""
        try:
            req.stats.reused_drafter_tokens, _ = self.drafter.sync(req.sid, req.d.ids)
            req.d.sent, req.d.synced = len(req.d.ids), True
        except (Unavailable, ResourceExhausted, InvalidArgument) as e:
            req.drafter_failed(e)

    # ---- a request --------------------------------------------------------------------------------
    def run(self, sid: str, target_ids: list[int], drafter_ids: list[int] | None, *, max_new_tokens: int,
            params: SamplingParams, seed: int, draft: DraftConfig, round_start: int = 0,
            use_drafter: bool = True, round_scope=None, stop=(), top_logprobs: int = -1, chooser=None) -> Run:
        """Validate and return the round iterator (its first step syncs both servers).

        stop: up to 4 strings; the output ends before the first one generated (finish_reason
        "stop"), matched on the generated text across token boundaries. Text that could still
        become a stop string is held back from the rounds' ``text`` until it cannot.
        top_logprobs: -1 = none; n in 0..20 = every generated token's log-probability under the
        target (after the request's logits processing) and the n most likely alternatives, exact
        whether the token was an accepted draft, a resample or the bonus token.

        round_scope: optional callable round_index -> context manager yielding record(RoundEvent);
        each round's port calls run inside it (the gateway opens the round's trace span there).
        chooser: optional callable (Request, RoundEvent) -> Decoder or None, asked after each round that
        does not end the request: a Decoder (another drafter kind over the same verifier) takes the
        request over from the next round (:meth:`hand_over`; the gateway's pool of drafters).
        """
        check_int("max_new_tokens", max_new_tokens, 1)
        check_int("seed", seed, 0, 2**63 - 1)
        if not target_ids:
            raise InvalidArgument("prompt", "must not be empty")
        if self.max_context and len(target_ids) + max_new_tokens > self.max_context:
            raise InvalidArgument("max_new_tokens", f"prompt ({len(target_ids)} tokens) + max_new_tokens "
                                                    f"({max_new_tokens}) exceeds the context ({self.max_context})")
        spec = use_drafter and self.drafter is not None and drafter_ids is not None
        if spec and draft.mode == "text" and not params.greedy:
            raise InvalidArgument("mode", "text drafting is lossless for greedy decoding only (temperature 0)")
        stops = check_stop(stop)
        check_int("top_logprobs", top_logprobs, -1, 20)
        stats = Stats(prompt_tokens=len(target_ids), draws=draws_of(params))
        req = Request(sid, list(target_ids), max_new_tokens, params, seed, draft, stats,
                       spec, d=DrafterState(list(drafter_ids), len(drafter_ids), len(drafter_ids)) if spec else None,
                       out=Output(stop=tuple(x.encode("utf-8") for x in stops), top_logprobs=top_logprobs))
        req.chooser = chooser
        if spec and self.name:
            stats.drafter = self.name
        run = Run(None)
        run._gen = self._rounds(run, req, round_start, round_scope)
        return run

    def _start(self, req: Request, round_index: int = 0) -> None:
        """Sync both servers with the prompt; choose the drafting mode, the policy and the first block."""
        t0 = time.perf_counter()
        running0 = self._running
        req.stats.reused_target_tokens, _ = self.verifier.sync(req.sid, req.t_ids)
        if req.spec:
            self._choose_mode(req)
        if not req.spec:
            req.policy, req.step_s = DraftPolicy(req.draft, 1.0), 0.0
        pol = req.policy
        req.k = pol.hi if req.spec and pol.confident else req.draft.num_draft_tokens
        # what a first block's drafter forward feeds: the prompt (a session's later request finds
        # most of its history cached on the drafter)
        feed = len(req.d.ids) if req.spec and round_index == 0 else 1
        if req.spec and pol.costs.measured and req.draft.adaptive and req.draft.allow_skip:
            # the load: what the latest rounds saw, at least the requests in this loop now
            pol.expect_load(max(self._load, float(self._running)))
            self._peers(req)
            self._hold(req)
            # a burst (other requests entered the loop moments ago and have not had a round yet): the
            # load this one would price is still climbing, and first blocks decided now would run their
            # drafter prefills on the cores verifying the burst's prompts. Start target-only: the first
            # round's end prices drafting at the load the burst settles at.
            if not pol.first_block_pays(req.max_new_tokens, feed):
                req.k = 0
            elif self._unsettled(req):
                req.k, pol.reason = 0, "starting"
            else:  # (a confident block's bound at this load: DraftPolicy.block_of)
                req.k = pol.block_of(pol.best_k()) if pol.confident else req.k
        if req.spec and req.k == 0:
            req.d.synced = False  # the drafter gets the prompt if and when the request drafts
            pol.drafter_missed(feed)  # (and a probe's cost counts that feed)
        elif req.spec:
            self._sync_drafter(req)
            req.prefill = self._prefill_beside(req)  # (pipeline.py: the target's prefill beside the first block)
        if self.log and req.spec:
            self.log.write(start_record(req, round_index, feed, time.perf_counter() - t0, running0, self._running))

    def _choose_mode(self, req: Request) -> None:
        """A speculative request: its drafting mode (text for greedy decoding across vocabularies,
        else TLI), the drafter's mask for it, and its policy."""
        stats = req.stats
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

    def _rounds(self, run: Run, req: Request, round_index: int, round_scope):
        t_start = time.perf_counter()
        run.target_ids, run.drafter_ids = req.t_ids, req.d.ids if req.d else None
        run.decoder = self
        with self._lock:
            self._reqs[id(req)] = req
        req.gate = self.gate
        req.gate.enter()
        try:
            yield from self._loop(run, req, round_index, round_scope, t_start)
        finally:
            req.gate.leave()
            dec = run.decoder  # (the request may have been handed over to another drafter kind's Decoder)
            with dec._lock:
                dec._reqs.pop(id(req), None)
            dec.gang.leave(req.sid)  # (a block it was drafting when a round failed: nobody waits for it)
            self._end_calls(req)  # (pipeline.py: the calls beside its rounds end before the session's next)

    def _loop(self, run: Run, req: Request, round_index: int, round_scope, t_start: float):
        self._start(req, round_index)
        dec = self
        while True:
            ev = None
            with (round_scope(round_index) if round_scope is not None else nullcontext(None)) as record:
                done_round = dec._round(req, round_index)
                if record is not None:
                    record(done_round)
                ev = done_round
            if ev is None:  # the round scope swallowed an error: the request ends here
                return
            req.gate.record(len(ev.emitted), ev.speculative, ev.drafted > 0)
            round_index += 1
            run.next_round = round_index
            if not ev.done and req.chooser is not None and req.ready is None and req.ahead is None:
                other = req.chooser(req, ev)
                if other is not None and other is not dec:
                    dec.hand_over(req, other)
                    dec = run.decoder = other
            if req.d is not None:
                run.drafter_ids = req.d.ids
            if ev.done:
                if self.log:  # the request's lines are in the file when its result is
                    self.log.flush()
                req.stats.new_tokens = len(req.out.gen)
                req.stats.total_s = time.perf_counter() - t_start
                run.result = req.out.result(req.stats)
            yield ev
            if ev.done:
                return

    def hand_over(self, req: Request, other: Decoder) -> None:
        """Between two rounds, move the request to `other`: another drafter kind's Decoder over the same
        verifier (a gateway's pool of drafters). The target side is untouched -- the verifier's session,
        the output, the round counter -- so the text is what it would have been: each round's tokens
        are the target's choice whatever was drafted. The new kind's view of the history is the
        prompt (the target's rendering of it) and the generated bytes, re-encoded byte-exactly in its
        vocabulary; its drafter gets the session when the request next drafts (as a session moved to
        another replica does), with a drafting mode and a policy of its own."""
        with self._lock:
            self._reqs.pop(id(req), None)
        with other._lock:
            other._reqs[id(req)] = req
        n_prompt = req.stats.prompt_tokens
        gen = bytes(req.out.gen_bytes)
        prompt = other.pair.encode_drafter(self.pair.target_tok.decode(req.t_ids[:n_prompt]))
        state = DrafterState(list(prompt), 0, len(prompt), synced=False)
        tail = encode_drafter_bytes(other.pair, gen) if gen else []
        state.edit(len(prompt), tail)
        state.gen_lens = [len(other.pair.d_bytes[t]) if t < len(other.pair.d_bytes) else 0 for t in tail]
        state.sent = 0
        req.d, req.spec, req.prev_drafted, req.k = state, other.drafter is not None, False, 0
        req.drop_bonus, req.policy = False, None
        req.stats.drafter_switches += 1
        req.stats.drafter = other.name
        if not req.spec:
            return
        other._choose_mode(req)
        if not req.spec:  # the new kind refused the mask (its drafter failed): target-only, as any failure
            return
        pol = req.policy
        req.k = pol.hi if pol.confident else req.draft.num_draft_tokens
        if pol.costs.measured and req.draft.adaptive:
            pol.expect_load(max(other._load, float(other._running)))
            other._peers(req)
            if other._hold(req):  # the load gate holds drafting: the next round drafts nothing
                req.k, pol.reason = 0, "load"
            elif req.draft.allow_skip and not pol.first_block_pays(req.remaining(), len(state.ids)):
                req.k = 0  # as a new request's first block: only where it could pay, the drafter's sync included
            elif pol.confident:  # (and bounded as one at this load: DraftPolicy.block_of)
                req.k = pol.block_of(pol.best_k())
        if req.k == 0:
            pol.drafter_missed(len(state.ids))

    # ---- the other requests in the loop -----------------------------------------------------------
    @property
    def _running(self) -> int:
        """Requests in the round loop now."""
        return len(self._reqs)

    def _unsettled(self, req: Request) -> bool:
        """Whether another request in the loop has not finished its first round yet."""
        with self._lock:
            return any(r is not req and r.first for r in self._reqs.values())

    def _peers(self, req: Request) -> None:
        """Measured costs: tell the request's policy what the other requests in this loop do now --
        how many draft (their next block is not empty) and their mean acceptance estimate -- and
        whether the drafter shares the verifier's hardware (unless it keeps out: DraftPolicy.keeps_out).
        Sessions of other gateways count as not drafting (their drafting is not known here)."""
        pol = req.policy
        if pol is None or not pol.costs.measured or pol.keeps_out():
            return
        with self._lock:
            others = [r for r in self._reqs.values() if r is not req and r.spec and r.policy is not None]
        peer_alpha = sum(r.policy.acceptance.alpha() for r in others) / len(others) if others else None
        pol.see_peers(float(sum(1 for r in others if r.k > 0)), peer_alpha, self.colocated)

    @staticmethod
    def _hold(req: Request) -> bool:
        """Tell the request's policy whether the load gate holds drafting now (adaptive blocks with
        measured costs that may skip; the others draft as they would); returns the policy's view."""
        pol = req.policy
        if pol is None or not pol.costs.measured or not req.draft.adaptive or not req.draft.allow_skip:
            return False
        pol.held = req.gate is not None and req.gate.holds()
        return pol.held

    # ---- one round --------------------------------------------------------------------------------
    def _round(self, req: Request, round_index: int) -> RoundEvent:
        """One round: draft -> verify -> learn -> emit -> the drafter's edit and the next k."""
        stats = req.stats
        remaining = req.remaining()
        kk = min(req.k, remaining - 1) if req.spec else 0
        t_round = time.perf_counter()
        # the front end's handling of the previous round's event (span, metrics, streaming) delays this round
        gap = t_round - req.t_end if req.t_end else 0.0
        # 1. draft up to kk tokens (after the drafter's pending edit), in target ids -- unless the block
        # was drafted during the previous verification (pipelined: its wait was on that round's path)
        drafted, req.ready = req.ready, None
        was_ahead = drafted is not None and req.spec
        # fixed blocks are verified with the blocks being drafted beside them (crossdraft.decoding.gang)
        ganged = kk > 0 and not was_ahead and not req.draft.adaptive
        if was_ahead:
            kk, draft_on_path = len(drafted.target_ids), 0.0
        else:
            with self.gang.drafting(req.sid) if ganged else nullcontext():
                drafted = self._draft_step(req, kk, remaining, round_index)
            draft_on_path = drafted.seconds
        draft_wall = time.perf_counter() - t_round if drafted.wall < 0 else drafted.wall
        # (pipelined) the next block, drafted while this one is verified
        req.ahead = self._draft_ahead(req, drafted, remaining, round_index) if self.pipeline else None
        # 2. verify them in one target forward: the accepted drafts and the target's own next token
        req.gang_s, req.gang_n = self.gang.ready(req.sid, min(2.0, max(0.05, 2 * draft_wall))) if ganged else (0.0, 1)
        # (pipelined) a round that drafts nothing before a probe: the drafter catches up meanwhile
        catch = self._catch_up(req, kk)
        t_verify = time.perf_counter()
        try:
            res = self._verify(req, drafted, round_index)
        finally:  # (the verification's wall time ends here: a catch-up's wait is the drafter's, on_path below)
            verify_wall = time.perf_counter() - t_verify
            if catch is not None:
                self._caught_up(req, catch)
        kd, n = len(drafted.target_ids), res.num_accepted
        ahead, req.ahead = req.ahead, None
        following = self._take_ahead(req, ahead, kd, n, remaining) if ahead is not None else None
        # 3. what the round showed: the times, and for the policy the acceptance, the load and the costs
        v_queue = getattr(res, "queue_wait_s", 0.0)
        if req.first:
            stats.prefill_s += res.forward_s - v_queue
        else:
            stats.verify_s += res.forward_s - v_queue
        stats.verify_queue_s += v_queue
        # what the chooser expected of this round (before it learns from it): the gateway's goodput metrics
        # compare it with what the round yielded and took
        predicted = (req.policy.predict(kd, 0 if was_ahead else len(drafted.tokens))
                     if req.spec and req.step_s > 0 and req.policy.costs.measured else None)
        skip_reason = req.policy.reason if req.spec and kd == 0 and req.k == 0 else ""
        if req.spec:
            self._learn(req, drafted, res, draft_wall, verify_wall, ahead, following)
        req.prev_drafted = len(drafted.tokens) > 0
        req.first = False
        stats.record_round(kd, n)
        if req.spec and kd == 0 and remaining > 1:
            stats.skipped_rounds += 1
        # 4. emit the accepted drafts and the target's token (cut at an EOS, a stop string or the budget);
        # pipelined, a block accepted whole with the next block ready emits no token of its own: the
        # ready block starts at that position and the next round's verification decides it
        own = [] if following is not None else [res.next_token]
        out, text, done = req.out.emit(list(drafted.target_ids[:n]) + own, self.eos,
                                       self.pair.target_text_bytes, req.max_new_tokens)
        req.t_ids.extend(out)
        if req.out.stopped:
            stats.finish_reason = "stop"
        lps = req.out.keep_logprobs(getattr(res, "logprobs", None), len(out))
        # 5. the drafter's ids for the next round (or the session's next turn) and the next block size
        if done and req.d is not None:
            req.d.restart_from(self.pair, bytes(req.out.gen_bytes))
        if not done and req.spec and following is not None:
            self._follow(req, drafted, following)
        elif not done and req.spec:
            self._next_block(req, drafted, n, res.next_token)
        br = req.branch  # (the block beside the one ahead, on the likeliest correction: the next block if it came true)
        taken = br is not None and self._take_branch(req, n, res.next_token, done)
        # Overhead: the round's wall time (from the end of the previous round, so that the front end's
        # handling of its event counts) minus the model time on its critical path -- the verification and
        # the drafting done in this round (forwards and their waits in the servers' queues), the part of
        # the block drafted ahead that the round waited for, and the wait for a catch-up
        on_path = draft_on_path + (ahead.on_path_s() if ahead else 0.0) + (catch.waited_s if catch else 0.0)
        on_path += req.gang_s + (br.ahead.on_path_s() if taken else 0.0)
        t_end = time.perf_counter()
        overhead = t_end - t_round + gap - res.forward_s - on_path
        stats.overhead_s += overhead
        req.t_end = t_end
        d_queue = 0.0 if was_ahead else drafted.queue_s
        if self.log:
            parts = {"gap": gap, "draft_rpc": draft_wall - draft_on_path - drafted.map_s if not was_ahead else 0.0,
                     "map": drafted.map_s if not was_ahead else 0.0, "verify_rpc": verify_wall - res.forward_s}
            parts["loop"] = overhead - sum(parts.values())  # policy, emission, the drafter's edit, bookkeeping
            self.log.write(round_record(req, round_index, kk, kd, n, res, draft_wall, verify_wall, skip_reason,
                                        predicted, req.step_s, overhead, d_queue, parts, self._running, drafted.rows))
        return RoundEvent(round_index, kk, kd, n, out, text, drafted.seconds, res.forward_s, overhead, done, req.t_ids,
                          req.d.ids if req.d else None, batch_size=getattr(res, "batch_size", 1),
                          queue_wait_s=v_queue, draft_queue_s=d_queue, logprobs=lps, drafted_ahead=was_ahead,
                          ahead="" if ahead is None else "used" if following else "branch" if taken else "dropped",
                          skip_reason=skip_reason, speculative=req.spec, wall_s=t_end - t_round + gap,
                          predicted_tokens=predicted[0] if predicted else 0.0,
                          predicted_s=predicted[1] * req.step_s if predicted else 0.0,
                          drafter=self.name if req.spec else "", draft_batch_rows=drafted.rows)

    def _draft_step(self, req: Request, kk: int, remaining: int, round_index: int) -> Drafted:
        """Draft up to kk tokens and express them in target ids (nothing when kk == 0)."""
        if kk <= 0:
            return Drafted([], [], None, 0.0)
        t0 = time.perf_counter()
        toks: list = []
        req.stats.elided += req.d.elide(req.policy.costs.feed_window)  # (the latest of what it missed)
        if not req.d.synced:
            self._sync_drafter(req)
            if not req.spec:  # the drafter failed: the request goes on target-only
                return Drafted([], [], None, 0.0)
        # token healing (text mode): the drafter may re-choose its last id, one the gateway's
        # re-encoding of the target's text chose (crossdraft.vocab.healing); only a generated one
        d = req.d
        heal = req.text_mode and req.draft.heal and len(d.ids) > d.prompt_len
        healed = b""
        try:
            sc = req.policy.cumulative_stop() if req.policy.confident or req.draft.stop_cumulative else 0.0
            toks = self._draft(req, kk, round_index, sc, heal)
        except (Unavailable, ResourceExhausted, InvalidArgument) as e:  # the request goes on target-only
            req.drafter_failed(e)
        if heal and toks and toks[0].heals:  # the drafter dropped its last id: so does our view of it
            healed = d.drop_healed(self.pair)
            req.stats.healed += 1
        seconds = sum(t.forward_s for t in toks) if toks else time.perf_counter() - t0
        queued = sum(t.queue_s for t in toks)
        with_q = not req.params.greedy and not req.params.coupled  # coupled draws test no distribution
        t_map = time.perf_counter()
        drafts_t, q_rows = block_in_target_ids(self.pair, toks, healed, remaining - 1, req.text_mode, with_q)
        req.stats.draft_s += seconds - queued
        req.stats.draft_queue_s += queued
        return Drafted(toks, drafts_t, q_rows, seconds, healed, queue_s=queued, map_s=time.perf_counter() - t_map)

    def _learn(self, req: Request, drafted: Drafted, res, draft_wall: float, verify_wall: float, ahead=None,
               following=None) -> None:
        """Tell the request's policy what the round showed: its acceptance (the first block's too),
        what a drafted target token cost in drafter steps, the load and the servers' prices, and after
        the first round (whose times include the prefill) the wall-clock times."""
        pol = req.policy
        kd = len(drafted.target_ids)
        pol.observe(kd, res.num_accepted)
        if req.text_mode and drafted.tokens:
            pol.observe_steps(len(drafted.tokens), kd)
        if kd:  # with how many rows a drafted block was verified and drafted, against the load (CostModel.sharing)
            pol.costs.observe_sharing(getattr(res, "batch_size", 0) or 0, drafted.rows)
        # how many sessions share the verifier's forwards (its recent senders; else this batch's
        # rows), and at least the requests in this loop now: each sends the verifier rows
        # whenever it is not waiting on the drafter, but a session that waits long on a busy
        # drafter drops out of the verifier's count of recent senders, and pricing with that
        # smaller count would have more sessions draft than pays
        pol.observe_batch(max(getattr(res, "active_sessions", 0) or getattr(res, "batch_size", 1) or 1, self._running))
        # the servers' prices of a row and of a token now (batched verifiers publish theirs in every reply,
        # batched drafters on each Draft stream's last message)
        dprice = getattr(self.drafter, "price", None)
        pol.see_price(getattr(res, "price", None), dprice() if dprice is not None else None)
        self._price, self._dprice = pol.costs.price, pol.costs.dprice
        # the average follows the reports; the requests in the loop now are a floor it must not lag
        # below (a burst's first requests start at a small load, and an average climbing 30% a round
        # would price their first rounds far below the load they share)
        pol.load_at_least(self._running)
        self._load = pol.costs.batch
        if req.first:  # (the load is priced from the first round on: a burst's requests enter meanwhile)
            return
        # wall-clock corrections (measured costs only). A block after skipped rounds first feeds the
        # drafter what it missed, all in its first step's forward: its other steps still time the
        # drafter (so a probe corrects a wrong cost table too)
        toks = drafted.tokens
        steps, dsec = len(toks) if drafted.wall < 0 else 0, draft_wall  # (a block drafted ahead: beside a verification)
        if not req.prev_drafted:  # (the drafter's own times of its later steps)
            steps, dsec = max(0, len(toks) - 1), sum(t.forward_s for t in toks[1:])
        # the verification's own time: its wait in the verifier's queue (for other sessions' forwards)
        # is not a cost of this block's size, and read as one it would make the target look slow and
        # drafting cheap under load
        vsec = max(1e-6, verify_wall - getattr(res, "queue_wait_s", 0.0))
        drop = ahead.on_path_s() if ahead is not None and following is None else None
        pol.observe_time(steps, dsec, kd + 1, vsec, req.step_s, ahead is not None, drop)
        if pol.costs.measured:
            self._scales.put(req.mode, pol.costs.batch, pol.scales())

    def _next_block(self, req: Request, drafted: Drafted, n: int, next_token: int) -> None:
        """Record the drafter's edit (what the round accepted, in drafter ids) and choose the next k."""
        d, proposals = req.d, [t.id for t in drafted.tokens]
        if req.text_mode:
            d.commit_text(self.pair, proposals, drafted.target_ids[:n], next_token, drafted.healed)
        elif d.commit_tli(self.pair, proposals[:n], next_token, bytes(req.out.gen_bytes), req.draft.resync_window):
            req.stats.resyncs += 1
        self._hold(req)
        self._peers(req)
        req.k = req.policy.next_k(req.remaining(), d.feed(req.policy.costs.feed_window))
        if req.policy.costs.measured and drafted.target_ids:
            self._probes[req.mode] = req.policy.probe_record()
