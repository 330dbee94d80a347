"""The gateway's liveness probe (/healthz, Gateway.stale_pairing) and requests to other replicas answer
while decoder() waits on a model server: a replica's first Decoder asks it for its info (a remote call
that takes as long as a slow server does) outside the gateway's lock, and the probe reads what the
readiness check published without a lock. Real gRPC verifier servers in this process; the one a
decoder is paired with holds its info call until the test releases it."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent import futures
from types import SimpleNamespace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from crossdraft.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from gateway.clients import RemoteVerifier
from gateway.config import GatewayConfig
from gateway.core import Gateway
from gateway.discovery import Placement, Pool
from gateway.rest import RestApi

GUARD_S = 60.0  # (only against a hung test: no assertion below reads a clock)


class _Verifier(verifier_pb2_grpc.VerifierServiceServicer):
    """A verifier's info service (model "m" at `revision`); with ``hold`` its info call blocks
    until ``release`` is set, ``entered`` saying it has started."""

    def __init__(self, revision: str, hold: bool = False):
        self.revision, self.hold = revision, hold
        self.entered, self.release = threading.Event(), threading.Event()

    def GetVerifierInfo(self, request, context):
        if self.hold:
            self.entered.set()
            self.release.wait()
        return verifier_pb2.GetVerifierInfoResponse(info=common_pb2.ModelInfo(model_name="m", revision=self.revision))


def _serve(servicer: _Verifier):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, server)
    h = health.HealthServicer()
    h.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_liveness_answers_while_a_decoder_waits_on_a_servers_first_info_call():
    a, slow, other = _Verifier("r1"), _Verifier("r1", hold=True), _Verifier("r1")
    (sa, addr_a), (sb, addr_b), (sc, addr_c) = _serve(a), _serve(slow), _serve(other)
    placement = Placement(Pool("verifier", [addr_a]), None, RemoteVerifier, None)
    decoding = same = None
    got = {}
    try:
        # a pair without a drafter; a Redis that answers (readiness pings it)
        gw = Gateway(GatewayConfig(verifier=addr_a, redis_url="redis://unused", stale_pairing_restart_s=1e-6),
                     SimpleNamespace(drafter_tok=None), placement, SimpleNamespace(ping=lambda: True))
        assert gw.model_revision == "r1" and gw.readiness(max_age_s=0)[0]
        # the only verifier in the pool now serves another revision: two readiness checks (any time
        # apart exceeds the 1 us restart limit) publish a stale pairing for liveness to report
        a.revision = "r2"
        assert not gw.readiness(max_age_s=0)[0] and not gw.readiness(max_age_s=0)[0]

        # a request paired with the slow replica: decoder() asks it for its info; a second request for the
        # same pair waits for that Decoder rather than building its own
        decoding = threading.Thread(target=lambda: got.setdefault("first", gw.decoder(addr_b, None)), daemon=True)
        decoding.start()
        assert slow.entered.wait(GUARD_S)
        same = threading.Thread(target=lambda: got.setdefault("second", gw.decoder(addr_b, None)), daemon=True)
        same.start()
        # a request to another replica does not wait for it
        elsewhere = threading.Thread(target=lambda: got.setdefault("other", gw.decoder(addr_c, None)), daemon=True)
        elsewhere.start()
        elsewhere.join(GUARD_S)
        assert not elsewhere.is_alive() and got["other"] is gw.decoder(addr_c, None)

        answers = {}

        def probe():
            r = asyncio.run(RestApi(lambda: gw).healthz(None))
            answers["healthz"] = (r.status_code, json.loads(r.body))
            answers["stale"] = gw.stale_pairing()
            answers["ready"] = gw.readiness(max_age_s=3600.0)[0]  # (/readyz's cached answer, too)

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        prober.join(GUARD_S)
        # the probes returned while the info call is provably still held: the server has not been
        # released, both requests for the slow pair are still inside decoder()
        assert not prober.is_alive(), "the liveness probe waited on decoder()'s remote info call"
        assert not slow.release.is_set() and decoding.is_alive() and same.is_alive()
        status, body = answers["healthz"]
        assert status == 503 and body["status"] == "stale pairing", body
        assert "revision r2" in body["reason"] and "revision r1" in body["reason"], body
        assert answers["stale"] == body["reason"] and answers["ready"] is False
    finally:
        slow.release.set()
        for t in (decoding, same):
            if t is not None:
                t.join(GUARD_S)
        for c in list(placement.clients.values()):
            c.close()
        for srv in (sa, sb, sc):
            srv.stop(None)
    # released, the decoder pairs the slow replica (same model, same revision as paired), one Decoder for both
    assert not decoding.is_alive() and not same.is_alive()
    assert got["first"] is got["second"] is gw._decoders[(addr_b, None, "")]


def test_one_load_gate_per_verifier_replica_and_load_gate_off():
    """Whether drafting pays under load is a question of a verifier's whole load: the gateway gives every
    Decoder over one verifier replica (all drafter replicas and kinds) the same load gate, another
    replica its own; `--load-gate off` makes gates that never hold."""
    (sa, addr_a), (sb, addr_b) = _serve(_Verifier("r1")), _serve(_Verifier("r1"))
    try:
        for setting in ("on", "off"):
            placement = Placement(Pool("verifier", [addr_a, addr_b]), None, RemoteVerifier, None)
            gw = Gateway(GatewayConfig(verifier=f"{addr_a},{addr_b}", redis_url="redis://unused", load_gate=setting),
                         SimpleNamespace(drafter_tok=None), placement, SimpleNamespace(ping=lambda: True))
            ga, gb = gw.decoder(addr_a, None).gate, gw.decoder(addr_b, None).gate
            assert gw._gates == {addr_a: ga, addr_b: gb} and ga is not gb
            assert gw.decoder(addr_a, None).gate is ga
            assert ga.enabled is (setting == "on") and gb.enabled is (setting == "on")
            for c in list(placement.clients.values()):
                c.close()
    finally:
        sa.stop(None)
        sb.stop(None)


def test_drafter_kinds_paired_later_join_in_the_operators_order():
    """Kinds whose replicas did not answer at start wait in `pending` with why; pair_later retries each
    (a failure is kept as the reason and retried) until it pairs, and the gateway's kinds stay in the
    configured order whatever order they joined in; the first configured kind is the gateway's drafter."""
    from gateway.pool import DrafterKind

    (sa, addr_a) = _serve(_Verifier("r1"))
    try:
        placement = Placement(Pool("verifier", [addr_a]), None, RemoteVerifier, None)
        kinds = {key: DrafterKind(key.partition(":")[2] or "first", key, SimpleNamespace(drafter_tok=None), "m-" + key)
                 for key in ("drafter", "drafter:b", "drafter:c")}
        gw = Gateway(GatewayConfig(verifier=addr_a, redis_url="redis://unused"), SimpleNamespace(drafter_tok=None),
                     placement, SimpleNamespace(ping=lambda: True), kinds=[kinds["drafter:c"]],
                     kind_keys=list(kinds))
        assert (list(gw.kinds), gw.has_drafter, gw.drafter_model) == (["c"], True, None)
        calls = {"drafter": 0, "drafter:b": 0}
        step = threading.Semaphore(0)

        def pair_one(key):
            step.acquire(timeout=GUARD_S)
            calls[key] += 1
            if key == "drafter:b" and calls[key] == 1:
                raise ConnectionError("tokenizer fetch failed")
            return kinds[key] if (key, calls[key]) in (("drafter:b", 2), ("drafter", 3)) else None

        t = gw.pair_later(["drafter", "drafter:b"], pair_one, interval_s=0.01)
        assert set(gw.pending) == {"drafter", "drafter:b"}
        for _ in range(2):  # one try of each: "drafter" not up, "b" fails
            step.release()
        failed = threading.Event()
        for _ in range(int(GUARD_S / 0.01)):
            if "ConnectionError" in gw.pending.get("drafter:b", ""):
                failed.set()
                break
            failed.wait(0.01)
        assert failed.is_set()
        assert "tokenizer fetch failed" in gw.pending["drafter:b"] and list(gw.kinds) == ["c"]
        for _ in range(8):
            step.release()
        t.join(GUARD_S)
        assert not t.is_alive() and gw.pending == {}
        assert list(gw.kinds) == ["first", "b", "c"] and gw.drafter_model == "m-drafter"
        assert [k.key for k in gw.kinds.values()] == ["drafter", "drafter:b", "drafter:c"]
        assert gw.kind_of("drafter:b") is kinds["drafter:b"]
    finally:
        sa.stop(None)
