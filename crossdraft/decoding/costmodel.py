"""The cost model of the draft-length policy: what a round costs and what it yields per unit of time.

:class:`CostModel` prices a round in units of one target decoding step -- the drafter's steps,
the verification of the block, and (measured costs) the load of the sessions sharing the model
servers' forwards -- and corrects its prices online from the rounds' wall-clock times.
:func:`interpolate_cost` reads a forward-cost table (the batch scheduler uses it too);
:func:`cost_ratio` turns the model servers' weight bytes into a drafter-step cost.
"""

from __future__ import annotations

import math

from crossdraft.decoding.acceptance import clamp_alpha, expected_tokens


class CostModel:
    """Prices of a round in target decoding steps, and the rate they give at an acceptance.

    One session alone: a block of k costs k drafter steps of ``c`` plus one target forward over
    k + 1 tokens, v(k + 1) (v(1) = 1). ``c`` and the table v (``verify_costs``, v(m) for
    m = 1..M, relative to v(1)) come either from the model servers' measured forward times
    (``measured=True``: on CPUs the verification forward of a block can cost 2-3x a decoding step,
    which a weight-bytes estimate cannot see), or from weight bytes with a small per-token slope.
    Measured costs are corrected online from the rounds' wall-clock times (:meth:`observe_time`:
    load, RPC overheads). Static costs are a function of the generated tokens only, so a seeded
    sampling run picks the same block sizes, hence the same random draws and the same text, every
    time (and after a failover).

    Many sessions at once (measured costs only): the model servers batch the rounds of concurrent
    sessions into one forward, so a session's share of the verification is v(B * m) / B and of a
    drafter step d(B) / B, where B (``batch``) is the number of sessions the verifier reports as
    sending it blocks lately (an exponential average; not the rows of the last batch: while sessions
    draft, fewer of them are verifying at any moment, and pricing with that smaller number would
    keep everyone drafting where everyone skipping is faster). Where forwards cost in proportion to
    their tokens (a CPU in fp32) drafting stops paying as B grows -- the verifier would rather score
    B sessions' single tokens than B blocks of which a third is rejected -- while on a GPU, flat in
    m up to hundreds of tokens, it keeps paying. The drafter's table (``drafter_costs``, d(n) for
    n = 1..M) gives d(B); without it d(B) = B. What the other sessions do -- how many of them draft
    (``others``), their acceptance (``peer_alpha``) and whether the drafter computes on the
    verifier's hardware (``colocated``) -- is part of what a block costs under load (:meth:`rate`).
    """

    margin = 1.05  # measured costs: draft only when it is expected to beat target-only by this factor
    time_decay = 0.8
    batch_decay = 0.7
    step_decay = 0.85
    # bounds of one round's measured/predicted time ratio: wide enough to correct a cost table timed
    # while another process computed on the same cores (such a table can be off by more than 20x)
    max_scale = 50.0
    price_forwards = 8  # forwards a server's published price must be fitted from before it prices rows
    # a catch-up feeds the drafter what it missed where that costs at most this share of a target decoding
    # step, else only the latest tokens that do, and never fewer than min_feed_window (feed_window)
    feed_share = 0.25
    min_feed_window = 16
    overlap_relax = 0.97  # per serial drafting round, what pipelined rounds measured (scale_o) keeps of its excess

    def __init__(self, cost_ratio: float = 0.2, verify_slope: float = 0.03, *,
                 verify_costs: list[float] | None = None, measured: bool = False,
                 drafter_costs: list[float] | None = None):
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
        # many sessions (measured mode): how many of the OTHER sessions sharing the forwards draft now
        # (None: unknown -- price as if all drafted alike), their mean acceptance estimate (None: as
        # this session's), and whether the drafter computes on the verifier's hardware (its steps then
        # stall every session's forwards, not only this one's round)
        self.others: float | None = None
        self.peer_alpha: float | None = None
        self.colocated = True
        # of the b sessions sharing the forwards, the share whose rows joined this session's verifications
        # in the rounds where it drafted (exponentially weighted; 1: all -- what a GPU's batches give).
        # Sessions drafting blocks of changing lengths on shared CPU cores fall out of step: each
        # verification then runs in a forward of its own few rows (measured 1.8 rows at 4 clients), and
        # pricing everyone drafting as one forward of all rows made blocks look 1.1-1.7x where they gave 0.6x
        self.sharing = 1.0
        # and the same for the drafter's steps of those blocks (the rows of the drafter's forwards that computed
        # them, DraftToken.batch_rows): b sessions' steps batched into one forward only while their Draft calls
        # arrive together -- on shared CPU cores they measured 1.1 rows at 4 clients
        self.dsharing = 1.0
        # pipelined rounds (crossdraft.decoding.pipeline): a block accepted whole has the next one drafted
        # during its verification -- the drafting is off the critical path, and the round's own token
        # is not taken (the ready block checks that position)
        self.pipelined = False
        # the verifier's published price of a batched forward by rows and tokens (measured mode; fwd)
        self.price = None
        # and the drafter's price of a batched step (dcost)
        self.dprice = None
        self.scale_d = 1.0  # measured/predicted drafter time (online correction, measured mode only)
        self.scale_v = 1.0  # measured/predicted verification time
        # pipelined rounds (measured mode): the verification's time while the drafter drafts the next block
        # beside it, over its time alone (scale_v) -- models on cores, caches or memory they share slow each
        # other, and a target-only round would not pay that -- and the wait, in target steps, for the step in
        # progress of a block drafted ahead and dropped
        self.scale_o = 1.0
        self.drop_wait = 0.0
        # drafter steps per target token drafted (text mode re-encodes the drafter's text: SmolLM2 spells a
        # Chinese character the Qwen target has as one token in 2-3 byte tokens); 1 in TLI mode
        self.step_sum, self.tok_sum = 1.0, 1.0

    def need(self) -> float:
        """The rate (tokens per target step) drafting must reach to be worth it."""
        return self.margin if self.measured else 1.0

    # ---- the tables -----------------------------------------------------------------------------
    def vcost(self, m: float) -> float:
        """Cost of a target forward over m tokens, in target decoding steps."""
        if not self.v:
            return 1.0 + self.slope * (m - 1)
        return interpolate_cost(self.v, m, self.slope)

    def fwd(self, rows: float, m: float) -> float:
        """Cost of a batched forward of ``rows`` rows of m tokens each, in target decoding steps. One
        row: the one-row table's forward of m tokens. More (a batch): the verifier's published price
        of that many rows and tokens (:mod:`crossdraft.runtime.price`, fitted from the batches it ran:
        each row attends over its own context and reads its own KV blocks, and a batch's tokens may
        cost more than one row's), in units of its own one-row step so that its level meets the
        table's at one row (the online correction ``scale_v`` owns the level); without one (static
        costs, an unbatched or older verifier) rows cost what their tokens cost in one row."""
        p = self.price
        if p is None or rows <= 1:
            return self.vcost(rows * m)
        return p.ms(rows, rows * m) / p.ms(1, 1)

    def see_price(self, price, drafter=None) -> None:
        """Measured costs: the verifier's price of a forward now and the drafter's of a step
        (crossdraft.runtime.price.Price; None: none published, the last one stays). A price fitted from
        fewer than ``price_forwards`` forwards is not used yet."""
        if not self.measured:
            return
        if price is not None and price.forwards >= self.price_forwards and price.valid():
            self.price = price
        if drafter is not None and drafter.forwards >= self.price_forwards and drafter.valid():
            self.dprice = drafter

    def dcost(self, n: float) -> float:
        """Cost of a drafter step over n rows of one token (n sessions' steps batched), in drafter steps:
        the drafter's published price of that many rows against its one-row step where it has one
        (:mod:`crossdraft.runtime.price`: rows cost more in a batch than tokens in one row), else the
        one-row table's forward of n tokens (without a table: n)."""
        p = self.dprice
        if p is not None and n > 1:
            return p.ms(n, n) / p.ms(1, 1)
        return self.dfeed(n)

    def dstep(self, n: float) -> float:
        """What one drafter step of each of n sessions drafting together costs the drafter, in drafter steps:
        their steps batched as far as the drafted blocks' steps were measured to be (``dsharing``: n / r
        forwards of r rows), all in one forward of n rows until measured otherwise."""
        r = self.drows(n)
        return n / r * self.dcost(r)

    def drows(self, n: float) -> float:
        """The rows of the drafter's forwards while n sessions draft together (``dsharing`` of the load)."""
        return max(1.0, min(n, self.dsharing * self.batch)) if n > 1 else n

    def dfeed(self, n: float) -> float:
        """Cost of a drafter forward over one row of n tokens (a catch-up feed), in drafter steps."""
        return interpolate_cost(self.d, n, 1.0) if self.d else max(1.0, n)

    def feed_fits(self, n: int) -> bool:
        """Whether the drafter takes in ``n`` tokens it missed (one forward) within a target decoding step
        (measured costs; static ones cannot tell, and say yes): a catch-up of them during the verification
        of a round that drafts nothing then stays off the round's critical path."""
        if not self.measured:
            return True
        return self.c * self.scale_d * self.dfeed(n) <= self.scale_v * self.fwd(self.load()[0], 1)

    def feed_window(self, n: int) -> int:
        """How many of the ``n`` tokens a drafter missed while rounds drafted nothing it is fed before it
        drafts again (measured costs; static ones: all): all of them where that forward costs at most
        ``feed_share`` of a target decoding step, else the latest ones that do, at least
        ``min_feed_window`` (DrafterState.elide cuts the rest). A catch-up is drafter time on the probe's
        path, and it grows with the rounds skipped: fed whole, a drafter that never pays (an English one
        on Chinese text: 2-3 drafter tokens a target token) would take in the whole output anyway, a
        few percent of the target's time however rare the probes; the recent text is most of what
        drafting the next tokens needs."""
        if not self.measured or n <= self.min_feed_window:
            return n
        budget = self.feed_share * self.scale_v * self.fwd(self.load()[0], 1) / (self.c * self.scale_d)
        if self.dfeed(n) <= budget:
            return n
        lo, hi = self.min_feed_window, n  # the largest m in [lo, n) whose feed fits (dfeed grows with m)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.dfeed(mid) <= budget else (lo, mid)
        return lo

    def steps_per_token(self) -> float:
        """Drafter steps one drafted target token costs (exponentially weighted; 1 until observed)."""
        return min(8.0, max(0.25, self.step_sum / max(1e-6, self.tok_sum)))

    # ---- what the rounds show -------------------------------------------------------------------
    def observe_steps(self, steps: int, tokens: int) -> None:
        """Text drafting: a block took `steps` drafter forwards and gave `tokens` target-token drafts."""
        if steps > 0:
            d = self.step_decay
            self.step_sum = d * self.step_sum + steps
            self.tok_sum = d * self.tok_sum + tokens

    def observe_batch(self, rows: int) -> None:
        """Measured mode: ``rows`` sessions share the verifier's forwards now."""
        if self.measured and rows >= 1:
            d = self.batch_decay
            self.batch = d * self.batch + (1 - d) * float(rows)

    def observe_sharing(self, rows: int, drafter_rows: float = 0.0) -> None:
        """Measured mode: the verification of a block this session drafted ran in a forward of ``rows``
        rows, and its drafter steps in forwards of ``drafter_rows`` rows on average (0: not reported),
        while ``batch`` sessions shared the forwards (a session alone says nothing about either)."""
        if not self.measured or self.batch <= 1.5:
            return
        d = self.batch_decay
        if rows >= 1:
            self.sharing = d * self.sharing + (1 - d) * min(1.0, rows / self.batch)
        if drafter_rows >= 1:
            self.dsharing = d * self.dsharing + (1 - d) * min(1.0, drafter_rows / self.batch)

    def observe_time(self, steps: int, draft_s: float, m: int, verify_s: float, target_step_s: float,
                     overlapped: bool = False, drop_s: float | None = None) -> None:
        """Measured mode: a round's wall-clock times (drafter steps, the verification of m tokens),
        against the predicted ones (target_step_s = the measured time of one target decoding step).
        ``overlapped``: the drafter drafted the next block during this verification (pipelined), whose
        time then measures ``scale_o``, not ``scale_v``; ``drop_s``: that block was dropped, and the round
        waited this long for its step in progress."""
        if not self.measured or target_step_s <= 0:
            return
        d = self.time_decay
        b = self.batch
        if verify_s > 0 and m >= 1 and overlapped:  # (the verification alone is scale_v's)
            # (at least 1: running beside the drafter does not speed a verification up; a ratio below 1 is
            # the table's error for blocks of m tokens, which scale_v, fitted mostly on other sizes, leaves)
            ratio = verify_s / (self.fwd(b, m) * target_step_s * self.scale_v)
            self.scale_o = d * self.scale_o + (1 - d) * min(self.max_scale, max(1.0, ratio))
            if drop_s is not None:
                self.drop_wait = d * self.drop_wait + (1 - d) * drop_s / target_step_s
        elif verify_s > 0 and m >= 1:  # the batch's forward: B rows of m tokens
            ratio = verify_s / (self.fwd(b, m) * target_step_s)
            self.scale_v = d * self.scale_v + (1 - d) * min(self.max_scale, max(1 / self.max_scale, ratio))
            if self.pipelined and m > 1:  # a serial round that drafted: what pipelining measured relaxes toward
                # none (a contention that has passed is found out by the pipelined rounds it lets run again)
                self.scale_o = 1.0 + self.overlap_relax * (self.scale_o - 1.0)
                self.drop_wait *= self.overlap_relax
        if steps > 0 and draft_s > 0:
            # a ratio of times: averaged in log space, each drafter step one observation (a probe's
            # block of 6 steps says more than one step does)
            ratio = draft_s / (steps * self.c * self.dstep(b) * target_step_s)
            w = d ** min(steps, 5)  # (at most as much as 5 steps: one slow moment must not decide alone)
            ratio = min(self.max_scale, max(1 / self.max_scale, ratio))
            self.scale_d = math.exp(w * math.log(self.scale_d) + (1 - w) * math.log(ratio))

    # ---- prices ---------------------------------------------------------------------------------
    def load(self) -> tuple[float, float]:
        """(b, n): the sessions sharing the forwards and how many would draft with this one (itself
        included): all b where the others' drafting is unknown."""
        b = self.batch if self.measured else 1.0
        if self.others is None or b <= 1.0:
            return b, b
        return b, min(b, 1.0 + max(0.0, self.others))

    def vround(self, b: float, n: float, m: float) -> float:
        """The verification of a round in which n of b sessions send blocks of m tokens (the others
        one token), in target steps: padded to one forward of b x m, or the blocks in a forward of their
        own beside the others' -- whichever is cheaper (what the scheduler's split chooses)."""
        if n <= 0:
            return self.fwd(b, 1)
        pad = self.fwd(b, m)
        if n >= b - 1e-9:
            return pad
        return min(pad, self.fwd(n, m) + self.fwd(b - n, 1))

    def agg(self, k: int, e: float, n: float, b: float, c: float, ep: float | None = None) -> float:
        """Aggregate tokens per unit of the machine's time when n of b sessions draft blocks of k (this
        one yielding e tokens, the other drafters ep each: e where not given) and the rest do not,
        relative to all b target-only. Non-drafters' rounds wait for the drafters' steps only where the
        drafter shares the verifier's hardware."""
        if n <= 0:
            return 1.0
        sv = self.scale_v
        v = sv * self.vround(b, n, k + 1)
        dr = k * c * self.dstep(n)
        tn = v + (dr if self.colocated else 0.0)
        drafted = e + (n - 1.0) * (e if ep is None else ep)
        return ((b - n) / tn + drafted / (v + dr)) * sv * self.fwd(b, 1) / b

    def rate(self, k: int, a: float) -> float:
        """Expected tokens per target decoding step with a block of k at acceptance a (k = 0:
        target-only = 1).

        One session alone: E(k) tokens for v(k + 1) + k drafter steps, against one token for v(1).
        Many (b sessions share the forwards, measured costs): the better of two views. (a) This
        session's share of what the n sessions drafting now (it included; the others at their mean
        acceptance estimate, ``peer_alpha``) add to the machine's output: 1 + b x (the aggregate with
        them drafting - all target-only) / n, the aggregate from
        :meth:`agg` -- a lone drafter among 15 sessions that do not costs a forward of its own (or
        pads everyone) and, on shared hardware, drafter steps that stall them all, which a 1/b share
        of a batch-wide cost hides. It is an average, not the margin of one more drafter: once a few
        sessions pay for a forward of their own, one more adds little to it, and pricing by that
        margin keeps a group drafting that loses as a whole.
        (b) Everyone drafting alike, each at its own acceptance estimate (``peer_alpha``): b x E
        tokens for v(b(k + 1)) + k drafter steps of b rows -- where that pays (flat GPU tables) the
        sessions move there together even from a state where none drafts (there a lone drafter,
        pricing (a) alone, would never start). Without the others' counts only (b) is priced, with
        this session's estimate for all. Both are averages over the sessions drafting: a session the
        drafter follows well beside others it does not (a high estimate among low ones) would gain for
        itself while the group, stalling the rest, loses."""
        if k == 0:
            return 1.0
        b, n = self.load()
        c = self.c * self.scale_d * self.steps_per_token()
        e, per, _ = self._round(k, a, b, c)
        pa = a if self.peer_alpha is None else clamp_alpha(self.peer_alpha)
        ep = expected_tokens(pa, k)
        together = (e + (b - 1.0) * ep) / b * per
        if n >= b:
            return together
        alone = 1.0 + b * (self.agg(k, e, n, b, c, ep) - 1.0) / n
        # everyone drafting counts only where the others would join: drafting together must pay at
        # their acceptance too (else they stay out and this session would draft alone after all)
        if ep * per < self.need():
            return max(1e-3, alone)  # (view (a) can fall below zero; a ratio of rates is not)
        return max(alone, together)

    def pipelines(self) -> bool:
        """Whether this session's rounds are pipelined now: where pipelining is on and no other session
        shares the verifier's forwards (on average fewer than 2 sessions). Other sessions' verifications
        fill the time a session drafts -- serial rounds interleave -- so drafting ahead would only give
        up each block's own token and verify that position twice."""
        return self.pipelined and self.load()[0] < 2.0

    def ahead_pays(self, k: int, a: float) -> bool:
        """Whether a round of k at acceptance a runs pipelined -- its successor drafted during its
        verification -- rather than serially: where pipelining is on, no other session shares the
        forwards, and the pipelined round's rate beats the serial one's (:meth:`rate` prices it so)."""
        if k <= 0 or not self.pipelines():
            return False
        return self._round(k, a, self.load()[0], self.c * self.scale_d * self.steps_per_token())[2]

    def _round(self, k: int, a: float, b: float, c: float) -> tuple[float, float, bool]:
        """(tokens, tokens per target step per token, pipelined) of a round of k at acceptance a, b sessions
        drafting alike (c: a drafter step's cost): serial, or pipelined where that is on and beats it."""
        e, per = expected_tokens(a, k), self._serial(k, b, c)
        if self.pipelines():
            pe, pper = self._pipelined(k, a, e, b, c)
            if pe * pper > e * per:
                return pe, pper, True
        return e, per, False

    def _serial(self, k: int, b: float, c: float) -> float:
        """Tokens per target step per token of serial rounds of k, b sessions drafting alike (c: a drafter
        step's cost): b * E(k) tokens for v(b(k + 1)) + k drafter forwards of b rows, against b tokens for
        v(b) target-only (b = 1: one session alone). Where the drafted verifications were measured to run
        in forwards of r < b rows (``sharing``), the b sessions' blocks take b / r forwards of r rows -- and,
        on the verifier's hardware, as many drafter steps of r rows one after another."""
        sv = self.scale_v
        r = max(1.0, min(b, self.sharing * b)) if b > 1 else b
        parts = b / r
        # the drafter's steps of the b blocks, batched as measured (dstep); on its own hardware a round waits
        # for its block's steps only, but the rounds cannot come faster than the drafter drafts all b blocks
        dr = k * c * self.dstep(b)
        verify = parts * sv * self.fwd(r, k + 1)
        if self.colocated:
            return sv * self.fwd(b, 1) / (verify + dr)
        return sv * self.fwd(b, 1) / max(verify + k * c * self.dcost(self.drows(b)), dr)

    def _pipelined(self, k: int, a: float, e: float, b: float, c: float) -> tuple[float, float]:
        """(tokens, tokens per target step per token) of a pipelined round of k at acceptance a: with
        probability a^k the block is accepted whole, its successor was drafted while it was verified (the
        drafting costs only what it outlasts the verification) and the round yields k tokens, not k + 1;
        otherwise the round waits for the dropped block's step in progress and the next block is drafted
        after the verification, as in a serial round. Every such verification runs beside the drafter, at
        the speed measured so (``scale_o``); the target-only round it is compared with runs alone."""
        sv, o = self.scale_v, self.scale_o
        v = sv * self.fwd(b, k + 1)
        dr = k * c * self.dcost(b)
        whole = clamp_alpha(a) ** k
        cost = o * v + (1.0 - whole) * (dr + self.drop_wait) + whole * o * max(0.0, dr - v)
        return max(1e-6, e - whole), sv * self.fwd(b, 1) / cost

    def stop_threshold(self, hi: int) -> float:
        """The cumulative drafter probability below which a confident block stops (blocks up to hi).

        Another proposal gains about (that product) x (the acceptance of one more token) tokens
        and costs one drafter step, c_eff target steps; it is worth it while that gain beats what
        the step would give elsewhere (~1.4 c_eff, tuned on recorded traces; capped at 0.9)."""
        b, n = self.load()
        # this session's share of the round's costs where n of b sessions draft: the verification's
        # extra and (on shared hardware) the drafter's steps are the drafters', b/n each in units of a
        # session's target step (b = n: everyone alike)
        share = b / n
        # per drafter step: a step that yields 1/r target tokens (text mode) must be r times surer
        c_eff = (self.c * self.scale_d * self.dstep(n) * self.steps_per_token() * (share if self.colocated else 1.0)
                 / (self.scale_v * self.fwd(b, 1)))
        # and a longer block costs a longer verification: the mean extra cost of one more token over
        # the block sizes in reach (flat with native bf16 or on a GPU; ~0.3 of a step in fp32 on a CPU)
        dv = share * max(0.0, self.vround(b, n, hi + 1) - self.fwd(b, 1)) / (hi * self.fwd(b, 1))
        return min(0.9, 1.4 * (c_eff + dv))

    def probe_cost(self, n: float, feed: int = 1) -> float:
        """What a block of n drafted tokens costs, in target decoding steps, if none of it is accepted:
        the drafter forward that feeds the `feed` tokens it has not seen and proposes the first
        token, the steps for the rest of the block (more steps per token in text mode), and the
        verification that much longer.

        The block's steps batch with the other drafting sessions' (``dstep``); the feed beyond its first
        token does not: a prefill of many tokens is compute-bound (16 sessions feeding their prompts at
        once cost ~16 prefills, not one step of 16 rows), so it is this session's own drafter time, and
        on hardware shared with the verifier every session waits for it."""
        b, nd = self.load()
        share = b / nd  # (as in stop_threshold)
        sv, vb = self.scale_v, self.fwd(b, 1)
        block = self.dstep(nd) * self.steps_per_token() * n * (share if self.colocated else 1.0)
        fed = (self.dfeed(max(1, feed)) - 1.0) * (b if self.colocated else 1.0)
        drafter = self.c * self.scale_d * (block + fed)
        return (drafter + sv * share * max(0.0, self.vround(b, nd, n + 1) - vb)) / (sv * vb)


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
    """Drafter cost per token relative to one target forward, from the model servers' weight bytes
    (``(body_bytes, head_row_bytes, head_rows)``, crossdraft.runtime.sessions.cost_numbers).

    One-token forwards are bound by reading weights, so the ratio of bytes read estimates the ratio
    of step times; it underprices a small drafter, whose fixed per-forward costs weigh more.
    Deterministic on purpose: static costs reproduce a seeded run anywhere (see CostModel).
    """
    db, drow, drows = drafter
    tb, trow, trows = target
    return (db + drow * drows) / max(1, tb + trow * trows)


def load_band(load: float) -> int:
    """The band of a load (the sessions sharing the forwards) whose cost corrections a new request starts
    from: 0 alone (under 1.5), then one band per doubling (1.5-3, 3-6, 6-12, 12-24, 24 and more)."""
    if load < 1.5:
        return 0
    return min(5, 1 + int(math.log2(load / 1.5)))


class CarriedScales:
    """The online corrections of the cost tables (DraftPolicy.scales) the latest rounds of a round loop
    measured, per drafting mode and load band (:func:`load_band`). They change with the load: on shared
    CPU cores a drafter step beside other sessions' verifications takes ~1.5-2.5x its time alone, and how
    the sessions' rows batch is only measured under load. Carried as one value, a quiet spell's
    corrections would price the next busy spell's first requests with a drafter step's time alone; per
    band a request starts from what was measured at about its load, else from the nearest band measured
    (the busier on a tie: a price too high delays drafting, one too low drafts at a loss for every session
    in the forward). A load never measured starts from the nearest band's, alone included."""

    def __init__(self):
        self._by: dict[tuple[str, int], tuple] = {}

    def put(self, mode: str, load: float, scales: tuple) -> None:
        self._by[(mode, load_band(load))] = scales

    def get(self, mode: str, load: float) -> tuple | None:
        band = load_band(load)
        have = [b for m, b in list(self._by) if m == mode]
        if not have:
            return None
        return self._by.get((mode, min(have, key=lambda b: (abs(b - band), -b))))

    def values(self) -> list[tuple]:
        return list(self._by.values())

    def clear(self) -> None:
        self._by.clear()
