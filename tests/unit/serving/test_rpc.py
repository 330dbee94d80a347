"""Shared gRPC wiring on a real server (127.0.0.1, free port) with a test-only drafter servicer:
health, reflection, error mapping (unary, eager and mid-stream), trace propagation, and the
tracing exporter choice."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from crossdraft.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from crossdraft.serving import rpc, telemetry
from crossdraft.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

SERVICE = "crossdraft.v1.DrafterService"


class FakeDrafter(drafter_pb2_grpc.DrafterServiceServicer):
    """Fixed answers; the session id selects a failure."""

    def GetDrafterInfo(self, request, context):
        return drafter_pb2.GetDrafterInfoResponse(
            info=common_pb2.ModelInfo(model_name="fake", vocab_size=32)
        )

    def SetAllowedTokens(self, request, context):
        if request.allowed_key == "invalid":
            raise InvalidArgument("vocab_size", "must be > 0")
        if request.allowed_key == "missing":
            raise NotFound("allowed_key", "unknown allowed_key 'missing'")
        if request.allowed_key == "full":
            raise ResourceExhausted("too many masks")
        if request.allowed_key == "abort":
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "handler aborted itself")
        if request.allowed_key == "boom":
            raise RuntimeError("secret internals")
        return drafter_pb2.SetAllowedTokensResponse(allowed_count=7)

    def Draft(self, request, context):
        # validation before any token: raised when the handler is called
        if request.num_draft_tokens == 0:
            raise InvalidArgument("num_draft_tokens", "must be > 0")
        return self._tokens(request)

    def _tokens(self, request):
        for i in range(request.num_draft_tokens):
            if request.session_id == "fail-mid" and i == 2:
                raise Unavailable("drafter model went away")
            if request.session_id == "slow":
                time.sleep(0.02)
            if request.session_id == "boom-mid" and i == 1:
                raise KeyError("unexpected")
            yield drafter_pb2.DraftResponse(token=drafter_pb2.DraftToken(token_id=100 + i))
        yield drafter_pb2.DraftResponse(
            done=drafter_pb2.DraftDone(num_tokens=request.num_draft_tokens, stop_reason="length")
        )


@pytest.fixture
def server_exporter():
    return InMemorySpanExporter()


@pytest.fixture
def served(server_exporter):
    provider = telemetry.setup_tracing("test-drafter", exporter=server_exporter, set_global=False)
    servicer = FakeDrafter()
    server, port, health = rpc.build_server(
        [lambda s: drafter_pb2_grpc.add_DrafterServiceServicer_to_server(servicer, s)],
        [SERVICE],
        "127.0.0.1",
        0,
        max_workers=4,
        tracer=provider.get_tracer("test"),
    )
    server.start()
    address = f"127.0.0.1:{port}"
    channel = rpc.client_channel(address)
    try:
        yield address, channel, health
    finally:
        channel.close()
        server.stop(grace=None).wait(5)
        provider.shutdown()


def _check(channel, service=""):
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_not_serving_until_set(served):
    address, channel, health = served
    assert port_of(address) > 0
    assert _check(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert _check(channel, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert not rpc.wait_healthy(address, 0.3)
    rpc.set_serving(health, ["", SERVICE], True)
    assert _check(channel) == health_pb2.HealthCheckResponse.SERVING
    assert _check(channel, SERVICE) == health_pb2.HealthCheckResponse.SERVING
    assert rpc.wait_healthy(address, 5, service=SERVICE)
    rpc.set_serving(health, [""], False)
    assert _check(channel) == health_pb2.HealthCheckResponse.NOT_SERVING


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_wait_healthy_without_server_times_out():
    # a bound but never started server answers nothing
    server, port, _ = rpc.build_server([], [], "127.0.0.1", 0, max_workers=1)
    try:
        start = time.monotonic()
        assert not rpc.wait_healthy(f"127.0.0.1:{port}", 0.3)
        # a liveness bound, not a speed check: the wait gives up (about 0.3 s) rather than hang;
        # 5 s is over 10x that
        assert time.monotonic() - start < 5
    finally:
        server.stop(grace=None)


def test_reflection_lists_services(served):
    _, channel, _ = served
    db = ProtoReflectionDescriptorDatabase(channel)
    names = set(db.get_services())
    assert {SERVICE, rpc.HEALTH_SERVICE_NAME, rpc.REFLECTION_SERVICE_NAME} <= names
    fd = db.FindFileContainingSymbol(SERVICE)
    assert fd.name == "crossdraft/v1/drafter.proto"


def test_unary_ok_and_error_mapping(served):
    _, channel, _ = served
    stub = drafter_pb2_grpc.DrafterServiceStub(channel)
    assert stub.GetDrafterInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=5).info.vocab_size == 32
    assert stub.SetAllowedTokens(drafter_pb2.SetAllowedTokensRequest(allowed_key="ok")).allowed_count == 7

    cases = {
        "invalid": (grpc.StatusCode.INVALID_ARGUMENT, "vocab_size: must be > 0"),
        "missing": (grpc.StatusCode.NOT_FOUND, "allowed_key: unknown"),
        "full": (grpc.StatusCode.RESOURCE_EXHAUSTED, "too many masks"),
        "abort": (grpc.StatusCode.PERMISSION_DENIED, "handler aborted itself"),
        "boom": (grpc.StatusCode.INTERNAL, "internal error"),
    }
    for key, (code, details) in cases.items():
        with pytest.raises(grpc.RpcError) as info:
            stub.SetAllowedTokens(drafter_pb2.SetAllowedTokensRequest(allowed_key=key), timeout=5)
        assert info.value.code() == code, key
        assert details in info.value.details(), (key, info.value.details())
    # the unexpected error's message is not leaked to the client
    with pytest.raises(grpc.RpcError) as info:
        stub.SetAllowedTokens(drafter_pb2.SetAllowedTokensRequest(allowed_key="boom"), timeout=5)
    assert "secret internals" not in info.value.details()


def test_stream_ok_and_errors(served):
    _, channel, _ = served
    stub = drafter_pb2_grpc.DrafterServiceStub(channel)
    items = list(stub.Draft(drafter_pb2.DraftRequest(session_id="s", num_draft_tokens=3), timeout=5))
    assert [i.token.token_id for i in items[:3]] == [100, 101, 102]
    assert items[-1].WhichOneof("item") == "done" and items[-1].done.num_tokens == 3

    # raised eagerly, before the stream starts
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Draft(drafter_pb2.DraftRequest(session_id="s", num_draft_tokens=0), timeout=5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_draft_tokens" in info.value.details()

    # raised mid-stream: the tokens already produced arrive, then the mapped error
    got = []
    with pytest.raises(grpc.RpcError) as info:
        for item in stub.Draft(drafter_pb2.DraftRequest(session_id="fail-mid", num_draft_tokens=5), timeout=5):
            got.append(item.token.token_id)
    assert got == [100, 101]
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "drafter model went away" in info.value.details()

    got = []
    with pytest.raises(grpc.RpcError) as info:
        for item in stub.Draft(drafter_pb2.DraftRequest(session_id="boom-mid", num_draft_tokens=5), timeout=5):
            got.append(item.token.token_id)
    assert got == [100]
    assert info.value.code() == grpc.StatusCode.INTERNAL


def _wait_spans(exporter, count, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = exporter.get_finished_spans()
        if len(spans) >= count:
            return spans
        time.sleep(0.02)
    return exporter.get_finished_spans()


def test_trace_context_propagates_to_server_span(served, server_exporter):
    _, channel, _ = served
    client_exporter = InMemorySpanExporter()
    client_provider = telemetry.setup_tracing("test-client", exporter=client_exporter, set_global=False)
    tracer = client_provider.get_tracer("client")
    stub = drafter_pb2_grpc.DrafterServiceStub(channel)
    try:
        with tracer.start_as_current_span("client-call", kind=SpanKind.CLIENT) as client_span:
            stub.GetDrafterInfo(drafter_pb2.GetDrafterInfoRequest(), metadata=rpc.traced_metadata(), timeout=5)
            list(
                stub.Draft(
                    drafter_pb2.DraftRequest(session_id="s", num_draft_tokens=2),
                    metadata=rpc.traced_metadata([("x-test", "1")]),
                    timeout=5,
                )
            )
        client_ctx = client_span.get_span_context()
        spans = {s.name: s for s in _wait_spans(server_exporter, 2)}
        assert set(spans) == {f"{SERVICE}/GetDrafterInfo", f"{SERVICE}/Draft"}
        for span in spans.values():
            assert span.kind == SpanKind.SERVER
            assert span.context.trace_id == client_ctx.trace_id
            assert span.parent is not None and span.parent.span_id == client_ctx.span_id
            assert span.attributes["rpc.service"] == SERVICE
            assert span.attributes["rpc.grpc.status_code"] == 0
            assert span.resource.attributes["service.name"] == "test-drafter"
        # the streaming span ends after the stream, so it covers all responses
        assert spans[f"{SERVICE}/Draft"].end_time >= spans[f"{SERVICE}/Draft"].start_time
        assert [s.name for s in client_exporter.get_finished_spans()] == ["client-call"]
    finally:
        client_provider.shutdown()


def test_failed_rpcs_are_recorded_on_spans(served, server_exporter):
    _, channel, _ = served
    stub = drafter_pb2_grpc.DrafterServiceStub(channel)
    with pytest.raises(grpc.RpcError):
        list(stub.Draft(drafter_pb2.DraftRequest(session_id="fail-mid", num_draft_tokens=5), timeout=5))
    with pytest.raises(grpc.RpcError):
        stub.SetAllowedTokens(drafter_pb2.SetAllowedTokensRequest(allowed_key="abort"), timeout=5)
    spans = {s.name: s for s in _wait_spans(server_exporter, 2)}
    draft = spans[f"{SERVICE}/Draft"]
    assert draft.status.status_code == StatusCode.ERROR
    assert draft.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
    assert any(e.name == "exception" for e in draft.events)
    assert draft.parent is None  # no trace metadata sent: a root span
    aborted = spans[f"{SERVICE}/SetAllowedTokens"]
    assert aborted.attributes["rpc.grpc.status_code"] == grpc.StatusCode.PERMISSION_DENIED.value[0]
    # health checks are not traced
    _check(channel)
    time.sleep(0.05)
    assert not any("Health" in s.name for s in server_exporter.get_finished_spans())


def test_cancelled_stream_ends_its_span(served, server_exporter):
    _, channel, _ = served
    stub = drafter_pb2_grpc.DrafterServiceStub(channel)
    call = stub.Draft(drafter_pb2.DraftRequest(session_id="slow", num_draft_tokens=500), timeout=30)
    assert next(call).token.token_id == 100
    call.cancel()
    spans = _wait_spans(server_exporter, 1)
    assert [s.name for s in spans] == [f"{SERVICE}/Draft"]
    assert spans[0].end_time is not None


def test_server_without_tracer_still_maps_errors():
    server, port, _ = rpc.build_server(
        [lambda s: drafter_pb2_grpc.add_DrafterServiceServicer_to_server(FakeDrafter(), s)],
        [SERVICE],
        "127.0.0.1",
        0,
        max_workers=2,
    )
    server.start()
    try:
        with rpc.client_channel(f"127.0.0.1:{port}") as channel:
            stub = drafter_pb2_grpc.DrafterServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.SetAllowedTokens(drafter_pb2.SetAllowedTokensRequest(allowed_key="invalid"), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        server.stop(grace=None).wait(5)


def test_status_for():
    assert rpc.status_for(InvalidArgument("max_new_tokens", "must be > 0")) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_new_tokens: must be > 0",
    )
    assert rpc.status_for(NotFound("session", "no session 'x'"))[0] == grpc.StatusCode.NOT_FOUND
    from crossdraft.errors import FailedPrecondition, ModelError

    assert rpc.status_for(FailedPrecondition("crc mismatch"))[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert rpc.status_for(ModelError("bad weights")) == (grpc.StatusCode.FAILED_PRECONDITION, "bad weights")
    assert rpc.status_for(ValueError("x"))[0] == grpc.StatusCode.INTERNAL


def test_inject_extract_roundtrip():
    provider = telemetry.setup_tracing("t", exporter=InMemorySpanExporter(), set_global=False)
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("outer") as span:
        metadata = telemetry.inject_metadata()
    assert [k for k, _ in metadata] == ["traceparent"]
    assert telemetry.inject_metadata() == []  # no current span: nothing to send
    from opentelemetry import trace

    ctx = telemetry.extract_context(metadata + [("other-bin", b"\x00")])
    assert trace.get_current_span(ctx).get_span_context().span_id == span.get_span_context().span_id
    assert not trace.get_current_span(telemetry.extract_context([])).get_span_context().is_valid
    provider.shutdown()


def _processors(provider):
    # SDK internals: the multi-span processor's tuple of processors
    return list(provider._active_span_processor._span_processors)


OTEL_VARS = (
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SERVICE_NAME",
)


@pytest.fixture
def clean_otel_env(monkeypatch):
    for var in OTEL_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_setup_tracing_defaults_to_no_exporter(clean_otel_env):
    assert telemetry.choose_exporters() == []
    provider = telemetry.setup_tracing("svc", set_global=False)
    assert _processors(provider) == []
    assert provider.resource.attributes["service.name"] == "svc"
    provider.shutdown()


def test_setup_tracing_console_and_service_name(clean_otel_env):
    clean_otel_env.setenv("OTEL_TRACES_EXPORTER", "console")
    clean_otel_env.setenv("OTEL_SERVICE_NAME", "renamed")
    provider = telemetry.setup_tracing("svc", set_global=False)
    (processor,) = _processors(provider)
    assert isinstance(processor, SimpleSpanProcessor)
    assert isinstance(processor.span_exporter, ConsoleSpanExporter)
    assert provider.resource.attributes["service.name"] == "renamed"
    provider.shutdown()


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"},
        {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1"},
        {"OTEL_TRACES_EXPORTER": "otlp"},
    ],
)
def test_setup_tracing_otlp(clean_otel_env, env):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    for key, value in env.items():
        clean_otel_env.setenv(key, value)
    assert telemetry.choose_exporters() == ["otlp"]
    provider = telemetry.setup_tracing("svc", set_global=False)
    (processor,) = _processors(provider)
    assert isinstance(processor, BatchSpanProcessor)
    assert isinstance(processor.span_exporter, OTLPSpanExporter)
    provider.shutdown()  # nothing was recorded: nothing is sent


def test_choose_exporters_parsing():
    assert telemetry.choose_exporters({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"}) == []
    assert telemetry.choose_exporters({"OTEL_TRACES_EXPORTER": "otlp, console,otlp"}) == ["otlp", "console"]
    assert telemetry.choose_exporters({"OTEL_TRACES_EXPORTER": "zipkin"}) == []


def test_metrics_server_disabled_and_enabled():
    import urllib.request

    from prometheus_client import CollectorRegistry, Counter

    assert rpc.start_metrics_server(0) is None
    registry = CollectorRegistry()
    Counter("crossdraft_test_requests", "test counter", registry=registry).inc()
    # find a free port via a throwaway socket
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = rpc.start_metrics_server(port, host="127.0.0.1", registry=registry)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "crossdraft_test_requests_total 1.0" in body
    finally:
        server.shutdown()
        server.server_close()


def test_telemetry_module_does_not_import_grpc():
    import subprocess
    import sys

    code = "import sys, crossdraft.serving.telemetry; sys.exit(1 if 'grpc' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0



def test_a_drafter_without_draft_block_is_read_through_its_draft_stream(served):
    """The gateway asks for a whole block with DraftBlock (one reply); a drafter of an older version
    answers UNIMPLEMENTED, and the same call then reads its Draft stream -- and keeps doing so."""
    from crossdraft.decoding.sampling import SamplingParams
    from gateway.clients import RemoteDrafter

    address, _, _ = served
    client = RemoteDrafter(address)
    calls = []
    real = client.stub.DraftBlock

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    client.stub.DraftBlock = counted
    try:
        for _ in range(2):
            toks = client.draft("s", None, None, 3, 0, SamplingParams(), 0, 0.0, "")
            assert [t.id for t in toks] == [100, 101, 102]
        assert len(calls) == 1 and client._block is False
    finally:
        client.channel.close()
