"""Faults: a verifier restarted between requests, a drafter killed mid-stream, Redis down.

All real processes on 127.0.0.1. The drafter of the mid-stream test is slowed down with the
CROSSDRAFT_FAULT_DRAFT_DELAY_S fault-injection knob so the kill lands inside the request.
"""

from __future__ import annotations

import json
import time

import pytest
import requests

from crossdraft.client import Client
from crossdraft.redis_server import RedisServer
from tests.service_fixtures import Proc, gateway, model_server, wait_grpc_healthy, wait_http_ready

PROMPT = "def fibonacci(n):\n"


@pytest.fixture()
def logs(tmp_path):
    return tmp_path


def _stack(tiny_dirs, logs, drafter_env=None, drafter_timeout_s=5):
    t_dir, d_dir = tiny_dirs
    redis = RedisServer().start()
    v, vaddr = model_server("verifier", str(t_dir), logs)
    d, daddr = model_server("drafter", str(d_dir), logs)
    if drafter_env:
        d.stop()
        d.env.update(drafter_env)
        d.start()
    wait_grpc_healthy(vaddr, v)
    wait_grpc_healthy(daddr, d)
    g, http, grpc_addr = gateway(vaddr, daddr, redis.url, logs, drafter_timeout_s=drafter_timeout_s)
    wait_http_ready(http, g)
    return redis, v, vaddr, d, daddr, g, http, grpc_addr


def _stop(*procs):
    for p in procs:
        if isinstance(p, Proc):
            p.stop()
        elif isinstance(p, RedisServer):
            p.stop()


def test_verifier_killed_and_restarted_between_requests_of_a_session(tiny_dirs, logs):
    redis, v, vaddr, d, daddr, g, http, grpc_addr = _stack(tiny_dirs, logs)
    try:
        with Client(grpc_addr) as c:
            # reference: the same two turns without a fault
            ref = c.create_session(temperature=0.9, seed=3, max_new_tokens=20)
            c.generate(PROMPT, session_id=ref)
            ref2 = c.generate("    # then\n", session_id=ref)
            sid = c.create_session(temperature=0.9, seed=3, max_new_tokens=20)
            c.generate(PROMPT, session_id=sid)
            v.kill()  # SIGKILL: the verifier's KV caches are gone
            v.start()  # same port
            wait_grpc_healthy(vaddr, v)
            out = c.generate("    # then\n", session_id=sid)
        assert out.token_ids == ref2.token_ids and len(out.token_ids) > 0
        assert out.stats["reused_target_tokens"] == 0  # the new verifier rebuilt the session from the history
        assert ref2.stats["reused_target_tokens"] > 0
        assert not out.stats["drafter_fallback"]
    finally:
        _stop(g, d, v, redis)


def test_drafter_killed_mid_stream_completes_target_only_with_identical_output(tiny_dirs, logs, engine):
    ref = engine.generate(PROMPT, max_new_tokens=60, use_drafter=False)
    redis, v, vaddr, d, daddr, g, http, grpc_addr = _stack(
        tiny_dirs, logs, drafter_env={"CROSSDRAFT_FAULT_DRAFT_DELAY_S": "0.05"})
    try:
        r = requests.post(http + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 60, "stream": True,
                                                          "adaptive_draft": False, "num_draft_tokens": 4},
                          stream=True, timeout=120)
        assert r.status_code == 200
        pieces, final, killed = [], None, False
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            ch = obj["choices"][0]
            pieces.append(ch["text"])
            if not killed:
                d.kill()  # mid-stream: the first text has arrived, more rounds follow
                killed = True
            if ch["finish_reason"]:
                final = obj
        assert killed and final is not None
        assert "".join(pieces) == ref.text
        s = final["speculative"]
        assert s["drafter_fallback"] is True and "drafter" in s["fallback_reason"]
        assert final["usage"]["completion_tokens"] == len(ref.token_ids)
        # later requests keep working (target-only) while the drafter is down
        r2 = requests.post(http + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 20}, timeout=60).json()
        assert r2["choices"][0]["text"] == engine.generate(PROMPT, max_new_tokens=20, use_drafter=False).text
        assert r2["speculative"]["drafter_fallback"] is True
    finally:
        _stop(g, d, v, redis)


def test_slow_drafter_past_its_deadline_falls_back(tiny_dirs, logs, engine):
    ref = engine.generate(PROMPT, max_new_tokens=12, use_drafter=False)
    redis, v, vaddr, d, daddr, g, http, grpc_addr = _stack(
        tiny_dirs, logs, drafter_env={"CROSSDRAFT_FAULT_DRAFT_DELAY_S": "2"}, drafter_timeout_s=0.5)
    try:
        r = requests.post(http + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 12}, timeout=120).json()
        assert r["choices"][0]["text"] == ref.text
        assert r["speculative"]["drafter_fallback"] is True
        assert "DEADLINE_EXCEEDED" in r["speculative"]["fallback_reason"]
    finally:
        _stop(g, d, v, redis)


def test_redis_down_gives_503_and_the_gateway_recovers(tiny_dirs, logs):
    redis, v, vaddr, d, daddr, g, http, grpc_addr = _stack(tiny_dirs, logs)
    try:
        sid = requests.post(http + "/v1/sessions", json={"max_tokens": 8}, timeout=30).json()["session_id"]
        r = requests.post(http + "/v1/completions", json={"prompt": PROMPT, "session_id": sid}, timeout=60)
        assert r.status_code == 200
        redis.stop()
        r = requests.post(http + "/v1/completions", json={"prompt": "x", "session_id": sid}, timeout=60)
        assert r.status_code == 503
        assert "Redis" in r.json()["error"]["message"]
        r = requests.post(http + "/v1/sessions", json={}, timeout=30)
        assert r.status_code == 503 and "Redis" in r.json()["error"]["message"]
        assert requests.get(http + "/readyz", timeout=10).status_code == 503
        with Client(grpc_addr) as c:
            import grpc

            with pytest.raises(grpc.RpcError) as ei:
                c.create_session()
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in ei.value.details()
        assert g.alive()
        redis.start()  # same port, empty (no persistence)
        t0 = time.time()
        while requests.get(http + "/readyz", timeout=10).status_code != 200 and time.time() - t0 < 20:
            time.sleep(0.2)
        sid2 = requests.post(http + "/v1/sessions", json={"max_tokens": 8}, timeout=30).json()["session_id"]
        r = requests.post(http + "/v1/completions", json={"prompt": PROMPT, "session_id": sid2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        # the old session lived only in the Redis that went away: a clear 404, not a crash
        r = requests.post(http + "/v1/completions", json={"prompt": "x", "session_id": sid}, timeout=60)
        assert r.status_code == 404
    finally:
        _stop(g, d, v, redis)


def test_readyz_waits_for_a_restarted_verifier_to_load_its_model(tiny_dirs, logs):
    """Readiness tells the truth: while the verifier is down, and while a restarted one is still
    loading its model (port open, gRPC health NOT_SERVING), /readyz and the gateway's own gRPC
    health say not ready; once the verifier serves, both say ready and requests work."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    redis, v, vaddr, d, daddr, g, http, grpc_addr = _stack(tiny_dirs, logs)

    def gw_health():
        import grpc

        with grpc.insecure_channel(grpc_addr) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status

    try:
        r = requests.get(http + "/readyz", timeout=10)
        assert r.status_code == 200 and set(r.json()["verifiers"].values()) == {"SERVING"}
        v.stop()
        r = requests.get(http + "/readyz", timeout=10)
        assert r.status_code == 503 and "verifier" in r.json()["reason"]
        v.env["CROSSDRAFT_FAULT_LOAD_DELAY_S"] = "6"
        v.start()
        # the port opens at once; the model takes 6 s more
        t0 = time.time()
        states = []
        while time.time() - t0 < 4:
            r = requests.get(http + "/readyz", timeout=10)
            states.append((r.status_code, r.json().get("verifiers", {}).get(vaddr)))
            time.sleep(0.2)
        assert (503, "NOT_SERVING") in states, states
        assert all(code == 503 for code, _ in states), states
        time.sleep(1.5)  # the gateway's own health follows /readyz within about a second
        assert gw_health() == health_pb2.HealthCheckResponse.NOT_SERVING
        wait_grpc_healthy(vaddr, v)
        deadline = time.time() + 30
        while requests.get(http + "/readyz", timeout=10).status_code != 200:
            assert time.time() < deadline, "never ready again"
            time.sleep(0.2)
        r = requests.post(http + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        deadline = time.time() + 10
        while gw_health() != health_pb2.HealthCheckResponse.SERVING:
            assert time.time() < deadline, "the gateway's gRPC health never came back"
            time.sleep(0.2)
    finally:
        _stop(g, d, v, redis)
