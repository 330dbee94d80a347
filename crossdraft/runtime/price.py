"""A model server's price of a batched forward, fitted online from the forwards it runs.

The cost tables (:mod:`crossdraft.runtime.costs`) time forwards of ONE row of m tokens, once, at
load. A batched forward of many sessions costs more than one row of as many tokens: every row
attends over its own context and gathers its own KV blocks. So what a session's block of k drafts
costs the whole server depends on how many rows share the forward, and on how busy the machine
is now. The server measures it where it happens: after every batched forward,
:class:`PriceModel` adds (rows, tokens, milliseconds) to a least-squares fit of

    ms = base + row * rows + token * tokens

that forgets old forwards (weight ``decay`` per forward, so the fit follows the load and the
machine), with a prior taken from the one-row table. Target-only rounds under load run forwards
with as many tokens as rows, which fix ``row + token`` but not the split: the prior holds the
per-token slope near the table's (the table measured it) and the per-row cost, more loosely, near
none, so the per-row extra lands in ``row``. Forwards with blocks (tokens > rows) then measure the
token slope too. Forwards of one row (one session alone) fix ``base + row`` but not the split: the
base is free, so where the machine runs slower or faster than its table did, the difference lands
in the base -- a cost every forward pays once -- and not in a per-row cost that the rows of a batch
would multiply (a price fitted while one session ran would otherwise make a first batch of four
cost twice what it does, and the blocks priced on top of it look nearly free).

A forward's tokens are what it computed: its rows left-padded to the longest (crossdraft.runtime.kvpool),
so rows x the longest row -- the same as the rows' own tokens where all are alike (decoding steps,
blocks of one size). The server fits only forwards whose rows are short (at most crossdraft.runtime.rowmix.SHORT_ROW
tokens: decoding steps, verification blocks, short syncs): a prompt's chunks attend over themselves
and put per-row costs in their forwards that no decoding round pays, and a burst of new requests,
all prefilling, would otherwise price rows far above what the rounds that follow pay (and tokens,
beside them, as nearly free).

The fit is published in every reply (:class:`Price`; proto ``Price``): each gateway chooses its
sessions' draft lengths against the server's current price of a row and of a token
(crossdraft.decoding.costmodel), without seeing the other gateways' sessions.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Price:
    """ms of a batched forward = base_ms + row_ms * rows + token_ms * tokens (all >= 0); ``forwards``:
    the forwards the fit has seen (0: the prior alone)."""

    base_ms: float
    row_ms: float
    token_ms: float
    forwards: int = 0

    def ms(self, rows: float, tokens: float) -> float:
        return self.base_ms + self.row_ms * rows + self.token_ms * tokens

    def valid(self) -> bool:
        return self.ms(1, 1) > 0


class PriceModel:
    """Exponentially forgetting least squares of forward time over (1, rows, tokens), with a prior."""

    decay = 0.98  # weight of the fit's history per new forward (~50 forwards of memory)
    # prior precisions (in observations' worth): the per-token slope is held near the table, the per-row
    # cost loosely near none (any batch of several rows outweighs it), the base is free to move
    prior_base = 1e-3
    prior_row = 0.5
    prior_token = 50.0

    def __init__(self, table_ms: list[float] | None = None):
        self._lock = threading.Lock()
        self._s = np.zeros((3, 3))
        self._y = np.zeros(3)
        self._n = 0
        self.set_prior(table_ms)

    def set_prior(self, table_ms: list[float] | None) -> None:
        """The one-row table (ms of one row of 1, 2, ... tokens): its 1-token forward and its slope up
        to 16 tokens. Without a table: 1 ms a forward, flat."""
        if table_ms:
            t = [float(x) for x in table_ms]
            m = min(len(t), 16)
            token = max(0.0, (t[m - 1] - t[0]) / (m - 1)) if m > 1 else 0.0
            base = max(1e-3, t[0] - token)
        else:
            base, token = 1.0, 0.0
        with self._lock:
            self._theta0 = np.array([base, 0.0, token])
            self._lam = np.diag([self.prior_base, self.prior_row, self.prior_token])

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        if rows < 1 or tokens < 1 or not seconds > 0:
            return
        x = np.array([1.0, float(rows), float(tokens)])
        with self._lock:
            self._s = self.decay * self._s + np.outer(x, x)
            self._y = self.decay * self._y + x * (seconds * 1e3)
            self._n += 1

    def price(self) -> Price:
        with self._lock:
            a = self._s + self._lam
            b = self._y + self._lam @ self._theta0
            n = self._n
        try:
            base, row, token = np.linalg.solve(a, b)
        except np.linalg.LinAlgError:
            base, row, token = self._theta0
        # a price must grow with rows and tokens: a negative slope (noise over a narrow range of
        # batches) is read as flat, its share moved to the base
        if token < 0:
            base, token = base + token, 0.0
        if row < 0:
            base, row = base + row, 0.0
        return Price(max(1e-3, float(base)), float(row), float(token), n)
