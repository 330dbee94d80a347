"""crossdraft.runtime.graphs: batched forwards padded to shape buckets and replayed from captured graphs.

No GPU runs here, so no CUDA graph is captured in these tests: ``backend="emulate"`` runs the
same path -- the batch padded to its bucket (rows, tokens per row, context), the index tensors
copied into the bucket's own static buffers, the decoder run on those buffers, the first replay
checked against the eager forward -- with the eager call standing in for the graph replay. What
they check is what padding must not change: every real row's logits equal those of the unpadded
eager forward (fp32, within 1e-5) and of the model run alone (1e-4), across rollbacks and past a
sliding window; and that a capture that fails or a replay that differs turns graphs off and
still answers right.
"""

from __future__ import annotations

import pytest
import torch

from crossdraft.runtime import graphs as G
from crossdraft.runtime.batching import BatchConfig, BatchScheduler, KVSlot
from crossdraft.runtime.kvpool import KVPool, Row, batched_forward
from tests.unit.runtime.test_kvpool import VOCAB, _build, _ref, _toks

_models: dict = {}


@pytest.fixture(params=["qwen2-eager", "gemma3"])
def model(request):
    if request.param not in _models:
        _models[request.param] = _build(request.param)
    return _models[request.param]


def _pools(model):
    return (KVPool(model, max_tokens=2048, block_size=16), KVPool(model, max_tokens=2048, block_size=16))


def test_padded_buckets_give_the_eager_logits_across_rounds_and_rollbacks(model):
    """Five sessions of 3..70 tokens (past the 8-token sliding window), then rounds of 1-9 tokens
    per session with rejected drafts rolled back: the bucketed forward (3 rows -> 4, 5 -> 8; 3
    tokens -> 4; context -> 256) gives the eager forward's logits, and both the model's alone."""
    eager_pool, graph_pool = _pools(model)
    fg = G.ForwardGraphs(model, graph_pool, backend="emulate")
    g = torch.Generator().manual_seed(7)
    seqs = [_toks(g, n) for n in (3, 17, 40, 9, 70)]
    hs = {}
    for pool in (eager_pool, graph_pool):
        hs[id(pool)] = [pool.alloc() for _ in seqs]
    # prefill: long rows (over 16 tokens) fit no bucket and run eagerly
    for pool, gr in ((eager_pool, None), (graph_pool, fg)):
        batched_forward(model, pool, [Row(h, 0, s) for h, s in zip(hs[id(pool)], seqs, strict=True)], graphs=gr)
    assert fg.stats.eager == 1 and fg.stats.replays == 0
    for rnd in range(4):
        active = [i for i in range(len(seqs)) if (i + rnd) % 3 != 0]  # a changing subset of sessions
        rows_e, rows_g, starts = [], [], []
        for i in active:
            rollback = (rnd % 2) * min(2, len(seqs[i]) - 1)  # every other round: 2 drafts were rejected
            start = len(seqs[i]) - rollback
            seqs[i] = seqs[i][:start] + _toks(g, 1 + (i + rnd) % 9)
            feed = seqs[i][start:]
            rows_e.append(Row(hs[id(eager_pool)][i], start, feed, keep=len(feed)))
            rows_g.append(Row(hs[id(graph_pool)][i], start, feed, keep=len(feed)))
            starts.append(start)
        before = fg.stats.replays
        out_e = batched_forward(model, eager_pool, rows_e)
        out_g = batched_forward(model, graph_pool, rows_g, graphs=fg)
        assert fg.stats.replays == before + 1, "a batch of <= 9 tokens per row fits a bucket"
        for i, st, oe, og in zip(active, starts, out_e, out_g, strict=True):
            torch.testing.assert_close(og, oe, atol=1e-5, rtol=0)
            torch.testing.assert_close(og, _ref(model, seqs[i], range(st, len(seqs[i]))), atol=1e-4, rtol=0)
            assert graph_pool.length(hs[id(graph_pool)][i]) == len(seqs[i])
    assert not fg.stats.disabled
    shapes = set(fg.stats.buckets)
    assert all(b in G.ROW_BUCKETS and t in G.TOKEN_BUCKETS and c == 256 for b, t, c in shapes), shapes
    assert fg.stats.captures == len(shapes) and len(shapes) < 4 * 2  # captured once per bucket, reused


def test_buckets_round_up_and_large_batches_run_eagerly(model):
    _, pool = _pools(model)
    fg = G.ForwardGraphs(model, pool, backend="emulate", rows=(1, 2, 4), tokens=(1, 4), contexts=(64, 128))
    assert fg.bucket(3, 2, 65) == (4, 4, 128)
    assert fg.bucket(1, 1, 1) == (1, 1, 64)
    assert fg.bucket(5, 1, 10) is None and fg.bucket(1, 5, 10) is None and fg.bucket(1, 1, 129) is None
    assert fg.stats.eager == 3


def test_a_capture_that_fails_turns_graphs_off_and_the_forward_runs_eagerly(model, monkeypatch):
    eager_pool, pool = _pools(model)
    fg = G.ForwardGraphs(model, pool, backend="emulate")
    g = torch.Generator().manual_seed(3)
    seq = _toks(g, 12)
    he, hg = eager_pool.alloc(), pool.alloc()
    want = batched_forward(model, eager_pool, [Row(he, 0, seq, keep=12)])

    def broken(self, shape):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(G.ForwardGraphs, "_capture", broken)
    got = batched_forward(model, pool, [Row(hg, 0, seq, keep=12)], graphs=fg)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
    assert fg.stats.disabled.startswith("bucket (1, 16, 256): RuntimeError") and not fg.enabled
    assert fg.bucket(1, 1, 20) is None  # off for good: later batches run eagerly


def test_a_replay_that_differs_from_the_eager_forward_is_not_used(model, monkeypatch):
    """The first replay of each graph is checked: a graph that computes something else (a capture
    gone wrong) is dropped, graphs go off, and the batch gets the eager forward's logits."""
    eager_pool, pool = _pools(model)
    fg = G.ForwardGraphs(model, pool, backend="emulate")
    real_capture = G.ForwardGraphs._capture

    def skewed(self, shape):
        c = real_capture(self, shape)
        inner = c.graph
        c.graph = lambda: inner() + 0.5
        return c

    monkeypatch.setattr(G.ForwardGraphs, "_capture", skewed)
    g = torch.Generator().manual_seed(5)
    seq = _toks(g, 6)
    he, hg = eager_pool.alloc(), pool.alloc()
    want = batched_forward(model, eager_pool, [Row(he, 0, seq, keep=6)])
    got = batched_forward(model, pool, [Row(hg, 0, seq, keep=6)], graphs=fg)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
    assert "differs from the eager forward" in fg.stats.disabled and fg.stats.replays == 0


def test_the_scheduler_uses_graphs_when_asked_and_not_by_default_on_cpu(model):
    """BatchConfig.cuda_graphs: None (default) is off on a CPU device; True on a CPU runs the
    bucketed path (emulated: there is nothing to capture); rows are bucketed up to max_rows."""
    pool = KVPool(model, max_tokens=1024, block_size=16)
    off = BatchScheduler(model, pool, BatchConfig())
    on = BatchScheduler(model, KVPool(model, max_tokens=1024, block_size=16),
                        BatchConfig(cuda_graphs=True, max_rows=24))
    try:
        assert off.graphs is None
        assert on.graphs is not None and on.graphs.backend == "emulate" and on.graphs.rows == (1, 2, 4, 8, 16, 24)
        slot = KVSlot()
        seq = list(range(5, 5 + 10))
        on.forward(slot, 0, seq, 1, None)
        out2, _ = on.forward(slot, 10, [7, 8], 2, None)
        assert on.graphs.stats.replays == 2 and not on.graphs.stats.disabled
        torch.testing.assert_close(out2, _ref(model, seq + [7, 8], [10, 11]), atol=1e-4, rtol=0)
        assert max(seq) < VOCAB
    finally:
        off.close()
        on.close()
    with pytest.raises(ValueError):
        G.ForwardGraphs(model, pool, backend="cuda")  # the pool is on the CPU


def test_the_model_server_flag_and_its_environment_variable(monkeypatch):
    """--cuda-graphs auto|on|off (CROSSDRAFT_CUDA_GRAPHS, the chart's batching.cudaGraphs) reaches
    the worker's BatchConfig: auto = None (on for a CUDA device)."""
    from crossdraft.serving import modelserver

    def cfg(*extra):
        p = modelserver.argparse.ArgumentParser()
        modelserver.add_arguments(p, 50052)
        return modelserver.batch_config(modelserver.config_from_args(p.parse_args(["--model", "x", *extra])))

    assert cfg().cuda_graphs is None
    assert cfg("--cuda-graphs", "on").cuda_graphs is True and cfg("--cuda-graphs", "off").cuda_graphs is False
    monkeypatch.setenv("CROSSDRAFT_CUDA_GRAPHS", "off")
    assert cfg().cuda_graphs is False
    with pytest.raises(SystemExit):
        cfg("--cuda-graphs", "maybe")
