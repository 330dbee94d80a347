"""crossdraft.vocab.report: the vocabulary report beside the HF-style baseline."""

from __future__ import annotations

from crossdraft.vocab.report import _hf_style_pairs, vocab_report
from tests.tokenizers_fixtures import bytelevel_bpe_tokenizer, sentencepiece_like_tokenizer
from tests.unit.vocab.checks import token_id

BL = bytelevel_bpe_tokenizer
SP = sentencepiece_like_tokenizer


def test_vocab_report_compares_with_hf_style(cache_dir, monkeypatch):
    monkeypatch.setenv("CROSSDRAFT_HOME", str(cache_dir))
    rep = vocab_report(BL(), SP())
    assert rep["intersection_size"] > rep["hf_style_correct_pairs"]
    assert rep["hf_style_intersection"] > 0
    assert rep["only_ours"] > 0
    assert "b'\\n'" in rep["examples_only_ours"] or "b'\\t'" in rep["examples_only_ours"]
    # SP's letter "é" and the byte-level symbol "é" (byte 0xE9) are equal strings, different text
    assert rep["hf_style_wrong_text_pairs"] >= 1
    assert "hf_style_intersection" not in vocab_report(BL(), SP(), hf_baseline=False)


def test_hf_style_rule_translates_only_leading_space_marker():
    pairs = _hf_style_pairs(BL(), SP())
    bl, sp = BL(), SP()
    assert pairs.get(token_id(bl, "Ġthe")) == token_id(sp, "▁the")
    assert token_id(bl, "Ċ") not in pairs  # "Ċ" is not "\n" as a string
