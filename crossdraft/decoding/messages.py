"""What the round loop and the model servers say to each other, whether in one process or over gRPC.

`Expect` is the caller's view of a session (how many ids and their CRC-32), checked by the model
side on every call; `DraftToken` is one drafted token with the distribution it was drawn from;
`VerifyReply` is a verified block's outcome.
"""

from __future__ import annotations

import array
import zlib
from dataclasses import dataclass

import numpy as np


def ids_crc32(ids) -> int:
    """CRC-32 of token ids as int32 little-endian bytes (the ContextCheck digest)."""
    a = array.array("i", ids)
    if array.array("i", [1]).tobytes()[0] != 1:  # big-endian host
        a.byteswap()
    return zlib.crc32(a.tobytes()) & 0xFFFFFFFF


@dataclass
class Expect:
    """The caller's view of a session: number of ids and their CRC-32."""

    length: int
    crc32: int

    @classmethod
    def of(cls, ids) -> "Expect":
        return cls(len(ids), ids_crc32(ids))


@dataclass
class DraftToken:
    id: int  # drafter id
    q_ids: np.ndarray | None  # [m] int32 drafter ids ascending (None when greedy)
    q_probs: np.ndarray | None  # [m] float32, the distribution it was drawn from (unnormalised)
    forward_s: float
    last: bool = False  # the block ends with this proposal
    heals: bool = False  # (first token only) it replaces the session's last id (crossdraft.vocab.healing)
    queue_s: float = 0.0  # of forward_s, the time its forward waited for its batch (other sessions' steps)
    batch_rows: int = 0  # rows of the batched forward that computed it (0: unbatched or not reported)
    # (asked for, greedy) its probability under the drafter, and the drafter's second choice there (-1: none)
    prob: float = 0.0
    alt: int = -1
    alt_prob: float = 0.0


@dataclass
class VerifyReply:
    num_accepted: int
    next_token: int
    accepted: list[bool]
    forward_s: float  # the verification's time in the verifier (queue wait included)
    context: Expect
    batch_size: int = 1  # sessions in the batched forward that verified this block
    queue_wait_s: float = 0.0  # time the block waited for its batch to start
    active_sessions: int = 1  # sessions sending blocks to this verifier lately (batched servers)
    logprobs: list | None = None  # per emitted token (accepted drafts, then next_token), when asked for
    price: object | None = None  # the verifier's price of a forward now (crossdraft.runtime.price.Price)
