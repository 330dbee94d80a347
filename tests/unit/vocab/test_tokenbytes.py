"""crossdraft.vocab.tokenbytes: the fixture tokenizers and what each of their ids stands for in bytes."""

from __future__ import annotations

import copy

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from crossdraft.vocab.tokenbytes import _BYTE_ENCODER, byte_table, token_bytes
from tests.tokenizers_fixtures import CORPUS, bytelevel_bpe_tokenizer, sentencepiece_like_tokenizer
from tests.unit.vocab.checks import token_id

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
    a, b = set(token_bytes(BL())) - {None}, set(token_bytes(SP())) - {None}
    assert a != b
    assert 0 < len(a & b) < min(len(a), len(b))
    assert BL().get_vocab() != SP().get_vocab()


# ----------------------------------------------------------------------------------------------
# token_bytes
# ----------------------------------------------------------------------------------------------


def test_bytelevel_symbols():
    tok = BL()
    tb = token_bytes(tok)
    assert len(tb) == len(tok)
    assert tb[token_id(tok, "Ġ")] == b" "
    assert tb[token_id(tok, "Ċ")] == b"\n"
    assert tb[token_id(tok, "ĉ")] == b"\t"
    assert tb[token_id(tok, "ĊĠĠĠ")] == b"\n   "
    assert tb[token_id(tok, "Ã©")] == "é".encode()
    assert tb[token_id(tok, "Ġreturn")] == b" return"
    # every one of the 256 byte symbols stands for its own single byte
    singles = {tb[token_id(tok, _BYTE_ENCODER[b])] for b in range(256)}
    assert singles == {bytes([b]) for b in range(256)}


def test_sentencepiece_pieces_and_byte_fallback():
    tok = SP()
    tb = token_bytes(tok)
    assert tb[token_id(tok, "▁the")] == b" the"
    assert tb[token_id(tok, "▁")] == b" "
    assert tb[token_id(tok, "<0x0A>")] == b"\n"
    assert tb[token_id(tok, "<0x20>")] == b" "
    assert tb[token_id(tok, "<0xC3>")] == b"\xc3"
    assert tb[token_id(tok, "é")] == "é".encode()


def test_leading_space_not_stripped():
    tok = SPP()  # Llama-style: the decoder strips the first space of the output
    i = token_id(tok, "▁the")
    assert tok.decode([i]) == "the"
    assert token_bytes(tok)[i] == b" the"


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
        tb = token_bytes(tok)
        assert tb[8] == b" foo", dec
        assert tb[9] == b"\n"
        assert tb[0] is None and tb[1] is None
        assert byte_table(tok).disagreements == 0


def test_unknown_decoder_falls_back_to_decoding():
    tok = _handmade(decoders.WordPiece(prefix="##", cleanup=False), extra_vocab=("##b",))
    table = byte_table(tok)
    assert table.method == "decoded"
    tb = table.bytes
    assert tb[token_id(tok, "##b")] == b"b"
    assert tb[token_id(tok, "ab")] == b" ab"  # a WordPiece word is preceded by a space mid-text


def test_specials_excluded():
    tok = copy.deepcopy(BL())
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>", "<reserved>"]})
    tok.add_tokens(["<|not_marked|>", "[PAD123]", "<unused7>", "\n\n\n", "<tool>", "café"])
    tb = token_bytes(tok)
    for t in ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|tool|>", "<reserved>",
              "<|not_marked|>", "[PAD123]", "<unused7>"]:
        assert tb[token_id(tok, t)] is None, t
    assert tb[token_id(tok, "\n\n\n")] == b"\n\n\n"  # a non-special added token is text
    assert tb[token_id(tok, "<tool>")] == b"<tool>"
    # byte-level decoders turn the added "café" into "caf\ufffd" (é is also byte 0xE9's symbol)
    assert tok.decode([token_id(tok, "café")]) != "café"
    assert tb[token_id(tok, "café")] is None
    for t in ["<s>", "</s>", "<unk>", "<pad>"]:
        assert token_bytes(SP())[SP().convert_tokens_to_ids(t)] is None


def test_token_bytes_memoized_and_refreshed_after_add_tokens():
    tok = copy.deepcopy(SP())
    first = byte_table(tok)
    assert byte_table(tok) is first
    tok.add_tokens(["zzqq"])
    second = byte_table(tok)
    assert second is not first and len(second.bytes) == len(tok) == len(first.bytes) + 1
    assert second.bytes[-1] == b"zzqq"
