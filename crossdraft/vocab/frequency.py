"""A tokenizer's own frequency order of its ids: which tokens a drafter with a limited draft
vocabulary (``TokenPair(draft_vocab=...)``) drafts from.
"""

from __future__ import annotations

import json

import numpy as np

from crossdraft.vocab.tokenbytes import rust_backend

__all__ = ["frequency_order"]


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
    backend = rust_backend(tokenizer)
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
