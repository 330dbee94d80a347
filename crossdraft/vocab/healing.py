"""Token healing for text drafting: the drafter re-chooses its last token under a byte constraint.

In text mode the drafter continues the target's text from its own re-encoding of that text, and
the last token of that re-encoding is often one the drafter would never have produced itself: a
Qwen target ends a line's indentation with one 4-space token before ``return``; SmolLM2 re-encodes
those 4 spaces as one token too, although its own habit is 3 spaces and then " return" -- so after
the 4 spaces it proposes " return", 5 spaces in all, and nothing it drafts after an indentation is
ever accepted.

Healing backs off that last token P and lets the drafter choose again, among the tokens that agree
with P's bytes: those that start with them (P and more) and, when P is all whitespace, those that
are a proper prefix of them (the rest of P is then required of the next proposals). Prefixes only
for whitespace: offered a word such as " Create", SmolLM2 prefers a lone " " (then "Create"), an
unnatural split after which it drafts worse than without healing; for indentation the split is
the point. If the drafter's choice is P itself nothing changes,
and the forward that scored P's position is the one that had to feed P anyway (the first forward of
a block feeds the last two ids and keeps both rows of logits), so healing costs no extra forward.
If it chooses another token, P leaves the session and the block's proposals spell P's bytes and
then new text; the caller strips P's bytes from the drafted text. Greedy only (text drafting is).
"""

from __future__ import annotations

import bisect

import numpy as np

WHITESPACE = b" \t\r\n"


class TokenBytes:
    """A vocabulary's id -> bytes table, indexed for the healing constraint."""

    def __init__(self, table: list[bytes | None]):
        self.bytes = by = [b or b"" for b in table]
        # (ids sorted by their bytes, ties by id: a sort of ints keyed by the table is ~5x quicker
        # than one of (bytes, id) tuples -- 262,144 ids for a Gemma-3 drafter)
        order = sorted((i for i, b in enumerate(by) if b), key=by.__getitem__)
        self._keys = [by[i] for i in order]
        self._order = np.array(order, dtype=np.int64)
        # exact matches are only ever looked up for the whitespace prefixes of a whitespace token
        self._exact: dict[bytes, list[int]] = {}
        for i in order:
            if not by[i].strip(WHITESPACE):
                self._exact.setdefault(by[i], []).append(i)

    def agreeing(self, need: bytes) -> np.ndarray:
        """Ids whose bytes start with ``need`` or -- if ``need`` is all whitespace -- are a non-empty
        proper prefix of it (sorted)."""
        if not need:
            return self._order.copy()
        # the ids starting with `need` are one run of the sorted keys: [need, need's successor)
        lo = bisect.bisect_left(self._keys, need)
        up = _successor(need)
        hi = len(self._keys) if up is None else bisect.bisect_left(self._keys, up, lo)
        out = [self._order[lo:hi]]
        for j in range(1, len(need) if not need.strip(WHITESPACE) else 0):
            ids = self._exact.get(need[:j])
            if ids:
                out.append(np.asarray(ids, dtype=np.int64))
        return np.unique(np.concatenate(out)) if out else np.zeros(0, dtype=np.int64)

    def rest(self, need: bytes, tok: int) -> bytes:
        """What of ``need`` the proposals after ``tok`` must still spell (b"" once it is covered)."""
        b = self.bytes[tok] if 0 <= tok < len(self.bytes) else b""
        return need[len(b):] if need.startswith(b) and len(b) < len(need) else b""


def _successor(b: bytes) -> bytes | None:
    """The least byte string greater than every string that starts with ``b`` (None: there is none)."""
    b = b.rstrip(b"\xff")
    return b[:-1] + bytes([b[-1] + 1]) if b else None
