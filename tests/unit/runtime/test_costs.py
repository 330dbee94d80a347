"""Measured forward costs (crossdraft.runtime.costs) and the policy's choice of measured vs static costs."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from crossdraft.decoding.policy import DraftPolicy
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.engine import DraftConfig, Engine
from crossdraft.runtime import costs
from crossdraft.runtime.workers import DrafterWorker, VerifierWorker
from crossdraft.serving import wire
from tests.tiny_models import tiny_lm
from tests.tokenizers_fixtures import bytelevel_bpe_tokenizer, sentencepiece_like_tokenizer


@pytest.fixture(scope="module")
def pair():
    return tiny_lm(bytelevel_bpe_tokenizer(), seed=1, arch="qwen2"), tiny_lm(sentencepiece_like_tokenizer(), seed=2)


def test_measure_gives_a_non_decreasing_table(pair):
    target, _ = pair
    table = costs.measure(target.model, target.device, 13, reps=1)
    assert len(table) == 13 and all(t > 0 for t in table)
    assert all(b >= a for a, b in itertools.pairwise(table))


@pytest.mark.parametrize("kind", ["verifier", "drafter"])
def test_the_tables_time_the_large_forwards_a_catch_up_or_a_batch_runs(pair, monkeypatch, kind):
    """A model server's table ends on a forward it timed (not extrapolated from small ones, where
    bf16 on a CPU is flat), and between two timed sizes it interpolates over at most a doubling of
    tokens. The drafter's timed forwards reach a catch-up after the longest run of skipped rounds
    between two probes (one token a round at least), so that catch-up is priced from what such a
    forward measured."""
    monkeypatch.setenv("CROSSDRAFT_COST_PROFILE", "measure")
    target, drafter = pair
    worker = VerifierWorker(target) if kind == "verifier" else DrafterWorker(drafter)
    model = worker.loaded.model
    fed = []
    hook = model.register_forward_pre_hook(lambda mod, args, kw: fed.append(kw["input_ids"].shape[1]),
                                           with_kwargs=True)
    try:
        table = worker.timings()
    finally:
        hook.remove()
    context, fed = fed[0], fed[1:]  # (the context is cached once, before the timed forwards)
    assert context == costs.CONTEXT
    timed = sorted(set(fed))
    assert table and timed[-1] == len(table)
    assert timed[0] == 1 and all(b <= 2 * a for a, b in itertools.pairwise(timed)), timed
    # every timed size: a warm-up and then as many timed forwards as every other size
    assert len({fed.count(m) for m in timed}) == 1 and fed.count(timed[0]) >= 2
    if kind == "drafter":
        assert timed[-1] >= DraftPolicy.max_probe_every


def test_table_is_cached_on_disk_per_model_file(pair, tmp_path, monkeypatch):
    target, _ = pair
    monkeypatch.setenv("CROSSDRAFT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CROSSDRAFT_COST_PROFILE", "measure")
    f = tmp_path / "model.gguf"
    f.write_bytes(b"weights")
    loaded = SimpleNamespace(model=target.model, device=target.device, dtype=torch.float32, path=f)
    first = costs.forward_ms(loaded, 5)
    assert len(first) == 5 and list((tmp_path / "home" / "costs").glob("*.json"))
    monkeypatch.setattr(costs, "measure", lambda *a, **k: pytest.fail("measured again instead of reading the cache"))
    monkeypatch.setattr(costs, "quick_ms", lambda *a, **k: first[0])  # this start is no faster than the cache says
    assert costs.forward_ms(loaded, 5) == first
    f.write_bytes(b"other weights, other size")  # another model file: another key
    with pytest.raises(pytest.fail.Exception):
        costs.forward_ms(loaded, 5)


def test_a_table_measured_on_a_busy_machine_is_measured_again_and_the_minimum_kept(pair, tmp_path, monkeypatch):
    """A cached table that a start's quick one-token timing shows to be too slow (measured while the
    machine was busy) is re-measured; the cache then holds the minimum of both, size by size."""
    target, _ = pair
    monkeypatch.setenv("CROSSDRAFT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CROSSDRAFT_COST_PROFILE", "measure")
    f = tmp_path / "model.gguf"
    f.write_bytes(b"weights")
    loaded = SimpleNamespace(model=target.model, device=target.device, dtype=torch.float32, path=f)
    busy = [100.0, 110.0, 120.0, 130.0, 140.0]
    monkeypatch.setattr(costs, "measure", lambda *a, **k: list(busy))
    assert costs.forward_ms(loaded, 5) == busy  # first start: measured while busy, cached
    calm = [50.0, 50.0, 200.0, 60.0, 70.0]  # the calm run is faster except where the busy one was
    monkeypatch.setattr(costs, "measure", lambda *a, **k: list(calm))
    monkeypatch.setattr(costs, "quick_ms", lambda *a, **k: 55.0)  # < 0.8 x 100: the cache is too slow
    want = [50.0, 50.0, 120.0, 120.0, 120.0]  # the minimum of both, made non-decreasing
    assert costs.forward_ms(loaded, 5) == want
    monkeypatch.setattr(costs, "measure", lambda *a, **k: pytest.fail("measured again"))
    monkeypatch.setattr(costs, "quick_ms", lambda *a, **k: 90.0)  # a slow start now: keep the cache
    assert costs.forward_ms(loaded, 5) == want
    assert costs.quick_ms(target.model, target.device) > 0  # the real quick timing runs


def test_static_profile_turns_measuring_off(pair, monkeypatch):
    monkeypatch.setenv("CROSSDRAFT_COST_PROFILE", "static")
    target, _ = pair
    loaded = SimpleNamespace(model=target.model, device=target.device, dtype=torch.float32, path=None)
    assert costs.forward_ms(loaded, 5) == []


def test_model_info_carries_the_table():
    info = dict(model_name="m", vocab_size=10, tokenizer_digest="d", dtype="float32", device="cpu", body_bytes=1,
                head_row_bytes=2, max_context_tokens=3, eos_token_ids=[1], max_sessions=4, active_sessions=0,
                instance_id="i", forward_ms=[1.5, 2.25, 4.0])
    back = wire.model_info_from_proto(wire.model_info_to_proto(info))
    assert back["forward_ms"] == [1.5, 2.25, 4.0]


@pytest.mark.parametrize("profile", ["measure", "static"])
def test_greedy_uses_measured_costs_sampling_static(pair, tmp_path, monkeypatch, profile):
    monkeypatch.setenv("CROSSDRAFT_COST_PROFILE", profile)
    target, drafter = pair
    eng = Engine(target, drafter, vocab_cache_dir=tmp_path)
    prompt = "def add(a, b):\n    return"
    ref = eng.generate(prompt, max_new_tokens=30, use_drafter=False)
    out = eng.generate(prompt, max_new_tokens=30)
    assert out.token_ids == ref.token_ids  # whatever k the costs pick, greedy is the target's output
    assert out.stats.cost_model == ("measured" if profile == "measure" else "static")
    assert eng.verifier.info()["forward_ms"] == ([] if profile == "static" else eng.verifier.timings())
    s1 = eng.generate(prompt, max_new_tokens=20, params=SamplingParams(temperature=0.9), seed=4)
    s2 = eng.generate(prompt, max_new_tokens=20, params=SamplingParams(temperature=0.9), seed=4)
    assert s1.stats.cost_model == "static" and s1.token_ids == s2.token_ids
    forced = eng.generate(prompt, max_new_tokens=20, params=SamplingParams(temperature=0.9), seed=4,
                          draft=DraftConfig(cost_model="measured"))
    assert forced.stats.cost_model == ("measured" if profile == "measure" else "static")


_CHILD = """
import sys, torch
from crossdraft.runtime import costs
with costs.cpu_startup_lock(torch.device('cpu'), timeout_s=float(sys.argv[1])) as held:
    print('held' if held else 'not held')
"""


def _child_lock(tmp_path, timeout_s: float) -> str:
    import os
    import subprocess
    import sys

    env = dict(os.environ, TMPDIR=str(tmp_path))
    return subprocess.run([sys.executable, "-c", _CHILD, str(timeout_s)], env=env, capture_output=True, text=True,
                          timeout=120, check=True).stdout.strip()


def test_cpu_model_servers_load_and_time_one_at_a_time(tmp_path, monkeypatch):
    """Two processes on one machine: while one holds the startup lock (loading and timing its
    model), the other waits -- and after its timeout goes on without it (never a hang)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert _child_lock(tmp_path, 30) == "held"  # nobody else: it gets the lock
    with costs.cpu_startup_lock(torch.device("cpu")) as held:
        assert held
        assert _child_lock(tmp_path, 0.5) == "not held"  # busy: it waited 0.5 s, then went on
    assert _child_lock(tmp_path, 30) == "held"  # released
    with costs.cpu_startup_lock(torch.device("meta")) as held:  # not a CPU: no lock at all
        assert held is False
