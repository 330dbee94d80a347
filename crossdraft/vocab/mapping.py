"""Vocabulary mapping between a drafter tokenizer and a target tokenizer (UAG-TLI).

The drafter may only propose tokens that stand for *exactly* the same bytes in both
vocabularies. Tokens are therefore matched by the bytes each one stands for in the middle of a
text, never by their raw token strings:

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

Mapping rules (:func:`build_mapping`)
-------------------------------------
* ``d2t[d]`` is the target id with the same bytes as drafter id ``d`` (-1 if none). When several
  target ids stand for the same bytes (Gemma's added ``"\\n"`` and byte-fallback ``<0x0A>``), the
  canonical one is the lowest id that is not a byte-fallback token, else the lowest id.
* Several drafter ids may map to the same target id (SentencePiece ``▁`` and ``<0x20>``); the
  engine adds their probabilities. ``t2d[t]`` names one canonical drafter id for every target id
  in the image of ``d2t`` (non-byte-fallback first, then lowest id) and is -1 elsewhere, so
  ``t2d[t] >= 0`` exactly on the intersection and ``d2t[t2d[t]] == t``. A target id that is a
  non-canonical duplicate (Gemma ``<0x0A>`` when ``"\\n"`` exists) is *not* in the intersection:
  counting it too would count the same drafter mass twice.
* Identical vocabularies (same bytes tables, same special sets): identity over non-special ids.

HF-style baseline (:func:`vocab_report`)
----------------------------------------
Hugging Face's ``AssistantToTargetTranslator`` matches raw token strings after replacing only a
*leading* space marker (``▁`` <-> ``Ġ``). It misses every token whose other characters are
remapped bytes (``Ċ`` newline, ``ĉ`` tab, ``ĠĠĠ`` indentation, ``Ã©`` = "é" ...), and it can
produce *false* matches: Gemma's literal letter ``Ċ`` (U+010A) equals Qwen's newline symbol ``Ċ``
as a string. :func:`vocab_report` reimplements that rule (it does not import HF's code) and
reports its size, how many of its pairs have different bytes, and examples of tokens only we map.

How the engine should tokenize text for the drafter (re-sync)
-------------------------------------------------------------
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

Pitfalls found
--------------
* Gemma 3 loaded from GGUF (transformers' converter): ``<start_of_turn>``/``<end_of_turn>``,
  ``<unusedNN>`` and the other control tokens come back as special added tokens, but
  ``<start_of_image>``/``<end_of_image>`` come back as plain vocabulary (excluded by pattern),
  and ``[multimodal]``, ``"\\n"`` .. 31 newlines, tab runs and HTML tags (``<table>``, ``<code>``,
  ``<s>`` = strikethrough) are *non-special* added tokens (GGUF type USER_DEFINED). The newline,
  tab and HTML tokens are real text and are mapped; the newline tokens being added tokens, Gemma
  never encodes ``"\\n"`` as ``<0x0A>``.
* Gemma 3 <-> Qwen2.5: HF-style 63,608 target ids (3 of them special-looking text: Qwen's plain
  tokens ``<unk>``, ``<s>``, ``</s>`` paired with Gemma's), ~180 of them pairs with *different*
  text; ours 95,966. Matching all decoded text gives 95,969: the difference is exactly those
  3 pairs (Gemma's ``<unk>`` is its unknown token, its ``<s>``/``</s>`` are non-special HTML
  tags; Qwen's three are plain text). We exclude control-looking tokens on purpose; counting
  only the two HTML tags would give 95,968.
* Qwen2.5 from GGUF has 151,936 ids: 151,643 BPE tokens, 22 added tokens, and 271
  ``[PAD151665]`` .. placeholders that are plain vocabulary entries (GGUF type UNUSED) with
  text "[PAD151665]"; HF does not mark them special, we exclude them by pattern. Only 2 ids are
  in ``all_special_ids``; the other control tokens are found through ``added_tokens_decoder``.
* Non-special added tokens go through the decoder too: in a byte-level tokenizer an added token
  "café" decodes to "caf\\ufffd" (``é`` is also the byte symbol for 0xE9) although it matches the
  text "café" when encoding. Such tokens are excluded.
* Tokens that the tokenizer never produces (a Gemma piece with a literal space, non-NFC pieces in
  Qwen, the ``[PAD]`` placeholders) may still be in the vocabulary. Mapping them is harmless for
  losslessness (the target verifies whatever is drafted), they just are almost never drafted.
* ``len(tokenizer)`` may differ from the model's embedding size (Qwen2.5-1.5B: 151,665 in the
  official tokenizer vs 151,936 rows); use ``allowed_drafter_mask(size)`` for wider logits.
* transformers' Python (non-Rust) SentencePiece tokenizers print byte-fallback pieces literally
  ("<0x0A>") and drop a lone "▁" when decoding; such tokens fail the decode cross-check and are
  excluded. WordPiece vocabularies are handled only as well as their lossy decoder allows.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

__all__ = [
    "TokenPair",
    "VocabMapping",
    "build_mapping",
    "chat_ids",
    "decode_bytes",
    "encode_bytes",
    "token_bytes",
    "vocab_report",
    "default_cache_dir",
    "clear_memory_cache",
]

# Bump when the way bytes or mappings are computed changes: it is part of every cache key.
_FORMAT_VERSION = 1

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


# --------------------------------------------------------------------------------------------
# Per-token bytes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Table:
    """What one tokenizer's ids stand for. Internal; :func:`token_bytes` exposes ``bytes``."""

    bytes: list  # list[bytes | None]
    byte_fallback: np.ndarray  # bool [n]: a <0xNN> byte-fallback token
    special: np.ndarray  # int64 sorted: ids excluded as special/control
    method: str  # how bytes were obtained (for reports)
    disagreements: int  # tokens excluded because emulation and decoder disagreed
    digest: str = ""
    index: dict = field(default_factory=dict, repr=False)  # bytes -> canonical id
    max_len: int = 0


# tokenizer object -> (fingerprint, _Table); tokenizers are weak-referenceable objects.
_TABLES: "weakref.WeakKeyDictionary[Any, tuple[tuple, _Table]]" = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def _fingerprint(tokenizer) -> tuple:
    """Cheap identity of a tokenizer's state, to notice ``add_tokens`` after a table was built.

    It runs on every table lookup (several per round), so fast tokenizers answer from the Rust
    backend in microseconds; transformers' ``added_tokens_decoder`` builds a dict of every added
    token per call (~15 ms for Gemma-3's), which once took most of the gateway's CPU."""
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


def _table(tokenizer) -> _Table:
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
    return list(_table(tokenizer).bytes)


def _backend(tokenizer):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        backend = getattr(tokenizer, "_tokenizer", None)
    # A tokenizers.Tokenizer has decode_batch / id_to_token.
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
                # Only the first token of a sequence loses its leading space; we are mid-text.
                rep = s.get("replacement", "\u2581")
                if isinstance(state, str):
                    state = state.replace(rep, " ")
                else:
                    state = state.replace(rep.encode("utf-8"), b" ")
            elif kind == "Fuse":
                fused = True
            elif kind == "Strip":
                # After Fuse it only touches the ends of the whole text, not a mid-text token.
                if not fused:
                    ch, start, stop = s.get("content", " "), int(s.get("start", 0)), int(s.get("stop", 0))
                    st = state if isinstance(state, str) else None
                    if st is not None:
                        k = 0
                        while k < start and k < len(st) and st[k] == ch:
                            k += 1
                        st = st[k:]
                        k = 0
                        while k < stop and k < len(st) and st[len(st) - 1 - k] == ch:
                            k += 1
                        state = st[: len(st) - k]
        if isinstance(state, str):
            state = state.encode("utf-8")
        return state, is_bf

    return convert


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


def _build_table(tokenizer) -> _Table:
    n = len(tokenizer)
    backend = _backend(tokenizer)
    if backend is not None:
        raw: list[str | None] = [backend.id_to_token(i) for i in range(n)]
    else:
        raw = list(tokenizer.convert_ids_to_tokens(list(range(n))))
    special = _special_ids(tokenizer, raw)
    try:
        added = {int(i): t for i, t in tokenizer.added_tokens_decoder.items()}
    except Exception:  # pragma: no cover
        added = {}

    out: list[bytes | None] = [None] * n
    bf = np.zeros(n, dtype=bool)
    disagreements = 0

    if backend is not None:
        steps = _decoder_steps(backend)
        emulate = _make_emulator(steps) if steps else None

        def decode_batch(seqs):
            return backend.decode_batch(seqs, skip_special_tokens=False)

        method = "emulated:" + "+".join(s["type"] for s in steps) if emulate else "decoded"
    else:
        emulate = None
        sp = getattr(tokenizer, "sp_model", None)
        if sp is not None:

            def emulate(tok: str) -> tuple[bytes, bool]:  # noqa: F811
                m = _BYTE_FALLBACK_RE.match(tok)
                if m:
                    return bytes([int(m.group(1), 16)]), True
                return tok.replace("\u2581", " ").encode("utf-8"), False

        def decode_batch(seqs):
            return [
                tokenizer.decode(s, skip_special_tokens=False, clean_up_tokenization_spaces=False) for s in seqs
            ]

        method = "sentencepiece" if emulate else "decoded"

    candidates = [i for i in range(n) if raw[i] is not None and i not in special]
    if emulate is not None:
        for i in candidates:
            b, is_bf = emulate(raw[i])
            if i in added and not is_bf:
                # Added tokens are matched as their own text when encoding, but still pass
                # through the decoder; keep them only where both agree.
                if b != added[i].content.encode("utf-8"):
                    disagreements += 1
                    continue
            out[i] = b
            bf[i] = is_bf

    anchor = _find_anchor(out if emulate is not None else [
        (s.encode("utf-8") if s is not None and len(s) == 1 else None) for s in raw
    ], special, bf)
    if anchor is None and emulate is None:
        log.warning("vocab: no anchor token and no known decoder; every token is excluded")
        return _finish(out, bf, special, method, disagreements)

    if anchor is not None:
        if emulate is not None:
            to_check = [i for i in candidates if out[i] is not None]
            if backend is None and len(to_check) > 5000:  # pure-Python decode: check a sample
                to_check = to_check[:: max(1, len(to_check) // 5000)]
        else:
            to_check = candidates
        anchor_text, decoded = _decoded_suffixes(decode_batch, anchor, to_check)
        if emulate is not None and anchor_text.encode("utf-8") != out[anchor]:
            log.warning("vocab: anchor %r decodes to %r; cross-check skipped", out[anchor], anchor_text)
        else:
            examples = []
            for i, text in zip(to_check, decoded, strict=True):
                if emulate is None:
                    if text and "\ufffd" not in text:
                        out[i] = text.encode("utf-8")
                    continue
                b = out[i]
                try:
                    ok = text == b.decode("utf-8")
                except UnicodeDecodeError:
                    ok = text in _lossy_forms(b)
                if not ok:
                    disagreements += 1
                    if len(examples) < 5:
                        examples.append((i, raw[i], b, text))
                    out[i] = None
                    bf[i] = False
            if examples:
                log.warning(
                    "vocab: %d token(s) excluded because their decoded text differs from the emulated "
                    "bytes, e.g. %s", disagreements, examples,
                )
    for i, b in enumerate(out):
        if b is not None and len(b) == 0:
            out[i] = None
            bf[i] = False
    return _finish(out, bf, special, method, disagreements)


def _finish(out, bf, special, method, disagreements) -> _Table:
    special_arr = np.array(sorted(special), dtype=np.int64)
    lengths = np.array([-1 if b is None else len(b) for b in out], dtype=np.int64)
    h = hashlib.sha256()
    h.update(f"crossdraft-vocab-table-v{_FORMAT_VERSION}:{len(out)}".encode())
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
    return _Table(out, bf, special_arr, method, disagreements, h.hexdigest(), index, max(max_len, 0))


# --------------------------------------------------------------------------------------------
# Mapping
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class VocabMapping:
    """Drafter <-> target id mapping over tokens that stand for identical bytes."""

    d2t: np.ndarray  # int64 [drafter_vocab_size]: drafter id -> target id, -1 if none
    t2d: np.ndarray  # int64 [target_vocab_size]: target id -> canonical drafter id, -1 if none
    drafter_vocab_size: int
    target_vocab_size: int
    key: str

    def intersection_size(self) -> int:
        """Number of distinct target ids the drafter can propose."""
        return int(np.count_nonzero(self.t2d >= 0))

    def stats(self) -> dict:
        mapped = self.d2t[self.d2t >= 0]
        counts = np.bincount(mapped, minlength=self.target_vocab_size) if mapped.size else np.zeros(0, np.int64)
        many_to_one = int(counts[counts > 1].sum()) if counts.size else 0
        inter = self.intersection_size()
        return {
            "drafter_vocab_size": self.drafter_vocab_size,
            "target_vocab_size": self.target_vocab_size,
            "intersection_size": inter,
            "drafter_coverage": float(mapped.size / self.drafter_vocab_size) if self.drafter_vocab_size else 0.0,
            "target_coverage": float(inter / self.target_vocab_size) if self.target_vocab_size else 0.0,
            "many_to_one": many_to_one,
            "key": self.key,
        }

    def allowed_drafter_mask(self, size: int | None = None) -> np.ndarray:
        """Bool mask over drafter ids that may be drafted; ``size`` pads (False) or truncates."""
        mask = self.d2t >= 0
        if size is None or size == self.drafter_vocab_size:
            return mask
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        out = np.zeros(size, dtype=bool)
        k = min(size, self.drafter_vocab_size)
        out[:k] = mask[:k]
        return out


    def resized(self, drafter_size: int, target_size: int) -> "VocabMapping":
        """The mapping over a drafter model's and a target model's logit rows, whose sizes may
        differ from the tokenizers' (padded embeddings): ids beyond either side map to -1."""
        d2t = np.full(drafter_size, -1, dtype=np.int64)
        n = min(drafter_size, len(self.d2t))
        d2t[:n] = self.d2t[:n]
        d2t[d2t >= target_size] = -1
        t2d = np.full(target_size, -1, dtype=np.int64)
        n = min(target_size, len(self.t2d))
        t2d[:n] = self.t2d[:n]
        t2d[t2d >= drafter_size] = -1
        d2t.setflags(write=False)
        t2d.setflags(write=False)
        return VocabMapping(d2t=d2t, t2d=t2d, drafter_vocab_size=drafter_size, target_vocab_size=target_size,
                            key=self.key)

    def map_distribution(self, q_ids, q_probs) -> tuple[np.ndarray, np.ndarray]:
        """A drafter distribution (drafter ids in the intersection, probabilities) as target ids
        (ascending, unique) + float64 probabilities: drafter tokens standing for the same target
        token add up (many-to-one, e.g. a byte-fallback token and a plain one)."""
        t = self.d2t[np.asarray(q_ids, dtype=np.int64)]
        if (t < 0).any():
            raise ValueError("the distribution has drafter ids outside the intersection")
        p = np.asarray(q_probs, dtype=np.float64)
        order = np.argsort(t, kind="stable")
        t, p = t[order], p[order]
        if len(t) > 1 and (t[1:] == t[:-1]).any():
            uniq, inv = np.unique(t, return_inverse=True)
            acc = np.zeros(len(uniq), dtype=np.float64)
            np.add.at(acc, inv, p)
            t, p = uniq, acc
        return t, p


_MEMORY: dict[str, VocabMapping] = {}
_MEMORY_LOCK = threading.Lock()


def clear_memory_cache() -> None:
    """Forget in-memory mappings and per-tokenizer tables (tests; after mutating tokenizers)."""
    with _MEMORY_LOCK:
        _MEMORY.clear()
    with _TABLES_LOCK:
        _TABLES.clear()


def default_cache_dir() -> Path:
    """``$CROSSDRAFT_HOME/vocab`` (``CROSSDRAFT_HOME`` defaults to ``~/.cache/crossdraft``)."""
    from crossdraft.home import crossdraft_home

    return crossdraft_home() / "vocab"


def _mapping_key(target: _Table, drafter: _Table) -> str:
    h = hashlib.sha256(f"crossdraft-vocab-map-v{_FORMAT_VERSION}".encode())
    h.update(b"target:" + target.digest.encode())
    h.update(b"drafter:" + drafter.digest.encode())
    return h.hexdigest()


def _compute(target: _Table, drafter: _Table, key: str) -> VocabMapping:
    nt, nd = len(target.bytes), len(drafter.bytes)
    d2t = np.full(nd, -1, dtype=np.int64)
    t2d = np.full(nt, -1, dtype=np.int64)
    if target.digest == drafter.digest:
        ids = np.array([i for i, b in enumerate(target.bytes) if b is not None], dtype=np.int64)
        d2t[ids] = ids
        t2d[ids] = ids
    else:
        tindex = target.index
        for d, b in enumerate(drafter.bytes):
            if b is not None:
                t = tindex.get(b)
                if t is not None:
                    d2t[d] = t
        # Canonical drafter id per target id: non-byte-fallback first, then the lowest id.
        order = np.concatenate([np.flatnonzero(~drafter.byte_fallback), np.flatnonzero(drafter.byte_fallback)])
        targets = d2t[order]
        keep = targets >= 0
        order, targets = order[keep], targets[keep]
        # First occurrence of each target in `order` wins.
        uniq, first = np.unique(targets, return_index=True)
        t2d[uniq] = order[first]
    d2t.setflags(write=False)
    t2d.setflags(write=False)
    return VocabMapping(d2t=d2t, t2d=t2d, drafter_vocab_size=nd, target_vocab_size=nt, key=key)


def _load_disk(path: Path, key: str, nt: int, nd: int) -> VocabMapping | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            stored_key = str(z["key"])
            d2t = np.asarray(z["d2t"], dtype=np.int64)
            t2d = np.asarray(z["t2d"], dtype=np.int64)
    except FileNotFoundError:
        return None
    except Exception as exc:  # corrupt, truncated, not an npz ...
        log.warning("vocab: ignoring unreadable cache file %s (%s)", path, exc)
        return None
    if stored_key != key or d2t.shape != (nd,) or t2d.shape != (nt,):
        log.warning("vocab: ignoring inconsistent cache file %s", path)
        return None
    if (d2t >= nt).any() or (t2d >= nd).any() or (d2t < -1).any() or (t2d < -1).any():
        log.warning("vocab: ignoring cache file %s with out-of-range ids", path)
        return None
    d2t.setflags(write=False)
    t2d.setflags(write=False)
    return VocabMapping(d2t=d2t, t2d=t2d, drafter_vocab_size=nd, target_vocab_size=nt, key=key)


def _save_disk(path: Path, mapping: VocabMapping) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{mapping.key[:16]}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, d2t=mapping.d2t, t2d=mapping.t2d, key=np.array(mapping.key))
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache may be shared
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except OSError as exc:
        log.warning("vocab: could not write cache file %s (%s)", path, exc)


def build_mapping(target_tokenizer, drafter_tokenizer, *, cache_dir: str | Path | None = None) -> VocabMapping:
    """Map drafter ids to target ids over tokens with identical bytes.

    Cached in memory (by key) and on disk as ``<cache_dir>/<key>.npz`` (default
    :func:`default_cache_dir`). The key hashes both bytes tables and special sets, so a changed
    tokenizer never hits a stale entry; an unreadable cache file is ignored and rewritten.
    """
    target = _table(target_tokenizer)
    drafter = _table(drafter_tokenizer)
    key = _mapping_key(target, drafter)
    with _MEMORY_LOCK:
        hit = _MEMORY.get(key)
    if hit is not None:
        return hit
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"{key}.npz"
    mapping = _load_disk(path, key, len(target.bytes), len(drafter.bytes))
    if mapping is None:
        mapping = _compute(target, drafter, key)
        _save_disk(path, mapping)
    with _MEMORY_LOCK:
        _MEMORY[key] = mapping
    return mapping


# --------------------------------------------------------------------------------------------
# Bytes <-> ids helpers for the engine
# --------------------------------------------------------------------------------------------


def decode_bytes(tokenizer, ids: Sequence[int], *, strict: bool = False) -> bytes:
    """The exact bytes of ``ids`` as mid-text tokens (no stripped leading space, no U+FFFD).

    Special/unmappable ids contribute nothing, or raise ``ValueError`` when ``strict``.
    """
    table = _table(tokenizer).bytes
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


def _greedy(table: _Table, data: bytes) -> list[int] | None:
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


def encode_bytes(tokenizer, data: bytes, *, table: _Table | None = None) -> list[int]:
    """Ids (no special tokens) whose bytes concatenate to exactly ``data``.

    Tries the tokenizer's own tokenization (plain, then behind an anchor, which defeats a
    prepended ``▁``), and falls back to a greedy longest match over the token bytes; raises
    ``ValueError`` only if the vocabulary cannot spell ``data`` at all. ``table``: the tokenizer's
    table when the caller holds it (:class:`TokenPair`: skips the per-call staleness check).
    """
    if not data:
        return []
    table = table if table is not None else _table(tokenizer)
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


def _encode_text(tokenizer, text: str, data: bytes, exact, table: _Table) -> list[int]:
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


# --------------------------------------------------------------------------------------------
# Report with the HF-style baseline
# --------------------------------------------------------------------------------------------


def _space_sign(tokenizer) -> str | None:
    try:
        ids = tokenizer(" ", add_special_tokens=False)["input_ids"]
        if ids:
            tok = tokenizer.convert_ids_to_tokens(ids)[0]
            return tok[0] if tok else None
    except Exception:  # pragma: no cover
        return None
    return None


def _hf_style_pairs(target_tokenizer, drafter_tokenizer) -> dict[int, int]:
    """Our equivalent of HF's rule: raw strings, only a leading space marker translated.

    Returns target id -> drafter id (the last drafter id wins, as in a dict comprehension).
    """
    tvocab = target_tokenizer.get_vocab()
    dvocab = drafter_tokenizer.get_vocab()
    ts, ds = _space_sign(target_tokenizer), _space_sign(drafter_tokenizer)
    if ts is not None and ds is not None and ts != ds:
        dvocab = {(ts + tok[1:] if tok.startswith(ds) else tok): i for tok, i in dvocab.items()}
    pairs: dict[int, int] = {}
    for tok, d in dvocab.items():
        t = tvocab.get(tok)
        if t is not None:
            pairs[t] = d
    return pairs


def vocab_report(
    target_tokenizer,
    drafter_tokenizer,
    *,
    hf_baseline: bool = True,
    examples: int = 12,
    cache_dir: str | Path | None = None,
) -> dict:
    """``build_mapping(...).stats()`` plus how HF-style string matching compares.

    With ``hf_baseline``: ``hf_style_intersection`` (distinct target ids HF's rule matches, special
    tokens included, as HF counts), split into ``hf_style_correct_pairs`` (same bytes),
    ``hf_style_wrong_text_pairs`` (equal strings, different text: lossy drafts) and
    ``hf_style_special_pairs``; ``only_ours`` and ``examples_only_ours`` (repr'd bytes, whitespace
    first); ``examples_hf_wrong``.
    """
    mapping = build_mapping(target_tokenizer, drafter_tokenizer, cache_dir=cache_dir)
    report = mapping.stats()
    tt, dt = _table(target_tokenizer), _table(drafter_tokenizer)
    report["target_method"], report["drafter_method"] = tt.method, dt.method
    report["target_excluded_special"] = int(tt.special.size)
    report["drafter_excluded_special"] = int(dt.special.size)
    if not hf_baseline:
        return report
    pairs = _hf_style_pairs(target_tokenizer, drafter_tokenizer)
    tspecial, dspecial = set(tt.special.tolist()), set(dt.special.tolist())
    wrong = [
        (t, d) for t, d in pairs.items()
        if t >= len(tt.bytes) or d >= len(dt.bytes) or tt.bytes[t] is None or tt.bytes[t] != dt.bytes[d]
    ]
    wrong_text = [(t, d) for t, d in wrong if t not in tspecial and d not in dspecial]
    ours = np.flatnonzero(mapping.t2d >= 0)
    wrong_targets = {t for t, _ in wrong}
    # target ids we map but HF-style does not map correctly (missing, or paired with other text)
    only_ours = [int(t) for t in ours if int(t) not in pairs or int(t) in wrong_targets]

    # Examples from several kinds of tokens (newlines, tabs, indentation, non-ASCII ...),
    # shortest first, taken in turn so that one kind does not crowd out the others.
    def kind(b: bytes) -> int:
        if b"\n" in b:
            return 0
        if b"\t" in b:
            return 1
        if b.startswith(b"  "):
            return 2
        try:
            return 3 if not b.isascii() and b.decode("utf-8") else 5
        except UnicodeDecodeError:
            return 4
    buckets: dict[int, list[int]] = {}
    for t in sorted(only_ours, key=lambda t: (len(tt.bytes[t]), t)):
        buckets.setdefault(kind(tt.bytes[t]), []).append(t)
    picked: list[int] = []
    for group in itertools.zip_longest(*(buckets[k] for k in sorted(buckets))):
        picked.extend(t for t in group if t is not None)
        if len(picked) >= examples:
            break
    report.update(
        {
            "hf_style_intersection": len(pairs),
            "hf_style_special_pairs": len(wrong) - len(wrong_text),
            "hf_style_wrong_text_pairs": len(wrong_text),
            "hf_style_correct_pairs": len(pairs) - len(wrong),
            "only_ours": len(only_ours),
            "examples_only_ours": [repr(tt.bytes[t]) for t in picked[:examples]],
            "examples_hf_wrong": [
                f"{target_tokenizer.convert_ids_to_tokens(t)!r}={tt.bytes[t]!r} vs "
                f"{drafter_tokenizer.convert_ids_to_tokens(d)!r}={dt.bytes[d]!r}"
                for t, d in wrong_text[:examples]
            ],
        }
    )
    return report


# --------------------------------------------------------------------------------------------
# The runtime pair: both tokenizers and the mapping between the two models' ids
# --------------------------------------------------------------------------------------------


def has_chat_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


def chat_text(tok, messages: list[dict], model: str = "the model") -> str:
    """`messages` rendered with the tokenizer's chat template (+ generation prompt).

    ``model`` names the model in the error (never the tokenizer's path: that is a server detail)."""
    from crossdraft.errors import InvalidArgument

    if not has_chat_template(tok):
        raise InvalidArgument("messages", f"{model} has no chat template: send the conversation as text (a "
                                          "prompt to /v1/completions, or GenerateRequest.prompt)")
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def chat_ids(tok, messages: list[dict], model: str = "the model") -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template (+ generation prompt)."""
    return list(tok(chat_text(tok, messages, model), add_special_tokens=False)["input_ids"])


def frequency_order(tokenizer, size: int | None = None) -> np.ndarray:
    """Each id's place in the tokenizer's own frequency order, [size] int64 (0 = most frequent).

    A BPE vocabulary lists its merges in the order they were learned, most frequent pair first, so
    a token's place is the rank of the merge that builds it, after the base symbols (which every
    text may need) in id order; a Unigram vocabulary carries each piece's log probability. The id
    alone is not enough: Gemma-3's ids do not follow its merges (its first 32k ids cover 63% of the
    Qwen target's HumanEval completions, its first 32k merges 89%). Ids outside the model (added
    and special tokens, rows past the tokenizer) come last, in id order; a tokenizer without such a
    model gives the id order."""
    n = int(size or len(tokenizer))
    ids = np.arange(n, dtype=np.int64)
    # Sorted by (group, key, id): group 0 = base symbols / scored pieces, 1 = merged tokens, 2 = the
    # rest; the key is the merge rank or the negated score (0 where the group is ordered by id).
    group = np.full(n, 2, dtype=np.int64)
    key = np.zeros(n, dtype=np.float64)
    backend = _backend(tokenizer)
    model = None
    if backend is not None:
        try:
            model = json.loads(backend.to_str()).get("model") or {}
        except Exception:  # noqa: BLE001 -- an unreadable model: the id order below
            model = None
    kind = (model or {}).get("type")
    if kind == "BPE" and isinstance(model.get("vocab"), dict):
        vocab = model["vocab"]
        rank = np.full(n, -1, dtype=np.int64)
        for r, m in enumerate(model.get("merges") or []):
            a, b = (m[0], m[1]) if isinstance(m, (list, tuple)) else m.split(" ", 1)
            t = vocab.get(a + b)
            if t is not None and 0 <= t < n and rank[t] < 0:
                rank[t] = r
        known = np.fromiter((t for t in vocab.values() if 0 <= t < n), dtype=np.int64)
        group[known] = np.where(rank[known] < 0, 0, 1)
        key[known] = np.maximum(rank[known], 0)
    elif kind == "Unigram" and isinstance(model.get("vocab"), list):
        for t, entry in enumerate(model["vocab"][:n]):
            score = float(entry[1])
            if np.isfinite(score):
                group[t], key[t] = 0, -score
    else:
        group[:] = 0
    out = np.empty(n, dtype=np.int64)
    out[np.lexsort((ids, key, group))] = ids
    return out


class TokenPair:
    """Both tokenizers and the mapping between the two models' ids (drafter optional).

    What the round loop needs at run time, built from :class:`VocabMapping` resized to the
    models' logit rows: ``d2t`` / ``t2d`` (ids, -1 outside the intersection), the drafter masks
    (``"tli"``: the intersection; ``"text"``: every drafter token that stands for bytes, for text
    drafting), ``map_q`` (a drafter distribution as target ids), and the bytes of each id.
    """

    def __init__(self, target_tok, drafter_tok=None, target_vocab: int = 0, drafter_vocab: int = 0, *, mapping=None,
                 vocab_cache_dir=None, draft_vocab: int = 0):
        from crossdraft.errors import InvalidArgument

        # draft_vocab: the drafter drafts only from its this many most frequent tokens (frequency_order):
        # its LM head is then pruned to those rows, which a drafter with a large vocabulary reads on every
        # step (Gemma-3: 168M of its 268M parameters). Lossless whatever the set: the target verifies,
        # and its own tokens outside the set come from the residual. 0 = every token.
        if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, (int, np.integer)) or draft_vocab < 0:
            raise InvalidArgument("draft_vocab", f"must be an integer >= 0 (0 = no limit), got {draft_vocab!r}")
        self.draft_vocab = int(draft_vocab)

        self.target_tok = target_tok
        self.drafter_tok = drafter_tok
        self.vt = int(target_vocab or len(target_tok))
        # the tables once, here: the round loop spells and re-encodes bytes several times per round,
        # and checking a table for staleness costs 0.2 ms per call for Gemma-3's tokenizer
        self._t_table = _table(target_tok)
        self._d_table = None
        # encode_*_bytes of short byte strings, remembered: the round loop re-encodes each round's new
        # text (mostly one token's bytes, the same few hundred strings again and again) into drafter
        # ids, and the tokenizer's Python wrapper costs ~0.2 ms a call -- per round, per session, on
        # the gateway's one interpreter (measured in process: a round's work outside the forwards
        # 0.46 -> 0.26 ms)
        self._memo: dict[tuple[bool, bytes], tuple[int, ...]] = {}
        self.t_bytes = [b if b is not None else b"" for b in self._t_table.bytes]
        self.mapping = None
        self.same_vocab = False
        if drafter_tok is None:
            return
        self.mapping = mapping or build_mapping(target_tok, drafter_tok, cache_dir=vocab_cache_dir)
        vt, vd = self.vt, int(drafter_vocab or len(drafter_tok))
        self.vd = vd
        self.rows = self.mapping.resized(vd, vt)  # the mapping over the models' logit rows
        self.d2t, self.t2d = self.rows.d2t, self.rows.t2d
        self.allowed = self.rows.allowed_drafter_mask()  # [vd] bool: drafter ids in the intersection
        self._d_table = _table(drafter_tok)
        self.d_bytes = [b if b is not None else b"" for b in self._d_table.bytes]
        has_bytes = np.zeros(vd, dtype=bool)
        nb = min(vd, len(self.d_bytes))
        has_bytes[:nb] = [len(b) > 0 for b in self.d_bytes[:nb]]
        self.allowed_text = has_bytes  # text drafting may use every drafter token that stands for bytes
        src = np.nonzero(self.allowed)[0]
        self.same_vocab = vd == vt and bool(np.array_equal(self.d2t[src], src)) and int(has_bytes.sum()) == len(src)
        if not self.allowed.any():
            raise InvalidArgument("drafter", "shares no token with the target's vocabulary")
        base = f"{self.mapping.key}-{vt}-{vd}"
        self.keys = {"tli": f"{base}-tli", "text": f"{base}-text"}
        self.masks = {"tli": self.allowed, "text": self.allowed_text}
        if 0 < self.draft_vocab < vd:
            top = frequency_order(drafter_tok, vd) < self.draft_vocab
            for mode, mask in list(self.masks.items()):
                capped = mask & top
                if capped.any() and int(capped.sum()) < int(mask.sum()):  # (never an empty set)
                    self.masks[mode] = capped
                    self.keys[mode] += f"-top{self.draft_vocab}"

    # ---- text <-> ids ----------------------------------------------------------------------
    def encode_target(self, text: str) -> list[int]:
        return list(self.target_tok(text, add_special_tokens=True)["input_ids"])

    def encode_drafter(self, text: str) -> list[int]:
        return list(self.drafter_tok(text, add_special_tokens=True)["input_ids"])

    def chat_ids(self, messages: list[dict],
                 target_name: str = "the target model") -> tuple[list[int], list[int] | None]:
        """Both models' ids of a conversation, each in its own chat template. A drafter without a
        template drafts over the target's rendering (the text the target sees)."""
        text = chat_text(self.target_tok, messages, target_name)
        t = list(self.target_tok(text, add_special_tokens=False)["input_ids"])
        if self.drafter_tok is None:
            return t, None
        if has_chat_template(self.drafter_tok):
            return t, chat_ids(self.drafter_tok, messages)
        return t, self.encode_drafter(text)

    def target_text_bytes(self, ids) -> bytes:
        """The bytes of target ids (special tokens and ids past the tokenizer stand for none), as
        :func:`decode_bytes`."""
        tb, n = self.t_bytes, len(self.t_bytes)
        return b"".join(tb[i] for i in map(int, ids) if 0 <= i < n)

    MEMO_BYTES = 48  # strings up to this long are remembered
    MEMO_SIZE = 16384  # entries; past it the memo starts over

    def _encode_memo(self, drafter: bool, data: bytes) -> list[int]:
        """encode_bytes with the drafter's or the target's tokenizer (a pure function of ``data``),
        remembered for short strings. A string the vocabulary cannot spell raises every time."""
        tok, table = (self.drafter_tok, self._d_table) if drafter else (self.target_tok, self._t_table)
        if len(data) > self.MEMO_BYTES:
            return encode_bytes(tok, data, table=table)
        key = (drafter, bytes(data))
        ids = self._memo.get(key)
        if ids is None:
            ids = tuple(encode_bytes(tok, data, table=table))
            if len(self._memo) >= self.MEMO_SIZE:
                self._memo = {}
            self._memo[key] = ids
        return list(ids)

    def encode_target_bytes(self, data: bytes) -> list[int]:
        """:func:`encode_bytes` with the target's tokenizer."""
        return self._encode_memo(False, data)

    def encode_drafter_bytes(self, data: bytes) -> list[int]:
        """:func:`encode_bytes` with the drafter's tokenizer."""
        return self._encode_memo(True, data)

    def map_q(self, q_ids: np.ndarray, q_probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A drafter distribution as target ids: :meth:`VocabMapping.map_distribution`."""
        return self.rows.map_distribution(q_ids, q_probs)
