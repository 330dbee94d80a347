"""Drafted blocks of one round loop's sessions verified together: a session whose block is ready waits
(bounded) for the sessions still drafting theirs, and they send their verifications at once.

A verifier whose forward costs about the same for one row as for several (a GPU; a CPU reading fp32
weights from memory) gives speculation under load its best price when every drafting session's block
is verified in ONE forward, and the drafter steps of those sessions, starting together after that
forward's replies, run as rows of one drafter forward too. Sessions that send their blocks the moment
each is ready fall out of that step at once: blocks end at different lengths (the drafter's doubt
stops one early), a drafter step taken alone puts one session a forward ahead, and each block then
gets a verifier forward of its own.

:class:`Gang` keeps the sessions drafting a block now (numbered) and the sessions whose block is ready.
:meth:`Gang.ready` moves a session from the first to the second and waits, at most ``bound_s``, until
every block that was being drafted when it got there is ready too (or its drafting ended without one);
then it releases every ready session at once, each told how many were released together (the
verifier's batch waits briefly for that many rows: VerifyRequest.gang). Blocks started later (a session
a round ahead) are not waited for, so no session waits on a chain of others. Sessions that draft
nothing this round take no part: a target-only round goes on at its own pace. The round loop
(crossdraft.decoding.decode) bounds a wait at twice the block's own drafting (0.05-2 s).

Which blocks take part: blocks of a fixed size (``adaptive_draft`` off). Measured on 2 cores (Xeon,
default pair fp32, 4 clients, every session drafting blocks of 4): 1.6 -> 2.9 rows per drafted
verification, 0.65x -> 0.87x of target-only. Adaptive blocks do not, yet: their lengths differ (the
drafter's doubt ends each where it ends), so a gang's drafter steps past the shortest block run with
few rows and every member waits for the longest, which the draft-length policy does not price -- with
them ganged, the chooser (pricing the better-shared verifications it measured) kept a 4-client
burst's sessions drafting at a loss (bf16, A/B in one run: 0.90x / 0.98x of target-only against 0.97x /
1.01x).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager


class Gang:
    """The blocks one round loop's sessions are drafting now, and their release together (see the module)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._drafting: dict[object, int] = {}  # session key -> the number of the block it is drafting
        self._ready: set = set()  # sessions whose block is ready, not yet released
        self._released: dict[object, int] = {}  # session key -> how many were released with it
        self._n = 0
        self.waits = 0  # releases that waited for other blocks
        self.waited_s = 0.0

    def start(self, key) -> None:
        """The session ``key`` starts drafting a block."""
        with self._cv:
            self._n += 1
            self._drafting[key] = self._n

    @contextmanager
    def drafting(self, key):
        """While the session drafts its block (:meth:`start`; :meth:`leave` where the drafting raises)."""
        self.start(key)
        try:
            yield
        except BaseException:
            self.leave(key)
            raise

    def leave(self, key) -> None:
        """The session's drafting ended without a block to verify (an error): nobody waits for it."""
        with self._cv:
            self._drafting.pop(key, None)
            self._ready.discard(key)
            self._cv.notify_all()

    def ready(self, key, bound_s: float) -> tuple[float, int]:
        """The session's block is ready: wait (at most ``bound_s``) for the blocks being drafted now, then go
        with every session ready by then. Returns (seconds waited, sessions released together)."""
        with self._cv:
            self._drafting.pop(key, None)
            others = dict(self._drafting)
            self._ready.add(key)
            self._cv.notify_all()  # (a session waiting for this block: it may go now)
            t0 = time.perf_counter()
            deadline = t0 + bound_s
            while key not in self._released:
                left = deadline - time.perf_counter()
                if left <= 0 or not any(self._drafting.get(k) == n for k, n in others.items()):
                    n = len(self._ready)
                    for k in self._ready:
                        self._released[k] = n
                    self._ready.clear()
                    self._cv.notify_all()
                    break
                self._cv.wait(left)
            w = time.perf_counter() - t0
            if others:
                self.waits += 1
                self.waited_s += w
            return w, self._released.pop(key)
