"""The distributed stack on real catalog models: smollm2-135m drafting for qwen2.5-coder-0.5b
(different vocabularies), each in its own process, behind a gateway with Redis sessions.

Greedy output through REST and gRPC must be token-identical to the in-process engine and to
target-only decoding (fp32 target on both sides), for completions and for chat.
"""

from __future__ import annotations

import pytest
import requests
import torch

from crossdraft import models as M
from crossdraft.client import Client
from crossdraft.engine import Engine
from crossdraft.redis_server import RedisServer
from tests.service_fixtures import gateway, model_server, wait_grpc_healthy, wait_http_ready

pytestmark = pytest.mark.real_models

TARGET, DRAFTER = "qwen2.5-coder-0.5b", "smollm2-135m"
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The three primary colors are",
           "请用中文回答：天空为什么是蓝色的？"]
N = 24


@pytest.fixture(scope="module", autouse=True)
def static_costs():
    """Round statistics are compared with the in-process engine's: static costs make them
    comparable (measured costs may pick other block sizes -- the same tokens, other counts)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("CROSSDRAFT_COST_PROFILE", "static")
    yield
    mp.undo()


@pytest.fixture(scope="module")
def engine():
    return Engine(M.load_model(TARGET, dtype=torch.float32), M.load_model(DRAFTER, dtype=torch.float32))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("real-stack")
    redis = RedisServer().start()
    procs = []
    try:
        v, vaddr = model_server("verifier", TARGET, logs, dtype="float32")
        procs.append(v)
        # float drafter weights, as the in-process engine's: round counts are compared (an fp32 drafter
        # server may otherwise choose int8 copies at load, crossdraft.quant.choose_fp32)
        d, daddr = model_server("drafter", DRAFTER, logs, dtype="float32", extra=["--quantize", "none"])
        procs.append(d)
        wait_grpc_healthy(vaddr, v, timeout=300)
        wait_grpc_healthy(daddr, d, timeout=300)
        g, http, grpc_addr = gateway(vaddr, daddr, redis.url, logs, drafter_timeout_s=30)
        procs.append(g)
        wait_http_ready(http, g, timeout=300)
        yield http, grpc_addr
    finally:
        for p in reversed(procs):
            p.stop()
        redis.stop()


def test_greedy_rest_and_grpc_equal_engine_and_target_only(stack, engine):
    http, grpc_addr = stack
    for prompt in PROMPTS:
        ref = engine.generate(prompt, max_new_tokens=N, use_drafter=False)
        spec = engine.generate(prompt, max_new_tokens=N)
        assert spec.token_ids == ref.token_ids
        r = requests.post(http + "/v1/completions", json={"prompt": prompt, "max_tokens": N}, timeout=300)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == ref.text
        assert body["speculative"]["drafted"] == spec.stats.drafted > 0
        assert body["speculative"]["accepted"] == spec.stats.accepted
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
