"""Coupled draws: sampling whose every token is a function of (seed, position) alone.

With the rejection rule of :mod:`crossdraft.decoding.sampling` a seeded request replays only if it is
drafted the same way again: which uniforms a position uses depends on the round it falls in and
on whether a draft stood there. Coupled draws remove that dependence (the Gumbel-max coupling):

* every (seed, position) has its own field of noise ``G[x]``, one independent standard Gumbel per
  target id ``x``;
* the target's token at that position is ``argmax_x (l[x] + G[x])`` over its processed logits
  ``l`` (log-probabilities up to a constant): a sample of exactly ``softmax(l)``;
* a drafter proposes ``argmax_y (l_d[y] + G[t(y)])`` over its own processed logits, each allowed
  drafter id ``y`` read at the noise of the target id ``t(y)`` with the same bytes;
* the verifier accepts a draft iff it equals the target's own token there, and otherwise emits
  that token.

The emitted tokens are the target's samples whatever was drafted -- lossless, and the same text
with any drafter, any block lengths, any batch, or none (target-only). The drafter only decides
how many of them one forward confirms: where its distribution is near the target's, both argmaxes
fall on the same id (the chance is ``sum_x 1 / sum_y max(p_y/p_x, q_y/q_x)``; on qwen2.5-coder
0.5B drafting for 1.5B at T = 0.7 that measured 0.797 against 0.812 for rejection sampling).

A vocabulary of V ids would need V Gumbels per position (2-4 ms on one CPU core for V = 152k).
Only ids that can win are computed, exactly: the field is built in two parts. Each id's uniform
``u[x]`` lies above ``C = exp(-exp(-T))`` (so ``G[x] > T``) with probability ``1 - C``; those ids
(~0.25% of the vocabulary for T = 6) are generated directly as a Bernoulli process -- geometric
gaps from a hashed stream -- with their uniforms in (C, 1); every other id's uniform is
``C * h(x)`` for a hash uniform ``h``, computed only when asked for. An id outside the exceedance
set has ``G <= T``, so it can win only if its logit is within T of the best candidate's score:
those few are the only others evaluated. All of it is integer hashing (splitmix64 over
blake2b-derived keys) and float64 arithmetic on the CPU: the same draws on every machine.
"""

from __future__ import annotations

import hashlib
import math
import struct

import numpy as np
import torch

from crossdraft.decoding.sampling import VerifyOutcome

STREAM_COUPLED = 4  # blake2b stream tag of the coupled draws (sampling.STREAM_* use 1-3)
THRESHOLD = 6.0  # T: ids whose Gumbel exceeds it are generated up front
C = math.exp(-math.exp(-THRESHOLD))  # P(G <= T) = P(u <= C)
_LOG_C = math.log(C)
_CHUNK = 512
_M64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_K1 = np.uint64(0xBF58476D1CE4E5B9)
_K2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _K1
        z = (z ^ (z >> np.uint64(27))) * _K2
        return z ^ (z >> np.uint64(31))


def _key(seed: int, position: int, part: int) -> np.uint64:
    h = hashlib.blake2b(struct.pack("<qqqq", seed, position, STREAM_COUPLED, part), digest_size=8).digest()
    return np.uint64(int.from_bytes(h, "little"))


def _uniforms(key: np.uint64, idx: np.ndarray) -> np.ndarray:
    """Hash uniforms in (0, 1), float64, one per index (53 bits; never 0 or 1)."""
    with np.errstate(over="ignore"):
        z = _mix(key ^ _mix(idx.astype(np.uint64) * _GOLDEN + _GOLDEN))
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


class Draws:
    """The noise field of one (seed, position) over target ids (see the module's docstring)."""

    def __init__(self, seed: int, position: int):
        self._k_gap = _key(seed, position, 0)
        self._k_exc = _key(seed, position, 1)
        self._k_low = _key(seed, position, 2)
        self._ids = np.zeros(0, dtype=np.int64)  # exceedance ids found so far, ascending
        self._u = np.zeros(0, dtype=np.float64)  # their uniforms, in (C, 1)
        self._next = 0  # index of the next gap in the stream
        self._end = -1  # last id of the exceedance process generated so far

    def exceeding(self, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids in [0, limit) whose uniform exceeds C, ascending int64; their uniforms)."""
        while self._end < limit:
            j = np.arange(self._next, self._next + _CHUNK, dtype=np.int64)
            gaps = 1 + np.floor(np.log(_uniforms(self._k_gap, j)) / _LOG_C).astype(np.int64)
            pos = self._end + np.cumsum(gaps)
            self._ids = np.concatenate([self._ids, pos])
            self._u = np.concatenate([self._u, C + (1.0 - C) * _uniforms(self._k_exc, j)])
            self._next += _CHUNK
            self._end = int(pos[-1])
        n = int(np.searchsorted(self._ids, limit))
        return self._ids[:n], self._u[:n]

    def gumbel(self, ids: np.ndarray) -> np.ndarray:
        """The Gumbel noise of the given target ids (int64 array), float64."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:
            return np.zeros(0, dtype=np.float64)
        ex, eu = self.exceeding(int(ids.max()) + 1)
        u = C * _uniforms(self._k_low, ids)
        if ex.size:
            j = np.searchsorted(ex, ids)
            j = np.minimum(j, ex.size - 1)
            hit = ex[j] == ids
            u[hit] = eu[j[hit]]
        return -np.log(-np.log(u))


def coupled_argmax(logits: torch.Tensor, draws: Draws, target_ids: np.ndarray | None = None,
                   inverse: np.ndarray | None = None) -> int:
    """argmax_j (logits[j] + G[t(j)]) over a row of processed logits (-inf = excluded), exactly.

    logits: [n] over target ids (``target_ids`` None), or over a drafter's allowed ids with
    ``target_ids`` [n] (int64, the target id of each entry) and ``inverse`` (int64 over target ids
    0..max(target_ids): the entry of each target id, -1 if none). Returns the entry's index.
    """
    row = logits.detach().to("cpu", torch.float32)
    n = row.shape[0]
    top = int(torch.argmax(row))
    if not math.isfinite(float(row[top])):
        raise ValueError("cannot sample from a row with no finite logit")
    lim = n if target_ids is None else int(inverse.shape[0])
    ex, _ = draws.exceeding(lim)
    e_idx = ex if target_ids is None else inverse[ex]
    e_idx = e_idx[e_idx >= 0]
    # the best logit and the exceedance set give a score to beat; an id outside that set (G <= T)
    # can win only if its logit is within T of the score
    cand = np.union1d(e_idx, [top])
    lv = row.numpy()
    score = lv[cand].astype(np.float64) + draws.gumbel(cand if target_ids is None else target_ids[cand])
    best = float(np.max(score))
    near = torch.nonzero(row > best - THRESHOLD).flatten().numpy()
    cand = np.union1d(cand, near)
    score = lv[cand].astype(np.float64) + draws.gumbel(cand if target_ids is None else target_ids[cand])
    return int(cand[int(np.argmax(score))])


def verify_coupled(processed: torch.Tensor, drafts: list[int], seed: int, position: int):
    """Verification with coupled draws: processed [k+1, V] target rows of the positions
    ``position .. position + k``; accept while a draft equals the target's own token there.
    Returns a :class:`crossdraft.decoding.sampling.VerifyOutcome`."""
    k = len(drafts)
    rows = processed.detach().to("cpu", torch.float32)
    for i in range(k + 1):
        tok = coupled_argmax(rows[i], Draws(seed, position + i))
        if i == k or tok != drafts[i]:
            return VerifyOutcome(i, tok, [j < i for j in range(k)])
    raise AssertionError("unreachable")
