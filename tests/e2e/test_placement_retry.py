"""A verifier replica that refuses a request before its first token does not fail it: the request
moves to another ready replica, and only when every replica refuses does it fail, with an error
that names each replica and why (429 when every one was full, else 503).

Real verifier processes on 127.0.0.1 (tiny random-init fp32 target, target-only): H has room; R
and F hold 6 KV blocks of 16 tokens each (--kv-cache-tokens 96, the flags of test_kv_pressure.py),
so that of two prompts of 5 blocks whose prefills meet in one batched forward (a long batch wait
makes them meet) one is refused with RESOURCE_EXHAUSTED: it cannot get memory beside a busy
session. F is stopped part-way (its address then refuses with UNAVAILABLE). The gateway core runs
in this process over pools the tests set, and a replica is made the least loaded one (so that it
is chosen first) by holding placement slots on the others. Greedy decoding: every request that
succeeds gives the in-process engine's text, wherever it ran.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from crossdraft.errors import ResourceExhausted, Unavailable
from crossdraft.serving.redis_server import RedisServer
from gateway.discovery import Pool
from tests.service_fixtures import Proc, Services

pytestmark = pytest.mark.timeout(300)

# prompts of 5 KV blocks each (74-75 tokens): one fits a 6-block pool, two do not
WORDS = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
PROMPTS = [WORDS.replace("one", w) for w in ("zero", "one", "uno", "eins", "yksi", "jeden")]
MAX_NEW = 3
# the requests sent two at a time generate one token: their one round is their first, so a refusal
# always comes before any output (a later round of a session evicted while idle between its rounds
# may be refused too, and is not moved: its client has seen output)
PAIR_NEW = 1
SMALL_POOL = ["--kv-cache-tokens", "96", "--prefill-chunk", "64", "--max-batch-tokens", "128",
              "--batch-wait-ms", "1000"]
PAIRS = [PROMPTS[i:i + 2] for i in range(0, len(PROMPTS), 2)]  # requests sent two at a time
HOLD = 100  # placement slots held on the replicas a test wants chosen last


@dataclass
class Replicas:
    redis: RedisServer
    h: str
    r: str
    f: str
    f_proc: Proc

    def stop_f(self) -> None:
        """F's process ends (SIGTERM, waited for): its address refuses every call from now on."""
        self.f_proc.stop()
        assert not self.f_proc.alive()


@pytest.fixture(scope="module")
def replicas(tiny_dirs, tmp_path_factory):
    t_dir, _ = tiny_dirs
    with Services(tmp_path_factory.mktemp("placement-retry")) as s:
        _, h = s.verifier(t_dir)
        _, r = s.verifier(t_dir, extra=SMALL_POOL)
        f, fa = s.verifier(t_dir, extra=SMALL_POOL)
        s.ready()
        yield Replicas(s.redis, h, r, fa, f)


@pytest.fixture(scope="module")
def reference(engine):
    """The in-process engine's greedy text of each prompt (no KV pool, no replicas)."""
    return {(p, n): engine.generate(p, max_new_tokens=n, use_drafter=False).text
            for p in PROMPTS for n in (MAX_NEW, PAIR_NEW)}


def core(replicas: Replicas, addrs: list[str], last: tuple[str, ...] = ()):
    """A gateway core over the verifier replicas `addrs` (no drafter); the ones in `last` hold HOLD
    placement slots each, so that a request chooses them only after every other one refused it."""
    from gateway.config import GatewayConfig
    from gateway.server import build_gateway

    cfg = GatewayConfig(verifier=None, redis_url=replicas.redis.url, connect_timeout_s=60)
    gw = build_gateway(cfg, pools=(Pool("verifier", addrs), None))
    for a in last:
        for _ in range(HOLD):
            gw.placement.acquire("verifier", a)
    return gw


def generate(gw, prompt: str, session_id: str | None = None, max_new: int = MAX_NEW) -> dict:
    job = gw.start(session_id=session_id, prompt=prompt, messages=None,
                   options={"max_new_tokens": max_new, "temperature": 0.0})
    return list(job.events())[-1]


def attempt(gw, prompt: str):
    """The done event, or the error the request failed with."""
    try:
        return generate(gw, prompt, max_new=PAIR_NEW)
    except (ResourceExhausted, Unavailable) as e:
        return e


def at_once(gw, prompts: list[str]) -> list:
    """The prompts as concurrent requests (their prefills meet in the replicas' batched forwards)."""
    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(lambda p: attempt(gw, p), prompts))


def failures(gw, reference) -> list[Exception]:
    """PAIRS sent two at a time: each request that succeeds gives the engine's text; returns the
    errors of those that failed."""
    failed = []
    for pair in PAIRS:
        for p, out in zip(pair, at_once(gw, pair), strict=True):
            if isinstance(out, dict):
                assert out["text"] == reference[p, PAIR_NEW]
            else:
                failed.append(out)
    return failed


def retries(gw, reason: str) -> float:
    return gw.metrics.placement_retries.labels("verifier", reason)._value.get()


def test_requests_refused_by_a_full_replica_move_to_one_with_room(replicas, reference):
    """(b) R is chosen first for every request; the ones its pool cannot hold beside the busy
    sessions are refused (RESOURCE_EXHAUSTED) and served by H: every request gives the engine's text."""
    gw = core(replicas, [replicas.h, replicas.r], last=(replicas.h,))
    for pair in PAIRS + PAIRS:
        for p, out in zip(pair, at_once(gw, pair), strict=True):
            assert isinstance(out, dict), out
            assert out["text"] == reference[p, PAIR_NEW]
    # two prompts of 5 blocks that meet cannot both fit R's 6 blocks: one was moved to H
    assert retries(gw, "resource_exhausted") >= 1
    assert retries(gw, "unavailable") == 0


def test_every_replica_full_is_429_naming_it(replicas, reference):
    """(c, all full) R is the only replica: a request it cannot hold beside a busy session fails
    with ResourceExhausted (REST 429 with Retry-After) naming it and why."""
    from gateway.rest_errors import error_response

    gw = core(replicas, [replicas.r])
    failed = failures(gw, reference)
    assert failed  # two prompts of 5 blocks that meet cannot both fit R's 6 blocks
    for e in failed:
        assert type(e) is ResourceExhausted, e
        msg = str(e)
        assert msg.startswith(f"no verifier replica accepted the request: {replicas.r} RESOURCE_EXHAUSTED "
                              "(kv cache full"), msg
        resp = error_response(e)
        assert resp.status_code == 429 and resp.headers["Retry-After"]
    assert retries(gw, "resource_exhausted") == 0  # no other replica to move to


def test_a_stopped_replica_is_skipped_and_its_sessions_move(replicas, reference):
    """(a) F is chosen first for every request; once its process is stopped it refuses
    (UNAVAILABLE) and the request runs on H. A session recorded on F moves to H with the turn,
    which gives the text of a session that ran on H alone."""
    gw = core(replicas, [replicas.h, replicas.f], last=(replicas.h,))
    turns = ["def add(a, b):", "\n# again\n"]
    # the reference: the same session on H alone
    ref_gw = core(replicas, [replicas.h])
    ref_sid = ref_gw.create_session({"max_new_tokens": MAX_NEW, "temperature": 0.0}).session_id
    ref = [generate(ref_gw, t, ref_sid)["text"] for t in turns]
    sid = gw.create_session({"max_new_tokens": MAX_NEW, "temperature": 0.0}).session_id
    assert generate(gw, turns[0], sid)["text"] == ref[0]
    assert gw.get_session(sid).verifier_address == replicas.f
    replicas.stop_f()
    out = generate(gw, turns[1], sid)
    assert out["text"] == ref[1]
    assert out["stats"]["reused_target_tokens"] == 0  # H rebuilt the session's cache from its history
    s = gw.get_session(sid)
    assert s.verifier_address == replicas.h and s.turns == 2  # the turn committed the new placement
    assert retries(gw, "unavailable") == 1
    for i, p in enumerate(PROMPTS):
        out = generate(gw, p)
        assert out["text"] == reference[p, MAX_NEW]
        assert retries(gw, "unavailable") == 2 + i
    assert retries(gw, "resource_exhausted") == 0
    assert gw.placement.inflight[("verifier", replicas.h)] == HOLD  # every job gave its slot back


def test_full_and_stopped_replicas_are_503_naming_each(replicas, reference):
    """(c, mixed) F is stopped and R is small: a request R cannot hold beside its busy sessions has
    no replica left; its error names both (R full, F unavailable) and is Unavailable (REST 503)."""
    from gateway.rest_errors import error_response

    replicas.stop_f()
    gw = core(replicas, [replicas.r])
    gw.placement.pools["verifier"].set([replicas.r, replicas.f])  # (the core starts on a replica that answers)
    failed = failures(gw, reference)
    assert failed  # two prompts of 5 blocks that meet cannot both fit R's 6 blocks; F is down
    for e in failed:
        assert type(e) is Unavailable, e
        msg = str(e)
        assert msg.startswith("no verifier replica accepted the request: "), msg
        assert f"{replicas.r} RESOURCE_EXHAUSTED (kv cache full" in msg
        assert f"{replicas.f} UNAVAILABLE (" in msg
        resp = error_response(e)
        assert resp.status_code == 503 and resp.headers["Retry-After"]
