"""Same-family vocabularies that differ only by padding take the same-vocabulary fast path (issue 41).

A model's logit rows may outnumber its tokenizer's tokens (Qwen2.5's small models have 151,936 rows,
the 7B+ ones 152,064; Llama variants carry extra reserved ids). A pair of two such models shares one
vocabulary: greedy drafting runs in TLI (d2t the identity, no text re-encoding), and the drafter never
proposes a padding row -- an id with no token in the tokenizer, or one past the target's rows.

Real tokenizers (the suite's trained ones) and tiny random models; one side's embedding is padded with
``resize_token_embeddings``.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from crossdraft.engine import DraftConfig, Engine
from crossdraft.vocab.pair import TokenPair
from tests.tiny_models import noisy_copy, tiny_lm
from tests.tokenizers_fixtures import bytelevel_bpe_tokenizer, sentencepiece_like_tokenizer

PAD = 128
TOKENIZERS = {"bytelevel": bytelevel_bpe_tokenizer, "sentencepiece": sentencepiece_like_tokenizer}


def _check_same_vocab(pair: TokenPair, n_tokens: int) -> None:
    """same_vocab, and neither mask allows a padding row; d2t (and t2d) the identity on what is allowed."""
    assert pair.same_vocab
    for mode in ("tli", "text"):
        ids = np.nonzero(pair.masks[mode])[0]
        assert len(ids) > 0 and ids.max() < min(n_tokens, pair.vt, pair.vd)
    ids = np.nonzero(pair.allowed)[0]
    assert (pair.masks["tli"] == pair.allowed).all() and (pair.masks["text"] == pair.allowed).all()
    assert (pair.d2t[ids] == ids).all() and (pair.t2d[ids] == ids).all()
    assert (pair.d2t[pair.d2t >= 0] < pair.vt).all()
    assert np.count_nonzero(pair.d2t >= 0) == np.count_nonzero(pair.t2d >= 0) == len(ids)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_padded_rows_on_either_side_keep_the_same_vocabulary(name, cache_dir):
    tok = TOKENIZERS[name]()
    n = len(tok)
    plain = TokenPair(tok, tok, n, n, vocab_cache_dir=cache_dir)
    assert plain.same_vocab
    keys = {tuple(plain.keys.values())}
    for vt, vd in [(n + PAD, n), (n, n + PAD), (n + PAD, n + 2 * PAD), (n + 2 * PAD, n + PAD)]:
        pair = TokenPair(tok, tok, vt, vd, vocab_cache_dir=cache_dir)
        assert (pair.vt, pair.vd) == (vt, vd) and len(pair.allowed) == len(pair.d2t) == vd and len(pair.t2d) == vt
        _check_same_vocab(pair, n)
        assert (pair.allowed[:n] == plain.allowed).all()  # the same tokens as without padding, no more
        keys.add(tuple(pair.keys.values()))
    assert len(keys) == 5  # a drafter caches one mask per (vt, vd): each pair names its own


def test_a_target_with_fewer_rows_than_the_drafter_bounds_the_drafts(cache_dir):
    """Rows past the target's (here even inside the tokenizer) are never allowed: the target has no such id."""
    tok = bytelevel_bpe_tokenizer()
    n = len(tok)
    pair = TokenPair(tok, tok, n - 10, n + PAD, vocab_cache_dir=cache_dir)
    assert not pair.allowed[n - 10:].any() and (pair.d2t[pair.d2t >= 0] < n - 10).all()
    # the drafter's text tokens would include ids the target cannot take: text drafting is not the same
    assert not pair.same_vocab


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("wider", ["target", "drafter"])
def test_extra_reserved_ids_keep_the_same_vocabulary(name, wider, cache_dir):
    """A Llama variant with extra reserved special ids, a GGUF Qwen with ``[PADnnn]`` placeholder tokens:
    the same vocabulary, and neither the reserved ids nor the padding rows past them are ever drafted."""
    base = TOKENIZERS[name]()
    n = len(base)
    extra = copy.deepcopy(base)
    extra.add_special_tokens({"additional_special_tokens": [f"<|reserved_special_token_{i}|>" for i in range(5)]})
    extra.add_tokens([f"[PAD{n + 5 + i}]" for i in range(3)])  # plain vocabulary, like the GGUF placeholders
    assert len(extra) == n + 8
    target, drafter = (extra, base) if wider == "target" else (base, extra)
    pair = TokenPair(target, drafter, len(target) + PAD, len(drafter) + PAD, vocab_cache_dir=cache_dir)
    _check_same_vocab(pair, n)


# ---- the engine: one side's embedding padded ---------------------------------------------------------------

PROMPTS = ["def add(a, b):\n    return", "The quick brown fox"]
N_NEW = 24
FIXED = DraftConfig(num_draft_tokens=4, adaptive=False)


class DraftedIds:
    """The drafter port, wrapped: every id it drafts and every id of its distributions."""

    def __init__(self, inner):
        self.inner = inner
        self.ids: list[int] = []
        self.q_ids: list[int] = []

    def draft(self, *a, **kw):
        toks = self.inner.draft(*a, **kw)
        self.ids.extend(int(t.id) for t in toks)
        for t in toks:
            if t.q_ids is not None:  # (greedy blocks carry none)
                self.q_ids.extend(int(x) for x in np.asarray(t.q_ids).ravel())
        return toks

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _pad(lm, rows: torch.Tensor | None) -> None:
    """``lm``'s embedding and head padded by PAD rows: zero rows (a trained model's padding), or ``rows``."""
    n = lm.model.get_input_embeddings().weight.shape[0]
    lm.model.resize_token_embeddings(n + PAD, mean_resizing=False)
    with torch.no_grad():
        head = lm.model.get_output_embeddings().weight
        head[n:] = 0.0 if rows is None else rows
        lm.model.get_input_embeddings().weight[n:] = 0.0
    lm.vocab_size = n + PAD
    assert lm.model.config.vocab_size == n + PAD


@pytest.fixture(scope="module")
def models():
    tok = bytelevel_bpe_tokenizer()
    target = tiny_lm(tok, seed=1, arch="qwen2", head_scale=8.0, with_eos=False)
    drafter = noisy_copy(target, 0.25, seed=5)
    return tok, target, drafter


@pytest.mark.parametrize("padded", ["drafter", "target"])
def test_greedy_with_a_padded_embedding_is_identical_and_never_drafts_a_padded_id(models, padded, tmp_path):
    tok, target, drafter = models
    n = len(tok)
    target, drafter = copy.deepcopy(target), copy.deepcopy(drafter)
    if padded == "target":
        _pad(target, None)
    else:
        # padding rows that would win: scaled-up copies of the largest rows, so a drafter that did not mask
        # them would propose one at every position
        head = drafter.model.get_output_embeddings().weight.detach()
        _pad(drafter, 3.0 * head[torch.argsort(head.norm(dim=1), descending=True)[:PAD]])
    eng = Engine(target, drafter, vocab_cache_dir=tmp_path)
    assert eng.same_vocab
    allowed = np.nonzero(eng.allowed)[0]
    assert allowed.max() < n and (eng.d2t[allowed] == allowed).all()

    port = DraftedIds(eng.decoder.drafter)
    eng.decoder.drafter = port
    accepted = would_pad = positions = 0
    for prompt in PROMPTS:
        ref = eng.generate(prompt, max_new_tokens=N_NEW, use_drafter=False)
        out = eng.generate(prompt, max_new_tokens=N_NEW, draft=FIXED)
        assert out.token_ids == ref.token_ids and out.text == ref.text
        assert out.stats.mode == "speculative" and out.stats.draft_mode == "tli" and out.stats.drafted > 0
        accepted += out.stats.accepted
        if padded == "drafter":  # without its mask the drafter would have proposed padding rows here
            ids = torch.tensor([tok(prompt)["input_ids"] + ref.token_ids])
            with torch.no_grad():
                logits = drafter.model(input_ids=ids).logits[0]
            would_pad += int((logits.argmax(-1) >= n).sum())
            positions += len(logits)
    assert accepted > 0
    assert would_pad == positions and (positions > 0) == (padded == "drafter")
    assert port.ids and max(port.ids) < n and all(eng.allowed[i] for i in port.ids)
    assert not port.q_ids or max(port.q_ids) < n
