"""crossdraft.vocab.pair: TokenPair (the round loop's vocabulary pair) and chat ids."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from crossdraft.errors import InvalidArgument
from crossdraft.vocab import pair as pair_module
from crossdraft.vocab.codec import decode_bytes, encode_bytes
from crossdraft.vocab.frequency import frequency_order
from crossdraft.vocab.mapping import VocabMapping
from crossdraft.vocab.pair import TokenPair
from tests.tokenizers_fixtures import bytelevel_bpe_tokenizer, sentencepiece_like_tokenizer

BL = bytelevel_bpe_tokenizer
SP = sentencepiece_like_tokenizer


def test_token_pair_runs_the_mappings_own_methods(cache_dir, monkeypatch):
    """The loop's pair uses VocabMapping.map_distribution and decode_bytes: the tested helpers
    are the ones the round loop runs."""
    sp, bl = SP(), BL()
    pair = TokenPair(sp, bl, len(sp) + 4, len(bl) + 2, vocab_cache_dir=cache_dir)
    assert pair.d2t.shape == (len(bl) + 2,) and pair.t2d.shape == (len(sp) + 4,)
    assert (pair.allowed == (pair.d2t >= 0)).all()
    calls = []
    real = VocabMapping.map_distribution
    monkeypatch.setattr(VocabMapping, "map_distribution", lambda self, *a: calls.append(1) or real(self, *a))
    ids = np.flatnonzero(pair.allowed)[:3]
    t, p = pair.map_q(ids, np.full(3, 1 / 3, np.float32))
    assert calls and (np.diff(t) > 0).all()
    text_ids = list(sp("hello world")["input_ids"])
    assert pair.target_text_bytes(text_ids) == decode_bytes(sp, text_ids)
    # no drafter: a target-only pair
    solo = TokenPair(sp)
    assert solo.mapping is None and not solo.same_vocab


def test_chat_ids_drafter_without_a_template_drafts_over_the_targets_rendering(tok_t, tok_d):
    msgs = [{"role": "user", "content": "hello world"}]
    t = copy.deepcopy(tok_t)
    t.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}[assistant] {% endif %}")
    pair = TokenPair(t, tok_d, len(t), len(tok_d))
    t_ids, d_ids = pair.chat_ids(msgs)
    text = "[user] hello world\n[assistant] "
    assert t_ids == list(t(text, add_special_tokens=False)["input_ids"])
    assert d_ids == pair.encode_drafter(text)
    # no template on the target: a clear error naming the model (not a tokenizer path)
    bare = TokenPair(tok_t, tok_d, len(tok_t), len(tok_d))
    with pytest.raises(InvalidArgument) as e:
        bare.chat_ids(msgs, "tiny-target")
    assert e.value.field == "messages" and "tiny-target has no chat template" in str(e.value)


def test_a_pairs_byte_encodings_are_remembered_and_the_same_as_uncached(cache_dir, monkeypatch):
    """TokenPair.encode_*_bytes remember short strings (the round loop encodes each round's new
    text into drafter ids): the same ids as encode_bytes, the tokenizer not asked twice, long strings
    not kept."""
    sp, bl = SP(), BL()
    pair = TokenPair(sp, bl, len(sp) + 4, len(bl) + 2, vocab_cache_dir=cache_dir)
    samples = [b" return", b"\n    ", b"x = 1", "héllo wörld".encode(), b"  ", "日本".encode()]
    for s in samples:
        assert pair.encode_drafter_bytes(s) == encode_bytes(bl, s)
        assert pair.encode_target_bytes(s) == encode_bytes(sp, s)
    calls = []
    orig = encode_bytes
    monkeypatch.setattr(pair_module, "encode_bytes", lambda *a, **kw: calls.append(a[1]) or orig(*a, **kw))
    for s in samples:
        assert pair.encode_drafter_bytes(s) == orig(bl, s)
    assert calls == []  # all remembered
    ids = pair.encode_drafter_bytes(b" return")
    ids.append(0)  # a caller's list is its own
    assert pair.encode_drafter_bytes(b" return") == orig(bl, b" return")
    long = b"y" * (pair.MEMO_BYTES + 1)
    pair.encode_drafter_bytes(long)
    pair.encode_drafter_bytes(long)
    assert calls == [long, long]


def test_draft_vocab_limits_what_the_drafter_drafts_from(cache_dir):
    sp, bl = SP(), BL()
    full = TokenPair(sp, bl, len(sp) + 4, len(bl) + 2, vocab_cache_dir=cache_dir)
    n = 120
    cut = TokenPair(sp, bl, len(sp) + 4, len(bl) + 2, vocab_cache_dir=cache_dir, draft_vocab=n)
    order = frequency_order(bl, len(bl) + 2)
    for mode in ("tli", "text"):
        m, f = cut.masks[mode], full.masks[mode]
        assert m.any() and not (m & ~f).any()  # a subset of what it was,
        assert (order[m] < n).all()  # only the n most frequent,
        assert int(m.sum()) == int((f & (order < n)).sum())  # all of those
        assert int(m.sum()) < int(f.sum()) and cut.keys[mode] != full.keys[mode]  # (the drafter's mask key)
    # the mapping itself is unchanged: the target's tokens outside the set still map (the residual)
    assert (cut.allowed == full.allowed).all() and (cut.d2t == full.d2t).all() and cut.same_vocab == full.same_vocab
    # a limit at or past the vocabulary changes nothing
    wide = TokenPair(sp, bl, len(sp) + 4, len(bl) + 2, vocab_cache_dir=cache_dir, draft_vocab=len(bl) + 2)
    assert all((wide.masks[k] == full.masks[k]).all() and wide.keys[k] == full.keys[k] for k in full.masks)


@pytest.mark.parametrize("bad", [-1, 2.5, "64", True])
def test_draft_vocab_must_be_a_count(bad, cache_dir):
    with pytest.raises(InvalidArgument) as e:
        TokenPair(SP(), BL(), vocab_cache_dir=cache_dir, draft_vocab=bad)
    assert e.value.field == "draft_vocab"
