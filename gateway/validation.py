"""A request's checks that need no model server: generation options, prompts and chat messages.
Both front ends run them, so that REST and gRPC refuse the same input with the same field named."""

from __future__ import annotations

from typing import TYPE_CHECKING

from crossdraft.decoding.sampling import SamplingParams
from crossdraft.errors import InvalidArgument, check_int, check_number

if TYPE_CHECKING:
    from .config import GatewayConfig


OPTION_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed",
                 "num_draft_tokens", "adaptive_draft", "use_drafter")


def _bool(name, v):
    if not isinstance(v, bool):
        raise InvalidArgument(name, f"must be a boolean, got {type(v).__name__}")
    return v


def validate_options(opts: dict, cfg: GatewayConfig, names: dict | None = None) -> dict:
    """Check generation options (None = unset); `names` maps option names to the caller's field names."""
    names = names or {}
    out = {}
    for key, v in opts.items():
        if v is None:
            continue
        name = names.get(key, key)
        if key not in OPTION_FIELDS:
            raise InvalidArgument(name, "unknown option")
        if key == "max_new_tokens":
            out[key] = check_int(name, v, 1, cfg.max_new_tokens_limit)
        elif key in ("temperature", "top_p", "repetition_penalty"):
            out[key] = check_number(name, v)
        elif key == "top_k":
            out[key] = check_int(name, v, 0, 2**31 - 1)  # int32 on the wire to the verifier/drafter
        elif key == "seed":
            out[key] = check_int(name, v, 0, 2**63 - 1)
        elif key == "num_draft_tokens":
            out[key] = check_int(name, v, 1, 64)
        else:
            out[key] = _bool(name, v)
    sp = {k: out[k] for k in ("temperature", "top_k", "top_p", "repetition_penalty") if k in out}
    try:
        SamplingParams(**sp)
    except InvalidArgument as e:
        raise InvalidArgument(names.get(e.field, e.field), str(e).split(": ", 1)[-1]) from None
    return out


def check_utf8(name: str, text: str) -> None:
    """JSON can carry lone surrogates ("\\ud800"); they have no UTF-8 form (tokenisers and gRPC need one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(name, f"is not valid UTF-8 (unpaired surrogate at character {e.start})") from None


def validate_messages(messages, field: str = "messages") -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument(field, "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidArgument(f"{field}[{i}]", "must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant"):
            raise InvalidArgument(f"{field}[{i}].role", f"must be system, user or assistant, got {role!r}")
        if not isinstance(content, str):
            raise InvalidArgument(f"{field}[{i}].content", "must be a string")
        check_utf8(f"{field}[{i}].content", content)
        out.append({"role": role, "content": content})
    return out


def check_input(cfg: GatewayConfig, prompt, messages, names: dict | None = None, *, session: bool = False):
    """A request's input: exactly one of a prompt (a string of at most ``cfg.max_prompt_chars``
    characters, valid UTF-8, not empty unless it continues a session) or messages (at most as long
    together). Returns the messages validated (None for a prompt). Field names as the caller's API
    spells them (``names``)."""
    names = names or {}
    pname, mname = names.get("prompt", "prompt"), names.get("messages", "messages")
    if (prompt is None) == (messages is None):
        raise InvalidArgument(pname, "give exactly one of prompt or messages")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InvalidArgument(pname, "must be a string")
        if len(prompt) > cfg.max_prompt_chars:
            raise InvalidArgument(pname, f"is longer than {cfg.max_prompt_chars} characters")
        check_utf8(pname, prompt)
        if not prompt and not session:
            raise InvalidArgument(pname, "must not be empty")
        return None
    messages = validate_messages(messages, mname)
    if sum(len(m["content"]) for m in messages) > cfg.max_prompt_chars:
        raise InvalidArgument(mname, f"are longer than {cfg.max_prompt_chars} characters")
    return messages
