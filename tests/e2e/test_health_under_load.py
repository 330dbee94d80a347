"""The probes answer while the gateway is full of work.

A gateway with 64 generations in flight (REST, REST streaming and gRPC streams, all long) answers
GET /healthz, GET /readyz and grpc.health.v1 Check before any of the 64 has ended: the probes do
not wait for a worker thread that a generation holds (anyio's default REST limiter has 40 threads,
a default gRPC pool 16; both are filled here). The proof is an ordering, not a time: after the
probes have answered, the gateway's own counters still say that none of the 64 requests has
ended. The benchmark benchmarks/health_under_load.py measures the probes' latency."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlparse

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from crossdraft.v1 import gateway_pb2, gateway_pb2_grpc
from tests.service_fixtures import Services

PROMPT = "The quick brown fox"
MAX_TOKENS = 480  # the tiny models' context is 512 positions: as long as a request can be here
# 64 requests: as many plain REST ones as anyio's default 40 worker threads, more gRPC streams than
# grpc's usual 16 handler threads (the gateway sizes its pool by the admission limits, so all run)
REST, SSE, GRPC = 40, 4, 20
# Liveness bounds, not timings: a probe answers in well under 100 ms on an idle machine; 5 s is 50x
# that, so a probe past it waits for something (a generation ending), and the test fails instead of
# hanging. Filling the gateway takes seconds; 180 s bounds that.
PROBE_BOUND_S = 5.0
FILL_BOUND_S = 180.0


@pytest.fixture(scope="module")
def busy_gw(tiny_dirs, tmp_path_factory):
    """Redis, a verifier, a drafter and a gateway of this module's own: 64 requests in flight at
    once would crowd the shared stack's model servers (their session caches are sized for the
    other files)."""
    t_dir, d_dir = tiny_dirs
    with Services(tmp_path_factory.mktemp("health-under-load")) as s:
        sessions = ["--max-sessions", "160"]
        _, vaddr = s.verifier(t_dir, extra=sessions)
        _, daddr = s.drafter(d_dir, extra=sessions)
        s.ready()
        _, http, grpc_addr = s.gateway(vaddr, daddr, drafter_timeout_s=30)
        s.ready()
        yield http, grpc_addr


def _metrics(http: str) -> dict[str, float]:
    """The gateway's /metrics samples, name{labels} -> value."""
    out = {}
    for line in requests.get(http + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _ended(m: dict[str, float]) -> float:
    """Requests the gateway has finished, whatever their outcome (counted when a generation ends)."""
    return sum(v for k, v in m.items() if k.startswith("crossdraft_requests_total{"))


def _rest_request(http: str, stream: bool) -> socket.socket:
    """A completion request sent on a socket of its own, left unread: closing the socket is the
    client going away, which cancels the generation."""
    u = urlparse(http)
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}).encode()
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def _nothing_received(sock: socket.socket) -> bool:
    """Whether no byte of a non-streaming response has arrived (it is sent when the request ends)."""
    sock.setblocking(False)
    try:
        return not sock.recv(1, socket.MSG_PEEK)  # b"": the server closed the connection
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)


def test_probes_answer_before_any_of_64_requests_in_flight_ends(busy_gw):
    http, grpc_addr = busy_gw
    ended_before = _ended(_metrics(http))
    channel = grpc.insecure_channel(grpc_addr)
    socks: list[socket.socket] = []
    calls = []
    try:
        socks = [_rest_request(http, stream=False) for _ in range(REST)]
        socks += [_rest_request(http, stream=True) for _ in range(SSE)]
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        req = gateway_pb2.GenerateRequest(prompt=PROMPT, options=gateway_pb2.GenerationOptions(
            max_new_tokens=MAX_TOKENS, temperature=0.0))
        calls = [stub.Generate(req, timeout=600) for _ in range(GRPC)]
        n = REST + SSE + GRPC
        deadline = time.monotonic() + FILL_BOUND_S
        while _metrics(http).get("crossdraft_active_requests", 0) < n:
            assert time.monotonic() < deadline, f"the gateway never ran all {n} requests at once"
            time.sleep(0.1)

        # the three probes at once, as a kubelet and a load balancer would send them
        answers: dict[str, object] = {}

        def probe(name, fn):
            try:
                answers[name] = fn()
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                answers[name] = e

        health = health_pb2_grpc.HealthStub(channel)
        probes = {
            "healthz": lambda: requests.get(http + "/healthz", timeout=PROBE_BOUND_S).status_code,
            "readyz": lambda: requests.get(http + "/readyz", timeout=PROBE_BOUND_S).status_code,
            "grpc health": lambda: health_pb2.HealthCheckResponse.ServingStatus.Name(
                health.Check(health_pb2.HealthCheckRequest(service=""), timeout=PROBE_BOUND_S).status),
        }
        threads = [threading.Thread(target=probe, args=item) for item in probes.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert answers == {"healthz": 200, "readyz": 200, "grpc health": "SERVING"}, answers

        # the probes have answered; none of the 64 has ended, by the gateway's counters (a request
        # is counted when it ends) and by what the clients have received
        m = _metrics(http)
        assert _ended(m) == ended_before, "a request ended before the probes answered"
        assert m["crossdraft_active_requests"] == n
        assert all(_nothing_received(s) for s in socks[:REST])
        assert all(c.is_active() for c in calls)
    finally:
        for s in socks:
            s.close()
        for c in calls:
            c.cancel()
        channel.close()
    # the cancelled requests end (the module's stack is stopped next; this keeps its logs clean)
    deadline = time.monotonic() + FILL_BOUND_S
    while _metrics(http).get("crossdraft_active_requests", 0) > 0:
        assert time.monotonic() < deadline, "the cancelled requests did not end"
        time.sleep(0.2)


def test_grpc_health_answers_while_every_handler_thread_is_busy():
    """A gRPC server whose only handler thread is held by a stream answers health checks: Check
    runs on a pool of its own (crossdraft.serving.rpc.ProbeHealthServicer)."""
    from crossdraft.serving import rpc

    release = threading.Event()
    entered = threading.Event()

    def hold(request, context):  # a server stream that holds its handler thread until released
        entered.set()
        release.wait(60)
        yield b""

    handler = grpc.method_handlers_generic_handler(
        "test.Hold", {"Hold": grpc.unary_stream_rpc_method_handler(hold)})
    server, port, health = rpc.build_server([lambda s: s.add_generic_rpc_handlers((handler,))], ["test.Hold"],
                                            "127.0.0.1", 0, max_workers=1)
    rpc.set_serving(health, ["", "test.Hold"], True)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        call = channel.unary_stream("/test.Hold/Hold")(b"", timeout=60)
        assert entered.wait(30), "the stream never started"
        r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                       timeout=PROBE_BOUND_S)  # a liveness bound, as above
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        assert not release.is_set() and call.is_active()  # answered while the stream still held the thread
    finally:
        release.set()
        channel.close()
        server.stop(None)
