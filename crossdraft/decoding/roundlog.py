"""The round log (the gateway's --round-log): one JSON line per round, appended to a file.

Each line holds the policy's view and the round's times, for tracing what the cost model decided
and why; a request's first line records how it started. A log that cannot be written is dropped,
never the request.
"""

from __future__ import annotations

import json
import threading


class RoundLog:
    """Appends JSON lines to ``path`` (None or "": off), one writer at a time."""

    def __init__(self, path: str | None):
        self.path = path or None
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return self.path is not None

    def write(self, rec: dict) -> None:
        line = json.dumps(rec) + "\n"
        with self._lock:
            if self.path is None:
                return
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(line)
            except OSError:
                self.path = None
