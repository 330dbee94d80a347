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
import time


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


def round_record(req, round_index: int, kk: int, kd: int, n: int, res, draft_s: float, verify_s: float,
                 skip_reason: str, predicted, step_s: float, overhead_s: float, draft_queue_s: float,
                 parts: dict | None, running: int, draft_rows: float = 0.0) -> dict:
    """One round's line (crossdraft.decoding.decode.Decoder._round): what the round did and took, and the
    policy's view after it."""
    rec = {"t": round(time.time(), 4), "sid": req.sid, "round": round_index, "mode": req.mode, "requested": kk,
           "drafted": kd, "accepted": n, "next_k": req.k if req.spec else 0,
           "draft_s": round(draft_s, 4), "verify_s": round(verify_s, 4),
           "queue_wait_s": round(getattr(res, "queue_wait_s", 0.0), 4),
           "draft_queue_s": round(draft_queue_s, 5), "overhead_ms": round(overhead_s * 1e3, 3),
           # where the overhead went (ms): before the round (the previous event's handling), the Draft
           # call outside the drafter's steps, the block's mapping to target ids, the Verify call outside
           # the verifier's time, and the rest of the loop
           "overhead_parts_ms": {k: round(v * 1e3, 3) for k, v in (parts or {}).items()},
           "batch_size": getattr(res, "batch_size", 1), "active_sessions": getattr(res, "active_sessions", 0),
           "running": running, "draft_batch_rows": round(draft_rows, 2),
           # the wait for the blocks other sessions were drafting, and how many blocks went with this one
           "gang_wait_s": round(req.gang_s, 4), "gang": req.gang_n}
    if skip_reason:
        rec["skip_reason"] = skip_reason
    if predicted:
        rec["predicted_tokens"], rec["predicted_s"] = round(predicted[0], 3), round(predicted[1] * step_s, 4)
    for key, price in (("price", getattr(res, "price", None)),
                       ("drafter_price", req.policy.costs.dprice if req.spec else None)):
        if price is not None:
            rec[key] = [round(price.base_ms, 2), round(price.row_ms, 2), round(price.token_ms, 2), price.forwards]
    if req.spec:
        rec.update(req.policy.log_fields())
    if req.gate is not None:  # the load gate's regime now (crossdraft.decoding.gate)
        rec["gate"] = "held" if req.gate.holds() else "free"
    return rec


def start_record(req, round_index: int, feed: int, sync_s: float, running_before: int, running: int) -> dict:
    """A speculative request's first line (crossdraft.decoding.decode.Decoder._start): its first block, the
    drafter tokens that block's first forward feeds, the prompt's sync, and the policy's view then."""
    view = req.policy.log_fields()
    return {"t": round(time.time(), 4), "sid": req.sid, "start": round_index, "k": req.k, "feed": feed,
            "sync_s": round(sync_s, 4), "running_before_sync": running_before, "running": running,
            **{x: view[x] for x in ("load", "others_drafting", "alpha", "best_rate", "need", "odds", "probe_cost")}}
