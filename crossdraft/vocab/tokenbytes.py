"""What each token id of one tokenizer stands for in bytes: the tokenizer's byte table.

The drafter may only propose tokens that stand for *exactly* the same bytes in both
vocabularies, so tokens are compared by the bytes each one stands for in the middle of a text,
never by their raw token strings:

* byte-level BPE (GPT-2, Qwen, SmolLM): every character of a token string is one of the 256
  byte symbols (``Ġ`` = space, ``Ċ`` = newline, ``ĉ`` = tab, ``Ã`` = 0xC3 ...), so a token may
  stand for a partial UTF-8 character; that is fine, bytes are compared;
* SentencePiece-style vocabularies (Gemma, Llama): ``▁`` is a space and the byte-fallback
  tokens ``<0x00>`` .. ``<0xFF>`` stand for one raw byte each;
* anything else is emulated from the tokenizer's decoder or, failing that, read from the
  decoder itself (see below).

How a token's bytes are found (:func:`token_bytes`)
---------------------------------------------------
For a ``tokenizers``-backed tokenizer the decoder pipeline (``backend_tokenizer.decoder``:
``ByteLevel``, ``Metaspace``, ``Replace``, ``ByteFallback``, ``Fuse``, ``Strip``) is emulated
for one token standing in the middle of a text. That matters because decoders strip a space at
the *start of a sequence* (``Metaspace`` with ``prepend_scheme="first"``, ``Strip`` after
``Fuse`` in Llama-style decoders): ``decode([id("▁foo")])`` gives ``"foo"`` while the token
stands for ``b" foo"`` everywhere else. Every result is then cross-checked by decoding the
token after an anchor token (``decode([anchor, id])`` minus ``decode([anchor])``, where
``anchor`` is a plain one-letter token, so nothing gets stripped); a token whose emulated bytes
disagree with the decoder is excluded (``None``) rather than guessed. Decoders the emulator does
not know (WordPiece, BPEDecoder, none) fall back to the decoded text itself, which cannot express
partial UTF-8 (such tokens are excluded). Tokenizers without a Rust backend (SentencePiece-only)
read piece types from ``sp_model`` and otherwise decode per token.

Excluded (``None``): added tokens marked special, ``all_special_ids``, the unknown token,
control-looking tokens even if nobody marked them special (``<|...|>``, ``<unusedNN>``,
``[PADNNNNNN]``, ``<extra_id_N>``, ``<start_of_...>``/``<end_of_...>``, ``<s>``, ``</s>``,
``<pad>``, ``<mask>`` ...), holes in the id range, tokens that stand for no bytes, and added
(non-special) tokens whose decoded bytes differ from their own text (see pitfalls).

Pitfalls
--------
* Gemma 3 loaded from GGUF (transformers' converter): ``<start_of_turn>``/``<end_of_turn>``,
  ``<unusedNN>`` and the other control tokens come back as special added tokens, but
  ``<start_of_image>``/``<end_of_image>`` come back as plain vocabulary (excluded by pattern),
  and ``[multimodal]``, ``"\\n"`` .. 31 newlines, tab runs and HTML tags (``<table>``, ``<code>``,
  ``<s>`` = strikethrough) are *non-special* added tokens (GGUF type USER_DEFINED). The newline,
  tab and HTML tokens are real text and are kept; the newline tokens being added tokens, Gemma
  never encodes ``"\\n"`` as ``<0x0A>``.
* Qwen2.5 from GGUF has 151,936 ids: 151,643 BPE tokens, 22 added tokens, and 271
  ``[PAD151665]`` .. placeholders that are plain vocabulary entries (GGUF type UNUSED) with
  text "[PAD151665]"; HF does not mark them special, they are excluded by pattern. Only 2 ids are
  in ``all_special_ids``; the other control tokens are found through ``added_tokens_decoder``.
* Non-special added tokens go through the decoder too: in a byte-level tokenizer an added token
  "café" decodes to "caf\\ufffd" (``é`` is also the byte symbol for 0xE9) although it matches the
  text "café" when encoding. Such tokens are excluded.
* transformers' Python (non-Rust) SentencePiece tokenizers print byte-fallback pieces literally
  ("<0x0A>") and drop a lone "▁" when decoding; such tokens fail the decode cross-check and are
  excluded. WordPiece vocabularies are handled only as well as their lossy decoder allows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["ByteTable", "byte_table", "clear_tables", "rust_backend", "token_bytes", "tokenizer_digest"]

# Bump when the way bytes or mappings are computed changes: it is part of every cache key.
FORMAT_VERSION = 1

_BYTE_FALLBACK_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# Tokens that look like control tokens: never drafted, even when nobody marked them special.
_CONTROL_RE = re.compile(
    r"^(?:<\|[^|\s]{1,80}\|>"  # <|im_start|>, <|endoftext|>, <|reserved_special_token_3|>
    r"|<unused\d+>|<unused_\d+>|\[PAD\d+\]|<extra_id_\d+>|<pad_\d+>"
    r"|<(?:start|end)_of_[a-z_]+>"  # Gemma <start_of_turn>, <start_of_image> ...
    r"|<s>|</s>|<unk>|<pad>|<mask>|<bos>|<eos>|<cls>|<sep>"
    r"|\[CLS\]|\[SEP\]|\[PAD\]|\[MASK\]|\[UNK\])$"
)
_ANCHOR_CANDIDATES = (b"a", b"x", b"e", b"o", b"t", b"n", b"b", b"0", b"1", b"(", b"=")


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable symbol table used by byte-level BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_ENCODER: dict[int, str] = _bytes_to_unicode()
_BYTE_DECODER: dict[str, int] = {s: b for b, s in _BYTE_ENCODER.items()}


@dataclass(frozen=True, eq=False)
class ByteTable:
    """What one tokenizer's ids stand for; :func:`token_bytes` gives callers outside the package ``bytes``."""

    bytes: list  # list[bytes | None]
    byte_fallback: np.ndarray  # bool [n]: a <0xNN> byte-fallback token
    special: np.ndarray  # int64 sorted: ids excluded as special/control
    method: str  # how bytes were obtained (for reports)
    disagreements: int  # tokens excluded because emulation and decoder disagreed
    digest: str = ""
    index: dict = field(default_factory=dict, repr=False)  # bytes -> canonical id
    max_len: int = 0


# tokenizer object -> (fingerprint, ByteTable); tokenizers are weak-referenceable objects.
_TABLES: "weakref.WeakKeyDictionary[Any, tuple[tuple, ByteTable]]" = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def _fingerprint(tokenizer) -> tuple:
    """Cheap identity of a tokenizer's state, to notice ``add_tokens`` after a table was built.

    It runs on every table lookup (several per round), so fast tokenizers answer from the Rust
    backend in microseconds: transformers' ``added_tokens_decoder`` builds a dict of every added
    token per call (~15 ms for Gemma-3's), too slow to run per round on the gateway."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            return ("fast", backend.get_vocab_size(with_added_tokens=True), backend.get_vocab_size(False))
        except Exception:  # pragma: no cover - exotic backends
            pass
    try:
        added = tokenizer.added_tokens_decoder
        added_sig = (len(added), sum(1 for a in added.values() if getattr(a, "special", False)))
    except Exception:  # pragma: no cover - exotic tokenizers
        added_sig = None
    try:
        specials = tuple(sorted(int(i) for i in tokenizer.all_special_ids if i is not None))
    except Exception:  # pragma: no cover
        specials = None
    return (len(tokenizer), added_sig, specials)


def byte_table(tokenizer) -> ByteTable:
    """The tokenizer's table, built once per tokenizer object (and again after tokens are added)."""
    fp = _fingerprint(tokenizer)
    with _TABLES_LOCK:
        try:
            hit = _TABLES.get(tokenizer)
        except TypeError:  # not hashable / weak-referenceable
            hit = None
        if hit is not None and hit[0] == fp:
            return hit[1]
    table = _build_table(tokenizer)
    with _TABLES_LOCK:
        try:
            _TABLES[tokenizer] = (fp, table)
        except TypeError:
            pass
    return table


def clear_tables() -> None:
    """Forget every tokenizer's table."""
    with _TABLES_LOCK:
        _TABLES.clear()


def tokenizer_digest(tokenizer) -> str:
    """sha256 of the tokenizer's id -> bytes table (ModelInfo.tokenizer_digest)."""
    h = hashlib.sha256()
    for b in token_bytes(tokenizer):
        h.update(b"\x00" if b is None else len(b).to_bytes(2, "little") + b)
    return h.hexdigest()


def token_bytes(tokenizer) -> list[bytes | None]:
    """The bytes each id in ``range(len(tokenizer))`` stands for in the middle of a text.

    ``None`` marks special/control tokens, holes and tokens whose bytes cannot be established.
    The result is computed once per tokenizer object (and recomputed if tokens are added).
    """
    return list(byte_table(tokenizer).bytes)


def rust_backend(tokenizer):
    """The tokenizer's ``tokenizers.Tokenizer`` (it has decode_batch / id_to_token), or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode_batch") and hasattr(backend, "id_to_token"):
        return backend
    return None


def _special_ids(tokenizer, raw: Sequence[str | None]) -> set[int]:
    n = len(raw)
    special: set[int] = set()
    for i in getattr(tokenizer, "all_special_ids", None) or []:
        if i is not None and 0 <= int(i) < n:
            special.add(int(i))
    unk = getattr(tokenizer, "unk_token_id", None)
    if isinstance(unk, int) and 0 <= unk < n:
        special.add(unk)
    try:
        added = tokenizer.added_tokens_decoder
    except Exception:  # pragma: no cover
        added = {}
    for i, tok in added.items():
        if getattr(tok, "special", False) and 0 <= int(i) < n:
            special.add(int(i))
    for i, s in enumerate(raw):
        if s is not None and s.startswith(("<", "[")) and _CONTROL_RE.match(s):
            special.add(i)
    sp = getattr(tokenizer, "sp_model", None)
    if sp is not None:
        for i in range(min(n, sp.get_piece_size())):
            if sp.IsControl(i) or sp.IsUnknown(i) or sp.IsUnused(i):
                special.add(i)
    return special


def _decoder_steps(backend) -> list[dict] | None:
    """The flattened decoder pipeline as JSON dicts, or None if there is no decoder."""
    dec = backend.decoder
    if dec is None:
        return None
    try:
        spec = json.loads(dec.__getstate__())
    except Exception:
        spec = json.loads(backend.to_str()).get("decoder")
    steps: list[dict] = []

    def flat(d):
        if d is None:
            return
        if d.get("type") == "Sequence":
            for sub in d.get("decoders", []):
                flat(sub)
        else:
            steps.append(d)

    flat(spec)
    return steps


def _strip(st: str, ch: str, start: int, stop: int) -> str:
    """A ``Strip`` decoder step: up to ``start`` leading and ``stop`` trailing ``ch`` removed."""
    k = 0
    while k < start and k < len(st) and st[k] == ch:
        k += 1
    st = st[k:]
    k = 0
    while k < stop and k < len(st) and st[len(st) - 1 - k] == ch:
        k += 1
    return st[: len(st) - k]


def _make_emulator(steps: list[dict]) -> Callable[[str], tuple[bytes, bool]] | None:
    """A function token string -> (bytes mid-text, is_byte_fallback), or None if unsupported."""
    supported = {"ByteLevel", "Replace", "ByteFallback", "Fuse", "Strip", "Metaspace"}
    if not steps or any(s.get("type") not in supported for s in steps):
        return None
    for s in steps:
        if s["type"] == "Replace" and "String" not in s.get("pattern", {}):
            return None  # regex replacements: let the decoder speak for itself

    def convert(tok: str) -> tuple[bytes, bool]:
        state: str | bytes = tok
        fused = False
        is_bf = False
        for s in steps:
            kind = s["type"]
            if kind == "ByteLevel":
                if isinstance(state, str):
                    try:
                        state = bytes(_BYTE_DECODER[c] for c in state)
                    except KeyError:  # like tokenizers: a char outside the table -> raw UTF-8
                        state = state.encode("utf-8")
            elif kind == "ByteFallback":
                if isinstance(state, str):
                    m = _BYTE_FALLBACK_RE.match(state)
                    if m:
                        state = bytes([int(m.group(1), 16)])
                        is_bf = True
            elif kind == "Replace":
                pat, content = s["pattern"]["String"], s.get("content", "")
                if isinstance(state, str):
                    state = state.replace(pat, content)
                else:
                    state = state.replace(pat.encode("utf-8"), content.encode("utf-8"))
            elif kind == "Metaspace":
                # Only the first token of a sequence loses its leading space; this one is mid-text.
                rep = s.get("replacement", "\u2581")
                if isinstance(state, str):
                    state = state.replace(rep, " ")
                else:
                    state = state.replace(rep.encode("utf-8"), b" ")
            elif kind == "Fuse":
                fused = True
            elif kind == "Strip":
                # After Fuse it only touches the ends of the whole text, not a mid-text token.
                if not fused and isinstance(state, str):
                    state = _strip(state, s.get("content", " "), int(s.get("start", 0)), int(s.get("stop", 0)))
        if isinstance(state, str):
            state = state.encode("utf-8")
        return state, is_bf

    return convert


def _sentencepiece_piece(tok: str) -> tuple[bytes, bool]:
    """A SentencePiece piece's bytes mid-text (``▁`` a space, ``<0xNN>`` one byte), is_byte_fallback."""
    m = _BYTE_FALLBACK_RE.match(tok)
    if m:
        return bytes([int(m.group(1), 16)]), True
    return tok.replace("\u2581", " ").encode("utf-8"), False


def _find_anchor(raw_bytes: Sequence[bytes | None], special: set[int], bf: np.ndarray) -> int | None:
    """A plain one-character token (not byte-fallback: those merge with following bytes)."""
    wanted = {b: None for b in _ANCHOR_CANDIDATES}
    for i, b in enumerate(raw_bytes):
        if b in wanted and wanted[b] is None and i not in special and not bf[i]:
            wanted[b] = i
    for b in _ANCHOR_CANDIDATES:
        if wanted[b] is not None:
            return wanted[b]
    return None


def _decoded_suffixes(decode_batch, anchor: int, ids: list[int], chunk: int = 65536) -> tuple[str, list[str | None]]:
    """Decode ``[anchor, i]`` for every i; return anchor text and the text after it (or None)."""
    anchor_text = decode_batch([[anchor]])[0]
    out: list[str | None] = []
    for start in range(0, len(ids), chunk):
        seqs = [[anchor, i] for i in ids[start : start + chunk]]
        for s in decode_batch(seqs):
            out.append(s[len(anchor_text) :] if s.startswith(anchor_text) else None)
    return anchor_text, out


def _lossy_forms(b: bytes) -> tuple[str, str]:
    """What a decoder may print for bytes that are not valid UTF-8 (grouped or per-byte U+FFFD)."""
    grouped = b.decode("utf-8", errors="replace")
    per_byte = []
    i = 0
    while i < len(b):
        for j in range(min(len(b), i + 4), i, -1):
            try:
                per_byte.append(b[i:j].decode("utf-8"))
                i = j
                break
            except UnicodeDecodeError:
                continue
        else:
            per_byte.append("\ufffd")
            i += 1
    return grouped, "".join(per_byte)


# ---- building a table ----------------------------------------------------------------------


def _decoder(tokenizer, backend) -> tuple[Callable[[str], tuple[bytes, bool]] | None, Callable, str]:
    """(emulator or None, decode_batch over id lists, method name) for a tokenizer."""
    if backend is not None:
        steps = _decoder_steps(backend)
        emulate = _make_emulator(steps) if steps else None

        def decode_batch(seqs):
            return backend.decode_batch(seqs, skip_special_tokens=False)

        return emulate, decode_batch, ("emulated:" + "+".join(s["type"] for s in steps) if emulate else "decoded")
    emulate = _sentencepiece_piece if getattr(tokenizer, "sp_model", None) is not None else None

    def decode_python(seqs):
        return [tokenizer.decode(s, skip_special_tokens=False, clean_up_tokenization_spaces=False) for s in seqs]

    return emulate, decode_python, ("sentencepiece" if emulate else "decoded")


def _emulate_all(tokenizer, emulate, raw, candidates, out, bf) -> int:
    """Fill ``out``/``bf`` with the emulated bytes of the candidates; returns how many added tokens
    were dropped because their emulated bytes differ from their own text."""
    try:
        added = {int(i): t for i, t in tokenizer.added_tokens_decoder.items()}
    except Exception:  # pragma: no cover
        added = {}
    dropped = 0
    for i in candidates:
        b, is_bf = emulate(raw[i])
        if i in added and not is_bf:
            # Added tokens are matched as their own text when encoding, but still pass
            # through the decoder; keep them only where both agree.
            if b != added[i].content.encode("utf-8"):
                dropped += 1
                continue
        out[i] = b
        bf[i] = is_bf
    return dropped


def _read_decoded(decode_batch, anchor: int, candidates, out) -> None:
    """Without an emulator: each candidate's bytes are its text decoded after the anchor, where
    that text is whole characters (no U+FFFD)."""
    _, decoded = _decoded_suffixes(decode_batch, anchor, candidates)
    for i, text in zip(candidates, decoded, strict=True):
        if text and "\ufffd" not in text:
            out[i] = text.encode("utf-8")


def _cross_check(decode_batch, anchor: int, to_check, raw, out, bf) -> tuple[int, list]:
    """Drop (set to None) every emulated token whose text decoded after the anchor differs from
    its emulated bytes; returns how many were dropped and up to 5 examples."""
    anchor_text, decoded = _decoded_suffixes(decode_batch, anchor, to_check)
    if anchor_text.encode("utf-8") != out[anchor]:
        log.warning("vocab: anchor %r decodes to %r; cross-check skipped", out[anchor], anchor_text)
        return 0, []
    dropped, examples = 0, []
    for i, text in zip(to_check, decoded, strict=True):
        b = out[i]
        try:
            ok = text == b.decode("utf-8")
        except UnicodeDecodeError:
            ok = text in _lossy_forms(b)
        if not ok:
            dropped += 1
            if len(examples) < 5:
                examples.append((i, raw[i], b, text))
            out[i] = None
            bf[i] = False
    return dropped, examples


def _build_table(tokenizer) -> ByteTable:
    """Emulate the decoder per token where it can, then check every token against the decoder
    itself after an anchor token (or, with no emulator, take the decoder's text)."""
    n = len(tokenizer)
    backend = rust_backend(tokenizer)
    if backend is not None:
        raw: list[str | None] = [backend.id_to_token(i) for i in range(n)]
    else:
        raw = list(tokenizer.convert_ids_to_tokens(list(range(n))))
    special = _special_ids(tokenizer, raw)
    emulate, decode_batch, method = _decoder(tokenizer, backend)
    candidates = [i for i in range(n) if raw[i] is not None and i not in special]
    out: list[bytes | None] = [None] * n
    bf = np.zeros(n, dtype=bool)
    disagreements = 0
    if emulate is None:
        singles = [(s.encode("utf-8") if s is not None and len(s) == 1 else None) for s in raw]
        anchor = _find_anchor(singles, special, bf)
        if anchor is None:
            log.warning("vocab: no anchor token and no known decoder; every token is excluded")
        else:
            _read_decoded(decode_batch, anchor, candidates, out)
    else:
        disagreements = _emulate_all(tokenizer, emulate, raw, candidates, out, bf)
        anchor = _find_anchor(out, special, bf)
        if anchor is not None:
            to_check = [i for i in candidates if out[i] is not None]
            if backend is None and len(to_check) > 5000:  # pure-Python decode: check a sample
                to_check = to_check[:: max(1, len(to_check) // 5000)]
            dropped, examples = _cross_check(decode_batch, anchor, to_check, raw, out, bf)
            disagreements += dropped
            if examples:
                log.warning("vocab: %d token(s) excluded because their decoded text differs from the emulated "
                            "bytes, e.g. %s", disagreements, examples)
    for i, b in enumerate(out):
        if b is not None and len(b) == 0:
            out[i] = None
            bf[i] = False
    return _finish(out, bf, special, method, disagreements)


def _finish(out, bf, special, method, disagreements) -> ByteTable:
    special_arr = np.array(sorted(special), dtype=np.int64)
    lengths = np.array([-1 if b is None else len(b) for b in out], dtype=np.int64)
    h = hashlib.sha256()
    h.update(f"crossdraft-vocab-table-v{FORMAT_VERSION}:{len(out)}".encode())
    h.update(lengths.tobytes())
    h.update(b"".join(b for b in out if b is not None))
    h.update(np.packbits(bf).tobytes())
    h.update(special_arr.tobytes())
    index: dict[bytes, int] = {}
    # Canonical id per bytes: lowest non-byte-fallback id, else lowest byte-fallback id.
    for i, b in enumerate(out):
        if b is not None and not bf[i] and b not in index:
            index[b] = i
    for i in np.flatnonzero(bf):
        b = out[int(i)]
        if b is not None and b not in index:
            index[b] = int(i)
    max_len = int(lengths.max()) if len(lengths) else 0
    bf.setflags(write=False)
    special_arr.setflags(write=False)
    return ByteTable(out, bf, special_arr, method, disagreements, h.hexdigest(), index, max(max_len, 0))
