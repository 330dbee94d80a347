"""Admission: how many generations the gateway runs at once and how many wait for a slot."""

from __future__ import annotations

import threading
import time

from crossdraft.errors import ResourceExhausted


class Admission:
    """How many generations run at once (``limit``) and how many may wait for a slot (``queue``,
    each up to ``wait_s``); past both, requests are refused at once with RESOURCE_EXHAUSTED (HTTP
    429 + Retry-After). Only generations take slots: health, metrics, sessions and tokenization
    never wait behind them."""

    def __init__(self, limit: int, queue: int, wait_s: float):
        self.limit, self.queue, self.wait_s = int(limit), int(queue), float(wait_s)
        self.active = 0
        self.waiting = 0
        self._cv = threading.Condition()

    def _refuse(self, why: str) -> ResourceExhausted:
        return ResourceExhausted(f"the gateway is at capacity ({self.active} requests running, {self.waiting} "
                                 f"waiting): {why}; retry later")

    def enter_nowait(self) -> bool:
        """True: a slot is taken; False: queued (then :meth:`wait` or poll :meth:`promote`)."""
        with self._cv:
            if self.active < self.limit and self.waiting == 0:
                self.active += 1
                return True
            if self.waiting >= self.queue:
                raise self._refuse("the wait queue is full")
            self.waiting += 1
            return False

    def promote(self) -> bool:
        """A queued caller takes a free slot, if there is one."""
        with self._cv:
            if self.active < self.limit:
                self.active += 1
                self.waiting -= 1
                return True
            return False

    def abandon(self) -> ResourceExhausted:
        """A queued caller gives up (waited too long): the error to raise."""
        with self._cv:
            self.waiting -= 1
            return self._refuse(f"no slot within {self.wait_s:g} s")

    def enter(self) -> None:
        """Take a slot, waiting in the queue up to ``wait_s`` (blocking: gRPC handler threads)."""
        if self.enter_nowait():
            return
        deadline = time.monotonic() + self.wait_s
        with self._cv:
            while True:
                if self.active < self.limit:
                    self.active += 1
                    self.waiting -= 1
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
        raise self.abandon()

    async def enter_async(self) -> None:
        """Take a slot without blocking the event loop (REST): poll while queued."""
        import anyio

        if self.enter_nowait():
            return
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            if self.promote():
                return
            await anyio.sleep(0.01)
        raise self.abandon()

    def leave(self) -> None:
        with self._cv:
            self.active -= 1
            self._cv.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no generation runs or waits (a drain); whether that happened in time."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self.active or self.waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.2))
        return True
