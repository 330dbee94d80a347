"""A request's state in the round loop (:class:`Request`), what a round's drafting produced
(:class:`Drafted`), and the iterator a caller reads the rounds from (:class:`Run`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from crossdraft.decoding.drafter_view import DrafterState
from crossdraft.decoding.output import Output
from crossdraft.decoding.policy import DraftConfig, DraftPolicy
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.decoding.stats import GenerationResult, Stats
from crossdraft.errors import InvalidArgument

if TYPE_CHECKING:  # (annotations only: the pipeline's module imports this one)
    from crossdraft.decoding.pipeline import Ahead, Branch, CatchUp
    from crossdraft.decoding.stats import RoundEvent


class Run:
    """An iterator of RoundEvents; ``result`` is set once it is exhausted."""

    def __init__(self, gen):
        self._gen = gen
        self.result: GenerationResult | None = None
        self.target_ids: list[int] = []
        self.drafter_ids: list[int] | None = None
        self.next_round: int = 0
        self.decoder = None  # the Decoder running the rounds now (a pool's request may move to another kind's)

    def __iter__(self):
        return self

    def __next__(self) -> RoundEvent:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()


@dataclass
class Request:
    """One request's state in the round loop."""

    sid: str
    t_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    seed: int
    draft: DraftConfig
    stats: Stats
    spec: bool
    d: DrafterState | None = None
    mode: str = "tli"  # which drafter mask: "tli" or "text"
    text_mode: bool = False
    policy: DraftPolicy | None = None
    step_s: float = 0.0  # measured seconds of one target decoding step (0.0 with static costs)
    out: Output = field(default_factory=Output)
    k: int = 0
    first: bool = True
    prev_drafted: bool = False
    # pipelined rounds: the block drafted during the previous verification (None: draft one now), the
    # drafter call for the next block while this one is verified, and whether the verifier holds the
    # previous round's own token, which the ready block replaces (dropped with the next Verify)
    ready: Drafted | None = None
    ahead: Ahead | None = None
    drop_bonus: bool = False
    # (greedy TLI, --branch) the block drafted beside the block ahead on the likeliest correction, and the
    # drafter whose session the request's branches fork (it drops the branch's session at the end)
    branch: Branch | None = None
    branch_on: object = None
    # the target's prefill of the prompt, computed while the first block is drafted (CatchUp on the verifier)
    prefill: CatchUp | None = None
    # when the previous round ended (perf_counter; 0.0 before the first): the time until the next round
    # starts is the front end's handling of that round's event, and counts in the next round's overhead
    t_end: float = 0.0
    # this round's wait for the blocks other sessions were drafting, and how many blocks went with this one
    # (crossdraft.decoding.gang)
    gang_s: float = 0.0
    gang_n: int = 1
    # a pool of drafter kinds: asked after each round whether another kind's Decoder takes over (Decoder.run)
    chooser: object = None
    # the load gate (crossdraft.decoding.gate.LoadGate) of the Decoder the request started on: it counts
    # the request and its rounds, and says whether rounds with measured costs may draft now
    gate: object = None

    def remaining(self) -> int:
        """Tokens the request may still generate."""
        return self.max_new_tokens - len(self.out.gen)

    def drafter_failed(self, e: Exception) -> None:
        self.spec = False
        reason = str(e)
        if isinstance(e, InvalidArgument):  # e.g. its context is shorter, or its tokens more, than the target's
            reason = f"the drafter refused the request ({reason})"
        self.stats.drafter_fallback, self.stats.fallback_reason = True, reason


@dataclass
class Drafted:
    """What the drafting step of a round produced."""

    tokens: list  # DraftTokens (drafter ids)
    target_ids: list[int]  # the block in target ids
    q_rows: list | None  # sampling: the drafter's distributions over target ids
    seconds: float
    healed: bytes = b""  # text mode: the drafter replaced its last id, whose bytes the block spells first
    wall: float = -1.0  # drafted ahead: the drafter call's wall time (else the round measures it)
    queue_s: float = 0.0  # of seconds, the drafter's steps' waits for their batches (other sessions' steps)
    map_s: float = 0.0  # the gateway's time expressing the block in target ids (and q over target ids)

    @property
    def rows(self) -> float:
        """The mean rows of the drafter's batched forwards that computed the block (0: none reported)."""
        rows = [t.batch_rows for t in self.tokens if getattr(t, "batch_rows", 0)]
        return sum(rows) / len(rows) if rows else 0.0
