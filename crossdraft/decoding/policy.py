"""The draft-length policy: how many tokens the drafter proposes in the next round.

:class:`DraftConfig` holds a request's settings; :class:`DraftPolicy` is the one chooser of the
block size k of each round, from its two models: the acceptance it measures
(:mod:`crossdraft.decoding.acceptance`) and the costs of the two models' forwards
(:mod:`crossdraft.decoding.costmodel`); it also decides when a probe re-measures a drafter that
does not pay.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

from crossdraft.decoding.acceptance import AcceptanceModel, clamp_alpha, expected_tokens
from crossdraft.decoding.costmodel import CostModel
from crossdraft.errors import InvalidArgument, check_int

# The drafter's draft vocabulary by default (vocab.TokenPair's draft_vocab, the gateway's --draft-vocab):
# its this many most frequent tokens (vocab.frequency_order); 0 = every token
DEFAULT_DRAFT_VOCAB = 0


@dataclass(frozen=True)
class DraftConfig:
    """How many tokens the drafter proposes per round."""

    num_draft_tokens: int = 4  # initial k (the block size) per round
    adaptive: bool = True  # choose k per round from measured acceptance and costs (else fixed k)
    min_draft_tokens: int = 1  # lower bound for adaptive k
    max_draft_tokens: int = 10  # upper bound for adaptive k
    stop_below: float = 0.3  # stop a block early once the drafter's own probability of its token is below this
    # stop a block early once the product of its proposals' probabilities (the drafter's estimate
    # that the whole block is accepted) is below this. None: chosen from the costs for greedy
    # adaptive decoding (a block then runs up to max_draft_tokens and the drafter's doubt ends it),
    # off otherwise; 0 = off
    stop_cumulative: float | None = None
    # adaptive: draft nothing (target-only rounds) while drafting does not pay, probing now and then
    allow_skip: bool = True
    resync_window: int = 4  # drafter tokens re-tokenised (look-behind) when the target leaves the intersection
    # text mode: the drafter may re-choose the last id of its re-encoding of the target's text for
    # the same bytes (token healing, crossdraft.vocab.healing); it never changes the output
    heal: bool = True
    mode: str = "auto"  # "tli" | "text" (greedy only: drafts text, re-encoded into target tokens) | "auto"
    # where the adaptive policy takes costs from: "measured" (the model servers' timed forwards,
    # corrected online by the round's wall-clock times), "static" (weight bytes; a function of the
    # generated tokens only, so a seeded sampling run is reproducible anywhere), or "auto":
    # measured for greedy (the output does not depend on k), static for sampling
    cost_model: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "tli", "text"):
            raise InvalidArgument("mode", f"must be one of auto, tli, text; got {self.mode!r}")
        if self.cost_model not in ("auto", "measured", "static"):
            raise InvalidArgument("cost_model", f"must be one of auto, measured, static; got {self.cost_model!r}")
        check_int("num_draft_tokens", self.num_draft_tokens, 1, 64)
        if not 1 <= self.min_draft_tokens <= self.max_draft_tokens <= 64:
            raise InvalidArgument("max_draft_tokens", "need 1 <= min_draft_tokens <= max_draft_tokens <= 64")
        if not 0.0 <= self.stop_below < 1.0:
            raise InvalidArgument("stop_below", f"must be in [0, 1), got {self.stop_below}")
        if self.stop_cumulative is not None and not 0.0 <= self.stop_cumulative < 1.0:
            raise InvalidArgument("stop_cumulative", f"must be in [0, 1), got {self.stop_cumulative}")
        if self.resync_window < 1:
            raise InvalidArgument("resync_window", "must be >= 1")

    def measures(self, params) -> bool:
        """Whether a request with these sampling parameters prices drafting with measured costs (where the
        model servers timed their forwards): greedy decoding and coupled draws, whose text does not depend
        on the blocks drafted, under "auto"."""
        return self.cost_model == "measured" or (self.cost_model == "auto" and (params.greedy or params.coupled))


# why a round drafts nothing (DraftPolicy.reason):
# - "acceptance": at this acceptance drafting would not pay even for a session alone with its drafter at
#   its usual speed (the probes' pace rules the rounds);
# - "load": it would pay alone, not with the sessions sharing the verifier's forwards now;
# - "drafter busy": it would pay alone if the drafter stepped at its usual speed -- its steps take longer
#   now (queued behind other sessions' steps, or its machine busy);
# - "short": it pays, but too few tokens are left to win back what the drafter must catch up on first;
# - "starting": a request's first round while a burst of requests is still starting (the gateway's
#   round loop; the first round prices drafting at the load the burst settles at).
SKIP_REASONS = ("acceptance", "load", "drafter busy", "short", "starting")


class DraftPolicy:
    """Chooses the block size k of the next round (adaptive draft length) for one request.

    Model: drafts are accepted independently with probability alpha (:class:`AcceptanceModel`,
    estimated online), so a block of k yields E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens; the
    :class:`CostModel` prices the block in target decoding steps, and k maximises the rate E(k) /
    cost(k) within [min, max] (:meth:`_best`, the one search over block sizes). If even the best k
    yields less than one token per target step (plus a margin when costs are measured), the round
    drafts nothing, and a short probe block re-measures alpha now and then -- every `probe_every`
    rounds, doubling after each probe that does not pay (up to `max_probe_every`) -- so a drafter
    that cannot help costs only its rare probes. With measured costs a probe (and a request's first
    block) is sent only where what it could win, weighed by how often recent probes found text that
    pays (the probes' record, which the round loop carries from one request to the next), beats what
    it costs when it fails (:meth:`worth_probing`, :meth:`probe_pace`).

    Confident mode (``confident``, greedy by default): the drafter ends each block itself once the
    product of its proposals' probabilities falls below :meth:`cumulative_stop`, a threshold that
    grows with the drafter's cost (a costly drafter must be surer to be worth another step). Blocks
    then run up to the upper bound and are as long as the drafter is sure, which follows easy and
    hard stretches of the text within a round instead of over rounds; the acceptance model only
    decides whether to draft at all. On recorded acceptance traces (tests/data/traces,
    benchmarks/policy_replay.py) this beats the per-round k of the acceptance model.

    The round loop tells the policy what each round showed (:meth:`observe`, :meth:`observe_steps`,
    :meth:`observe_batch`, :meth:`observe_time`, :meth:`see_peers`) and asks :meth:`next_k`; the
    policy's parts (``acceptance``, ``costs``) change only through these calls.
    """

    probe_every = 6
    max_probe_every = 48
    # measured costs: a probe (and a request's first block) is sent only where what it could win,
    # weighed by how often recent probes found text that pays, beats what it costs when it fails
    # (see probe_odds and worth_probing). hit_prior: (hits, probes) before any probe is seen
    hit_prior = (1.0, 3.0)  # 1 in 3
    hit_decay = 0.8
    probe_decay = 0.6
    # a session the load rules out (loaded_out) drafts nothing without pricing every round: the whole
    # pricing (some 30 block rates, and why_not's) runs again after this many rounds, or at once when the
    # load falls by half a session or the load gate lets go (what could make drafting pay again). Under
    # load a full pricing costs the gateway more CPU than the rest of such a round, on the path of every
    # session's next row and on the cores the verifier computes on where they share a machine
    recheck_every = 8

    def __init__(self, cfg: DraftConfig, cost_ratio: float = 0.2, verify_slope: float = 0.03, *,
                 verify_costs: list[float] | None = None, measured: bool = False,
                 drafter_costs: list[float] | None = None, confident: bool = False):
        self.cfg = cfg
        self.acceptance = AcceptanceModel()
        self.costs = CostModel(cost_ratio, verify_slope, verify_costs=verify_costs, measured=measured,
                               drafter_costs=drafter_costs)
        self.hi = max(cfg.max_draft_tokens, cfg.num_draft_tokens)
        self.confident = confident  # blocks end on the drafter's doubt (cumulative_stop); k is the upper bound
        self.skipped = 0
        self.unfed = 0  # rounds since the drafter was last fed (a probe's first forward catches them up)
        self.interval = self.wait = self.probe_every
        self.probing = False
        # tokens a probe block drafts where it fails (exponentially weighted over the probes and first
        # blocks not accepted in full): a confident block runs until the drafter doubts, so what a
        # failed probe costs depends on how sure the drafter is of text it gets wrong -- typically 1-4
        # tokens. Prior: 3 tokens
        self.probe_sum, self.probe_n = 3.0, 1.0
        self.first = True  # the next observed block is the request's first (a probe of the text too)
        # probes (and first blocks) after which drafting paid, of all (exponentially weighted; the
        # decoder carries it over its requests in measured mode: a pair's drafter finds text it gets
        # right more or less often)
        self.hit_s, self.hit_n = self.hit_prior
        self.judge = False  # the block just observed was a probe: next_k scores its outcome
        # why the latest choice drafts nothing ("" where it drafts; SKIP_REASONS): the round log, the
        # verify_round span and the gateway's counters carry it
        self.reason = ""
        self.whole = False  # (and it was accepted in full)
        # the load gate holds drafting (crossdraft.decoding.gate: at this load, the requests sharing the
        # verifier measured more goodput target-only): rounds skip without probes until it lets go
        self.held = False
        # while the load rules drafting out: (the load it was priced at, whether the gate held, rounds left
        # before the next full pricing); None otherwise
        self._out: tuple[float, bool, int] | None = None

    # ---- what the round loop tells the policy ------------------------------------------------------
    def observe(self, k: int, n: int) -> None:
        """A block of k drafts was verified and n of them were accepted."""
        # a block accepted in full says the text is draftable -- unless it was one token the drafter
        # already doubted (a confident block that ended after its first proposal): on text the drafter
        # cannot follow such lone guesses come true now and then, and taking each for a hit would keep
        # the probes at their fastest pace there, slower than target-only
        whole = n == k and k >= min(2, self.hi)
        if k > 0 and (self.probing or self.first):
            self.judge, self.whole = True, whole
            if n < k:  # (a probe accepted in full lost nothing)
                d = self.probe_decay
                self.probe_sum = d * self.probe_sum + k
                self.probe_n = d * self.probe_n + 1
        self.first = False
        if k > 0:
            self.acceptance.observe(k, n)
            if whole and self.could_pay():  # a whole block accepted: the text may be draftable again,
                # so the probes keep their pace (next_k doubles it after a probe that does not pay; this
                # cancels that) -- unless no acceptance could pay. Drafting that pays resets it (next_k).
                self.interval = max(self.probe_every, self.interval // 2)

    def observe_steps(self, steps: int, tokens: int) -> None:
        """Text drafting: a block took `steps` drafter forwards and gave `tokens` target-token drafts."""
        self.costs.observe_steps(steps, tokens)

    def observe_batch(self, rows: int) -> None:
        """Measured mode: ``rows`` sessions share the verifier's forwards now."""
        self.costs.observe_batch(rows)

    def observe_time(self, steps: int, draft_s: float, m: int, verify_s: float, target_step_s: float,
                     overlapped: bool = False, drop_s: float | None = None) -> None:
        """Measured mode: a round's wall-clock times against the predicted ones (CostModel.observe_time)."""
        self.costs.observe_time(steps, draft_s, m, verify_s, target_step_s, overlapped, drop_s)

    def see_price(self, price, drafter=None) -> None:
        """Measured mode: the verifier's published price of a batched forward and the drafter's of a
        batched step (CostModel.see_price)."""
        self.costs.see_price(price, drafter)

    def load_at_least(self, sessions: float) -> None:
        """At least ``sessions`` share the forwards now (the requests in the round loop): the load's
        average follows the verifier's reports but never lags below them."""
        self.costs.batch = max(self.costs.batch, float(sessions))

    def see_peers(self, others: float | None, peer_alpha: float | None, colocated: bool) -> None:
        """Measured costs: how many of the other sessions draft now (None: unknown), their mean
        acceptance estimate (None: no others or unknown) and whether the drafter computes on the verifier's hardware."""
        c = self.costs
        c.others, c.peer_alpha, c.colocated = others, peer_alpha, colocated

    def drafter_missed(self, tokens: int) -> None:
        """The request starts without the drafter: its first forward will feed these ``tokens``."""
        self.unfed = tokens

    # ---- what one request carries from the earlier ones of its decoder -----------------------------
    def scales(self) -> tuple[float, float, float, float, float, float]:
        """The online corrections of the cost tables: (drafter, verifier) measured/predicted times, the
        pipelined rounds' (the verification beside the drafter, a dropped block's wait), and the shares of
        the load that drafted verifications and their drafter steps were measured to share forwards with."""
        c = self.costs
        return c.scale_d, c.scale_v, c.scale_o, c.drop_wait, c.sharing, c.dsharing

    def probe_record(self) -> tuple[float, float, float, float]:
        """The probes' record: (hits, probes, drafted by failed probes, failed probes), all weighted."""
        return self.hit_s, self.hit_n, self.probe_sum, self.probe_n

    def resume(self, scales: tuple[float, float] | None = None,
               record: tuple[float, float, float, float] | None = None) -> None:
        """Start from what the latest requests of the same pair learnt: the cost corrections, and the
        probes' record (relaxed toward the prior, :meth:`relax_record`)."""
        if scales is not None:
            c = self.costs
            c.scale_d, c.scale_v, c.scale_o, c.drop_wait, c.sharing, c.dsharing = (*scales, 1.0, 0.0, 1.0, 1.0)[:6]
        if record is not None:
            self.hit_s, self.hit_n, self.probe_sum, self.probe_n = record
            self.relax_record()

    def log_fields(self) -> dict:
        """The policy's view for a round log line (rounded): besides the inputs, what the chooser concluded
        from them -- the best block size and its rate at the acceptance estimate (tokens per target step;
        drafting needs ``need``), the odds against a probe's finding text that pays, and what a failed
        probe would cost now (target steps, feeding the drafter what it has not seen)."""
        c = self.costs
        best_k, best_rate = self._best(self.acceptance.alpha())
        return dict(best_k=best_k, best_rate=round(best_rate, 3), need=round(c.need(), 3),
                    odds=round(self.probe_odds(), 2), probe_cost=round(self.probe_cost(max(1, self.unfed)), 3),
                    load=round(c.batch, 2), others_drafting=c.others,
                    peer_alpha=None if c.peer_alpha is None else round(c.peer_alpha, 3),
                    alpha=round(self.acceptance.alpha(), 3), scale_d=round(c.scale_d, 3),
                    scale_v=round(c.scale_v, 3), scale_o=round(c.scale_o, 3), sharing=round(c.sharing, 3),
                    dsharing=round(c.dsharing, 3),
                    steps_per_token=round(c.steps_per_token(), 3), probing=self.probing, interval=self.interval)

    # ---- the rate and the one search over block sizes ----------------------------------------------
    def rate(self, k: int) -> float:
        """Expected tokens per target decoding step with a block of k at the current acceptance."""
        return self.costs.rate(k, self.acceptance.alpha())

    def _best(self, alpha: float) -> tuple[int, float]:
        """The block size within [min, hi] of the highest rate at acceptance ``alpha`` (the smallest
        of equals), and that rate."""
        best_k, best_r = 0, -math.inf
        for k in range(self.cfg.min_draft_tokens, self.hi + 1):
            r = self.costs.rate(k, alpha)
            if r > best_r:
                best_k, best_r = k, r
        return best_k, best_r

    def ahead_pays(self, k: int) -> bool:
        """Whether a block of k runs pipelined: where it beats a serial round at the acceptance estimate
        (CostModel.ahead_pays); a fixed block (not adaptive) whenever pipelining is on and no other session
        shares the forwards."""
        if not self.cfg.adaptive:
            return self.costs.pipelines()
        return self.costs.ahead_pays(k, self.acceptance.alpha())

    def value(self, alpha: float | None = None, usual_speed: bool = False) -> float:
        """What drafting is worth to this request: the best rate over block sizes at the acceptance
        estimate (or at ``alpha``; tokens per target decoding step), priced for the request alone, or 1.0
        (target-only) where no block size pays. A gateway compares its drafter kinds by it, and learns from
        it what a kind is worth to a class of prompts (gateway.pool): each kind's policy prices its own
        drafter's cost and acceptance against the same target step. Alone: the load is the moment's, not
        the text's -- what it allows is decided round by round (:meth:`next_k`), and a value learned under
        load would keep the class's next requests from drafting once the load is gone; so, with
        ``usual_speed``, is a drafter slowed by other work now (priced at most at its table's cost). A
        request that drafts a fixed block whatever it costs (not adaptive) is worth the rate of that block,
        below 1.0 where it loses."""
        a = self.acceptance.alpha() if alpha is None else clamp_alpha(alpha)
        with self._alone(usual_speed) as c:
            if not self.cfg.adaptive:
                return c.rate(self.cfg.num_draft_tokens, a)
            best = self._best(a)[1]
            return best if best >= c.need() else 1.0

    @contextmanager
    def _alone(self, usual_speed: bool = False):
        """The cost model priced for a session alone while inside (no load, no peers; with ``usual_speed``
        the drafter at most at its table's cost), restored after."""
        c = self.costs
        saved = c.batch, c.others, c.peer_alpha, c.scale_d
        try:
            c.batch, c.others, c.peer_alpha = 1.0, None, None
            c.scale_d = min(1.0, c.scale_d) if usual_speed else c.scale_d
            yield c
        finally:
            c.batch, c.others, c.peer_alpha, c.scale_d = saved

    def _pays_at(self, alpha: float) -> bool:
        cfg = self.cfg
        if not cfg.adaptive or not cfg.allow_skip:
            return True
        return self._best(alpha)[1] >= self.costs.need()

    def pays(self) -> bool:
        """Whether some block size is expected to beat target-only now (no state changes)."""
        return self._pays_at(self.acceptance.alpha())

    def could_pay(self, alpha: float = 0.9) -> bool:
        """Whether drafting would pay at a high acceptance (90%; no state changes). A drafter nearly
        as costly as its target cannot: its probes then stay at their slowest pace even when a
        whole probe block is accepted."""
        return self._pays_at(clamp_alpha(alpha))

    def saving(self, alpha: float = 0.9) -> float:
        """The share of a target step per generated token that drafting would save at a high
        acceptance (0 where it would not pay): the most a probe that finds such text can win."""
        best = self._best(clamp_alpha(alpha))[1]
        return max(0.0, 1.0 - 1.0 / best)

    def cumulative_stop(self) -> float:
        """The threshold of the block's cumulative drafter probability below which the drafter stops
        (the request's ``stop_cumulative``, else priced by CostModel.stop_threshold)."""
        if self.cfg.stop_cumulative is not None:
            return self.cfg.stop_cumulative
        return self.costs.stop_threshold(self.hi)

    def loaded_out(self) -> bool:
        """Measured costs, more than one session sharing the forwards, and no acceptance could pay; or the
        load gate holds drafting."""
        return self.held or (self.costs.measured and self.costs.batch > 1.5 and not self.could_pay())

    # ---- probes -------------------------------------------------------------------------------------
    def probe_len(self) -> float:
        """Tokens a failed probe block is expected to have drafted: in confident mode the mean over
        the recent probes (and first blocks) not accepted in full, within [1, hi]; otherwise the
        probe's fixed block."""
        if self.confident:
            return min(float(self.hi), max(1.0, self.probe_sum / self.probe_n))
        return float(min(self.hi, max(self.cfg.min_draft_tokens, 2)))

    def probe_cost(self, feed: int = 1) -> float:
        """What a probe costs, in target decoding steps, if none of it is accepted: the drafter
        forward that feeds the `feed` tokens it has not seen (a request's prompt for its first block,
        the skipped rounds' tokens for a probe) and proposes the first token, the steps for the rest
        of the block (:meth:`probe_len` tokens; more steps per token in text mode), and the
        verification that much longer. (On a CPU in fp32, where verifying 3-5 tokens costs 2-3
        decoding steps, a probe priced as one drafted token would be about 3x too cheap.)"""
        return self.costs.probe_cost(self.probe_len(), feed)

    def relax_record(self, r: float = 0.9) -> None:
        """A new request: the probes' record carried from earlier requests moves 10% back toward the
        prior. Only probes change it, and a record of misses stops them where the completions are
        short: without this a pair that once stopped probing would never try again; with it, a
        record of misses (odds 20-30 to 1) is back under 5 to 1 after 7-9 requests, which then
        draft a first block or probe (a request's first block costs a short one ~3% then)."""
        ps, pn = self.hit_prior
        self.hit_s = r * self.hit_s + (1 - r) * ps
        self.hit_n = r * self.hit_n + (1 - r) * pn

    def probe_odds(self) -> float:
        """How many failed probes one that finds text worth drafting must pay for: (1 - h) / h, h the
        recent probes' hit rate (exponentially weighted, prior ``hit_prior``; within [0.03, 0.9])."""
        h = min(0.9, max(0.03, self.hit_s / self.hit_n))
        return (1.0 - h) / h

    def worth_probing(self, remaining: int | None, feed: int = 1) -> bool:
        """Measured costs: whether `remaining` tokens leave room for a probe to pay: drafting them all
        at 90% acceptance would save more than the probe costs when it fails, times the odds against
        its finding such text (:meth:`probe_odds`, from how often recent probes did). A pair near
        its break-even (smollm2-135m for gemma3-270m: 7% at best) then drafts little in a 64-token
        completion; the default pair (~50%) probes until the last few tokens. None (unknown) and
        static costs: always; and a drafter that could not pay even at 90% acceptance keeps its rare
        probes (every ``max_probe_every`` rounds): they are what corrects a cost table measured
        wrong (one timed on a busy machine)."""
        if remaining is None or not self.costs.measured or not self.could_pay():
            return True
        return remaining * self.saving() >= self.probe_odds() * self.probe_cost(feed)

    def probe_pace(self) -> int:
        """The probes' shortest interval in rounds (measured costs): long enough that the rounds
        between two probes could save a failed probe's cost times the odds against a hit
        (``probe_every`` for a pair that pays well, up to ``max_probe_every`` near the break-even)."""
        if not self.costs.measured:
            return self.probe_every
        s = self.saving()
        if s <= 0:
            return self.max_probe_every
        need = math.ceil(self.probe_odds() * self.probe_cost() / s)
        return min(self.max_probe_every, max(self.probe_every, need))

    def probe_next(self) -> bool:
        """Whether the next :meth:`next_k` is due to send a probe (rounds are being skipped and the wait
        ends with the next one; under a load that rules drafting out there is none): the round loop can
        feed the drafter what it missed during this round (crossdraft.decoding.pipeline.CatchUp). No
        state changes."""
        cfg = self.cfg
        return (cfg.adaptive and cfg.allow_skip and self.skipped > 0 and not self.probing and self.wait <= 1
                and not self.loaded_out())

    def _feed(self, feed: int | None) -> int:
        """What a probe's first forward feeds the drafter: the decoder's exact count, else the
        rounds (target tokens) it missed."""
        return self.unfed if feed is None else max(1, int(feed))

    def why_not(self) -> str:
        """Why drafting does not pay now (SKIP_REASONS): priced again for a session alone (no load),
        then also with the drafter at its table's speed; no state changes."""
        a = self.acceptance.alpha()
        if self.held and self._pays_at(a):
            return "load"  # the model would draft at this load; the load gate measured that it does not pay
        with self._alone():
            if self._pays_at(a):
                return "load"
        with self._alone(usual_speed=True):
            return "drafter busy" if self._pays_at(a) else "acceptance"

    def predict(self, drafted: int, steps: int) -> tuple[float, float]:
        """Measured costs: what the chooser expects of a round that verifies ``drafted`` tokens drafted in
        ``steps`` drafter steps, at the acceptance, costs and load it knows now: (tokens, cost in
        target decoding steps). The gateway compares them with what the rounds yield and take (its
        goodput metrics)."""
        c = self.costs
        b, n = c.load()
        if drafted <= 0:
            return 1.0, c.scale_v * c.fwd(b, 1)
        e = expected_tokens(self.acceptance.alpha(), drafted)
        v = c.scale_v * c.vround(b, n, drafted + 1)
        dr = steps * c.c * c.scale_d * c.dstep(n)
        return e, v + dr

    # ---- the choices --------------------------------------------------------------------------------
    def first_block_pays(self, remaining: int, feed: int) -> bool:
        """Measured costs, adaptive blocks that may skip: whether a new request drafts its first block
        (which also measures this text's acceptance), priced at the load the round loop expects
        (:meth:`expect_load`). Where it does not, the probes' pace starts where the reason says."""
        if not self.could_pay():
            # not even a 90% acceptance would pay (at this load, or a drafter nearly as costly as its
            # target): alone, probe at the slowest pace (the costs may be wrong, a probe corrects
            # them), under load not at all until the load falls (next_k, loaded_out)
            self.interval = self.wait = self.max_probe_every
            self.reason = self.why_not()
            return False
        if self.held or (self.costs.batch > 1.5 and not self.pays()):
            self.reason = self.why_not()
            return False  # drafting does not pay at this load (the policy probes later)
        if not self.worth_probing(remaining, feed):
            # a pair near its break-even, or a short completion: even text the drafter gets right would
            # not win back the first block's cost, the drafter's prefill of the prompt included (a
            # session's later requests find most of it cached); the policy probes later if the request
            # is long enough
            self.interval = self.wait = self.probe_pace()
            self.reason = "short"
            return False
        return True

    def expect_load(self, sessions: float) -> None:
        """A new request prices its start at this load (what the latest rounds saw, at least the
        requests in the round loop now) until its own rounds report one."""
        self.costs.batch = sessions

    def next_k(self, remaining: int | None = None, feed: int | None = None) -> int:
        """The next round's block size; `remaining` = tokens the request may still generate (a
        probe needs room to pay back, see worth_probing; None = unknown). `feed`: the drafter tokens
        the drafter would be fed before it drafts again (its ids it does not hold: the decoder
        knows them exactly; in text mode a skipped round can be 2-3 drafter tokens); None = count
        the rounds it missed (`unfed`, what replays of traces do)."""
        cfg = self.cfg
        if not cfg.adaptive:
            return cfg.num_draft_tokens
        if self._still_out():  # (reason: as priced)
            self.skipped += 1
            self.unfed += 1
            return 0
        best, best_rate = self._best(self.acceptance.alpha())
        need = self.costs.need()
        if self.judge:  # the probe (or first block) just verified: did it find text the drafter gets
            self.judge = False  # right (accepted in full), or text where drafting pays?
            d = self.hit_decay
            self.hit_s = d * self.hit_s + (1.0 if self.whole or best_rate >= need else 0.0)
            self.hit_n = d * self.hit_n + 1.0
        if cfg.allow_skip and (best_rate < need or self.held):
            k = self._skip_or_probe(remaining, feed)
            self.reason = "" if k else self.why_not()
            return k
        self.reason = ""
        if self.unfed > 1 and not self.worth_probing(remaining, self._feed(feed)):
            # drafting would pay, but the drafter has rounds (or, where the request started without
            # it, the prompt) to catch up on first, and too few tokens are left to win that back
            self.skipped += 1
            self.unfed += 1
            self.reason = "short"
            return 0
        self.skipped = self.unfed = 0
        self.probing = False
        self.interval = self.wait = self.probe_every  # drafting pays: when it stops, probe at the usual pace
        return self.block_of(best)

    def best_k(self) -> int:
        """The best-rated block size at the acceptance estimate (no state changes)."""
        return self._best(self.acceptance.alpha())[0]

    def block_of(self, best: int) -> int:
        """The block to draft where drafting pays and ``best`` is the best-rated size. Confident blocks run
        up to ``hi`` (the drafter's doubt ends them) for a session alone, whose verification costs about
        the same for any block on most hardware; where sessions share the verifier's forwards (measured
        costs, a load over 1.5) a batched forward pads every row to its longest and prices every token,
        so a block that ran past the size it was priced at would cost every session in the forward: there
        it stops at ``best``, earlier where the drafter doubts."""
        if self.confident and not (self.costs.measured and self.costs.load()[0] > 1.5):
            return self.hi
        return best

    def keeps_out(self) -> bool:
        """Whether the next :meth:`next_k` keeps drafting nothing without a new pricing
        (``recheck_every``): the load ruled drafting out fewer rounds ago, has not fallen by half a
        session since, and the gate's hold is as it was (no state changes). The round loop then need
        not tell the policy what the other sessions do."""
        o = self._out
        return (o is not None and o[2] > 0 and o[1] == self.held and self.costs.batch >= o[0] - 0.5
                and not self.judge)

    def _still_out(self) -> bool:
        """:meth:`keeps_out`, counting the round."""
        if not self.keeps_out():
            self._out = None
            return False
        load, held, left = self._out
        self._out = (load, held, left - 1)
        return True

    def _skip_or_probe(self, remaining: int | None, feed: int | None) -> int:
        """Drafting does not pay now: skip the round (0), or send a probe once the wait is over."""
        cfg = self.cfg
        if self.loaded_out():
            # many sessions share the forwards and even 90% acceptance would not pay at this load:
            # no probe (it would only measure what the load already rules out); the load is
            # re-read every round, and once it falls the usual probe pace starts over
            self.probing = False
            self.skipped += 1
            self.unfed += 1
            self.interval = self.wait = self.probe_every
            self._out = (self.costs.batch, self.held, self.recheck_every - 1)
            return 0
        if self.probing:  # the probe just verified did not pay: wait longer before the next one
            self.interval = max(self.probe_pace(), min(self.max_probe_every, self.interval * 2))
            if not self.could_pay():  # not even at 90% acceptance: the slowest pace at once
                self.interval = self.max_probe_every
            self.wait = self.interval
        elif self.skipped == 0:  # drafting (or the first block) just stopped paying
            self.interval = self.wait = max(self.interval, self.probe_pace())
        self.probing = False
        self.skipped += 1
        self.unfed += 1
        self.wait -= 1
        if self.wait <= 0 and not self.worth_probing(remaining, self._feed(feed)):
            self.wait = self.interval  # too few tokens left for a probe to pay back its cost
        if self.wait <= 0:
            self.probing = True
            self.unfed = 0
            self.acceptance.restart()
            return self.hi if self.confident else min(self.hi, max(cfg.min_draft_tokens, 2))
        return 0
