"""Pod discovery from EndpointSlices and session placement.

No API server runs here: recorded EndpointSlice watch events (the JSON an API server sends) go
through the kubernetes client's own event decoding (``Watch.unmarshal_event`` into its
``V1EndpointSlice`` models) and then through the gateway's watch code path.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from kubernetes import client, watch

from gateway.discovery import EndpointSliceWatcher, Placement, Pool, slice_addresses, static_pool

EVENTS = (Path(__file__).parents[2] / "data" / "endpointslice_events.jsonl").read_text().splitlines()
# the pool after each recorded event
EXPECTED = [
    ["10.8.1.14:50062"],  # pod 1 not ready yet
    ["10.8.1.14:50062", "10.8.2.31:50062"],
    ["10.8.1.14:50062", "10.8.2.31:50062", "10.8.3.7:50062"],  # a second slice
    ["10.8.2.31:50062", "10.8.3.7:50062"],  # pod 0 terminating
    ["10.8.2.31:50062"],  # second slice deleted
]


def decoded(lines):
    w = watch.Watch()
    return [w.unmarshal_event(line, "V1EndpointSlice") for line in lines]


def test_events_decode_into_client_models():
    ev = decoded(EVENTS[:1])[0]
    assert ev["type"] == "ADDED" and isinstance(ev["object"], client.V1EndpointSlice)
    assert slice_addresses(ev["object"]) == ["10.8.1.14:50062"]
    assert slice_addresses(ev["object"], port_name="metrics") == ["10.8.1.14:9090"]


def test_watch_events_keep_the_pool_current():
    pool = Pool("verifier")
    w = EndpointSliceWatcher(pool, "llm", "crossdraft-verifier", api=object())
    for ev, want in zip(decoded(EVENTS), EXPECTED, strict=True):
        w.consume([ev])
        assert pool.addresses() == want
    assert w.resource_version == "104611"


def test_nil_ready_means_ready_and_ipv6_is_bracketed():
    s = client.V1EndpointSlice(
        address_type="IPv6", metadata=client.V1ObjectMeta(name="x"),
        endpoints=[client.V1Endpoint(addresses=["fd00::1"], conditions=client.V1EndpointConditions()),
                   client.V1Endpoint(addresses=["fd00::2"], conditions=None)],
        ports=[client.DiscoveryV1EndpointPort(name="grpc", port=50061)])
    assert slice_addresses(s) == ["[fd00::1]:50061", "[fd00::2]:50061"]


class FakeDiscoveryApi:
    """Answers the initial LIST with a recorded EndpointSliceList."""

    def __init__(self, items):
        self.items = items
        self.calls = []

    def list_namespaced_endpoint_slice(self, namespace, **kw):
        self.calls.append((namespace, kw))
        data = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": "104000"}, "items": self.items}
        return client.ApiClient().deserialize(json.dumps(data), "V1EndpointSliceList", "application/json")


def test_run_lists_then_watches_through_the_client(monkeypatch):
    """The real run() loop: LIST (recorded), then WATCH (recorded stream), then ERROR -> re-LIST."""
    first = json.loads(EVENTS[0])["object"]
    api = FakeDiscoveryApi([first])
    streams = [list(EVENTS[1:4]) + ['{"type": "ERROR", "object": {"kind": "Status", "code": 410}}'], []]
    seen_kwargs = []

    def fake_stream(self, func, *args, **kwargs):
        seen_kwargs.append(kwargs)
        lines = streams.pop(0) if streams else []
        for line in lines:
            yield self.unmarshal_event(line, "V1EndpointSlice")
        time.sleep(0.05)

    monkeypatch.setattr(watch.Watch, "stream", fake_stream)
    pool = Pool("verifier")
    w = EndpointSliceWatcher(pool, "llm", "crossdraft-verifier", api=api)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    deadline = time.time() + 5
    while len(api.calls) < 2 and time.time() < deadline:  # the ERROR forces a second LIST
        time.sleep(0.02)
    w.stop()
    t.join(5)
    assert len(api.calls) >= 2
    assert api.calls[0] == ("llm", {"label_selector": "kubernetes.io/service-name=crossdraft-verifier"})
    assert seen_kwargs[0]["resource_version"] == "104000"
    assert seen_kwargs[0]["label_selector"].endswith("crossdraft-verifier")
    # after the re-LIST the pool is the listed slice again
    assert pool.addresses() == ["10.8.1.14:50062"]


def test_static_pool_parsing():
    assert static_pool("verifier", "a:1, b:2").addresses() == ["a:1", "b:2"]
    assert static_pool("drafter", None) is None
    with pytest.raises(ValueError, match="host:port"):
        static_pool("verifier", "nohost")


def test_placement_least_loaded_affinity_and_move():
    pool = Pool("verifier", ["a:1", "b:1"])
    made = []
    pl = Placement(pool, None, lambda a: made.append(a) or f"client-{a}", None)
    first, moved = pl.choose("verifier", None)
    assert not moved
    pl.acquire("verifier", first)
    second, _ = pl.choose("verifier", None)
    assert second != first  # least loaded
    pl.acquire("verifier", second)
    pl.acquire("verifier", second)
    assert pl.choose("verifier", None)[0] == first
    assert pl.choose("verifier", second) == (second, False)  # affinity beats load
    pool.set([first])  # the session's pod is gone
    assert pl.choose("verifier", second) == (first, True)
    pool.set([])
    assert pl.choose("verifier", first) == (None, True)
    assert pl.client("verifier", "a:1") == "client-a:1" and pl.client("verifier", "a:1") == "client-a:1"
    assert made == ["a:1"]  # one client per pod
    assert pl.choose("drafter", None) == (None, False)  # no drafter pool: target-only


class _PodClient:
    """Stands in for the gRPC client of one pod: this test checks Placement's bookkeeping only (the
    e2e test in tests/e2e/test_placement.py does it with real model servers)."""

    def __init__(self, addr):
        self.addr, self.closed = addr, False

    def close(self):
        self.closed = True


def test_placement_closes_the_clients_of_pods_that_left():
    vpool, dpool = Pool("verifier", ["a:1", "b:1"]), Pool("drafter", ["d:1"])
    pl = Placement(vpool, dpool, _PodClient, _PodClient)
    pl.gone_grace_s = 10.0
    a, b, d = pl.client("verifier", "a:1"), pl.client("verifier", "b:1"), pl.client("drafter", "d:1")
    pl.acquire("verifier", "b:1")  # a call is on b
    vpool.set(["c:1"])  # a and b leave
    assert pl.prune(now=100.0) == [] and pl.prune(now=109.0) == []  # within the grace period
    assert pl.prune(now=110.0) == [("verifier", "a:1")]
    assert a.closed and not b.closed and not d.closed
    assert ("verifier", "a:1") not in pl.clients and ("verifier", "a:1") not in pl.inflight
    assert pl.prune(now=500.0) == []  # b's call is still in flight
    pl.release("verifier", "b:1")
    assert pl.prune(now=501.0) == [("verifier", "b:1")] and b.closed
    assert set(pl.clients) == {("drafter", "d:1")}  # the drafter never left
    # a pod that comes back at the same address gets a new client
    vpool.set(["a:1"])
    a2 = pl.client("verifier", "a:1")
    assert a2 is not a and not a2.closed and pl.prune(now=600.0) == []
    # back within the grace period: the clock starts over when it leaves again
    vpool.set([])
    assert pl.prune(now=700.0) == []
    vpool.set(["a:1"])
    assert pl.prune(now=705.0) == []
    vpool.set([])
    assert pl.prune(now=712.0) == [] and not a2.closed
    assert pl.prune(now=722.0) == [("verifier", "a:1")] and a2.closed
    assert pl.choose("verifier", "a:1") == (None, True)


def test_placement_skips_the_pods_that_refused():
    """A request refused by its pod goes to the least-loaded pod that has not refused it; with every
    ready pod excluded there is none (the gateway then reports every refusal)."""
    pool = Pool("verifier", ["a:1", "b:1", "c:1"])
    pl = Placement(pool, None, _PodClient, None)
    pl.acquire("verifier", "b:1")
    assert pl.choose("verifier", None, exclude={"a:1"}) == ("c:1", False)  # c is idle, b is not
    assert pl.choose("verifier", None, exclude={"a:1", "c:1"}) == ("b:1", False)
    assert pl.choose("verifier", "a:1", exclude={"a:1"}) == ("c:1", True)  # the recorded pod refused: it moves
    assert pl.choose("verifier", None, exclude={"a:1", "b:1", "c:1"}) == (None, False)


def test_refused_error_names_every_replica_and_keeps_the_status():
    from crossdraft.errors import ResourceExhausted, Unavailable
    from gateway.job import refused_error

    full = ResourceExhausted("verifier 127.0.0.1:5001: kv cache full: 6 of 6 blocks held by busy sessions; retry later")
    down = Unavailable("verifier 127.0.0.1:5002 UNAVAILABLE: failed to connect to all addresses")
    late = Unavailable("verifier 127.0.0.1:5003 DEADLINE_EXCEEDED: Deadline Exceeded")
    e = refused_error("verifier", [("127.0.0.1:5001", full), ("127.0.0.1:5002", down)])
    assert type(e) is Unavailable  # not every replica was full: 503
    assert str(e) == ("no verifier replica accepted the request: 127.0.0.1:5001 RESOURCE_EXHAUSTED (kv cache full: "
                      "6 of 6 blocks held by busy sessions; retry later), 127.0.0.1:5002 UNAVAILABLE (failed to "
                      "connect to all addresses)")
    both_full = refused_error("verifier", [("127.0.0.1:5001", full), ("127.0.0.1:5004", ResourceExhausted(
        "verifier 127.0.0.1:5004: kv cache full: 2 of 2 blocks held by busy sessions; retry later"))])
    assert type(both_full) is ResourceExhausted  # every replica was full: 429, retry later
    assert "127.0.0.1:5001 RESOURCE_EXHAUSTED" in str(both_full)
    assert "127.0.0.1:5004 RESOURCE_EXHAUSTED" in str(both_full)
    # a message of another shape is kept whole; a gRPC code other than UNAVAILABLE is named as such
    odd = refused_error("verifier", [("x:1", Unavailable("verifier x:1 serves m at revision b")),
                                     ("127.0.0.1:5003", late)])
    assert str(odd).endswith("x:1 UNAVAILABLE (verifier x:1 serves m at revision b), "
                             "127.0.0.1:5003 DEADLINE_EXCEEDED (Deadline Exceeded)")
