"""The load gate: whether speculation pays at the load a verifier carries now, measured.

The draft-length policy (:mod:`crossdraft.decoding.policy`) prices each round from cost tables, the
servers' published prices and what its peers do. Under load that model can settle where every
session drafts because, given that the others draft, drafting pays for each of them -- while all of
them running target-only rounds would produce more (on cores shared by both models, the drafters'
steps and the longer verifications slow every session, and queue waits are not a block's price).
Where the sessions start is then a matter of history: reached from a light load with high
acceptance estimates, everyone keeps drafting; started at the same load from nothing, nobody does.

The gate settles it by measurement. Over windows of rounds it measures the goodput of the requests
sharing a verifier (tokens per request-second) with drafting *free* (each request's policy chooses
its blocks) or *held* (every request whose costs are measured runs target-only rounds, reason
``load``), per load level (the mean number of requests in the window, in powers of two). At each level
it keeps the regime that measured better and tries the other one again now and then: after the
first window, then after 2, 4, ... up to ``max_interval`` windows while the choice holds (the tries
cost little once the choice is stable), and a try takes over only when it beats the kept regime by
``margin`` (hysteresis: noise does not make it flap). A level never measured starts from the
neighbouring levels: held where a lighter load already measured held better (drafting pays less as
the load grows), free otherwise -- so a rising load does not pay the lesson again at every level. A
request alone (a mean load under ~1.4, or the only request in the loop at the moment) is never held:
its own policy prices that case exactly.

The gate never changes what is generated -- only whether blocks are drafted -- and it holds only the
requests whose costs are measured (greedy or coupled draws): a seeded sampling run with static costs
drafts the same blocks whatever the load, so its text replays.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field


def level_of(mean_requests: float) -> int:
    """The load level of a window with this mean number of requests: round(log2(mean)), so that a
    load of 8 whose requests come and go (7.6 on average) stays at level 3; 0 = alone."""
    if mean_requests < math.sqrt(2.0):
        return 0
    return int(round(math.log2(mean_requests)))


@dataclass
class Level:
    """What the gate knows of one load level."""

    held: bool  # the regime kept at this level (True: held, target-only rounds)
    goodput: dict = field(default_factory=lambda: {False: None, True: None})  # regime -> tokens/request-second
    interval: int = 1  # windows in the kept regime before the next try of the other
    wait: int = 1  # windows left until then
    trying: bool = False  # the current window tries the other regime
    switches: int = 0

    def held_now(self) -> bool:
        """The regime of the level's next window: the kept one, or the other while it is tried."""
        return not self.held if self.trying else self.held

    def measured(self) -> bool:
        return self.goodput[False] is not None and self.goodput[True] is not None


class LoadGate:
    """Measured goodput by load level: whether the requests sharing a verifier may draft now (see the
    module's docstring). The round loop calls :meth:`enter` / :meth:`leave` around each request (its
    whole time counts, the prompt's prefill included: a regime that makes prefills wait pays for it),
    :meth:`record` after each round, and asks :meth:`holds` before choosing a block."""

    margin = 1.03  # a try takes over only when it measures this much better than the kept regime
    rounds_per_request = 4  # a window lasts this many rounds per request sharing it (and min_window_s)
    min_window_s = 2.0
    # after a switch, rounds per request not measured: those in flight, and (free after held) the first
    # block's drafter catch-up and the policies' first look at the load again
    settle_rounds = 2
    # a free window measures drafting only where this share of its speculative rounds drafted (where the
    # policies already draft next to nothing, free and held are the same regime)
    min_drafting = 0.3
    first_interval = 2  # windows in a newly kept regime before the other is tried again; doubling
    max_interval = 16

    def __init__(self, clock=time.perf_counter, enabled: bool = True):
        self.clock = clock
        self.enabled = enabled
        self._lock = threading.Lock()
        self.running = 0
        self.levels: dict[int, Level] = {}
        self.level = 0
        self.held = False  # the regime of the current window
        self.windows = 0  # windows closed (measured or not)
        self._settle = 0
        self._t = clock()
        self._open(self._t)

    # ---- the requests and their rounds ----------------------------------------------------------------
    def enter(self) -> None:
        """A request enters the round loop. Into an idle loop: the window starts over, and is not
        measured (a burst's requests all prefill at once, which no later window of that load does)."""
        with self._lock:
            now = self.clock()
            self._advance(now)
            if self.running == 0:
                self._open(now)
                self._cold = True
            self.running += 1

    def leave(self) -> None:
        """A request leaves the round loop."""
        with self._lock:
            self._advance(self.clock())
            self.running = max(0, self.running - 1)

    def record(self, tokens: int, speculative: bool, drafted: bool) -> None:
        """A round ended: it emitted ``tokens``; it belongs to a speculative request; it verified a
        drafted block. (A gate that is off measures nothing.)"""
        if not self.enabled:
            return
        with self._lock:
            now = self.clock()
            self._advance(now)
            if self._settle > 0:  # rounds that started under the previous regime: not measured
                self._settle -= 1
                if self._settle == 0:
                    self._open(now)
                return
            self._tokens += tokens
            self._rounds += 1
            self._spec += int(speculative)
            self._drafted += int(speculative and drafted)
            elapsed = now - self._t0
            mean = self._area / elapsed if elapsed > 0 else 0.0
            if elapsed >= self.min_window_s and self._rounds >= self.rounds_per_request * max(1.0, mean):
                self._close(now, mean)

    def holds(self) -> bool:
        """Whether requests with measured costs run target-only rounds now (never for a request alone in
        the loop, whatever its level's regime: its own policy prices that case exactly)."""
        return self.enabled and self.held and self.running > 1

    # ---- windows ----------------------------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        """Integrate the requests in the loop over time (the window's request-seconds)."""
        self._area += self.running * max(0.0, now - self._t)
        self._t = now

    def _open(self, now: float) -> None:
        self._cold = False
        self._t0 = now
        self._area = 0.0
        self._tokens = self._rounds = self._spec = self._drafted = 0

    def _close(self, now: float, mean: float) -> None:
        self.windows += 1
        level = level_of(mean)
        regime = self.held
        if level == 0:  # a request alone: its own policy rules
            self.level, self.held = 0, False
        elif self._cold:  # (the window began in an idle loop: its level's regime starts now)
            self.level, self.held = level, self._at(level).held_now()
        else:
            st = self._at(level)
            # a window is measured at its level where it ran that level's regime (where the load moved
            # into a level that runs the other regime, it measured a mix: dropped)
            if level == self.level or st.held_now() == regime:
                share = self._drafted / self._spec if self._spec else 0.0
                self._learn(st, regime, self._tokens / self._area if self._area > 0 else 0.0, share)
            self.level, self.held = level, st.held_now()
        self._open(now)
        if self.held != regime:  # the requests' rounds in flight started under the other regime
            self._settle = self.settle_rounds * max(1, math.ceil(mean))

    def _at(self, level: int) -> Level:
        st = self.levels.get(level)
        if st is None:
            # a level never measured: held where a lighter load measured held better, else free
            # (the nearest lighter level measured in both regimes)
            lighter = [lv for lv, s in self.levels.items() if lv < level and s.measured()]
            st = self.levels[level] = Level(held=bool(lighter) and self.levels[max(lighter)].held)
        return st

    def _learn(self, st: Level, regime: bool, goodput: float, share: float) -> None:
        """One window at level ``st`` ran ``regime`` and measured ``goodput`` with ``share`` of its
        speculative rounds drafting: keep or switch the level's regime, and schedule the next try."""
        if not regime and share < self.min_drafting:
            # the policies drafted next to nothing: this window says nothing of drafting
            if st.trying:  # (a try of free that nobody drafted in: held stays, tried less often)
                st.trying = False
                st.interval = st.wait = min(self.max_interval, st.interval * 2)
            return
        g = st.goodput
        g[regime] = goodput if g[regime] is None else 0.5 * (g[regime] + goodput)
        if st.trying:
            st.trying = False
            if g[regime] > g[st.held] * self.margin:
                st.held = regime
                st.switches += 1
                st.interval = self.first_interval
            else:
                st.interval = min(self.max_interval, max(self.first_interval, st.interval * 2))
            st.wait = st.interval
            return
        st.wait -= 1
        if st.wait <= 0:
            st.trying = True

    # ---- what it reports --------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Per load level (2 ** level requests): the kept regime, the goodput measured in each, switches."""
        with self._lock:
            return {lv: {"held": st.held, "free": st.goodput[False], "held_goodput": st.goodput[True],
                         "switches": st.switches, "trying": st.trying}
                    for lv, st in sorted(self.levels.items())}
