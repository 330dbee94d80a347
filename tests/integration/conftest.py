"""What the real-model tests share, so that each model is loaded and each stack started once.

* `catalog_model(name, dtype, quantize)`: a catalog model loaded in this process, kept for the
  whole package (a model loads in 5-15 s on 2 cores; several files use the same ones).
* `target_only(engine, prompt, n, params, seed)`: the target-only output for a prompt, computed
  once per target and reused by every test that compares against it.
* `qwen_stack`: smollm2-135m drafting for qwen2.5-coder-0.5b as separate processes (fp32 verifier
  with its Prometheus port, fp32 drafter without int8 copies, a gateway, Redis), started when the
  first test asks for it and stopped after the package. Its users only send requests, so they
  can share it; they read the verifier's counters as differences.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from crossdraft.models import loading as M
from crossdraft.serving.redis_server import RedisServer
from tests.service_fixtures import free_port, gateway, model_server, wait_grpc_healthy, wait_http_ready

# The stacks' servers keep a KV pool of this many tokens (the default sizes it to the machine's free
# memory: gigabytes to allocate at every start, for requests of a few hundred tokens here).
KV_TOKENS = "8192"
# Round statistics are compared with the in-process engine's, and drafts must be verified in shared
# batches: static costs make the counts comparable and ignore the load (with measured costs eight
# fp32 sessions on a CPU would rightly stop drafting; tests/unit/decoding/test_policy.py covers that path).
STATIC = {"CROSSDRAFT_COST_PROFILE": "static"}


@pytest.fixture(scope="package")
def catalog_model():
    loaded: dict[tuple, M.LoadedModel] = {}

    def get(name: str, dtype: torch.dtype = torch.float32, quantize: str | None = None):
        key = (name, dtype, quantize)
        if key not in loaded:
            kw = {"quantize": quantize} if quantize else {}
            loaded[key] = M.load_model(name, dtype=dtype, **kw)
        return loaded[key]

    return get


@pytest.fixture(scope="package")
def target_only():
    done: dict[tuple, object] = {}

    def ref(engine, prompt: str, n: int, params=None, seed: int = 0):
        # the drafter plays no part in target-only decoding: the target and the request are the key
        key = (engine.target.name, engine.target.dtype, prompt, n, repr(params), seed)
        if key not in done:
            done[key] = engine.generate(prompt, max_new_tokens=n, params=params, seed=seed, use_drafter=False)
        return done[key]

    return ref


@dataclass
class RealStack:
    http: str
    grpc: str
    metrics: str
    rounds: str  # the gateway's round log (CROSSDRAFT_ROUND_LOG): one JSON line per round


def start_stack(target: str, drafter: str, log_dir, drafter_args: list[str], drafter_timeout_s: float = 60):
    """Redis + verifier + drafter + gateway on real models; yields a RealStack, stops them all after."""
    redis = RedisServer().start()
    procs = []
    try:
        mport = free_port()
        v, vaddr = model_server("verifier", target, log_dir, dtype="float32", env=STATIC,
                                extra=["--metrics-port", str(mport), "--kv-cache-tokens", KV_TOKENS])
        procs.append(v)
        d, daddr = model_server("drafter", drafter, log_dir, dtype="float32", env=STATIC,
                                extra=["--kv-cache-tokens", KV_TOKENS, *drafter_args])
        procs.append(d)
        wait_grpc_healthy(vaddr, v, timeout=300)
        wait_grpc_healthy(daddr, d, timeout=300)
        rounds = str(log_dir / "rounds.jsonl")
        g, http, grpc_addr = gateway(vaddr, daddr, redis.url, log_dir, drafter_timeout_s=drafter_timeout_s,
                                     env={**STATIC, "CROSSDRAFT_ROUND_LOG": rounds})
        procs.append(g)
        wait_http_ready(http, g, timeout=300)
        yield RealStack(http, grpc_addr, f"http://127.0.0.1:{mport}/metrics", rounds)
    finally:
        for p in reversed(procs):
            p.stop()
        redis.stop()


@pytest.fixture(scope="package")
def qwen_stack(tmp_path_factory):
    # float drafter weights, as the in-process engine's: round counts are compared (an fp32 drafter
    # server may otherwise choose int8 copies at load, crossdraft.models.quant.choose_fp32)
    yield from start_stack("qwen2.5-coder-0.5b", "smollm2-135m", tmp_path_factory.mktemp("qwen-stack"),
                           ["--quantize", "none"])
