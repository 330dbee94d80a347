"""Checks shared by the vocab tests (and tests/integration/test_vocab_real.py): in-context decoding
of mapped pairs, token ids by string, and counting build_mapping's costly steps."""

from __future__ import annotations

import itertools

from crossdraft.vocab import mapping, tokenbytes
from crossdraft.vocab.tokenbytes import token_bytes

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
        table = token_bytes(tok)
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
    bytes_a = token_bytes(tok_a)
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


def token_id(tok, token: str) -> int:
    """The id of ``token`` (a token string), which must be in the vocabulary."""
    i = tok.convert_tokens_to_ids(token)
    assert i is not None and i != tok.unk_token_id, token
    return i


def count_vocab_work(monkeypatch) -> dict[str, int]:
    """Count the calls of build_mapping's costly steps: a tokenizer's bytes table, the mapping's
    computation, and the disk cache's read and write."""
    counts = {"table": 0, "compute": 0, "load": 0, "save": 0}
    for name, module, fn in (("table", tokenbytes, "_build_table"), ("compute", mapping, "_compute"),
                             ("load", mapping, "load_mapping"), ("save", mapping, "save_mapping")):
        real = getattr(module, fn)

        def counted(*a, _name=name, _real=real, **kw):
            counts[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(module, fn, counted)
    return counts
