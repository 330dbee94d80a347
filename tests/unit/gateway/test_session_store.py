"""The gateway's session store on a real redis-server: each API key's session ids are a namespace.

With keys on, two keys may each hold a session called "chat": their documents, leases and
model-server session ids never meet, and neither learns that the other uses the id. Sessions
written before the namespaces (at the bare key, owner inside) are still found by their owner,
saved back where they are and deleted there.

A turn is stored by one commit, made only while its request still holds the session's lease:
a request whose lease expired (and may belong to another request now) writes nothing, and a
session deleted while its turn ran stays deleted.
"""

from __future__ import annotations

import pytest

from crossdraft.errors import FailedPrecondition, NotFound
from crossdraft.serving.redis_server import RedisServer
from gateway.sessions import RedisSessionStore, Session, server_session_id

pytestmark = pytest.mark.timeout(60)

A, B = "a" * 64, "b" * 64  # owner hashes (key_owner gives sha256 hex)


@pytest.fixture(scope="module")
def store():
    srv = RedisServer().start()
    try:
        yield RedisSessionStore(srv.url, ttl_s=60)
    finally:
        srv.stop()


def test_two_keys_each_have_their_own_session_of_one_id(store):
    a = store.create({"max_new_tokens": 4}, "chat", owner=A)
    b = store.create({"max_new_tokens": 8}, "chat", owner=B)  # not "already exists"
    with pytest.raises(FailedPrecondition, match="already exists"):
        store.create({}, "chat", owner=A)  # within one key, ids are unique
    a.text, b.text = "mine", "theirs"
    assert store.save(a) and store.save(b)
    assert store.get("chat", A).text == "mine" and store.get("chat", B).text == "theirs"
    assert store.get("chat", A).options == {"max_new_tokens": 4}
    # one lease each: a request on one key's session does not make the other's busy
    la = store.acquire(store.get("chat", A))
    lb = store.acquire(store.get("chat", B))
    with pytest.raises(FailedPrecondition, match="busy"):
        store.acquire(store.get("chat", A))
    store.release(store.get("chat", A), la)
    store.release(store.get("chat", B), lb)
    # deleting one leaves the other
    assert store.delete(store.get("chat", B))
    with pytest.raises(NotFound):
        store.get("chat", B)
    assert store.get("chat", A).text == "mine"
    # keys off (owner ""): the bare namespace, apart from both
    with pytest.raises(NotFound):
        store.get("chat", "")
    store.create({}, "chat", owner="")
    assert store.get("chat", "").text == "" and store.get("chat", A).text == "mine"


def test_model_server_ids_differ_per_key_and_stay_valid():
    from crossdraft.errors import check_session_id

    sid = "s" * 64
    ids = {server_session_id(sid, ""), server_session_id(sid, A), server_session_id(sid, B)}
    assert len(ids) == 3 and server_session_id("chat", "") == "chat"
    # long ids that differ only at the end stay apart (one server session per session)
    long = ["conversation-2026-12-01-tenant-0042-user-000000000017-" + x for x in ("a", "b")]
    ids |= {server_session_id(x, A) for x in long}
    assert len(ids) == 5
    for x in ids | {server_session_id("c" * 47, A), server_session_id("c" * 48, A)}:
        check_session_id(x)  # the model servers accept it (<= 64 characters of the same alphabet)


def test_a_session_written_before_namespaces_is_found_saved_and_deleted_in_place(store):
    old = Session("legacy", 1.0, 1.0, options={"seed": 3}, owner=A, text="before")
    store.r.set(store._key("legacy"), old.to_json())  # where older gateways wrote it
    s = store.get("legacy", A)
    assert s.text == "before"
    with pytest.raises(NotFound):
        store.get("legacy", B)  # still its owner's only
    s.text = "after"
    assert store.save(s)  # back to the same key: no copy appears in A's namespace
    assert not store.r.exists(store._key("legacy", A))
    assert Session.from_json(store.r.get(store._key("legacy"))).text == "after"
    assert "_store_key" not in s.to_json()  # the store's bookkeeping is not part of the document
    lease = store.acquire(s)
    store.release(s, lease)
    assert store.delete(store.get("legacy", A))
    with pytest.raises(NotFound):
        store.get("legacy", A)


def _doc(store, s) -> bytes:
    return store.r.get(store._doc_key(s))


def test_commit_writes_the_turn_only_while_the_request_holds_the_lease(store):
    s = store.create({"seed": 1}, "turns")
    lease = store.acquire(s)
    s.text, s.turns, s.target_ids, s.round_index = "one", 1, [5, 6, 7], 3
    assert store.commit(s, lease)
    got = store.get("turns")
    assert (got.text, got.turns, got.target_ids, got.round_index) == ("one", 1, [5, 6, 7], 3)
    # the lease expires and another request takes it: the first request's turn, which started from
    # an older state, is refused and writes nothing
    store.r.delete(f"{store._doc_key(s)}:lease")
    other = store.acquire(got)
    before = _doc(store, s)
    s.text, s.turns = "stale", 2
    with pytest.raises(FailedPrecondition, match="lease"):
        store.commit(s, lease)
    assert _doc(store, s) == before
    # a lease that is simply gone (expired, nobody else) is refused too
    store.release(got, other)
    with pytest.raises(FailedPrecondition, match="lease"):
        store.commit(s, lease)
    assert _doc(store, s) == before
    # a session deleted while its turn ran stays deleted
    lease = store.acquire(got)
    assert store.delete(got)
    assert not store.commit(got, lease)
    assert not store.r.exists(store._doc_key(got))
    with pytest.raises(NotFound):
        store.get("turns")
    store.release(got, lease)


def test_commit_keeps_the_documents_place_and_owner(store):
    s = store.create({}, "turns-owned", owner=A)
    lease = store.acquire(s)
    s.text = "x"
    assert store.commit(s, lease)
    assert store.get("turns-owned", A).text == "x"
    with pytest.raises(NotFound):
        store.get("turns-owned", B)
    store.release(s, lease)


def test_renew_restarts_the_lease_of_its_holder_only(store):
    s = store.create({}, "renewed")
    key = f"{store._doc_key(s)}:lease"
    lease = store.acquire(s)
    store.r.pexpire(key, 5_000)
    assert store.renew(s, lease)
    assert store.r.pttl(key) > 5_000  # back to lease_s (600 s)
    store.r.pexpire(key, 5_000)
    assert not store.renew(s, "not-the-token")
    assert store.r.pttl(key) <= 5_000
    store.release(s, lease)
    assert not store.renew(s, lease)  # released: nothing to renew
    assert not store.r.exists(key)
