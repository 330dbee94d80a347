"""The REST gateway's SSE response closes its generator as soon as the response ends, also when
the client goes away -- never leaving the cleanup to the garbage collector.

Regression test for a deadlock found by benchmarks/soak.py: Starlette's StreamingResponse left the
generator of a disconnected SSE client to the garbage collector; a collection triggered inside
``Placement.choose`` (holding the placement lock, on the event loop) ran the generator's cleanup,
which takes that lock again, and the whole gateway hung. Here the garbage collector is off: the
cleanup must have run, in a worker thread, by the time the response returns.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time

import anyio
import pytest

from gateway.rest_stream import ClosingStreamingResponse


def _events(state: dict, n: int = 1000):
    try:
        for i in range(n):
            time.sleep(0.005)  # a round of generation
            yield f"data: {i}\n\n"
    finally:
        state["closed_in"] = threading.current_thread()


def _serve(state: dict, spec: str, disconnect_after: int | None, n: int = 1000) -> list[bytes]:
    """Run one response with a fake ASGI server; the client goes away after `disconnect_after`
    body chunks (ASGI < 2.4: an http.disconnect message; 2.4: send raises OSError)."""
    bodies: list[bytes] = []

    async def main():
        gone = anyio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            if msg["type"] != "http.response.body":
                return
            if gone.is_set() and spec == "2.4":
                raise OSError("the client went away")
            bodies.append(msg["body"])
            if disconnect_after is not None and len(bodies) >= disconnect_after:
                gone.set()

        resp = ClosingStreamingResponse(_events(state, n), media_type="text/event-stream")
        with contextlib.suppress(Exception):  # 2.4: starlette raises ClientDisconnect
            await resp({"type": "http", "asgi": {"spec_version": spec}}, receive, send)
        state["returned"] = True

    enabled = gc.isenabled()
    gc.disable()
    try:
        anyio.run(main)
    finally:
        if enabled:
            gc.enable()
    return bodies


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_a_client_that_goes_away_has_its_stream_closed_before_the_response_returns(spec):
    state: dict = {}
    bodies = _serve(state, spec, disconnect_after=2)
    assert state.get("returned")
    assert 2 <= len(bodies) < 1000  # it stopped early
    assert "closed_in" in state, "the generator was left to the garbage collector"
    assert state["closed_in"] is not threading.main_thread()  # a worker thread, not the event loop


def test_a_stream_that_ends_is_closed_and_complete():
    state: dict = {}
    bodies = _serve(state, "2.3", disconnect_after=None, n=5)
    assert [b for b in bodies if b] == [f"data: {i}\n\n".encode() for i in range(5)]
    assert "closed_in" in state
