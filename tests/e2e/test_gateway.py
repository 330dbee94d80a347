"""Through REST and gRPC, the distributed stack produces exactly the in-process engine's tokens."""

from __future__ import annotations

import json

import grpc
import pytest
import requests

from crossdraft.client import Client
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.engine import DraftConfig

PROMPTS = ["def fibonacci(n):\n", "The quick brown fox", "x = [i * i for i in range(10)]\nprint("]


def rest(stack, path, body, http=None, **kw):
    return requests.post((http or stack.http) + path, json=body, timeout=120, **kw)


def sse_texts(resp):
    pieces, final = [], None
    for line in resp.iter_lines(decode_unicode=False):
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        obj = json.loads(data)
        assert "error" not in obj, obj
        ch = obj["choices"][0]
        pieces.append(ch.get("text") or ch.get("delta", {}).get("content") or "")
        if ch["finish_reason"] is not None:
            final = obj
    return "".join(pieces), final


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_rest_equals_engine_and_target_only(stack, engine, prompt):
    ref = engine.generate(prompt, max_new_tokens=32, use_drafter=False)
    spec = engine.generate(prompt, max_new_tokens=32)
    r = rest(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 32})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == ref.text == spec.text
    assert body["usage"]["completion_tokens"] == len(ref.token_ids)
    s = body["speculative"]
    assert s["mode"] == "speculative" and s["rounds"] >= 1
    assert s["drafted"] == spec.stats.drafted and s["accepted"] == spec.stats.accepted


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_grpc_token_ids_equal_target_only(stack, engine, prompt):
    ref = engine.generate(prompt, max_new_tokens=32, use_drafter=False)
    with Client(stack.grpc) as c:
        out = c.generate(prompt, max_new_tokens=32)
    assert out.token_ids == ref.token_ids
    assert out.text == ref.text
    assert out.stats["mode"] == "speculative"
    assert out.usage["completion_tokens"] == len(ref.token_ids)


@pytest.mark.parametrize("params", [dict(temperature=1.0),
                                    dict(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2)])
def test_seeded_sampling_equals_in_process_engine(stack, engine, params):
    """Same seed, same code path: the distributed run draws exactly the in-process run's tokens (a
    seeded request gets coupled draws from a verifier that has them)."""
    for seed in (1, 2):
        ref = engine.generate(PROMPTS[0], max_new_tokens=24, params=SamplingParams(**params, coupled=True), seed=seed)
        with Client(stack.grpc) as c:
            out = c.generate(PROMPTS[0], max_new_tokens=24, seed=seed, **params)
        assert out.token_ids == ref.token_ids
        assert out.stats["drafted"] == ref.stats.drafted and out.stats["accepted"] == ref.stats.accepted


def test_fixed_block_size_matches_engine(stack, engine):
    ref = engine.generate(PROMPTS[1], max_new_tokens=24,
                          draft=DraftConfig(num_draft_tokens=3, adaptive=False, mode="tli"),
                          params=SamplingParams(temperature=0.7, coupled=True), seed=5)
    with Client(stack.grpc) as c:
        out = c.generate(PROMPTS[1], max_new_tokens=24, num_draft_tokens=3, adaptive_draft=False, temperature=0.7,
                         seed=5)
    assert out.token_ids == ref.token_ids
    assert out.stats["drafted"] == ref.stats.drafted > 0


def test_a_seed_gives_the_same_text_with_or_without_the_drafter(stack, engine):
    """Coupled draws over REST: a seeded completion's text depends on (seed, prompt) alone -- drafted
    in blocks of any size or not at all -- and equals the in-process target-only run's."""
    drafted = 0
    for seed in (1, 2, 3):
        body = {"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0.9, "seed": seed}
        spec = rest(stack, "/v1/completions", body).json()
        fixed = rest(stack, "/v1/completions", dict(body, num_draft_tokens=5, adaptive_draft=False)).json()
        alone = rest(stack, "/v1/completions", dict(body, use_drafter=False)).json()
        ref = engine.generate(PROMPTS[1], max_new_tokens=24, params=SamplingParams(temperature=0.9, coupled=True),
                              seed=seed, use_drafter=False)
        assert spec["choices"][0]["text"] == fixed["choices"][0]["text"] == alone["choices"][0]["text"] == ref.text
        assert alone["speculative"]["drafted"] == 0
        assert {r["speculative"]["draws"] for r in (spec, fixed, alone)} == {"coupled"}
        drafted += fixed["speculative"]["drafted"]
    assert drafted > 0
    # without a seed, sampling keeps the rejection rule; greedy says so too
    unseeded = rest(stack, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0.9}).json()
    greedy = rest(stack, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 8}).json()
    assert (unseeded["speculative"]["draws"], greedy["speculative"]["draws"]) == ("rejection", "greedy")


@pytest.mark.parametrize("http_attr", ["http", "http2"])
def test_sse_stream_concatenates_to_the_non_streaming_text(stack, http_attr):
    http = getattr(stack, http_attr)
    body = {"prompt": PROMPTS[0], "max_tokens": 40}
    whole = rest(stack, "/v1/completions", body, http=http).json()
    r = rest(stack, "/v1/completions", dict(body, stream=True), http=http, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    text, final = sse_texts(r)
    assert text == whole["choices"][0]["text"]
    assert final["usage"] == whole["usage"]
    assert final["speculative"]["rounds"] == whole["speculative"]["rounds"]


def test_grpc_stream_deltas_concatenate(stack):
    with Client(stack.grpc) as c:
        pieces = list(c.stream(PROMPTS[2], max_new_tokens=30, temperature=0.9, seed=4))
        whole = c.generate(PROMPTS[2], max_new_tokens=30, temperature=0.9, seed=4)
    assert "".join(pieces) == whole.text
    assert whole.stats["draws"] == "coupled"


def test_session_continues_identically_on_a_second_gateway(stack):
    """Two sessions, same seed and history; turn 2 runs on gateway A for one and B for the other."""
    with Client(stack.grpc) as a, Client(stack.grpc2) as b:
        s1 = a.create_session(temperature=0.8, seed=11, max_new_tokens=16)
        s2 = a.create_session(temperature=0.8, seed=11, max_new_tokens=16)
        t1 = a.generate("def add(a, b):", session_id=s1)
        t1b = a.generate("def add(a, b):", session_id=s2)
        assert t1.token_ids == t1b.token_ids
        u1 = a.generate("\n# next\n", session_id=s1)
        u2 = b.generate("\n# next\n", session_id=s2)
        assert u1.token_ids == u2.token_ids and len(u1.token_ids) > 0
        info = b.get_session(s2)
        assert info["turns"] == 2
        assert info["text"] == "def add(a, b):" + t1b.text + "\n# next\n" + u2.text
        assert a.delete_session(s1) and a.delete_session(s2)
        assert not a.delete_session(s1)


def test_session_turn_two_reuses_kv_caches(stack):
    with Client(stack.grpc) as c:
        sid = c.create_session(max_new_tokens=12)
        c.generate("def add(a, b):", session_id=sid)
        second = c.generate(" return", session_id=sid)
        assert second.stats["reused_target_tokens"] > 5
        assert second.stats["reused_drafter_tokens"] > 3
        c.delete_session(sid)


def test_session_via_rest_and_turns_are_consistent_with_one_long_run(stack, engine):
    """Greedy: prompt + continuation in one session == the same text generated in one go."""
    r = requests.post(stack.http + "/v1/sessions", json={"max_tokens": 10}, timeout=30)
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    t1 = rest(stack, "/v1/completions", {"prompt": PROMPTS[0], "session_id": sid}).json()
    assert t1["session_id"] == sid
    got = requests.get(f"{stack.http}/v1/sessions/{sid}", timeout=30).json()
    assert got["turns"] == 1 and got["text"] == PROMPTS[0] + t1["choices"][0]["text"]
    assert requests.delete(f"{stack.http}/v1/sessions/{sid}", timeout=30).status_code == 200
    assert requests.get(f"{stack.http}/v1/sessions/{sid}", timeout=30).status_code == 404


def test_models_vocab_health_metrics(stack):
    m = requests.get(stack.http + "/v1/models", timeout=10).json()
    assert m["object"] == "list" and m["data"][0]["id"].endswith("tiny-target")
    v = requests.get(stack.http + "/v1/vocab", timeout=10).json()
    assert v["drafter_allowed_tli"] > 0 and v["target_vocab_size"] > 0
    # no --draft-vocab: the drafter drafts from the whole intersection
    assert v["draft_vocab"] == 0 and v["drafter_drafts_tli"] == v["drafter_allowed_tli"]
    assert requests.get(stack.http + "/healthz", timeout=10).status_code == 200
    assert requests.get(stack.http + "/readyz", timeout=10).status_code == 200
    rest(stack, "/v1/completions", {"prompt": "abc", "max_tokens": 8})
    text = requests.get(stack.http + "/metrics", timeout=10).text
    for name in ("crossdraft_requests_total", "crossdraft_rounds_total", "crossdraft_drafted_tokens_total",
                 "crossdraft_accepted_tokens_total", "crossdraft_accepted_by_position_total",
                 'crossdraft_round_seconds_bucket{le="0.001",phase="overhead"}', "crossdraft_completion_tokens_total"):
        assert name in text, name
    # the chooser of draft lengths: every speculative round lands in the histogram of blocks verified
    hist = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines()
            if ln.startswith("crossdraft_draft_length_")}
    assert hist["crossdraft_draft_length_count"] >= 1
    assert hist['crossdraft_draft_length_bucket{le="+Inf"}'] == hist["crossdraft_draft_length_count"]


def test_health_and_reflection_on_every_service(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for addr, svc in ((stack.verifier_addr, "crossdraft.v1.VerifierService"),
                      (stack.drafter_addr, "crossdraft.v1.DrafterService"),
                      (stack.grpc, "crossdraft.v1.GatewayService")):
        with grpc.insecure_channel(addr) as ch:
            st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=svc), timeout=10)
            assert st.status == health_pb2.HealthCheckResponse.SERVING
            resp = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
            names = {s.name for r in resp for s in r.list_services_response.service}
            assert svc in names and "grpc.health.v1.Health" in names


def test_api_keys_guard_rest_and_grpc(stack):
    from tests.service_fixtures import gateway, wait_http_ready

    g, http, grpc_addr = gateway(stack.verifier_addr, stack.drafter_addr, stack.redis.url, stack.log_dir,
                                 env={"CROSSDRAFT_API_KEYS": "key-one, key-two"})
    try:
        wait_http_ready(http, g)
        body = {"prompt": "abc", "max_tokens": 4}
        r = requests.post(http + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["param"] == "authorization"
        r = requests.post(http + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}, timeout=60)
        assert r.status_code == 401
        r = requests.post(http + "/v1/completions", json=body, headers={"Authorization": "Bearer key-two"}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert requests.get(http + "/healthz", timeout=10).status_code == 200  # probes need no key
        from crossdraft.v1 import gateway_pb2, gateway_pb2_grpc

        with grpc.insecure_channel(grpc_addr) as ch:
            stub = gateway_pb2_grpc.GatewayServiceStub(ch)
            req = gateway_pb2.GenerateRequest(prompt="abc", options=gateway_pb2.GenerationOptions(max_new_tokens=4))
            with pytest.raises(grpc.RpcError) as ei:
                list(stub.Generate(req, timeout=60))
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
            out = list(stub.Generate(req, timeout=60, metadata=[("authorization", "Bearer key-one")]))
            assert out[-1].done.usage.completion_tokens == 4
    finally:
        g.stop()


def test_model_servers_hand_out_their_tokenizers(stack, tmp_path):
    """The gateway tokenizes with the servers' own tokenizers (no model copy needed)."""
    from transformers import AutoTokenizer

    from crossdraft.vocab.tokenbytes import token_bytes
    from gateway.clients import RemoteDrafter, RemoteVerifier

    for cls, addr in ((RemoteVerifier, stack.verifier_addr), (RemoteDrafter, stack.drafter_addr)):
        c = cls(addr)
        files, digest = c.tokenizer_files()
        assert "tokenizer.json" in files and digest == c.info()["tokenizer_digest"] and len(digest) == 64
        d = tmp_path / cls.__name__
        d.mkdir()
        for name, content in files.items():
            (d / name).write_bytes(content)
        tok = AutoTokenizer.from_pretrained(str(d))
        assert len(token_bytes(tok)) > 100
        c.close()


def test_concurrent_requests_give_the_same_tokens_as_sequential_ones(stack):
    """Six requests at once over both gateways (greedy and seeded sampling): each gets exactly the
    tokens it gets alone -- sessions on the shared model servers do not interfere."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(PROMPTS[i % 3], dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.9, seed=i)) for i in range(6)]

    def run(i):
        prompt, kw = jobs[i]
        addr = stack.grpc if i % 2 == 0 else stack.grpc2
        with Client(addr) as c:
            return c.generate(prompt, max_new_tokens=20, **kw).token_ids

    alone = [run(i) for i in range(len(jobs))]
    with ThreadPoolExecutor(len(jobs)) as ex:
        together = list(ex.map(run, range(len(jobs))))
    assert together == alone


def test_model_servers_fork_sessions_over_grpc(stack):
    """ForkVerifierSession / ForkDrafterSession through real servers: the fork starts with the
    source's prefilled cache; bad requests are INVALID_ARGUMENT / NOT_FOUND naming the field, and
    the servers keep serving."""
    from crossdraft.decoding.messages import Expect
    from crossdraft.errors import InvalidArgument, NotFound
    from gateway.clients import RemoteDrafter, RemoteVerifier

    ids = [5, 6, 7, 8, 9, 10, 11]
    for cls, addr in ((RemoteVerifier, stack.verifier_addr), (RemoteDrafter, stack.drafter_addr)):
        c = cls(addr)
        try:
            reused, exp = c.sync("fork-src", ids, prefill=True)
            assert reused == 0 and exp == Expect.of(ids)
            shared, exp = c.fork("fork-src", "fork-dst")
            assert shared == len(ids) - 1 and exp == Expect.of(ids)
            assert c.sync("fork-dst", ids)[0] == len(ids) - 1  # the fork's cache is there
            with pytest.raises(NotFound, match="source_session_id"):
                c.fork("no-such-session", "fork-x")
            with pytest.raises(InvalidArgument, match="session_id"):
                c.fork("fork-src", "fork-src")
            with pytest.raises(InvalidArgument, match="source_session_id"):
                c.fork("", "fork-x")
            assert c.end("fork-src") and c.end("fork-dst")
        finally:
            c.close()


def test_a_gateway_with_a_smaller_draft_vocabulary_gives_the_same_greedy_text(stack, tmp_path):
    """--draft-vocab N: the drafter server registers the smaller masks (its head pruned to them), and
    greedy completions stay the target's own, through a real gateway process."""
    from tests.service_fixtures import gateway, wait_http_ready

    g, http, _ = gateway(stack.verifier_addr, stack.drafter_addr, stack.redis.url, tmp_path, drafter_timeout_s=5,
                         extra=["--draft-vocab", "150"])
    try:
        wait_http_ready(http, g)
        v = requests.get(http + "/v1/vocab", timeout=10).json()
        assert v["draft_vocab"] == 150
        assert 0 < v["drafter_drafts_tli"] < v["drafter_allowed_tli"]
        assert 0 < v["drafter_drafts_text"] < v["drafter_allowed_text"]
        for prompt in ("def fib(n):", "The quick brown fox"):
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
            ref = rest(stack, "/v1/completions", dict(body, use_drafter=False)).json()
            out = rest(stack, "/v1/completions", body, http=http).json()
            assert out["choices"][0]["text"] == ref["choices"][0]["text"]
            assert out["speculative"]["drafted"] > 0
    finally:
        g.stop()
