"""One trace per request: a `crossdraft.verify_round` span per round with its attributes, and the
drafter's and verifier's own server spans (in their processes) in the same trace.

The gateway runs in this process with an in-memory exporter; the drafter and verifier are real
processes exporting with OTEL_TRACES_EXPORTER=console, so their spans are read from their logs.
"""

from __future__ import annotations

import re
import time

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from crossdraft.serving import telemetry
from crossdraft.serving.redis_server import RedisServer
from tests.service_fixtures import Proc, model_server, wait_grpc_healthy

ROUND_ATTRS = ("crossdraft.round.index", "crossdraft.round.draft_tokens_requested", "crossdraft.round.drafted",
               "crossdraft.round.accepted", "crossdraft.round.emitted", "crossdraft.round.draft_ms",
               "crossdraft.round.verify_ms", "crossdraft.round.overhead_ms", "crossdraft.round.batch_size",
               "crossdraft.round.queue_wait_ms")


@pytest.fixture(scope="module")
def traced(tiny_dirs, tmp_path_factory):
    from gateway.config import GatewayConfig
    from gateway.server import build_gateway

    t_dir, d_dir = tiny_dirs
    logs = tmp_path_factory.mktemp("trace-logs")
    redis = RedisServer().start()
    procs = []
    try:
        for kind, model in (("verifier", t_dir), ("drafter", d_dir)):
            p, addr = model_server(kind, str(model), logs)
            p.stop()
            p.env.update(OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME=f"test-{kind}")
            p.start()
            procs.append((p, addr))
        for p, addr in procs:
            wait_grpc_healthy(addr, p)
        exporter = InMemorySpanExporter()
        provider = telemetry.setup_tracing("test-gateway", exporter, set_global=False)
        tracer = provider.get_tracer("test")
        cfg = GatewayConfig(verifier=procs[0][1], drafter=procs[1][1], redis_url=redis.url, connect_timeout_s=60)
        gw = build_gateway(cfg, tracer)
        yield gw, tracer, exporter, {p.name.split("-")[0]: p for p, _ in procs}
    finally:
        for p, _ in procs:
            p.stop()
        redis.stop()


def _run(gw, tracer, **kw):
    with tracer.start_as_current_span("client-request") as root:
        job = gw.start(session_id=None, prompt="def fibonacci(n):\n", messages=None,
                       options=dict(max_new_tokens=24, **kw))
        events = list(job.events())
    return root.get_span_context().trace_id, events[-1]


def test_one_verify_round_span_per_round_with_attributes(traced):
    gw, tracer, exporter, _ = traced
    exporter.clear()
    trace_id, done = _run(gw, tracer, temperature=0.8, seed=2)
    spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
    rounds = [s for s in spans if s.name == "crossdraft.verify_round"]
    assert len(rounds) == done["stats"]["rounds"] > 1
    assert sorted(s.attributes["crossdraft.round.index"] for s in rounds) == list(range(len(rounds)))
    for s in rounds:
        for a in ROUND_ATTRS:
            assert a in s.attributes, a
        assert s.attributes["crossdraft.round.accepted"] <= s.attributes["crossdraft.round.drafted"]
    assert sum(s.attributes["crossdraft.round.drafted"] for s in rounds) == done["stats"]["drafted"]
    assert sum(s.attributes["crossdraft.round.accepted"] for s in rounds) == done["stats"]["accepted"]
    assert sum(s.attributes["crossdraft.round.emitted"] for s in rounds) == done["usage"]["completion_tokens"]
    # each round's RPCs are its children
    round_ids = {s.context.span_id for s in rounds}
    verifies = [s for s in spans if s.name == "crossdraft.v1.VerifierService/Verify"]
    drafts = [s for s in spans if s.name == "crossdraft.v1.DrafterService/DraftBlock"]  # (serial rounds)
    assert len(verifies) == len(rounds)
    assert drafts and all(s.parent.span_id in round_ids for s in verifies + drafts)
    assert all(s.kind == trace.SpanKind.CLIENT for s in verifies + drafts)


def _server_spans(proc: Proc, trace_id: int, timeout: float = 10.0) -> list[str]:
    want = f"0x{trace_id:032x}"
    t0 = time.time()
    while time.time() - t0 < timeout:
        names = re.findall(r'"name": "([^"]+)",\s*"context": \{\s*"trace_id": "' + want, proc.log_path.read_text())
        if names:
            return names
        time.sleep(0.2)
    return []


def test_drafter_and_verifier_spans_share_the_request_trace(traced):
    gw, tracer, exporter, procs = traced
    trace_id, done = _run(gw, tracer)
    v_names = _server_spans(procs["verifier"], trace_id)
    d_names = _server_spans(procs["drafter"], trace_id)
    assert "crossdraft.v1.VerifierService/Verify" in v_names
    assert v_names.count("crossdraft.v1.VerifierService/Verify") == done["stats"]["rounds"]
    assert "crossdraft.v1.DrafterService/DraftBlock" in d_names
    # and a different request is a different trace
    other, _ = _run(gw, tracer)
    assert other != trace_id and _server_spans(procs["verifier"], other)


def test_concurrent_requests_share_verifier_batches(traced):
    """Requests running at once are verified in shared forwards; each round's span says how many
    sessions its forward held and how long the block queued. Whether two blocks meet in one forward
    depends on timing, so up to three bursts are tried before concluding they never do."""
    from concurrent.futures import ThreadPoolExecutor

    gw, tracer, exporter, _ = traced
    sizes = []
    for _attempt in range(3):
        exporter.clear()
        with ThreadPoolExecutor(6) as ex:
            dones = list(ex.map(lambda i: _run(gw, tracer, temperature=0.0, seed=i)[1], range(6)))
        rounds = [s for s in exporter.get_finished_spans() if s.name == "crossdraft.verify_round"]
        assert len(rounds) == sum(d["stats"]["rounds"] for d in dones)
        sizes = [s.attributes["crossdraft.round.batch_size"] for s in rounds]
        assert all(1 <= b <= 6 for b in sizes), sizes
        assert all(s.attributes["crossdraft.round.queue_wait_ms"] >= 0 for s in rounds)
        if max(sizes) > 1:
            break
    assert max(sizes) > 1, sizes


def test_a_round_makes_one_call_to_each_server_and_no_redis_write(traced):
    """Work counting (issue "rounds at GPU speed"): every round of a session's turn is one Verify and, when
    it drafts, one drafter call (the whole block in one DraftBlock reply) -- none retried or repeated;
    the turn writes Redis a fixed number of times (its lease, the commit, the release), none per round.
    Each round's span reports its overhead and its waits in the servers' queues apart."""
    gw, tracer, exporter, _ = traced
    s = gw.create_session({"max_new_tokens": 24, "temperature": 0.0, "adaptive_draft": False})
    issued: list[str] = []  # the commands the gateway sends Redis during the turn
    real = gw.store.r.execute_command

    def counted(*args, **kw):
        issued.append(str(args[0]).upper())
        return real(*args, **kw)

    exporter.clear()
    gw.store.r.execute_command = counted
    try:
        with tracer.start_as_current_span("client-request"):
            job = gw.start(session_id=s.session_id, prompt="def fibonacci(n):\n", messages=None, options={})
            done = list(job.events())[-1]
    finally:
        del gw.store.r.execute_command
    gw.delete_session(s.session_id)
    written = [c for c in issued if c not in ("GET", "PING", "EXISTS", "PTTL", "TTL")]
    spans = exporter.get_finished_spans()
    rounds = {x.context.span_id: x for x in spans if x.name == "crossdraft.verify_round"}
    assert len(rounds) == done["stats"]["rounds"] >= 8
    calls: dict[tuple, int] = {}
    for x in spans:
        if x.parent is not None and x.parent.span_id in rounds:
            key = (x.parent.span_id, x.name.rsplit("/", 1)[-1])
            calls[key] = calls.get(key, 0) + 1
    for sid, r in rounds.items():
        assert calls.get((sid, "Verify")) == 1
        drafts = calls.get((sid, "DraftBlock"), 0) + calls.get((sid, "Draft"), 0)
        assert drafts == (1 if r.attributes["crossdraft.round.draft_tokens_requested"] > 0 else 0)
        assert calls.get((sid, "DraftBlock"), 0) == drafts  # a serial round waits for the whole block: one reply
        assert r.attributes["crossdraft.round.overhead_ms"] >= 0
        assert r.attributes["crossdraft.round.queue_wait_ms"] >= 0
        assert r.attributes["crossdraft.round.draft_queue_wait_ms"] >= 0
        if r.attributes["crossdraft.round.drafted"] > 0:  # (one request: the drafter's steps ran alone)
            assert r.attributes["crossdraft.round.draft_batch_rows"] == 1
    assert sum(1 for r in rounds.values() if r.attributes["crossdraft.round.drafted"] > 0) >= len(rounds) // 2
    assert "SET" in issued and len(written) <= 3, issued  # the lease, the commit, the release
    st = done["stats"]
    assert st["draft_queue_ms"] >= 0 and st["verify_queue_ms"] >= 0
