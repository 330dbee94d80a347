"""The draft-length policy replayed on recorded greedy acceptance traces (deterministic, no timing).

tests/data/traces/qwen-0.5b-for-1.5b.json holds, for 16 prompts (8 HumanEval, 8 code/prose/SQL/
Chinese), whether qwen2.5-coder-0.5b's argmax matched qwen2.5-coder-1.5b's greedy token at each of
64 positions and how sure the drafter was, plus both models' forward-cost tables as measured on
the recording machine (benchmarks/policy_replay.py records and replays them). The replay drives
DraftPolicy exactly as the round loop does and prices each round with those tables, so these
tests check the policy's choices -- not this machine's speed -- and fail if a change makes it
draft worse.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest

from crossdraft.policy import DraftConfig

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("policy_replay", ROOT / "benchmarks" / "policy_replay.py")
replay = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replay)


@pytest.fixture(scope="module")
def data():
    return json.loads((ROOT / "tests" / "data" / "traces" / "qwen-0.5b-for-1.5b.json").read_text())


def _both(data, c=None):
    dm, tm = data["drafter_ms"], data["target_ms"]
    if c is not None:
        dm = replay.scaled(dm, tm, c)
    conf = replay.summary(data["traces"], DraftConfig(), dm, tm, confident=True)
    per_round = replay.summary(data["traces"], replace(DraftConfig(), stop_cumulative=0.0), dm, tm, confident=False)
    return conf, per_round


def test_the_recorded_pair_gains_from_confident_blocks(data):
    """At the recorded costs (a drafter step = 0.45 target steps) the default greedy policy reaches
    1.45x target-only over the 16 prompts, 5% more than choosing k per round from the acceptance
    model, and no prompt -- the Chinese ones included -- falls below 0.95x."""
    conf, per_round = _both(data)
    assert conf["gmean"] >= 1.45, conf["gmean"]
    assert conf["gmean"] >= 1.05 * per_round["gmean"], (conf["gmean"], per_round["gmean"])
    assert conf["min"] >= 0.95, [round(r["speedup"], 3) for r in conf["runs"]]


@pytest.mark.parametrize("c", [0.15, 0.3, 0.6, 0.8])
def test_confident_blocks_never_lose_to_the_per_round_policy_whatever_the_drafter_costs(data, c):
    conf, per_round = _both(data, c)
    assert conf["gmean"] >= 0.99 * per_round["gmean"], (conf["gmean"], per_round["gmean"])
    assert conf["min"] >= 0.95, [round(r["speedup"], 3) for r in conf["runs"]]


def test_a_drafter_as_costly_as_the_target_drafts_little(data):
    """No acceptance makes such a drafter pay; what it still drafts is each request's first block
    (it measures the text) and probes at their slowest pace, even when a probe is wholly accepted
    (with a full-pace reset, as for a drafter that can pay, this pair drafted 193 tokens)."""
    conf, _ = _both(data, 1.0)
    tokens = sum(len(t["match"]) for t in data["traces"])
    assert conf["drafted"] <= 0.18 * tokens, conf["drafted"]
    assert conf["min"] >= 0.9 and conf["gmean"] >= 0.97, (conf["gmean"], conf["min"])


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
