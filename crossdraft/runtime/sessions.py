"""Model sessions: one model's token ids and KV cache, the unit a worker holds per session.

* :class:`TargetSession` -- target ids + KV cache; ``verify(drafts, q)`` runs ONE forward over
  the uncached tail and the drafts and applies the lossless acceptance rule.
* :class:`DrafterSession` -- drafter ids + KV cache; ``draft_iter(k, allowed=...)`` proposes up
  to k tokens of an :class:`AllowedSet` (the vocabulary intersection) with the distributions they
  were drawn from; ``edit`` / ``sync`` replace the tail after the target's verdict.

Neither knows the other's vocabulary (the round loop in :mod:`crossdraft.decoding.decode` maps between
them). KV caches live across rounds; on rejection they are cropped, never recomputed.

Invariant for both sessions: ``cache_len <= len(ids) - 1``; the next forward feeds
``ids[cache_len:]`` (at least one token), so the last row of its logits predicts the next token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from crossdraft.decoding import sampling as S
from crossdraft.decoding.coupled import Draws, coupled_argmax, verify_coupled
from crossdraft.decoding.messages import DraftToken
from crossdraft.decoding.sampling import SamplingParams, VerifyOutcome
from crossdraft.errors import FailedPrecondition, InvalidArgument


def cost_numbers(model, head_rows: int | None = None) -> tuple[int, int, int]:
    """(body_bytes, head_row_bytes, head_rows) of one token's forward, for
    :func:`crossdraft.decoding.costmodel.cost_ratio`.

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
    from crossdraft.models.cpulinear import packed_bytes

    total += packed_bytes(model)  # weights that moved into oneDNN's layout (crossdraft.models.cpulinear)
    overhead = 60e6 * next(model.parameters()).element_size()
    return int(total + overhead), int(row_bytes), int(rows)


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
    from crossdraft.models.quant import Int8Linear

    if isinstance(head, Int8Linear):  # a quantized drafter: the pruned rows keep their int8 copy
        return head.rows(allowed_ids.to(w.device))
    return w.detach().index_select(0, allowed_ids.to(w.device)).contiguous()


def apply_head(h: torch.Tensor, head) -> torch.Tensor:
    """Logits of hidden states `h` under a pruned head: a ``[A, hidden]`` matrix or an
    :class:`~crossdraft.models.quant.Int8Linear` of those rows."""
    if isinstance(head, torch.Tensor):
        w = head.to(device=h.device)
        return torch.nn.functional.linear(h.to(w.dtype), w)
    return head(h.to(head.weight.dtype))


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class OwnKV:
    """A session's own KV cache (a transformers DynamicCache): its forwards run alone, one
    session at a time -- the in-process engine, and model servers with batching off.

    The other kind, a slot in a model server's shared KV pool whose forwards are batched with other
    sessions', is :class:`crossdraft.runtime.batching.PooledKV`; both answer length / crop / run / close.
    """

    def __init__(self, model, device):
        self.model = model
        self.device = device
        self.cache = new_cache(model)

    def length(self) -> int:
        return cache_length(self.cache)

    def crop(self, n: int) -> None:
        crop_cache(self.cache, n)

    @torch.inference_mode()
    def run(self, start: int, feed: list[int], keep: int, head: torch.Tensor | None = None,
            more: bool = False) -> torch.Tensor:
        """Feed tokens at positions start..; the last `keep` rows of logits [keep, V] (or, with a
        pruned LM head [A, hidden], of linear(h, head) [keep, A]). (``more``: a batched cache's hint.)"""
        inp = torch.tensor([feed], dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + len(feed), device=self.device).unsqueeze(0)
        kw = dict(input_ids=inp, position_ids=pos, cache_position=pos[0], cache=self.cache, use_cache=True)
        if head is None:
            # the kept positions as an index tensor, not an int: transformers then gathers them into a
            # fresh [1, keep, hidden] tensor; with an int it slices a view whose batch stride is that of
            # the whole feed, and a bf16 linear over such a view takes a slow path on CPU (measured on an
            # AMX Xeon, qwen2.5-coder-0.5b: 5 tokens fed, 1 kept: 700 ms instead of 88 ms)
            n = len(feed)
            kept = keep if keep >= n else torch.arange(n - keep, n, device=self.device)
            return self.model(**kw, logits_to_keep=kept).logits[0, -keep:, :]
        h = self.model.model(**kw).last_hidden_state[0, -keep:]
        return apply_head(h, head)

    def fork(self) -> "OwnKV":
        """An independent copy (a cache of its own holds its own tensors: this copies them)."""
        import copy

        other = OwnKV.__new__(OwnKV)
        other.model, other.device = self.model, self.device
        other.cache = copy.deepcopy(self.cache)
        return other

    def close(self) -> None:
        self.cache = None


class _ModelSession:
    """ids + KV cache of one causal LM; feeds the uncached tail plus extra tokens.

    ``fed`` lists exactly the tokens whose keys/values are in the cache (a prefix of ids, possibly
    followed by uncommitted proposals), so any new history can reuse the longest common prefix.
    ``kv`` is where the keys and values live: :class:`OwnKV` (default) or a slot in a model
    server's batched KV pool (:class:`crossdraft.runtime.batching.PooledKV`).
    """

    def __init__(self, model, ids: list[int], device: torch.device, kv=None):
        if not ids:
            raise InvalidArgument("prompt", "is empty after tokenisation")
        self.model = model
        self.device = device
        self.ids: list[int] = list(ids)
        self.kv = kv if kv is not None else OwnKV(model, device)
        self.fed: list[int] = []
        self.cache_repairs = 0  # forwards that found the cache out of step with ids (a bug if ever > 0)
        self.closed = False
        # bumped by each call that edits the history (a drafter's Draft or Commit): the block of an
        # earlier Draft whose stream was cancelled stops instead of feeding proposals past the new history
        self.calls = 0

    @property
    def cache(self):
        """The DynamicCache of an :class:`OwnKV` session (None for a pooled one)."""
        return getattr(self.kv, "cache", None)

    @property
    def cache_len(self) -> int:
        return self.kv.length()

    def close(self) -> None:
        """Release the KV cache (the session is being dropped)."""
        if not self.closed:
            self.closed = True
            self.kv.close()

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
            self.kv.crop(keep)
            del self.fed[keep:]
            start = self.cache_len
        return start, seq[start:]

    def forward(self, extra: list[int], keep: int, head: torch.Tensor | None = None, more=False) -> torch.Tensor:
        """Feed (ids + extra)[cache_len:]; return the last `keep` rows of logits [keep, V]
        (with a pruned head [A, hidden]: [keep, A]). ``more``: another forward may follow at once (a block's step)."""
        start, feed = self._tail(extra)
        out = self.kv.run(start, feed, keep, head, more)
        self.fed = self.fed[:start] + feed
        return out

    def prefill(self) -> int:
        """Compute the keys and values of every id but the last now (the last one is fed by the
        next verify or draft, which needs its logits); returns the tokens cached. One forward over
        the uncached part, none if it is cached already."""
        start, feed = self._tail([])
        feed = feed[:-1]
        if feed:
            self.kv.run(start, feed, 1)
            self.fed = self.fed[:start] + feed
        return self.cache_len

    def fork(self) -> "_ModelSession":
        """A session with the same history and the same cached keys and values (a model server's
        pool shares them until either side writes; a cache of its own is copied)."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.ids, other.fed = list(self.ids), list(self.fed)
        other.kv = self.kv.fork()
        del other.fed[other.kv.length():]  # the copy never holds more than the source, at most fewer
        other.cache_repairs, other.closed = 0, False
        return other

    def truncate_cache(self, valid: int) -> None:
        n = min(valid, self.cache_len, len(self.ids) - 1)
        self.kv.crop(n)
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
    # per emitted token, when asked for: (its log-probability, top ids, their log-probabilities)
    logprobs: list | None = None


MAX_TOP_LOGPROBS = 20


def token_logprobs(processed: torch.Tensor, emitted: list[int], top: int) -> list:
    """The target's log-probabilities at each emitted position, from the processed logits rows
    ([len(emitted), V]: temperature, top-k/top-p, repetition penalty applied; greedy: the logits
    as they are): (the emitted token's, the ``top`` best ids, theirs). Tokens a top-k/top-p filter
    removed have log-probability -inf and are never listed among the best."""
    lp = torch.log_softmax(processed[: len(emitted)].double(), dim=-1)
    out = []
    if top > 0:
        vals, ids = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
    for i, tok in enumerate(emitted):
        if top > 0:
            keep = torch.isfinite(vals[i])
            tops = (ids[i][keep].tolist(), vals[i][keep].tolist())
        else:
            tops = ([], [])
        out.append((float(lp[i, tok]), *tops))
    return out


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

    def drop_last(self) -> None:
        """Pipelined rounds: drop the last id (the previous round's own token, which no forward has fed):
        the next block was drafted past the previous one and checks that position itself. The cache
        then holds every id but the new last one, whose logits the next forward computes again."""
        if len(self.ids) < 2:
            raise FailedPrecondition(f"drop_last_token: the session holds {len(self.ids)} token(s)")
        self.ids.pop()
        self.truncate_cache(len(self.ids))

    def verify(self, drafts: list[int], q_rows, round_index: int, params: SamplingParams, seed: int,
               top_logprobs: int = -1) -> VerifyResult:
        """drafts: [k] target ids; q_rows: k sparse rows over target ids (None if greedy or k = 0).

        top_logprobs: -1 = no log-probabilities; n >= 0 = each emitted token's and the n best."""
        t0 = time.perf_counter()
        k = len(drafts)
        base = len(self.ids)
        if not params.greedy and not params.coupled and k and (q_rows is None or len(q_rows) != k):
            got = 0 if q_rows is None else len(q_rows)
            raise InvalidArgument("q", f"sampling needs one drafter distribution per draft ({k}), got {got}")
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
        elif params.coupled:  # the target's token at each position is a function of (seed, position)
            outcome = verify_coupled(processed, drafts, seed, base)
        else:
            p = S.probabilities(processed).double().cpu()
            try:
                qd = dense_q(q_rows, k, vocab) if k else torch.zeros(0, vocab, dtype=torch.float64)
            except InvalidArgument:
                self.truncate_cache(base)
                raise
            outcome = S.verify_sampling(p, qd, drafts, seed, round_index)
        emitted = list(drafts[: outcome.num_accepted]) + [outcome.next_token]
        lps = token_logprobs(processed, emitted, top_logprobs) if top_logprobs >= 0 else None
        self.ids.extend(emitted)
        # cache now holds base-1 + ... + all k drafts; keep the accepted prefix only
        self.truncate_cache(base + outcome.num_accepted)
        return VerifyResult(outcome, emitted, time.perf_counter() - t0, lps)


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


class AllowedSet:
    """The drafter ids a drafter may propose, ascending, with the matching LM-head rows."""

    prune_below = 0.9  # prune the LM head when the set keeps fewer than this share of its rows

    def __init__(self, model, mask: torch.Tensor | np.ndarray, device, target_ids=None):
        mask = torch.as_tensor(np.asarray(mask, dtype=bool))
        self.ids = torch.nonzero(mask).flatten()  # [A] ascending drafter ids
        if self.ids.numel() == 0:
            raise InvalidArgument("mask", "allows no token")
        # coupled draws (crossdraft.decoding.coupled) read each allowed id at the noise of its target id:
        # target_ids [A] (None: unknown -- coupled drafting then proposes its argmax), and the
        # inverse over target ids (entry of each, -1 if none)
        self.target_ids = self.inverse = None
        if target_ids is not None:
            t = np.asarray(target_ids, dtype=np.int64)
            if t.shape != (self.ids.numel(),):
                raise InvalidArgument("target_ids", f"must hold one id per allowed id ({self.ids.numel()}), "
                                      f"got {t.size}")
            if t.size and int(t.min()) < 0:
                raise InvalidArgument("target_ids", "must be >= 0")
            if t.size and int(t.max()) >= 1 << 24:
                raise InvalidArgument("target_ids", f"must be < {1 << 24}")
            inv = np.full(int(t.max()) + 1, -1, dtype=np.int64)
            inv[t[::-1]] = np.arange(t.size - 1, -1, -1)  # several ids of one target id: the lowest entry
            self.target_ids, self.inverse = t, inv
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

    def _batch(self) -> dict:
        """How the latest forward was batched (a batched server's KV pool records it): the seconds it waited
        for its batch to start (part of a DraftToken's forward_s, reported apart) and the batch's rows."""
        last = getattr(self.kv, "last", None)
        return {"queue_s": last.queue_wait_s, "batch_rows": last.batch_rows} if last is not None else {}

    @torch.inference_mode()
    def _compact_logits(self, allowed: AllowedSet, props: list[int], keep: int = 1, more: bool = False) -> torch.Tensor:
        """Logits of the token after ids + props over the allowed ids only: [A] float32 (keep > 1:
        the last `keep` positions' rows, [keep, A])."""
        if allowed.head is None:
            out = self.forward(props, keep=keep, more=more).float()[:, allowed.ids_dev]
        else:
            out = self.forward(props, keep=keep, head=allowed.head, more=more).float()
        return out[0] if keep == 1 else out

    @staticmethod
    def _agreeing(row: torch.Tensor, allowed: AllowedSet, heal, need: bytes) -> torch.Tensor:
        """The row with every allowed id that disagrees with the bytes ``need`` set to -inf."""
        ids = torch.as_tensor(heal.agreeing(need))
        j = torch.searchsorted(allowed.ids, ids).clamp(max=allowed.ids.numel() - 1)
        j = j[allowed.ids[j] == ids].to(row.device)
        out = torch.full_like(row, float("-inf"))
        out[j] = row[j]
        return out

    def _heal(self, rows: torch.Tensor, allowed: AllowedSet, heal) -> tuple[int, float, bytes] | None:
        """Token healing (crossdraft.vocab.healing): rows[0] scores the position of the last id P. Returns
        (compact index, its probability, bytes still needed) when the drafter prefers another token
        for P's bytes -- P has then left the session -- or None (P stays)."""
        p_tok = self.ids[-1]
        need = heal.bytes[p_tok] if 0 <= p_tok < len(heal.bytes) else b""
        if not need:
            return None
        row = self._agreeing(rows[0], allowed, heal, need)
        j = int(torch.argmax(row))
        tok = int(allowed.ids[j])
        if not torch.isfinite(row[j]) or tok == p_tok:
            return None
        self.ids.pop()
        n = len(self.ids)  # the cache holds the ids up to P's predecessor (fed by this forward): keep them
        self.kv.crop(n)
        del self.fed[n:]
        return j, float(torch.softmax(row, dim=-1)[j]), heal.rest(need, tok)

    # one pass per drafted token; healing, the penalty, the draw rule and the block's end share its state: kept whole
    def draft_iter(self, k: int, round_index: int, params: SamplingParams, seed: int, allowed: AllowedSet,
                   stop_below: float = 0.0, stop_cumulative: float = 0.0, heal=None, position: int = -1,
                   runner_up: bool = False):
        """Yield up to k :class:`DraftToken` as they are produced (the committed ids are unchanged;
        the proposals stay in the cache so that an edit keeping them costs nothing).

        The block ends early after a proposal whose own probability is below ``stop_below``, or once
        the product of the block's proposal probabilities (the drafter's estimate that the whole
        block is accepted) is below ``stop_cumulative``.

        heal: a :class:`crossdraft.vocab.healing.TokenBytes` of this vocabulary to heal the last id
        (greedy only): if the drafter prefers another token for its bytes, the last id leaves the
        committed ids and the first proposal (``heals``) replaces it.

        position: with ``params.coupled``, the target's position of the first proposal: proposal i
        is the argmax of the drafter's logits plus the coupled draws of (seed, position + i) read at
        each allowed id's target id (its plain argmax when that is unknown); no distribution is
        shipped, since the verifier's test does not use one. runner_up (greedy): each proposal also carries
        its probability and the drafter's second choice (crossdraft.decoding.pipeline's branch)."""
        self.truncate_cache(len(self.ids) - 1)  # drop proposals of an uncommitted earlier block
        presence = alt = None
        props: list[int] = []
        cum = 1.0
        healing = heal is not None and params.greedy and len(self.ids) >= 2
        if healing:  # the first forward feeds the last two ids: rows for P's position and the next
            self.truncate_cache(len(self.ids) - 2)
        need = b""  # bytes of a healed token that the next proposals must still spell
        for i in range(k):
            t0 = time.perf_counter()
            if healing:
                healing = False
                rows = self._compact_logits(allowed, props, keep=2, more=k > 1)
                healed = self._heal(rows, allowed, heal)
                if healed is not None:
                    j, conf, need = healed
                    tok = int(allowed.ids[j])
                    props.append(tok)
                    cum *= conf
                    last = i == k - 1 or (not need and (conf < stop_below or cum < stop_cumulative))
                    yield DraftToken(tok, None, None, time.perf_counter() - t0, last, heals=True,
                                     **self._batch())
                    if last:
                        break
                    continue
                logits = rows[1]
            else:
                logits = self._compact_logits(allowed, props, more=i < k - 1)  # [A]; feeds the last proposal
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
            if need:  # the rest of a healed token's bytes
                processed = self._agreeing(processed, allowed, heal, need)
                if not bool(torch.isfinite(processed).any()):
                    break  # no allowed id can spell the rest: the block ends (it drafted no new text)
            if params.greedy or params.coupled:
                if params.greedy or allowed.target_ids is None or position < 0:
                    j = int(torch.argmax(processed))
                else:
                    j = coupled_argmax(processed, Draws(seed, position + i), allowed.target_ids, allowed.inverse)
                if runner_up and params.greedy and processed.shape[-1] > 1:  # (its softmax gives conf too)
                    alt = S.runner_up(processed, j)
                conf = (alt[0] if alt is not None else float(torch.softmax(processed, dim=-1)[j])
                        if stop_below > 0 or stop_cumulative > 0 else 1.0)
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
            cum *= conf
            if need:
                need = heal.rest(need, tok)
            # (a block still spelling a healed token's bytes has no new text yet: it goes on)
            last = i == k - 1 or (not need and (conf < stop_below or cum < stop_cumulative))
            out = DraftToken(tok, q_ids, q_probs, time.perf_counter() - t0, last, **self._batch())
            if alt is not None:
                out.prob, out.alt, out.alt_prob = alt[0], int(allowed.ids[alt[1]]), alt[2]
                alt = None
            yield out
            if last:
                break
