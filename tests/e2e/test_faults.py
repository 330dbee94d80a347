"""Faults: a verifier restarted between requests, a drafter killed mid-stream, Redis down.

All real processes on 127.0.0.1, on a stack of this file's own (the package's shared `stack` is
never killed): a Redis server, a verifier, a drafter and a gateway. The tests that kill or
restart one of them restore it, and `restored` checks after every test that the stack serves
again. Tests that need a drafter started with a fault-injection knob (CROSSDRAFT_FAULT_DRAFT_DELAY_S,
read when the drafter starts) start that drafter with it, plus a gateway in front of it, on the
shared verifier and Redis.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from crossdraft.client import Client
from crossdraft.serving.redis_server import RedisServer
from tests.service_fixtures import Proc, gateway, model_server, stream_and_kill, wait_grpc_healthy, wait_http_ready

PROMPT = "def fibonacci(n):\n"
LOAD_DELAY = "CROSSDRAFT_FAULT_LOAD_DELAY_S"
# Liveness bound of the polling loops below, like the service helpers' waits: far beyond the
# seconds each one waits (at most a tiny model's load).
LIVENESS_S = 120.0


@dataclass
class FaultStack:
    redis: RedisServer
    verifier: Proc
    vaddr: str
    drafter: Proc
    daddr: str
    gw: Proc
    http: str
    grpc: str


@pytest.fixture(scope="module")
def faults(tiny_dirs, tmp_path_factory):
    t_dir, d_dir = tiny_dirs
    logs = tmp_path_factory.mktemp("fault-logs")
    redis = RedisServer().start()
    procs = []
    try:
        v, vaddr = model_server("verifier", str(t_dir), logs)
        procs.append(v)
        d, daddr = model_server("drafter", str(d_dir), logs)
        procs.append(d)
        wait_grpc_healthy(vaddr, v)
        wait_grpc_healthy(daddr, d)
        g, http, grpc_addr = gateway(vaddr, daddr, redis.url, logs, drafter_timeout_s=5)
        procs.append(g)
        wait_http_ready(http, g)
        yield FaultStack(redis, v, vaddr, d, daddr, g, http, grpc_addr)
    finally:
        for p in reversed(procs):
            p.stop()
        redis.stop()


def _until(pred, what: str):
    """Poll ``pred`` until it is true; LIVENESS_S only bounds a hang, it times nothing."""
    deadline = time.monotonic() + LIVENESS_S
    while not pred():
        assert time.monotonic() < deadline, f"{what}: not within {LIVENESS_S} s"
        time.sleep(0.1)


def _samples_until(sample, done, what: str) -> list:
    """Call ``sample`` until ``done`` holds for its answer; every answer, that one last."""
    seen = [sample()]
    _until(lambda: done(seen[-1]) or seen.append(sample()), what)
    return seen


@pytest.fixture(autouse=True)
def restored(faults):
    """After each test: the verifier runs without a fault knob, Redis runs, and the gateway is ready."""
    yield
    f = faults
    if f.verifier.env.pop(LOAD_DELAY, None) is not None or not f.verifier.alive():
        f.verifier.kill()
        f.verifier.start()
    wait_grpc_healthy(f.vaddr, f.verifier)
    if not f.redis.running:
        f.redis.start()
    _until(lambda: requests.get(f.http + "/readyz", timeout=10).status_code == 200, "the gateway ready again")


@pytest.fixture()
def slow_drafter(faults, tiny_dirs, tmp_path):
    """start(delay_s, drafter_timeout_s): a drafter that sleeps delay_s after each proposed token,
    and a gateway in front of it on the shared verifier and Redis; its (drafter, http) pair."""
    procs = []

    def start(delay_s: float, drafter_timeout_s: float):
        d, daddr = model_server("drafter", str(tiny_dirs[1]), tmp_path,
                                env={"CROSSDRAFT_FAULT_DRAFT_DELAY_S": str(delay_s)})
        procs.append(d)
        wait_grpc_healthy(daddr, d)
        g, http, _ = gateway(faults.vaddr, daddr, faults.redis.url, tmp_path, drafter_timeout_s=drafter_timeout_s)
        procs.append(g)
        wait_http_ready(http, g)
        return d, http

    yield start
    for p in reversed(procs):
        p.stop()


def test_verifier_killed_and_restarted_between_requests_of_a_session(faults):
    v, vaddr = faults.verifier, faults.vaddr
    with Client(faults.grpc) as c:
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


def test_drafter_killed_mid_stream_completes_target_only_with_identical_output(slow_drafter, engine):
    ref = engine.generate(PROMPT, max_new_tokens=60, use_drafter=False)
    # 50 ms per proposed token: the stream is still drafting when the kill lands
    d, http = slow_drafter(0.05, drafter_timeout_s=5)
    # killed mid-stream: once the first text has arrived, in a chunk that more rounds follow
    text, final, killed = stream_and_kill(http, {"prompt": PROMPT, "max_tokens": 60, "adaptive_draft": False,
                                                 "num_draft_tokens": 4}, d, 0)
    assert killed and final is not None
    assert text == ref.text
    s = final["speculative"]
    assert s["drafter_fallback"] is True and "drafter" in s["fallback_reason"]
    assert final["usage"]["completion_tokens"] == len(ref.token_ids)
    # later requests keep working (target-only) while the drafter is down
    r2 = requests.post(http + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 20}, timeout=60).json()
    assert r2["choices"][0]["text"] == engine.generate(PROMPT, max_new_tokens=20, use_drafter=False).text
    assert r2["speculative"]["drafter_fallback"] is True


def test_slow_drafter_past_its_deadline_falls_back(slow_drafter, engine):
    ref = engine.generate(PROMPT, max_new_tokens=12, use_drafter=False)
    _, http = slow_drafter(2, drafter_timeout_s=0.5)  # one proposed token takes 4x the deadline
    r = requests.post(http + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 12}, timeout=120).json()
    assert r["choices"][0]["text"] == ref.text
    assert r["speculative"]["drafter_fallback"] is True
    assert "DEADLINE_EXCEEDED" in r["speculative"]["fallback_reason"]


def test_redis_down_gives_503_and_the_gateway_recovers(faults):
    redis, g, http = faults.redis, faults.gw, faults.http
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
    with Client(faults.grpc) as c:
        with pytest.raises(grpc.RpcError) as ei:
            c.create_session()
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in ei.value.details()
    assert g.alive()
    redis.start()  # same port, empty (no persistence)
    _until(lambda: requests.get(http + "/readyz", timeout=10).status_code == 200, "ready once Redis is back")
    sid2 = requests.post(http + "/v1/sessions", json={"max_tokens": 8}, timeout=30).json()["session_id"]
    r = requests.post(http + "/v1/completions", json={"prompt": PROMPT, "session_id": sid2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    # the old session lived only in the Redis that went away: a clear 404, not a crash
    r = requests.post(http + "/v1/completions", json={"prompt": "x", "session_id": sid}, timeout=60)
    assert r.status_code == 404


def _health(addr: str) -> str:
    """A server's gRPC health status by name; DOWN when nothing answers."""
    try:
        with grpc.insecure_channel(addr) as ch:
            st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
    except grpc.RpcError:
        return "DOWN"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(st)


def test_readyz_waits_for_a_restarted_verifier_to_load_its_model(faults):
    """Readiness tells the truth: while the verifier is down, and while a restarted one is still
    loading its model (port open, gRPC health NOT_SERVING), /readyz and the gateway's own gRPC
    health say not ready; once the verifier serves, both say ready and requests work.

    Each answer of /readyz is followed by a query of the verifier's own health: a verifier not
    serving after /readyz answered was not serving when it answered (a loading verifier only ever
    goes on to SERVING), so that answer must be a 503."""
    f = faults
    v, vaddr, http = f.verifier, f.vaddr, f.http

    def sample():
        r = requests.get(http + "/readyz", timeout=10)
        return r.status_code, r.json().get("verifiers", {}).get(vaddr), _health(vaddr)

    r = requests.get(http + "/readyz", timeout=10)
    assert r.status_code == 200 and set(r.json()["verifiers"].values()) == {"SERVING"}
    v.stop()
    # /readyz takes the verifiers' states from a check at most 2 s old: the answers after the stop turn to 503
    r = _samples_until(lambda: requests.get(http + "/readyz", timeout=10), lambda r: r.status_code != 200,
                       "readyz sees the verifier gone")[-1]
    assert r.status_code == 503 and "verifier" in r.json()["reason"]

    # a restart whose model load does not finish while the test watches: the gateway sees the open
    # port's NOT_SERVING, and every answer until then and after is a 503
    v.env[LOAD_DELAY] = "3600"
    v.start()
    seen = _samples_until(sample, lambda s: s[:2] == (503, "NOT_SERVING"), "readyz reports NOT_SERVING")
    seen += [sample() for _ in range(5)]
    assert all(code == 503 for code, _, _ in seen), seen
    assert seen[-5:] == [(503, "NOT_SERVING", "NOT_SERVING")] * 5, seen
    _until(lambda: _health(f.grpc) == "NOT_SERVING", "the gateway's gRPC health follows /readyz")

    # a restart that loads: not ready until the verifier serves, then ready
    v.kill()
    del v.env[LOAD_DELAY]
    v.start()
    seen = _samples_until(sample, lambda s: s[0] == 200, "readyz ready again")
    assert all(code == 503 for code, _, health in seen if health != "SERVING"), seen
    assert seen[-1][1] == "SERVING", seen
    r = requests.post(http + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    _until(lambda: _health(f.grpc) == "SERVING", "the gateway's gRPC health back to SERVING")
