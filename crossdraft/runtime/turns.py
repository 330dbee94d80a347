"""Model servers that compute on the same CPU cores take turns: one forward at a time across processes.

Two model servers computing at once on the same cores run their intra-op threads on cores the
other's threads want too. torch's OpenMP threads spin while they wait for one another, so each
forward then takes several times as long as alone -- longer than the two forwards one after the
other. A drafter and a verifier sharing two cores are in that state whenever one session drafts
while another verifies. :class:`Turns` makes the servers that share a lock file take turns
instead: a forward holds an exclusive ``flock`` on the file (a process that dies lets go of it)
and runs at the speed it has alone; rows that arrive meanwhile join the server's next forward.

The turns are fair. A server waiting for a turn marks itself (an exclusive lock on a file of its
own beside the lock file); a server ending its forward lets every marked server take the turn
before it tries again, so a verifier with a queue of rows cannot starve a drafter whose steps are
short, nor the other way round.

Waits are bounded, so a stopped or stuck peer slows the others down and never hangs them: a turn
not had within ``max_wait_s`` is taken anyway (the forward runs beside the peer's), and a peer
that does not take the turn it is given within ``handoff_s`` is passed over.

Which servers share a file: by default (:func:`lock_path` with ``"auto"``) the CPU model servers
of one machine whose processes may run on the same set of CPUs (the file's name in the temporary
directory is the CPU list); servers pinned to disjoint CPUs (``--cpus``) never wait for each
other. GPU servers do not take turns.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import tempfile
import threading
import time

log = logging.getLogger("crossdraft.runtime.turns")


def lock_path(setting: str | None) -> str | None:
    """The lock file of a server's ``--cpu-turns`` setting: ``"off"`` / empty -> None; ``"auto"`` -> one per
    CPU set in the temporary directory (this process's affinity now: call it after pinning); anything else
    is a file path (servers in containers that share a directory)."""
    s = (setting or "").strip()
    if not s or s.lower() == "off":
        return None
    if s.lower() != "auto":
        return s
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    from crossdraft.argtypes import format_cpu_list

    return os.path.join(tempfile.gettempdir(), f"crossdraft-turns-cpus-{format_cpu_list(cpus)}.lock")


class Turns:
    """Fair, bounded turns over the forwards of the processes given the same ``path``."""

    poll_s = 0.0005  # how often a waiting server tries the lock again
    max_wait_s = 30.0  # a turn not had by then is taken anyway (a stopped peer holds it)
    handoff_s = 0.05  # how long an ending turn waits for each marked peer to take the next one
    # a server whose callers send their next row as soon as they have an answer (a drafter's block) keeps
    # the turn into that row's forward: for at most run_on_s in all, waiting at most linger_s for the row
    run_on_s = 1.0
    linger_s = 0.005

    def __init__(self, path: str, name: str = ""):
        self.path = os.path.abspath(path)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._mark = f"{self.path}.wait.{name or 'server'}-{os.getpid()}"
        self._sweep()
        self._mark_fd = os.open(self._mark, os.O_RDWR | os.O_CREAT, 0o600)
        self._lock = threading.Lock()  # one turn at a time within the process too
        self._held = False
        self._owed: list[int] = []  # marks of the servers waiting when the last turn ended (open descriptors)
        self.waited_s = 0.0  # seconds spent waiting for turns (all forwards)
        self.turns = 0  # turns taken
        self.forced = 0  # turns taken without the lock (max_wait_s passed)

    @staticmethod
    def _try(fd: int, how: int) -> bool:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return True
        except OSError:
            return False

    def acquire(self) -> float:
        """Wait for the turn (at most ``max_wait_s``); returns the seconds waited. The servers that were
        waiting when this server's last turn ended take theirs first."""
        t0 = time.perf_counter()
        self._lock.acquire()
        try:
            owed, self._owed = self._owed, []
            for fd in owed:
                self._hand_over(fd)
            fcntl.flock(self._mark_fd, fcntl.LOCK_EX)  # "waiting": peers ending their turn let this one go first
            try:
                deadline = t0 + self.max_wait_s
                self._held = self._try(self._fd, fcntl.LOCK_EX)
                while not self._held:
                    if time.perf_counter() >= deadline:
                        self.forced += 1
                        log.warning("no turn on %s after %.0f s: computing beside the server that holds it",
                                    self.path, self.max_wait_s)
                        break
                    time.sleep(self.poll_s)
                    self._held = self._try(self._fd, fcntl.LOCK_EX)
            finally:
                fcntl.flock(self._mark_fd, fcntl.LOCK_UN)
        except OSError:  # (a file system without flock, a file removed under it: compute without turns)
            log.warning("turns on %s failed: computing without a turn", self.path, exc_info=True)
            self.forced += 1
        w = time.perf_counter() - t0
        self.waited_s += w
        self.turns += 1
        return w

    def release(self) -> None:
        """End the turn, and note the servers waiting for one: the next :meth:`acquire` lets them go first
        (here, the caller goes on at once: its rows' results are not held up by the hand-over)."""
        try:
            if self._held:
                self._held = False
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                self._owed = [fd for fd in map(self._open, self._waiting()) if fd is not None]
        except OSError:
            log.warning("ending a turn on %s failed", self.path, exc_info=True)
        finally:
            self._lock.release()

    def _open(self, mark: str) -> int | None:
        """An open descriptor of ``mark`` if its server is waiting now (it holds the mark), else None."""
        try:
            fd = os.open(mark, os.O_RDWR)
        except OSError:  # (its server stopped meanwhile)
            return None
        if self._try(fd, fcntl.LOCK_SH):  # not waiting
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return None
        return fd

    def _sweep(self) -> None:
        """Remove the marks of servers that ended without closing theirs (killed): their process is gone."""
        for mark in self._waiting():
            try:
                pid = int(mark.rsplit("-", 1)[1])
                os.kill(pid, 0)
            except ProcessLookupError:
                try:
                    os.unlink(mark)
                except OSError:
                    pass
            except (ValueError, IndexError, OSError):  # not ours to judge (another user's process)
                pass

    def _waiting(self) -> list[str]:
        return [m for m in glob.glob(glob.escape(self.path) + ".wait.*") if m != self._mark]

    def _hand_over(self, fd: int) -> None:
        """Wait (at most ``handoff_s``) while the server of the mark open as ``fd`` is waiting: it drops its
        mark once it has the turn. Closes ``fd``."""
        try:
            deadline = time.perf_counter() + self.handoff_s
            while not self._try(fd, fcntl.LOCK_SH):
                if time.perf_counter() >= deadline:
                    return
                time.sleep(self.poll_s)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Let go of the files (the mark is removed: nobody waits for this server any more)."""
        for fd in self._owed:
            os.close(fd)
        self._owed = []
        try:
            os.unlink(self._mark)
        except OSError:
            pass
        for fd in (self._mark_fd, self._fd):
            try:
                os.close(fd)
            except OSError:
                pass
