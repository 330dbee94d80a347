"""When each session's next row is expected back at a batching scheduler.

A session's rows come back after a round trip outside the server: its client (a gateway) handles the
reply, runs its round loop and sends the next request -- a few ms for a round that drafts nothing,
the drafter's block for one that drafts. Rows of sessions served by one forward therefore come back
spread over the clients' round trips (many sessions' round loops share one Python process, so
their replies are handled one after another). A scheduler that starts the next forward with
whatever has come splits the sessions into groups that then alternate, each group paying a whole
forward (seen on a 2-core CPU: 16 target-only sessions of a 1.5B model averaged 9.6 rows per
forward where one forward of 16 would do; a simulated GPU-like server 8.9).

:class:`Returns` keeps, per session, the time its last row was answered and a running estimate of
its return time (mean and mean deviation, from the rows it sent after being answered). A session
that is out -- answered, its next row not sent yet -- is expected back at ``answered + 1.1 mean +
2 deviations + 1 ms``; the scheduler may wait for the sessions expected back before a deadline, and stops
waiting once they are back or once their expected time has passed. A session whose round trips vary
(one that drafts blocks of changing length) gets a wide deviation, so it is waited for only where
even its late returns fall before the deadline. Times are plain numbers (seconds); the caller holds
the lock.
"""

from __future__ import annotations

# how much of each new return time moves the estimates
_ALPHA = 0.3
# beyond mean + 2 deviations: a thread's wake-up (a session whose returns never varied is still
# waited for a little past its mean, not dropped for being 0.1 ms late)
_SLACK = 0.001


class Returns:
    """Per-session return times (see the module's docstring)."""

    __slots__ = ("_s",)

    def __init__(self):
        # key -> [answered at (None while its row is in the server), mean return, mean deviation]
        self._s: dict = {}

    def answered(self, key, t: float) -> None:
        """The session's row was answered at ``t``: it is out until its next row comes."""
        s = self._s.get(key)
        if s is None:
            self._s[key] = [t, None, 0.0]
        else:
            s[0] = t

    def sent(self, key, t: float) -> None:
        """The session sent a row at ``t``: it is back (its return time is learnt)."""
        s = self._s.get(key)
        if s is None or s[0] is None:
            return
        r = max(0.0, t - s[0])
        if s[1] is None:
            s[1], s[2] = r, 0.25 * r  # (one return says little about the next: start with a wide deviation)
        else:
            s[2] += _ALPHA * (abs(r - s[1]) - s[2])
            s[1] += _ALPHA * (r - s[1])
        s[0] = None

    def forget(self, key) -> None:
        self._s.pop(key, None)

    def expected(self, key) -> float | None:
        """When the session is expected back (None: in the server, or no return time known yet)."""
        s = self._s.get(key)
        if s is None or s[0] is None or s[1] is None:
            return None
        return s[0] + 1.1 * s[1] + 2.0 * s[2] + _SLACK

    def wait_until(self, exclude, now: float, deadline: float) -> float | None:
        """The latest time before ``deadline`` at which a session not in ``exclude`` is expected back,
        counting the sessions that are out and not yet overdue (None: no session to wait for).
        Sessions long overdue (ended, or gone quiet) are forgotten."""
        until = None
        for key in list(self._s):
            if key in exclude:
                continue
            at = self.expected(key)
            if at is None:
                continue
            if at < now:
                s = self._s[key]
                if now - s[0] > 10.0 * (s[1] + s[2]) + 1.0:
                    del self._s[key]
                continue
            if at <= deadline and (until is None or at > until):
                until = at
        return until

    def __len__(self) -> int:
        return len(self._s)


__all__ = ["Returns"]
