"""The round log (the gateway's --round-log): one JSON line per round, appended to a file.

Each line holds the policy's view and the round's times, for tracing what the cost model decided
and why; a request's first line records how it started. A log that cannot be written is dropped,
never the request.

The round loop only queues a line: a writer thread encodes and writes it, so that the file's
writes are not on the rounds' path. A request's lines are in the file when its result is
(:meth:`RoundLog.flush`, at the end of each request), and at the process's normal exit.
"""

from __future__ import annotations

import atexit
import json
import queue
import threading


class RoundLog:
    """Appends JSON lines to ``path`` (None or "": off), written in order by one writer thread."""

    def __init__(self, path: str | None):
        self.path = path or None
        self._q: queue.Queue | None = None
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return self.path is not None

    def write(self, rec: dict) -> None:
        """Queue one line (the record is encoded later: do not change it after this call)."""
        if self.path is None:
            return
        if self._q is None:
            with self._lock:
                if self._q is None:
                    q: queue.Queue = queue.Queue()
                    threading.Thread(target=self._writer, args=(q,), name="crossdraft-round-log", daemon=True).start()
                    atexit.register(self.flush)
                    self._q = q
        self._q.put(rec)

    def flush(self) -> None:
        """Wait until every line queued so far is written (or the log was dropped)."""
        if self._q is not None:
            self._q.join()

    def _writer(self, q: queue.Queue) -> None:
        f = None
        while True:
            rec = q.get()
            try:
                if self.path is None:
                    continue
                if f is None:
                    f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 -- held open by the writer
                f.write(json.dumps(rec) + "\n")
                if q.empty():  # a burst's lines reach the file together
                    f.flush()
            except (OSError, TypeError, ValueError):
                self.path = None  # the log is dropped, never the request
            finally:
                q.task_done()
