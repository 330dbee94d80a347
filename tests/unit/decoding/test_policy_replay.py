"""The draft-length policy replayed on recorded greedy acceptance traces (deterministic, no timing).

tests/data/traces/qwen-0.5b-for-1.5b.json holds, for 16 prompts (8 HumanEval, 8 code/prose/SQL/
Chinese), whether qwen2.5-coder-0.5b's argmax matched qwen2.5-coder-1.5b's greedy token at each of
64 positions and how sure the drafter was, plus both models' forward-cost tables as measured on
the recording machine (benchmarks/policy_replay.py records and replays them). The replay drives
DraftPolicy exactly as the round loop does and prices each round with those tables, so these
tests check the policy's choices -- not this machine's speed. They assert properties that hold
whatever the tuning: no policy beats the best block sizes chosen with hindsight, a dearer drafter
never makes the policy faster or draft more, drafting pays where the recorded pair makes it pay,
and a drafter that no acceptance could repay costs at most its probes.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from crossdraft.decoding.policy import DraftConfig, DraftPolicy

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("policy_replay", ROOT / "benchmarks" / "policy_replay.py")
replay = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replay)

# drafter step costs (in target steps) the replays sweep; the recorded pair's own lies among them
COSTS = (0.15, 0.3, 0.6, 0.8, 1.0)


@pytest.fixture(scope="module")
def data():
    return json.loads((ROOT / "tests" / "data" / "traces" / "qwen-0.5b-for-1.5b.json").read_text())


def _drafter_ms(data, c=None):
    dm, tm = data["drafter_ms"], data["target_ms"]
    return dm if c is None else replay.scaled(dm, tm, c)


def _both(data, c=None):
    dm, tm = _drafter_ms(data, c), data["target_ms"]
    conf = replay.summary(data["traces"], DraftConfig(), dm, tm, confident=True)
    per_round = replay.summary(data["traces"], replace(DraftConfig(), stop_cumulative=0.0), dm, tm, confident=False)
    return conf, per_round


def _hindsight(match: list[bool], c: float, v: list[float], hi: int) -> float:
    """The fewest target steps any choice of block sizes (0..hi each round) needs to generate the
    trace, knowing where the drafter matches; priced as the replay prices a round (k drafter steps
    of c, a verification of k + 1 tokens from the table v, in target steps)."""
    n = len(match)
    run = [0] * (n + 1)  # run[i]: the drafter's consecutive matches from position i on
    for i in range(n - 1, -1, -1):
        run[i] = run[i + 1] + 1 if match[i] else 0

    @functools.cache
    def best(i: int) -> float:
        if i >= n:
            return 0.0
        return min(k * c + v[min(k + 1, len(v)) - 1] + best(i + min(k, run[i]) + 1)
                   for k in range(min(hi, n - i - 1) + 1))

    return best(0)


@pytest.mark.parametrize("c", [None, *COSTS])
def test_no_prompt_beats_the_block_sizes_chosen_with_hindsight(data, c):
    """Each prompt's replayed speedup is at most what the best block sizes for that very trace give
    at the same prices: a replay that credited drafts past a mismatch, or priced a round below its
    forwards, would break this bound."""
    dm, tm = _drafter_ms(data, c), data["target_ms"]
    cost_c = dm[0] / tm[0]
    v = [x / tm[0] for x in tm]
    hi = DraftPolicy(DraftConfig()).hi
    conf, per_round = _both(data, c)
    for t, a, b in zip(data["traces"], conf["runs"], per_round["runs"], strict=True):
        bound = len(t["match"]) / _hindsight(t["match"], cost_c, v, hi)
        assert a["speedup"] <= bound + 1e-9 and b["speedup"] <= bound + 1e-9, (t["label"], a, b, bound)
        assert a["accepted"] <= a["drafted"] and a["accepted"] <= sum(t["match"])


def test_a_dearer_drafter_never_makes_the_policy_faster_or_draft_more(data):
    """Over drafter costs from cheap to as dear as the target, the default policy's speedup falls
    and what it drafts shrinks: it never spends more drafter steps when each costs more."""
    runs = [_both(data, c)[0] for c in COSTS]
    gm = [r["gmean"] for r in runs]
    drafted = [r["drafted"] for r in runs]
    assert all(b <= a for a, b in itertools.pairwise(gm)), gm
    assert all(b <= a for a, b in itertools.pairwise(drafted)), drafted


def test_the_recorded_pair_gains_from_confident_blocks(data):
    """At the recorded costs the default greedy policy beats target-only (1.0) over the 16 prompts,
    and beats choosing k per round from the acceptance model."""
    conf, per_round = _both(data)
    assert conf["gmean"] > 1.0, conf["gmean"]
    assert conf["gmean"] >= per_round["gmean"], (conf["gmean"], per_round["gmean"])


@pytest.mark.parametrize("c", [c for c in COSTS if c < 1.0])
def test_confident_blocks_never_lose_to_the_per_round_policy_while_drafting_can_pay(data, c):
    conf, per_round = _both(data, c)
    assert conf["gmean"] >= per_round["gmean"], (conf["gmean"], per_round["gmean"])


def test_a_drafter_as_costly_as_the_target_costs_at_most_its_probes(data):
    """A drafter step as dear as a target step: no acceptance makes a block pay (k + 1 tokens at
    best for k + 1 steps or more), so a request starts target-only and drafts only probes, at their
    slowest pace even when a probe is wholly accepted -- at most one block of the upper bound every
    ``max_probe_every`` rounds. Each such block costs at most its drafter steps and the verification
    of its tokens beyond the target-only step it replaces, and that bounds the loss per prompt."""
    conf, _ = _both(data, 1.0)
    tm = data["target_ms"]
    v = [x / tm[0] for x in tm]
    hi = DraftPolicy(DraftConfig()).hi
    c = _drafter_ms(data, 1.0)[0] / tm[0]
    worst_probe = hi * c + v[min(hi + 1, len(v)) - 1] - 1.0
    for t, r in zip(data["traces"], conf["runs"], strict=True):
        n = len(t["match"])
        probes = math.ceil(n / DraftPolicy.max_probe_every)
        assert r["drafted"] <= probes * hi, (t["label"], r)
        assert r["speedup"] >= n / (n + probes * worst_probe), (t["label"], r)


def test_the_replay_counts_what_a_fixed_block_accepts(data):
    """Negative control for the replay itself: with k fixed at 1 and no early stop, every round
    drafts one token, and it is accepted exactly where the trace says the argmax matched."""
    t = data["traces"][0]
    cfg = DraftConfig(adaptive=False, num_draft_tokens=1, stop_below=0.0)
    r = replay.replay(t, cfg, data["drafter_ms"], data["target_ms"], confident=False)
    # walk the trace: a round at position i emits 2 tokens on a match, 1 otherwise
    i = rounds = acc = 0
    while i < len(t["match"]):
        m = i < len(t["match"]) - 1 and t["match"][i]
        rounds, acc, i = rounds + 1, acc + int(m), i + (2 if m else 1)
    assert (r["rounds"], r["accepted"]) == (rounds, acc)
