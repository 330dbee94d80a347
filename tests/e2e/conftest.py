"""A real stack for service tests: a Redis server, a verifier, a drafter and two gateway
instances, each its own process on 127.0.0.1 (tiny random-init models saved as real HF
directories, so that processes start in seconds), plus the in-process engine on the same models
as the reference.

`stack` and `engine` are package-scoped: every e2e file shares one of each, started when the
first test asks for it and stopped after the last e2e test. The tests that use `stack` leave it
as they found it: they start their own extra gateways (and stop them) for other flags, and the
tests that kill, restart or reconfigure processes run on stacks of their own (test_faults.py,
test_failed_turn.py, test_session_move.py). Requests read counters as differences (before / after), and sessions carry
their own ids."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from crossdraft.serving.redis_server import RedisServer
from tests.service_fixtures import Proc, Services, save_tiny_pair


@pytest.fixture(scope="session", autouse=True)
def static_costs():
    """These tests compare the services' round statistics (blocks drafted, accepted, rounds) with
    the in-process engine's and across requests. With measured costs (the default for greedy)
    every process times its own forwards and corrects them by the clock, so it may pick other
    block sizes -- the same tokens, other counts. Static costs make the counts comparable; the
    measured path has its own tests (tests/unit/runtime/test_costs.py)."""
    old = os.environ.get("CROSSDRAFT_COST_PROFILE")
    os.environ["CROSSDRAFT_COST_PROFILE"] = "static"
    yield
    if old is None:
        os.environ.pop("CROSSDRAFT_COST_PROFILE", None)
    else:
        os.environ["CROSSDRAFT_COST_PROFILE"] = old


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("tiny-models"))


@dataclass
class Stack:
    redis: RedisServer
    verifier: Proc
    verifier_addr: str
    drafter: Proc
    drafter_addr: str
    gw: Proc
    http: str
    grpc: str
    gw2: Proc
    http2: str
    grpc2: str
    log_dir: object


@pytest.fixture(scope="package")
def stack(tiny_dirs, tmp_path_factory):
    t_dir, d_dir = tiny_dirs
    logs = tmp_path_factory.mktemp("logs")
    with Services(logs) as s:
        # KV caches for more sessions than all e2e files leave open together: past it the least
        # recently used is dropped, which would change the session counts test_api.py compares
        sessions = ["--max-sessions", "64"]
        v, vaddr = s.verifier(t_dir, extra=sessions)
        d, daddr = s.drafter(d_dir, extra=sessions)
        s.ready()
        g1, http1, grpc1 = s.gateway(vaddr, daddr, drafter_timeout_s=5)
        g2, http2, grpc2 = s.gateway(vaddr, daddr, drafter_timeout_s=5)
        s.ready()
        yield Stack(s.redis, v, vaddr, d, daddr, g1, http1, grpc1, g2, http2, grpc2, logs)


@pytest.fixture(scope="package")
def engine(tiny_dirs):
    from crossdraft.engine import Engine
    from crossdraft.models.loading import load_model

    t_dir, d_dir = tiny_dirs
    return Engine(load_model(str(t_dir), dtype="float32"), load_model(str(d_dir), dtype="float32"))
