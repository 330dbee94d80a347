"""A REST request's body: read as one JSON object, OpenAI's field names turned into the gateway's
options, the fields accepted only for compatibility held to their neutral values, and the
error names mapped back to the fields the caller sent."""

from __future__ import annotations

import json

from starlette.requests import Request

from crossdraft.errors import InvalidArgument, check_int

MAX_BODY_BYTES = 4 << 20
# REST field -> gateway option
REST_OPTIONS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "temperature": "temperature",
                "top_k": "top_k", "top_p": "top_p", "repetition_penalty": "repetition_penalty", "seed": "seed",
                "num_draft_tokens": "num_draft_tokens", "adaptive_draft": "adaptive_draft",
                "use_drafter": "use_drafter"}
MAX_N = 16  # completions per request (`n`)
# accepted for compatibility; only their neutral values are allowed
NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
           "best_of": (1,), "user": None, "model": None,
           "suffix": (None, "")}
# gateway option -> REST field, to name the caller's field in errors and in a session's options
NAMES = {v: k for k, v in REST_OPTIONS.items() if k != "max_completion_tokens"}


async def json_body(request: Request) -> dict:
    """The body as a JSON object (InvalidArgument naming `body` when it is not one)."""
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise InvalidArgument("body", f"is longer than {MAX_BODY_BYTES} bytes")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgument("body", f"is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument("body", f"is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:  # e.g. "[[[[..." 100k deep: json.loads overflows the stack
        raise InvalidArgument("body", "is nested too deeply") from None
    if not isinstance(data, dict):
        raise InvalidArgument("body", "must be a JSON object")
    return data


def take_option(opts: dict, name: str, value) -> None:
    """Record REST field `name` as its gateway option (max_tokens and max_completion_tokens are one)."""
    if REST_OPTIONS[name] in opts:
        raise InvalidArgument(name, "give only one of max_tokens or max_completion_tokens")
    opts[REST_OPTIONS[name]] = value


def split_body(data: dict, input_field: str) -> tuple[dict, dict]:
    """A completion request's body -> (gateway options, other fields: input, stream, session_id)."""
    opts, extra = {}, {}
    for k, v in data.items():
        if k in REST_OPTIONS:
            take_option(opts, k, v)
        elif k in (input_field, "stream", "session_id", "stop", "stream_options", "echo", "logprobs", "top_logprobs",
                   "n"):
            extra[k] = v
        elif k in NEUTRAL:
            allowed = NEUTRAL[k]
            if allowed is not None and v not in allowed:
                raise InvalidArgument(k, f"is not supported (only {allowed[0]!r})")
        else:
            raise InvalidArgument(k, "unknown field")
    if "stream" in extra and not isinstance(extra["stream"], bool):
        raise InvalidArgument("stream", "must be a boolean")
    sid = extra.get("session_id")
    if sid is not None and not isinstance(sid, str):
        raise InvalidArgument("session_id", "must be a string")
    extra["top"] = _top_logprobs(extra, chat=input_field == "messages")
    extra["n"] = check_int("n", extra.get("n", 1), 1, MAX_N)
    if extra["n"] > 1 and sid is not None:
        raise InvalidArgument("n", "must be 1 for a request on a session (one history, one continuation)")
    if "echo" in extra:
        if not isinstance(extra["echo"], bool):
            raise InvalidArgument("echo", "must be a boolean")
        if extra["echo"] and input_field == "messages":
            raise InvalidArgument("echo", "is for /v1/completions only")
    so = extra.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidArgument("stream_options", "must be an object")
        for k, v in so.items():
            if k != "include_usage":
                raise InvalidArgument(f"stream_options.{k}", "unknown field")
            if not isinstance(v, bool):
                raise InvalidArgument("stream_options.include_usage", "must be a boolean")
        if not extra.get("stream"):
            raise InvalidArgument("stream_options", "is only allowed with stream: true")
    return opts, extra


def _top_logprobs(extra: dict, chat: bool) -> int:
    """-1 (no log-probabilities) or how many alternatives per token: completions take
    ``logprobs: N`` (0-20), chat ``logprobs: true`` with ``top_logprobs: N``."""
    lp, top = extra.get("logprobs"), extra.get("top_logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise InvalidArgument("logprobs", "must be a boolean (chat); use top_logprobs for how many alternatives")
        if top is not None:
            if not lp:
                raise InvalidArgument("top_logprobs", "needs logprobs: true")
            return check_int("top_logprobs", top, 0, 20)
        return 0 if lp else -1
    if top is not None:
        raise InvalidArgument("top_logprobs", "is for chat; completions take logprobs: N")
    if lp is None or lp is False:
        return -1
    return check_int("logprobs", lp, 0, 20)



def option_names(data: dict) -> dict:
    """Option -> REST field names for errors, naming max_completion_tokens when that is what was sent."""
    return dict(NAMES, max_new_tokens="max_completion_tokens") if "max_completion_tokens" in data else NAMES
