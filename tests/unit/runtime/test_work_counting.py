"""Work counting: every forward feeds exactly the tokens it must, at the right positions.

Speed is part of correctness. A refactor once made the drafter re-feed all proposals of its
block at every draft step (O(k^2) tokens, duplicated proposals in its KV cache at the wrong
positions, lower acceptance) and every output-equality test still passed, because greedy
verification is lossless whatever the drafter proposes. These tests count the tokens each model
is fed per forward -- deterministic, no timing -- through a forward pre-hook on the models' base
transformer (the one module both head paths, full LM head and pruned LM head, go through):

* drafter: the first step of a block feeds the uncached tail of the committed ids, and every
  later step feeds exactly ONE token (the previous proposal) at the position right after the
  cache; k proposals cost k forwards;
* target: one forward per round, feeding exactly the uncached tail plus the block of drafts;
* the drafter's KV cache after rounds equals a cache built from scratch on the same ids (keys,
  values and next-token logits within 1e-5 in fp32).

Both drafter head paths run: the TLI pair's drafter keeps only the intersection's rows of its LM
head (pruned path), the same-vocabulary drafter keeps the full head.
"""

from __future__ import annotations

import pytest
import torch

from crossdraft.decoding.sampling import SamplingParams
from crossdraft.engine import DraftConfig, Engine
from crossdraft.runtime.sessions import AllowedSet, DrafterSession, TargetSession, new_cache
from tests.tiny_models import tiny_lm

PROMPTS = ["def add(a, b):\n    return", "import numpy as np\n\nclass Model:\n    def __init__(self):"]


class FeedLog:
    """Records (input_ids, position_ids) of every forward of a model's base transformer."""

    def __init__(self, model):
        self.calls: list[tuple[list[int], list[int]]] = []
        self.marks: list[int] = []  # index into calls where a draft block starts
        self._h = model.model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _mod, args, kwargs):
        ids = kwargs.get("input_ids")
        pos = kwargs.get("position_ids")
        assert ids is not None and pos is not None, "the sessions always pass input_ids and position_ids"
        self.calls.append((ids[0].tolist(), pos[0].tolist()))

    def close(self):
        self._h.remove()


@pytest.fixture(scope="module")
def drafters(tok_t, tok_d):
    return {"tli": tiny_lm(tok_d, seed=2), "same-vocab": tiny_lm(tok_t, seed=3)}


@pytest.fixture(params=[("pruned", "tli"), ("full", "tli"), ("full", "same-vocab"), ("pruned", "same-vocab")],
                ids=lambda p: f"{p[0]}-head-{p[1]}")
def eng(request, target, drafters, monkeypatch, tmp_path_factory):
    """An engine whose drafter runs the pruned-head path or the full-head path (forced either way)."""
    path, pair = request.param
    monkeypatch.setattr(AllowedSet, "prune_below", 2.0 if path == "pruned" else 0.0)
    e = Engine(target, drafters[pair], vocab_cache_dir=tmp_path_factory.mktemp("vocab"))
    e.path = path
    return e


def _allowed(engine) -> AllowedSet:
    return AllowedSet(engine.drafter.model, engine.pair.masks["tli"], engine.drafter.device)


def test_both_head_paths_are_exercised(eng):
    assert (_allowed(eng).head is not None) == (eng.path == "pruned")


def _lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _expected_cache(model, ids: list[int]):
    """KV cache and next-token logits built from scratch over `ids` (one forward, positions 0..n-1)."""
    cache = new_cache(model)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids)).unsqueeze(0),
                    cache=cache, use_cache=True)
    return cache, out.logits[0, -1].float()


def _kv(cache):
    return [(layer.keys, layer.values) for layer in cache.layers]


@pytest.mark.parametrize("k", [1, 4, 7])
def test_drafter_feeds_one_token_per_draft_step(eng, k):
    model = eng.drafter.model
    allowed = _allowed(eng)
    ids = eng.pair.encode_drafter(PROMPTS[1])
    sess = DrafterSession(model, ids, eng.drafter.device)
    log = FeedLog(model)
    try:
        params = SamplingParams()
        for rnd in range(4):
            n_calls = len(log.calls)
            cached = sess.cache_len
            toks = list(sess.draft_iter(k, rnd, params, 0, allowed))
            props = [t.id for t in toks]
            calls = log.calls[n_calls:]
            assert len(toks) == k and len(calls) == k, "k proposals cost exactly k forwards"
            # step 0: the uncached tail of the committed ids, starting right after the cache
            first_ids, first_pos = calls[0]
            assert first_ids == sess.ids[cached:]
            assert first_pos == list(range(cached, len(sess.ids)))
            # step i >= 1: exactly one token, the previous proposal, at the next position
            for i in range(1, k):
                assert calls[i] == ([props[i - 1]], [len(sess.ids) + i - 1]), f"draft step {i} fed {calls[i]}"
            # the cache holds the committed ids plus all proposals but the last
            assert sess.cache_len == len(sess.ids) + k - 1
            assert sess.fed == sess.ids + props[:-1]
            exp_cache, _ = _expected_cache(model, sess.ids + props[:-1])
            for (a, b), (c, d) in zip(_kv(sess.cache), _kv(exp_cache), strict=True):
                assert a.shape == c.shape and torch.allclose(a, c, atol=1e-5) and torch.allclose(b, d, atol=1e-5)
            # commit: accept a prefix of the block (all, some, none over the rounds) + a "target" token
            n = [k, k // 2, 0, k - 1][rnd]
            sess.edit(len(sess.ids), props[:n] + [int(allowed.ids[rnd % allowed.count])])
    finally:
        log.close()
    assert sess.cache_repairs == 0


@pytest.mark.parametrize("greedy", [True, False])
def test_a_confident_block_ends_where_the_drafters_own_estimate_drops(eng, greedy):
    """stop_cumulative: the block ends after the first proposal at which the product of the
    proposals' probabilities (computed here from scratch) falls below the threshold; that costs
    exactly one forward per proposal, and the proposals are those of the unbounded block."""
    model = eng.drafter.model
    allowed = _allowed(eng)
    ids = eng.pair.encode_drafter(PROMPTS[0])
    params = SamplingParams() if greedy else SamplingParams(temperature=1.0)
    sess = DrafterSession(model, ids, eng.drafter.device)
    full = list(sess.draft_iter(8, 3, params, 7, allowed))
    props = [t.id for t in full]
    with torch.no_grad():
        logits = model(torch.tensor([ids + props])).logits[0, len(ids) - 1:].float()
    probs = torch.softmax(logits[:, allowed.ids], dim=-1)
    if not greedy:  # sampling: the probability of the sampled token in the (truncated) distribution it came from
        conf = [float(t.q_probs[t.q_ids.tolist().index(t.id)]) / float(t.q_probs.sum()) for t in full]
    else:
        conf = [float(probs[i, int(torch.searchsorted(allowed.ids, torch.tensor(p)))]) for i, p in enumerate(props)]
    cum = [conf[0]]
    for c in conf[1:]:
        cum.append(cum[-1] * c)
    stop_at = 3  # the 4th proposal is the first below the threshold
    tau = (cum[stop_at - 1] * cum[stop_at]) ** 0.5
    assert cum[stop_at] < tau <= cum[stop_at - 1] < 1.0
    log = FeedLog(model)
    try:
        toks = list(sess.draft_iter(8, 3, params, 7, allowed, stop_cumulative=tau))
    finally:
        log.close()
    assert [t.id for t in toks] == props[: stop_at + 1]
    assert len(log.calls) == stop_at + 1, "one forward per proposal, none after the block ended"
    assert toks[-1].last and not any(t.last for t in toks[:-1])


def test_drafter_cache_after_generation_equals_fresh_cache(eng):
    """Through the whole engine (worker, edits, re-syncs): the drafter's cache = one built from scratch."""
    model = eng.drafter.model
    sid = "cache-check"
    dw = eng.drafter_worker
    # keep the engine's sessions alive after generate() to inspect them
    ended = []
    orig_end = dw.end
    dw.end = lambda s: ended.append(s) or True
    try:
        res = eng.generate(PROMPTS[0], max_new_tokens=30,
                           draft=DraftConfig(num_draft_tokens=4, adaptive=False, stop_below=0.0, mode="tli"))
    finally:
        dw.end = orig_end
    sid = ended[-1]
    sess = dw.sessions.get(sid)
    assert res.stats.drafted > 0 and sess is not None
    assert sess.cache_repairs == 0
    # the cache holds the committed ids (a prefix of them) followed only by the last block's proposals
    c = min(len(sess.fed), len(sess.ids))
    assert sess.fed[:c] == sess.ids[:c] and sess.cache_len == len(sess.fed)
    exp_cache, _ = _expected_cache(model, sess.fed)
    for (a, b), (c, d) in zip(_kv(sess.cache), _kv(exp_cache), strict=True):
        assert torch.allclose(a, c, atol=1e-5) and torch.allclose(b, d, atol=1e-5)
    # next-token logits from the session's cache vs from scratch over the same ids
    sess.truncate_cache(len(sess.ids) - 1)
    got = sess.forward([], keep=1)[0].float()
    _, want = _expected_cache(model, sess.ids)
    assert torch.allclose(got, want, atol=1e-5)
    dw.end(sid)
    eng.verifier.end(sid)


@pytest.mark.parametrize("greedy", [True, False])
def test_rounds_feed_drafter_and_target_exactly_once(eng, greedy):
    """Whole generations: drafter forwards = drafted tokens, each later step one token; the target
    feeds the uncached tail plus the block, one forward per round."""
    dlog, tlog = FeedLog(eng.drafter.model), FeedLog(eng.target.model)
    blocks: list[int] = []  # index of the drafter call at which each block starts
    verifies: list[tuple[int, int, list[int]]] = []  # (cache_len, len(ids), drafts) at each verify
    orig_draft_iter, orig_verify = DrafterSession.draft_iter, TargetSession.verify

    block_ids: list[list[int]] = []

    def draft_iter(self, *a, **kw):
        blocks.append(len(dlog.calls))
        block_ids.append(list(self.ids))
        return orig_draft_iter(self, *a, **kw)

    def verify(self, drafts, *a, **kw):
        verifies.append((self.cache_len, list(self.ids), list(drafts)))
        return orig_verify(self, drafts, *a, **kw)

    DrafterSession.draft_iter, TargetSession.verify = draft_iter, verify
    try:
        params = SamplingParams() if greedy else SamplingParams(temperature=0.9)
        res = eng.generate(PROMPTS[1], max_new_tokens=40, params=params, seed=3,
                           draft=DraftConfig(num_draft_tokens=5, adaptive=False, stop_below=0.0, mode="tli"))
    finally:
        DrafterSession.draft_iter, TargetSession.verify = orig_draft_iter, orig_verify
        dlog.close()
        tlog.close()
    s = res.stats
    # drafter: one forward per proposal; within a block, steps after the first feed one token each
    assert len(dlog.calls) == sum(s.draft_lengths) >= s.drafted > 0
    ends = blocks[1:] + [len(dlog.calls)]
    for b, e in zip(blocks, ends, strict=True):
        for i in range(b + 1, e):
            ids_i, pos_i = dlog.calls[i]
            prev_ids, prev_pos = dlog.calls[i - 1]
            assert len(ids_i) == 1 and pos_i == [prev_pos[-1] + 1], f"drafter call {i} fed {ids_i} at {pos_i}"
    for ids_i, pos_i in dlog.calls:
        assert pos_i == list(range(pos_i[0], pos_i[0] + len(ids_i)))
    # a block's first step feeds exactly what the cache lacks: the cache holds the previous block's
    # ids + its proposals but the last; the new ids share a prefix with that (the accepted
    # proposals, or less after a re-tokenisation), and only the rest is fed
    small = 0
    for j, (b, _) in enumerate(zip(blocks, ends, strict=True)):
        ids_now = block_ids[j]
        if j == 0:
            assert dlog.calls[b] == (ids_now, list(range(len(ids_now))))  # the prompt's prefill
            continue
        pb, pe = blocks[j - 1], ends[j - 1]
        cached = block_ids[j - 1] + [dlog.calls[i][0][0] for i in range(pb + 1, pe)]
        start = min(_lcp(cached, ids_now), len(ids_now) - 1)
        assert dlog.calls[b] == (ids_now[start:], list(range(start, len(ids_now))))
        small += len(ids_now) - start <= 2
    assert small >= (len(blocks) - 1) // 2  # mostly one or two tokens: the target's, plus the last proposal
    # target: one forward per round, fed exactly ids[cache_len:] + drafts at positions cache_len..
    assert len(tlog.calls) == s.rounds == len(verifies)
    for (cache_len, ids, drafts), (fed, pos) in zip(verifies, tlog.calls, strict=True):
        assert fed == ids[cache_len:] + drafts
        assert pos == list(range(cache_len, cache_len + len(fed)))
    for cache_len, ids, _ in verifies[1:]:
        assert cache_len == len(ids) - 1  # only the target's last token is pending


def test_the_lm_head_sees_only_the_kept_rows_as_a_fresh_tensor(target):
    """Work counted in the LM head: a forward that keeps fewer rows than it feeds (a prefill, the
    drafter's first step of a block, a verification with an uncached tail) runs the head on exactly
    the kept rows, gathered into a tensor of their own. (A strided view of the feed's hidden states
    sent a bf16 head down a ~40x slower path on an AMX CPU; see commit 676e98c.)"""
    from crossdraft.runtime.sessions import OwnKV

    seen = []
    h = target.model.lm_head.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    try:
        kv = OwnKV(target.model, target.device)
        ids = list(range(5, 17))
        out = kv.run(0, ids, keep=1)  # a prefill keeping one row
        out3 = kv.run(12, [20, 21, 22, 23], keep=3)  # a block: the tail + drafts, three rows kept
    finally:
        h.remove()
    assert out.shape[0] == 1 and out3.shape[0] == 3
    assert [tuple(x.shape[:2]) for x in seen] == [(1, 1), (1, 3)]  # the head computed only the kept rows
    for x in seen:  # each a tensor of its own, not a view into the feed's [1, n, hidden] states
        assert x.storage_offset() == 0 and x.stride()[0] == x.shape[1] * x.shape[2]
    ref = OwnKV(target.model, target.device)
    full = ref.run(0, ids + [20, 21, 22, 23], keep=16)
    torch.testing.assert_close(out[0], full[11], atol=1e-5, rtol=0)
    torch.testing.assert_close(out3, full[13:16], atol=1e-5, rtol=0)


def test_text_drafting_reports_drafter_steps_per_target_token(target, drafters, monkeypatch, tmp_path):
    """Text mode: every drafting round tells the policy how many drafter forwards its block took
    and how many target-token drafts the re-encoded text gave (the policy prices drafting with it)."""
    from crossdraft.decoding.policy import DraftPolicy

    seen = []
    orig = DraftPolicy.observe_steps

    def spy(self, steps, tokens):
        seen.append((steps, tokens))
        return orig(self, steps, tokens)

    monkeypatch.setattr(DraftPolicy, "observe_steps", spy)
    eng = Engine(target, drafters["tli"], vocab_cache_dir=tmp_path)
    out = eng.generate(PROMPTS[1], max_new_tokens=24, draft=DraftConfig(num_draft_tokens=4, mode="text",
                                                                          adaptive=False))
    assert out.stats.draft_mode == "text" and out.stats.drafted > 0
    assert seen and all(1 <= s <= 4 for s, _ in seen)
    assert sum(t for _, t in seen) == out.stats.drafted  # the target-token drafts of those rounds
    seen.clear()
    eng.generate(PROMPTS[1], max_new_tokens=24, draft=DraftConfig(num_draft_tokens=4, mode="tli", adaptive=False))
    assert seen == []  # TLI: one drafter token is one target token


def test_the_round_loop_never_rechecks_a_tokenizer_table(target, drafters, monkeypatch, tmp_path):
    """The byte tables are looked up once, when the pair is built. Checking a table for staleness
    (vocab._fingerprint) costs 0.2 ms per call for Gemma-3's tokenizer and ran ~7 times per round."""
    from crossdraft.vocab import tokenbytes as V

    eng = Engine(target, drafters["tli"], vocab_cache_dir=tmp_path)
    calls = []
    orig = V._fingerprint
    monkeypatch.setattr(V, "_fingerprint", lambda tok: calls.append(1) or orig(tok))
    for mode in ("text", "tli"):
        out = eng.generate(PROMPTS[0], max_new_tokens=24, draft=DraftConfig(num_draft_tokens=4, mode=mode))
        assert out.stats.draft_mode == mode and len(out.token_ids) > 0
    assert calls == []
