"""A session continues on other replicas with exactly the text of an uninterrupted session.

Real processes on 127.0.0.1, on a stack of this module's own (it kills processes): Redis, two
verifier replicas V1 and V2, two drafters D1 and D2, gateway G1 (verifiers V1,V2; drafter D1) and
gateway G2 (verifiers V1,V2; drafter D2). Tiny random-init fp32 models, greedy decoding, a fixed
block of 4 drafts every round (so that every turn drafts, and syncs its drafter first).

Two sessions run their first turns on G1, on one verifier ("verifier 1"; the other is "verifier 2").
Then verifier 1 is SIGKILLed and
- (verifier move) the first session continues on G1, whose placement moves it to verifier 2 (its
  replica list); D1 still holds the session's drafter cache and reuses it;
- (gateway + verifier move) G1 is SIGKILLed too and the second session continues on G2 from what
  Redis holds: verifier 2 and D2 rebuild its caches from the stored token ids; D2's
  crossdraft_drafter_synced_tokens_total counts the rebuild, token for token.
Each continued turn must give the text and token ids of the same turn of an uninterrupted session
(run on G2 before any kill; its turns are checked against the in-process target's own greedy
choices), and the stored history must be the uninterrupted session's, no token lost or repeated.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import pytest
import requests
import torch

from crossdraft.client import Client
from gateway.sessions import RedisSessionStore, Session
from tests.service_fixtures import Proc, Services, free_port

# a liveness bound for a hang, never a timing: the module takes ~25 s on 2 idle cores (six
# process starts, thirteen turns of 24 tokens) and was seen at 170 s with the cores 8x oversubscribed
pytestmark = pytest.mark.timeout(600)

PROMPTS = ["def add(a, b):\n", "    # then the loop\n", "\nclass Foo:\n", "\n# and a test\n"]
BEFORE = 2  # turns run before the kill; the rest run after the move
# a request moved off a verifier replica that refused it before its first token (gateway.job.Job._place)
RETRIES = 'crossdraft_placement_retries_total{kind="verifier",reason="unavailable"}'
OPTS = dict(max_new_tokens=24, temperature=0.0, adaptive_draft=False, num_draft_tokens=4)


@dataclass
class Stack:
    store: RedisSessionStore
    verifiers: dict[str, Proc]  # address -> process
    g1: Proc
    g1_http: str
    g1_grpc: str
    g2_http: str
    g2_grpc: str
    d1: str  # drafter addresses
    d2: str
    d1_metrics: str  # their /metrics URLs
    d2_metrics: str


@pytest.fixture(scope="module")
def stack(tiny_dirs, tmp_path_factory):
    t_dir, d_dir = tiny_dirs
    with Services(tmp_path_factory.mktemp("session-move-logs")) as s:
        v1, a1 = s.verifier(t_dir)
        v2, a2 = s.verifier(t_dir)
        m1, m2 = free_port(), free_port()
        _, d1 = s.drafter(d_dir, extra=["--metrics-port", str(m1)])
        _, d2 = s.drafter(d_dir, extra=["--metrics-port", str(m2)])
        s.ready()
        g1, http1, grpc1 = s.gateway([a1, a2], d1)
        _, http2, grpc2 = s.gateway([a1, a2], d2)
        s.ready()
        yield Stack(RedisSessionStore(s.redis.url), {a1: v1, a2: v2}, g1, http1, grpc1, http2, grpc2, d1, d2,
                    f"http://127.0.0.1:{m1}/metrics", f"http://127.0.0.1:{m2}/metrics")


def _metric(url: str, name: str) -> float:
    """One sample of a /metrics page, by its name and labels as the page spells them; a labelled
    series appears when first counted, so one not there yet is 0."""
    for line in requests.get(url, timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    assert "{" in name, f"{name} not in {url}"
    return 0.0


def _drafter_syncs(url: str) -> tuple[float, float]:
    """(syncs, history tokens they gave beyond what the drafter's cache reused) so far."""
    return (_metric(url, "crossdraft_drafter_syncs_total"), _metric(url, "crossdraft_drafter_synced_tokens_total"))


def _check_turn(got, want) -> None:
    assert got.text == want.text
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason


def _same_state(a: Session, b: Session) -> None:
    """Two sessions hold the same conversation: text, token ids of both sides, turns."""
    assert a.text == b.text
    assert a.target_ids == b.target_ids
    assert a.drafter_ids == b.drafter_ids
    assert (a.turns, a.kind) == (b.turns, b.kind)


def _extends(after: Session, before: Session, turn) -> None:
    """The turn's tokens follow the stored history and the turn's prompt, once each: the history is
    kept whole, then come the prompt's ids (the turn's usage counts history + prompt), then exactly
    the turn's output."""
    n = turn.usage["prompt_tokens"]
    assert after.target_ids[:len(before.target_ids)] == before.target_ids
    assert after.target_ids[n:] == turn.token_ids
    assert len(after.target_ids) == n + len(turn.token_ids)
    assert after.drafter_ids[:len(before.drafter_ids)] == before.drafter_ids
    assert after.turns == before.turns + 1


@pytest.fixture(scope="module")
def sent(tiny_dirs):
    """Drafter ids a turn's sync sends: the stored history's, then the prompt's (gateway.job.Job)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dirs[1]))
    return lambda before, prompt: len(before.drafter_ids) + len(tok(prompt, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def reference(stack, engine):
    """An uninterrupted session's turns (on G2, before any process is killed) and its stored state
    after them. Each of its tokens is the in-process target's own greedy choice after the history
    before it (one forward over the whole history)."""
    with Client(stack.g2_grpc) as c:
        sid = c.create_session(**OPTS)
        turns = [c.generate(p, session_id=sid) for p in PROMPTS]
    state = stack.store.get(sid)
    with torch.no_grad():
        logits = engine.target.model(torch.tensor([state.target_ids])).logits[0]
    greedy = logits.argmax(-1).tolist()
    for t in turns:
        n = t.usage["prompt_tokens"]  # the history + this turn's prompt; the output follows
        assert t.token_ids and t.token_ids == state.target_ids[n:n + len(t.token_ids)]
        assert t.token_ids == greedy[n - 1:n - 1 + len(t.token_ids)]
        assert t.stats["drafted"] > 0  # the turn drafted (a move has a drafter cache to rebuild)
    return turns, state


@pytest.fixture(scope="module")
def moved(stack, reference):
    """Two sessions whose first BEFORE turns ran on G1 on one verifier replica, then that replica
    SIGKILLed: (first session, second session, verifier 1's address, verifier 2's address).

    Placement of a new session is random between equally loaded replicas, so three sessions start
    and two of them (pigeonhole: at least two share a replica) go on; the third is deleted."""
    ref, _ = reference
    with Client(stack.g1_grpc) as c:
        on = defaultdict(list)
        for _ in range(3):
            sid = c.create_session(**OPTS)
            _check_turn(c.generate(PROMPTS[0], session_id=sid), ref[0])
            on[stack.store.get(sid).verifier_address].append(sid)
        v1 = next(a for a, sids in on.items() if len(sids) >= 2)
        a, b, *rest = on[v1] + [s for addr, sids in on.items() if addr != v1 for s in sids]
        for sid in rest:
            c.delete_session(sid)
        for sid in (a, b):
            for i in range(1, BEFORE):
                _check_turn(c.generate(PROMPTS[i], session_id=sid), ref[i])
            s = stack.store.get(sid)
            assert (s.verifier_address, s.drafter_address, s.turns) == (v1, stack.d1, BEFORE)
    stack.verifiers[v1].kill()
    (v2,) = [addr for addr in stack.verifiers if addr != v1]
    return a, b, v1, v2


def test_verifier_killed_the_gateway_moves_the_session_to_its_other_replica(stack, reference, moved, sent):
    ref, ref_state = reference
    sid, _, v1, v2 = moved
    with Client(stack.g1_grpc) as c:
        for i in range(BEFORE, len(PROMPTS)):
            before = stack.store.get(sid)
            retried = _metric(stack.g1_http + "/metrics", RETRIES)
            syncs0, synced0 = _drafter_syncs(stack.d1_metrics)
            turn = c.generate(PROMPTS[i], session_id=sid)
            _check_turn(turn, ref[i])
            after = stack.store.get(sid)
            _extends(after, before, turn)
            assert (after.verifier_address, after.drafter_address) == (v2, stack.d1)
            syncs, synced = _drafter_syncs(stack.d1_metrics)
            assert syncs - syncs0 == 1
            # D1 still holds the session: it reuses its cache and computes only what is new
            assert turn.stats["reused_drafter_tokens"] > 0
            assert synced - synced0 == sent(before, PROMPTS[i]) - turn.stats["reused_drafter_tokens"]
            if i == BEFORE:
                # verifier 1 refused (it is gone) and the turn moved to verifier 2, which built the
                # session's cache from the stored ids
                assert _metric(stack.g1_http + "/metrics", RETRIES) - retried == 1
                assert turn.stats["reused_target_tokens"] == 0
            else:  # the session lives on verifier 2 now: no more moves, its cache reused
                assert _metric(stack.g1_http + "/metrics", RETRIES) == retried
                assert turn.stats["reused_target_tokens"] > 0
    _same_state(stack.store.get(sid), ref_state)


def test_gateway_and_verifier_killed_the_session_continues_on_another_gateway(stack, reference, moved, sent):
    ref, ref_state = reference
    _, sid, v1, v2 = moved
    stack.g1.kill()  # (verifier 1 is gone already)
    with Client(stack.g2_grpc) as c:
        for i in range(BEFORE, len(PROMPTS)):
            before = stack.store.get(sid)
            retried = _metric(stack.g2_http + "/metrics", RETRIES)
            syncs0, synced0 = _drafter_syncs(stack.d2_metrics)
            turn = c.generate(PROMPTS[i], session_id=sid)
            _check_turn(turn, ref[i])
            after = stack.store.get(sid)
            _extends(after, before, turn)
            assert (after.verifier_address, after.drafter_address) == (v2, stack.d2)
            syncs, synced = _drafter_syncs(stack.d2_metrics)
            assert syncs - syncs0 == 1
            # G2 found the session recorded on verifier 1, which refused the turn: it moved once
            assert _metric(stack.g2_http + "/metrics", RETRIES) - retried == (i == BEFORE)
            if i == BEFORE:
                # both caches rebuilt from the stored ids: nothing reused, and D2 computed the whole
                # history the turn's sync gave it
                assert turn.stats["reused_target_tokens"] == 0
                assert turn.stats["reused_drafter_tokens"] == 0
                assert synced - synced0 == sent(before, PROMPTS[i]) > len(before.drafter_ids) > 0
            else:  # the rebuilt caches serve the next turn
                assert turn.stats["reused_target_tokens"] > 0
                assert turn.stats["reused_drafter_tokens"] > 0
                assert synced - synced0 == sent(before, PROMPTS[i]) - turn.stats["reused_drafter_tokens"]
    _same_state(stack.store.get(sid), ref_state)
