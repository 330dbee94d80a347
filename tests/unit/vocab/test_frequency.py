"""crossdraft.vocab.frequency: a tokenizer's own frequency order."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from crossdraft.vocab.frequency import frequency_order


def _bpe_with_shuffled_ids():
    """A BPE tokenizer whose merged tokens' ids run against their merges' order (as Gemma-3's do):
    the frequency order must follow the merges, not the ids."""
    base = list("abcdxyz ")
    merges = [("a", "b"), ("ab", "c"), ("x", "y"), ("xy", "z"), ("c", "d")]
    made = ["ab", "abc", "xy", "xyz", "cd"]
    vocab = {t: i for i, t in enumerate(base)}
    for j, t in enumerate(reversed(made)):  # the first merge gets the highest id
        vocab[t] = len(base) + j
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok), vocab, base, made


def test_frequency_order_follows_the_merges_not_the_ids():
    tok, vocab, base, made = _bpe_with_shuffled_ids()
    order = frequency_order(tok, len(vocab) + 3)  # 3 rows past the tokenizer (a wider head)
    assert sorted(order.tolist()) == list(range(len(vocab) + 3))  # a permutation
    assert [int(order[vocab[t]]) for t in base] == list(range(len(base)))  # base symbols first, by id
    assert [int(order[vocab[t]]) for t in made] == list(range(len(base), len(base) + len(made)))  # merge order
    assert order[len(vocab):].tolist() == [len(vocab), len(vocab) + 1, len(vocab) + 2]  # rows past it last


def test_frequency_order_of_a_unigram_model_follows_the_scores():
    pieces = [("<unk>", 0.0), ("a", -5.0), ("b", -1.0), ("ab", -3.0), ("c", -2.0)]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.Unigram(pieces, unk_id=0)))
    order = frequency_order(tok)
    # by score: <unk> 0, b -1, c -2, ab -3, a -5
    assert order.tolist() == [0, 4, 1, 3, 2]


def test_frequency_order_without_a_model_is_the_id_order():
    class Plain:
        def __len__(self):
            return 5

    assert frequency_order(Plain()).tolist() == [0, 1, 2, 3, 4]
