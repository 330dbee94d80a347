"""The draft-length policy: how many tokens the drafter proposes in the next round.

:class:`DraftConfig` holds a request's settings; :class:`DraftPolicy` picks the block size k of
each round from the acceptance it measures and the costs of the two models' forwards
(:func:`cost_ratio` turns the model servers' weight bytes into a drafter-step cost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


class DraftPolicy:
    """Chooses the block size k of the next round (adaptive draft length).

    Model: drafts are accepted independently with probability alpha, so a block of k yields
    E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens and costs k drafter steps plus one target
    forward over k + 1 tokens: cost(k) = k * c + v(k + 1), in units of one target decoding step
    (v(1) = 1). alpha is estimated online (exponential forgetting) from acceptance counts; k
    maximises E(k) / cost(k) within [min, max]. If even the best k yields less than one token per
    target step (plus a margin when costs are measured), the round drafts nothing, and a short
    probe block re-measures alpha now and then -- every `probe_every` rounds, doubling after each
    probe that does not pay (up to `max_probe_every`) -- so a drafter that cannot help costs only
    its rare probes.

    Many sessions at once (measured costs only): the model servers batch the rounds of concurrent
    sessions into one forward, so a session's share of the verification is v(B * m) / B and of a
    drafter step d(B) / B, where B is the number of sessions the verifier reports as sending it
    blocks lately (an exponential average; not the rows of the last batch: while sessions draft,
    fewer of them are verifying at any moment, and pricing with that smaller number would keep
    everyone drafting where everyone skipping is faster). Where forwards cost in proportion to their tokens (a CPU in
    fp32) drafting stops paying as B grows -- the verifier would rather score B sessions' single
    tokens than B blocks of which a third is rejected -- while on a GPU, flat in m up to hundreds
    of tokens, it keeps paying. rate(k) then compares E(k) tokens per v(B(k+1)) + k c d(B) with
    one token per v(B); at B = 1 this is the single-session rule. The drafter's table
    (``drafter_costs``, d(n) for n = 1..M) gives d(B); without it d(B) = B.

    Confident mode (``confident``, greedy by default): the drafter ends each block itself once the
    product of its proposals' probabilities falls below :meth:`cumulative_stop`, a threshold that
    grows with the drafter's cost (a costly drafter must be surer to be worth another step). Blocks
    then run up to the upper bound and are as long as the drafter is sure, which follows easy and
    hard stretches of the text within a round instead of over rounds; the acceptance model only
    decides whether to draft at all. (Replayed on recorded acceptance traces of a 0.5B drafter for
    a 1.5B target -- drafter step 0.45 of a target step, 16 code/prose/SQL/Chinese prompts -- this
    gave 1.53x target-only against 1.39x for the per-round k of the acceptance model.)

    Costs: ``c`` and ``verify_costs`` (v(m) for m = 1..M, relative to v(1)) come either from the
    model servers' measured forward times (``measured=True``: on CPUs the verification forward
    of a block can cost 2-3x a decoding step, which a weight-bytes estimate cannot see), or from
    weight bytes with a small per-token slope. With measured costs the policy also corrects them
    online from the rounds' wall-clock times (:meth:`observe_time`: load, RPC overheads).
    With static costs every input is a function of the generated tokens only, so a seeded
    sampling run picks the same k sequence, hence the same random draws and the same text, every
    time (and after a failover); that is why sampling uses static costs by default.
    """

    decay = 0.85
    probe_every = 6
    max_probe_every = 48
    # measured costs: a probe (and a request's first block) is sent only where what it could win,
    # weighed by how often recent probes found text that pays, beats what it costs when it fails
    # (see probe_odds and worth_probing). hit_prior: (hits, probes) before any probe is seen
    hit_prior = (1.0, 3.0)  # 1 in 3
    hit_decay = 0.8
    margin = 1.05  # measured costs: draft only when it is expected to beat target-only by this factor
    time_decay = 0.8
    probe_decay = 0.6
    batch_decay = 0.7
    # bounds of one round's measured/predicted time ratio: wide enough to correct a cost table timed
    # while another process computed on the same cores (seen: a drafter step timed 22x too slow)
    max_scale = 50.0

    def __init__(self, cfg: DraftConfig, cost_ratio: float = 0.2, verify_slope: float = 0.03, *,
                 verify_costs: list[float] | None = None, measured: bool = False,
                 drafter_costs: list[float] | None = None):
        self.cfg = cfg
        self.c = max(1e-3, float(cost_ratio))
        self.slope = max(0.0, float(verify_slope))
        self.v = [max(1e-6, float(x)) for x in verify_costs] if verify_costs else None
        if self.v:
            self.v = [x / self.v[0] for x in self.v]
        self.d = [max(1e-6, float(x)) for x in drafter_costs] if drafter_costs else None
        if self.d:
            self.d = [x / self.d[0] for x in self.d]
        self.measured = measured
        self.batch = 1.0  # rows of the verifier's batches this session's rounds ran in (measured mode)
        # many sessions (measured mode; the Decoder sets these each round): how many of the OTHER
        # sessions sharing the forwards draft now (None: unknown -- price as if all drafted alike), their
        # mean acceptance estimate (None: as this session's), and whether the drafter computes on the
        # verifier's hardware (its steps then stall every session's forwards, not only this one's round)
        self.others: float | None = None
        self.peer_alpha: float | None = None
        self.colocated = True
        self.hi = max(cfg.max_draft_tokens, cfg.num_draft_tokens)
        self.succ, self.trials = 1.2, 2.0  # prior alpha = 0.6
        self.skipped = 0
        self.unfed = 0  # rounds since the drafter was last fed (a probe's first forward catches them up)
        self.interval = self.wait = self.probe_every
        self.probing = False
        self.scale_d = 1.0  # measured/predicted drafter time (online correction, measured mode only)
        self.scale_v = 1.0  # measured/predicted verification time
        self.confident = False  # blocks end on the drafter's doubt (cumulative_stop); k is the upper bound
        # drafter steps per target token drafted (text mode re-encodes the drafter's text: SmolLM2 spells a
        # Chinese character the Qwen target has as one token in 2-3 byte tokens); 1 in TLI mode
        self.step_sum, self.tok_sum = 1.0, 1.0
        # tokens a probe block drafts where it fails (exponentially weighted over the probes and first
        # blocks not accepted in full): a confident block runs until the drafter doubts, so what a
        # failed probe costs depends on how sure the drafter is of text it gets wrong -- seen 1-4
        # tokens. Prior: 3 tokens
        self.probe_sum, self.probe_n = 3.0, 1.0
        self.first = True  # the next observed block is the request's first (a probe of the text too)
        # probes (and first blocks) after which drafting paid, of all (exponentially weighted; the
        # decoder carries it over its requests in measured mode: a pair's drafter finds text it gets
        # right more or less often)
        self.hit_s, self.hit_n = self.hit_prior
        self.judge = False  # the block just observed was a probe: next_k scores its outcome
        self.whole = False  # (and it was accepted in full)

    def alpha(self) -> float:
        return min(0.98, max(0.02, self.succ / self.trials))

    def observe(self, k: int, n: int) -> None:
        # a block accepted in full says the text is draftable -- unless it was one token the drafter
        # already doubted (a confident block that ended after its first proposal): on text the drafter
        # cannot follow such lone guesses come true now and then (SmolLM2 on Chinese: 3 of 11), and
        # taking each for a hit kept the probes at their fastest pace there (0.87x of target-only)
        whole = n == k and k >= min(2, self.hi)
        if k > 0 and (self.probing or self.first):
            self.judge, self.whole = True, whole
            if n < k:  # (a probe accepted in full lost nothing)
                d = self.probe_decay
                self.probe_sum = d * self.probe_sum + k
                self.probe_n = d * self.probe_n + 1
        self.first = False
        if k > 0:
            d = self.decay
            self.succ = d * self.succ + n
            self.trials = d * self.trials + n + (1 if n < k else 0)
            if whole and self.could_pay():  # a whole block accepted: the text may be draftable again,
                # so the probes keep their pace (next_k doubles it after a probe that does not pay; this
                # cancels that) -- unless no acceptance could pay. Drafting that pays resets it (next_k).
                self.interval = max(self.probe_every, self.interval // 2)

    def observe_steps(self, steps: int, tokens: int) -> None:
        """Text drafting: a block took `steps` drafter forwards and gave `tokens` target-token drafts."""
        if steps > 0:
            d = self.decay
            self.step_sum = d * self.step_sum + steps
            self.tok_sum = d * self.tok_sum + tokens

    def steps_per_token(self) -> float:
        """Drafter steps one drafted target token costs (exponentially weighted; 1 until observed)."""
        return min(8.0, max(0.25, self.step_sum / max(1e-6, self.tok_sum)))

    def vcost(self, m: float) -> float:
        """Cost of a target forward over m tokens, in target decoding steps."""
        if not self.v:
            return 1.0 + self.slope * (m - 1)
        return interpolate_cost(self.v, m, self.slope)

    def dcost(self, n: float) -> float:
        """Cost of a drafter forward over n rows of one token, in drafter steps."""
        return interpolate_cost(self.d, n, 1.0) if self.d else max(1.0, n)

    def observe_batch(self, rows: int) -> None:
        """Measured mode: ``rows`` sessions share the verifier's forwards now."""
        if self.measured and rows >= 1:
            d = self.batch_decay
            self.batch = d * self.batch + (1 - d) * float(rows)

    def observe_time(self, steps: int, draft_s: float, m: int, verify_s: float, target_step_s: float) -> None:
        """Measured mode: a round's wall-clock times (drafter steps, the verification of m tokens),
        against the predicted ones (target_step_s = the measured time of one target decoding step)."""
        if not self.measured or target_step_s <= 0:
            return
        d = self.time_decay
        b = self.batch
        if verify_s > 0 and m >= 1:  # the batch's forward: B rows of m tokens
            ratio = verify_s / (self.vcost(b * m) * target_step_s)
            self.scale_v = d * self.scale_v + (1 - d) * min(self.max_scale, max(1 / self.max_scale, ratio))
        if steps > 0 and draft_s > 0:
            # a ratio of times: averaged in log space, each drafter step one observation (a probe's
            # block of 6 steps says more than one step does)
            ratio = draft_s / (steps * self.c * self.dcost(b) * target_step_s)
            w = d ** min(steps, 5)  # (at most as much as 5 steps: one slow moment must not decide alone)
            ratio = min(self.max_scale, max(1 / self.max_scale, ratio))
            self.scale_d = math.exp(w * math.log(self.scale_d) + (1 - w) * math.log(ratio))

    @staticmethod
    def _tokens(a: float, k: int) -> float:
        """E(k): tokens a block of k yields at acceptance a (the accepted drafts and the target's own)."""
        return (1 - a ** (k + 1)) / (1 - a)

    def _load(self) -> tuple[float, float]:
        """(b, n): the sessions sharing the forwards and how many would draft with this one (itself
        included): all b where the others' drafting is unknown (the rule before it was measured)."""
        b = self.batch if self.measured else 1.0
        if self.others is None or b <= 1.0:
            return b, b
        return b, min(b, 1.0 + max(0.0, self.others))

    def _vround(self, b: float, n: float, m: float) -> float:
        """The verification of a round in which n of b sessions send blocks of m tokens (the others
        one token), in target steps: padded to one forward of b x m, or the blocks in a forward of their
        own beside the others' -- whichever is cheaper (what the scheduler's split chooses)."""
        if n <= 0:
            return self.vcost(b)
        pad = self.vcost(b * m)
        if n >= b - 1e-9:
            return pad
        return min(pad, self.vcost(n * m) + self.vcost(b - n))

    def _agg(self, k: int, e: float, n: float, b: float, c: float) -> float:
        """Aggregate tokens per unit of the machine's time when n of b sessions draft blocks of k (each
        yielding e tokens) and the rest do not, relative to all b target-only. Non-drafters' rounds
        wait for the drafters' steps only where the drafter shares the verifier's hardware."""
        if n <= 0:
            return 1.0
        sv = self.scale_v
        v = sv * self._vround(b, n, k + 1)
        dr = k * c * self.dcost(n)
        tn = v + (dr if self.colocated else 0.0)
        return ((b - n) / tn + n * e / (v + dr)) * sv * self.vcost(b) / b

    def rate(self, k: int) -> float:
        """Expected tokens per target decoding step with a block of k (k = 0: target-only = 1).

        One session alone: E(k) tokens for v(k + 1) + k drafter steps, against one token for v(1).
        Many (b sessions share the forwards, measured costs): the better of two views. (a) This
        session's share of what the n sessions drafting now (it included) add to the machine's
        output: 1 + b x (the aggregate with them drafting - all target-only) / n, the aggregate from
        :meth:`_agg` -- a lone drafter among 15 sessions that do not costs a forward of its own (or
        pads everyone) and, on shared hardware, drafter steps that stall them all, which a 1/b share
        of a batch-wide cost hid. (An average, not the margin of one more drafter: once a few
        sessions pay for a forward of their own, one more adds little to it, and a group that loses
        as a whole kept itself drafting -- seen, 4 of 16 on this CPU.)
        (b) Everyone drafting alike, each at its own acceptance estimate (``peer_alpha``): b x E
        tokens for v(b(k + 1)) + k drafter steps of b rows -- where that pays (flat GPU tables) the
        sessions move there together even from a state where none drafts (there a lone drafter,
        pricing (a) alone, would never start). Without the others' counts only (b) is priced, with
        this session's estimate for all (the rule before they were measured)."""
        if k == 0:
            return 1.0
        a = self.alpha()
        e = self._tokens(a, k)
        sv = self.scale_v
        b, n = self._load()
        c = self.c * self.scale_d * self.steps_per_token()
        # (b): per batch of b sessions: b * E(k) tokens for v(b(k+1)) + k drafter forwards of b rows,
        # against b tokens for v(b) (target-only); b = 1 is one session alone
        per = sv * self.vcost(b) / (sv * self.vcost(b * (k + 1)) + k * c * self.dcost(b))
        if n >= b:
            return e * per
        alone = 1.0 + b * (self._agg(k, e, n, b, c) - 1.0) / n
        # everyone drafting counts only where the others would join: drafting together must pay at
        # their acceptance too (else they stay out and this session would draft alone after all)
        pa = self.alpha() if self.peer_alpha is None else min(0.98, max(0.02, self.peer_alpha))
        ep = self._tokens(pa, k)
        if ep * per < (self.margin if self.measured else 1.0):
            return max(1e-3, alone)  # (view (a) can fall below zero; a ratio of rates is not)
        return max(alone, (e + (b - 1.0) * ep) / b * per)

    def cumulative_stop(self) -> float:
        """The threshold of the block's cumulative drafter probability below which the drafter stops.

        Another proposal gains about (that product) x (the acceptance of one more token) tokens
        and costs one drafter step, c_eff target steps; it is worth it while that gain beats what
        the step would give elsewhere (~1.4 c_eff, tuned on recorded traces; capped at 0.9)."""
        if self.cfg.stop_cumulative is not None:
            return self.cfg.stop_cumulative
        b, n = self._load()
        # this session's share of the round's costs where n of b sessions draft: the verification's
        # extra and (on shared hardware) the drafter's steps are the drafters', b/n each in units of a
        # session's target step (b = n: everyone alike)
        share = b / n
        # per drafter step: a step that yields 1/r target tokens (text mode) must be r times surer
        c_eff = (self.c * self.scale_d * self.dcost(n) * self.steps_per_token() * (share if self.colocated else 1.0)
                 / (self.scale_v * self.vcost(b)))
        # and a longer block costs a longer verification: the mean extra cost of one more token over
        # the block sizes in reach (flat with native bf16 or on a GPU; ~0.3 of a step in fp32 on a CPU)
        dv = share * max(0.0, self._vround(b, n, self.hi + 1) - self.vcost(b)) / (self.hi * self.vcost(b))
        return min(0.9, 1.4 * (c_eff + dv))

    def pays(self) -> bool:
        """Whether some block size is expected to beat target-only now (no state changes)."""
        cfg = self.cfg
        if not cfg.adaptive or not cfg.allow_skip:
            return True
        best = max(self.rate(k) for k in range(cfg.min_draft_tokens, self.hi + 1))
        return best >= (self.margin if self.measured else 1.0)

    def could_pay(self, alpha: float = 0.9) -> bool:
        """Whether drafting would pay at a high acceptance (90%; no state changes). A drafter nearly
        as costly as its target cannot: its probes then stay at their slowest pace even when a
        whole probe block is accepted."""
        saved = self.succ, self.trials
        self.succ, self.trials = alpha, 1.0
        try:
            return self.pays()
        finally:
            self.succ, self.trials = saved

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
        verification that much longer. (Pricing one drafted token underpriced probes ~3x on a CPU
        in fp32, where verifying 3-5 tokens costs 2-3 decoding steps.)"""
        b, nd = self._load()
        share = b / nd  # (as in cumulative_stop)
        sv, vb = self.scale_v, self.vcost(b)
        n = self.probe_len()
        steps = self.dcost(max(1, feed)) + self.steps_per_token() * n - 1.0
        drafter = self.c * self.scale_d * self.dcost(nd) * steps * (share if self.colocated else 1.0)
        return (drafter + sv * share * max(0.0, self._vround(b, nd, n + 1) - vb)) / (sv * vb)

    def saving(self, alpha: float = 0.9) -> float:
        """The share of a target step per generated token that drafting would save at a high
        acceptance (0 where it would not pay): the most a probe that finds such text can win."""
        saved = self.succ, self.trials
        self.succ, self.trials = alpha, 1.0
        try:
            best = max(self.rate(k) for k in range(self.cfg.min_draft_tokens, self.hi + 1))
        finally:
            self.succ, self.trials = saved
        return max(0.0, 1.0 - 1.0 / best)

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
        if remaining is None or not self.measured or not self.could_pay():
            return True
        return remaining * self.saving() >= self.probe_odds() * self.probe_cost(feed)

    def probe_pace(self) -> int:
        """The probes' shortest interval in rounds (measured costs): long enough that the rounds
        between two probes could save a failed probe's cost times the odds against a hit
        (``probe_every`` for a pair that pays well, up to ``max_probe_every`` near the break-even)."""
        if not self.measured:
            return self.probe_every
        s = self.saving()
        if s <= 0:
            return self.max_probe_every
        need = math.ceil(self.probe_odds() * self.probe_cost() / s)
        return min(self.max_probe_every, max(self.probe_every, need))

    def loaded_out(self) -> bool:
        """Measured costs, more than one session sharing the forwards, and no acceptance could pay."""
        return self.measured and self.batch > 1.5 and not self.could_pay()

    def _feed(self, feed: int | None) -> int:
        """What a probe's first forward feeds the drafter: the decoder's exact count, else the
        rounds (target tokens) it missed."""
        return self.unfed if feed is None else max(1, int(feed))

    def next_k(self, remaining: int | None = None, feed: int | None = None) -> int:
        """The next round's block size; `remaining` = tokens the request may still generate (a
        probe needs room to pay back, see worth_probing; None = unknown). `feed`: the drafter tokens
        the drafter would be fed before it drafts again (its ids it does not hold: the decoder
        knows them exactly; in text mode a skipped round can be 2-3 drafter tokens); None = count
        the rounds it missed (`unfed`, what replays of traces do)."""
        cfg = self.cfg
        if not cfg.adaptive:
            return cfg.num_draft_tokens
        best = max(range(cfg.min_draft_tokens, self.hi + 1), key=self.rate)
        need = self.margin if self.measured else 1.0
        if self.judge:  # the probe (or first block) just verified: did it find text the drafter gets
            self.judge = False  # right (accepted in full), or text where drafting pays?
            d = self.hit_decay
            self.hit_s = d * self.hit_s + (1.0 if self.whole or self.rate(best) >= need else 0.0)
            self.hit_n = d * self.hit_n + 1.0
        if cfg.allow_skip and self.rate(best) < need:
            if self.loaded_out():
                # many sessions share the forwards and even 90% acceptance would not pay at this load:
                # no probe (it would only measure what the load already rules out); the load is
                # re-read every round, and once it falls the usual probe pace starts over
                self.probing = False
                self.skipped += 1
                self.unfed += 1
                self.interval = self.wait = self.probe_every
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
                # the text may have changed since alpha was last measured: let the probe's own
                # outcome dominate (a light, pessimistic prior of weight 1) instead of nudging a stale estimate
                self.probing = True
                self.unfed = 0
                self.succ, self.trials = 0.3, 1.0
                return self.hi if self.confident else min(self.hi, max(cfg.min_draft_tokens, 2))
            return 0
        if self.unfed > 1 and not self.worth_probing(remaining, self._feed(feed)):
            # drafting would pay, but the drafter has rounds (or, where the request started without
            # it, the prompt) to catch up on first, and too few tokens are left to win that back
            self.skipped += 1
            self.unfed += 1
            return 0
        self.skipped = self.unfed = 0
        self.probing = False
        self.interval = self.wait = self.probe_every  # drafting pays: when it stops, probe at the usual pace
        return self.hi if self.confident else best


def interpolate_cost(t: list[float], x: float, slope: float) -> float:
    """t[i] = cost of i + 1 units; linear in between, past the end the last step (or ``slope``) goes on."""
    if x <= 1:
        return t[0]
    if x <= len(t):
        i = int(x) - 1
        frac = x - (i + 1)
        return t[i] if frac == 0 else t[i] + (t[i + 1] - t[i]) * frac
    last = t[-1]
    step = max(0.0, last - t[-2]) if len(t) > 1 else slope
    return last + step * (x - len(t))


def cost_ratio(drafter: tuple[int, int, int], target: tuple[int, int, int]) -> float:
    """Drafter cost per token relative to one target forward, from :func:`cost_numbers`.

    Measured here: 0.5B/1.5B 0.36 (estimate 0.35), 135M/1.5B 0.17 (0.12). Deterministic on
    purpose (see DraftPolicy).
    """
    db, drow, drows = drafter
    tb, trow, trows = target
    return (db + drow * drows) / max(1, tb + trow * trows)
