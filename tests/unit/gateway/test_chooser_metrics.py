"""The gateway's metrics of the chooser of draft lengths (gateway/metrics.py): the histogram of blocks
verified per speculative round, skipped rounds by reason, and predicted vs measured goodput over a
window of rounds -- fed RoundEvents with known numbers, read back from a real Prometheus registry."""

from __future__ import annotations

import pytest

from crossdraft.decoding.stats import RoundEvent
from gateway.metrics import Metrics


def _ev(drafted, accepted, *, reason="", pt=0.0, ps=0.0, wall=0.0, spec=True, ahead=""):
    return RoundEvent(0, drafted, drafted, accepted, [], "", 0.0, 0.0, 0.0, False, speculative=spec,
                      skip_reason=reason, predicted_tokens=pt, predicted_s=ps, wall_s=wall, ahead=ahead)


def _value(m: Metrics, name: str, **labels) -> float:
    v = m.registry.get_sample_value(name, labels or None)
    return 0.0 if v is None else v


def test_speculative_rounds_land_in_the_histogram_and_skips_by_reason():
    m = Metrics()
    for ev in (_ev(0, 0, reason="load"), _ev(0, 0, reason="load"), _ev(0, 0, reason="acceptance"), _ev(4, 3),
               _ev(0, 0, spec=False)):  # (a target-only request's round is not the chooser's)
        m.round(ev)
    assert _value(m, "crossdraft_draft_length_count") == 4
    assert _value(m, "crossdraft_draft_length_bucket", le="0.0") == 3
    assert _value(m, "crossdraft_draft_length_sum") == 4
    assert _value(m, "crossdraft_skipped_rounds_total", reason="load") == 2
    assert _value(m, "crossdraft_skipped_rounds_total", reason="acceptance") == 1


def test_goodput_is_predicted_and_measured_over_the_latest_rounds():
    m = Metrics()
    n = Metrics.GOODPUT_WINDOW
    # old rounds: predicted 2 tokens in 1 s, got 1 token in 1 s; then a full window of newer ones:
    # predicted 3 tokens in 0.5 s, got 4 (a block accepted whole) in 2 s -- the old ones drop out
    for _ in range(10):
        m.round(_ev(3, 0, pt=2.0, ps=1.0, wall=1.0))
    assert _value(m, "crossdraft_round_goodput_tokens_per_second", kind="predicted") == pytest.approx(2.0)
    assert _value(m, "crossdraft_round_goodput_tokens_per_second", kind="measured") == pytest.approx(1.0)
    for _ in range(n):
        m.round(_ev(3, 3, pt=3.0, ps=0.5, wall=2.0))
    assert _value(m, "crossdraft_round_goodput_tokens_per_second", kind="predicted") == pytest.approx(6.0)
    assert _value(m, "crossdraft_round_goodput_tokens_per_second", kind="measured") == pytest.approx(2.0)
    # a pipelined round whose block ahead was used takes no token of its own; rounds without a
    # prediction (static costs) do not count
    m2 = Metrics()
    m2.round(_ev(2, 2, pt=3.0, ps=1.0, wall=1.0, ahead="used"))
    m2.round(_ev(2, 2))
    assert _value(m2, "crossdraft_round_goodput_tokens_per_second", kind="measured") == pytest.approx(2.0)


def test_blocks_drafted_ahead_are_counted_by_outcome():
    """Pipelined rounds: each round that drafted the next block during its verification counts it as used
    or dropped; serial rounds count nothing."""
    m = Metrics()
    for ev in (_ev(4, 4, ahead="used"), _ev(4, 4, ahead="used"), _ev(4, 1, ahead="dropped"), _ev(4, 2)):
        m.round(ev)
    assert _value(m, "crossdraft_blocks_drafted_ahead_total", outcome="used") == 2
    assert _value(m, "crossdraft_blocks_drafted_ahead_total", outcome="dropped") == 1


def test_the_load_gates_are_exported_per_verifier_and_load():
    """A gate that measured held better at 8 requests (a simulated machine, tests/unit/decoding/test_gate.py)
    shows as held there, with both regimes' goodput and its one switch."""
    from tests.unit.decoding.test_gate import DRAFT_LOSES, gate_with, simulate

    gate, clock = gate_with(8)
    simulate(gate, clock, 8, 3000, **DRAFT_LOSES)
    m = Metrics()
    m.watch_gates(lambda: {"10.0.0.7:50052": gate})
    at = dict(verifier="10.0.0.7:50052", load="8")
    assert _value(m, "crossdraft_load_gate_held", **at) == 1.0
    free, held = (_value(m, "crossdraft_load_gate_goodput", regime=r, **at) for r in ("free", "held"))
    assert free == pytest.approx(2.0, rel=0.05) and held == pytest.approx(2.5, rel=0.05)  # tokens / request-second
    assert _value(m, "crossdraft_load_gate_switches_total", **at) == 1
