"""Unit tests use tiny models: one thread avoids OpenMP oversubscription on small matmuls."""

import pytest
import torch

from tests.tiny_models import tiny_lm
from tests.tokenizers_fixtures import bytelevel_bpe_tokenizer, sentencepiece_like_tokenizer

torch.set_num_threads(1)


# The engine tests' tiny pair: two different tokenizers (byte-level BPE target, SentencePiece-like
# drafter), so runs exercise TLI, and a target whose head is wider than its tokenizer.
@pytest.fixture(scope="module")
def tok_t():
    return bytelevel_bpe_tokenizer()


@pytest.fixture(scope="module")
def tok_d():
    return sentencepiece_like_tokenizer()


@pytest.fixture(scope="module")
def target(tok_t):
    # head wider than the tokenizer, like Qwen's 151,936-wide head over 151,665 tokens
    return tiny_lm(tok_t, seed=1, arch="qwen2", extra_vocab=7)
