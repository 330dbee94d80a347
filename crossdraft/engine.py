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
from . import vocab as V
from .errors import InvalidArgument
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

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "tli", "text"):
            raise InvalidArgument("mode", f"must be one of auto, tli, text; got {self.mode!r}")
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
    E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens and costs k * c + 1 + s * k target-forward
    units, where c is the drafter's cost per token relative to one target forward and s the extra
    cost of one more verified position. alpha is estimated online (exponential forgetting) from
    acceptance counts; k maximises E(k) / cost(k) within [min, max]. If even the best k yields
    less than one token per target forward, the round drafts nothing, and every `probe_every`
    such rounds a short block re-measures alpha -- a poor drafter costs only its probes.

    Every input is a function of the generated tokens and fixed costs -- never of wall-clock
    time -- so a seeded sampling run picks the same k sequence, hence the same random draws and
    the same text, every time (and after a failover).
    """

    decay = 0.85
    probe_every = 6

    def __init__(self, cfg: DraftConfig, cost_ratio: float = 0.2, verify_slope: float = 0.03):
        self.cfg = cfg
        self.c = max(1e-3, float(cost_ratio))
        self.slope = max(0.0, float(verify_slope))
        self.hi = max(cfg.max_draft_tokens, cfg.num_draft_tokens)
        self.succ, self.trials = 1.2, 2.0  # prior alpha = 0.6
        self.skipped = 0

    def alpha(self) -> float:
        return min(0.98, max(0.02, self.succ / self.trials))

    def observe(self, k: int, n: int) -> None:
        if k > 0:
            d = self.decay
            self.succ = d * self.succ + n
            self.trials = d * self.trials + n + (1 if n < k else 0)

    def rate(self, k: int) -> float:
        """Expected tokens per target-forward unit with a block of k (k = 0: target-only = 1)."""
        a = self.alpha()
        return ((1 - a ** (k + 1)) / (1 - a)) / (1 + k * (self.c + self.slope))

    def next_k(self) -> int:
        cfg = self.cfg
        if not cfg.adaptive:
            return cfg.num_draft_tokens
        best = max(range(cfg.min_draft_tokens, self.hi + 1), key=self.rate)
        if cfg.allow_skip and self.rate(best) < 1.0:
            self.skipped += 1
            return cfg.min_draft_tokens if self.skipped % self.probe_every == 0 else 0
        self.skipped = 0
        return best


def estimate_cost_ratio(drafter_model, target_model, drafter_head_rows: int | None = None) -> float:
    """Drafter cost per token relative to one target forward, from weight sizes.

    One-token decoding is memory-bound: its time follows the bytes of weights read (embedding
    lookups excluded, the LM head included -- only the pruned rows for the drafter), plus a fixed
    per-forward overhead worth ~60M parameters on CPU (kernel launches, Python). Measured here:
    0.5B/1.5B 0.36 (estimate 0.35), 135M/1.5B 0.17 (0.12). Deterministic on purpose (see
    DraftPolicy).
    """

    def active_bytes(model, head_rows):
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
        if hw is not None:
            rows = hw.shape[0] if head_rows is None else head_rows
            total += rows * hw.shape[1] * hw.element_size()
        overhead = 60e6 * next(model.parameters()).element_size()
        return total + overhead

    return active_bytes(drafter_model, drafter_head_rows) / active_bytes(target_model, None)


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


class _ModelSession:
    """ids + KV cache of one causal LM; feeds the uncached tail plus extra tokens."""

    def __init__(self, model, ids: list[int], device: torch.device):
        if not ids:
            raise InvalidArgument("prompt", "is empty after tokenisation")
        self.model = model
        self.device = device
        self.ids: list[int] = list(ids)
        self.cache = new_cache(model)

    @property
    def cache_len(self) -> int:
        return cache_length(self.cache)

    @torch.inference_mode()
    def forward(self, extra: list[int], keep: int) -> torch.Tensor:
        """Feed ids[cache_len:] + extra; return the last `keep` rows of logits [keep, V]."""
        start = self.cache_len
        feed = self.ids[start:] + list(extra)
        inp = torch.tensor([feed], dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + len(feed), device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=inp,
            position_ids=pos,
            cache_position=pos[0],
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        return out.logits[0, -keep:, :]

    def truncate_cache(self, valid: int) -> None:
        crop_cache(self.cache, min(valid, self.cache_len, len(self.ids) - 1))


@dataclass
class VerifyResult:
    """What one verification round produced, in target ids."""

    outcome: VerifyOutcome
    emitted: list[int]  # accepted drafts + the target's own token
    forward_s: float


class TargetSession(_ModelSession):
    """The target side of a round: one forward pass per block, lossless acceptance."""

    def __init__(self, model, ids: list[int], device, params: SamplingParams, seed: int):
        super().__init__(model, ids, device)
        self.params = params
        self.seed = seed

    def verify(self, drafts: list[int], q: torch.Tensor | None, round_index: int) -> VerifyResult:
        """drafts: [k] target ids; q: [k, V_target] drafter probabilities (None if greedy or k=0)."""
        t0 = time.perf_counter()
        k = len(drafts)
        base = len(self.ids)
        logits = self.forward(drafts, keep=k + 1)  # [k+1, V]
        vocab = logits.shape[-1]
        presence = None
        if self.params.repetition_penalty != 1.0:
            ctx = torch.tensor(self.ids, dtype=torch.long, device=logits.device)
            ext = torch.tensor(drafts, dtype=torch.long, device=logits.device) if k else None
            presence = S.presence_rows(ctx, ext, vocab, k + 1)
        processed = S.process_logits(logits, self.params, presence)
        if self.params.greedy:
            outcome = S.verify_greedy(torch.argmax(processed, dim=-1).tolist(), drafts)
        else:
            p = S.probabilities(processed).double().cpu()
            qd = q.double().cpu() if k else torch.zeros(0, vocab, dtype=torch.float64)
            outcome = S.verify_sampling(p, qd, drafts, self.seed, round_index)
        emitted = list(drafts[: outcome.num_accepted]) + [outcome.next_token]
        self.ids.extend(emitted)
        # cache now holds base-1 + ... + all k drafts; keep the accepted prefix only
        self.truncate_cache(base + outcome.num_accepted)
        return VerifyResult(outcome, emitted, time.perf_counter() - t0)


@dataclass
class DraftBlock:
    """k proposals of the drafter, in drafter ids, with their processed distributions."""

    ids: list[int]
    probs: torch.Tensor | None  # [k, V_drafter] float32 (None when greedy)
    forward_s: float


class DrafterSession(_ModelSession):
    """The drafter side: proposes only ids whose mask entry is True (the intersection).

    Logits are computed only for the allowed ids: the LM head is pruned to those rows (kept in
    ascending id order, so compact index j always means drafter id ``allowed_ids[j]``). For a
    262,144-token Gemma drafter under a Qwen target that skips 63% of the head's matmul.
    """

    def __init__(self, model, ids: list[int], device, params: SamplingParams, seed: int, allowed: torch.Tensor,
                 stop_below: float = 0.0):
        super().__init__(model, ids, device)
        self.params = params
        self.seed = seed
        self.stop_below = stop_below
        self.allowed_ids = torch.nonzero(allowed.to("cpu")).flatten()  # [A] ascending drafter ids
        self._allowed_dev = self.allowed_ids.to(device)
        self._head = _pruned_head(model, self._allowed_dev)  # [A, H] or None

    @torch.inference_mode()
    def _compact_logits(self) -> torch.Tensor:
        """Logits of the next token over the allowed ids only: [A] float32."""
        if self._head is None:
            return self.forward([], keep=1)[0].float()[self._allowed_dev]
        start = self.cache_len
        feed = self.ids[start:]
        inp = torch.tensor([feed], dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + len(feed), device=self.device).unsqueeze(0)
        out = self.model.model(input_ids=inp, position_ids=pos, cache_position=pos[0],
                               past_key_values=self.cache, use_cache=True)
        h = out.last_hidden_state[0, -1]
        return torch.nn.functional.linear(h, self._head).float()

    def draft(self, k: int, round_index: int) -> DraftBlock:
        t0 = time.perf_counter()
        self.truncate_cache(len(self.ids) - 1)  # drop proposals of an uncommitted earlier block
        ids: list[int] = []
        rows: list[torch.Tensor] = []
        presence = None
        base = len(self.ids)
        try:
            for i in range(k):
                logits = self._compact_logits()  # [A]; feeds the uncached tail (the last proposal)
                if self.params.repetition_penalty != 1.0:
                    if presence is None:
                        seen = torch.zeros(int(self.allowed_ids.max()) + 1 if len(self.allowed_ids) else 1, dtype=torch.bool)
                        ctx = torch.tensor([t for t in self.ids if t < seen.numel()], dtype=torch.long)
                        seen[ctx] = True
                        presence = seen[self.allowed_ids].to(logits.device)
                    elif ids:
                        j = int(torch.searchsorted(self.allowed_ids, torch.tensor(ids[-1])))
                        presence[j] = True
                pres = None if presence is None else presence.unsqueeze(0)
                processed = S.process_logits(logits.unsqueeze(0), self.params, pres)[0]
                if self.params.greedy:
                    j = int(torch.argmax(processed))
                    conf = float(torch.softmax(processed, dim=-1)[j]) if self.stop_below > 0 else 1.0
                else:
                    pr = torch.softmax(processed, dim=-1)
                    rows.append(pr)
                    j = S.sample_from(pr, S.uniform(self.seed, round_index, i, S.STREAM_DRAFT))
                    conf = float(pr[j])
                tok = int(self.allowed_ids[j])
                ids.append(tok)
                self.ids.append(tok)  # so that the next forward feeds exactly this proposal
                if conf < self.stop_below:
                    break
        finally:
            del self.ids[base:]  # proposals stay proposals until commit()
        probs = torch.stack(rows) if rows else None
        return DraftBlock(ids, probs, time.perf_counter() - t0)

    def commit(self, accepted: list[int], appended: list[int]) -> None:
        """Keep `accepted` proposals (drafter ids) and append `appended`; crop the cache."""
        base = len(self.ids)
        self.ids.extend(accepted)
        self.ids.extend(appended)
        self.truncate_cache(base + len(accepted))

    def replace_tail(self, keep: int, new_tail: list[int]) -> None:
        """ids = ids[:keep] + new_tail; crop the cache to the common prefix."""
        new = self.ids[:keep] + list(new_tail)
        lcp = 0
        for a, b in zip(self.ids, new):
            if a != b:
                break
            lcp += 1
        self.ids = new
        self.truncate_cache(lcp)


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
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = "length"

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
    ``tokenizer``, ``device``, ``eos_token_ids`` and ``vocab_size``.
    """

    def __init__(self, target, drafter=None, *, mapping=None, vocab_cache_dir=None):
        self.target = target
        self.drafter = drafter
        self.mapping = None
        self._cost_cache: dict[str, float] = {}
        self.t_bytes = [b if b is not None else b"" for b in V.token_bytes(target.tokenizer)]
        if drafter is not None:
            self.mapping = mapping or V.build_mapping(target.tokenizer, drafter.tokenizer, cache_dir=vocab_cache_dir)
            vt, vd = int(target.vocab_size), int(drafter.vocab_size)
            d2t = np.full(vd, -1, dtype=np.int64)
            n = min(vd, len(self.mapping.d2t))
            d2t[:n] = self.mapping.d2t[:n]
            d2t[d2t >= vt] = -1
            t2d = np.full(vt, -1, dtype=np.int64)
            n = min(vt, len(self.mapping.t2d))
            t2d[:n] = self.mapping.t2d[:n]
            t2d[t2d >= vd] = -1
            self.d2t = d2t
            self.t2d = t2d
            self.allowed = torch.from_numpy(d2t >= 0)
            self._src = torch.from_numpy(np.nonzero(d2t >= 0)[0])  # drafter ids in the intersection
            self._dst = torch.from_numpy(d2t[d2t >= 0])  # their target ids
            self.d_bytes = [b if b is not None else b"" for b in V.token_bytes(drafter.tokenizer)]
            # text drafting may use every drafter token that stands for some bytes
            has_bytes = np.zeros(vd, dtype=bool)
            nb = min(vd, len(self.d_bytes))
            has_bytes[:nb] = [len(b) > 0 for b in self.d_bytes[:nb]]
            self.allowed_text = torch.from_numpy(has_bytes)
            src = np.nonzero(d2t >= 0)[0]
            self.same_vocab = vd == vt and bool(np.array_equal(d2t[src], src)) and int(has_bytes.sum()) == len(src)
            if not bool(self.allowed.any()):
                raise InvalidArgument("drafter", "shares no token with the target's vocabulary")

    # ---- helpers -------------------------------------------------------------------------
    def _cost_ratio(self, text_mode: bool) -> float:
        key = "text" if text_mode else "tli"
        if key not in self._cost_cache:
            rows = int((self.allowed_text if text_mode else self.allowed).sum())
            self._cost_cache[key] = estimate_cost_ratio(self.drafter.model, self.target.model, rows)
        return self._cost_cache[key]

    def _encode(self, tok, text: str) -> list[int]:
        return list(tok(text, add_special_tokens=True)["input_ids"])

    def _q_target(self, probs_d: torch.Tensor) -> torch.Tensor:
        """Map compact drafter probabilities [k, A] to target ids [k, V_t] (adding many-to-one)."""
        k = probs_d.shape[0]
        q = torch.zeros(k, int(self.target.vocab_size), dtype=torch.float64)
        q.index_add_(1, self._dst, probs_d.double().cpu())  # probs_d is compact: column j = drafter id _src[j]
        return q

    def _commit_text(self, dsess: DrafterSession, proposals: list[int], accepted_t: list[int], next_t: int,
                     d_gen_lens: list[int]) -> None:
        """Text drafting: keep the drafter proposals lying wholly inside the accepted text, then
        append the rest of the new text (accepted drafts + the target's token) encoded byte-exactly."""
        new_bytes = b"".join(self.t_bytes[t] for t in accepted_t if t < len(self.t_bytes))
        agreed = len(new_bytes)
        if next_t < len(self.t_bytes):
            new_bytes += self.t_bytes[next_t]
        keep, off = 0, 0
        for d in proposals:
            ln = len(self.d_bytes[d])
            if off + ln > agreed:
                break
            off += ln
            keep += 1
        try:
            tail = V.encode_bytes(self.drafter.tokenizer, new_bytes[off:])
        except ValueError:
            text = new_bytes[off:].decode("utf-8", errors="ignore")
            tail = list(self.drafter.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
        dsess.commit(proposals[:keep], tail)
        d_gen_lens.extend(len(self.d_bytes[t]) if t < len(self.d_bytes) else 0 for t in proposals[:keep] + tail)

    def _resync(self, dsess: DrafterSession, d_prompt_len: int, d_gen_lens: list[int], gen_bytes: bytes, window: int) -> None:
        """Re-tokenise the drafter's last `window` generated tokens plus the target's new text.

        The drafter's generated ids always spell exactly the target's generated bytes (accepted
        drafts and mapped target tokens have identical bytes; re-tokenised tails are encoded
        byte-exactly), so the kept prefix ends at a known byte offset.
        """
        n_gen = len(dsess.ids) - d_prompt_len
        keep = max(0, n_gen - window)
        tail = gen_bytes[sum(d_gen_lens[:keep]):]
        try:
            new_tail = V.encode_bytes(self.drafter.tokenizer, tail)
        except ValueError:  # the drafter cannot spell these bytes: approximate (quality only)
            text = tail.decode("utf-8", errors="ignore")
            new_tail = list(self.drafter.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
        dsess.replace_tail(d_prompt_len + keep, new_tail)
        del d_gen_lens[keep:]
        d_gen_lens.extend(len(self.d_bytes[t]) if t < len(self.d_bytes) else 0 for t in new_tail)

    @staticmethod
    def chat_ids(tok, messages: list[dict]) -> list[int]:
        """Token ids of `messages` rendered with the tokenizer's chat template (+ generation prompt)."""
        if not getattr(tok, "chat_template", None):
            raise InvalidArgument("chat", f"{getattr(tok, 'name_or_path', 'model')} has no chat template")
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def generate_chat(self, messages: list[dict], **kwargs) -> GenerationResult:
        """Generate the assistant's reply; each model sees the conversation in its own template."""
        t_ids = self.chat_ids(self.target.tokenizer, messages)
        d_ids = self.chat_ids(self.drafter.tokenizer, messages) if self.drafter is not None else None
        return self.generate(prompt_ids=t_ids, drafter_prompt_ids=d_ids, **kwargs)

    # ---- the loop ------------------------------------------------------------------------
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
        params = params or SamplingParams()
        draft = draft or DraftConfig()
        _check_positive_int("max_new_tokens", max_new_tokens)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidArgument("seed", "must be an integer")
        if prompt_ids is None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidArgument("prompt", "must be a non-empty string")
            prompt_ids = self._encode(self.target.tokenizer, prompt)
        if not prompt_ids:
            raise InvalidArgument("prompt", "must not be empty")
        limit = getattr(self.target.model.config, "max_position_embeddings", None)
        if limit and len(prompt_ids) + max_new_tokens > limit:
            raise InvalidArgument(
                "max_new_tokens", f"prompt ({len(prompt_ids)} tokens) + max_new_tokens exceeds the context ({limit})"
            )

        t_start = time.perf_counter()
        stats = Stats(prompt_tokens=len(prompt_ids))
        eos = set(self.target.eos_token_ids)
        tsess = TargetSession(self.target.model, prompt_ids, self.target.device, params, seed)
        spec = use_drafter and self.drafter is not None
        text_mode = False
        dsess = None
        if spec:
            stats.mode = "speculative"
            if drafter_prompt_ids is not None:
                d_ids = list(drafter_prompt_ids)
            else:
                if prompt is None:
                    prompt = self.target.tokenizer.decode(prompt_ids, skip_special_tokens=True)
                d_ids = self._encode(self.drafter.tokenizer, prompt)
            if draft.mode == "text" and not params.greedy:
                raise InvalidArgument("mode", "text drafting is lossless for greedy decoding only (temperature 0)")
            text_mode = params.greedy and not self.same_vocab and draft.mode in ("auto", "text")
            stats.draft_mode = "text" if text_mode else "tli"
            dsess = DrafterSession(self.drafter.model, d_ids, self.drafter.device, params, seed,
                                   self.allowed_text if text_mode else self.allowed, stop_below=draft.stop_below)
            d_prompt_len = len(d_ids)
            d_gen_lens: list[int] = []
        gen: list[int] = []
        gen_bytes = bytearray()
        policy = DraftPolicy(draft, self._cost_ratio(text_mode) if spec else 1.0)
        k = draft.num_draft_tokens
        round_index = 0
        while len(gen) < max_new_tokens:
            remaining = max_new_tokens - len(gen)
            kk = min(k, remaining - 1) if spec else 0
            t_round = time.perf_counter()
            block = None
            drafts_t: list[int] = []
            q = None
            if kk > 0:
                block = dsess.draft(kk, round_index)
                if text_mode:
                    drafted_bytes = b"".join(self.d_bytes[d] for d in block.ids)
                    try:
                        drafts_t = V.encode_bytes(self.target.tokenizer, drafted_bytes)[: remaining - 1]
                    except ValueError:  # the target cannot spell these bytes: nothing to propose
                        drafts_t = []
                else:
                    drafts_t = [int(self.d2t[d]) for d in block.ids]
                if block.probs is not None:
                    q = self._q_target(block.probs)
                stats.draft_s += block.forward_s
            kd = len(drafts_t)
            first = round_index == 0
            res = tsess.verify(drafts_t, q, round_index)
            n = res.outcome.num_accepted
            if first:
                stats.prefill_s += res.forward_s
            else:
                stats.verify_s += res.forward_s
                if spec:
                    policy.observe(kd, n)
            stats.record_round(kd, n)
            if spec and kd == 0 and remaining > 1:
                stats.skipped_rounds += 1
            emitted = res.emitted
            # stop at EOS / the token budget
            for j, tok in enumerate(emitted):
                if tok in eos:
                    emitted = emitted[: j + 1]
                    stats.finish_reason = "stop"
                    break
            gen.extend(emitted)
            for tok in emitted:
                if tok < len(self.t_bytes):
                    gen_bytes += self.t_bytes[tok]
            done = stats.finish_reason == "stop" or len(gen) >= max_new_tokens
            if not done and text_mode:
                self._commit_text(dsess, block.ids if block else [], drafts_t[:n], res.outcome.next_token, d_gen_lens)
            elif not done and spec:
                accepted_d = block.ids[:n] if block else []
                nxt = res.outcome.next_token
                d_nxt = int(self.t2d[nxt]) if nxt < len(self.t2d) else -1
                if d_nxt >= 0:
                    dsess.commit(accepted_d, [d_nxt])
                    d_gen_lens.extend(len(self.d_bytes[t]) for t in accepted_d + [d_nxt])
                else:
                    dsess.commit(accepted_d, [])
                    d_gen_lens.extend(len(self.d_bytes[t]) for t in accepted_d)
                    self._resync(dsess, d_prompt_len, d_gen_lens, bytes(gen_bytes), draft.resync_window)
                    stats.resyncs += 1
            if spec and not done:
                k = policy.next_k()
            round_index += 1
            stats.other_s += time.perf_counter() - t_round - res.forward_s - (block.forward_s if block else 0.0)
            if done:
                break
        stats.new_tokens = len(gen)
        stats.total_s = time.perf_counter() - t_start
        text = self.target.tokenizer.decode(gen, skip_special_tokens=True)
        return GenerationResult(text, gen, stats)
