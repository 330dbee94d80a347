"""Memory tracing of a running gateway, for finding what grows (``CROSSDRAFT_TRACEMALLOC``).

With ``CROSSDRAFT_TRACEMALLOC=<file>`` the gateway starts :mod:`tracemalloc` once it is ready
(connected, tokenizers loaded: what start-up allocates is not traced) and takes a baseline
snapshot ``CROSSDRAFT_TRACEMALLOC_BASELINE_S`` seconds later (default 0; a warmed-up baseline
leaves the first requests' one-time allocations out). Then every
``CROSSDRAFT_TRACEMALLOC_INTERVAL_S`` seconds (default 60), on ``SIGUSR1``, and when the gateway
stops, it appends one report to the file: the process's RSS, the Python heap that tracemalloc
traces, the top ``CROSSDRAFT_TRACEMALLOC_TOP`` (default 25) allocation sites by growth since the
baseline, grouped by traceback (``CROSSDRAFT_TRACEMALLOC_FRAMES`` frames, default 8), and the
object types whose live count grew most. RSS growing while the traced heap stays flat points at
native memory (gRPC, Redis or OpenSSL buffers, the allocator's fragmentation); a traced site
that grows with the requests served is a Python-level leak.

tracemalloc costs CPU (every allocation records its traceback) and memory (the traces): for
diagnosis, not for production traffic.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import signal
import threading
import time
import tracemalloc

log = logging.getLogger("crossdraft.gateway")


def _rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _snapshot():
    """A snapshot without tracemalloc's own and the import system's allocations."""
    return tracemalloc.take_snapshot().filter_traces(
        (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>")))


def _type_counts() -> collections.Counter:
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


class MemTrace:
    """The tracer: :meth:`start` takes the baseline and starts the reporting thread; :meth:`report`
    appends one report (thread-safe); :meth:`stop` writes a last one."""

    def __init__(self, path: str, interval_s: float = 60.0, top: int = 25, frames: int = 8, baseline_s: float = 0.0):
        self.path, self.interval_s, self.top, self.frames = path, interval_s, top, frames
        self.baseline_s = baseline_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._base = None
        self._base_types: collections.Counter = collections.Counter()
        self._t0 = 0.0
        self.started = False
        self._rss0 = 0
        self._base_t = 0.0
        self._n = 0

    def install_signal(self) -> None:
        """SIGUSR1 asks for a report (call from the main thread: Python handles signals there)."""
        signal.signal(signal.SIGUSR1, lambda *_: self._wake.set())

    def start(self) -> "MemTrace":
        """Start tracing (allocations made before are not traced) and the reporting thread."""
        if not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)
        self._t0 = time.time()
        self.started = True
        if self.baseline_s <= 0:
            self._baseline()
        threading.Thread(target=self._loop, name="crossdraft-memtrace", daemon=True).start()
        log.warning("tracemalloc on (%d frames): baseline in %g s, reports every %g s and on SIGUSR1 to %s",
                    self.frames, self.baseline_s, self.interval_s, self.path)
        return self

    def _baseline(self) -> None:
        with self._lock:
            gc.collect()
            self._rss0 = _rss_bytes()
            self._base = _snapshot()
            self._base_types = _type_counts()
            self._base_t = time.time() - self._t0

    def _loop(self) -> None:
        if self._base is None and not self._stop.wait(self.baseline_s):
            self._baseline()
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.report()
            except Exception as e:  # noqa: BLE001 - diagnosis never takes the gateway down
                log.warning("memtrace report failed: %s: %s", type(e).__name__, e)

    def report(self) -> str:
        """Append one report (RSS, traced heap, top growth by traceback, object counts) and return it."""
        if self._base is None:
            self._baseline()
        with self._lock:
            gc.collect()
            snap = _snapshot()
            cur, peak = tracemalloc.get_traced_memory()
            rss = _rss_bytes()
            self._n += 1
            lines = [f"==== memtrace report {self._n} at +{time.time() - self._t0:.0f} s (pid {os.getpid()}) ====",
                     f"rss {rss / 2**20:.1f} MiB ({(rss - self._rss0) / 2**20:+.1f} since the baseline at "
                     f"+{self._base_t:.0f} s); "
                     f"traced python heap {cur / 2**20:.1f} MiB (peak {peak / 2**20:.1f}); "
                     f"tracemalloc's own {tracemalloc.get_tracemalloc_memory() / 2**20:.1f} MiB"]
            stats = snap.compare_to(self._base, "traceback")
            total = sum(s.size_diff for s in stats)
            lines.append(f"traced growth since the baseline: {total / 2**20:+.2f} MiB over {len(stats)} sites; "
                         f"top {self.top} by growth:")
            for s in sorted(stats, key=lambda s: s.size_diff, reverse=True)[:self.top]:
                lines.append(f"  {s.size_diff / 1024:+10.1f} KiB {s.count_diff:+8d} blocks "
                             f"(now {s.size / 1024:.1f} KiB in {s.count})")
                for fr in s.traceback.format(limit=self.frames, most_recent_first=True):
                    if fr.strip():
                        lines.append("      " + fr.strip())
            types = _type_counts()
            grown = sorted(((n - self._base_types.get(t, 0), t, n) for t, n in types.items()), reverse=True)
            lines.append("object types by growth in count: " + ", ".join(
                f"{t} {d:+d} ({n})" for d, t, n in grown[:15] if d > 0))
            text = "\n".join(lines) + "\n\n"
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(text)
            return text

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        try:
            self.report()
        except Exception as e:  # noqa: BLE001
            log.warning("memtrace report failed: %s: %s", type(e).__name__, e)


def from_env(env=None) -> MemTrace | None:
    """A :class:`MemTrace` (not started) if ``CROSSDRAFT_TRACEMALLOC`` names a file, else None."""
    env = os.environ if env is None else env
    path = env.get("CROSSDRAFT_TRACEMALLOC", "").strip()
    if not path:
        return None
    return MemTrace(path, interval_s=float(env.get("CROSSDRAFT_TRACEMALLOC_INTERVAL_S", 60)),
                    top=int(env.get("CROSSDRAFT_TRACEMALLOC_TOP", 25)),
                    frames=int(env.get("CROSSDRAFT_TRACEMALLOC_FRAMES", 8)),
                    baseline_s=float(env.get("CROSSDRAFT_TRACEMALLOC_BASELINE_S", 0)))


__all__ = ["MemTrace", "from_env"]
