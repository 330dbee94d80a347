"""The vocabulary report (``crossdraft vocab``): a mapping's numbers beside an HF-style baseline.

Hugging Face's ``AssistantToTargetTranslator`` matches raw token strings after replacing only a
*leading* space marker (``▁`` <-> ``Ġ``). It misses every token whose other characters are
remapped bytes (``Ċ`` newline, ``ĉ`` tab, ``ĠĠĠ`` indentation, ``Ã©`` = "é" ...), and it can
produce *false* matches: Gemma's literal letter ``Ċ`` (U+010A) equals Qwen's newline symbol ``Ċ``
as a string. :func:`vocab_report` reimplements that rule (it does not import HF's code) and
reports its size, how many of its pairs have different bytes, and examples of tokens only the
byte mapping pairs.

Gemma 3 <-> Qwen2.5: HF-style matches 63,608 target ids (3 of them special-looking text: Qwen's
plain tokens ``<unk>``, ``<s>``, ``</s>`` paired with Gemma's), ~180 of them pairs with
*different* text; the byte mapping 95,966. Matching all decoded text gives 95,969: the difference
is exactly those 3 pairs (Gemma's ``<unk>`` is its unknown token, its ``<s>``/``</s>`` are
non-special HTML tags; Qwen's three are plain text). Control-looking tokens are excluded on
purpose; counting only the two HTML tags would give 95,968.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from crossdraft.vocab.mapping import build_mapping
from crossdraft.vocab.tokenbytes import byte_table

__all__ = ["vocab_report"]


def _space_sign(tokenizer) -> str | None:
    """The character the tokenizer's tokens start with for a leading space (``Ġ``, ``▁``), or None."""
    try:
        ids = tokenizer(" ", add_special_tokens=False)["input_ids"]
        if ids:
            tok = tokenizer.convert_ids_to_tokens(ids)[0]
            return tok[0] if tok else None
    except Exception:  # pragma: no cover
        return None
    return None


def _hf_style_pairs(target_tokenizer, drafter_tokenizer) -> dict[int, int]:
    """This module's equivalent of HF's rule: raw strings, only a leading space marker translated.

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


def _kind(b: bytes) -> int:
    """The kind of text a token stands for: newline, tab, indentation, non-ASCII, partial UTF-8, other."""
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


def _examples(tbytes: list, ids: list[int], count: int) -> list[int]:
    """Up to ``count`` of ``ids`` from several kinds of tokens (:func:`_kind`), shortest first,
    taken in turn so that one kind does not crowd out the others."""
    buckets: dict[int, list[int]] = {}
    for t in sorted(ids, key=lambda t: (len(tbytes[t]), t)):
        buckets.setdefault(_kind(tbytes[t]), []).append(t)
    picked: list[int] = []
    for group in itertools.zip_longest(*(buckets[k] for k in sorted(buckets))):
        picked.extend(t for t in group if t is not None)
        if len(picked) >= count:
            break
    return picked[:count]


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
    tt, dt = byte_table(target_tokenizer), byte_table(drafter_tokenizer)
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
    # target ids the byte mapping pairs but HF-style does not pair correctly (missing, or with other text)
    only_ours = [int(t) for t in ours if int(t) not in pairs or int(t) in wrong_targets]
    report.update(
        {
            "hf_style_intersection": len(pairs),
            "hf_style_special_pairs": len(wrong) - len(wrong_text),
            "hf_style_wrong_text_pairs": len(wrong_text),
            "hf_style_correct_pairs": len(pairs) - len(wrong),
            "only_ours": len(only_ours),
            "examples_only_ours": [repr(tt.bytes[t]) for t in _examples(tt.bytes, only_ours, examples)],
            "examples_hf_wrong": [
                f"{target_tokenizer.convert_ids_to_tokens(t)!r}={tt.bytes[t]!r} vs "
                f"{drafter_tokenizer.convert_ids_to_tokens(d)!r}={dt.bytes[d]!r}"
                for t, d in wrong_text[:examples]
            ],
        }
    )
    return report
