"""Sessions stay on the verifier pod that holds their cache, and move when it leaves the pool.

Two real verifier processes and a drafter; the gateway core runs in this process with its pools
fed by EndpointSlice objects (the kubernetes client's models) through the watch code path, as a
Kubernetes API server would (none runs here).
"""

from __future__ import annotations

import pytest
from kubernetes import client

from crossdraft.serving.redis_server import RedisServer
from gateway.discovery import EndpointSliceWatcher, Pool
from tests.service_fixtures import model_server, wait_grpc_healthy


def endpoint_slice(name: str, addrs: list[str], rv: str) -> client.V1EndpointSlice:
    eps = []
    for a in addrs:
        host, port = a.rsplit(":", 1)
        eps.append(client.V1Endpoint(addresses=[host],
                                     conditions=client.V1EndpointConditions(ready=True, terminating=False)))
    port = int(addrs[0].rsplit(":", 1)[1]) if addrs else 1
    return client.V1EndpointSlice(address_type="IPv4", metadata=client.V1ObjectMeta(name=name, resource_version=rv),
                                  endpoints=eps, ports=[client.DiscoveryV1EndpointPort(name="grpc", port=port)])


def watched_gateway(redis, verifiers: list[str], drafter: str):
    """A gateway core whose pools follow EndpointSlice events (one slice per verifier pod, v-1, v-2,
    ...; the drafter in d-1) as a Kubernetes API server would send them; (gateway, verifier watcher,
    verifier pool)."""
    from gateway.config import GatewayConfig
    from gateway.server import build_gateway

    vpool, dpool = Pool("verifier"), Pool("drafter")
    vw = EndpointSliceWatcher(vpool, "llm", "crossdraft-verifier", api=object())
    dw = EndpointSliceWatcher(dpool, "llm", "crossdraft-drafter", api=object())
    for i, a in enumerate(verifiers):
        vw.apply("ADDED", endpoint_slice(f"v-{i + 1}", [a], str(i + 1)))
    dw.apply("ADDED", endpoint_slice("d-1", [drafter], str(len(verifiers) + 1)))
    cfg = GatewayConfig(verifier=None, redis_url=redis.url, discovery="kubernetes",
                        verifier_service="crossdraft-verifier", drafter_service="crossdraft-drafter",
                        connect_timeout_s=60)
    return build_gateway(cfg, pools=(vpool, dpool)), vw, vpool


@pytest.fixture(scope="module")
def pods(tiny_dirs, tmp_path_factory):
    t_dir, d_dir = tiny_dirs
    logs = tmp_path_factory.mktemp("placement")
    redis = RedisServer().start()
    procs = []
    try:
        v1, a1 = model_server("verifier", str(t_dir), logs)
        v2, a2 = model_server("verifier", str(t_dir), logs)
        d, da = model_server("drafter", str(d_dir), logs)
        procs = [v1, v2, d]
        for p, a in ((v1, a1), (v2, a2), (d, da)):
            wait_grpc_healthy(a, p)
        yield redis, [a1, a2], da
    finally:
        for p in procs:
            p.stop()
        redis.stop()


def test_session_follows_its_pod_then_moves_when_it_is_gone(pods):
    redis, (a1, a2), da = pods
    # each pod in its own slice (one can go away alone); all on 127.0.0.1, distinct ports
    gw, vw, vpool = watched_gateway(redis, [a1, a2], da)
    assert vpool.addresses() == sorted([a1, a2])

    def turn(sid, prompt):
        job = gw.start(session_id=sid, prompt=prompt, messages=None, options={})
        return list(job.events())[-1]

    def new_session():
        return gw.create_session({"max_new_tokens": 12, "temperature": 0.9, "seed": 4}).session_id

    ref = new_session()
    turn(ref, "def add(a, b):")
    ref2 = turn(ref, "\n# again\n")
    sid = new_session()
    turn(sid, "def add(a, b):")
    home = gw.get_session(sid).verifier_address
    assert home in (a1, a2)
    other = a2 if home == a1 else a1
    # the next turn stays on its pod while it is ready
    sid_b = new_session()
    turn(sid_b, "def add(a, b):")
    b_home = gw.get_session(sid_b).verifier_address
    for _ in range(2):
        turn(sid_b, " ")
        assert gw.get_session(sid_b).verifier_address == b_home
    # the session's pod leaves (its slice is deleted): the session moves, its cache is rebuilt
    vw.apply("DELETED", endpoint_slice("v-1" if home == a1 else "v-2", [], "9"))
    assert vpool.addresses() == [other]
    out = turn(sid, "\n# again\n")
    assert gw.get_session(sid).verifier_address == other
    assert out["stats"]["reused_target_tokens"] == 0
    assert out["text"] == ref2["text"]  # same continuation (same seed and history)


def test_connections_to_pods_that_left_are_closed_once_unused(pods):
    """Every rollout gives pods new addresses: the gateway closes its channel to a pod that left
    (after a grace period, never under a call in flight) and drops the decoders paired with it."""
    redis, (a1, a2), da = pods
    gw, vw, _ = watched_gateway(redis, [a1], da)
    gw.placement.gone_grace_s = 0.0
    sid = gw.create_session({"max_new_tokens": 6, "seed": 1}).session_id
    list(gw.start(session_id=sid, prompt="def add(a, b):", messages=None, options={}).events())
    assert gw.get_session(sid).verifier_address == a1
    old = gw.placement.clients[("verifier", a1)]
    assert (a1, da, "drafter") in gw._decoders
    # a request is placed on a1, then a1's pod leaves (a rollout) and a2 comes in
    job = gw.start(session_id=None, prompt="def sub(a, b):", messages=None, options={"max_new_tokens": 6})
    assert job.v_addr == a1
    vw.apply("DELETED", endpoint_slice("v-1", [], "3"))
    vw.apply("ADDED", endpoint_slice("v-2", [a2], "4"))
    assert gw.forget_gone_pods() == []  # a call is in flight on a1: its channel stays
    out = list(job.events())[-1]
    assert out["finish_reason"] and out["usage"]["completion_tokens"] >= 1
    gone = gw.forget_gone_pods()
    assert gone == [("verifier", a1)]
    assert ("verifier", a1) not in gw.placement.clients and (a1, da, "drafter") not in gw._decoders
    with pytest.raises(ValueError):  # the old channel is closed
        old.info(refresh=True)
    assert ("drafter", da) in gw.placement.clients  # the drafter stayed
    # the session moves to a2 and continues; a pod back at a1's address gets a new connection
    again = list(gw.start(session_id=sid, prompt="\n", messages=None, options={}).events())[-1]
    assert gw.get_session(sid).verifier_address == a2 and again["text"] is not None
    vw.apply("ADDED", endpoint_slice("v-1", [a1], "5"))
    new = gw.placement.client("verifier", a1)
    assert new is not old and new.info(refresh=True)["model_name"] == old.info()["model_name"]
