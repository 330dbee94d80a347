"""The acceptance model of the draft-length policy: how likely the drafter's next proposal is accepted.

The policy (:mod:`crossdraft.decoding.policy`) models drafts as accepted independently with
probability alpha. :class:`AcceptanceModel` estimates alpha online from the rounds' acceptance
counts; :func:`expected_tokens` is what a block of k yields at a given alpha.
"""

from __future__ import annotations


def clamp_alpha(a: float) -> float:
    """An acceptance probability kept within [0.02, 0.98] (neither certain failure nor certain success)."""
    return min(0.98, max(0.02, a))


def expected_tokens(a: float, k: int) -> float:
    """E(k): tokens a block of k yields at acceptance a (the accepted drafts and the target's own),
    (1 - a^(k+1)) / (1 - a)."""
    return (1 - a ** (k + 1)) / (1 - a)


class AcceptanceModel:
    """alpha, estimated from acceptance counts with exponential forgetting (prior 0.6 of weight 2).

    A block of k drafts of which n are accepted counts n successes in n + 1 trials (n in n trials
    when the whole block is accepted: the block ended, not a rejection).
    """

    decay = 0.85

    def __init__(self) -> None:
        self.succ, self.trials = 1.2, 2.0  # prior alpha = 0.6

    def alpha(self) -> float:
        return clamp_alpha(self.succ / self.trials)

    def observe(self, k: int, n: int) -> None:
        """A block of k drafts, n of them accepted (nothing to learn from k = 0)."""
        if k > 0:
            d = self.decay
            self.succ = d * self.succ + n
            self.trials = d * self.trials + n + (1 if n < k else 0)

    def restart(self) -> None:
        """A probe starts: the text may have changed since alpha was last measured, so the probe's own
        outcome dominates (a light, pessimistic prior of weight 1) instead of nudging a stale estimate."""
        self.succ, self.trials = 0.3, 1.0
