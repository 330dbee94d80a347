"""Batched model workers: many sessions' forwards in one forward, same tokens as one at a time.

Real (tiny, random-init, fp32) transformers models; the concurrency is real threads, as the gRPC
handler threads of a model server would be. Work is counted (forwards, rows per forward), never
timed.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from crossdraft.decoding.decode import Decoder
from crossdraft.decoding.messages import Expect
from crossdraft.decoding.policy import DraftConfig
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.errors import InvalidArgument, NotFound, ResourceExhausted
from crossdraft.runtime.batching import BatchConfig, KVSlot
from crossdraft.runtime.workers import DrafterWorker, VerifierWorker, WorkerConfig
from crossdraft.vocab.pair import TokenPair
from tests.tiny_models import tiny_lm
from tests.unit.runtime.threads import run_threads as _run_threads

GREEDY = SamplingParams()
WCFG = WorkerConfig(max_sessions=64)


@pytest.fixture(scope="module")
def drafter(tok_d):
    return tiny_lm(tok_d, seed=2, arch="llama")


def _prompts(tok, n):
    rng = np.random.default_rng(0)
    vocab = len(tok)
    # different lengths: 3 .. 60 tokens
    return [[int(x) for x in rng.integers(5, vocab - 5, size=3 + 7 * i % 58)] for i in range(n)]


def _forward_counter(model):
    calls = []
    h = model.model.register_forward_pre_hook(lambda mod, args, kw: calls.append(kw["input_ids"].shape),
                                              with_kwargs=True)
    return calls, h


def _run_held(w, model, fns) -> list:
    """Run `fns` in threads at once while the worker's loop is told they are all busy inside it (it
    holds the first row, up to its max wait, until all are queued, as under load); return the
    shapes of the model's forwards meanwhile. Closes the worker's scheduler."""
    calls, hook = _forward_counter(model.model)
    busy = w.scheduler.busy
    w.scheduler.busy = lambda: len(fns)
    try:
        _run_threads(fns)
    finally:
        w.scheduler.busy = busy
        hook.remove()
        w.scheduler.close()
    return calls


# the scheduler's wait for the rows it holds out for, where a test pins it: a liveness bound (the
# rows of threads released by one barrier arrive within milliseconds), never a batching window
HOLD_S = 60.0


def _hold_for(w, rows: int, monkeypatch) -> None:
    """Make the worker's scheduler hold each batch's first row until ``rows`` rows are in the batch:
    it is told that many callers are inside the worker, and its wait for them lasts HOLD_S. Batches
    then depend on the rows the callers send, not on when their threads run."""
    monkeypatch.setattr(w.scheduler, "busy", lambda: rows)
    monkeypatch.setattr(w.scheduler, "_max_wait_s", lambda: HOLD_S)


def test_concurrent_verifications_share_forwards_and_give_the_one_by_one_answers(target, tok_t, monkeypatch):
    """Eight sessions verify two rounds each at once: each round's eight blocks run in ONE forward of
    eight rows, and every answer is the one a verifier without batching gives."""
    n = 8
    prompts = _prompts(tok_t, n)
    blocks = [[7 + i, 9, 11 + i][: 1 + i % 3] for i in range(n)]
    ref = VerifierWorker(target, WCFG)
    want = []
    for i, (p, b) in enumerate(zip(prompts, blocks, strict=True)):
        ref.sync(f"s{i}", p)
        r1 = ref.verify(f"s{i}", None, b, None, 0, GREEDY, 0)
        r2 = ref.verify(f"s{i}", None, [r1.next_token], None, 1, GREEDY, 0)  # a second round on the cache
        want.append((r1.num_accepted, r1.next_token, r2.num_accepted, r2.next_token))

    w = VerifierWorker(target, WCFG, batch=BatchConfig())
    for i in range(n):  # the prompts' keys and values first, one session at a time: the rounds' rows are short
        w.sync(f"s{i}", prompts[i], prefill=True)
    before = (w.scheduler.stats.batches, w.scheduler.stats.rows)
    before_fit = w.price().forwards
    _hold_for(w, n, monkeypatch)
    calls, hook = _forward_counter(target.model)
    got, sizes = [None] * n, [None] * n
    try:
        def one(i):
            def fn():
                r1 = w.verify(f"s{i}", Expect.of(prompts[i]), blocks[i], None, 0, GREEDY, 0)
                r2 = w.verify(f"s{i}", None, [r1.next_token], None, 1, GREEDY, 0)
                got[i] = (r1.num_accepted, r1.next_token, r2.num_accepted, r2.next_token)
                sizes[i] = (r1.batch_size, r2.batch_size)
            return fn

        _run_threads([one(i) for i in range(n)])
    finally:
        hook.remove()
        w.scheduler.close()
    assert got == want
    st = w.scheduler.stats
    # two rounds of eight blocks: two forwards of eight rows, each through the scheduler
    assert [shape[0] for shape in calls] == [n, n]
    assert (st.batches - before[0], st.rows - before[1]) == (2, 2 * n)
    assert sizes == [(n, n)] * n  # what each caller was told of its batches
    # the price each reply publishes is fitted from the forwards of short rows the scheduler ran (the two
    # rounds' among them; a prompt's long chunks are not a round's forwards: test_price)
    assert w.price().forwards - before_fit == 2


def test_a_lone_caller_does_not_wait_for_a_batch(target, tok_t, monkeypatch):
    """With one caller inside the worker the scheduler runs its row at once, however long it may
    wait for company: here it would wait an hour, and the call still returns (a liveness bound far
    above the milliseconds it takes) in a batch of one. The control: told of a second caller, the
    same scheduler holds the first row until the second arrives, and both run in one batch."""
    w = VerifierWorker(target, WCFG, batch=BatchConfig(max_wait_ms=1000))
    monkeypatch.setattr(w.scheduler, "_max_wait_s", lambda: 3600.0)
    p = _prompts(tok_t, 2)
    got = {}
    try:
        w.sync("solo", p[0])
        solo = threading.Thread(target=lambda: got.__setitem__("solo", w.verify("solo", None, [5, 6], None, 0,
                                                                                 GREEDY, 0)), daemon=True)
        solo.start()
        solo.join(HOLD_S)
        assert not solo.is_alive(), "a lone caller waited for a batch"
        assert got["solo"].batch_size == 1 and w.scheduler.stats.batches == 1
        w.sync("pair", p[1])
        monkeypatch.setattr(w.scheduler, "busy", lambda: 2)
        _run_threads([lambda s=s: got.__setitem__(s, w.verify(s, None, [5], None, 1 if s == "solo" else 0,
                                                                GREEDY, 0)) for s in ("solo", "pair")])
        assert got["solo"].batch_size == got["pair"].batch_size == 2 and w.scheduler.stats.batches == 2
    finally:
        w.scheduler.close()


def test_long_prefill_runs_in_chunks(target, tok_t):
    w = VerifierWorker(target, WCFG, batch=BatchConfig(prefill_chunk=16, max_tokens=64))
    calls, hook = _forward_counter(target.model)
    try:
        p = [int(x) for x in np.random.default_rng(1).integers(5, len(tok_t) - 5, size=70)]
        w.sync("long", p)
        w.verify("long", None, [5], None, 0, GREEDY, 0)
    finally:
        hook.remove()
        w.scheduler.close()
    # 70 uncached tokens + 1 draft = 71 tokens fed in chunks of at most 16
    assert [s[1] for s in calls] == [16, 16, 16, 16, 7] and all(s[0] == 1 for s in calls)


def test_full_pool_evicts_idle_sessions_which_resync_to_the_same_answer(target, tok_t):
    prompts = _prompts(tok_t, 6)
    ref = VerifierWorker(target, WCFG)
    w = VerifierWorker(target, WCFG, batch=BatchConfig(kv_cache_tokens=96, block_size=8, prefill_chunk=32,
                                                       max_tokens=64))
    try:
        for i, p in enumerate(prompts):
            ref.sync(f"s{i}", p)
        for rnd in range(2):
            for i in range(len(prompts)):
                sid = f"s{i}"
                want = ref.verify(sid, None, [5], None, rnd, GREEDY, 0)
                try:
                    got = w.verify(sid, None, [5], None, rnd, GREEDY, 0)
                except NotFound:  # evicted to make room: the caller re-syncs, as the round loop does
                    w.sync(sid, ref.sessions.get(sid).ids[: -(want.num_accepted + 1)])
                    got = w.verify(sid, None, [5], None, rnd, GREEDY, 0)
                assert (got.num_accepted, got.next_token) == (want.num_accepted, want.next_token)
        assert w.evicted_for_memory > 0
        info = w.batch_info()
        assert info["kv_blocks_used"] <= info["kv_blocks_total"] and info["evictions"] == w.evicted_for_memory
    finally:
        w.scheduler.close()


def test_a_session_larger_than_the_whole_cache_is_invalid_and_the_worker_still_serves(target, tok_t):
    w = VerifierWorker(target, WCFG, batch=BatchConfig(kv_cache_tokens=32, block_size=8, prefill_chunk=16,
                                                       max_tokens=16))
    try:
        big = [int(x) for x in np.random.default_rng(2).integers(5, len(tok_t) - 5, size=60)]
        with pytest.raises(InvalidArgument, match="KV cache holds 32"):
            w.sync("big", big)
            w.verify("big", None, [5], None, 0, GREEDY, 0)
        w.end("big")
        w.sync("small", big[:10])
        r = w.verify("small", None, [5], None, 0, GREEDY, 0)
        assert r.context.length == 10 + r.num_accepted + 1
    finally:
        w.scheduler.close()


def test_ended_sessions_give_their_blocks_back(target, tok_t):
    w = VerifierWorker(target, WCFG, batch=BatchConfig(block_size=8))
    try:
        for i, p in enumerate(_prompts(tok_t, 4)):
            w.sync(f"e{i}", p)
            w.verify(f"e{i}", None, [5], None, 0, GREEDY, 0)
        used = w.batch_info()["kv_blocks_used"]
        assert used > 0
        for i in range(4):
            assert w.end(f"e{i}")
        w.sync("probe", [5, 6])  # the frees are applied on the scheduler thread before its next batch
        w.verify("probe", None, [], None, 0, GREEDY, 0)
        assert w.batch_info()["kv_blocks_used"] == 1
    finally:
        w.scheduler.close()


@pytest.mark.parametrize("chooser", ["fixed", "priced"])
def test_round_loops_over_batched_workers_match_the_unbatched_engine(target, drafter, tok_t, tok_d, chooser,
                                                                     monkeypatch):
    """Several requests through the shared round loop at once, with drafting and verification
    both batched: every one gives the tokens it gives alone (greedy, TLI and target-only) -- with
    fixed blocks, and with the adaptive chooser priced by the servers' measured tables and the
    verifier's published price (crossdraft.runtime.price), which the round loop took up."""
    pair = TokenPair(tok_t, tok_d, target.vocab_size, drafter.vocab_size)
    texts = ["hello world", "the cat sat on", "def f(x): return", "a b c d e f g", "once upon a time", "x = 1"]
    params = SamplingParams()
    if chooser == "fixed":
        cfg = DraftConfig(num_draft_tokens=3, adaptive=False, mode="tli")
    else:
        monkeypatch.setenv("CROSSDRAFT_COST_PROFILE", "measure")
        cfg = DraftConfig(mode="tli", cost_model="measured")

    def run(dec, i, use_drafter=True):
        t_ids, d_ids = pair.encode_target(texts[i]), pair.encode_drafter(texts[i])
        r = dec.run(f"r{i}", t_ids, d_ids, max_new_tokens=12, params=params, seed=0, draft=cfg, use_drafter=use_drafter)
        for _ in r:
            pass
        return r.result.token_ids

    ref_dec = Decoder(pair, VerifierWorker(target, WCFG), DrafterWorker(drafter, WCFG), eos_ids=target.eos_token_ids)
    want = [run(ref_dec, i, use_drafter=i % 3 != 0) for i in range(len(texts))]

    vb = VerifierWorker(target, WCFG, batch=BatchConfig(max_wait_ms=50))
    db = DrafterWorker(drafter, WCFG, batch=BatchConfig(max_wait_ms=50))
    dec = Decoder(pair, vb, db, eos_ids=target.eos_token_ids)
    got = [None] * len(texts)
    try:
        def one(i):
            def fn():
                got[i] = run(dec, i, use_drafter=i % 3 != 0)
            return fn

        _run_threads([one(i) for i in range(len(texts))])
    finally:
        vb.scheduler.close()
        db.scheduler.close()
    assert got == want
    assert vb.scheduler.stats.rows > vb.scheduler.stats.batches  # verification was batched
    if chooser == "fixed":
        assert db.scheduler.stats.rows > db.scheduler.stats.batches  # so was drafting (pruned heads per row)
    else:  # the round loop holds the verifier's latest price, fitted from (at least) 8 forwards
        assert dec._price is not None and dec._price.forwards >= 8


def test_batch_config_rejects_bad_values():
    from crossdraft.errors import InvalidArgument

    for bad in (dict(max_rows=0), dict(max_wait_ms=-1), dict(kv_cache_tokens=-5), dict(prefill_chunk=0),
                dict(max_tokens=8, prefill_chunk=16)):
        with pytest.raises(InvalidArgument):
            BatchConfig(**bad)


@pytest.mark.parametrize("seed", [0, 1])
def test_sampling_verification_in_shared_batches_is_deterministic(target, tok_t, seed):
    """Sampling: each row's draws depend on (seed, round, position) only, not on the batch."""
    prompts = _prompts(tok_t, 6)
    params = SamplingParams(temperature=0.9)
    vt = target.vocab_size
    q_rows = [(np.array([5, 6, 7]), np.array([0.5, 0.3, 0.2]))] * 2
    ref = VerifierWorker(target, WCFG)
    want = []
    for i, p in enumerate(prompts):
        ref.sync(f"q{i}", p)
        r = ref.verify(f"q{i}", None, [5, 6], q_rows, 3, params, seed)
        want.append((r.num_accepted, r.next_token))
    w = VerifierWorker(target, WCFG, batch=BatchConfig(max_wait_ms=100))
    got = [None] * len(prompts)
    try:
        def one(i):
            def fn():
                w.sync(f"q{i}", prompts[i])
                r = w.verify(f"q{i}", None, [5, 6], q_rows, 3, params, seed)
                got[i] = (r.num_accepted, r.next_token)
            return fn

        _run_threads([one(i) for i in range(len(prompts))])
    finally:
        w.scheduler.close()
    assert got == want and all(0 <= t < vt for _, t in got)
    assert torch.get_num_threads() >= 1


def test_a_long_prefill_does_not_pad_other_sessions_short_rows(target, tok_t):
    """A batched forward pads every row to the longest. A new session's 120-token prompt arriving
    with six sessions' 3-token blocks runs in a forward of its own, and the blocks batch together:
    no forward pads short rows to the prompt's length (6 x 120 computed for 18 real tokens). The
    answers are the one-by-one ones."""
    from crossdraft.runtime.rowmix import SHORT_ROW, _mixes

    rng = np.random.default_rng(7)
    short = {f"s{i}": [int(x) for x in rng.integers(5, len(tok_t) - 5, size=10)] for i in range(6)}
    long_p = [int(x) for x in rng.integers(5, len(tok_t) - 5, size=120)]
    w = VerifierWorker(target, WCFG, batch=BatchConfig(max_wait_ms=1000))
    ref = VerifierWorker(target, WCFG)
    for x in (w, ref):
        for sid, p in short.items():
            x.sync(sid, p)
            x.verify(sid, None, [5], None, 0, GREEDY, 0)  # prefilled: the next rows are short
        x.sync("long", long_p)  # (its prefill runs with its first block)
    want = {sid: ref.verify(sid, None, [5, 6], None, 1, GREEDY, 0) for sid in short}
    want["long"] = ref.verify("long", None, [5], None, 0, GREEDY, 0)
    got = {}

    def one(sid):
        def fn():
            got[sid] = w.verify(sid, None, [5] if sid == "long" else [5, 6], None,
                                0 if sid == "long" else 1, GREEDY, 0)
        return fn
    calls = _run_held(w, target, [one(s) for s in [*short, "long"]])
    assert {s: (r.num_accepted, r.next_token) for s, r in got.items()} == \
        {s: (r.num_accepted, r.next_token) for s, r in want.items()}
    assert (1, 121) in [tuple(c[:2]) for c in calls]  # the prompt and its block: a row alone
    assert all(c[0] == 1 for c in calls if c[1] > SHORT_ROW), calls
    assert any(c[0] > 1 for c in calls)  # the short rows still batched
    # the rule itself: short rows mix whatever their lengths; a long one where it adds little padding
    assert _mixes(15, 1, 17, 4096) and not _mixes(15, 1, 150, 4096) and not _mixes(1, 3, 121, 4096)
    assert _mixes(1, 150, 140, 4096) and not _mixes(3, 17, 300, 4096) and not _mixes(1, 512, 200, 4096)
    assert not _mixes(8, 512, 512, 4096)  # padded past the token cap


@pytest.mark.parametrize("table", ["cpu", "gpu"])
def test_a_block_among_one_token_steps_is_cut_off_where_padding_costs_more_than_a_forward(target, tok_t, table):
    """Six sessions' one-token steps and one session's 10-token block arrive together. On a CPU
    (a measured cost table that grows with the tokens) padding the six steps to 10 tokens costs
    more than a second forward: the block runs apart. On a GPU (a flat table) one forward holds
    all seven. Same answers either way; the oldest row is always in the first forward."""
    from crossdraft.runtime.batching import _split

    cpu = [131.0, 135.0, 135.0, 135.0, 140.0, 145.0, 150.0, 157.0, 160.0, 163.0, 166.0] + \
        [166.0 + 4.0 * i for i in range(1, 54)]  # (1.5B bf16 on 2 cores: flat, then ~4 ms a token)
    gpu = [30.0 + 0.02 * i for i in range(64)]
    rng = np.random.default_rng(8)
    ps = {f"s{i}": [int(x) for x in rng.integers(5, len(tok_t) - 5, size=12)] for i in range(7)}
    block = {sid: ([5, 6, 7, 8, 9, 10, 11, 12, 13] if sid == "s6" else []) for sid in ps}
    w = VerifierWorker(target, WCFG, batch=BatchConfig(max_wait_ms=1000))
    ref = VerifierWorker(target, WCFG)
    for x in (w, ref):
        for sid, p in ps.items():
            x.sync(sid, p)
            x.verify(sid, None, [5], None, 0, GREEDY, 0)
    want = {sid: ref.verify(sid, None, block[sid], None, 1, GREEDY, 0) for sid in ps}
    w.scheduler.cost_ms = cpu if table == "cpu" else gpu
    got = {}
    calls = _run_held(w, target, [lambda s=s: got.__setitem__(s, w.verify(s, None, block[s], None, 1, GREEDY, 0))
                                  for s in ps])
    assert {s: (r.num_accepted, r.next_token) for s, r in got.items()} == \
        {s: (r.num_accepted, r.next_token) for s, r in want.items()}
    shapes = sorted(tuple(c[:2]) for c in calls)
    if table == "cpu":
        assert shapes == [(1, 10), (6, 1)], shapes
    else:
        assert shapes == [(7, 10)], shapes

    class J:
        def __init__(self, n):
            self.tokens = [0] * n

    rows = [J(1) for _ in range(15)] + [J(11)]
    assert [len(x) for x in _split(rows, cpu)] == [15, 1]  # the block waits one forward
    assert [len(x) for x in _split(rows[::-1], cpu)] == [1, 15]  # the oldest (the block) runs now
    assert [len(x) for x in _split(rows, gpu)] == [16, 0] and [len(x) for x in _split(rows, None)] == [16, 0]
    assert [len(x) for x in _split([J(2), J(1), J(1)], cpu)] == [3, 0]  # little padding: whole


def test_rows_that_do_not_fit_beside_busy_sessions_get_resource_exhausted_then_succeed(target, tok_t):
    """Two sessions whose prefills land in one batch but do not fit in the pool together: the busy one
    cannot be evicted, so the other is refused with RESOURCE_EXHAUSTED (retry later); retried
    alone, it evicts the now idle one and is served, with the one-by-one answer."""
    w = VerifierWorker(target, WCFG, batch=BatchConfig(kv_cache_tokens=32, block_size=8, prefill_chunk=32,
                                                       max_tokens=64, max_wait_ms=1000))
    ref = VerifierWorker(target, WCFG)
    rng = np.random.default_rng(4)
    ps = {f"s{i}": [int(x) for x in rng.integers(5, len(tok_t) - 5, size=20)] for i in range(2)}
    outcomes = {}

    both_synced = threading.Barrier(2, timeout=60)

    def run(sid):
        try:
            w.sync(sid, ps[sid])  # no forward yet: the prefill runs with the first block
            both_synced.wait()
            w.verify(sid, None, [5], None, 0, GREEDY, 0)
            outcomes[sid] = "ok"
        except ResourceExhausted:
            outcomes[sid] = "exhausted"

    # Both rows must land in ONE batch: the scheduler holds the first row until the second is in it
    # (its wait a liveness bound), whenever the threads run; the retry below runs with the real count
    busy, max_wait = w.scheduler.busy, w.scheduler._max_wait_s
    w.scheduler.busy, w.scheduler._max_wait_s = (lambda: 2), (lambda: HOLD_S)
    try:
        try:
            _run_threads([lambda s=s: run(s) for s in ps])
        finally:
            w.scheduler.busy, w.scheduler._max_wait_s = busy, max_wait
        assert w.scheduler.stats.batches == 1  # one batch held both prefills
        assert sorted(outcomes.values()) == ["exhausted", "ok"]
        assert w.batch_info()["exhausted"] == 1
        late = next(s for s, o in outcomes.items() if o == "exhausted")
        w.sync(late, ps[late])  # alone now: the other session is idle and gets evicted
        ref.sync(late, ps[late])
        got, want = (x.verify(late, None, [5], None, 0, GREEDY, 0) for x in (w, ref))
        assert (got.num_accepted, got.next_token) == (want.num_accepted, want.next_token)
    finally:
        w.scheduler.close()


def test_a_stalled_draft_stream_does_not_block_other_sessions_batches(drafter, target, tok_t, tok_d):
    """A client that stops reading its Draft stream after one token (stalled or gone) holds nothing
    the batch loop needs: other sessions keep drafting and verifying in batched forwards, and the
    stalled stream still works when read again."""
    d = DrafterWorker(drafter, WCFG, batch=BatchConfig(max_wait_ms=5))
    v = VerifierWorker(target, WCFG, batch=BatchConfig(max_wait_ms=5))
    try:
        d.sync("stalled", [5, 6, 7, 8])
        it = d.draft_iter("stalled", None, None, 5, 0, GREEDY, 0, 0.0, "")
        first = next(it)
        done = []

        def others(i):
            def fn():
                sid = f"o{i}"
                d.sync(sid, [9, 10 + i, 11])
                toks = list(d.draft_iter(sid, None, None, 4, 0, GREEDY, 0, 0.0, ""))
                v.sync(sid, [9, 10 + i, 11])
                v.verify(sid, None, [5, 6], None, 0, GREEDY, 0)
                done.append(len(toks))
            return fn

        _run_threads([others(i) for i in range(4)])  # would hang (and fail) if blocked
        assert sorted(done) == [4, 4, 4, 4]
        rest = list(it)
        assert len(rest) == 4 and first is not None
    finally:
        d.scheduler.close()
        v.scheduler.close()


def test_replies_report_how_many_sessions_share_the_forwards(target, tok_t):
    """Each verification reply says how many sessions are sending blocks to this verifier lately
    (what the draft-length policy prices drafting against); a lone session reports 1."""
    prompts = _prompts(tok_t, 4)
    w = VerifierWorker(target, WCFG, batch=BatchConfig(max_wait_ms=50))
    seen = []
    try:
        w.sync("alone", prompts[0])
        assert w.verify("alone", None, [5], None, 0, GREEDY, 0).active_sessions == 1
        w.end("alone")

        def one(i):
            def fn():
                w.sync(f"a{i}", prompts[i])
                seen.append(w.verify(f"a{i}", None, [5, 6], None, 0, GREEDY, 0).active_sessions)
            return fn

        _run_threads([one(i) for i in range(4)])
    finally:
        w.scheduler.close()
    assert len(seen) == 4 and all(1 <= n <= 4 for n in seen) and max(seen) >= 2


# ---- n completions of one prompt: one prefill, forked sessions ----------------------------------------

@pytest.mark.parametrize("batched", [True, False])
def test_forked_sessions_share_the_prompts_prefill_and_answer_as_if_alone(target, tok_t, batched):
    """sync(prefill=True) computes all but the last prompt token once; forks start with that cache
    (the pool's blocks shared, or a copied cache without batching); each fork's first verification
    then feeds only the last prompt token + its drafts, and gives the same answer as a session that
    prefilled alone. Work is counted: the model sees the prompt once, not once per fork."""
    prompt = _prompts(tok_t, 4)[3]  # 24 tokens
    blocks = [[7], [9, 11], [13, 15, 17]]
    ref = VerifierWorker(target, WCFG)
    want = []
    for i, b in enumerate(blocks):
        ref.sync(f"r{i}", prompt)
        r = ref.verify(f"r{i}", None, b, None, 0, GREEDY, 0)
        want.append((r.num_accepted, r.next_token))
    w = VerifierWorker(target, WCFG, batch=BatchConfig(max_wait_ms=0)) if batched else VerifierWorker(target, WCFG)
    calls, hook = _forward_counter(target.model)
    try:
        reused, exp = w.sync("base", prompt, prefill=True)
        assert reused == 0 and exp == Expect.of(prompt)
        assert [c[-1] for c in calls] == [len(prompt) - 1]  # one forward over all but the last token
        for i in range(3):
            shared, exp = w.fork("base", f"c{i}")
            assert shared == len(prompt) - 1 and exp == Expect.of(prompt)
        assert len(calls) == 1  # forking computes nothing
        if batched:
            assert w.scheduler.pool.blocks_used == -(-(len(prompt) - 1) // w.scheduler.pool.block_size)
        got = []
        for i, b in enumerate(blocks):
            reused, _ = w.sync(f"c{i}", prompt)  # what the round loop does first: everything is reused
            assert reused == len(prompt) - 1
            n = len(calls)
            r = w.verify(f"c{i}", Expect.of(prompt), b, None, 0, GREEDY, 0)
            assert [c[-1] for c in calls[n:]] == [1 + len(b)]  # the last prompt token + the drafts
            got.append((r.num_accepted, r.next_token))
        assert got == want
        # the base session is untouched by its forks' writes: it verifies like a fresh session too
        r = w.verify("base", None, blocks[2], None, 0, GREEDY, 0)
        assert (r.num_accepted, r.next_token) == want[2]
    finally:
        hook.remove()
    assert w.end("base") and all(w.end(f"c{i}") for i in range(3))
    if batched:  # every block is back once every session sharing it is gone (freed on the loop thread)
        w.scheduler.fork(KVSlot(), KVSlot(), 0)  # a no-op op: returns once the loop ran the releases before it
        assert w.scheduler.pool.blocks_used == 0


def test_fork_errors_name_the_field(target, tok_t):
    w = VerifierWorker(target, WCFG, batch=BatchConfig(max_wait_ms=0))
    w.sync("a", [5, 6, 7])
    with pytest.raises(NotFound) as e:
        w.fork("nope", "b")
    assert e.value.what == "source_session_id"
    with pytest.raises(InvalidArgument) as e:
        w.fork("a", "a")
    assert e.value.field == "session_id"
    with pytest.raises(InvalidArgument) as e:
        w.fork("bad id!", "b")
    assert e.value.field == "source_session_id"
    # a fork replaces an existing session of that id
    w.sync("b", [9, 9, 9, 9])
    shared, exp = w.fork("a", "b")
    assert exp == Expect.of([5, 6, 7]) and shared == 0  # "a" never ran a forward: nothing cached to share
