"""Tiny deterministic tokenizers for tests (no network, built in well under a second).

* :func:`bytelevel_bpe_tokenizer`: GPT-2/Qwen style byte-level BPE (``Ġ`` = space, ``Ċ`` =
  newline); specials ``<|endoftext|>`` (eos, bos), ``<|pad|>`` (pad), ``<|im_start|>``,
  ``<|im_end|>``; adds no BOS.
* :func:`sentencepiece_like_tokenizer`: SentencePiece-style BPE (``▁`` = space) with byte
  fallback ``<0x00>`` .. ``<0xFF>``; specials ``<unk>`` 0, ``<s>`` 1 (bos, added by
  ``add_special_tokens=True`` like Gemma/Llama), ``</s>`` 2 (eos), ``<pad>`` 3.
  ``add_prefix_space=False`` (default) behaves like Gemma: no ``▁`` is prepended, so every
  text round-trips. ``add_prefix_space=True`` behaves like Llama/Mistral: a ``▁`` is prepended
  to the first word and the decoder strips the first space of the output (so text that starts
  with a space does not round-trip - as with the real thing).

Both are trained on the same small built-in corpus (:data:`CORPUS`: Python code + English,
with tabs, blank lines, indentation and some non-ASCII), so their vocabularies overlap only in
part. Instances are cached per process: do not mutate them (``copy.deepcopy`` first).
"""

from __future__ import annotations

import collections
import functools
import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

__all__ = ["CORPUS", "bytelevel_bpe_tokenizer", "sentencepiece_like_tokenizer"]

_CODE = '''\
import os
import sys
from dataclasses import dataclass


@dataclass
class Point:
    """A point in the plane."""

    x: float = 0.0
    y: float = 0.0

    def norm(self) -> float:
        return (self.x ** 2 + self.y ** 2) ** 0.5

    def __add__(self, other: "Point") -> "Point":
        return Point(self.x + other.x, self.y + other.y)


def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    result = []
    a, b = 0, 1
    for _ in range(n):
        result.append(a)
        a, b = b, a + b
    return result


def read_lines(path):
\twith open(path, encoding="utf-8") as handle:
\t\tfor line in handle:
\t\t\tyield line.rstrip("\\n")


class Counter(dict):
    def add(self, key, value=1):
        if key not in self:
            self[key] = 0
        self[key] += value
        return self[key]


if __name__ == "__main__":
    for i, value in enumerate(fibonacci(10)):
        print(f"{i}: {value}")
    print(Point(3.0, 4.0).norm())
'''

_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog did not mind at all; it was asleep in
the warm afternoon sun, dreaming of the long walks it used to take along the river.

Speculative decoding lets a small model draft several tokens that a large model then checks
in a single forward pass. When the two models do not share a vocabulary, the draft must be
translated, and only tokens that stand for exactly the same text can be used.

In the morning the market opens early: bakers sell fresh bread, farmers bring apples and
pears, and the café on the corner serves coffee to everyone who passes by. Prices are shown
in euros (€) and sometimes in dollars ($). Naïve résumé writers — and their editors — argue
about “smart quotes” all day. 你好，世界! Emoji: 🙂🚀.

Numbers: 1, 2, 3, 10, 42, 100, 2024, 3.14159.
"""

CORPUS: str = _CODE + "\n\n" + _TEXT
"""The built-in training corpus; both tokenizers round-trip it exactly."""


def _training_texts() -> list[str]:
    # Line-level training texts (plus the whole corpus), fixed order -> fixed vocabulary.
    return [line + "\n" for line in CORPUS.split("\n")] * 3 + [CORPUS]


@functools.lru_cache(maxsize=None)
def bytelevel_bpe_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    specials = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_texts(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
    )


@functools.lru_cache(maxsize=None)
def sentencepiece_like_tokenizer(vocab_size: int = 350, add_prefix_space: bool = False) -> PreTrainedTokenizerFast:
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    n_trained = vocab_size - len(specials) - len(byte_tokens)
    if n_trained < 64:
        raise ValueError(f"vocab_size must be at least {len(specials) + len(byte_tokens) + 64}")

    # 1) Learn pieces and merges on "▁"-marked words (rare characters left to byte fallback).
    scheme = "first" if add_prefix_space else "never"
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme, split=True)
    # The trainer's own limit_alphabet breaks frequency ties in hash order (a different vocabulary
    # per process), so choose the alphabet here: most frequent characters, ties by code point.
    texts = _training_texts()
    counts = collections.Counter("".join(texts).replace(" ", "\u2581"))
    counts["\u2581"] += 10**9  # the space marker is always in
    keep = {c for c, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: min(60, n_trained - 32)]}
    texts = ["".join(c for c in t if c in keep or c == " ") for t in texts]
    trainer = trainers.BpeTrainer(vocab_size=n_trained, min_frequency=2, show_progress=False)
    learner.train_from_iterator(texts, trainer=trainer)
    learned = json.loads(learner.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    pieces = sorted(learned["vocab"].items(), key=lambda kv: kv[1])

    # 2) Final vocabulary: specials, the 256 byte-fallback tokens, then the learned pieces.
    vocab: dict[str, int] = {}
    for t in [*specials, *byte_tokens, *(p for p, _ in pieces)]:
        vocab.setdefault(t, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme, split=True)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )
