"""When a batching scheduler expects each session's next row back (crossdraft.runtime.returns): exact
checks on synthetic times, then the scheduler with real threads whose rows come back staggered."""

import time

from crossdraft.runtime import batching
from crossdraft.runtime.batching import BatchConfig, BatchScheduler, KVSlot
from crossdraft.runtime.returns import Returns
from tests.unit.runtime.threads import cpu_pool, run_threads


def _steady(r: Returns, key, answered_at: float, ret: float, rounds: int) -> float:
    """The session comes back `ret` after each answer, for `rounds` rounds; returns its last answer time."""
    t = answered_at
    for _ in range(rounds):
        r.answered(key, t)
        r.sent(key, t + ret)
        t += ret + 0.1
    r.answered(key, t)
    return t


def test_a_steady_session_is_expected_back_after_its_return_time():
    r = Returns()
    t = _steady(r, "a", 0.0, 0.02, 30)
    assert t + 0.02 < r.expected("a") < t + 0.026
    # waited for until then, not past its expected time, and only within the deadline
    assert r.wait_until(set(), t, t + 0.1) == r.expected("a")
    assert r.wait_until(set(), t, t + 0.01) is None
    assert r.wait_until({"a"}, t, t + 0.1) is None  # (already in the batch)


def test_a_session_in_the_server_or_never_answered_is_not_waited_for():
    r = Returns()
    r.answered("a", 0.0)  # out, but no return time known yet
    assert r.expected("a") is None
    r.sent("a", 0.05)
    assert r.expected("a") is None  # back in the server
    assert r.wait_until(set(), 0.06, 10.0) is None
    r.sent("b", 1.0)  # a row of a session never answered teaches nothing
    assert r.expected("b") is None and len(r) == 1


def test_an_overdue_session_stops_the_wait_and_is_forgotten_later():
    r = Returns()
    t = _steady(r, "a", 0.0, 0.02, 10)
    at = r.expected("a")
    assert r.wait_until(set(), at + 0.001, at + 1.0) is None  # it did not come when expected: no longer waited for
    assert len(r) == 1
    r.wait_until(set(), t + 5.0, t + 6.0)  # long gone (its request ended): forgotten
    assert len(r) == 0


def test_varying_returns_widen_the_expected_time():
    """A session that drafts blocks of changing length comes back at varying times: it is expected
    later than its mean return, and the more its returns vary, the later."""
    steady, varying = Returns(), Returns()
    t = 0.0
    for i in range(40):
        ret = 0.1 if i % 2 else 0.5
        for r, x in ((steady, 0.3), (varying, ret)):
            r.answered("a", t)
            r.sent("a", t + x)
        t += 1.0
    for r in (steady, varying):
        r.answered("a", t)
    assert steady.expected("a") < t + 0.35
    assert varying.expected("a") > t + 0.35 + 0.2


def test_the_wait_runs_to_the_latest_session_expected_before_the_deadline():
    r = Returns()
    ta = _steady(r, "a", 0.0, 0.01, 20)
    _steady(r, "b", 0.0, 0.03, 20)
    _steady(r, "c", 0.0, 0.5, 20)
    r.answered("a", ta)
    r.answered("b", ta)
    r.answered("c", ta)
    assert r.wait_until(set(), ta, ta + 0.1) == r.expected("b")  # (c is not before the deadline)
    r.sent("b", ta + 0.02)
    assert r.wait_until(set(), ta + 0.005, ta + 0.1) == r.expected("a")  # (a: still due)
    assert r.wait_until(set(), ta + 0.03, ta + 0.1) is None  # a is overdue by then: nothing left to wait for


def test_sessions_coming_back_staggered_share_one_forward_per_round(monkeypatch):
    """Four sessions whose clients take 0, 20, 40 and 60 ms to send their next row after each answer
    (what a gateway's round loops do, one after another) at a server whose forward takes 200 ms
    (a 1.5B model's step on 2 CPU cores): after a round or two to learn those times, each round of
    the four is ONE forward. Waiting only for callers inside the server, or a fixed share of a
    forward (30 ms at most), splits each round into two forwards: the late rows miss the first.

    The model's forward is a stand-in that sleeps (batched_forward patched; no KV pool): the test is
    about the scheduler's choice of rows, which needs forwards much longer than the threads'
    wake-ups, and a real model that slow would cost the suite seconds per round."""
    calls: list[int] = []

    def forward(model, pool, rows, head=None, graphs=None):
        calls.append(len(rows))
        time.sleep(0.2)
        return [None] * len(rows)

    monkeypatch.setattr(batching, "batched_forward", forward)
    sched = BatchScheduler(None, cpu_pool(), BatchConfig(), threads=1)  # (the automatic wait)
    sched.prices.set_prior([200.0])  # (what the server's timing of its forwards would say)
    sched._reserve = lambda batch: batch
    rounds, lags = 10, (0.0, 0.02, 0.04, 0.06)

    def client(lag: float) -> None:
        slot = KVSlot()
        for _ in range(rounds):
            sched.forward(slot, 0, [1], 1)
            time.sleep(lag)
        sched.release(slot)

    try:
        run_threads([lambda lag=lag: client(lag) for lag in lags], 60)
    finally:
        sched.close()
    assert sum(calls) == rounds * len(lags)
    # once their return times are learnt, each forward serves all four sessions: about one forward a round
    # (the first rounds split them, so the quick sessions get a round ahead and end first). Without the
    # wait for sessions expected back: ~19 forwards of 2 rows on average.
    assert len(calls) <= rounds + 3, calls
    assert calls.count(4) >= rounds - 3, calls
