"""Blocks drafted together are sent together (crossdraft.decoding.gang): which sessions wait for which,
and how many go at once. Real threads; what is asserted is who was released with whom, never a time (the
bounds are hours where a wait must not end by itself, and zero where it must not wait)."""

from __future__ import annotations

import threading

import pytest

from crossdraft.decoding.gang import Gang

HOUR = 3600.0


def _ready_in_thread(gang: Gang, key, out: dict, bound: float = HOUR) -> threading.Thread:
    t = threading.Thread(target=lambda: out.__setitem__(key, gang.ready(key, bound)), daemon=True)
    t.start()
    return t


def _waiting(gang: Gang, key) -> bool:
    with gang._cv:
        return key in gang._ready


def _until(cond) -> None:
    ev = threading.Event()
    for _ in range(20000):
        if cond():
            return
        ev.wait(0.001)
    raise AssertionError("condition not reached")


def test_a_ready_block_waits_for_the_blocks_being_drafted_and_they_go_together():
    g, out = Gang(), {}
    for s in ("a", "b", "c"):
        g.start(s)
    ta = _ready_in_thread(g, "a", out)
    _until(lambda: _waiting(g, "a"))
    tb = _ready_in_thread(g, "b", out)
    _until(lambda: _waiting(g, "b"))
    assert ta.is_alive() and tb.is_alive() and not out  # c is still drafting
    assert g.ready("c", HOUR)[1] == 3
    ta.join(10)
    tb.join(10)
    assert out["a"][1] == out["b"][1] == 3 and g.waits == 2


def test_alone_or_with_nobody_drafting_a_block_goes_at_once():
    g = Gang()
    g.start("a")
    assert g.ready("a", 0.0) == (pytest.approx(0.0, abs=0.5), 1)  # (a bound of 0: no wait possible)
    g.start("a")
    assert g.ready("a", HOUR)[1] == 1  # nobody else drafting: no wait at all
    assert g.waits == 0


def test_a_block_started_after_the_wait_began_is_not_waited_for():
    """b starts drafting after a began waiting for c: once c is ready, a and c go; b (a round ahead
    of them, say) is not waited for -- no session waits on a chain of others."""
    g, out = Gang(), {}
    g.start("a")
    g.start("c")
    ta = _ready_in_thread(g, "a", out)
    _until(lambda: _waiting(g, "a"))
    g.start("b")
    assert g.ready("c", HOUR)[1] == 2
    ta.join(10)
    assert out["a"][1] == 2
    with g._cv:
        assert "b" in g._drafting


def test_a_drafting_that_fails_releases_the_waiters():
    g, out = Gang(), {}
    g.start("x")
    with pytest.raises(RuntimeError):
        with g.drafting("y"):
            tx = _ready_in_thread(g, "x", out)
            _until(lambda: _waiting(g, "x"))
            assert tx.is_alive()  # waiting for y's block
            raise RuntimeError("the drafter went away")
    tx.join(10)
    assert out["x"][1] == 1  # released, alone


def test_a_block_that_never_comes_is_waited_for_at_most_the_bound():
    g, out = Gang(), {}
    g.start("a")
    g.start("stuck")
    ta = _ready_in_thread(g, "a", out, bound=0.05)
    ta.join(30)
    assert not ta.is_alive() and out["a"][1] == 1
