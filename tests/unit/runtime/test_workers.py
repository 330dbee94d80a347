"""Model workers (what the drafter/verifier servers wrap): bounded sessions, context checks,
cache reuse on sync and edit, and drafts restricted to a registered mask."""

from __future__ import annotations

import numpy as np
import pytest

from crossdraft.decoding.messages import Expect, ids_crc32
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.errors import FailedPrecondition, InvalidArgument, NotFound
from crossdraft.runtime.workers import DrafterWorker, ModelSessionCache, VerifierWorker, WorkerConfig
from tests.tiny_models import tiny_lm
from tests.tokenizers_fixtures import bytelevel_bpe_tokenizer

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def lm():
    lm = tiny_lm(bytelevel_bpe_tokenizer(), seed=1, arch="qwen2")
    lm.path = "tiny"
    lm.kind = "hf_dir"
    return lm


def test_session_store_lru_and_ttl():
    now = [0.0]
    st = ModelSessionCache(2, ttl_s=10, clock=lambda: now[0])
    st.put("a", 1)
    st.put("b", 2)
    assert st.get("a") == 1  # a is now the most recent
    st.put("c", 3)  # evicts b
    assert st.get("b") is None and st.evicted == 1 and len(st) == 2
    now[0] = 11.0
    assert st.get("a") is None and st.get("c") is None and st.expired == 2


def test_crc_is_of_int32_little_endian():
    import zlib

    ids = [1, 2, 70000, 0]
    assert ids_crc32(ids) == zlib.crc32(np.asarray(ids, dtype="<i4").tobytes())
    assert Expect.of(ids) == Expect(4, ids_crc32(ids))


def test_verifier_checks_context_and_rebuilds_after_loss(lm):
    w = VerifierWorker(lm, WorkerConfig(max_sessions=2))
    ids = list(range(5, 20))
    with pytest.raises(NotFound):
        w.verify("s", None, [], None, 0, GREEDY, 0)
    reused, exp = w.sync("s", ids)
    assert reused == 0 and exp == Expect.of(ids)
    with pytest.raises(FailedPrecondition):
        w.verify("s", Expect.of(ids[:-1]), [], None, 0, GREEDY, 0)
    r1 = w.verify("s", Expect.of(ids), [], None, 0, GREEDY, 0)
    assert r1.context == Expect.of(ids + [r1.next_token])
    # sync with a longer history that extends ours: the cache is kept
    longer = ids + [r1.next_token, 7, 8]
    reused, _ = w.sync("s", longer)
    assert reused == len(ids)
    # a different history shares only a prefix
    reused, _ = w.sync("s", ids[:6] + [99, 98])
    assert reused == 6
    # evicted by two other sessions, then rebuilt: same answer
    w.sync("t", ids)
    w.sync("u", ids)
    with pytest.raises(NotFound):
        w.verify("s", None, [], None, 0, GREEDY, 0)
    w.sync("s", ids)
    assert w.verify("s", Expect.of(ids), [], None, 0, GREEDY, 0).next_token == r1.next_token


def test_verifier_rejects_bad_input(lm):
    w = VerifierWorker(lm)
    with pytest.raises(InvalidArgument, match="token_ids"):
        w.sync("s", [])
    with pytest.raises(InvalidArgument, match="token_ids"):
        w.sync("s", [10**9])
    with pytest.raises(InvalidArgument, match="session_id"):
        w.sync("", [1])
    w.sync("s", [1, 2, 3])
    with pytest.raises(InvalidArgument, match="draft_token_ids"):
        w.verify("s", None, [-1], None, 0, GREEDY, 0)
    with pytest.raises(InvalidArgument, match="q"):
        w.verify("s", None, [4], None, 0, SamplingParams(temperature=1.0), 0)
    with pytest.raises(InvalidArgument, match="q"):
        w.verify("s", None, [4], [(np.array([4]), np.array([-1.0]))], 0, SamplingParams(temperature=1.0), 0)
    # nothing was half-applied: the session still holds its 3 ids
    assert w.verify("s", Expect.of([1, 2, 3]), [], None, 0, GREEDY, 0).context.length == 4


def test_drafter_masks_edits_and_proposals(lm):
    w = DrafterWorker(lm)
    vocab = w.vocab
    mask = np.zeros(vocab, dtype=bool)
    mask[50:150] = True
    with pytest.raises(FailedPrecondition, match="allowed_key"):
        list(w.draft_iter("s", None, None, 3, 0, GREEDY, 0, 0.0, "k"))
    assert w.set_allowed("k", mask) == 100
    ids = list(range(5, 25))
    w.sync("s", ids)
    for params in (GREEDY, SamplingParams(temperature=1.0, top_k=30)):
        toks = w.draft("s", None, Expect.of(ids), 4, 0, params, 1, 0.0, "k")
        assert len(toks) == 4 and all(50 <= t.id < 150 for t in toks)
        if not params.greedy:
            for t in toks:
                assert t.q_ids is not None and np.all(np.isin(t.q_ids, np.arange(50, 150)))
                assert t.id in t.q_ids.tolist()
    # the committed ids did not change; an edit keeping two proposals + one more id
    props = [t.id for t in toks]
    new = ids + props[:2] + [60]
    exp = w.commit("s", (len(ids), props[:2] + [60]), Expect.of(new))
    assert exp == Expect.of(new)
    sess = w.sessions.get("s")
    assert sess.cache_len >= len(ids) + 1  # the kept proposals' cache entries survived the edit
    with pytest.raises(FailedPrecondition):
        w.commit("s", (len(new) + 5, []), None)
    with pytest.raises(FailedPrecondition):
        w.commit("s", (len(new), [1]), Expect.of(new))  # result would not match the expectation
    with pytest.raises(InvalidArgument, match="num_draft_tokens"):
        list(w.draft_iter("s", None, None, 0, 0, GREEDY, 0, 0.0, "k"))
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(InvalidArgument, match="stop_cumulative_below"):
            list(w.draft_iter("s", None, None, 3, 0, GREEDY, 0, 0.0, "k", stop_cumulative=bad))


def test_abandoned_draft_stream_does_not_block_the_model(lm):
    w = DrafterWorker(lm)
    w.sync("s", [5, 6, 7])
    it = w.draft_iter("s", None, None, 5, 0, GREEDY, 0, 0.0, "")
    next(it)  # a consumer that stops reading after one token
    import threading

    got = []

    def other():  # another thread (an RLock would let this one in anyway)
        ok = w.lock.acquire(timeout=2)
        got.append(ok)
        if ok:
            w.lock.release()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert got == [True]  # the lock is free between tokens
    w.sync("t", [5, 6, 7])
    assert len(w.draft("t", None, None, 3, 0, GREEDY, 0, 0.0, "")) == 3
