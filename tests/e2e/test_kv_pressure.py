"""A verifier whose KV pool is too small for its concurrent users, as real processes: the request
that cannot get memory beside busy sessions gets HTTP 429 with Retry-After (the model server's
RESOURCE_EXHAUSTED), streamed or not, the server stays healthy, and retried alone the request gets the output it
gets from the in-process engine. Tiny random-init models; the pool holds 6 blocks of 16 tokens, and
each prompt needs 4, so two prefills that meet in one batched forward (a long batch wait makes them
meet) cannot both be served."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from crossdraft.serving.redis_server import RedisServer
from tests.service_fixtures import gateway, model_server, wait_grpc_healthy, wait_http_ready

PROMPT = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"


@pytest.fixture(scope="module")
def small_pool(tiny_dirs, tmp_path_factory):
    t_dir, _ = tiny_dirs
    logs = tmp_path_factory.mktemp("kv-pressure")
    redis = RedisServer().start()
    procs = []
    try:
        v, vaddr = model_server("verifier", str(t_dir), logs,
                                extra=["--kv-cache-tokens", "96", "--prefill-chunk", "64", "--max-batch-tokens", "128",
                                       "--batch-wait-ms", "1000"])
        procs.append(v)
        wait_grpc_healthy(vaddr, v)
        g, http, _ = gateway(vaddr, None, redis.url, logs)
        procs.append(g)
        wait_http_ready(http, g)
        yield http
    finally:
        for p in reversed(procs):
            p.stop()
        redis.stop()


def _complete(http, prompt, stream=False):
    return requests.post(http + "/v1/completions",
                         json={"prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": stream}, timeout=120)


def test_full_pool_answers_429_with_retry_after_then_serves(small_pool, engine):
    http = small_pool
    prompts = [PROMPT, PROMPT.replace("one", "zero")]
    for stream in (False, True):
        # streamed, the refusal comes before the stream begins: the same HTTP status, not 200 + an error event.
        # The two prefills must meet in one forward: on a machine busy with other tests the second request can
        # reach the verifier after the first one ended (both then fit, one after the other): sent again then
        for _ in range(3):
            with ThreadPoolExecutor(2) as ex:
                rs = list(ex.map(lambda p, s=stream: _complete(http, p, s), prompts))
            codes = sorted(r.status_code for r in rs)
            assert set(codes) <= {200, 429}, [r.text for r in rs]
            if codes != [200, 200]:
                break
        assert codes == [200, 429], [r.text for r in rs]
        refused = next(r for r in rs if r.status_code == 429)
        assert refused.headers["Retry-After"] == "1"
        assert "kv cache full" in refused.json()["error"]["message"]
        served = next(r for r in rs if r.status_code == 200)
        assert served.text.rstrip().endswith("data: [DONE]") == stream and '"error"' not in served.text
    assert requests.get(http + "/healthz", timeout=5).status_code == 200
    # retried alone: the idle session is evicted to make room, and the output is the usual one
    for p in prompts:
        again = _complete(http, p)
        assert again.status_code == 200, again.text
        ref = engine.generate(p, max_new_tokens=3, use_drafter=False)  # in process, no pool
        assert again.json()["choices"][0]["text"] == ref.text
