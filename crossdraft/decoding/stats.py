"""What a run reports: the per-call :class:`Stats`, each round's :class:`RoundEvent` and the
finished :class:`GenerationResult` (the engine returns it; the gateway turns it into its replies).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def draws_of(params) -> str:
    """Stats.draws for a request's sampling parameters."""
    return "greedy" if params.greedy else "coupled" if params.coupled else "rejection"


@dataclass
class Stats:
    """Per-call statistics, JSON-friendly."""

    mode: str = "target-only"
    draft_mode: str = ""  # "tli" (drafts from the vocabulary intersection) or "text" (greedy: drafted text re-encoded)
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    resyncs: int = 0
    healed: int = 0  # text mode: blocks whose drafter re-chose its last id (token healing, crossdraft.vocab.healing)
    skipped_rounds: int = 0  # speculative rounds in which the policy drafted nothing (drafting did not pay)
    # pipelined rounds: blocks drafted during the previous block's verification and verified next, and
    # blocks drafted ahead but dropped (the previous block was not accepted whole)
    pipelined_blocks: int = 0
    dropped_blocks: int = 0
    # (greedy TLI, --branch) blocks drafted beside the block ahead on the likeliest correction, and of
    # them those verified next (the correction came true)
    branches: int = 0
    branch_blocks: int = 0
    # (pipelined) rounds that drafted nothing during whose verification the drafter was fed what it had
    # missed, before a probe (crossdraft.decoding.pipeline.CatchUp)
    caught_up: int = 0
    # generated drafter tokens a catch-up did not feed: a drafter that missed many drafts from the latest
    # of them (CostModel.feed_window, DrafterState.elide)
    elided: int = 0
    cost_model: str = ""  # where the draft-length policy took its costs from: "measured" or "static"
    # how each token was chosen: "greedy" (argmax), "coupled" (a function of (seed, position): the same
    # text with or without a drafter) or "rejection" (the classic accept/resample rule)
    draws: str = ""
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    # the models' own time: the first verification (the prompt's prefill), the drafter's steps and the
    # later verifications, each without its waits in the server's queue (reported apart below)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    # time the drafter's steps and the verifications waited in their server's queue for a batch (for
    # other sessions' forwards); of the drafter's, the part on the rounds' critical path counts in rounds
    draft_queue_s: float = 0.0
    verify_queue_s: float = 0.0
    # the rounds' wall time outside the model time on their critical path (forwards and queue waits):
    # the gateway's loop, RPCs, protobuf, vocabulary mapping, policy, spans and metrics, and the front
    # end's handling of each round's event before the next round starts (see Decoder._round)
    overhead_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = "length"
    drafter_fallback: bool = False  # the drafter failed or was too slow: the rest ran target-only
    fallback_reason: str = ""
    # a pool of drafter kinds (gateway/pool.py): the kind that drafted last ("" = the only one, or none),
    # how many times the request moved to another kind, and why the last choice was made
    drafter: str = ""
    drafter_switches: int = 0
    drafter_choice: str = ""
    reused_target_tokens: int = 0  # verifier KV-cache entries reused from an earlier request
    reused_drafter_tokens: int = 0

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["acceptance_rate"] = self.accepted / self.drafted if self.drafted else 0.0
        d["acceptance_by_position"] = [
            a / n if n else 0.0 for a, n in zip(self.accepted_by_position, self.drafted_by_position, strict=True)
        ]
        d["mean_accepted_per_round"] = self.accepted / self.rounds if self.rounds else 0.0
        d["tokens_per_round"] = self.new_tokens / self.rounds if self.rounds else 0.0
        gen_s = self.total_s - self.prefill_s
        d["tokens_per_s"] = self.new_tokens / self.total_s if self.total_s > 0 else 0.0
        d["decode_tokens_per_s"] = self.new_tokens / gen_s if gen_s > 0 else 0.0
        del d["draft_lengths"]
        d["mean_draft_length"] = float(np.mean(self.draft_lengths)) if self.draft_lengths else 0.0
        return d

    def record_round(self, k: int, n: int) -> None:
        self.rounds += 1
        self.drafted += k
        self.accepted += n
        if k:
            self.draft_lengths.append(k)
        while len(self.drafted_by_position) < k:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)
        for i in range(k):
            self.drafted_by_position[i] += 1
            if i < n:
                self.accepted_by_position[i] += 1


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # target ids of the new tokens (EOS included when it ended the output)
    stats: Stats
    # a stop string ended the output: the stop string and whatever followed it in the same token
    # (not part of ``text``, but part of what ``token_ids`` spell)
    stop_tail: str = ""
    logprobs: list | None = None  # per token of token_ids, when asked for (see RoundEvent.logprobs)

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict()}


@dataclass
class RoundEvent:
    """What one round did; yielded by :meth:`Decoder.run` as soon as the round ends."""

    round_index: int
    requested: int  # block size asked of the drafter
    drafted: int  # drafts verified (target ids)
    accepted: int
    emitted: list[int]  # new target ids (after EOS / budget trimming)
    text: str  # new text (complete UTF-8 characters only)
    draft_s: float  # the drafter's forward time of this round's block (queue waits included)
    verify_s: float  # the verification's time in the verifier (queue wait included)
    overhead_s: float  # the round's wall time outside the model time on its critical path (Decoder._round)
    done: bool
    target_ids: list[int] = field(repr=False, default_factory=list)  # the session's ids now (shared, do not mutate)
    drafter_ids: list[int] | None = field(repr=False, default=None)
    batch_size: int = 1  # sessions in the verifier's batched forward that verified this block
    queue_wait_s: float = 0.0  # how long the block waited in the verifier for its batch
    draft_queue_s: float = 0.0  # how long this round's drafter steps waited for their batches (on its path)
    draft_batch_rows: float = 0.0  # the mean rows of the drafter's forwards behind the block (0: not reported)
    # per emitted token when asked for: (log-probability, top ids, their log-probabilities)
    logprobs: list | None = field(repr=False, default=None)
    # pipelined rounds: this round's block was drafted during the previous verification; and what became
    # of the block drafted during this one ("" none, "used": verified next, "dropped", "branch": dropped, and
    # the branch beside it verified next)
    drafted_ahead: bool = False
    ahead: str = ""
    # a speculative round that drafted nothing: why (crossdraft.decoding.policy.SKIP_REASONS; "" otherwise)
    skip_reason: str = ""
    speculative: bool = False  # the round belongs to a speculative request (a drafter, and use_drafter)
    # the round's wall time: from the end of the request's previous round (its first round: from its own
    # start) to its end; the span's and metrics' work on the previous round's event is in it
    wall_s: float = 0.0
    # measured costs: what the chooser expected of the round (tokens, seconds; 0 = no prediction)
    predicted_tokens: float = 0.0
    predicted_s: float = 0.0
    drafter: str = ""  # the drafter kind the round's request drafts with (a pool's; "" = unnamed)
