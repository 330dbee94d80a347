"""The `crossdraft` CLI verbs other than generate, run as real subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real_models


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "crossdraft.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_vocab_json_reports_sizes_and_coverage():
    r = _cli("vocab", "--target", "qwen2.5-coder-0.5b", "--drafter", "smollm2-135m", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["target_vocab_size"] == 151936 and rep["drafter_vocab_size"] == 49152
    assert 30_000 < rep["intersection_size"] < 49152
    assert rep["drafter_coverage"] == pytest.approx(rep["intersection_size"] / 49152, rel=0.01)
    assert 0 < rep["target_coverage"] < rep["drafter_coverage"]


def test_models_list_path_and_errors():
    r = _cli("models", "list", "--json")
    assert r.returncode == 0, r.stderr
    names = {m["name"] for m in json.loads(r.stdout)}
    assert names == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    r = _cli("models", "path", "smollm2-135m")
    assert r.returncode == 0 and r.stdout.strip().endswith("smollm2-135m")
    for verb in ("pull", "path"):
        r = _cli("models", verb, "no-such-model")
        assert r.returncode == 2 and "unknown model 'no-such-model'" in r.stderr and "Traceback" not in r.stderr
