"""Batched model servers on real catalog models: 8 clients at once get the tokens they get alone.

smollm2-135m drafts (different vocabularies) for gemma3-270m (sliding-window layers, 262k vocab)
and for qwen2.5-coder-0.5b, each model in its own process with batching on (the default), fp32,
behind a real gateway and Redis. The same 8 prompts run first one at a time, then all at once
through gRPC clients in 8 threads: greedy token ids must be identical, and the verifier must have
run forwards holding more than one session (its Prometheus histogram of rows per forward), and every
drafted round must say with how many rows the drafter's steps ran (DraftToken.batch_rows, the gateway's
round log).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from crossdraft.client import Client
from tests.integration.conftest import start_stack

pytestmark = pytest.mark.real_models

DRAFTER = "smollm2-135m"
PROMPTS = ["def fibonacci(n):\n", "The three primary colors are", "SELECT name FROM users WHERE",
           "请用中文回答：天空为什么是蓝色的？", "import numpy as np\n\ndef softmax(x):\n",
           "Once upon a time, in a small village,", "class Stack:\n    def __init__(self):\n",
           "The capital of France is"]
N = 10  # tokens per request: enough for several shared batches of drafts per session


@pytest.fixture(scope="module", params=["gemma3-270m", "qwen2.5-coder-0.5b"])
def stack(request, tmp_path_factory):
    """The qwen target's stack is the package's shared one (tests/integration/conftest.py); the
    gemma one lives for this module. Both run with static costs: with measured costs eight fp32
    sessions on a CPU would (rightly) stop drafting, and shared batches of drafts are what is tested."""
    if request.param == "qwen2.5-coder-0.5b":
        yield request.getfixturevalue("qwen_stack")
    else:
        yield from start_stack(request.param, DRAFTER, tmp_path_factory.mktemp("batched-real"), [])


def _generate(addr, prompt, **options):
    with Client(addr) as c:
        return c.generate(prompt, max_new_tokens=N, **options)


def _rows_histogram(metrics_url) -> tuple[float, float]:
    """(forwards, rows) the verifier has run so far, from crossdraft_verifier_batch_rows."""
    text = requests.get(metrics_url, timeout=10).text
    vals = {}
    for line in text.splitlines():
        for k in ("crossdraft_verifier_batch_rows_count", "crossdraft_verifier_batch_rows_sum"):
            if line.startswith(k + " "):
                vals[k] = float(line.split()[1])
    return vals["crossdraft_verifier_batch_rows_count"], vals["crossdraft_verifier_batch_rows_sum"]


def test_eight_concurrent_clients_get_the_tokens_they_get_alone(stack):
    addr, metrics = stack.grpc, stack.metrics
    alone = [_generate(addr, p) for p in PROMPTS]
    assert all(len(r.token_ids) > 0 for r in alone)
    f0, r0 = _rows_histogram(metrics)
    # one at a time: every forward held one session (the shared stack's earlier users send one
    # request at a time too, so its counters from before this test hold one session per forward)
    assert r0 == f0 > 0
    # together, with fixed blocks of 4 (the greedy text does not depend on the blocks drafted)
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        together = list(ex.map(lambda p: _generate(addr, p, adaptive_draft=False, num_draft_tokens=4), PROMPTS))
    for p, a, t in zip(PROMPTS, alone, together, strict=True):
        assert t.token_ids == a.token_ids, p
    assert sum(r.stats["drafted"] for r in together) > 0
    f1, r1 = _rows_histogram(metrics)
    assert r1 - r0 > f1 - f0  # some forwards verified several sessions at once
    # the drafter reports each step's batch over the wire: at least its own row, at most the 8 sessions
    with open(stack.rounds) as f:  # (whole lines: the gateway's writer may be mid-line)
        lines = [json.loads(line) for line in f.read().rpartition("\n")[0].splitlines()]
    rows = [r["draft_batch_rows"] for r in lines if r.get("drafted", 0) > 0]
    assert rows and all(1 <= x <= len(PROMPTS) for x in rows)
    # fixed blocks went to the verifier with the blocks drafted beside them (crossdraft.decoding.gang): some
    # with others, at most the 8 sessions at once; rounds that drafted nothing went alone, without waiting
    gangs = [(r["gang"], r["gang_wait_s"], r["requested"]) for r in lines if "round" in r]
    assert all(1 <= g <= len(PROMPTS) and w >= 0 for g, w, _ in gangs)
    assert all(g == 1 and w == 0 for g, w, k in gangs if k == 0)
    assert any(g >= 2 for g, _, k in gangs if k > 0)
