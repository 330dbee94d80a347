"""Pipelined rounds through the real services (crossdraft.decoding.pipeline, gateway ``--pipeline``).

One stack of this file's own, on 127.0.0.1: a Redis server, a verifier and a drafter (each with its
Prometheus port, so that their work can be counted), a gateway with ``--pipeline on``, one with
``--pipeline off`` and one with ``--pipeline on --branch on`` on the same model servers (on loopback
``auto`` would mean off: the two models count as colocated). The drafter is the target plus noise
(same vocabulary; peaked heads), so most blocks are accepted whole -- the pipelined path, the round's
own token dropped -- and some are not -- the block drafted ahead dropped. The test that kills a
drafter starts its own drafter and gateway on this stack's verifier and Redis.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlparse

import pytest
import requests

from crossdraft.client import Client
from crossdraft.decoding.sampling import SamplingParams
from gateway.rest_json import _token_text
from tests import exact
from tests.service_fixtures import (
    Proc,
    Services,
    free_port,
    gateway,
    metric_settled,
    metric_value,
    model_server,
    stream_and_kill,
    wait_grpc_healthy,
    wait_http_ready,
)

PROMPTS = ["def fibonacci(n):\n", "The quick brown fox", "x = [i * i for i in range(10)]\nprint("]
FIXED = {"num_draft_tokens": 3, "adaptive_draft": False}
N_NEW = 32
# the chi-square guard: samples of the first two tokens, through REST, n completions per request
CHI_PROMPT = "The quick brown fox"
CHI_SAMPLES = 1_200
CHI_N = 16


@dataclass
class PipeStack:
    services: Services
    vaddr: str
    daddr: str
    v_metrics: str  # the verifier's Prometheus base URL
    d_metrics: str
    drafter: Proc
    on: str  # REST base URL of the pipelined gateway
    on_grpc: str
    off: str  # REST base URL of the serial gateway
    off_grpc: str
    branch: str  # REST base URL of the gateway drafting branches beside its blocks ahead


@pytest.fixture(scope="module")
def close_pair(tmp_path_factory):
    """(target, drafter) as TinyLMs and their directories: a qwen2-style target with peaked heads and
    a drafter = target + noise (same tokenizer)."""
    from tests.tiny_models import noisy_copy, tiny_lm
    from tests.tokenizers_fixtures import bytelevel_bpe_tokenizer

    target = tiny_lm(bytelevel_bpe_tokenizer(), seed=1, arch="qwen2", extra_vocab=7, head_scale=25.0)
    drafter = noisy_copy(target, 0.3, seed=9)
    out = tmp_path_factory.mktemp("close-pair")
    dirs = []
    for lm, name in ((target, "target"), (drafter, "drafter")):
        path = out / name
        eos = int(lm.tokenizer.eos_token_id)
        lm.model.config.eos_token_id = eos
        lm.model.generation_config.eos_token_id = eos
        lm.model.save_pretrained(path)
        lm.tokenizer.save_pretrained(path)
        dirs.append(path)
    return target, drafter, dirs[0], dirs[1]


@pytest.fixture(scope="module")
def pipe(close_pair, tmp_path_factory):
    _, _, t_dir, d_dir = close_pair
    with Services(tmp_path_factory.mktemp("pipe-logs")) as s:
        vm, dm = free_port(), free_port()
        _, vaddr = s.verifier(t_dir, extra=["--metrics-port", str(vm)])
        d, daddr = s.drafter(d_dir, extra=["--metrics-port", str(dm)])
        s.ready()
        _, on, on_grpc = s.gateway(vaddr, daddr, drafter_timeout_s=5, extra=["--pipeline", "on"])
        _, off, off_grpc = s.gateway(vaddr, daddr, drafter_timeout_s=5, extra=["--pipeline", "off"])
        _, branch, _ = s.gateway(vaddr, daddr, drafter_timeout_s=5, extra=["--pipeline", "on", "--branch", "on"])
        s.ready()
        yield PipeStack(s, vaddr, daddr, f"http://127.0.0.1:{vm}", f"http://127.0.0.1:{dm}", d, on, on_grpc, off,
                        off_grpc, branch)


def complete(http: str, body: dict) -> dict:
    r = requests.post(http + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def reference(pipe) -> dict:
    """Target-only greedy completions (use_drafter=false) through the pipelined gateway, per prompt."""
    out = {}
    for prompt in PROMPTS:
        body = complete(pipe.on, {"prompt": prompt, "max_tokens": N_NEW, "use_drafter": False})
        assert body["speculative"]["drafted"] == 0
        out[prompt] = body
    return out


def test_greedy_pipelined_is_token_identical_to_serial_and_target_only(pipe, reference):
    """Through REST, the pipelined gateway's greedy text equals the target-only text and the serial
    gateway's, for fixed and adaptive blocks; the serial gateway never drafts ahead, the pipelined
    one both verifies blocks drafted ahead and drops some (both branches of the pipeline ran across
    the services). Where a run ends on its budget, each block drafted ahead and verified replaced
    the round's own token: tokens = accepted + rounds - pipelined blocks."""
    piped = dropped = 0
    for prompt in PROMPTS:
        ref = reference[prompt]
        text = ref["choices"][0]["text"]
        serial = complete(pipe.off, {"prompt": prompt, "max_tokens": N_NEW, **FIXED})
        assert serial["choices"][0]["text"] == text
        assert serial["speculative"]["pipelined_blocks"] == serial["speculative"]["dropped_blocks"] == 0
        for extra in (FIXED, {}):
            body = complete(pipe.on, {"prompt": prompt, "max_tokens": N_NEW, **extra})
            assert body["choices"][0]["text"] == text, (prompt, extra)
            assert body["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
            s = body["speculative"]
            assert s["mode"] == "speculative" and not s["drafter_fallback"]
            piped += s["pipelined_blocks"]
            dropped += s["dropped_blocks"]
            if extra and body["choices"][0]["finish_reason"] == "length":
                assert body["usage"]["completion_tokens"] == s["accepted"] + s["rounds"] - s["pipelined_blocks"], s
    assert piped > 0 and dropped > 0, (piped, dropped)


def test_branches_over_the_wire_keep_the_target_only_text(pipe, reference):
    """--branch: the drafter service sends its second choices, forks the request's session for each branch
    and the gateway forks it back where a branch came true; the text stays the target-only text, some
    branches were drafted and some verified, and the drafter holds no branch session afterwards (one-off
    requests: the drafter's KV blocks in use come back to what they were)."""
    blocks = "crossdraft_drafter_kv_cache_blocks_used"
    before = metric_value(pipe.d_metrics, blocks)
    branches = used = 0
    for prompt in PROMPTS:
        ref = reference[prompt]
        for extra in (FIXED, {"num_draft_tokens": 5, "adaptive_draft": False}):
            body = complete(pipe.branch, {"prompt": prompt, "max_tokens": N_NEW, **extra})
            assert body["choices"][0]["text"] == ref["choices"][0]["text"], (prompt, extra)
            s = body["speculative"]
            assert s["branch_blocks"] <= s["branches"] and not s["drafter_fallback"]
            branches += s["branches"]
            used += s["branch_blocks"]
    assert branches > used > 0, (branches, used)
    assert blocks + " " in requests.get(pipe.d_metrics + "/metrics", timeout=10).text  # (a paged KV pool)
    deadline = time.monotonic() + 10
    while metric_value(pipe.d_metrics, blocks) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric_value(pipe.d_metrics, blocks) == before


def test_greedy_pipelined_over_grpc_gives_the_target_only_ids(pipe):
    """gRPC: the same token ids pipelined as target-only; SpeculativeStats carries the pipeline's counts."""
    ahead = 0
    with Client(pipe.on_grpc) as c:
        for prompt in PROMPTS[:2]:
            ref = c.generate(prompt, max_new_tokens=N_NEW, use_drafter=False)
            out = c.generate(prompt, max_new_tokens=N_NEW, num_draft_tokens=3, adaptive_draft=False)
            assert out.token_ids == ref.token_ids and len(ref.token_ids) > 8
            ahead += out.stats["pipelined_blocks"] + out.stats["dropped_blocks"]
    assert ahead > 0


def test_a_seed_gives_the_same_text_pipelined_serial_and_target_only(pipe):
    """Seeded sampling gets coupled draws: its text depends on (seed, prompt) alone, so the pipelined
    gateway gives the serial gateway's and target-only text, and blocks were drafted ahead."""
    ahead = 0
    for seed in (1, 2, 3):
        body = {"prompt": PROMPTS[1], "max_tokens": N_NEW, "temperature": 0.9, "seed": seed, **FIXED}
        alone = complete(pipe.on, dict(body, use_drafter=False))
        serial = complete(pipe.off, body)
        piped = complete(pipe.on, body)
        assert piped["choices"][0]["text"] == serial["choices"][0]["text"] == alone["choices"][0]["text"]
        assert piped["speculative"]["draws"] == "coupled"
        ahead += piped["speculative"]["pipelined_blocks"] + piped["speculative"]["dropped_blocks"]
    assert ahead > 0


def test_rest_sampling_pipelined_follows_the_target_distribution(pipe, close_pair, tmp_path_factory):
    """Chi-square guard through REST: the first two tokens of pipelined runs against target-only
    sampling's exact joint distribution (computed in process on the served target's weights).
    One-token blocks, so the second token is the first of a block drafted ahead whenever the first
    block is accepted whole; pipelined and dropped blocks both occur. Tokens are compared by the text
    the gateway gives each (its logprobs' tokens); the exact distribution is mapped through the same
    function, and a run that ends on EOS ends its key there. Sampling is unseeded -- a seed would get
    coupled draws, not the rejection rule -- so, unlike the seeded in-process guards, this one draws
    anew each run: its bound, p > 1e-4, is a false alarm once in 10,000 runs."""
    from crossdraft.engine import Engine
    from crossdraft.models.loading import load_model

    _, _, t_dir, d_dir = close_pair  # loaded as the servers load them: their weights, their EOS ids
    engine = Engine(load_model(str(t_dir), dtype="float32"), load_model(str(d_dir), dtype="float32"),
                    vocab_cache_dir=tmp_path_factory.mktemp("vocab"))
    params = SamplingParams(temperature=1.0)
    prompt_ids = engine.pair.encode_target(CHI_PROMPT)
    eos = engine.target.eos_token_ids
    expected: dict = {}
    for (t1, t2), p in exact.exact_two_token_distribution(engine, prompt_ids, params).items():
        key = () if t1 in eos else (_token_text(engine.pair, t1)[0],) if t2 in eos else (
            _token_text(engine.pair, t1)[0], _token_text(engine.pair, t2)[0])
        expected[key] = expected.get(key, 0.0) + p
    body = {"prompt": CHI_PROMPT, "max_tokens": 3, "temperature": 1.0, "num_draft_tokens": 1,
            "adaptive_draft": False, "logprobs": 0, "n": CHI_N}

    def one(_):
        r = complete(pipe.on, body)
        return [tuple(c["logprobs"]["tokens"][:2]) for c in r["choices"]], r["speculative"]

    counts: dict = {}
    stats = {"pipelined_blocks": 0, "dropped_blocks": 0, "drafted": 0, "accepted": 0}
    with ThreadPoolExecutor(3) as ex:
        for keys, s in ex.map(one, range(CHI_SAMPLES // CHI_N)):
            assert s["draws"] == "rejection"
            for k in keys:
                counts[k] = counts.get(k, 0) + 1
            for k in stats:
                stats[k] += s[k]
    n = sum(counts.values())
    assert n == CHI_SAMPLES
    (chi2, pvalue), cells = exact.chi_square(counts, expected, n)
    assert cells >= 10, "distribution too concentrated to test anything"
    assert pvalue > 1e-4, f"chi2={chi2:.1f} over {cells} cells, p={pvalue:.2e}"
    assert stats["pipelined_blocks"] > 0 and stats["dropped_blocks"] > 0, stats
    assert 0 < stats["accepted"] < stats["drafted"], stats  # both branches of the acceptance rule


def _held_sessions(pipe) -> tuple[int, int]:
    from gateway.clients import RemoteDrafter, RemoteVerifier

    v, d = RemoteVerifier(pipe.vaddr), RemoteDrafter(pipe.daddr)
    try:
        return int(v.info(refresh=True).get("active_sessions", 0)), int(d.info(refresh=True).get("active_sessions", 0))
    finally:
        v.channel.close()
        d.channel.close()


def test_a_client_that_goes_away_mid_pipeline_stops_both_services(pipe, reference):
    """An SSE stream of a 480-token pipelined request closed after a few rounds: the gateway's rounds,
    the verifier's Verify calls and the drafter's Draft calls (blocks drafted ahead included) all stop
    within a few rounds -- far fewer than the rest of the request would take -- the request counts as
    cancelled, its sessions are dropped on both model servers, and the next request on the stack gives
    the target-only greedy text."""
    http = pipe.on
    verify_calls, draft_calls = "crossdraft_verifier_verify_calls_total", "crossdraft_drafter_draft_calls_total"
    cancelled = '{api="rest",status="cancelled"}'
    held_before = _held_sessions(pipe)
    n_cancelled = metric_value(http, "crossdraft_requests_total", cancelled)
    rounds_before = metric_value(http, "crossdraft_rounds_total")
    body = json.dumps({"prompt": PROMPTS[1], "max_tokens": 480, "stream": True, "num_draft_tokens": 3,
                       "adaptive_draft": False}).encode()
    u = urlparse(http)
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 60  # liveness bound: the first rounds take milliseconds
    while metric_value(http, "crossdraft_rounds_total") <= rounds_before + 3:
        assert time.monotonic() < deadline, "the request never started its rounds"
        time.sleep(0.005)
    at_close = {"rounds": metric_value(http, "crossdraft_rounds_total"),
                "verify": metric_value(pipe.v_metrics, verify_calls),
                "draft": metric_value(pipe.d_metrics, draft_calls)}
    sock.close()
    after = {"rounds": metric_settled(http, "crossdraft_rounds_total"),
             "verify": metric_settled(pipe.v_metrics, verify_calls),
             "draft": metric_settled(pipe.d_metrics, draft_calls)}
    deadline = time.monotonic() + 30
    while metric_value(http, "crossdraft_requests_total", cancelled) < n_cancelled + 1:
        assert time.monotonic() < deadline, "the request was not counted as cancelled"
        time.sleep(0.05)
    # the whole request would take at least 480 / 4 = 120 more rounds (and as many Verify and Draft
    # calls); the ones after the close are the round in flight plus the few before the gateway saw it
    for k in after:
        assert after[k] - at_close[k] <= 25, (k, at_close, after)
    assert _held_sessions(pipe) == held_before  # the request's sessions were dropped on both servers
    # the stack serves the next request with the target-only text
    ref = reference[PROMPTS[1]]
    again = complete(http, {"prompt": PROMPTS[1], "max_tokens": N_NEW, **FIXED})
    assert again["choices"][0]["text"] == ref["choices"][0]["text"]
    assert again["speculative"]["pipelined_blocks"] + again["speculative"]["dropped_blocks"] > 0


@pytest.fixture()
def slow_pipelined(pipe, close_pair, tmp_path):
    """A drafter that sleeps 50 ms per proposed token (CROSSDRAFT_FAULT_DRAFT_DELAY_S: a draft is in
    flight most of the time) and a pipelined gateway in front of it on the stack's verifier and Redis;
    (drafter, REST URL). Both stopped after the test."""
    procs = []
    try:
        d, daddr = model_server("drafter", str(close_pair[3]), tmp_path, extra=["--quantize", "none"],
                                env={"CROSSDRAFT_FAULT_DRAFT_DELAY_S": "0.05"})
        procs.append(d)
        wait_grpc_healthy(daddr, d)
        g, http, _ = gateway(pipe.vaddr, daddr, pipe.services.redis.url, tmp_path, drafter_timeout_s=5,
                             extra=["--pipeline", "on"])
        procs.append(g)
        wait_http_ready(http, g)
        yield d, http
    finally:
        for p in reversed(procs):
            p.stop()


def test_drafter_killed_mid_pipeline_completes_target_only_with_identical_output(slow_pipelined, reference):
    """SIGKILL of the drafter once half of a pipelined stream's text has arrived (its drafting takes
    most of each round, so a Draft -- often one drafted ahead -- is in flight): the request completes
    with the target-only text and token count, the stats name the fallback, and blocks had been
    drafted ahead before the kill."""
    d, http = slow_pipelined
    prompt = PROMPTS[1]
    ref = reference[prompt]
    text = ref["choices"][0]["text"]
    streamed, final, killed = stream_and_kill(http, {"prompt": prompt, "max_tokens": N_NEW, **FIXED}, d,
                                              len(text) // 2)  # mid-stream: more rounds follow
    assert killed and final is not None
    assert streamed == text
    s = final["speculative"]
    assert s["drafter_fallback"] is True and "drafter" in s["fallback_reason"]
    assert s["pipelined_blocks"] + s["dropped_blocks"] > 0
    assert final["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
