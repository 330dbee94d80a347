"""The model servers' price of a batched forward (crossdraft.runtime.price): fitted online from the
forwards' rows, tokens and times. The times here are synthetic numbers fed to the fit (what a
scheduler would measure), so every check is exact arithmetic, not a clock."""

from __future__ import annotations

import itertools
import time

import pytest

from crossdraft.runtime.price import Price, PriceModel
from crossdraft.serving import wire
from crossdraft.v1 import verifier_pb2

# a one-row table: 20 ms for one token, +1.5 ms per further token
TABLE = [20.0 + 1.5 * i for i in range(64)]


def _feed(model: PriceModel, cost, shapes) -> None:
    for rows, tokens in shapes:
        model.observe(rows, tokens, cost(rows, tokens) / 1e3)


def test_the_fit_recovers_a_linear_cost_from_mixed_batches():
    """Batches with blocks (more tokens than rows) and without: base, per-row and per-token costs
    all come out, whatever the prior said."""
    m = PriceModel(TABLE)
    shapes = [(r, r * t) for r, t in itertools.product((1, 2, 4, 8, 16), (1, 2, 5))] * 3
    _feed(m, lambda r, t: 12.0 + 6.0 * r + 2.5 * t, shapes)
    p = m.price()
    assert p.forwards == len(shapes)
    assert (p.base_ms, p.row_ms, p.token_ms) == pytest.approx((12.0, 6.0, 2.5), rel=0.05)


def test_target_only_batches_put_the_per_row_extra_in_the_row_cost():
    """Only one token per row (target-only rounds: tokens = rows) fixes row + token but not the
    split: the token slope stays at the one-row table's (1.5 ms) and the rest of each row's cost
    lands in row_ms, so a block priced on top of the batch costs the table's slope per token."""
    m = PriceModel(TABLE)
    _feed(m, lambda r, t: 18.0 + 9.0 * r + 1.5 * t, [(r, r) for r in range(1, 17)] * 4)
    p = m.price()
    assert p.token_ms == pytest.approx(1.5, rel=0.1)
    assert p.row_ms == pytest.approx(9.0, rel=0.1)
    assert p.ms(16, 16) == pytest.approx(18.0 + 16 * 10.5, rel=0.02)


def test_one_session_alone_puts_a_slower_machine_in_the_base_not_in_the_rows():
    """Forwards of one row (a session alone: single tokens and blocks) on a machine running 30 ms
    slower than its table fix base + row but not the split: the difference is a cost each forward
    pays once, so a first batch of four single tokens is priced at what four rows cost (base + 4
    tokens), not at four times the extra."""
    m = PriceModel(TABLE)
    _feed(m, lambda r, t: 30.0 + 18.5 + 1.5 * t, [(1, t) for t in (1, 1, 1, 3, 5, 2)] * 10)
    p = m.price()
    assert p.token_ms == pytest.approx(1.5, rel=0.05)
    assert p.row_ms < 0.5
    assert p.ms(1, 1) == pytest.approx(50.0, rel=0.01)
    assert p.ms(4, 4) == pytest.approx(48.5 + 6.0, rel=0.02)


def test_the_price_follows_a_machine_that_slows_down():
    """Old forwards weigh less with every new one: after the machine becomes twice as slow, the
    price of a 16-row batch moves from the old cost to (near) the new one."""
    m = PriceModel(TABLE)
    shapes = [(r, r * t) for r, t in itertools.product((2, 8, 16), (1, 3))]
    _feed(m, lambda r, t: 10.0 + 4.0 * r + 2.0 * t, shapes * 20)
    before = m.price().ms(16, 16)
    _feed(m, lambda r, t: 2 * (10.0 + 4.0 * r + 2.0 * t), shapes * 30)
    after = m.price().ms(16, 16)
    assert before == pytest.approx(10 + 64 + 32, rel=0.05)
    assert after == pytest.approx(2 * (10 + 64 + 32), rel=0.05)


def test_a_price_never_falls_with_more_rows_or_tokens():
    """Forwards that cost less the more tokens they carry (noise over a narrow range) give a flat
    token price, not a negative one; a forward with nothing in it is not data."""
    m = PriceModel(TABLE)
    _feed(m, lambda r, t: 100.0 - 3.0 * t + 5.0 * r, [(4, 4), (4, 8), (4, 12), (4, 16)] * 200)
    m.observe(0, 0, 1.0)
    m.observe(3, 3, 0.0)
    p = m.price()
    assert p.token_ms >= 0 and p.row_ms >= 0 and p.base_ms > 0
    assert p.forwards == 800
    assert p.ms(8, 16) >= p.ms(4, 16) >= p.ms(4, 4)


def test_the_price_crosses_the_wire_and_a_bad_one_is_dropped():
    r = verifier_pb2.VerifyResponse(price=wire.price_to_proto(Price(10.0, 2.0, 0.5, 42)))
    assert wire.price_from_proto(verifier_pb2.VerifyResponse.FromString(r.SerializeToString())) == \
        Price(10.0, 2.0, 0.5, 42)
    assert wire.price_from_proto(verifier_pb2.VerifyResponse()) is None  # an older or unbatched verifier
    for bad in (Price(float("nan"), 1, 1), Price(-5, 1, 1), Price(0, 0, 0), Price(1, float("inf"), 0)):
        assert wire.price_from_proto(verifier_pb2.VerifyResponse(price=wire.price_to_proto(bad))) is None


def test_the_server_prices_only_forwards_of_short_rows(monkeypatch):
    """A prompt's chunk (a row longer than SHORT_ROW) is not a decoding round's forward: the scheduler
    leaves it out of the fit; one-token steps and blocks go in. (A stand-in forward: no model.)"""
    from crossdraft.runtime import batching
    from crossdraft.runtime.batching import SHORT_ROW, BatchConfig, BatchScheduler, KVSlot
    from tests.unit.runtime.threads import cpu_pool

    monkeypatch.setattr(batching, "batched_forward", lambda model, pool, rows, head=None, graphs=None:
                        [None] * len(rows))
    sched = BatchScheduler(None, cpu_pool(), BatchConfig(max_wait_ms=0), threads=1)
    sched._reserve = lambda batch: batch
    try:
        slot = KVSlot()
        sched.forward(slot, 0, [1] * (SHORT_ROW + 1), 1)  # a prompt's chunk
        assert sched.prices.price().forwards == 0
        sched.forward(slot, SHORT_ROW + 1, [1], 1)  # a decoding step
        sched.forward(slot, SHORT_ROW + 2, [1] * SHORT_ROW, 1)  # (a block at the limit)
        assert sched.prices.price().forwards == 2
    finally:
        sched.close()


def test_the_server_prices_a_ragged_forward_by_the_tokens_it_computed(monkeypatch):
    """Rows of a batch are padded to the longest: a 20-token sync beside three one-token steps is a
    forward of 4 x 20 tokens, and the fit gets it so (as 23 tokens its time would read as a dear
    row). The forward is held until all four rows wait, so they run as one batch."""
    import threading

    from crossdraft.runtime import batching
    from crossdraft.runtime.batching import BatchConfig, BatchScheduler, KVSlot
    from tests.unit.runtime.threads import cpu_pool, run_threads

    started, go = threading.Event(), threading.Event()
    monkeypatch.setattr(batching, "batched_forward", lambda model, pool, rows, head=None, graphs=None:
                        (started.set(), go.wait(10)) and [None] * len(rows))
    sched = BatchScheduler(None, cpu_pool(), BatchConfig(max_wait_ms=0), threads=1)
    sched._reserve = lambda batch: batch
    seen = []
    monkeypatch.setattr(sched.prices, "observe", lambda rows, tokens, s: seen.append((rows, tokens)))
    first = threading.Thread(target=sched.forward, args=(KVSlot(), 0, [1], 1))
    try:
        first.start()
        assert started.wait(10)  # (the first row's forward runs: it waits for go)

        def release():
            while len(sched._q) < 4:
                time.sleep(0.001)
            go.set()

        rows = [lambda n=n: sched.forward(KVSlot(), 0, [1] * n, 1) for n in (20, 1, 1, 1)]
        run_threads([*rows, release], 30)
        first.join(10)
    finally:
        go.set()
        sched.close()
    assert seen == [(1, 1), (4, 80)]
