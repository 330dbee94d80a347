"""The gateway's checks of a request's input (gateway.validation.check_input), which run before the
request takes an admission slot (Gateway.precheck): each names the field as the caller's API spells
it."""

from __future__ import annotations

import pytest

from crossdraft.errors import InvalidArgument
from gateway.config import GatewayConfig
from gateway.validation import check_input

CFG = GatewayConfig(verifier=None, redis_url="redis://unused", max_prompt_chars=50)


@pytest.mark.parametrize("prompt, messages, field, message", [
    (None, None, "prompt", "give exactly one of prompt or messages"),
    ("hi", [{"role": "user", "content": "hi"}], "prompt", "give exactly one"),
    (42, None, "prompt", "must be a string"),
    ("x" * 51, None, "prompt", "is longer than 50 characters"),
    ("a\ud800b", None, "prompt", "UTF-8"),
    ("", None, "prompt", "must not be empty"),
    (None, [{"role": "user", "content": "x" * 30}, {"role": "assistant", "content": "y" * 21}], "messages",
     "are longer than 50 characters"),
    (None, [{"role": "robot", "content": "hi"}], "messages", "role"),
    (None, "hi", "messages", ""),
])
def test_malformed_input_is_refused_naming_the_field(prompt, messages, field, message):
    with pytest.raises(InvalidArgument) as e:
        check_input(CFG, prompt, messages)
    assert e.value.field.startswith(field), e.value.field
    assert message in str(e.value)


def test_field_names_follow_the_callers_api():
    with pytest.raises(InvalidArgument) as e:
        check_input(CFG, "x" * 51, None, {"prompt": "input"})
    assert e.value.field == "input"


def test_well_formed_input_passes():
    assert check_input(CFG, "x" * 50, None) is None
    msgs = check_input(CFG, None, [{"role": "user", "content": "x" * 50}])
    assert msgs == [{"role": "user", "content": "x" * 50}]
    # a session's turn may continue without new text
    assert check_input(CFG, "", None, session=True) is None
