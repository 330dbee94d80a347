"""The drafter <-> target id mapping over tokens that stand for identical bytes (UAG-TLI).

Each tokenizer's ids are turned into bytes first (:mod:`crossdraft.vocab.tokenbytes`); two ids
match when they stand for exactly the same bytes in the middle of a text.

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
* Identical vocabularies (same bytes tables, same special sets): identity over non-special ids. So
  are vocabularies that differ only by ids past the shorter one that stand for no bytes (a Llama
  variant's extra reserved special ids, a GGUF Qwen's ``[PADnnnnnn]`` placeholders): the byte-fallback
  duplicates (``<0x20>`` beside ``▁``) then map to themselves too, and the pair is one vocabulary.
* Tokens that the tokenizer never produces (a Gemma piece with a literal space, non-NFC pieces in
  Qwen, the ``[PAD]`` placeholders) may still be in the vocabulary. Mapping them is harmless for
  losslessness (the target verifies whatever is drafted), they just are almost never drafted.
* ``len(tokenizer)`` may differ from the model's embedding size (Qwen2.5-1.5B: 151,665 in the
  official tokenizer vs 151,936 rows); :meth:`VocabMapping.resized` and
  ``allowed_drafter_mask(size)`` cover the models' rows.

Mappings are kept in memory by key and on disk (:mod:`crossdraft.vocab.cache`).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from crossdraft.vocab.cache import default_cache_dir, load_mapping, save_mapping
from crossdraft.vocab.tokenbytes import FORMAT_VERSION, ByteTable, byte_table, clear_tables

__all__ = ["VocabMapping", "build_mapping", "clear_memory_cache"]


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
    clear_tables()


# Bump when the mapping computed from two tables changes (part of every key, so no stale cache entry is
# read). 2: identity for vocabularies equal up to reserved ids past the shorter one (_same_up_to_reserved).
_MAPPING_REVISION = 2


def _mapping_key(target: ByteTable, drafter: ByteTable) -> str:
    h = hashlib.sha256(f"crossdraft-vocab-map-v{FORMAT_VERSION}r{_MAPPING_REVISION}".encode())
    h.update(b"target:" + target.digest.encode())
    h.update(b"drafter:" + drafter.digest.encode())
    return h.hexdigest()


def _same_up_to_reserved(target: ByteTable, drafter: ByteTable) -> bool:
    """The same vocabulary but for ids past the shorter table that stand for no bytes (reserved special
    ids, placeholders): the same bytes and byte-fallback flags id by id over the shorter one."""
    n = min(len(target.bytes), len(drafter.bytes))
    longer = target if len(target.bytes) > n else drafter
    if any(b is not None for b in longer.bytes[n:]):
        return False
    same_fallback = bool(np.array_equal(target.byte_fallback[:n], drafter.byte_fallback[:n]))
    return same_fallback and target.bytes[:n] == drafter.bytes[:n]


def _compute(target: ByteTable, drafter: ByteTable, key: str) -> VocabMapping:
    nt, nd = len(target.bytes), len(drafter.bytes)
    d2t = np.full(nd, -1, dtype=np.int64)
    t2d = np.full(nt, -1, dtype=np.int64)
    if target.digest == drafter.digest or _same_up_to_reserved(target, drafter):
        n = min(nt, nd)
        ids = np.array([i for i, b in enumerate(target.bytes[:n]) if b is not None], dtype=np.int64)
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


def build_mapping(target_tokenizer, drafter_tokenizer, *, cache_dir: str | Path | None = None) -> VocabMapping:
    """Map drafter ids to target ids over tokens with identical bytes.

    Cached in memory (by key) and on disk as ``<cache_dir>/<key>.npz`` (default
    :func:`crossdraft.vocab.cache.default_cache_dir`). The key hashes both bytes tables and special
    sets, so a changed tokenizer never hits a stale entry; an unreadable cache file is ignored and
    rewritten.
    """
    target = byte_table(target_tokenizer)
    drafter = byte_table(drafter_tokenizer)
    key = _mapping_key(target, drafter)
    with _MEMORY_LOCK:
        hit = _MEMORY.get(key)
    if hit is not None:
        return hit
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"{key}.npz"
    nt, nd = len(target.bytes), len(drafter.bytes)
    stored = load_mapping(path, key, nt, nd)
    if stored is not None:
        mapping = VocabMapping(d2t=stored[0], t2d=stored[1], drafter_vocab_size=nd, target_vocab_size=nt, key=key)
    else:
        mapping = _compute(target, drafter, key)
        save_mapping(path, key, mapping.d2t, mapping.t2d)
    with _MEMORY_LOCK:
        _MEMORY[key] = mapping
    return mapping
