"""The gateway's tokenization caches stay bounded however much new text passes through it
(gateway.server.bound_caches): TokenPair's memo of short re-encodings and the word caches of
the Rust BPE tokenizers. Unbounded by the gateway, they grew with every new word a soak's random
models spelled, and the gateway's RSS with them."""

from __future__ import annotations

import random

import pytest

from crossdraft.vocab.pair import TokenPair
from gateway.server import MEMO_ENTRIES, TOKENIZER_CACHE_WORDS, bound_caches, token_pair
from tests.tokenizers_fixtures import bytelevel_bpe_tokenizer, sentencepiece_like_tokenizer


@pytest.fixture(scope="module")
def toks():
    return bytelevel_bpe_tokenizer(), sentencepiece_like_tokenizer()


def _words(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(n)]


def test_the_memo_holds_at_most_its_bound_after_many_new_strings(toks):
    t, d = toks
    pair = token_pair(t, d, len(t), len(d))
    assert pair.MEMO_SIZE == MEMO_ENTRIES
    bound_caches(pair, memo=50)
    for w in _words(400):  # 800 distinct short strings: each round re-encodes a new one
        pair.encode_drafter_bytes(w.encode())
        pair.encode_target_bytes(w.encode())
        assert len(pair._memo) <= 50
    assert TokenPair.MEMO_SIZE > 50  # (the class's default stays: only the gateway's pair is bounded)


def test_both_tokenizers_word_caches_are_bounded_and_encode_the_same(toks):
    t, d = toks
    words = _words(300, seed=1)
    before = [(t(w)["input_ids"], d(w)["input_ids"]) for w in words]
    pair = TokenPair(t, d, len(t), len(d))
    assert bound_caches(pair, words=16) == 2  # both are BPE tokenizers with a word cache
    assert [(t(w)["input_ids"], d(w)["input_ids"]) for w in words] == before
    bound_caches(pair)  # (back to the gateway's bound for the other tests of this module)


class _Model:
    def __init__(self):
        self.sizes = []

    def _resize_cache(self, n):
        self.sizes.append(n)


class _Tok:
    def __init__(self, model):
        self.backend_tokenizer = type("Backend", (), {"model": model})()


def test_each_tokenizer_gets_the_bound_and_one_without_a_cache_is_left_alone():
    m = _Model()
    pair = type("Pair", (), {"target_tok": _Tok(m), "drafter_tok": object(), "MEMO_SIZE": 16384})()
    assert bound_caches(pair) == 1
    assert m.sizes == [TOKENIZER_CACHE_WORDS] and pair.MEMO_SIZE == MEMO_ENTRIES
    pair.drafter_tok = None  # target-only
    assert bound_caches(pair, words=7, memo=9) == 1 and m.sizes[-1] == 7 and pair.MEMO_SIZE == 9
