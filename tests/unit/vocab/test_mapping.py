"""crossdraft.vocab.mapping: the drafter <-> target mapping, its rules, resizing and distributions."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from crossdraft.vocab.mapping import VocabMapping, build_mapping
from crossdraft.vocab.tokenbytes import byte_table, token_bytes
from tests.tokenizers_fixtures import CORPUS, bytelevel_bpe_tokenizer, sentencepiece_like_tokenizer
from tests.unit.vocab.checks import in_context_mismatches, token_id

BL = bytelevel_bpe_tokenizer
SP = sentencepiece_like_tokenizer


def SPP():
    return sentencepiece_like_tokenizer(add_prefix_space=True)


def _check_consistent(m: VocabMapping, target, drafter):
    tb, db = token_bytes(target), token_bytes(drafter)
    assert m.d2t.dtype == np.int64 and m.t2d.dtype == np.int64
    assert m.d2t.shape == (len(drafter),) and m.t2d.shape == (len(target),)
    for d in np.flatnonzero(m.d2t >= 0):
        t = m.d2t[d]
        assert db[d] is not None and db[d] == tb[t]
        assert m.t2d[t] >= 0 and db[m.t2d[t]] == db[d]
    for t in np.flatnonzero(m.t2d >= 0):
        assert m.d2t[m.t2d[t]] == t
    assert m.intersection_size() == len(np.unique(m.d2t[m.d2t >= 0]))
    # nothing special is ever mapped
    for d in byte_table(drafter).special:
        assert m.d2t[d] == -1
    for t in byte_table(target).special:
        assert m.t2d[t] == -1


@pytest.mark.parametrize("t_make, d_make", [(BL, SP), (SP, BL), (BL, SPP), (SPP, SP)])
def test_fixture_pairs_partial_and_consistent(t_make, d_make, cache_dir):
    target, drafter = t_make(), d_make()
    m = build_mapping(target, drafter, cache_dir=cache_dir)
    st = m.stats()
    assert 0 < st["intersection_size"] < min(len(target), len(drafter))
    assert st["drafter_vocab_size"] == len(drafter) and st["target_vocab_size"] == len(target)
    assert 0 < st["drafter_coverage"] < 1 and 0 < st["target_coverage"] < 1
    _check_consistent(m, target, drafter)


@pytest.mark.parametrize("t_make, d_make", [(BL, SP), (SP, BL), (BL, SPP), (SPP, BL)])
def test_every_mapped_pair_decodes_identically(t_make, d_make, cache_dir):
    target, drafter = t_make(), d_make()
    m = build_mapping(target, drafter, cache_dir=cache_dir)
    pairs = [(int(d), int(m.d2t[d])) for d in np.flatnonzero(m.d2t >= 0)]
    assert pairs
    assert in_context_mismatches(drafter, target, pairs) == []


def test_many_to_one_and_canonical_ids(cache_dir):
    sp, bl = SP(), BL()
    # drafter SP: "a" and its byte-fallback twin <0x61> both map to the target's "a"
    m = build_mapping(bl, sp, cache_dir=cache_dir)
    a_sp, a_bf, a_bl = token_id(sp, "a"), token_id(sp, "<0x61>"), token_id(bl, "a")
    assert m.d2t[a_sp] == a_bl and m.d2t[a_bf] == a_bl
    assert m.t2d[a_bl] == a_sp  # canonical drafter id: the non-byte-fallback one
    assert m.stats()["many_to_one"] > 0
    # target SP: the target's canonical id for b"a" is "a", not <0x61>
    m2 = build_mapping(sp, bl, cache_dir=cache_dir)
    assert m2.d2t[a_bl] == a_sp
    assert m2.t2d[a_bf] == -1  # non-canonical duplicate: outside the intersection
    assert m2.stats()["many_to_one"] == 0
    # a byte only SP spells with byte fallback maps to that byte-fallback token
    assert m2.d2t[token_id(bl, "Ã")] == token_id(sp, "<0xC3>")


def test_identical_vocabularies_give_identity(cache_dir):
    for tok in (BL(), SP()):
        other = copy.deepcopy(tok)
        m = build_mapping(tok, other, cache_dir=cache_dir)
        tb = token_bytes(tok)
        ok = np.array([b is not None for b in tb])
        ids = np.arange(len(tok))
        assert (m.d2t[ok] == ids[ok]).all() and (m.t2d[ok] == ids[ok]).all()
        assert (m.d2t[~ok] == -1).all() and (m.t2d[~ok] == -1).all()
        assert m.intersection_size() == ok.sum()


def test_allowed_drafter_mask_and_stats(cache_dir):
    m = build_mapping(BL(), SP(), cache_dir=cache_dir)
    mask = m.allowed_drafter_mask()
    assert mask.dtype == bool and mask.shape == (len(SP()),)
    assert (mask == (m.d2t >= 0)).all()
    wide = m.allowed_drafter_mask(len(SP()) + 7)
    assert wide.shape == (len(SP()) + 7,) and not wide[len(SP()):].any() and (wide[: len(SP())] == mask).all()
    assert (m.allowed_drafter_mask(10) == mask[:10]).all()
    st = m.stats()
    assert set(st) >= {"drafter_vocab_size", "target_vocab_size", "intersection_size", "drafter_coverage",
                       "target_coverage", "many_to_one", "key"}
    assert st["key"] == m.key and len(m.key) == 64
    with pytest.raises(ValueError):
        m.d2t[0] = 5  # cached arrays are read-only


def test_resized_mapping_covers_the_models_rows(cache_dir):
    m = build_mapping(BL(), SP(), cache_dir=cache_dir)
    nd, nt = m.drafter_vocab_size, m.target_vocab_size
    # wider logits than tokenizers (padded embeddings): the extra rows map nowhere
    w = m.resized(nd + 5, nt + 3)
    assert w.d2t.shape == (nd + 5,) and w.t2d.shape == (nt + 3,)
    assert (w.d2t[:nd] == m.d2t).all() and (w.d2t[nd:] == -1).all() and (w.t2d[nt:] == -1).all()
    assert (w.allowed_drafter_mask() == np.r_[m.d2t >= 0, np.zeros(5, bool)]).all()
    # narrower: ids that land beyond the other side's rows are dropped from the mapping
    cut = 40
    n = m.resized(nd, cut)
    assert (n.d2t < cut).all() and ((n.d2t >= 0) == ((m.d2t >= 0) & (m.d2t < cut))).all()
    assert n.key == m.key and not n.d2t.flags.writeable


def test_map_distribution_sums_many_to_one(cache_dir):
    sp, bl = SP(), BL()
    m = build_mapping(bl, sp, cache_dir=cache_dir)  # drafter SP -> target BL: "a" and <0x61> both map to "a"
    counts = np.bincount(m.d2t[m.d2t >= 0])
    t_many = int(np.flatnonzero(counts > 1)[0])
    dups = np.flatnonzero(m.d2t == t_many)
    other = int(np.flatnonzero((m.d2t >= 0) & (m.d2t != t_many))[0])
    q_ids = np.array([other, *dups], dtype=np.int32)
    q_probs = np.array([0.5] + [0.5 / len(dups)] * len(dups), dtype=np.float32)
    t, p = m.map_distribution(q_ids, q_probs)
    assert list(t) == sorted({int(m.d2t[other]), t_many}) and p.dtype == np.float64
    assert p[list(t).index(t_many)] == pytest.approx(0.5) and p.sum() == pytest.approx(1.0)
    with pytest.raises(ValueError):
        m.map_distribution(np.flatnonzero(m.d2t < 0)[:1], np.array([1.0], np.float32))


def test_slow_sentencepiece_tokenizer(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    import io

    from transformers.models.bert_generation import BertGenerationTokenizer

    buf = io.BytesIO()
    lines = [line for line in CORPUS.split("\n") if line.strip()] * 3
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=400, model_type="bpe", byte_fallback=True,
        character_coverage=0.98, num_threads=1, minloglevel=2, control_symbols=["<ctrl>"],
    )
    (tmp_path / "sp.model").write_bytes(buf.getvalue())
    tok = BertGenerationTokenizer(vocab_file=str(tmp_path / "sp.model"))
    table = byte_table(tok)
    assert table.method == "sentencepiece"
    tb = table.bytes
    assert tb[token_id(tok, "▁the")] == b" the"
    assert tb[tok.convert_tokens_to_ids("<ctrl>")] is None and tb[tok.unk_token_id] is None
    # transformers' Python decode prints byte-fallback pieces literally ("<0x0A>"), so they are
    # excluded rather than claimed to be a byte the decoder does not produce
    assert tb[token_id(tok, "<0x0A>")] in (None, b"\n")
    m = build_mapping(BL(), tok, cache_dir=tmp_path / "vocab")
    pairs = [(int(d), int(m.d2t[d])) for d in np.flatnonzero(m.d2t >= 0)]
    assert len(pairs) > 50
    assert in_context_mismatches(tok, BL(), pairs) == []
