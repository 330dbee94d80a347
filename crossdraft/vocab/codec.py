"""Exact bytes <-> ids for one tokenizer: what the round loop uses to move text between vocabularies.

How the engine tokenizes text for the drafter (re-sync):

* Keep the committed output as target ids and as *bytes* (:func:`decode_bytes`), never as
  re-encoded target text: ``decode`` is not byte-exact (partial UTF-8 becomes U+FFFD, the first
  space may be stripped) and re-encoding is not faithful (Qwen's tokenizer normalises NFC,
  Gemma's normaliser turns a literal ``▁`` in the text into a space).
* A committed target id ``t`` with ``t2d[t] >= 0`` can be fed to the drafter as ``t2d[t]``.
  Otherwise convert its bytes with :func:`encode_bytes` (drafter tokenizer), which guarantees
  that the returned ids concatenate to exactly those bytes: it tries the tokenizer without
  special tokens, then behind an anchor (which defeats the ``▁`` that Llama-style tokenizers
  prepend to the first word), and falls back to a greedy longest match over the token bytes
  (every byte-level or byte-fallback vocabulary has all 256 single-byte tokens).
* Encode the user prompt once with each tokenizer (``add_special_tokens`` as the model expects,
  e.g. Gemma's ``<bos>``); never splice text fragments through ``tokenizer(...)`` with its
  defaults: it would add BOS/EOS, prepend a ``▁`` and parse literal ``<|im_start|>`` text as a
  special token.
* Fragments tokenized separately give a valid but non-canonical tokenization at the seam; that
  costs draft quality only, not correctness. For better drafts re-encode from the last few
  drafter tokens (rolling the drafter's cache back) instead of appending.
"""

from __future__ import annotations

import logging
from typing import Sequence

from crossdraft.vocab.tokenbytes import ByteTable, byte_table

log = logging.getLogger(__name__)

__all__ = ["decode_bytes", "encode_bytes"]


def decode_bytes(tokenizer, ids: Sequence[int], *, strict: bool = False) -> bytes:
    """The exact bytes of ``ids`` as mid-text tokens (no stripped leading space, no U+FFFD).

    Special/unmappable ids contribute nothing, or raise ``ValueError`` when ``strict``.
    """
    table = byte_table(tokenizer).bytes
    parts = []
    for i in ids:
        i = int(i)
        b = table[i] if 0 <= i < len(table) else None
        if b is None:
            if strict:
                raise ValueError(f"token id {i} stands for no bytes (special or unknown)")
            continue
        parts.append(b)
    return b"".join(parts)


def _greedy(table: ByteTable, data: bytes) -> list[int] | None:
    """The longest token at each position, left to right; None if some byte has no token."""
    out = []
    pos = 0
    index = table.index
    while pos < len(data):
        for ln in range(min(table.max_len, len(data) - pos), 0, -1):
            t = index.get(data[pos : pos + ln])
            if t is not None:
                out.append(t)
                pos += ln
                break
        else:
            return None
    return out


def _split_utf8(data: bytes) -> tuple[bytes, bytes, bytes]:
    """(stray leading continuation bytes, middle, trailing incomplete character)."""
    i = 0
    while i < len(data) and i < 3 and (data[i] & 0xC0) == 0x80:
        i += 1
    j = len(data)
    for k in range(1, 4):
        if j - k < i:
            break
        c = data[j - k]
        if (c & 0xC0) == 0x80:
            continue
        need = 2 if (c >> 5) == 0b110 else 3 if (c >> 4) == 0b1110 else 4 if (c >> 3) == 0b11110 else 1
        if need > k:
            j -= k
        break
    return data[:i], data[i:j], data[j:]


def encode_bytes(tokenizer, data: bytes, *, table: ByteTable | None = None) -> list[int]:
    """Ids (no special tokens) whose bytes concatenate to exactly ``data``.

    Tries the tokenizer's own tokenization (plain, then behind an anchor, which defeats a
    prepended ``▁``), and falls back to a greedy longest match over the token bytes; raises
    ``ValueError`` only if the vocabulary cannot spell ``data`` at all. ``table``: the tokenizer's
    table when the caller holds it (:class:`crossdraft.vocab.pair.TokenPair`: skips the per-call
    staleness check).
    """
    if not data:
        return []
    table = table if table is not None else byte_table(tokenizer)
    tb = table.bytes
    special = set(table.special.tolist())

    def exact(ids, want: bytes) -> bool:
        if any(i in special or not (0 <= i < len(tb)) or tb[i] is None for i in ids):
            return False
        return b"".join(tb[i] for i in ids) == want

    def spell(piece: bytes) -> list[int]:
        ids = _greedy(table, piece)
        if ids is None:
            raise ValueError(f"the vocabulary cannot spell {piece[:40]!r}")
        return ids

    head, middle, tail = _split_utf8(data)
    try:
        text = middle.decode("utf-8")
    except UnicodeDecodeError:
        return spell(data)
    return (spell(head) if head else []) + _encode_text(tokenizer, text, middle, exact, table) + \
        (spell(tail) if tail else [])


def _encode_text(tokenizer, text: str, data: bytes, exact, table: ByteTable) -> list[int]:
    """``text`` (whole characters, ``data`` its bytes) as the tokenizer encodes it, if that spells
    ``data`` exactly, plain or behind an anchor; else the greedy match."""
    if not text:
        return []
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if exact(ids, data):
            return ids
        for anchor in ("\n", "a", "."):
            a_ids = list(tokenizer.encode(anchor, add_special_tokens=False))
            both = list(tokenizer.encode(anchor + text, add_special_tokens=False))
            if a_ids and both[: len(a_ids)] == a_ids and exact(both[len(a_ids) :], data):
                return both[len(a_ids) :]
    except Exception as exc:  # pragma: no cover - tokenizer quirks
        log.debug("vocab: encode failed (%s), using greedy match", exc)
    ids = _greedy(table, data)
    if ids is None:
        raise ValueError(f"the vocabulary cannot spell {data[:40]!r}")
    return ids
