"""Model servers and the gateway with models named by Hugging Face Hub id, offline.

The Hub is not reachable here: every process runs with HF_HUB_OFFLINE=1 and HF_HOME pointing at a
Hub cache laid out on disk as huggingface_hub writes it (refs/, snapshots/<commit>/, blobs/), with
tiny random-init models in it. Real processes: two verifiers serving two revisions of one target
(main and tag v1), a drafter pinned by commit, Redis, and gateways; and a verifier serving one GGUF
of a repo that holds only GGUFs.
"""

from __future__ import annotations

import time

import pytest
import requests

from crossdraft.serving.redis_server import RedisServer
from tests.hub_fixtures import add_snapshot, fake_commit, gguf_sources, hub_env
from tests.service_fixtures import Proc, free_port, gateway, save_tiny_pair, wait_grpc_healthy, wait_http_ready

T_REPO, D_REPO = "tiny-org/tiny-target", "tiny-org/tiny-drafter"
C_MAIN, C_V1, D1 = fake_commit("e2e-target-main"), fake_commit("e2e-target-v1"), fake_commit("e2e-drafter")
D2 = fake_commit("e2e-drafter-2")


def _server(kind: str, args: list[str], logs, env) -> tuple[Proc, str]:
    port = free_port()
    p = Proc(f"{kind}-{port}", [kind, *args, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                                "--max-sessions", "4"], logs, env=env).start()
    return p, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def hub_pods(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-e2e")
    t_dir, d_dir = save_tiny_pair(root / "src")
    home = root / "hf"
    add_snapshot(home / "hub", T_REPO, t_dir, C_MAIN, refs=("main",))
    add_snapshot(home / "hub", T_REPO, t_dir, C_V1, refs=("v1",))
    add_snapshot(home / "hub", D_REPO, d_dir, D1)
    add_snapshot(home / "hub", D_REPO, d_dir, D2, refs=("v2",))
    env = hub_env(home)
    logs = root / "logs"
    logs.mkdir()
    redis = RedisServer().start()
    procs = []
    try:
        v_main, a_main = _server("verifier", ["--model", T_REPO], logs, env)  # main -> C_MAIN
        procs.append(v_main)
        v_v1, a_v1 = _server("verifier", ["--model", T_REPO, "--revision", "v1"], logs, env)  # -> C_V1
        procs.append(v_v1)
        d, a_d = _server("drafter", ["--model", f"{D_REPO}@{D1}"], logs, env)
        procs.append(d)
        d2, a_d2 = _server("drafter", ["--model", D_REPO, "--revision", "v2"], logs, env)  # -> D2
        procs.append(d2)
        for p, a in ((v_main, a_main), (v_v1, a_v1), (d, a_d), (d2, a_d2)):
            wait_grpc_healthy(a, p)
        yield {"redis": redis, "main": a_main, "v1": a_v1, "drafter": a_d, "drafter2": a_d2, "logs": logs, "env": env,
               "procs": {"main": v_main, "v1": v_v1, "drafter": d}}
    finally:
        for p in reversed(procs):
            p.stop()
        redis.stop()


def test_servers_report_the_resolved_commit(hub_pods):
    from gateway.clients import RemoteDrafter, RemoteVerifier

    vm, vv, dr = (RemoteVerifier(hub_pods["main"]), RemoteVerifier(hub_pods["v1"]), RemoteDrafter(hub_pods["drafter"]))
    assert (vm.info()["model_name"], vm.info()["revision"]) == (T_REPO, C_MAIN)
    assert (vv.info()["model_name"], vv.info()["revision"]) == (T_REPO, C_V1)
    assert (dr.info()["model_name"], dr.info()["revision"]) == (D_REPO, D1)
    assert f"serving {T_REPO}@{C_MAIN}" in hub_pods["procs"]["main"].tail()


def test_gateway_reports_revisions_in_v1_models(hub_pods):
    g, http, _ = gateway(hub_pods["main"], hub_pods["drafter"], hub_pods["redis"].url, hub_pods["logs"],
                         env=hub_pods["env"])
    try:
        wait_http_ready(http, g)
        (m,) = requests.get(http + "/v1/models", timeout=10).json()["data"]
        assert (m["id"], m["revision"], m["drafter"], m["drafter_revision"]) == (T_REPO, C_MAIN, D_REPO, D1)
        r = requests.post(http + "/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 5}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
    finally:
        g.stop()


def test_gateway_refuses_replicas_of_another_revision(hub_pods):
    """Two verifiers serve revisions main and v1 of the same model: the gateway is not ready, names
    the refused replica and both commits, and never pairs a session with it."""
    from crossdraft.errors import Unavailable
    from gateway.config import GatewayConfig
    from gateway.discovery import Pool
    from gateway.server import build_gateway

    a_main, a_v1, a_d = hub_pods["main"], hub_pods["v1"], hub_pods["drafter"]
    cfg = GatewayConfig(verifier=f"{a_main},{a_v1}", drafter=a_d, redis_url=hub_pods["redis"].url,
                        connect_timeout_s=60)
    gw = build_gateway(cfg, pools=(Pool("verifier", [a_main, a_v1]), Pool("drafter", [a_d])))
    paired = {C_MAIN: a_main, C_V1: a_v1}[gw.model_revision]
    other = a_v1 if paired == a_main else a_main
    other_rev = C_V1 if paired == a_main else C_MAIN
    ok, details = gw.readiness(max_age_s=0)
    assert not ok
    assert details["verifiers"][paired] == "SERVING"
    refused = details["verifiers"][other]
    assert refused.startswith("REFUSED") and other_rev in refused and gw.model_revision in refused and T_REPO in refused
    with pytest.raises(Unavailable, match="one revision"):
        gw.decoder(other, a_d)
    assert gw.decoder(paired, a_d) is not None
    # the same through a gateway process: /readyz is 503 and says why
    g, http, _ = gateway(f"{a_main},{a_v1}", a_d, hub_pods["redis"].url, hub_pods["logs"], env=hub_pods["env"])
    try:
        body, t0 = {}, time.time()
        while time.time() - t0 < 120 and "REFUSED" not in str(body):
            assert g.alive(), g.tail()
            try:
                r = requests.get(http + "/readyz", timeout=5)
                body = r.json()
                assert r.status_code == 503, body
            except requests.RequestException:
                pass
            time.sleep(0.3)
        refused = [s for s in body["verifiers"].values() if s.startswith("REFUSED")]
        assert len(refused) == 1 and "one revision" in refused[0], body
    finally:
        g.stop()


def test_server_with_an_uncached_or_unknown_revision_fails_clearly(hub_pods):
    for args, needle in ((["--model", "nobody/uncached"], "'nobody/uncached' is not in the cache"),
                         (["--model", T_REPO, "--revision", "no-such-tag"], "revision 'no-such-tag'")):
        p, _ = _server("verifier", args, hub_pods["logs"], hub_pods["env"])
        try:
            p.p.wait(120)
        finally:
            p.kill()
        assert p.p.returncode != 0
        assert needle in p.tail(), p.tail()


def test_a_drafter_of_another_revision_is_not_paired(hub_pods):
    """Two drafters serve commits D1 and D2 of the same model: a session recorded on the one the
    gateway did not pair runs target-only and says why, instead of drafting from other weights."""
    from gateway.config import GatewayConfig
    from gateway.discovery import Pool
    from gateway.server import build_gateway

    a_main, a_d, a_d2 = hub_pods["main"], hub_pods["drafter"], hub_pods["drafter2"]
    cfg = GatewayConfig(verifier=a_main, drafter=f"{a_d},{a_d2}", redis_url=hub_pods["redis"].url,
                        connect_timeout_s=60)
    gw = build_gateway(cfg, pools=(Pool("verifier", [a_main]), Pool("drafter", [a_d, a_d2])))
    assert gw.drafter_revision in (D1, D2)
    paired, other = (a_d, a_d2) if gw.drafter_revision == D1 else (a_d2, a_d)
    assert gw.revision_conflict("drafter", paired) is None
    assert "one revision" in gw.revision_conflict("drafter", other)
    ok, details = gw.readiness(max_age_s=0)
    assert ok, details  # drafters do not gate readiness ...
    assert details["drafters"][other].startswith("REFUSED")  # ... but the refused one is reported

    def turn(sid, drafter_addr):
        s = gw.get_session(sid)
        s.drafter_address = drafter_addr  # where an earlier turn left it
        gw.store.save(s)
        return list(gw.start(session_id=sid, prompt="def add(a, b):", messages=None, options={}).events())[-1]

    sid = gw.create_session({"max_new_tokens": 6, "temperature": 0}).session_id
    done = turn(sid, other)
    assert done["stats"]["drafter_fallback"] and "revision" in done["stats"]["fallback_reason"]
    assert done["stats"]["drafted"] == 0
    sid2 = gw.create_session({"max_new_tokens": 6, "temperature": 0}).session_id
    done2 = turn(sid2, paired)
    assert not done2["stats"]["drafter_fallback"] and done2["stats"]["drafted"] > 0
    assert done2["token_ids"] == done["token_ids"]  # greedy: the same tokens either way


def test_a_gateway_left_on_the_old_revision_asks_to_be_restarted(hub_pods):
    """A revision rollout that finishes after a gateway paired the old revision: once every verifier
    has served the new one for stale_pairing_restart_s, /healthz (the liveness probe) turns 503 and
    says why, so that Kubernetes restarts the gateway, which then pairs the new revision. The pool
    is switched by hand here (as an EndpointSlice watch would switch it during the rollout)."""
    import asyncio
    import json

    from gateway.config import GatewayConfig
    from gateway.discovery import Pool
    from gateway.rest import RestApi
    from gateway.server import build_gateway

    a_main, a_v1, a_d = hub_pods["main"], hub_pods["v1"], hub_pods["drafter"]
    pool = Pool("verifier", [a_main])
    cfg = GatewayConfig(verifier=a_main, drafter=a_d, redis_url=hub_pods["redis"].url, connect_timeout_s=60,
                        stale_pairing_restart_s=1.0)
    gw = build_gateway(cfg, pools=(pool, Pool("drafter", [a_d])))
    assert gw.model_revision == C_MAIN
    api = RestApi(lambda: gw)

    def healthz():
        r = asyncio.run(api.healthz(None))
        return r.status_code, json.loads(r.body)

    def probe():  # the readiness probe (every few seconds in a pod): the check liveness then reads
        return gw.readiness(max_age_s=0)[0]

    assert healthz() == (200, {"status": "ok"})  # nothing checked yet: nothing to say
    assert probe() and gw.stale_pairing() is None and healthz() == (200, {"status": "ok"})
    pool.set([a_main, a_v1])  # mid-rollout: one replica at the paired revision is enough to stay alive
    assert not probe() and gw.stale_pairing() is None
    time.sleep(1.2)
    assert not probe() and healthz()[0] == 200
    pool.set([a_v1])  # the rollout finished
    assert not probe() and gw.stale_pairing() is None  # (not at once: a moment without them is not enough)
    time.sleep(1.2)
    assert healthz()[0] == 200  # (liveness only reads the last check: it never calls a verifier itself)
    assert not probe()
    status, body = healthz()
    assert status == 503 and body["status"] == "stale pairing", body
    assert C_V1 in body["reason"] and C_MAIN in body["reason"] and "another revision" in body["reason"]
    pool.set([a_main])  # back: alive again
    assert probe() and gw.stale_pairing() is None and healthz()[0] == 200
    # a restarted gateway pairs what the verifiers serve now
    gw2 = build_gateway(cfg, pools=(Pool("verifier", [a_v1]), Pool("drafter", [a_d])))
    assert gw2.model_revision == C_V1 and gw2.readiness(max_age_s=0)[0] and gw2.stale_pairing() is None


def test_a_verifier_serves_one_gguf_of_a_gguf_repo(tmp_path):
    """A repo of two GGUFs: --model-file (CROSSDRAFT_MODEL_FILE in the chart) picks one, the server
    reports the repo and commit and logs what the dequantised weights take; without it the server
    fails and lists the GGUFs."""
    from gateway.clients import RemoteVerifier

    repo, commit = "tiny-org/two-ggufs", fake_commit("e2e-two-ggufs")
    add_snapshot(tmp_path / "hf" / "hub", repo, gguf_sources(), commit, only=("tiny-Q8_0.gguf", "tiny-Q4_0.gguf"))
    env = hub_env(tmp_path / "hf")
    logs = tmp_path / "logs"
    logs.mkdir()
    p, addr = _server("verifier", ["--model", repo, "--model-file", "tiny-Q4_0.gguf", "--cpu-linear", "plain"], logs,
                      env)
    try:
        wait_grpc_healthy(addr, p)
        info = RemoteVerifier(addr).info()
        assert (info["model_name"], info["revision"]) == (repo, commit)
        assert "tiny-Q4_0.gguf (27.00 KiB) dequantised to float32: " in p.tail(), p.tail()
    finally:
        p.stop()
    p, _ = _server("verifier", ["--model", repo], logs, env)
    try:
        p.p.wait(120)
    finally:
        p.kill()
    assert p.p.returncode != 0
    assert "holds 2 GGUF files: tiny-Q4_0.gguf, tiny-Q8_0.gguf" in p.tail(), p.tail()
