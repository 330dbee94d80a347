"""crossdraft.runtime.kvpool: many sessions through ONE ragged forward, checked against one-session references.

Reference: the same model run on one session's whole sequence without a cache; its logits at the
same positions must match the batched, paged forward within 1e-4 (fp32). Tiny random-init models
(Llama, Qwen2 eager, Qwen2 with a sliding layer, Gemma-3 with sliding layers sdpa + eager).
"""

from __future__ import annotations

import pytest
import torch

from crossdraft.runtime.kvpool import KVPool, PoolFull, Row, batched_forward, new_pool_for

ATOL = 1e-4
VOCAB = 300
WINDOW = 8  # sliding window of the sliding-attention models, far below the histories used


def _build(kind: str):
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(1234)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **common, attn_implementation="sdpa"))
    elif kind == "qwen2-eager":
        model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, **common, attn_implementation="eager"))
    elif kind == "qwen2-sliding":
        model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW,
                                             max_window_layers=1, **common, attn_implementation="sdpa"))
    elif kind.startswith("gemma3"):
        cfg = Gemma3TextConfig(num_hidden_layers=3, head_dim=16, sliding_window=WINDOW,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                               final_logit_softcapping=30.0, query_pre_attn_scalar=16, **common,
                               attn_implementation="eager" if kind.endswith("eager") else "sdpa")
        model = Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # peaked distributions: logits of order 1..10, not ~0
    return model.eval()


MODELS = ["llama", "qwen2-eager", "qwen2-sliding", "gemma3", "gemma3-eager"]
_cache: dict = {}


@pytest.fixture(params=MODELS)
def model(request):
    if request.param not in _cache:
        _cache[request.param] = _build(request.param)
    return _cache[request.param]


def _ref(model, seq: list[int], positions) -> torch.Tensor:
    """Logits of the whole sequence, run alone without a cache, at `positions`."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([seq]), use_cache=False)
    return out.logits[0, list(positions)].float()


def _toks(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def _close(got: torch.Tensor, want: torch.Tensor):
    assert got.dtype == torch.float32
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def _check_rows(model, rows, outs, seqs):
    """Each row's logits equal the reference of its session's sequence `seqs[handle]` alone."""
    for r, o in zip(rows, outs, strict=True):
        end = r.start + len(r.tokens)
        _close(o, _ref(model, seqs[r.handle][:end], range(end - r.keep, end)))


def _sanity_sizes(model):
    # the sliding-window models really see histories past their window
    assert getattr(model.config, "sliding_window", None) in (None, WINDOW)


def test_prefill_one_forward_then_ragged_verify(model):
    _sanity_sizes(model)
    g = torch.Generator().manual_seed(1)
    pool = KVPool(model, max_tokens=256, block_size=4)
    hs = [pool.alloc() for _ in range(4)]
    hist = {h: _toks(g, n) for h, n in zip(hs, (5, 23, 40, 1), strict=True)}
    rows = [Row(h, 0, hist[h], keep=len(hist[h])) for h in hs]
    outs = batched_forward(model, pool, rows)
    _check_rows(model, rows, outs, hist)
    assert [pool.length(h) for h in hs] == [5, 23, 40, 1]

    # verification: blocks of 1..5 tokens, all in ONE forward
    seqs = {h: hist[h] + _toks(g, k) for h, k in zip(hs, (3, 1, 5, 4), strict=True)}
    rows = [Row(h, len(hist[h]), seqs[h][len(hist[h]):], keep=len(seqs[h]) - len(hist[h])) for h in hs]
    outs = batched_forward(model, pool, rows)
    _check_rows(model, rows, outs, seqs)
    assert [pool.length(h) for h in hs] == [len(seqs[h]) for h in hs]
    # keep < len: only the last `keep` positions come back
    more = {h: seqs[h] + _toks(g, 3) for h in hs}
    rows = [Row(h, len(seqs[h]), more[h][len(seqs[h]):], keep=k) for h, k in zip(hs, (1, 2, 3, 1), strict=True)]
    outs = batched_forward(model, pool, rows)
    assert [o.shape[0] for o in outs] == [1, 2, 3, 1]
    _check_rows(model, rows, outs, more)


def test_chunked_prefill_across_forwards(model):
    g = torch.Generator().manual_seed(2)
    pool = new_pool_for(model, max_tokens=200, block_size=4)
    hs = [pool.alloc() for _ in range(3)]
    seqs = {h: _toks(g, n) for h, n in zip(hs, (5, 23, 40), strict=True)}
    chunk = 7
    while any(pool.length(h) < len(seqs[h]) for h in hs):
        rows = []
        for h in hs:
            n = pool.length(h)
            if n < len(seqs[h]):
                piece = seqs[h][n:n + chunk]
                rows.append(Row(h, n, piece, keep=len(piece)))
        outs = batched_forward(model, pool, rows)
        _check_rows(model, rows, outs, seqs)
    # then one ragged verification over the chunk-built histories
    full = {h: seqs[h] + _toks(g, k) for h, k in zip(hs, (2, 5, 1), strict=True)}
    rows = [Row(h, len(seqs[h]), full[h][len(seqs[h]):], keep=len(full[h]) - len(seqs[h])) for h in hs]
    _check_rows(model, rows, batched_forward(model, pool, rows), full)


def test_rollback_then_different_tokens(model):
    g = torch.Generator().manual_seed(3)
    pool = KVPool(model, max_tokens=256, block_size=4)
    hs = [pool.alloc() for _ in range(3)]
    hist = {h: _toks(g, n) for h, n in zip(hs, (6, 21, 33), strict=True)}
    batched_forward(model, pool, [Row(h, 0, hist[h]) for h in hs])
    drafts = {h: _toks(g, 9) for h in hs}
    rows = [Row(h, len(hist[h]), drafts[h], keep=9) for h in hs]
    batched_forward(model, pool, rows)
    used = pool.blocks_used
    # rejected drafts: h0 keeps 1 draft (explicit truncate), h1 none (explicit), h2 keeps 4 (implicit,
    # through Row.start < length)
    pool.truncate(hs[0], len(hist[hs[0]]) + 1)
    pool.truncate(hs[1], len(hist[hs[1]]))
    assert pool.length(hs[0]) == len(hist[hs[0]]) + 1 and pool.length(hs[1]) == len(hist[hs[1]])
    assert pool.blocks_used < used
    kept = {hs[0]: 1, hs[1]: 0, hs[2]: 4}
    seqs = {h: hist[h] + drafts[h][:kept[h]] + _toks(g, 4) for h in hs}
    rows = [Row(h, len(hist[h]) + kept[h], seqs[h][len(hist[h]) + kept[h]:], keep=4) for h in hs]
    outs = batched_forward(model, pool, rows)
    _check_rows(model, rows, outs, seqs)
    assert pool.length(hs[2]) == len(seqs[hs[2]])
    # roll far back (past the sliding window), refeed, still exact
    seqs2 = {h: seqs[h][:3] + _toks(g, 12) for h in hs}
    rows = [Row(h, 3, seqs2[h][3:], keep=12) for h in hs]
    used = pool.blocks_used
    _check_rows(model, rows, batched_forward(model, pool, rows), seqs2)
    assert pool.blocks_used < used
    # free returns everything
    for h in hs:
        pool.free(h)
    assert pool.blocks_used == 0 and pool.handles == 0 and pool.occupancy == 0.0


def test_pruned_head(model):
    g = torch.Generator().manual_seed(4)
    pool = KVPool(model, max_tokens=128, block_size=8)
    hs = [pool.alloc() for _ in range(3)]
    seqs = {h: _toks(g, n) for h, n in zip(hs, (4, 17, 30), strict=True)}
    batched_forward(model, pool, [Row(h, 0, seqs[h][:-3]) for h in hs])
    rows = [Row(h, len(seqs[h]) - 3, seqs[h][-3:], keep=3) for h in hs]
    cols = torch.tensor([0, 7, 42, 299, 150])
    w = model.lm_head.weight.detach()[cols]
    outs = batched_forward(model, pool, rows, head=w)
    for r, o in zip(rows, outs, strict=True):
        assert o.shape == (3, len(cols))
        _close(o, _ref(model, seqs[r.handle], range(len(seqs[r.handle]) - 3, len(seqs[r.handle])))[:, cols])
    # per-row heads, one row on the full head
    for h in hs:
        pool.truncate(h, len(seqs[h]) - 3)
    cols2 = torch.tensor([5, 6])
    heads = [w, None, model.lm_head.weight.detach()[cols2]]
    outs = batched_forward(model, pool, rows, head=heads)
    for r, o, c in zip(rows, outs, (cols, None, cols2), strict=True):
        want = _ref(model, seqs[r.handle], range(len(seqs[r.handle]) - 3, len(seqs[r.handle])))
        _close(o, want if c is None else want[:, c])
    with pytest.raises(ValueError):
        batched_forward(model, pool, rows, head=[w])


def test_pool_full_leaves_state_unchanged(model):
    g = torch.Generator().manual_seed(5)
    pool = KVPool(model, max_tokens=32, block_size=4)  # 8 blocks
    assert pool.blocks_total == 8 and pool.tokens_capacity == 32
    a, b = pool.alloc(), pool.alloc()
    seq_a = _toks(g, 18)
    batched_forward(model, pool, [Row(a, 0, seq_a[:13])])  # 4 blocks
    assert pool.blocks_used == 4
    with pytest.raises(PoolFull):
        batched_forward(model, pool, [Row(a, 13, seq_a[13:]), Row(b, 0, _toks(g, 16))])  # 1 + 4 > 4 free
    assert pool.blocks_used == 4 and pool.length(a) == 13 and pool.length(b) == 0
    assert pool.block_table(b) == []
    with pytest.raises(PoolFull):
        pool.ensure(b, 17)
    assert pool.blocks_used == 4 and pool.block_table(b) == []
    pool.ensure(b, 16)  # exactly the 4 free blocks
    assert pool.blocks_used == 8 and pool.occupancy == 1.0
    pool.truncate(b, 0)
    assert pool.blocks_used == 4
    # a rollback in the same batch frees the blocks another row needs: allowed
    seq_b = _toks(g, 16)
    rows = [Row(a, 1, seq_a[1:4], keep=3), Row(b, 0, seq_b, keep=2)]
    outs = batched_forward(model, pool, rows)
    _check_rows(model, rows, outs, {a: seq_a, b: seq_b})
    # the pool still serves correct logits after the failures
    pool.truncate(b, 0)
    rows = [Row(a, 4, seq_a[4:18], keep=14)]
    _check_rows(model, rows, batched_forward(model, pool, rows), {a: seq_a})


def test_bad_rows():
    model = _cache.get("llama") or _build("llama")
    pool = KVPool(model, max_tokens=64)
    h = pool.alloc()
    batched_forward(model, pool, [Row(h, 0, [1, 2, 3])])
    with pytest.raises(ValueError):
        batched_forward(model, pool, [Row(h, 3, [4]), Row(h, 3, [5])])
    with pytest.raises(ValueError):
        batched_forward(model, pool, [Row(h, 4, [4])])  # start > length
    with pytest.raises(ValueError):
        batched_forward(model, pool, [Row(h, 3, [])])
    with pytest.raises(ValueError):
        batched_forward(model, pool, [Row(h, 3, [4, 5], keep=3)])
    with pytest.raises(ValueError):
        pool.truncate(h, 4)
    assert pool.length(h) == 3
    pool.free(h)
    with pytest.raises(KeyError):
        pool.length(h)


def test_one_model_call_per_batched_forward():
    model = _cache.get("gemma3") or _build("gemma3")
    calls = []

    def hook(module, args, kwargs):
        calls.append(tuple(kwargs["input_ids"].shape))

    handle = model.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        pool = KVPool(model, max_tokens=256)
        hs = [pool.alloc() for _ in range(5)]
        batched_forward(model, pool, [Row(h, 0, list(range(1, 3 + 4 * i))) for i, h in enumerate(hs)])
        assert calls == [(5, 18)]
        batched_forward(model, pool, [Row(h, pool.length(h), [7] * (1 + i % 3)) for i, h in enumerate(hs[:4])])
        assert calls == [(5, 18), (4, 3)]
    finally:
        handle.remove()


# ---- forks: n completions of one prompt share its blocks -------------------------------------------

def test_fork_shares_blocks_and_copies_only_the_block_it_writes(model):
    """A fork holds the source's blocks (no new block, no copy); each side's writes go to a private
    copy of the one partly filled shared block; both sides' logits equal their own from-scratch
    references, whatever the other side writes -- in one batch or in separate ones."""
    g = torch.Generator().manual_seed(21)
    pool = KVPool(model, max_tokens=512, block_size=8)
    prompt = _toks(g, 21)  # 2 full blocks + 5 tokens of a third
    src = pool.alloc()
    batched_forward(model, pool, [Row(src, 0, prompt, keep=1)])
    used = pool.blocks_used
    forks = [pool.fork(src) for _ in range(3)]
    assert pool.blocks_used == used  # nothing allocated, nothing copied
    assert all(pool.block_table(f) == pool.block_table(src) for f in forks)
    assert all(pool.length(f) == len(prompt) for f in forks)
    # the source and two forks continue differently, in ONE batch: each writes into the shared
    # third block, so each gets its own copy of it (3 copies) plus no other new block
    tails = {h: _toks(g, 3) for h in (src, *forks[:2])}
    rows = [Row(h, len(prompt), t, keep=3) for h, t in tails.items()]
    outs = batched_forward(model, pool, rows)
    _check_rows(model, rows, outs, {h: prompt + t for h, t in tails.items()})
    assert pool.blocks_used == used + 3
    assert len({pool.block_table(h)[2] for h in (src, *forks)}) == 4  # three copies + the original
    assert len({tuple(pool.block_table(h)[:2]) for h in (src, *forks)}) == 1  # full blocks still shared
    # the untouched fork still sees the original prompt
    last = _toks(g, 2)
    out = batched_forward(model, pool, [Row(forks[2], len(prompt), last, keep=2)])
    _close(out[0], _ref(model, prompt + last, range(len(prompt), len(prompt) + 2)))


def test_fork_point_and_rollback_below_it(model):
    """A fork of the first n tokens; rolling it back into a shared full block copies that block
    (the source's keys stay intact); freeing handles returns exactly the blocks nobody holds."""
    g = torch.Generator().manual_seed(22)
    pool = KVPool(model, max_tokens=256, block_size=8)
    seq = _toks(g, 30)
    src = pool.alloc()
    batched_forward(model, pool, [Row(src, 0, seq, keep=1)])
    f = pool.fork(src, 17)
    assert pool.length(f) == 17 and pool.block_table(f) == pool.block_table(src)[:3]
    other = _toks(g, 4)
    out = batched_forward(model, pool, [Row(f, 10, other, keep=4)])  # rolls back into block 1 (shared)
    _close(out[0], _ref(model, seq[:10] + other, range(10, 14)))
    assert pool.block_table(f)[0] == pool.block_table(src)[0]  # block 0 still shared
    assert pool.block_table(f)[1] != pool.block_table(src)[1]  # block 1 copied before the write
    more = _toks(g, 2)
    out = batched_forward(model, pool, [Row(src, 30, more, keep=2)])
    _close(out[0], _ref(model, seq + more, range(30, 32)))
    assert pool.shared_blocks(src, 0) == 1
    pool.free(src)
    assert pool.blocks_used == len(pool.block_table(f))
    pool.free(f)
    assert pool.blocks_used == 0 and pool.blocks_free == pool.blocks_total


def test_copy_on_write_counts_against_a_full_pool():
    """A write that needs a private copy of a shared block fails with PoolFull -- nothing changed --
    when no block is free, like any other allocation."""
    model = _build("llama")
    pool = KVPool(model, max_tokens=16, block_size=8)  # two blocks
    src = pool.alloc()
    batched_forward(model, pool, [Row(src, 0, list(range(12)), keep=1)])
    f = pool.fork(src)
    assert pool.blocks_free == 0
    with pytest.raises(PoolFull):
        batched_forward(model, pool, [Row(f, 12, [5], keep=1)])
    assert pool.length(f) == 12 and pool.block_table(f) == pool.block_table(src)
    pool.free(src)  # now the fork owns both blocks alone: no copy needed
    batched_forward(model, pool, [Row(f, 12, [5], keep=1)])
    assert pool.length(f) == 13 and pool.blocks_used == 2
