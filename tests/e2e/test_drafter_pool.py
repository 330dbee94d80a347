"""A pool of drafter kinds behind one gateway (gateway/pool.py, ``--drafter-pool``), through the real services.

On the shared e2e stack's verifier, Redis and drafter ("far": a random model of another vocabulary, which
cannot draft this target's text, acceptance about 0; listed first) plus this file's own drafter process
("close": the target plus a little noise, same vocabulary, most of its drafts accepted) and its own gateway,
``--drafter <far> --drafter-pool close=<close>``. Costs are static (tests/e2e/conftest.py) and blocks fixed
(3 drafts a round, not adaptive: tiny models' rounds are so short that a gRPC call costs what a forward
does, and an adaptive policy would rightly draft with neither kind), so the kinds are compared by the rate
of that block at each kind's acceptance. The last test kills the close drafter."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
import requests

from crossdraft.client import Client
from tests.service_fixtures import (
    TcpRelay,
    free_port,
    gateway,
    metric_value,
    model_server,
    stream_and_kill,
    wait_grpc_healthy,
    wait_http_ready,
)

N_NEW = 40
FIXED = {"num_draft_tokens": 3, "adaptive_draft": False}
PROMPTS = ["def fibonacci(n):\n", "The quick brown fox", "x = [i * i for i in range(10)]\nprint("]


@pytest.fixture(scope="module")
def close_dir(tiny_dirs, tmp_path_factory):
    """The shared stack's target plus noise of a tenth of each weight tensor's spread, on disk."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    t_dir, _ = tiny_dirs
    out = tmp_path_factory.mktemp("pool-models") / "close"
    model = AutoModelForCausalLM.from_pretrained(t_dir, dtype=torch.float32)
    torch.manual_seed(9)
    with torch.no_grad():
        for prm in model.parameters():
            prm.add_(0.1 * prm.std() * torch.randn_like(prm))
    model.save_pretrained(out)
    for f in t_dir.iterdir():  # the tokenizer's files
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json", "merges.txt"):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def pool(stack, close_dir):
    close, close_addr = model_server("drafter", str(close_dir), stack.log_dir, extra=["--quantize", "none"])
    gw = None
    try:
        wait_grpc_healthy(close_addr, close)
        gw, http, grpc_addr = gateway(stack.verifier_addr, stack.drafter_addr, stack.redis.url, stack.log_dir,
                                      drafter_timeout_s=5, extra=["--drafter-pool", f"close={close_addr}"])
        wait_http_ready(http, gw)
        yield {"http": http, "grpc": grpc_addr, "close": close, "close_addr": close_addr}
    finally:
        for p in (gw, close):
            if p is not None:
                p.stop()


def complete(http: str, body: dict) -> dict:
    r = requests.post(http + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def reference(pool) -> dict:
    return {p: complete(pool["http"], {"prompt": p, "max_tokens": N_NEW, "use_drafter": False}) for p in PROMPTS}


def test_the_gateway_lists_its_drafter_kinds(pool):
    d = requests.get(pool["http"] + "/v1/models", timeout=30).json()["data"][0]
    assert [k["name"] for k in d["drafters"]][1:] == ["close"] and len(d["drafters"]) == 2


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_with_the_pool_is_the_target_only_text(pool, reference, prompt):
    body = complete(pool["http"], {"prompt": prompt, "max_tokens": N_NEW, **FIXED})
    ref = reference[prompt]
    assert body["choices"][0]["text"] == ref["choices"][0]["text"]
    assert body["usage"] == ref["usage"]
    names = [k["name"] for k in requests.get(pool["http"] + "/v1/models", timeout=30).json()["data"][0]["drafters"]]
    assert body["speculative"]["drafter"] in names


def test_grpc_greedy_with_the_pool_gives_the_target_only_ids(pool):
    with Client(pool["grpc"]) as c:
        ref = c.generate(PROMPTS[0], max_new_tokens=N_NEW, use_drafter=False)
        got = c.generate(PROMPTS[0], max_new_tokens=N_NEW, **FIXED)
    assert got.token_ids == ref.token_ids and got.stats["drafter"]


def test_a_session_the_first_kind_cannot_draft_for_ends_on_the_other_and_keeps_it(stack, pool):
    """Turn 1, the first request of its prompt's class (Cyrillic prose: no earlier test sent one), ends on
    "close" -- started on "far" (first in the gateway's order), it explores "close"; started on "close" (its
    tokenizer spells the prompt more compactly), it explores "far" too when its fixed blocks do not pay at
    static costs, and comes back -- and the session stores the kind and its estimates; turn 2 starts on
    "close" and stays there. A new request of the same class then starts on "close" from what turn 1
    measured (the gateway's priors, kept in Redis for every gateway replica of the target), without
    exploring."""
    http = pool["http"]
    prompt = "Привет, мир! Как дела сегодня"
    ref = complete(http, {"prompt": prompt, "max_tokens": N_NEW, "use_drafter": False})["choices"][0]["text"]
    before = choices_of(http, "close")
    sid = requests.post(http + "/v1/sessions", json={"max_tokens": N_NEW, **FIXED}, timeout=30).json()["session_id"]
    try:
        one = complete(http, {"prompt": prompt, "session_id": sid})
        s1 = one["speculative"]
        assert one["choices"][0]["text"] == ref
        assert s1["drafter"] == "close" and s1["drafter_switches"] >= 1, s1
        assert s1["drafter_choice"] in ("explore", "exploit"), s1
        assert s1["accepted"] > 0
        info = requests.get(f"{http}/v1/sessions/{sid}", timeout=30).json()
        assert info["drafter_kind"] == "close"
        two = complete(http, {"prompt": " and then", "session_id": sid})
        s2 = two["speculative"]
        assert s2["drafter"] == "close" and s2["drafter_switches"] == 0, s2
        assert s2["reused_drafter_tokens"] > 0  # the close drafter kept the session's cache from turn 1
    finally:
        requests.delete(f"{http}/v1/sessions/{sid}", timeout=30)
    assert choices_of(http, "close") >= before + 2  # (turn 1 moved to it or started on it; turn 2 started on it)
    primed = metric_value(http, "crossdraft_drafter_choices_total", '{drafter="close",outcome="prior"}')
    again = complete(http, {"prompt": prompt, "max_tokens": N_NEW, **FIXED})
    assert again["choices"][0]["text"] == ref
    s3 = again["speculative"]
    assert s3["drafter"] == "close" and s3["drafter_switches"] == 0 and s3["drafter_choice"] == "prior", s3
    assert metric_value(http, "crossdraft_drafter_choices_total", '{drafter="close",outcome="prior"}') == primed + 1
    assert metric_value(http, "crossdraft_drafter_tokens_total", '{drafter="close",outcome="accepted"}') > 0
    import redis

    r = redis.Redis.from_url(stack.redis.url)
    shared = {k: v for key in r.scan_iter("crossdraft:pool-priors:*") for k, v in r.hgetall(key).items()}
    assert "close" in json.loads(shared[b"other/prose"]), shared


def test_a_drafter_down_at_start_is_paired_once_it_answers(stack, pool, reference):
    """A gateway whose only drafter does not answer at its start (drafter_start_wait_s 0) starts all the
    same, target-only, and its readiness says so; once the address answers (a relay to the running close
    drafter opens there) the gateway pairs it within seconds and the next request drafts with it -- the
    same text either way."""
    from gateway.config import GatewayConfig
    from gateway.server import build_gateway

    port = free_port()
    relay = TcpRelay(port, pool["close_addr"])
    cfg = GatewayConfig(verifier=stack.verifier_addr, drafter=f"127.0.0.1:{port}", redis_url=stack.redis.url,
                        connect_timeout_s=60, drafter_start_wait_s=0)

    def run(gw):
        job = gw.start(session_id=None, prompt=PROMPTS[0], messages=None, options={"max_new_tokens": N_NEW, **FIXED})
        done = list(job.events())[-1]
        assert done["text"] == reference[PROMPTS[0]]["choices"][0]["text"]
        return done["stats"]

    try:
        gw = build_gateway(cfg)
        ok, details = gw.readiness(max_age_s=0)
        assert ok and list(details["pending_drafter_kinds"]) == ["drafter"], details
        assert not gw.kinds and not gw.has_drafter
        assert run(gw)["drafted"] == 0
        relay.start()
        deadline = time.time() + 60
        while gw.pending:
            assert time.time() < deadline, f"not paired within 60 s of answering: {gw.pending}"
            time.sleep(0.2)
        assert "pending_drafter_kinds" not in gw.readiness(max_age_s=0)[1]
        stats = run(gw)
        assert stats["drafted"] > 0 and stats["accepted"] > 0, stats
    finally:
        relay.stop()


class FakeKubernetesApi:
    """Stands in for a Kubernetes API server (none runs here), over real HTTP for the real kubernetes client:
    LIST of a Service's EndpointSlices from ``slices`` ({service: [host:port]}), and WATCH streams that stay
    open and carry the ADDED events that ``add(service, name, address)`` sends."""

    def __init__(self, slices: dict[str, list[str]]):
        import http.server
        import json
        import queue
        import threading
        import urllib.parse

        self.slices, self.events = slices, {svc: queue.Queue() for svc in slices}
        self.stop = threading.Event()
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                q = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                svc = q["labelSelector"][0].partition("=")[2]
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if q.get("watch", ["false"])[0] != "true":
                    body = json.dumps({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                       "metadata": {"resourceVersion": "10"},
                                       "items": [api.slice(svc, f"{svc}-{i}", a)
                                                 for i, a in enumerate(api.slices[svc])]}).encode()
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_header("Transfer-Encoding", "chunked")  # (as an API server streams a watch)
                self.end_headers()
                while not api.stop.is_set():  # a watch: events as they come, until the server stops
                    with contextlib.suppress(queue.Empty):
                        line = (json.dumps(api.events[svc].get(timeout=0.2)) + "\n").encode()
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                        self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    @staticmethod
    def slice(svc: str, name: str, address: str) -> dict:
        host, _, port = address.rpartition(":")
        return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                "metadata": {"name": name, "resourceVersion": "11",
                             "labels": {"kubernetes.io/service-name": svc}},
                "endpoints": [{"addresses": [host], "conditions": {"ready": True}}],
                "ports": [{"name": "grpc", "port": int(port), "protocol": "TCP"}]}

    def add(self, svc: str, name: str, address: str) -> None:
        self.events[svc].put({"type": "ADDED", "object": self.slice(svc, name, address)})

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def test_kubernetes_discovery_of_several_drafter_services(stack, pool, reference, tmp_path, monkeypatch):
    """--discovery kubernetes with --drafter-pool-service: the gateway watches each kind's Service (through a
    fake API server: LIST + WATCH over HTTP, the real kubernetes client), pairs the kinds whose EndpointSlices
    list a ready pod, starts without the one whose Service has none yet, and pairs it when a WATCH event adds
    its pod; requests draft with the kinds and give the target-only text."""
    from gateway.config import GatewayConfig
    from gateway.server import build_gateway

    api = FakeKubernetesApi({"verifier": [stack.verifier_addr], "far": [stack.drafter_addr],
                             "close": [pool["close_addr"]], "late": []})
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "{api.url}"}}}}]
users: [{{name: test, user: {{token: unused}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: test, namespace: llm}}}}]
current-context: fake
""")
    from kubernetes.config import kube_config

    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    # (the client reads $KUBECONFIG once, when first imported: possibly before this test)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    cfg = GatewayConfig(verifier=None, discovery="kubernetes", verifier_service="verifier", drafter_service="far",
                        drafter_pool_services=(("close", "close"), ("late", "late")), namespace="llm",
                        redis_url=stack.redis.url, connect_timeout_s=60, drafter_start_wait_s=0)
    gw = None
    try:
        gw = build_gateway(cfg)
        deadline = time.time() + 60  # (a kind whose watch had not listed its pods yet is paired moments later)
        while set(gw.pending) != {"drafter:late"}:
            assert time.time() < deadline, gw.pending
            time.sleep(0.1)
        assert list(gw.kinds)[1:] == ["close"]
        assert gw.placement.pools["drafter:close"].addresses() == [pool["close_addr"]]
        api.add("late", "late-0", pool["close_addr"])
        deadline = time.time() + 60
        while gw.pending:
            assert time.time() < deadline, gw.pending
            time.sleep(0.2)
        assert list(gw.kinds)[1:] == ["close", "late"]
        job = gw.start(session_id=None, prompt=PROMPTS[2], messages=None, options={"max_new_tokens": N_NEW, **FIXED})
        done = list(job.events())[-1]
        assert done["text"] == reference[PROMPTS[2]]["choices"][0]["text"]
        assert done["stats"]["drafted"] > 0 and done["stats"]["drafter"] in gw.kinds
    finally:
        for w in gw.watchers if gw is not None else ():
            w.stop()
        api.close()


NONE_PROMPT = "функция квадрат(х) { вернуть х * х; }\n"  # (a class no other test here sends)


def test_a_class_where_no_kind_paid_runs_target_only_until_its_estimates_expire(stack, pool):
    """The class's estimates in the stack's Redis (as its requests teach them) say both kinds were measured
    and neither paid: a new request of the class with adaptive blocks runs target-only -- the target-only
    text, choice "none", no drafter touched -- and ages the estimates; once they expire, the next request
    of the class measures the kinds again."""
    import redis

    from gateway.pool import STALE, text_class

    http = pool["http"]
    cls = text_class(NONE_PROMPT)
    d = requests.get(http + "/v1/models", timeout=30).json()["data"][0]
    kinds = [k["name"] for k in d["drafters"]]
    r = redis.Redis.from_url(stack.redis.url)
    key = f"crossdraft:pool-priors:{d['id']}"

    def teach(age: int) -> None:
        r.hset(key, cls, json.dumps({k: {"v": 1.0, "a": 0.0, "age": age} for k in kinds}))

    ref = complete(http, {"prompt": NONE_PROMPT, "max_tokens": N_NEW, "use_drafter": False})
    teach(0)
    none = metric_value(http, "crossdraft_drafter_choices_total", '{drafter="",outcome="none"}')
    got = complete(http, {"prompt": NONE_PROMPT, "max_tokens": N_NEW})
    s = got["speculative"]
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    assert s["drafter_choice"] == "none" and s["mode"] == "target-only" and s["drafted"] == 0, s
    assert not s["drafter_fallback"] and s["drafter"] == "", s
    assert metric_value(http, "crossdraft_drafter_choices_total", '{drafter="",outcome="none"}') == none + 1
    assert sorted(p["age"] for p in json.loads(r.hget(key, cls)).values()) == [1] * len(kinds)
    teach(STALE - 1)  # (one request short of expiring)
    assert complete(http, {"prompt": NONE_PROMPT, "max_tokens": N_NEW})["speculative"]["drafter_choice"] == "none"
    assert json.loads(r.hget(key, cls)) == {}
    again = complete(http, {"prompt": NONE_PROMPT, "max_tokens": N_NEW})
    assert again["choices"][0]["text"] == ref["choices"][0]["text"]
    assert again["speculative"]["mode"] == "speculative" and again["speculative"]["drafter"] in kinds
    assert set(json.loads(r.hget(key, cls))) <= set(kinds) and json.loads(r.hget(key, cls))


ONE_PROMPT = "Расскажи мне короткую историю о старом доме у реки.\n"  # (a class no other test sends)


def test_one_drafter_kind_with_measured_costs_learns_its_prompt_classes(stack, tiny_dirs):
    """A gateway with a single drafter (no pool) uses what its prompts' classes measured, as a pool does,
    where its requests price drafting with measured costs (this test's own verifier and drafter time their
    forwards): a request of a class with no estimates drafts and teaches the class what its rounds measured;
    where the class says drafting was worth nothing, a new request runs target-only (the target-only text,
    choice "none") and ages the estimate. The shared stack's gateways (static costs, the same drafter and
    Redis) do not use the estimates: a request's choices there stay a function of its own tokens."""
    import redis

    from gateway.pool import text_class

    t_dir, d_dir = tiny_dirs
    measure = {"CROSSDRAFT_COST_PROFILE": "measure"}
    procs = []
    try:
        v, vaddr = model_server("verifier", str(t_dir), stack.log_dir, env=measure)
        d, daddr = model_server("drafter", str(d_dir), stack.log_dir, env=measure, extra=["--quantize", "none"])
        procs += [v, d]
        wait_grpc_healthy(vaddr, v)
        wait_grpc_healthy(daddr, d)
        gw, http, _ = gateway(vaddr, daddr, stack.redis.url, stack.log_dir, drafter_timeout_s=5, env=measure)
        procs.append(gw)
        wait_http_ready(http, gw)
        cls = text_class(ONE_PROMPT)
        m = requests.get(http + "/v1/models", timeout=30).json()["data"][0]
        r = redis.Redis.from_url(stack.redis.url)
        key = f"crossdraft:pool-priors:{m['id']}"
        r.hdel(key, cls)
        body = {"prompt": ONE_PROMPT, "max_tokens": N_NEW}
        ref = complete(http, dict(body, use_drafter=False))["choices"][0]["text"]
        first = complete(http, body)
        assert first["choices"][0]["text"] == ref
        # (it starts with no estimate; "none" where its own rounds find that nothing pays before it ends)
        s = first["speculative"]
        assert s["mode"] == "speculative" and s["drafter_choice"] in ("start", "none"), s
        learned = json.loads(r.hget(key, cls))
        (kind,) = learned  # (the one kind, named after its model)
        assert learned[kind]["age"] == 0 and learned[kind]["model"], learned
        r.hset(key, cls, json.dumps({kind: dict(learned[kind], v=1.0)}))  # (worth nothing, whatever it measured)
        got = complete(http, body)
        s = got["speculative"]
        assert got["choices"][0]["text"] == ref
        assert s["drafter_choice"] == "none" and s["mode"] == "target-only" and s["drafted"] == 0, s
        assert json.loads(r.hget(key, cls))[kind]["age"] == 1
        for url in (stack.http, stack.http2):  # static costs: the estimate is not used, nor taught
            s = complete(url, body)["speculative"]
            assert s["mode"] == "speculative" and s["drafter_choice"] == "", s
        assert json.loads(r.hget(key, cls))[kind]["age"] == 1
    finally:
        for p in reversed(procs):
            p.stop()


CHI_PROMPT = "Le renard brun rapide saute"  # (a class no other test here sends: its requests start without priors)
CHI_SAMPLES, CHI_N = 800, 16


def test_rest_sampling_with_the_pool_follows_the_target_distribution(tiny_dirs, close_dir, pool, tmp_path_factory):
    """Chi-square guard through REST with the pool: the first two tokens of unseeded sampled completions
    (top-k 8 at T 0.7: the tiny target's distribution is nearly flat, and 64 cells give a test with power)
    against target-only's exact joint distribution, computed in process on the served target's weights.
    One-token blocks: the first token is a draft's accept-or-resample, the second the bonus token or the
    next block's. The requests choose their kind as any do (the first of this class without priors, the
    later ones from it); both branches of the acceptance rule occur. A false alarm once in 10,000 runs."""
    from crossdraft.decoding.sampling import SamplingParams
    from crossdraft.engine import Engine
    from crossdraft.models.loading import load_model
    from gateway.rest_json import _token_text
    from tests import exact

    t_dir, _ = tiny_dirs
    engine = Engine(load_model(str(t_dir), dtype="float32"), load_model(str(close_dir), dtype="float32"),
                    vocab_cache_dir=tmp_path_factory.mktemp("vocab"))
    params = SamplingParams(temperature=0.7, top_k=8)
    eos = engine.target.eos_token_ids
    expected: dict = {}
    prompt_ids = engine.pair.encode_target(CHI_PROMPT)
    for (t1, t2), p in exact.exact_two_token_distribution(engine, prompt_ids, params).items():
        key = () if t1 in eos else (_token_text(engine.pair, t1)[0],) if t2 in eos else (
            _token_text(engine.pair, t1)[0], _token_text(engine.pair, t2)[0])
        expected[key] = expected.get(key, 0.0) + p
    body = {"prompt": CHI_PROMPT, "max_tokens": 3, "temperature": 0.7, "top_k": 8, "num_draft_tokens": 1,
            "adaptive_draft": False, "logprobs": 0, "n": CHI_N}
    counts: dict = {}
    stats = {"drafted": 0, "accepted": 0}
    kinds: set = set()
    for _ in range(CHI_SAMPLES // CHI_N):
        r = complete(pool["http"], body)
        s = r["speculative"]
        assert s["draws"] == "rejection"
        for c in r["choices"]:
            key = tuple(c["logprobs"]["tokens"][:2])
            counts[key] = counts.get(key, 0) + 1
        for k in stats:
            stats[k] += s[k]
        kinds.add(s["drafter"])
    (chi2, pvalue), cells = exact.chi_square(counts, expected, sum(counts.values()))
    assert cells >= 20, "distribution too concentrated to test anything"
    assert pvalue > 1e-4, f"chi2={chi2:.1f} over {cells} cells, p={pvalue:.2e}"
    assert 0 < stats["accepted"] < stats["drafted"], stats  # both branches of the acceptance rule
    assert len(kinds) == 2, kinds  # each kind drafted for some of them (the first request explores)


def test_killing_one_kind_mid_request_completes_with_the_same_text(pool):
    """A session settled on "close"; its drafter SIGKILLed once a third of a streamed turn has arrived: the
    turn completes with the text of the same turns run target-only, failing over to the other kind (or,
    were none left, target-only)."""
    http = pool["http"]
    first, second = PROMPTS[2][:12], PROMPTS[2][12:]

    def session(**opts):
        return requests.post(http + "/v1/sessions", json={"max_tokens": 8, **opts}, timeout=30).json()["session_id"]

    ref_sid = session(use_drafter=False)
    complete(http, {"prompt": first, "session_id": ref_sid})
    text = complete(http, {"prompt": second, "session_id": ref_sid, "max_tokens": 96})["choices"][0]["text"]
    sid = session(**FIXED)
    complete(http, {"prompt": first, "session_id": sid})  # settles the session on a kind
    streamed, final, killed = stream_and_kill(http, {"prompt": second, "session_id": sid, "max_tokens": 96},
                                              pool["close"], len(text) // 3)
    assert killed and final is not None
    assert streamed == text
    s = final["speculative"]
    assert s["drafter_choice"] == "failover" or s["drafter_fallback"], s
    for x in (ref_sid, sid):
        requests.delete(f"{http}/v1/sessions/{x}", timeout=30)


def choices_of(http: str, kind: str) -> float:
    """crossdraft_drafter_choices_total of `kind`, over the outcomes that put a request on it."""
    return sum(metric_value(http, "crossdraft_drafter_choices_total", f'{{drafter="{kind}",outcome="{o}"}}')
               for o in ("start", "prior", "explore", "exploit", "failover"))
