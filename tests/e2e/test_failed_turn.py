"""A session's turn that fails or is cancelled part-way leaves the session exactly as it was
before that turn, and the same turn sent again (and every turn after it) gives exactly the text
an uninterrupted session gives.

Real processes on 127.0.0.1: Redis, a verifier, a drafter and a gateway of this module's own (the
tests kill and restart the verifier), tiny random-init fp32 models, greedy decoding. The drafter
sleeps CROSSDRAFT_FAULT_DRAFT_DELAY_S per proposed token, so a turn runs for many rounds after its
first tokens arrive; each fault is triggered by the stream itself (after its first KILL_AFTER
tokens), not by a clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
import pytest
import requests

from crossdraft.client import Client
from crossdraft.serving.redis_server import RedisServer
from gateway.sessions import RedisSessionStore, Session
from tests.service_fixtures import Proc, Services, wait_grpc_healthy

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["    # then the loop\n", "\nclass Foo:\n", "\n# and a test\n"]
# greedy, a fixed block of 4 drafts every round (the drafter's delay then lengthens every round)
OPTS = dict(max_new_tokens=48, temperature=0.0, adaptive_draft=False, num_draft_tokens=4)
KILL_AFTER = 3  # tokens of the turn the client has received when the fault is injected
# per proposed token: >= 80 ms a round, so a turn has >= 0.7 s of rounds left when the fault is
# injected (>= 100x what the client takes to inject it)
DRAFT_DELAY_S = "0.02"


@dataclass
class Stack:
    redis: RedisServer
    store: RedisSessionStore
    verifier: Proc
    verifier_addr: str
    drafter: Proc
    gw: Proc
    http: str
    grpc: str


@pytest.fixture(scope="module")
def stack(tiny_dirs, tmp_path_factory):
    t_dir, d_dir = tiny_dirs
    with Services(tmp_path_factory.mktemp("failed-turn-logs")) as s:
        v, vaddr = s.verifier(t_dir)
        d, daddr = s.drafter(d_dir, env={"CROSSDRAFT_FAULT_DRAFT_DELAY_S": DRAFT_DELAY_S})
        s.ready()
        g, http, grpc_addr = s.gateway(vaddr, daddr, drafter_timeout_s=10)
        s.ready()
        yield Stack(s.redis, RedisSessionStore(s.redis.url), v, vaddr, d, g, http, grpc_addr)


@pytest.fixture(scope="module")
def reference(stack):
    """An uninterrupted session's three turns, and its stored state after them."""
    with Client(stack.grpc) as c:
        sid = c.create_session(**OPTS)
        turns = [c.generate(p, session_id=sid) for p in PROMPTS]
    # the faults land inside turn 2 only if it runs for many rounds after its first tokens
    assert turns[1].finish_reason == "length" and len(turns[1].token_ids) == OPTS["max_new_tokens"]
    return turns, stack.store.get(sid)


def _doc(stack, sid) -> bytes:
    """The session's stored document, byte for byte."""
    raw = stack.store.r.get(stack.store._key(sid))
    assert raw is not None, f"session {sid} is gone"
    return raw


def _lease_held(stack, sid) -> bool:
    return bool(stack.store.r.exists(stack.store._key(sid) + ":lease"))


def _wait(cond, what: str, bound_s: float = 60.0) -> None:
    """Liveness only: ``cond`` is expected within well under a second; the bound is >= 50x that."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < bound_s, f"{what} not within {bound_s} s"
        time.sleep(0.02)


def _same_state(a: Session, b: Session) -> None:
    """Two sessions hold the same conversation: text, token ids of both sides, turns."""
    assert a.text == b.text
    assert a.target_ids == b.target_ids
    assert a.drafter_ids == b.drafter_ids
    assert (a.turns, a.kind) == (b.turns, b.kind)


def _check_turn(got, want) -> None:
    assert got.text == want.text
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason


def test_a_cancelled_turn_leaves_the_session_and_the_retry_matches(stack, reference):
    ref, ref_state = reference
    with Client(stack.grpc) as c:
        sid = c.create_session(**OPTS)
        _check_turn(c.generate(PROMPTS[0], session_id=sid), ref[0])
        before = _doc(stack, sid)
        # turn 2, cancelled by the client once it has its first tokens: the round in flight
        # finishes on both model servers, whose caches then hold part of the turn
        call = c.stub.Generate(c._request(PROMPTS[1], None, sid, {}), timeout=120)
        got = 0
        with pytest.raises(grpc.RpcError) as err:
            for m in call:
                assert m.HasField("delta"), "the turn completed before the client cancelled it"
                got += len(m.delta.token_ids)
                if got >= KILL_AFTER:
                    call.cancel()
        assert err.value.code() == grpc.StatusCode.CANCELLED
        _wait(lambda: not _lease_held(stack, sid), "the cancelled turn's end (its lease released)")
        assert _doc(stack, sid) == before  # not a byte of the partial turn was stored

        retry = c.generate(PROMPTS[1], session_id=sid)
        _check_turn(retry, ref[1])
        # the verifier held the history plus part of the cancelled turn: it kept the common prefix
        # with the stored history + the new prompt and dropped the rest
        assert 0 < retry.stats["reused_target_tokens"] <= retry.usage["prompt_tokens"]
        assert retry.stats["reused_target_tokens"] >= ref[1].stats["reused_target_tokens"]
        _check_turn(c.generate(PROMPTS[2], session_id=sid), ref[2])
    _same_state(stack.store.get(sid), ref_state)


def test_a_turn_whose_verifier_is_killed_leaves_the_session_and_the_retry_matches(stack, reference, tiny_dirs):
    from transformers import AutoTokenizer

    ref, ref_state = reference
    with Client(stack.grpc) as c:
        sid = c.create_session(**OPTS)
        _check_turn(c.generate(PROMPTS[0], session_id=sid), ref[0])
        before = _doc(stack, sid)
        got = 0
        with pytest.raises(grpc.RpcError) as err:
            for m in c.events(PROMPTS[1], session_id=sid):
                assert m.HasField("delta"), "the turn completed before its verifier was killed"
                got += len(m.delta.token_ids)
                if got >= KILL_AFTER and stack.verifier.alive():
                    stack.verifier.kill()  # SIGKILL mid-turn: its caches are gone
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert got >= KILL_AFTER
        assert not _lease_held(stack, sid)  # released before the error reached the client
        assert _doc(stack, sid) == before

        # while the verifier is down, the turn again over REST: a clean 503, nothing stored
        r = requests.post(stack.http + "/v1/completions", json={"prompt": PROMPTS[1], "session_id": sid}, timeout=120)
        assert r.status_code == 503, r.text
        assert _doc(stack, sid) == before

        stack.verifier.start()  # the same port, an empty cache
        wait_grpc_healthy(stack.verifier_addr, stack.verifier)

        def retry():
            """The turn again; UNAVAILABLE while the gateway's channel to the restarted verifier
            reconnects (each such attempt must store nothing either)."""
            try:
                return c.generate(PROMPTS[1], session_id=sid)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
                assert _doc(stack, sid) == before
                return None

        done = []

        def retried() -> bool:
            out = retry()
            if out is not None:
                done.append(out)
            return bool(done)

        _wait(retried, "a turn on the restarted verifier")
        again = done[0]
        _check_turn(again, ref[1])
        assert again.stats["reused_target_tokens"] == 0  # the new verifier rebuilt it from the stored ids
        # the drafter still held the history plus part of the failed turn: it kept no more than the
        # common prefix with the stored drafter ids + the new prompt
        d_tok = AutoTokenizer.from_pretrained(str(tiny_dirs[1]))
        pre = Session.from_json(before)
        d_prompt = len(d_tok(PROMPTS[1], add_special_tokens=False)["input_ids"])
        assert 0 < again.stats["reused_drafter_tokens"] <= len(pre.drafter_ids) + d_prompt
        _check_turn(c.generate(PROMPTS[2], session_id=sid), ref[2])
    _same_state(stack.store.get(sid), ref_state)
