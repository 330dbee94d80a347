"""Helpers of the runtime tests that run callers on real threads against a scheduler."""

from __future__ import annotations

import threading


def run_threads(fns, timeout_s: float = 120.0) -> None:
    """Run each of ``fns`` on its own thread, all released at once; re-raise the first error, and fail
    if one of them is still running after ``timeout_s`` (a caller that hung)."""
    errors = []
    start = threading.Barrier(len(fns))

    def wrap(fn):
        try:
            start.wait()
            fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=wrap, args=(f,)) for f in fns]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in ts), "a caller hung"
    if errors:
        raise errors[0]


def cpu_pool():
    """A stand-in for a KV pool on the CPU, for a scheduler whose forward is patched (no model)."""
    return type("Pool", (), {"device": type("Device", (), {"type": "cpu"})()})()
