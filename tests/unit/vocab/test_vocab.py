"""crossdraft.vocab.mapping: token bytes, drafter <-> target mapping, caches, and the tiny tokenizers."""

from __future__ import annotations

import copy
import itertools
import os

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from crossdraft.errors import InvalidArgument
from crossdraft.vocab import mapping as V
from tests.tokenizers_fixtures import CORPUS, bytelevel_bpe_tokenizer, sentencepiece_like_tokenizer

# ----------------------------------------------------------------------------------------------
# Helpers (also used by tests/integration/test_vocab_real.py)
# ----------------------------------------------------------------------------------------------

# Bytes put around a token so that a partial UTF-8 token becomes decodable text.
_PREFIXES = [b"", b"\xc3", b"\xe4", b"\xe4\x80", b"\xf1", b"\xf1\x80", b"\xf1\x80\x80"]
_SUFFIXES = [b"", b"\x80", b"\xa5", b"\x80\x80", b"\xa5\x80", b"\x90\x80", b"\x80\x80\x80", b"\x90\x80\x80"]


def utf8_frame(b: bytes) -> tuple[bytes, bytes] | None:
    for p, s in itertools.product(_PREFIXES, _SUFFIXES):
        try:
            (p + b + s).decode("utf-8")
            return p, s
        except UnicodeDecodeError:
            continue
    return None


class ContextDecoder:
    """Decodes ids after a plain one-letter anchor token, so no leading space gets stripped."""

    def __init__(self, tok):
        self.tok = tok
        table = V.token_bytes(tok)
        raw = tok.convert_ids_to_tokens(list(range(len(tok))))
        self.anchor = next(i for i, b in enumerate(table) if b == b"a" and not raw[i].startswith("<0x"))
        self.anchor_text = self._decode([self.anchor])
        assert self.anchor_text == "a"
        self.byte_id = {}
        for i, b in enumerate(table):
            if b is not None and len(b) == 1:
                self.byte_id.setdefault(b[0], i)

    def _decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def text(self, prefix: bytes, token_id: int, suffix: bytes) -> str:
        ids = [self.anchor, *(self.byte_id[c] for c in prefix), token_id, *(self.byte_id[c] for c in suffix)]
        return self._decode(ids)


def in_context_mismatches(tok_a, tok_b, pairs) -> list[tuple]:
    """Pairs (id_a, id_b) whose in-context decodes differ (bytes-exact where UTF-8 allows)."""
    ca, cb = ContextDecoder(tok_a), ContextDecoder(tok_b)
    bytes_a = V.token_bytes(tok_a)
    bad = []
    for ia, ib in pairs:
        b = bytes_a[ia]
        frame = utf8_frame(b)
        if frame is None:  # cannot be made valid text: compare what the decoders print
            ta, tb = ca.text(b"", ia, b""), cb.text(b"", ib, b"")
            ok = ta == tb
            expected = None
        else:
            p, s = frame
            expected = "a" + (p + b + s).decode("utf-8")
            ta, tb = ca.text(p, ia, s), cb.text(p, ib, s)
            ok = ta == expected and tb == expected
        if not ok:
            bad.append((ia, ib, b, expected, ta, tb))
    return bad


def _id(tok, token: str) -> int:
    i = tok.convert_tokens_to_ids(token)
    assert i is not None and i != tok.unk_token_id, token
    return i


@pytest.fixture
def cache_dir(tmp_path):
    V.clear_memory_cache()
    yield tmp_path / "vocab"
    V.clear_memory_cache()


BL = bytelevel_bpe_tokenizer
SP = sentencepiece_like_tokenizer


def SPP():
    return sentencepiece_like_tokenizer(add_prefix_space=True)


# ----------------------------------------------------------------------------------------------
# Fixture tokenizers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [BL, SP, SPP], ids=["bytelevel", "sp", "sp-prefix"])
def test_fixture_roundtrips_corpus(make):
    tok = make()
    ids = tok(CORPUS, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == CORPUS
    assert all(i not in tok.all_special_ids for i in ids)


def test_fixtures_deterministic_and_cached():
    assert BL() is BL() and SP() is SP()
    fresh_bl = bytelevel_bpe_tokenizer.__wrapped__()
    fresh_sp = sentencepiece_like_tokenizer.__wrapped__()
    assert fresh_bl.get_vocab() == BL().get_vocab()
    assert fresh_sp.get_vocab() == SP().get_vocab()
    assert len(BL()) == 400 and len(SP()) == 350
    assert BL().eos_token == "<|endoftext|>" and SP().eos_token == "</s>"
    assert SP()("hi")["input_ids"][0] == SP().bos_token_id  # BOS like Gemma/Llama
    assert BL()("hi")["input_ids"][0] != BL().bos_token_id


def test_fixtures_differ_but_overlap():
    a, b = set(V.token_bytes(BL())) - {None}, set(V.token_bytes(SP())) - {None}
    assert a != b
    assert 0 < len(a & b) < min(len(a), len(b))
    assert BL().get_vocab() != SP().get_vocab()


# ----------------------------------------------------------------------------------------------
# token_bytes
# ----------------------------------------------------------------------------------------------


def test_bytelevel_symbols():
    tok = BL()
    tb = V.token_bytes(tok)
    assert len(tb) == len(tok)
    assert tb[_id(tok, "Ġ")] == b" "
    assert tb[_id(tok, "Ċ")] == b"\n"
    assert tb[_id(tok, "ĉ")] == b"\t"
    assert tb[_id(tok, "ĊĠĠĠ")] == b"\n   "
    assert tb[_id(tok, "Ã©")] == "é".encode()
    assert tb[_id(tok, "Ġreturn")] == b" return"
    # every one of the 256 byte symbols stands for its own single byte
    singles = {tb[_id(tok, V._BYTE_ENCODER[b])] for b in range(256)}
    assert singles == {bytes([b]) for b in range(256)}


def test_sentencepiece_pieces_and_byte_fallback():
    tok = SP()
    tb = V.token_bytes(tok)
    assert tb[_id(tok, "▁the")] == b" the"
    assert tb[_id(tok, "▁")] == b" "
    assert tb[_id(tok, "<0x0A>")] == b"\n"
    assert tb[_id(tok, "<0x20>")] == b" "
    assert tb[_id(tok, "<0xC3>")] == b"\xc3"
    assert tb[_id(tok, "é")] == "é".encode()


def test_leading_space_not_stripped():
    tok = SPP()  # Llama-style: the decoder strips the first space of the output
    i = _id(tok, "▁the")
    assert tok.decode([i]) == "the"
    assert V.token_bytes(tok)[i] == b" the"


def _handmade(decoder, extra_vocab=()):
    vocab = {"<unk>": 0, "<s>": 1, "a": 2, "f": 3, "o": 4, "▁": 5, "▁f": 6, "▁fo": 7, "▁foo": 8, "<0x0A>": 9, "ab": 10}
    for t in extra_vocab:
        vocab[t] = len(vocab)
    merges = [("▁", "f"), ("▁f", "o"), ("▁fo", "o")]
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    t.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    t.decoder = decoder
    t.add_special_tokens(["<unk>", "<s>"])
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>")


def test_metaspace_decoder_variants():
    for dec in (
        decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]),
        decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")]),
        decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                           decoders.Strip(" ", 1, 0)]),
    ):
        tok = _handmade(dec)
        tb = V.token_bytes(tok)
        assert tb[8] == b" foo", dec
        assert tb[9] == b"\n"
        assert tb[0] is None and tb[1] is None
        assert V._table(tok).disagreements == 0


def test_unknown_decoder_falls_back_to_decoding():
    tok = _handmade(decoders.WordPiece(prefix="##", cleanup=False), extra_vocab=("##b",))
    table = V._table(tok)
    assert table.method == "decoded"
    tb = table.bytes
    assert tb[_id(tok, "##b")] == b"b"
    assert tb[_id(tok, "ab")] == b" ab"  # a WordPiece word is preceded by a space mid-text


def test_specials_excluded():
    tok = copy.deepcopy(BL())
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>", "<reserved>"]})
    tok.add_tokens(["<|not_marked|>", "[PAD123]", "<unused7>", "\n\n\n", "<tool>", "café"])
    tb = V.token_bytes(tok)
    for t in ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|tool|>", "<reserved>",
              "<|not_marked|>", "[PAD123]", "<unused7>"]:
        assert tb[_id(tok, t)] is None, t
    assert tb[_id(tok, "\n\n\n")] == b"\n\n\n"  # a non-special added token is text
    assert tb[_id(tok, "<tool>")] == b"<tool>"
    # byte-level decoders turn the added "café" into "caf\ufffd" (é is also byte 0xE9's symbol)
    assert tok.decode([_id(tok, "café")]) != "café"
    assert tb[_id(tok, "café")] is None
    for t in ["<s>", "</s>", "<unk>", "<pad>"]:
        assert V.token_bytes(SP())[SP().convert_tokens_to_ids(t)] is None


def test_token_bytes_memoized_and_refreshed_after_add_tokens():
    tok = copy.deepcopy(SP())
    first = V._table(tok)
    assert V._table(tok) is first
    tok.add_tokens(["zzqq"])
    second = V._table(tok)
    assert second is not first and len(second.bytes) == len(tok) == len(first.bytes) + 1
    assert second.bytes[-1] == b"zzqq"


# ----------------------------------------------------------------------------------------------
# Mapping
# ----------------------------------------------------------------------------------------------


def _check_consistent(m: V.VocabMapping, target, drafter):
    tb, db = V.token_bytes(target), V.token_bytes(drafter)
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
    for d in V._table(drafter).special:
        assert m.d2t[d] == -1
    for t in V._table(target).special:
        assert m.t2d[t] == -1


@pytest.mark.parametrize("t_make, d_make", [(BL, SP), (SP, BL), (BL, SPP), (SPP, SP)])
def test_fixture_pairs_partial_and_consistent(t_make, d_make, cache_dir):
    target, drafter = t_make(), d_make()
    m = V.build_mapping(target, drafter, cache_dir=cache_dir)
    st = m.stats()
    assert 0 < st["intersection_size"] < min(len(target), len(drafter))
    assert st["drafter_vocab_size"] == len(drafter) and st["target_vocab_size"] == len(target)
    assert 0 < st["drafter_coverage"] < 1 and 0 < st["target_coverage"] < 1
    _check_consistent(m, target, drafter)


@pytest.mark.parametrize("t_make, d_make", [(BL, SP), (SP, BL), (BL, SPP), (SPP, BL)])
def test_every_mapped_pair_decodes_identically(t_make, d_make, cache_dir):
    target, drafter = t_make(), d_make()
    m = V.build_mapping(target, drafter, cache_dir=cache_dir)
    pairs = [(int(d), int(m.d2t[d])) for d in np.flatnonzero(m.d2t >= 0)]
    assert pairs
    assert in_context_mismatches(drafter, target, pairs) == []


def test_many_to_one_and_canonical_ids(cache_dir):
    sp, bl = SP(), BL()
    # drafter SP: "a" and its byte-fallback twin <0x61> both map to the target's "a"
    m = V.build_mapping(bl, sp, cache_dir=cache_dir)
    a_sp, a_bf, a_bl = _id(sp, "a"), _id(sp, "<0x61>"), _id(bl, "a")
    assert m.d2t[a_sp] == a_bl and m.d2t[a_bf] == a_bl
    assert m.t2d[a_bl] == a_sp  # canonical drafter id: the non-byte-fallback one
    assert m.stats()["many_to_one"] > 0
    # target SP: the target's canonical id for b"a" is "a", not <0x61>
    m2 = V.build_mapping(sp, bl, cache_dir=cache_dir)
    assert m2.d2t[a_bl] == a_sp
    assert m2.t2d[a_bf] == -1  # non-canonical duplicate: outside the intersection
    assert m2.stats()["many_to_one"] == 0
    # a byte only SP spells with byte fallback maps to that byte-fallback token
    assert m2.d2t[_id(bl, "Ã")] == _id(sp, "<0xC3>")


def test_identical_vocabularies_give_identity(cache_dir):
    for tok in (BL(), SP()):
        other = copy.deepcopy(tok)
        m = V.build_mapping(tok, other, cache_dir=cache_dir)
        tb = V.token_bytes(tok)
        ok = np.array([b is not None for b in tb])
        ids = np.arange(len(tok))
        assert (m.d2t[ok] == ids[ok]).all() and (m.t2d[ok] == ids[ok]).all()
        assert (m.d2t[~ok] == -1).all() and (m.t2d[~ok] == -1).all()
        assert m.intersection_size() == ok.sum()


def test_allowed_drafter_mask_and_stats(cache_dir):
    m = V.build_mapping(BL(), SP(), cache_dir=cache_dir)
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
    m = V.build_mapping(BL(), SP(), cache_dir=cache_dir)
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
    m = V.build_mapping(bl, sp, cache_dir=cache_dir)  # drafter SP -> target BL: "a" and <0x61> both map to "a"
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


def test_token_pair_runs_the_mappings_own_methods(cache_dir, monkeypatch):
    """The loop's pair uses VocabMapping.map_distribution and decode_bytes: the tested helpers
    are the ones the round loop runs."""
    sp, bl = SP(), BL()
    pair = V.TokenPair(sp, bl, len(sp) + 4, len(bl) + 2, vocab_cache_dir=cache_dir)
    assert pair.d2t.shape == (len(bl) + 2,) and pair.t2d.shape == (len(sp) + 4,)
    assert (pair.allowed == (pair.d2t >= 0)).all()
    calls = []
    real = V.VocabMapping.map_distribution
    monkeypatch.setattr(V.VocabMapping, "map_distribution", lambda self, *a: calls.append(1) or real(self, *a))
    ids = np.flatnonzero(pair.allowed)[:3]
    t, p = pair.map_q(ids, np.full(3, 1 / 3, np.float32))
    assert calls and (np.diff(t) > 0).all()
    text_ids = list(sp("hello world")["input_ids"])
    assert pair.target_text_bytes(text_ids) == V.decode_bytes(sp, text_ids)
    # no drafter: a target-only pair
    solo = V.TokenPair(sp)
    assert solo.mapping is None and not solo.same_vocab


# ----------------------------------------------------------------------------------------------
# Caches
# ----------------------------------------------------------------------------------------------


def test_memory_and_disk_cache(cache_dir, monkeypatch):
    m1 = V.build_mapping(BL(), SP(), cache_dir=cache_dir)
    path = cache_dir / f"{m1.key}.npz"
    assert path.is_file()
    assert [p.name for p in cache_dir.iterdir()] == [path.name]  # no temp files left behind
    assert V.build_mapping(BL(), SP(), cache_dir=cache_dir) is m1  # memory hit

    V._MEMORY.clear()

    def boom(*a, **k):
        raise AssertionError("should have been loaded from disk")

    monkeypatch.setattr(V, "_compute", boom)
    m2 = V.build_mapping(BL(), SP(), cache_dir=cache_dir)
    assert m2 is not m1 and m2.key == m1.key
    assert (m2.d2t == m1.d2t).all() and (m2.t2d == m1.t2d).all()
    # the key depends on the direction
    monkeypatch.undo()
    assert V.build_mapping(SP(), BL(), cache_dir=cache_dir).key != m1.key


@pytest.mark.parametrize("garbage", [b"not a zip", b"", "wrong-shape"])
def test_corrupt_cache_file_ignored_and_rewritten(cache_dir, garbage):
    m1 = V.build_mapping(BL(), SP(), cache_dir=cache_dir)
    path = cache_dir / f"{m1.key}.npz"
    if garbage == "wrong-shape":
        np.savez(path, d2t=np.zeros(3, np.int64), t2d=np.zeros(3, np.int64), key=np.array(m1.key))
    else:
        path.write_bytes(garbage)
    V._MEMORY.clear()
    m2 = V.build_mapping(BL(), SP(), cache_dir=cache_dir)
    assert (m2.d2t == m1.d2t).all() and (m2.t2d == m1.t2d).all()
    with np.load(path) as z:  # rewritten, valid
        assert (z["d2t"] == m1.d2t).all() and str(z["key"]) == m1.key


def test_default_cache_dir_uses_crossdraft_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSDRAFT_HOME", str(tmp_path / "home"))
    V.clear_memory_cache()
    assert V.default_cache_dir() == tmp_path / "home" / "vocab"
    m = V.build_mapping(SP(), BL())
    assert (tmp_path / "home" / "vocab" / f"{m.key}.npz").is_file()
    V.clear_memory_cache()


def test_unwritable_cache_dir_still_works(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    V.clear_memory_cache()
    m = V.build_mapping(BL(), SP(), cache_dir=blocker / "sub")  # cannot mkdir under a file
    assert m.intersection_size() > 0
    V.clear_memory_cache()


# ----------------------------------------------------------------------------------------------
# Report and engine helpers
# ----------------------------------------------------------------------------------------------


def test_vocab_report_compares_with_hf_style(cache_dir, monkeypatch):
    monkeypatch.setenv("CROSSDRAFT_HOME", str(cache_dir))
    rep = V.vocab_report(BL(), SP())
    assert rep["intersection_size"] > rep["hf_style_correct_pairs"]
    assert rep["hf_style_intersection"] > 0
    assert rep["only_ours"] > 0
    assert "b'\\n'" in rep["examples_only_ours"] or "b'\\t'" in rep["examples_only_ours"]
    # SP's letter "é" and the byte-level symbol "é" (byte 0xE9) are equal strings, different text
    assert rep["hf_style_wrong_text_pairs"] >= 1
    assert "hf_style_intersection" not in V.vocab_report(BL(), SP(), hf_baseline=False)


def test_hf_style_rule_translates_only_leading_space_marker():
    pairs = V._hf_style_pairs(BL(), SP())
    bl, sp = BL(), SP()
    assert pairs.get(_id(bl, "Ġthe")) == _id(sp, "▁the")
    assert _id(bl, "Ċ") not in pairs  # "Ċ" is not "\n" as a string


@pytest.mark.parametrize("make", [BL, SP, SPP], ids=["bytelevel", "sp", "sp-prefix"])
def test_encode_decode_bytes_exact(make):
    tok = make()
    data = CORPUS.encode("utf-8")
    ids = V.encode_bytes(tok, data)
    assert V.decode_bytes(tok, ids) == data
    for piece in [b"foo", b" foo", b"\n    return x", "é🙂".encode(), "🙂".encode()[:2], "🙂".encode()[1:],
                  b"<|endoftext|> <s>", b"  ", b"\xff\xfe"]:
        ids = V.encode_bytes(tok, piece)
        assert V.decode_bytes(tok, ids) == piece, (piece, ids)
        assert not set(ids) & set(tok.all_special_ids)
    assert V.encode_bytes(tok, b"") == []
    with pytest.raises(ValueError):
        V.decode_bytes(tok, [tok.all_special_ids[0]], strict=True)
    assert V.decode_bytes(tok, [tok.all_special_ids[0]]) == b""


def test_encode_bytes_prefers_tokenizer_segmentation():
    tok = SPP()  # prepends "▁" when encoding "return" alone; encode_bytes must not
    ids = V.encode_bytes(tok, b"return x")
    assert V.decode_bytes(tok, ids) == b"return x"
    assert tok.convert_ids_to_tokens(ids)[0] != "▁re"
    bl = BL()
    assert V.encode_bytes(bl, b" return") == bl(" return", add_special_tokens=False)["input_ids"]


def _count_vocab_work(monkeypatch) -> dict[str, int]:
    """Count the calls of build_mapping's costly steps: a tokenizer's bytes table, the mapping's
    computation, and the disk cache's read and write."""
    counts = {"table": 0, "compute": 0, "load": 0, "save": 0}
    for name, fn in (("table", "_build_table"), ("compute", "_compute"), ("load", "_load_disk"),
                     ("save", "_save_disk")):
        real = getattr(V, fn)

        def counted(*a, _name=name, _real=real, **kw):
            counts[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(V, fn, counted)
    return counts


def test_a_mapping_built_again_is_a_cache_hit_that_redoes_no_work(cache_dir, monkeypatch):
    """build_mapping runs every time a gateway pairs two models: the mapping is computed once, and
    building it again does none of that work -- with the same tokenizer objects not even their
    bytes tables; with new objects of the same tokenizers only the tables (kept per object), the
    mapping itself coming from memory."""
    counts = _count_vocab_work(monkeypatch)
    bl, sp = BL(), SP()
    first = V.build_mapping(bl, sp, cache_dir=cache_dir)
    assert counts == {"table": 2, "compute": 1, "load": 1, "save": 1}  # (the disk had nothing yet)
    for _ in range(20):
        assert V.build_mapping(bl, sp, cache_dir=cache_dir) is first
    assert counts == {"table": 2, "compute": 1, "load": 1, "save": 1}
    for _ in range(3):  # equal tokenizers, other objects (the fixtures are cached: copies)
        assert V.build_mapping(copy.deepcopy(bl), copy.deepcopy(sp), cache_dir=cache_dir) is first
    assert counts == {"table": 2 + 2 * 3, "compute": 1, "load": 1, "save": 1}
    assert os.path.isdir(cache_dir)


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
    table = V._table(tok)
    assert table.method == "sentencepiece"
    tb = table.bytes
    assert tb[_id(tok, "▁the")] == b" the"
    assert tb[tok.convert_tokens_to_ids("<ctrl>")] is None and tb[tok.unk_token_id] is None
    # transformers' Python decode prints byte-fallback pieces literally ("<0x0A>"), so they are
    # excluded rather than claimed to be a byte the decoder does not produce
    assert tb[_id(tok, "<0x0A>")] in (None, b"\n")
    m = V.build_mapping(BL(), tok, cache_dir=tmp_path / "vocab")
    pairs = [(int(d), int(m.d2t[d])) for d in np.flatnonzero(m.d2t >= 0)]
    assert len(pairs) > 50
    assert in_context_mismatches(tok, BL(), pairs) == []


def test_chat_ids_drafter_without_a_template_drafts_over_the_targets_rendering(tok_t, tok_d):
    import copy

    from crossdraft.errors import InvalidArgument
    from crossdraft.vocab.mapping import TokenPair

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
    pair = V.TokenPair(sp, bl, len(sp) + 4, len(bl) + 2, vocab_cache_dir=cache_dir)
    samples = [b" return", b"\n    ", b"x = 1", "héllo wörld".encode(), b"  ", "日本".encode()]
    for s in samples:
        assert pair.encode_drafter_bytes(s) == V.encode_bytes(bl, s)
        assert pair.encode_target_bytes(s) == V.encode_bytes(sp, s)
    calls = []
    orig = V.encode_bytes
    monkeypatch.setattr(V, "encode_bytes", lambda *a, **kw: calls.append(a[1]) or orig(*a, **kw))
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


# ----------------------------------------------------------------------------------------------
# The drafter's draft vocabulary (its most frequent tokens)
# ----------------------------------------------------------------------------------------------


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
    order = V.frequency_order(tok, len(vocab) + 3)  # 3 rows past the tokenizer (a wider head)
    assert sorted(order.tolist()) == list(range(len(vocab) + 3))  # a permutation
    assert [int(order[vocab[t]]) for t in base] == list(range(len(base)))  # base symbols first, by id
    assert [int(order[vocab[t]]) for t in made] == list(range(len(base), len(base) + len(made)))  # merge order
    assert order[len(vocab):].tolist() == [len(vocab), len(vocab) + 1, len(vocab) + 2]  # rows past it last


def test_frequency_order_of_a_unigram_model_follows_the_scores():
    pieces = [("<unk>", 0.0), ("a", -5.0), ("b", -1.0), ("ab", -3.0), ("c", -2.0)]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.Unigram(pieces, unk_id=0)))
    order = V.frequency_order(tok)
    # by score: <unk> 0, b -1, c -2, ab -3, a -5
    assert order.tolist() == [0, 4, 1, 3, 2]


def test_frequency_order_without_a_model_is_the_id_order():
    class Plain:
        def __len__(self):
            return 5

    assert V.frequency_order(Plain()).tolist() == [0, 1, 2, 3, 4]


def test_draft_vocab_limits_what_the_drafter_drafts_from(cache_dir):
    sp, bl = SP(), BL()
    full = V.TokenPair(sp, bl, len(sp) + 4, len(bl) + 2, vocab_cache_dir=cache_dir)
    n = 120
    cut = V.TokenPair(sp, bl, len(sp) + 4, len(bl) + 2, vocab_cache_dir=cache_dir, draft_vocab=n)
    order = V.frequency_order(bl, len(bl) + 2)
    for mode in ("tli", "text"):
        m, f = cut.masks[mode], full.masks[mode]
        assert m.any() and not (m & ~f).any()  # a subset of what it was,
        assert (order[m] < n).all()  # only the n most frequent,
        assert int(m.sum()) == int((f & (order < n)).sum())  # all of those
        assert int(m.sum()) < int(f.sum()) and cut.keys[mode] != full.keys[mode]  # (the drafter's mask key)
    # the mapping itself is unchanged: the target's tokens outside the set still map (the residual)
    assert (cut.allowed == full.allowed).all() and (cut.d2t == full.d2t).all() and cut.same_vocab == full.same_vocab
    # a limit at or past the vocabulary changes nothing
    wide = V.TokenPair(sp, bl, len(sp) + 4, len(bl) + 2, vocab_cache_dir=cache_dir, draft_vocab=len(bl) + 2)
    assert all((wide.masks[k] == full.masks[k]).all() and wide.keys[k] == full.keys[k] for k in full.masks)


@pytest.mark.parametrize("bad", [-1, 2.5, "64", True])
def test_draft_vocab_must_be_a_count(bad, cache_dir):
    with pytest.raises(InvalidArgument) as e:
        V.TokenPair(SP(), BL(), vocab_cache_dir=cache_dir, draft_vocab=bad)
    assert e.value.field == "draft_vocab"
