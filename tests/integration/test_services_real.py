"""The distributed stack on real catalog models: smollm2-135m drafting for qwen2.5-coder-0.5b
(different vocabularies), each in its own process, behind a gateway with Redis sessions.

Greedy output through REST and gRPC must be token-identical to the in-process engine and to
target-only decoding (fp32 target on both sides), for completions and for chat.
"""

from __future__ import annotations

import pytest
import requests

from crossdraft.client import Client
from crossdraft.engine import Engine

pytestmark = pytest.mark.real_models

TARGET, DRAFTER = "qwen2.5-coder-0.5b", "smollm2-135m"
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The three primary colors are",
           "请用中文回答：天空为什么是蓝色的？"]
N = 24  # as tests/integration/test_real_models.py: the target-only references are shared


@pytest.fixture(scope="module", autouse=True)
def static_costs():
    """Round statistics are compared with the in-process engine's: static costs make them
    comparable (measured costs may pick other block sizes -- the same tokens, other counts). The
    stack's processes run with static costs too (tests/integration/conftest.py)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("CROSSDRAFT_COST_PROFILE", "static")
    yield
    mp.undo()


@pytest.fixture(scope="module")
def engine(catalog_model):
    return Engine(catalog_model(TARGET), catalog_model(DRAFTER))


@pytest.fixture(scope="module")
def stack(qwen_stack):
    return qwen_stack.http, qwen_stack.grpc


def test_greedy_rest_and_grpc_equal_engine_and_target_only(stack, engine, target_only):
    http, grpc_addr = stack
    for prompt in PROMPTS:
        ref = target_only(engine, prompt, N)
        spec = engine.generate(prompt, max_new_tokens=N)
        assert spec.token_ids == ref.token_ids
        r = requests.post(http + "/v1/completions", json={"prompt": prompt, "max_tokens": N}, timeout=300)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == ref.text
        assert body["speculative"]["drafted"] == spec.stats.drafted > 0
        assert body["speculative"]["accepted"] == spec.stats.accepted
        if prompt == PROMPTS[-1]:  # gRPC once: the front ends share the decoding path (tests/e2e cover both)
            with Client(grpc_addr) as c:
                out = c.generate(prompt, max_new_tokens=N)
            assert out.token_ids == ref.token_ids


def test_chat_completion_equals_engine_chat(stack, engine):
    http, _ = stack
    msgs = [{"role": "user", "content": "Write a Python one-liner that reverses a string s."}]
    ref = engine.generate_chat(msgs, max_new_tokens=N, use_drafter=False)
    r = requests.post(http + "/v1/chat/completions", json={"messages": msgs, "max_tokens": N}, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
    assert body["speculative"]["mode"] == "speculative"


def test_multi_turn_chat_session_reuses_caches(stack, engine):
    _, grpc_addr = stack
    with Client(grpc_addr) as c:
        sid = c.create_session(max_new_tokens=16)
        first = c.generate(messages=[{"role": "user", "content": "Name a prime number."}], session_id=sid)
        second = c.generate(messages=[{"role": "user", "content": "And another one?"}], session_id=sid)
        info = c.get_session(sid)
    assert info["turns"] == 2 and len(info["messages"]) == 4
    assert info["messages"][1] == {"role": "assistant", "content": first.text}
    # the second turn's prompt re-renders the whole conversation; its prefix is still cached
    assert second.stats["reused_target_tokens"] > 20
    msgs = [{"role": "user", "content": "Name a prime number."}, {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And another one?"}]
    assert second.text == engine.generate_chat(msgs, max_new_tokens=16, use_drafter=False).text
