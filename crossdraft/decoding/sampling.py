"""Sampling and acceptance math: pure functions, shared by every side.

Notation (one verification round with k drafts x_1..x_k):
  p_i  target's processed distribution at draft position i (i = 1..k+1), over target ids
  q_i  drafter's processed distribution at position i, restricted to the vocabulary
       intersection, renormalised, and expressed over *target* ids
Lossless rule (Leviathan et al. 2023, thm. 3.5; Timor et al. 2025 for the intersection case):
accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit a sample of
norm(max(0, p_i - q_i)); if all k are accepted emit a bonus sample of p_{k+1}. For any q whose
support is a subset of the target vocabulary, the emitted token is distributed exactly as p_i:
  P(emit y) = q(y) min(1, p(y)/q(y)) + (1 - sum_x q(x) min(1, p(x)/q(x))) r(y) = min(q, p)(y) +
              (sum_x max(0, p(x) - q(x))) * max(0, p(y) - q(y)) / sum_x max(0, p(x) - q(x)) = p(y).
Target tokens outside the intersection have q = 0, so they are reachable only through the
residual, and that is exactly what makes the intersection lossless.

Randomness never comes from a global generator: every draw is a uniform derived by hashing
(seed, round, position, stream), so a session replays identically after a restart or failover,
on any device, and the drafter's sampling cannot disturb the target's draws.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field

import torch

from crossdraft.errors import InvalidArgument, check_int, check_number

# Streams of randomness; each one is an independent family of uniforms.
STREAM_DRAFT = 1  # drafter sampling its proposal at a position
STREAM_ACCEPT = 2  # the acceptance test of the draft at a position
STREAM_EMIT = 3  # the target's own token at a position (residual or bonus, or target-only)


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen; validated once, applied identically by drafter and target."""

    temperature: float = 0.0  # 0 = greedy (argmax); > 0 divides logits before softmax
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus: smallest set with mass >= top_p; 1 = off; must be in (0, 1]
    repetition_penalty: float = 1.0  # CTRL-style penalty on tokens already in the context; 1 = off
    # coupled draws (crossdraft.decoding.coupled): each sampled token is a function of (seed, position)
    # alone -- the same text whatever is drafted, batched or not -- instead of the rejection rule's
    # round-dependent draws; no effect on greedy decoding
    coupled: bool = False

    def __post_init__(self) -> None:
        validate_sampling(self.temperature, self.top_k, self.top_p, self.repetition_penalty)
        if not isinstance(self.coupled, bool):
            raise InvalidArgument("coupled", f"must be a boolean, got {self.coupled!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "repetition_penalty": self.repetition_penalty,
            "coupled": self.coupled,
        }


def _finite_number(name: str, value) -> float:
    value = check_number(name, value)
    if not math.isfinite(value):
        raise InvalidArgument(name, f"must be finite, got {value}")
    return value


def validate_sampling(temperature, top_k, top_p, repetition_penalty) -> None:
    """Raise InvalidArgument naming the first bad field."""
    if _finite_number("temperature", temperature) < 0:
        raise InvalidArgument("temperature", f"must be >= 0 (0 = greedy), got {temperature}")
    if check_int("top_k", top_k) < 0:
        raise InvalidArgument("top_k", f"must be >= 0 (0 = off), got {top_k}")
    p = _finite_number("top_p", top_p)
    if not 0.0 < p <= 1.0:
        raise InvalidArgument("top_p", f"must be in (0, 1], got {top_p}")
    if _finite_number("repetition_penalty", repetition_penalty) <= 0:
        raise InvalidArgument("repetition_penalty", f"must be > 0 (1 = off), got {repetition_penalty}")


# --------------------------------------------------------------------------------------------
# Logits processing: one function for both sides.


def presence_rows(context_ids: torch.Tensor, extra_ids: torch.Tensor | None, vocab: int, rows: int) -> torch.Tensor:
    """Which tokens each row has already seen, for the repetition penalty.

    context_ids: [C] ids before the block; extra_ids: [rows-1] ids fed inside the block, row i
    also sees extra_ids[:i]. Returns bool [rows, vocab].
    """
    base = torch.zeros(vocab, dtype=torch.bool, device=context_ids.device)
    if context_ids.numel():
        base[context_ids.clamp_max(vocab - 1)] = True
    out = base.unsqueeze(0).repeat(rows, 1)
    if extra_ids is not None:
        for i in range(1, rows):
            out[i:, int(extra_ids[i - 1])] = True
    return out


def process_logits(logits: torch.Tensor, params: SamplingParams, presence: torch.Tensor | None = None) -> torch.Tensor:
    """Repetition penalty, temperature, top-k, top-p -- in that order.

    logits: [N, V] (any float dtype; computed in float32). presence: bool [N, V] or None.
    Returns float32 [N, V] processed logits, -inf for removed tokens; sampling rows are shifted so
    that their maximum is 0 (the same distribution). With temperature 0 the temperature step is
    skipped (greedy takes the argmax of the result).
    """
    x = logits.float()
    if params.repetition_penalty != 1.0 and presence is not None:
        rp = params.repetition_penalty
        penalised = torch.where(x < 0, x * rp, x / rp)
        # an extreme penalty (1e-40, 1e308) overflows to +-inf, and inf - inf is NaN below: the
        # largest float32 keeps the row finite (the overflowed tokens tie)
        big = torch.finfo(torch.float32).max
        x = torch.where(presence, penalised.clamp(-big, big), x)
    if params.greedy:
        return x
    # shift each row to max 0 first (softmax does not change): a tiny temperature then sends the
    # others to -inf instead of overflowing the best to +inf (inf - inf = NaN in the softmax);
    # below 1e-30 (float32 holds nothing smaller as a divisor) the distribution is the argmax anyway
    x = (x - x.max(dim=-1, keepdim=True).values) / max(params.temperature, 1e-30)
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # mass strictly before each token; keep a token while that mass is < top_p (>= 1 token)
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def probabilities(processed: torch.Tensor) -> torch.Tensor:
    """Softmax of processed logits in float32: [N, V] -> [N, V]."""
    return torch.softmax(processed, dim=-1)


# --------------------------------------------------------------------------------------------
# Seeded uniforms.


def uniform(seed: int, round_index: int, position: int, stream: int) -> float:
    """A uniform in [0, 1) that depends only on its four arguments (53 random bits)."""
    h = hashlib.blake2b(struct.pack("<qqqq", seed, round_index, position, stream), digest_size=8).digest()
    return (int.from_bytes(h, "little") >> 11) * (1.0 / (1 << 53))


def sample_from(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of one id from probs [V] (need not be normalised) with uniform u.

    Zero-probability ids can never be returned. Computed in float64 on the CPU so the result is
    the same on every device.
    """
    cdf = torch.cumsum(probs.detach().to("cpu", torch.float64), dim=0)
    total = float(cdf[-1])
    if not total > 0.0:
        raise ValueError("cannot sample from an all-zero distribution")
    idx = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=torch.float64), right=True)[0])
    return min(idx, cdf.numel() - 1)


# --------------------------------------------------------------------------------------------
# Acceptance.


def acceptance_probability(p_x: float, q_x: float) -> float:
    """min(1, p(x)/q(x)) for a draft x that the drafter proposed (so q(x) > 0)."""
    if q_x <= 0.0:
        return 0.0  # cannot happen for a real proposal; never accept what q could not produce
    return min(1.0, p_x / q_x)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over [V] in float64. If p == q (no mass left) return p itself."""
    r = torch.clamp(p.double() - q.double(), min=0.0)
    s = float(r.sum())
    if s <= 1e-12:
        return p.double() / float(p.double().sum())
    return r / s


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, x: int, u_accept: float, u_emit: float) -> tuple[bool, int]:
    """One step of speculative sampling with explicit uniforms.

    p, q: [V] distributions over target ids; x: the draft (target id). Returns (accepted, token):
    (True, x) if u_accept < min(1, p(x)/q(x)), else (False, sample of the residual with u_emit).
    """
    a = acceptance_probability(float(p[x]), float(q[x]))
    if u_accept < a:
        return True, x
    return False, sample_from(residual_distribution(p, q), u_emit)


@dataclass
class VerifyOutcome:
    """Result of verifying one block of k drafts."""

    num_accepted: int  # n in [0, k]
    next_token: int  # the target's own token after the accepted prefix (residual or bonus)
    accepted: list[bool] = field(default_factory=list)  # per draft position, True up to n


def verify_greedy(target_argmax: list[int], drafts: list[int]) -> VerifyOutcome:
    """Greedy verification: accept while argmax p_i equals the draft, then emit argmax p_i.

    target_argmax: [k+1] argmax of each processed p_i; drafts: [k] target ids.
    """
    n = 0
    while n < len(drafts) and drafts[n] == target_argmax[n]:
        n += 1
    return VerifyOutcome(n, int(target_argmax[n]), [i < n for i in range(len(drafts))])


def verify_sampling(p: torch.Tensor, q: torch.Tensor, drafts: list[int], seed: int, round_index: int) -> VerifyOutcome:
    """Lossless verification of a block with seeded uniforms.

    p: [k+1, V] target probabilities; q: [k, V] drafter probabilities over target ids (zero
    outside the intersection); drafts: [k] target ids. Position i uses
    uniform(seed, round, i, STREAM_ACCEPT) for the test and (..., STREAM_EMIT) for the residual;
    the bonus (all accepted) uses position k.
    """
    k = len(drafts)
    for i, x in enumerate(drafts):
        ok, tok = accept_or_resample(
            p[i], q[i], x, uniform(seed, round_index, i, STREAM_ACCEPT), uniform(seed, round_index, i, STREAM_EMIT)
        )
        if not ok:
            return VerifyOutcome(i, tok, [j < i for j in range(k)])
    bonus = sample_from(p[k], uniform(seed, round_index, k, STREAM_EMIT))
    return VerifyOutcome(k, bonus, [True] * k)


def runner_up(processed: torch.Tensor, j: int) -> tuple[float, int, float]:
    """(probability of index j, the index of the second most likely entry, its probability) of logits."""
    top = torch.topk(processed, 2)
    probs = torch.softmax(processed.float(), dim=-1)
    i = int(top.indices[1]) if int(top.indices[0]) == j else int(top.indices[0])
    return float(probs[j]), i, float(probs[i])
