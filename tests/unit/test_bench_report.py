"""benchmarks/bench.py's report: with --paired, a prompt's ratio is the median over the repeats of
each run's speed over its own neighbouring target-only run, not a ratio of two medians taken
minutes apart (on a shared machine whose speed drifts, the latter can read 0.66x for a run whose
neighbours say 1.0x). Synthetic rows: the report's arithmetic, not a benchmark."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmarks" / "bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _rows(paired: bool):
    ids = list(range(48))
    # the machine sped up between the target-only runs: 11 s, then 7 s
    target = {"mode": "greedy", "method": "target-only", "drafter": None,
              "runs": [{"prompt": 0, "tokens": 48, "seconds": 7.0, "token_ids": ids, "repeat_seconds": [11.0, 7.0]}]}
    run = {"prompt": 0, "tokens": 48, "seconds": 9.0, "token_ids": ids, "drafted": 6, "accepted": 0}
    if paired:  # each crossdraft run beside its own target-only run: 10 s vs 10.5 s, then 8.5 s vs 8 s
        run.update(paired_target=[48, 8.0], paired_ratios=[round(10.0 / 10.5, 4), round(8.5 / 8.0, 4),
                                                           round(9.0 / 9.0, 4)])
    cd = {"mode": "greedy", "method": "crossdraft", "drafter": "d", "runs": [run]}
    return {("greedy", "target-only", None): target, ("greedy", "crossdraft", "d"): cd}


def test_paired_runs_report_the_median_of_neighbours_ratios():
    plain = bench.ratio_lines(_rows(False), ["x"])[-1]
    assert "| 0.78x (0/6) |" in plain  # 7 s / 9 s: the medians of runs minutes apart
    paired = bench.ratio_lines(_rows(True), ["x"])[-1]
    assert "| 1.00x (0/6) |" in paired  # the median of 0.95, 1.06, 1.00
    assert "| 1.00x | 1/1 |" in paired  # all: each prompt at its median ratio, weighed by its target time
    row = next(r for r in bench.summarize(_rows(True)) if r["method"] == "crossdraft")
    assert row["paired_median_ratios"] == [1.0] and row["speedup_vs_target_only"] == pytest.approx(1.0, abs=1e-3)
    plain_row = next(r for r in bench.summarize(_rows(False)) if r["method"] == "crossdraft")
    assert plain_row["speedup_vs_target_only"] == pytest.approx(7 / 9, abs=1e-3)


def test_a_runs_paired_ratio():
    assert bench._paired_ratio({"tokens": 48, "seconds": 6.0, "paired_target": [48, 9.0]}) == pytest.approx(1.5)
    nan = bench._paired_ratio({"tokens": 0, "seconds": 6.0, "paired_target": [48, 9.0]})
    assert nan != nan
