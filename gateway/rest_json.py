"""The REST responses' JSON: completions and chat completions in OpenAI's shapes (log-probabilities
included), n completions in one response, and a session as /v1/sessions shows it."""

from __future__ import annotations

from .metrics import add_stats
from .rest_input import NAMES


def _token_text(pair, tid: int) -> tuple[str, list[int]]:
    b = pair.target_text_bytes([tid])
    return b.decode("utf-8", errors="replace"), list(b)


def logprobs_json(pair, token_ids, lps, chat: bool, offset: int = 0):
    """OpenAI's logprobs object for these tokens (None when none were asked for)."""
    if lps is None:
        return None
    if chat:
        content = []
        for tid, (lp, ids, vals) in zip(token_ids, lps, strict=False):
            tok, raw = _token_text(pair, tid)
            tops = []
            for i, v in zip(ids, vals, strict=False):
                t, r = _token_text(pair, i)
                tops.append({"token": t, "logprob": v, "bytes": r})
            content.append({"token": tok, "logprob": lp, "bytes": raw, "top_logprobs": tops})
        return {"content": content}
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, (lp, ids, vals) in zip(token_ids, lps, strict=False):
        tok, _ = _token_text(pair, tid)
        tokens.append(tok)
        token_lps.append(lp)
        best: dict = {}
        for i, v in zip(ids, vals, strict=False):  # best first: ids with the same text keep the best
            best.setdefault(_token_text(pair, i)[0], v)
        tops.append(best)
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def session_json(s) -> dict:
    return {"session_id": s.session_id, "turns": s.turns, "target_tokens": len(s.target_ids),
            "drafter_tokens": len(s.drafter_ids), "options": {NAMES.get(k, k): v for k, v in s.options.items()},
            "stats": s.stats, "drafter_instance": s.drafter_instance, "verifier_instance": s.verifier_instance,
            "drafter_address": s.drafter_address, "verifier_address": s.verifier_address,
            "drafter_kind": s.drafter_kind,
            "created": s.created_unix_s, "updated": s.updated_unix_s, "messages": s.messages, "text": s.text}


def completion_json(done: dict, rid: str, created: int, model: str, chat: bool, pair=None) -> dict:
    """The whole (non-streamed) completion in the OpenAI response shape."""
    lps = logprobs_json(pair, done.get("token_ids", []), done.get("logprobs"), chat) if pair is not None else None
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": done["text"]},
                  "finish_reason": done["finish_reason"]}
        if lps is not None:
            choice["logprobs"] = lps
    else:
        choice = {"index": 0, "text": done["text"], "finish_reason": done["finish_reason"], "logprobs": lps}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": done["usage"], "speculative": done["stats"],
            "session_id": done["session_id"] or None}


def completions_json(dones: list[dict], rid: str, created: int, model: str, chat: bool, pair=None) -> dict:
    """n completions in one response: a choice each; usage counts the prompt once and every choice's
    tokens; ``speculative`` sums the stats of the runs that computed them."""
    out = completion_json(dones[0], rid, created, model, chat, pair)
    if len(dones) == 1:
        return out
    out["choices"] = [dict(completion_json(d, rid, created, model, chat, pair)["choices"][0], index=i)
                      for i, d in enumerate(dones)]
    completion = sum(d["usage"]["completion_tokens"] for d in dones)
    prompt = dones[0]["usage"]["prompt_tokens"]
    out["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    total: dict = {}
    for d in {id(d): d for d in dones}.values():  # greedy: one run sent n times counts once
        total = add_stats(total, d["stats"])
    out["speculative"] = dict(out["speculative"], **total)
    return out
