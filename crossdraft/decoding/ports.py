"""The two ports the round loop drives: a verifier and a drafter.

:class:`crossdraft.decoding.decode.Decoder` only ever calls these methods. In process the ports are the
model workers (:class:`crossdraft.runtime.workers.VerifierWorker`, :class:`~crossdraft.runtime.workers.DrafterWorker`);
in the gateway they are gRPC clients of the model servers (``gateway/clients.py``
``RemoteVerifier``, ``RemoteDrafter``). Both raise the errors of :mod:`crossdraft.errors`:
``NotFound`` (the server does not hold the session) and ``FailedPrecondition`` (it holds a
different history) make the loop re-send the whole history with ``sync``; ``Unavailable`` from
the drafter makes the request finish target-only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # data types only; no import at run time keeps this module a leaf
    import numpy as np

    from crossdraft.decoding.messages import DraftToken, Expect, VerifyReply
    from crossdraft.decoding.sampling import SamplingParams

# (keep, append): the drafter's ids become ids[:keep] + append before it drafts
Edit = tuple[int, list[int]]
# one sparse drafter distribution over target ids: (ids ascending, float64 probabilities)
QRow = tuple["np.ndarray", "np.ndarray"]


@runtime_checkable
class ModelPort(Protocol):
    """What both model servers answer."""

    def info(self) -> dict:
        """ModelInfo as a dict (vocab_size, eos_token_ids, tokenizer_digest, forward_ms, ...)."""

    def cost(self, head_rows: int | None = None) -> tuple[int, int, int]:
        """(body_bytes, head_row_bytes, head_rows) of one token's forward (static cost model)."""

    def timings(self) -> list[float]:
        """Measured ms of one forward of 1..M tokens ([] when measuring is off)."""

    def sync(self, sid: str, ids: Sequence[int], prefill: bool = False) -> tuple[int, "Expect"]:
        """Create or align session `sid` with the full history; (reused cache entries, state).
        prefill: compute the keys and values of all ids but the last now."""

    def fork(self, src: str, dst: str) -> tuple[int, "Expect"]:
        """Session `dst` starts as a copy of `src` (history and cache); (cache entries shared, state)."""

    def end(self, sid: str) -> bool:
        """Drop the session; whether it existed."""


@runtime_checkable
class VerifierPort(ModelPort, Protocol):
    def verify(self, sid: str, expect: "Expect | None", drafts: Sequence[int], q_rows: "Sequence[QRow] | None",
               round_index: int, params: "SamplingParams", seed: int, top_logprobs: int = -1,
               drop_last: bool = False, gang: int = 0) -> "VerifyReply":
        """One forward over the uncached tail + drafts; lossless acceptance; the cache keeps the
        accepted prefix. q_rows: one drafter distribution per draft (sampling), else None.
        top_logprobs >= 0: the reply carries each emitted token's log-probability and the n best.
        drop_last: first drop the session's last id, the previous round's own token (pipelined rounds:
        this block was drafted past the previous one); ``expect`` is the history after the drop.
        gang: the blocks sent together with this one (crossdraft.decoding.gang): the forward waits for them."""


@runtime_checkable
class DrafterPort(ModelPort, Protocol):
    def set_allowed(self, key: str, mask, target_ids=None) -> int:
        """Register a mask of drafter ids that may be proposed (the intersection) under `key`, and
        optionally the target id of each allowed id (ascending drafter-id order; coupled draws)."""

    def draft(self, sid: str, edit: "Edit | None", expect: "Expect | None", k: int, round_index: int,
              params: "SamplingParams", seed: int, stop_below: float, allowed_key: str,
              timeout_s: float | None = None, stop_cumulative: float = 0.0,
              heal: bool = False, position: int = -1, cancel=None, runner_up: bool = False,
              gang: int = 0) -> "list[DraftToken]":
        """Apply the edit, then propose up to k tokens of the mask `allowed_key` (the block ends
        early on the drafter's own doubt: see DrafterSession.draft_iter). heal: token healing of
        the session's last id (crossdraft.vocab.healing); a first token with ``heals`` replaced it.
        position: the target-side position of the first proposal (coupled draws; -1 = unknown).
        cancel: pipelined rounds: an object whose ``is_set()`` is called once after each token drafted (a
        threading.Event, or crossdraft.decoding.pipeline.Stop); True ends the block there, and the
        drafter stops drafting it. runner_up (greedy): each token also carries its probability and the
        drafter's second choice there (``prob``, ``alt``, ``alt_prob``; pipelined rounds' branch)."""
