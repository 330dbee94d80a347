"""The round loop, shared by the in-process engine and the gateway.

:class:`Decoder` runs speculative decoding over two ports -- a verifier and (optionally) a
drafter -- that have the method signatures of :class:`crossdraft.workers.VerifierWorker` and
:class:`crossdraft.workers.DrafterWorker`. In process the ports ARE the workers; in the gateway
they are gRPC clients of the drafter and verifier services. Everything vocabulary-related lives
here, in :class:`TokenPair`: the model servers only ever see their own ids.

One round: (apply the pending drafter edit and) draft k tokens -> map them to target ids (and q
to target ids) -> verify in one target forward -> stream the new text -> record the drafter's
edit (accepted proposals + the target's token, or a byte-exact re-tokenised tail).
"""

from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field

import numpy as np

from . import vocab as V
from .engine import DraftConfig, DraftPolicy, GenerationResult, Stats, cost_ratio
from .errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from .sampling import SamplingParams
from .workers import Expect


def chat_ids(tok, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template (+ generation prompt)."""
    if not getattr(tok, "chat_template", None):
        raise InvalidArgument("messages", f"{getattr(tok, 'name_or_path', 'model')} has no chat template")
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


class TokenPair:
    """Both tokenizers and the mapping between them (drafter optional)."""

    def __init__(self, target_tok, drafter_tok=None, target_vocab: int = 0, drafter_vocab: int = 0, *, mapping=None,
                 vocab_cache_dir=None):
        self.target_tok = target_tok
        self.drafter_tok = drafter_tok
        self.vt = int(target_vocab or len(target_tok))
        self.t_bytes = [b if b is not None else b"" for b in V.token_bytes(target_tok)]
        self.mapping = None
        self.same_vocab = False
        if drafter_tok is None:
            return
        self.mapping = mapping or V.build_mapping(target_tok, drafter_tok, cache_dir=vocab_cache_dir)
        vt, vd = self.vt, int(drafter_vocab or len(drafter_tok))
        self.vd = vd
        d2t = np.full(vd, -1, dtype=np.int64)
        n = min(vd, len(self.mapping.d2t))
        d2t[:n] = self.mapping.d2t[:n]
        d2t[d2t >= vt] = -1
        t2d = np.full(vt, -1, dtype=np.int64)
        n = min(vt, len(self.mapping.t2d))
        t2d[:n] = self.mapping.t2d[:n]
        t2d[t2d >= vd] = -1
        self.d2t, self.t2d = d2t, t2d
        self.allowed = d2t >= 0  # [vd] bool: drafter ids in the intersection
        self.d_bytes = [b if b is not None else b"" for b in V.token_bytes(drafter_tok)]
        has_bytes = np.zeros(vd, dtype=bool)
        nb = min(vd, len(self.d_bytes))
        has_bytes[:nb] = [len(b) > 0 for b in self.d_bytes[:nb]]
        self.allowed_text = has_bytes  # text drafting may use every drafter token that stands for bytes
        src = np.nonzero(self.allowed)[0]
        self.same_vocab = vd == vt and bool(np.array_equal(d2t[src], src)) and int(has_bytes.sum()) == len(src)
        if not self.allowed.any():
            raise InvalidArgument("drafter", "shares no token with the target's vocabulary")
        base = f"{self.mapping.key}-{vt}-{vd}"
        self.keys = {"tli": f"{base}-tli", "text": f"{base}-text"}
        self.masks = {"tli": self.allowed, "text": self.allowed_text}

    # ---- text <-> ids ----------------------------------------------------------------------
    def encode_target(self, text: str) -> list[int]:
        return list(self.target_tok(text, add_special_tokens=True)["input_ids"])

    def encode_drafter(self, text: str) -> list[int]:
        return list(self.drafter_tok(text, add_special_tokens=True)["input_ids"])

    def chat_ids(self, messages: list[dict]) -> tuple[list[int], list[int] | None]:
        t = chat_ids(self.target_tok, messages)
        d = chat_ids(self.drafter_tok, messages) if self.drafter_tok is not None else None
        return t, d

    def target_text_bytes(self, ids) -> bytes:
        tb = self.t_bytes
        return b"".join(tb[t] for t in ids if 0 <= t < len(tb))

    # ---- drafter -> target ------------------------------------------------------------------
    def map_q(self, q_ids: np.ndarray, q_probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A drafter distribution (drafter ids, float32 probs) as target ids (ascending) + float64
        probs; drafter tokens standing for the same target token add up."""
        t = self.d2t[np.asarray(q_ids, dtype=np.int64)]
        p = np.asarray(q_probs, dtype=np.float64)
        order = np.argsort(t, kind="stable")
        t, p = t[order], p[order]
        if len(t) > 1 and (t[1:] == t[:-1]).any():
            uniq, inv = np.unique(t, return_inverse=True)
            acc = np.zeros(len(uniq), dtype=np.float64)
            np.add.at(acc, inv, p)
            t, p = uniq, acc
        return t, p


@dataclass
class RoundEvent:
    """What one round did; yielded by :meth:`Decoder.run` as soon as the round ends."""

    round_index: int
    requested: int  # block size asked of the drafter
    drafted: int  # drafts verified (target ids)
    accepted: int
    emitted: list[int]  # new target ids (after EOS / budget trimming)
    text: str  # new text (complete UTF-8 characters only)
    draft_s: float
    verify_s: float
    overhead_s: float
    done: bool
    target_ids: list[int] = field(repr=False, default_factory=list)  # the session's ids now (shared, do not mutate)
    drafter_ids: list[int] | None = field(repr=False, default=None)


class Run:
    """An iterator of RoundEvents; ``result`` is set once it is exhausted."""

    def __init__(self, gen):
        self._gen = gen
        self.result: GenerationResult | None = None
        self.target_ids: list[int] = []
        self.drafter_ids: list[int] | None = None
        self.next_round: int = 0

    def __iter__(self):
        return self

    def __next__(self) -> RoundEvent:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()


class Decoder:
    """Speculative decoding over a verifier port and an optional drafter port."""

    def __init__(self, pair: TokenPair, verifier, drafter=None, *, eos_ids=(), max_context: int = 0,
                 check_context: bool = True, drafter_timeout_s: float | None = None):
        self.pair = pair
        self.verifier = verifier
        self.drafter = drafter if pair.drafter_tok is not None else None
        self.eos = set(int(e) for e in eos_ids)
        self.max_context = max_context
        self.check = check_context
        self.drafter_timeout_s = drafter_timeout_s
        self._mask_sent: set[str] = set()
        self._ratio: dict[tuple, tuple] = {}

    # ---- port calls with re-sync --------------------------------------------------------------
    def _expect(self, ids) -> Expect | None:
        return Expect.of(ids) if self.check else None

    def _send_mask(self, mode: str) -> None:
        key = self.pair.keys[mode]
        if key not in self._mask_sent:
            self.drafter.set_allowed(key, self.pair.masks[mode])
            self._mask_sent.add(key)

    def _policy(self, mode: str, draft: DraftConfig, params: SamplingParams) -> tuple[DraftPolicy, float]:
        """The draft-length policy of one request, and the measured seconds of one target step
        (0.0 with static costs). See DraftPolicy for measured vs static costs."""
        measured = draft.cost_model == "measured" or (draft.cost_model == "auto" and params.greedy)
        key = (mode, measured)
        if key not in self._ratio:
            rows = int(self.pair.masks[mode].sum())
            dcost = self.drafter.cost(rows)
            inputs = (cost_ratio(dcost, self.verifier.cost()), None, 0.0)
            vt = self.verifier.timings() if measured else []
            dt = self.drafter.timings() if measured else []
            if vt and dt and vt[0] > 0:
                # the drafter's step: its measured 1-token forward, scaled to the pruned head's bytes
                body, row, all_rows = self.drafter.cost()
                frac = (body + row * rows) / max(1, body + row * all_rows)
                inputs = (dt[0] * frac / vt[0], list(vt), vt[0] / 1000.0)
            self._ratio[key] = inputs
        c, vt, step_s = self._ratio[key]
        return DraftPolicy(draft, c, verify_costs=vt, measured=vt is not None), step_s

    def _verify(self, sid, t_ids, drafts, q_rows, round_index, params, seed):
        try:
            return self.verifier.verify(sid, self._expect(t_ids), drafts, q_rows, round_index, params, seed)
        except (NotFound, FailedPrecondition):
            self.verifier.sync(sid, t_ids)  # the verifier lost or diverged from the session: rebuild
            return self.verifier.verify(sid, self._expect(t_ids), drafts, q_rows, round_index, params, seed)

    def _draft(self, sid, d, k, round_index, params, seed, stop_below, mode):
        """d: the drafter-side state dict. Returns a list of DraftTokens (raises Unavailable)."""
        key = self.pair.keys[mode]
        edit = (d["sent"], d["ids"][d["sent"]:]) if d["sent"] < len(d["ids"]) else None
        kw = dict(k=k, round_index=round_index, params=params, seed=seed, stop_below=stop_below, allowed_key=key)
        if self.drafter_timeout_s is not None:
            kw["timeout_s"] = self.drafter_timeout_s
        try:
            toks = self.drafter.draft(sid, edit, self._expect(d["ids"]), **kw)
        except (NotFound, FailedPrecondition):
            self._mask_sent.discard(key)
            self._send_mask(mode)
            self.drafter.sync(sid, d["ids"])
            toks = self.drafter.draft(sid, None, self._expect(d["ids"]), **kw)
        d["sent"] = len(d["ids"])
        return toks

    # ---- the loop -------------------------------------------------------------------------------
    def run(self, sid: str, target_ids: list[int], drafter_ids: list[int] | None, *, max_new_tokens: int,
            params: SamplingParams, seed: int, draft: DraftConfig, round_start: int = 0,
            use_drafter: bool = True, round_scope=None) -> Run:
        """Validate and return the round iterator (its first step syncs both servers).

        round_scope: optional callable round_index -> context manager yielding record(RoundEvent);
        each round's port calls run inside it (the gateway opens the round's trace span there).
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise InvalidArgument("max_new_tokens", f"must be an integer, got {type(max_new_tokens).__name__}")
        if max_new_tokens <= 0:
            raise InvalidArgument("max_new_tokens", f"must be > 0, got {max_new_tokens}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidArgument("seed", "must be an integer")
        if not 0 <= seed < 2**63:
            raise InvalidArgument("seed", "must be in [0, 2^63)")
        if not target_ids:
            raise InvalidArgument("prompt", "must not be empty")
        if self.max_context and len(target_ids) + max_new_tokens > self.max_context:
            raise InvalidArgument(
                "max_new_tokens",
                f"prompt ({len(target_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context ({self.max_context})")
        spec = use_drafter and self.drafter is not None and drafter_ids is not None
        if spec and draft.mode == "text" and not params.greedy:
            raise InvalidArgument("mode", "text drafting is lossless for greedy decoding only (temperature 0)")
        run = Run(None)
        run._gen = self._rounds(run, sid, list(target_ids), list(drafter_ids) if spec else None, max_new_tokens,
                                params, seed, draft, round_start, spec, round_scope)
        return run

    def _rounds(self, run, sid, t_ids, d_ids, max_new_tokens, params, seed, draft, round_start, spec, round_scope):
        pair = self.pair
        t_start = time.perf_counter()
        stats = Stats(prompt_tokens=len(t_ids))
        run.target_ids = t_ids
        reused, _ = self.verifier.sync(sid, t_ids)
        stats.reused_target_tokens = reused
        text_mode = False
        d = None
        if spec:
            stats.mode = "speculative"
            text_mode = params.greedy and not pair.same_vocab and draft.mode in ("auto", "text")
            stats.draft_mode = "text" if text_mode else "tli"
            mode = "text" if text_mode else "tli"
            try:
                self._send_mask(mode)
                reused_d, _ = self.drafter.sync(sid, d_ids)
                stats.reused_drafter_tokens = reused_d
                policy, step_s = self._policy(mode, draft, params)
                stats.cost_model = "measured" if policy.measured else "static"
            except Unavailable as e:
                spec = False
                stats.drafter_fallback, stats.fallback_reason = True, str(e)
            d = {"ids": d_ids, "sent": len(d_ids), "prompt_len": len(d_ids), "gen_lens": []}
            run.drafter_ids = d_ids
        if not spec:
            policy, step_s = DraftPolicy(draft, 1.0), 0.0
        gen: list[int] = []
        gen_bytes = bytearray()
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        k = draft.num_draft_tokens
        round_index = round_start
        first = True
        prev_drafted = False
        while True:
            cm = round_scope(round_index) if round_scope is not None else None
            record = cm.__enter__() if cm is not None else None
            try:
                remaining = max_new_tokens - len(gen)
                kk = min(k, remaining - 1) if spec else 0
                t_round = time.perf_counter()
                toks = []
                drafts_t: list[int] = []
                q_rows = None
                draft_s = 0.0
                if kk > 0:
                    t0 = time.perf_counter()
                    try:
                        toks = self._draft(sid, d, kk, round_index, params, seed, draft.stop_below, mode)
                    except Unavailable as e:
                        spec, toks = False, []
                        stats.drafter_fallback, stats.fallback_reason = True, str(e)
                    draft_s = sum(t.forward_s for t in toks) if toks else time.perf_counter() - t0
                    d_prop = [t.id for t in toks]
                    if text_mode:
                        drafted_bytes = b"".join(pair.d_bytes[x] for x in d_prop)
                        try:
                            drafts_t = V.encode_bytes(pair.target_tok, drafted_bytes)[: remaining - 1] if drafted_bytes else []
                        except ValueError:  # the target cannot spell these bytes: nothing to propose
                            drafts_t = []
                    else:
                        drafts_t = [int(pair.d2t[x]) for x in d_prop]
                        if not params.greedy:
                            q_rows = [pair.map_q(t.q_ids, t.q_probs) for t in toks]
                    stats.draft_s += draft_s
                else:
                    d_prop = []
                kd = len(drafts_t)
                draft_wall = time.perf_counter() - t_round
                t_verify = time.perf_counter()
                res = self._verify(sid, t_ids, drafts_t, q_rows, round_index, params, seed)
                verify_wall = time.perf_counter() - t_verify
                n = res.num_accepted
                emitted = list(drafts_t[:n]) + [res.next_token]
                if first:
                    stats.prefill_s += res.forward_s
                else:
                    stats.verify_s += res.forward_s
                    if spec:
                        policy.observe(kd, n)
                        # wall-clock corrections (measured costs only); a probe after skipped
                        # rounds also feeds the drafter what it missed, so its time says little
                        policy.observe_time(len(toks) if prev_drafted else 0, draft_wall, kd + 1, verify_wall, step_s)
                prev_drafted = len(toks) > 0
                first = False
                stats.record_round(kd, n)
                if spec and kd == 0 and remaining > 1:
                    stats.skipped_rounds += 1
                out = emitted
                for j, tok in enumerate(out):
                    if tok in self.eos:
                        out = out[: j + 1]
                        stats.finish_reason = "stop"
                        break
                gen.extend(out)
                t_ids.extend(out)
                new_bytes = pair.target_text_bytes(out)
                gen_bytes += new_bytes
                done = stats.finish_reason == "stop" or len(gen) >= max_new_tokens
                text = utf8.decode(new_bytes, final=done)
                if done and d is not None:
                    self._edit(d, d["prompt_len"], self._encode_drafter_bytes(bytes(gen_bytes)))
                if not done and spec:
                    if text_mode:
                        self._commit_text(d, d_prop, drafts_t[:n], res.next_token)
                    else:
                        self._commit_tli(d, d_prop[:n], res.next_token, bytes(gen_bytes), draft.resync_window, stats)
                    k = policy.next_k()
                overhead = time.perf_counter() - t_round - res.forward_s - draft_s
                stats.other_s += overhead
                ev = RoundEvent(round_index, kk, kd, n, out, text, draft_s, res.forward_s, overhead, done, t_ids,
                                d["ids"] if d else None)
            except BaseException as e:
                if cm is not None and cm.__exit__(type(e), e, e.__traceback__):
                    return
                raise
            if cm is not None:
                record(ev)
                cm.__exit__(None, None, None)
            round_index += 1
            run.next_round = round_index
            if d is not None:
                run.drafter_ids = d["ids"]
            if done:
                stats.new_tokens = len(gen)
                stats.total_s = time.perf_counter() - t_start
                run.result = GenerationResult(bytes(gen_bytes).decode("utf-8", errors="replace"), gen, stats)
            yield ev
            if done:
                return

    # ---- drafter bookkeeping (gateway side) ------------------------------------------------------
    def _edit(self, d, keep: int, append: list[int]) -> None:
        """The drafter's ids become ids[:keep] + append (sent with the next Draft)."""
        d["ids"][keep:] = list(append)
        d["sent"] = min(d["sent"], keep)

    def _commit_tli(self, d, accepted_d: list[int], nxt: int, gen_bytes: bytes, window: int, stats: Stats) -> None:
        pair = self.pair
        d_nxt = int(pair.t2d[nxt]) if 0 <= nxt < len(pair.t2d) else -1
        ids = d["ids"]
        if d_nxt >= 0:
            self._edit(d, len(ids), accepted_d + [d_nxt])
            d["gen_lens"].extend(len(pair.d_bytes[t]) for t in accepted_d + [d_nxt])
            return
        self._edit(d, len(ids), accepted_d)
        d["gen_lens"].extend(len(pair.d_bytes[t]) for t in accepted_d)
        self._resync(d, gen_bytes, window)
        stats.resyncs += 1

    def _resync(self, d, gen_bytes: bytes, window: int) -> None:
        """Re-tokenise the drafter's last `window` generated tokens plus the target's new text.

        The drafter's generated ids always spell exactly the target's generated bytes (accepted
        drafts and mapped target tokens have identical bytes; re-tokenised tails are encoded
        byte-exactly), so the kept prefix ends at a known byte offset.
        """
        pair = self.pair
        lens = d["gen_lens"]
        n_gen = len(d["ids"]) - d["prompt_len"]
        keep = max(0, n_gen - window)
        tail = gen_bytes[sum(lens[:keep]):]
        new_tail = self._encode_drafter_bytes(tail)
        self._edit(d, d["prompt_len"] + keep, new_tail)
        del lens[keep:]
        lens.extend(len(pair.d_bytes[t]) if t < len(pair.d_bytes) else 0 for t in new_tail)

    def _encode_drafter_bytes(self, data: bytes) -> list[int]:
        if not data:
            return []
        try:
            return V.encode_bytes(self.pair.drafter_tok, data)
        except ValueError:  # the drafter cannot spell these bytes: approximate (quality only)
            text = data.decode("utf-8", errors="ignore")
            return list(self.pair.drafter_tok(text, add_special_tokens=False)["input_ids"]) if text else []

    def _commit_text(self, d, proposals: list[int], accepted_t: list[int], next_t: int) -> None:
        """Text drafting: keep the drafter proposals lying wholly inside the accepted text, then
        append the rest of the new text (accepted drafts + the target's token) encoded byte-exactly."""
        pair = self.pair
        new_bytes = pair.target_text_bytes(accepted_t)
        agreed = len(new_bytes)
        new_bytes += pair.target_text_bytes([next_t])
        keep, off = 0, 0
        for x in proposals:
            ln = len(pair.d_bytes[x])
            if off + ln > agreed:
                break
            off += ln
            keep += 1
        tail = self._encode_drafter_bytes(new_bytes[off:])
        self._edit(d, len(d["ids"]), proposals[:keep] + tail)
        d["gen_lens"].extend(len(pair.d_bytes[t]) if t < len(pair.d_bytes) else 0 for t in proposals[:keep] + tail)
