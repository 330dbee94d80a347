"""crossdraft.vocab.codec: exact bytes <-> ids."""

from __future__ import annotations

import pytest

from crossdraft.vocab.codec import decode_bytes, encode_bytes
from tests.tokenizers_fixtures import CORPUS, bytelevel_bpe_tokenizer, sentencepiece_like_tokenizer

BL = bytelevel_bpe_tokenizer
SP = sentencepiece_like_tokenizer


def SPP():
    return sentencepiece_like_tokenizer(add_prefix_space=True)


@pytest.mark.parametrize("make", [BL, SP, SPP], ids=["bytelevel", "sp", "sp-prefix"])
def test_encode_decode_bytes_exact(make):
    tok = make()
    data = CORPUS.encode("utf-8")
    ids = encode_bytes(tok, data)
    assert decode_bytes(tok, ids) == data
    for piece in [b"foo", b" foo", b"\n    return x", "é🙂".encode(), "🙂".encode()[:2], "🙂".encode()[1:],
                  b"<|endoftext|> <s>", b"  ", b"\xff\xfe"]:
        ids = encode_bytes(tok, piece)
        assert decode_bytes(tok, ids) == piece, (piece, ids)
        assert not set(ids) & set(tok.all_special_ids)
    assert encode_bytes(tok, b"") == []
    with pytest.raises(ValueError):
        decode_bytes(tok, [tok.all_special_ids[0]], strict=True)
    assert decode_bytes(tok, [tok.all_special_ids[0]]) == b""


def test_encode_bytes_prefers_tokenizer_segmentation():
    tok = SPP()  # prepends "▁" when encoding "return" alone; encode_bytes must not
    ids = encode_bytes(tok, b"return x")
    assert decode_bytes(tok, ids) == b"return x"
    assert tok.convert_ids_to_tokens(ids)[0] != "▁re"
    bl = BL()
    assert encode_bytes(bl, b" return") == bl(" return", add_special_tokens=False)["input_ids"]
