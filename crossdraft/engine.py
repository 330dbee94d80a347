"""The in-process reference engine: target-only, same-vocabulary SD and TLI speculative decoding.

Two session objects hold one model's state each and know nothing of the other's vocabulary:

* :class:`TargetSession` -- target ids + KV cache; ``verify(drafts, q)`` runs ONE forward over
  the uncached tail and the drafts and applies the lossless acceptance rule.
* :class:`DrafterSession` -- drafter ids + KV cache + the allowed-id mask (the intersection);
  ``draft(k)`` proposes k tokens with their processed distributions; ``commit`` keeps the accepted
  ones and appends the target's token; ``resync`` replaces the tail after re-tokenisation.

:class:`Engine` owns the loop and the vocabulary mapping (as the gateway will in the services).
KV caches live across rounds; on rejection they are cropped, never recomputed.

Invariant for both sessions: ``cache_len <= len(ids) - 1``; the next forward feeds
``ids[cache_len:]`` (at least one token), so the last row of its logits predicts the next token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from . import sampling as S
from .errors import FailedPrecondition, InvalidArgument
from .sampling import SamplingParams, VerifyOutcome


@dataclass(frozen=True)
class DraftConfig:
    """How many tokens the drafter proposes per round."""

    num_draft_tokens: int = 4  # initial k (the block size) per round
    adaptive: bool = True  # choose k per round from measured acceptance and costs (else fixed k)
    min_draft_tokens: int = 1  # lower bound for adaptive k
    max_draft_tokens: int = 10  # upper bound for adaptive k
    stop_below: float = 0.3  # stop a block early once the drafter's own probability of its token is below this
    allow_skip: bool = True  # adaptive: draft nothing (target-only rounds) while drafting does not pay, probing now and then
    resync_window: int = 4  # drafter tokens re-tokenised (look-behind) when the target leaves the intersection
    mode: str = "auto"  # "tli" | "text" (greedy only: drafts text, re-encoded into target tokens) | "auto"
    # where the adaptive policy takes costs from: "measured" (the model servers' timed forwards,
    # corrected online by the round's wall-clock times), "static" (weight bytes; a function of the
    # generated tokens only, so a seeded sampling run is reproducible anywhere), or "auto":
    # measured for greedy (the output does not depend on k), static for sampling
    cost_model: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "tli", "text"):
            raise InvalidArgument("mode", f"must be one of auto, tli, text; got {self.mode!r}")
        if self.cost_model not in ("auto", "measured", "static"):
            raise InvalidArgument("cost_model", f"must be one of auto, measured, static; got {self.cost_model!r}")
        k = self.num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidArgument("num_draft_tokens", f"must be an integer >= 1, got {k!r}")
        if k > 64:
            raise InvalidArgument("num_draft_tokens", f"must be <= 64, got {k}")
        if not 1 <= self.min_draft_tokens <= self.max_draft_tokens <= 64:
            raise InvalidArgument("max_draft_tokens", "need 1 <= min_draft_tokens <= max_draft_tokens <= 64")
        if not 0.0 <= self.stop_below < 1.0:
            raise InvalidArgument("stop_below", f"must be in [0, 1), got {self.stop_below}")
        if self.resync_window < 1:
            raise InvalidArgument("resync_window", "must be >= 1")


class DraftPolicy:
    """Chooses the block size k of the next round (adaptive draft length).

    Model: drafts are accepted independently with probability alpha, so a block of k yields
    E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens and costs k drafter steps plus one target
    forward over k + 1 tokens: cost(k) = k * c + v(k + 1), in units of one target decoding step
    (v(1) = 1). alpha is estimated online (exponential forgetting) from acceptance counts; k
    maximises E(k) / cost(k) within [min, max]. If even the best k yields less than one token per
    target step (plus a margin when costs are measured), the round drafts nothing, and a short
    probe block re-measures alpha now and then -- every `probe_every` rounds, doubling after each
    probe that does not pay (up to `max_probe_every`) -- so a drafter that cannot help costs only
    its rare probes.

    Costs: ``c`` and ``verify_costs`` (v(m) for m = 1..M, relative to v(1)) come either from the
    model servers' measured forward times (``measured=True``: on CPUs the verification forward
    of a block can cost 2-3x a decoding step, which a weight-bytes estimate cannot see), or from
    weight bytes with a small per-token slope. With measured costs the policy also corrects them
    online from the rounds' wall-clock times (:meth:`observe_time`: load, RPC overheads).
    With static costs every input is a function of the generated tokens only, so a seeded
    sampling run picks the same k sequence, hence the same random draws and the same text, every
    time (and after a failover); that is why sampling uses static costs by default.
    """

    decay = 0.85
    probe_every = 6
    max_probe_every = 48
    margin = 1.03  # measured costs: draft only when it is expected to beat target-only by this factor
    time_decay = 0.8

    def __init__(self, cfg: DraftConfig, cost_ratio: float = 0.2, verify_slope: float = 0.03, *,
                 verify_costs: list[float] | None = None, measured: bool = False):
        self.cfg = cfg
        self.c = max(1e-3, float(cost_ratio))
        self.slope = max(0.0, float(verify_slope))
        self.v = [max(1e-6, float(x)) for x in verify_costs] if verify_costs else None
        if self.v:
            self.v = [x / self.v[0] for x in self.v]
        self.measured = measured
        self.hi = max(cfg.max_draft_tokens, cfg.num_draft_tokens)
        self.succ, self.trials = 1.2, 2.0  # prior alpha = 0.6
        self.skipped = 0
        self.interval = self.wait = self.probe_every
        self.probing = False
        self.scale_d = 1.0  # measured/predicted drafter time (online correction, measured mode only)
        self.scale_v = 1.0  # measured/predicted verification time

    def alpha(self) -> float:
        return min(0.98, max(0.02, self.succ / self.trials))

    def observe(self, k: int, n: int) -> None:
        if k > 0:
            d = self.decay
            self.succ = d * self.succ + n
            self.trials = d * self.trials + n + (1 if n < k else 0)
            if n == k:  # a whole block accepted: drafting pays here again, probe at the usual pace
                self.interval = self.probe_every

    def vcost(self, m: int) -> float:
        """Cost of a target forward over m tokens, in target decoding steps."""
        if not self.v:
            return 1.0 + self.slope * (m - 1)
        if m <= len(self.v):
            return self.v[m - 1]
        last = self.v[-1]
        step = max(0.0, last - self.v[-2]) if len(self.v) > 1 else self.slope
        return last + step * (m - len(self.v))

    def observe_time(self, steps: int, draft_s: float, m: int, verify_s: float, target_step_s: float) -> None:
        """Measured mode: a round's wall-clock times (drafter steps, the verification of m tokens),
        against the predicted ones (target_step_s = the measured time of one target decoding step)."""
        if not self.measured or target_step_s <= 0:
            return
        d = self.time_decay
        if verify_s > 0 and m >= 1:
            ratio = verify_s / (self.vcost(m) * target_step_s)
            self.scale_v = d * self.scale_v + (1 - d) * min(10.0, max(0.1, ratio))
        if steps > 0 and draft_s > 0:
            ratio = draft_s / (steps * self.c * target_step_s)
            self.scale_d = d * self.scale_d + (1 - d) * min(10.0, max(0.1, ratio))

    def rate(self, k: int) -> float:
        """Expected tokens per target decoding step with a block of k (k = 0: target-only = 1)."""
        a = self.alpha()
        e = (1 - a ** (k + 1)) / (1 - a)
        if k == 0:
            return 1.0
        sv = self.scale_v
        return e * sv / (sv * self.vcost(k + 1) + k * self.c * self.scale_d)

    def next_k(self) -> int:
        cfg = self.cfg
        if not cfg.adaptive:
            return cfg.num_draft_tokens
        best = max(range(cfg.min_draft_tokens, self.hi + 1), key=self.rate)
        need = self.margin if self.measured else 1.0
        if cfg.allow_skip and self.rate(best) < need:
            if self.probing:  # the probe just verified did not pay: wait longer before the next one
                self.interval = min(self.max_probe_every, self.interval * 2)
                self.wait = self.interval
            self.probing = False
            self.skipped += 1
            self.wait -= 1
            if self.wait <= 0:
                # the text may have changed since alpha was last measured: let the probe's own
                # outcome dominate (a light, pessimistic prior of weight 1) instead of nudging a stale estimate
                self.probing = True
                self.succ, self.trials = 0.3, 1.0
                return min(self.hi, max(cfg.min_draft_tokens, 2))
            return 0
        self.skipped = 0
        self.probing = False
        self.wait = self.interval
        return best


def cost_numbers(model, head_rows: int | None = None) -> tuple[int, int, int]:
    """(body_bytes, head_row_bytes, head_rows) of one token's forward, for :func:`cost_ratio`.

    One-token decoding is memory-bound: its time follows the bytes of weights read. body_bytes
    counts every weight except the embedding table and the LM head, plus a fixed per-forward
    overhead worth ~60M parameters on CPU (kernel launches, Python); the LM head counts
    head_rows x head_row_bytes (only the pruned rows for the drafter). Model servers report
    these numbers so the gateway can run the same policy as the in-process engine.
    """
    emb = model.get_input_embeddings()
    head = getattr(model, "lm_head", None)
    total = 0
    seen = set()
    for prm in model.parameters():
        if id(prm) in seen:
            continue
        seen.add(id(prm))
        if emb is not None and prm is emb.weight:
            continue
        if head is not None and prm is getattr(head, "weight", None):
            continue
        total += prm.numel() * prm.element_size()
    hw = getattr(head, "weight", None) if head is not None else (emb.weight if emb is not None else None)
    row_bytes, rows = 0, 0
    if hw is not None:
        rows = hw.shape[0] if head_rows is None else head_rows
        row_bytes = hw.shape[1] * hw.element_size()
    overhead = 60e6 * next(model.parameters()).element_size()
    return int(total + overhead), int(row_bytes), int(rows)


def cost_ratio(drafter: tuple[int, int, int], target: tuple[int, int, int]) -> float:
    """Drafter cost per token relative to one target forward, from :func:`cost_numbers`.

    Measured here: 0.5B/1.5B 0.36 (estimate 0.35), 135M/1.5B 0.17 (0.12). Deterministic on
    purpose (see DraftPolicy).
    """
    db, drow, drows = drafter
    tb, trow, trows = target
    return (db + drow * drows) / max(1, tb + trow * trows)


def estimate_cost_ratio(drafter_model, target_model, drafter_head_rows: int | None = None) -> float:
    return cost_ratio(cost_numbers(drafter_model, drafter_head_rows), cost_numbers(target_model))


# --------------------------------------------------------------------------------------------
# KV cache helpers (transformers DynamicCache, crop takes "how many to remove" as a negative int).


def new_cache(model):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if hasattr(cache, "activate_past_recording"):
        # sliding-window layers (Gemma-3) keep full states until crop(), so rollback is possible
        cache.activate_past_recording()
    return cache


def cache_length(cache) -> int:
    return int(cache.get_seq_length()) if cache is not None else 0


def crop_cache(cache, new_len: int) -> None:
    cur = cache_length(cache)
    if cur == 0:
        return  # nothing cached yet (and uninitialised sliding-window layers cannot crop)
    if new_len > cur:
        raise ValueError(f"cannot crop a cache of {cur} tokens to {new_len}")
    cache.crop(new_len - cur)  # crop(0) also trims sliding-window layers back to their window


def _pruned_head(model, allowed_ids: torch.Tensor):
    """Rows of the LM head for `allowed_ids`, or None when the model's head cannot be split off."""
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(model, "model") or getattr(head, "bias", None) is not None:
        return None
    cfg = getattr(model, "config", None)
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return None
    w = getattr(head, "weight", None)
    if w is None or w.dim() != 2 or len(allowed_ids) == 0:
        return None
    return w.detach().index_select(0, allowed_ids.to(w.device)).contiguous()


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _ModelSession:
    """ids + KV cache of one causal LM; feeds the uncached tail plus extra tokens.

    ``fed`` lists exactly the tokens whose keys/values are in the cache (a prefix of ids, possibly
    followed by uncommitted proposals), so any new history can reuse the longest common prefix.
    """

    def __init__(self, model, ids: list[int], device: torch.device):
        if not ids:
            raise InvalidArgument("prompt", "is empty after tokenisation")
        self.model = model
        self.device = device
        self.ids: list[int] = list(ids)
        self.cache = new_cache(model)
        self.fed: list[int] = []
        self.cache_repairs = 0  # forwards that found the cache out of step with ids (a bug if ever > 0)

    @property
    def cache_len(self) -> int:
        return cache_length(self.cache)

    def _tail(self, extra: list[int]) -> tuple[int, list[int]]:
        """(start, feed): the part of ids + extra that the cache does not hold yet.

        The cache holds ``fed`` (a prefix of ids, possibly followed by proposals); a forward must
        feed exactly what follows it -- never tokens that are already cached (that once made the
        drafter re-feed its whole block at the wrong positions, O(k^2) work and a corrupted cache).
        """
        start = self.cache_len
        seq = self.ids + list(extra)
        if start >= len(seq) or len(self.fed) != start or self.fed != seq[:start]:
            # cannot happen by construction; if it ever does, recompute rather than score a wrong context
            self.cache_repairs += 1
            keep = min(_lcp(self.fed, seq), start, len(seq) - 1)
            crop_cache(self.cache, keep)
            del self.fed[keep:]
            start = self.cache_len
        return start, seq[start:]

    @torch.inference_mode()
    def forward(self, extra: list[int], keep: int) -> torch.Tensor:
        """Feed (ids + extra)[cache_len:]; return the last `keep` rows of logits [keep, V]."""
        start, feed = self._tail(extra)
        out = self.model(**self._inputs(start, feed), logits_to_keep=keep)
        self.fed = self.fed[:start] + feed
        return out.logits[0, -keep:, :]

    def _inputs(self, start: int, feed: list[int]) -> dict:
        inp = torch.tensor([feed], dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + len(feed), device=self.device).unsqueeze(0)
        return dict(input_ids=inp, position_ids=pos, cache_position=pos[0], past_key_values=self.cache, use_cache=True)

    def truncate_cache(self, valid: int) -> None:
        n = min(valid, self.cache_len, len(self.ids) - 1)
        crop_cache(self.cache, n)
        del self.fed[n:]

    def sync(self, ids: list[int]) -> int:
        """Replace the history with `ids`; keep the cache up to the longest common prefix."""
        if not ids:
            raise InvalidArgument("token_ids", "must not be empty")
        self.ids = list(ids)
        self.truncate_cache(_lcp(self.fed, self.ids))
        return self.cache_len

    def edit(self, keep: int, append: list[int]) -> None:
        """ids = ids[:keep] + append; the cache keeps the common prefix (proposals included)."""
        if keep > len(self.ids):
            raise FailedPrecondition(f"edit keeps {keep} tokens but the session holds {len(self.ids)}")
        new = self.ids[:keep] + list(append)
        if not new:
            raise InvalidArgument("edit", "would leave the session empty")
        self.ids = new
        self.truncate_cache(_lcp(self.fed, new))


@dataclass
class VerifyResult:
    """What one verification round produced, in target ids."""

    outcome: VerifyOutcome
    emitted: list[int]  # accepted drafts + the target's own token
    forward_s: float


def dense_q(q_rows, k: int, vocab: int) -> torch.Tensor:
    """Sparse drafter rows [(target ids [m], probs [m])] * k -> [k, vocab] float64, each row normalised."""
    q = torch.zeros(k, vocab, dtype=torch.float64)
    for i, (ids, probs) in enumerate(q_rows):
        ids_t = torch.as_tensor(np.asarray(ids, dtype=np.int64))
        if ids_t.numel() and (int(ids_t.min()) < 0 or int(ids_t.max()) >= vocab):
            raise InvalidArgument("q", f"row {i} has token ids outside [0, {vocab})")
        pr = torch.as_tensor(np.asarray(probs, dtype=np.float64))
        if pr.shape != ids_t.shape:
            raise InvalidArgument("q", f"row {i}: {ids_t.numel()} ids but {pr.numel()} probabilities")
        if pr.numel() and (not bool(torch.isfinite(pr).all()) or float(pr.min()) < 0):
            raise InvalidArgument("q", f"row {i} has negative or non-finite probabilities")
        q[i].index_add_(0, ids_t, pr)
        s = float(q[i].sum())
        if not s > 0:
            raise InvalidArgument("q", f"row {i} has no probability mass")
        q[i] /= s
    return q


class TargetSession(_ModelSession):
    """The target side of a round: one forward pass per block, lossless acceptance."""

    def verify(self, drafts: list[int], q_rows, round_index: int, params: SamplingParams, seed: int) -> VerifyResult:
        """drafts: [k] target ids; q_rows: k sparse rows over target ids (None if greedy or k = 0)."""
        t0 = time.perf_counter()
        k = len(drafts)
        base = len(self.ids)
        if not params.greedy and k and (q_rows is None or len(q_rows) != k):
            raise InvalidArgument("q", f"sampling needs one drafter distribution per draft ({k}), got {0 if q_rows is None else len(q_rows)}")
        logits = self.forward(drafts, keep=k + 1)  # [k+1, V]
        vocab = logits.shape[-1]
        if any(d < 0 or d >= vocab for d in drafts):
            self.truncate_cache(base)
            raise InvalidArgument("draft_token_ids", f"ids must be in [0, {vocab})")
        presence = None
        if params.repetition_penalty != 1.0:
            ctx = torch.tensor(self.ids, dtype=torch.long, device=logits.device)
            ext = torch.tensor(drafts, dtype=torch.long, device=logits.device) if k else None
            presence = S.presence_rows(ctx, ext, vocab, k + 1)
        processed = S.process_logits(logits, params, presence)
        if params.greedy:
            outcome = S.verify_greedy(torch.argmax(processed, dim=-1).tolist(), drafts)
        else:
            p = S.probabilities(processed).double().cpu()
            try:
                qd = dense_q(q_rows, k, vocab) if k else torch.zeros(0, vocab, dtype=torch.float64)
            except InvalidArgument:
                self.truncate_cache(base)
                raise
            outcome = S.verify_sampling(p, qd, drafts, seed, round_index)
        emitted = list(drafts[: outcome.num_accepted]) + [outcome.next_token]
        self.ids.extend(emitted)
        # cache now holds base-1 + ... + all k drafts; keep the accepted prefix only
        self.truncate_cache(base + outcome.num_accepted)
        return VerifyResult(outcome, emitted, time.perf_counter() - t0)


# Drafter distributions are truncated to their head before sampling: the smallest set of most
# likely tokens holding 1 - Q_TAIL of the mass, at most Q_MAX_ENTRIES. The drafter then samples
# from exactly that (renormalised) distribution and ships it, so acceptance stays lossless --
# any proposal distribution is, as long as the verifier sees the one actually sampled from.
Q_TAIL = 1e-4
Q_MAX_ENTRIES = 1024


def truncate_distribution(pr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pr: [A] float32 probabilities -> (indices [m] ascending int64, probs [m] float32, unnormalised)."""
    m = min(Q_MAX_ENTRIES, pr.numel())
    vals, idx = torch.topk(pr, m)
    cum = torch.cumsum(vals.double(), 0)
    total = float(pr.double().sum())
    n = int(torch.searchsorted(cum, torch.tensor([(1.0 - Q_TAIL) * total], dtype=torch.float64))[0]) + 1
    n = max(1, min(n, int((vals > 0).sum()), m))
    idx = idx[:n]
    idx, _ = torch.sort(idx)
    return idx.cpu(), pr[idx].cpu()


@dataclass
class DraftToken:
    id: int  # drafter id
    q_ids: np.ndarray | None  # [m] int32 drafter ids ascending (None when greedy)
    q_probs: np.ndarray | None  # [m] float32, the distribution it was drawn from (unnormalised)
    forward_s: float
    last: bool = False  # the block ends with this proposal


@dataclass
class DraftBlock:
    """k proposals of the drafter, in drafter ids, with the distributions they were drawn from."""

    tokens: list[DraftToken]
    forward_s: float

    @property
    def ids(self) -> list[int]:
        return [t.id for t in self.tokens]


class AllowedSet:
    """The drafter ids a drafter may propose, ascending, with the matching LM-head rows."""

    prune_below = 0.9  # prune the LM head when the set keeps fewer than this share of its rows

    def __init__(self, model, mask: torch.Tensor | np.ndarray, device):
        mask = torch.as_tensor(np.asarray(mask, dtype=bool))
        self.ids = torch.nonzero(mask).flatten()  # [A] ascending drafter ids
        if self.ids.numel() == 0:
            raise InvalidArgument("mask", "allows no token")
        self.ids_dev = self.ids.to(device)
        # a pruned head pays off unless nearly every row is kept
        full = getattr(getattr(model, "lm_head", None), "weight", None)
        rows = full.shape[0] if full is not None else None
        prune = rows is None or self.ids.numel() < self.prune_below * rows
        self.head = _pruned_head(model, self.ids_dev) if prune else None
        self.count = int(self.ids.numel())


class DrafterSession(_ModelSession):
    """The drafter side: proposes only ids of an :class:`AllowedSet` (the intersection).

    Logits are computed only for the allowed ids: the LM head is pruned to those rows (kept in
    ascending id order, so compact index j always means drafter id ``allowed.ids[j]``). For a
    262,144-token Gemma drafter under a Qwen target that skips 63% of the head's matmul.
    """

    @torch.inference_mode()
    def _compact_logits(self, allowed: AllowedSet, props: list[int]) -> torch.Tensor:
        """Logits of the token after ids + props over the allowed ids only: [A] float32."""
        if allowed.head is None:
            return self.forward(props, keep=1)[0].float()[allowed.ids_dev]
        start, feed = self._tail(props)
        out = self.model.model(**self._inputs(start, feed))
        self.fed = self.fed[:start] + feed
        h = out.last_hidden_state[0, -1]
        return torch.nn.functional.linear(h, allowed.head).float()

    def draft_iter(self, k: int, round_index: int, params: SamplingParams, seed: int, allowed: AllowedSet,
                   stop_below: float = 0.0):
        """Yield up to k :class:`DraftToken` as they are produced (the committed ids are unchanged;
        the proposals stay in the cache so that an edit keeping them costs nothing)."""
        self.truncate_cache(len(self.ids) - 1)  # drop proposals of an uncommitted earlier block
        presence = None
        props: list[int] = []
        for i in range(k):
            t0 = time.perf_counter()
            logits = self._compact_logits(allowed, props)  # [A]; feeds the uncached tail (the last proposal)
            if params.repetition_penalty != 1.0:
                if presence is None:
                    top = int(allowed.ids.max()) + 1
                    seen = torch.zeros(top, dtype=torch.bool)
                    ctx = torch.tensor([t for t in self.ids if 0 <= t < top], dtype=torch.long)
                    seen[ctx] = True
                    presence = seen[allowed.ids].to(logits.device)
                else:
                    j = int(torch.searchsorted(allowed.ids, torch.tensor(props[-1])))
                    presence[j] = True
            pres = None if presence is None else presence.unsqueeze(0)
            processed = S.process_logits(logits.unsqueeze(0), params, pres)[0]
            if params.greedy:
                j = int(torch.argmax(processed))
                conf = float(torch.softmax(processed, dim=-1)[j]) if stop_below > 0 else 1.0
                q_ids = q_probs = None
            else:
                pr = torch.softmax(processed, dim=-1)
                idx, vals = truncate_distribution(pr)
                jj = S.sample_from(vals, S.uniform(seed, round_index, i, S.STREAM_DRAFT))
                j = int(idx[jj])
                conf = float(vals[jj].double() / vals.double().sum())
                q_ids = allowed.ids[idx].numpy().astype(np.int32)
                q_probs = vals.numpy().astype(np.float32)
            tok = int(allowed.ids[j])
            props.append(tok)  # the next forward feeds exactly this proposal
            last = i == k - 1 or conf < stop_below
            yield DraftToken(tok, q_ids, q_probs, time.perf_counter() - t0, last)
            if last:
                break

    def draft(self, k: int, round_index: int, params: SamplingParams, seed: int, allowed: AllowedSet,
              stop_below: float = 0.0) -> DraftBlock:
        t0 = time.perf_counter()
        toks = list(self.draft_iter(k, round_index, params, seed, allowed, stop_below))
        return DraftBlock(toks, time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# The loop.


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
    skipped_rounds: int = 0  # speculative rounds in which the policy drafted nothing (drafting did not pay)
    cost_model: str = ""  # where the draft-length policy took its costs from: "measured" or "static"
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = "length"
    drafter_fallback: bool = False  # the drafter failed or was too slow: the rest ran target-only
    fallback_reason: str = ""
    reused_target_tokens: int = 0  # verifier KV-cache entries reused from an earlier request
    reused_drafter_tokens: int = 0

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["acceptance_rate"] = self.accepted / self.drafted if self.drafted else 0.0
        d["acceptance_by_position"] = [
            a / n if n else 0.0 for a, n in zip(self.accepted_by_position, self.drafted_by_position)
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

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict()}


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(name, f"must be an integer, got {type(value).__name__}")
    if value <= 0:
        raise InvalidArgument(name, f"must be > 0, got {value}")
    return value


class Engine:
    """Speculative decoding with a target and an optional drafter, in one process.

    target / drafter: :class:`crossdraft.models.LoadedModel`-like objects with ``model``,
    ``tokenizer``, ``device``, ``eos_token_ids`` and ``vocab_size``. The round loop is
    :class:`crossdraft.decode.Decoder` over in-process workers -- the same code the gateway runs
    over gRPC, so both produce the same tokens.
    """

    def __init__(self, target, drafter=None, *, mapping=None, vocab_cache_dir=None):
        from .decode import Decoder, TokenPair
        from .workers import DrafterWorker, VerifierWorker, WorkerConfig

        self.target = target
        self.drafter = drafter
        self.pair = TokenPair(target.tokenizer, drafter.tokenizer if drafter is not None else None,
                              int(target.vocab_size), int(drafter.vocab_size) if drafter is not None else 0,
                              mapping=mapping, vocab_cache_dir=vocab_cache_dir)
        self.mapping = self.pair.mapping
        cfg = WorkerConfig(max_sessions=4)
        self.verifier = VerifierWorker(target, cfg)
        self.drafter_worker = DrafterWorker(drafter, cfg) if drafter is not None else None
        self.decoder = Decoder(self.pair, self.verifier, self.drafter_worker, eos_ids=target.eos_token_ids,
                               max_context=self.verifier.max_context, check_context=False)
        if self.drafter_worker is not None:  # time the forwards now, not inside the first request
            self.verifier.timings()
            self.drafter_worker.timings()
        self._n = 0

    def __getattr__(self, name):  # d2t, t2d, allowed, same_vocab, t_bytes, d_bytes live on the pair
        if name in ("d2t", "t2d", "allowed", "allowed_text", "same_vocab", "t_bytes", "d_bytes"):
            return getattr(self.pair, name)
        raise AttributeError(name)

    @staticmethod
    def chat_ids(tok, messages: list[dict]) -> list[int]:
        from .decode import chat_ids

        return chat_ids(tok, messages)

    def generate_chat(self, messages: list[dict], **kwargs) -> GenerationResult:
        """Generate the assistant's reply; each model sees the conversation in its own template."""
        t_ids, d_ids = self.pair.chat_ids(messages)
        return self.generate(prompt_ids=t_ids, drafter_prompt_ids=d_ids, **kwargs)

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: list[int] | None = None,
        drafter_prompt_ids: list[int] | None = None,
        max_new_tokens: int = 64,
        params: SamplingParams | None = None,
        seed: int = 0,
        draft: DraftConfig | None = None,
        use_drafter: bool = True,
    ) -> GenerationResult:
        if prompt_ids is None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidArgument("prompt", "must be a non-empty string")
            prompt_ids = self.pair.encode_target(prompt)
        if not prompt_ids:
            raise InvalidArgument("prompt", "must not be empty")
        d_ids = None
        if self.drafter is not None and use_drafter:
            if drafter_prompt_ids is not None:
                d_ids = list(drafter_prompt_ids)
            else:
                if prompt is None:
                    prompt = self.target.tokenizer.decode(prompt_ids, skip_special_tokens=True)
                d_ids = self.pair.encode_drafter(prompt)
        self._n += 1
        sid = f"engine-{self._n}"
        try:
            run = self.decoder.run(sid, list(prompt_ids), d_ids, max_new_tokens=max_new_tokens,
                                   params=params or SamplingParams(), seed=seed, draft=draft or DraftConfig(),
                                   use_drafter=use_drafter)
            for _ in run:
                pass
            return run.result
        finally:
            self.verifier.end(sid)
            if self.drafter_worker is not None:
                self.drafter_worker.end(sid)
