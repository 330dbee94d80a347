"""The load gate (crossdraft.decoding.gate): drafting held or free by measured goodput per load level.

A simulated machine on a fake clock: n requests in a closed loop, each round of a request takes a time
and emits tokens that depend on the regime the gate is in (free: the policies draft; held: target-only
rounds). The tests check properties of what the gate keeps -- the better regime, no flapping, tries
that get rarer, nothing held for a request alone -- not its tuning constants.
"""

from __future__ import annotations

import random

import pytest

from crossdraft.decoding.gate import LoadGate, level_of


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def simulate(gate: LoadGate, clock: Clock, n: int, rounds: int, free: tuple[float, float],
             held: tuple[float, float], drafts: bool = True, noise: float = 0.0, seed: int = 0) -> list[bool]:
    """n requests share the machine: a round takes seconds s and emits e tokens, (e, s) = ``free`` or
    ``held`` by the gate's regime at the round's start; the n requests' rounds interleave, so the
    clock moves s / n per round. Returns the regime of each round."""
    rng = random.Random(seed)
    regimes = []
    for _ in range(rounds):
        h = gate.holds()
        e, s = held if h else free
        if noise:
            s *= 1.0 + rng.uniform(-noise, noise)
        clock.t += s / n
        gate.record(int(e) if float(e).is_integer() else (int(e) + (rng.random() < e % 1)), True, drafts and not h)
        regimes.append(h)
    return regimes


def gate_with(n: int) -> tuple[LoadGate, Clock]:
    clock = Clock()
    gate = LoadGate(clock=clock)
    for _ in range(n):
        gate.enter()
    return gate, clock


def changes(regimes: list[bool]) -> int:
    return sum(1 for a, b in zip(regimes, regimes[1:], strict=False) if a != b)


# CPU-like: blocks verified in a compute-bound batch cost more than they yield -- 3 tokens per 1.5 s
# drafting vs 1 per 0.4 s target-only (2.0 vs 2.5 tokens per request-second)
DRAFT_LOSES = dict(free=(3.0, 1.5), held=(1.0, 0.4))
# GPU-like: verification flat in tokens -- drafting wins
DRAFT_WINS = dict(free=(3.0, 0.6), held=(1.0, 0.4))


@pytest.mark.parametrize("n", [2, 8, 16, 32])
def test_it_holds_drafting_where_target_only_measures_more(n):
    gate, clock = gate_with(n)
    regimes = simulate(gate, clock, n, 400 * n, **DRAFT_LOSES)
    late = regimes[len(regimes) // 2:]
    assert sum(late) / len(late) > 0.85  # held nearly all the time, free only in rare tries
    assert gate.snapshot()[level_of(n)]["held"] is True


@pytest.mark.parametrize("n", [2, 8, 16])
def test_it_leaves_drafting_free_where_drafting_measures_more(n):
    gate, clock = gate_with(n)
    regimes = simulate(gate, clock, n, 400 * n, **DRAFT_WINS)
    late = regimes[len(regimes) // 2:]
    assert sum(late) / len(late) < 0.15
    assert gate.snapshot()[level_of(n)]["held"] is False


def test_the_other_regime_is_tried_less_and_less_often_while_the_choice_holds():
    gate, clock = gate_with(8)
    regimes = simulate(gate, clock, 8, 8000, **DRAFT_LOSES)
    half = len(regimes) // 2
    assert changes(regimes[:half]) > changes(regimes[half:]) >= 2  # still tried now and then, but less
    assert gate.snapshot()[3]["switches"] == 1  # one switch, to held: no flapping back


def test_noise_within_the_margin_does_not_make_it_flap():
    """Both regimes measure the same goodput (2.5 tokens per request-second) with 5% noise on every
    round: the gate keeps what it has (free) and never switches back and forth."""
    gate, clock = gate_with(8)
    simulate(gate, clock, 8, 8000, free=(2.5, 1.0), held=(1.0, 0.4), noise=0.05, seed=3)
    assert gate.snapshot()[3]["switches"] <= 1


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_clear_difference_is_found_through_noise(seed):
    gate, clock = gate_with(8)
    regimes = simulate(gate, clock, 8, 6000, **DRAFT_LOSES, noise=0.2, seed=seed)
    late = regimes[len(regimes) // 2:]
    assert sum(late) / len(late) > 0.8


def test_a_request_alone_is_never_held():
    gate, clock = gate_with(1)
    regimes = simulate(gate, clock, 1, 2000, **DRAFT_LOSES)
    assert not any(regimes) and gate.snapshot() == {}


def test_free_windows_in_which_nobody_drafts_say_nothing_of_drafting():
    """The policies already draft next to nothing (a free window is a held one): never held, never
    tried, nothing measured."""
    gate, clock = gate_with(8)
    regimes = simulate(gate, clock, 8, 4000, free=(1.0, 0.4), held=(1.0, 0.3), drafts=False)
    assert not any(regimes)
    assert gate.snapshot()[3]["free"] is None and gate.snapshot()[3]["held_goodput"] is None


def test_a_heavier_load_starts_held_where_a_lighter_one_measured_held():
    gate, clock = gate_with(2)
    simulate(gate, clock, 2, 1000, **DRAFT_LOSES)
    assert gate.snapshot()[1]["held"] is True
    for _ in range(6):  # the load rises to 8
        gate.enter()
    regimes = simulate(gate, clock, 8, 400, **DRAFT_LOSES)
    assert 3 in gate.snapshot()
    # the load's first rounds at 8 ran held (then each level it passes through tries free once)
    assert all(regimes[:16])
    fresh, clock = gate_with(8)  # where nothing lighter was measured, the first window is free
    assert not any(simulate(fresh, clock, 8, 30, **DRAFT_LOSES))


def test_a_lighter_load_is_not_held_by_what_a_heavier_one_measured():
    gate, clock = gate_with(8)
    simulate(gate, clock, 8, 3000, **DRAFT_LOSES)
    assert gate.snapshot()[3]["held"] is True
    for _ in range(6):  # the load falls to 2, where drafting wins
        gate.leave()
    regimes = simulate(gate, clock, 2, 1000, **DRAFT_WINS)
    late = regimes[len(regimes) // 2:]
    assert sum(late) / len(late) < 0.15


def test_disabled_it_never_holds():
    clock = Clock()
    gate = LoadGate(clock=clock, enabled=False)
    for _ in range(8):
        gate.enter()
    assert not any(simulate(gate, clock, 8, 4000, **DRAFT_LOSES))


def test_levels_are_powers_of_two_around_the_mean_load():
    assert level_of(1.0) == 0 and level_of(1.3) == 0
    assert level_of(2.0) == 1 and level_of(7.6) == 3 and level_of(8.0) == 3 and level_of(16.5) == 4



def test_the_only_request_left_is_not_held_at_a_level_that_holds():
    gate, clock = gate_with(8)
    simulate(gate, clock, 8, 3000, **DRAFT_LOSES)
    assert gate.snapshot()[3]["held"]
    gate.held = True  # (the current window runs held: not in a try of free)
    for _ in range(6):
        gate.leave()
    assert gate.running == 2 and gate.holds()
    gate.leave()
    assert gate.running == 1 and not gate.holds()
