"""Property-based fuzzing of the gRPC surface (hypothesis) against real Drafter, Verifier and Gateway
servers on tiny models.

Every RPC of proto/crossdraft/v1/{drafter,verifier,gateway}.proto gets, per example, one of:

* a random message built from the request's descriptor (every field may be set or not; numbers at
  and beyond their bounds, NaN and infinities, non-ASCII and overlong strings, huge repeated fields),
* a VALID request built from live state (a synced session, its ContextCheck, a registered mask, a
  gateway session) with one to three fields mutated or cleared,
* the valid request as it is (the path that must answer OK),
* raw wire bytes: a valid request's serialisation with bytes flipped, cut or appended, or random
  bytes (undecodable messages, invalid UTF-8 in string fields, unknown fields).

Every answer must be OK or INVALID_ARGUMENT (its message names a field of the request) / NOT_FOUND /
FAILED_PRECONDITION / RESOURCE_EXHAUSTED / OUT_OF_RANGE -- never UNKNOWN, INTERNAL, UNAVAILABLE
(a crashed server) or DEADLINE_EXCEEDED (a hang: every call has a deadline; request sizes are
bounded so that a valid request finishes far within it). RESOURCE_EXHAUSTED is a correct answer
to a valid request when a bounded resource is full (a model server's KV pool with every session
busy, the gateway's admission queue, a message over the 64 MiB limit): the caller retries later.
Streams are read to the end or cancelled after a few messages.

The last test checks that every server still reports SERVING and that a greedy generation and the
canary sessions on each model server (kept away from the fuzzer) give exactly the tokens they gave
before the fuzzing. Bounded for CI by CROSSDRAFT_GRPC_FUZZ_EXAMPLES (examples per RPC and kind);
`make fuzz-grpc` runs many more with random seeds (CROSSDRAFT_GRPC_FUZZ_RANDOM=1).
"""

from __future__ import annotations

import math
import os
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as FD
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from crossdraft.decoding.messages import ids_crc32
from crossdraft.serving.redis_server import RedisServer
from crossdraft.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from tests.service_fixtures import gateway, model_server, wait_grpc_healthy, wait_http_ready

MAX_EXAMPLES = int(os.environ.get("CROSSDRAFT_GRPC_FUZZ_EXAMPLES", "25"))
RANDOM = os.environ.get("CROSSDRAFT_GRPC_FUZZ_RANDOM", "") == "1"
CALL_TIMEOUT_S = 60.0  # per call: a valid request here finishes in well under a second or two

SC = grpc.StatusCode
ACCEPTED = {SC.INVALID_ARGUMENT, SC.NOT_FOUND, SC.FAILED_PRECONDITION, SC.RESOURCE_EXHAUSTED, SC.OUT_OF_RANGE}

OUTCOMES: dict[str, Counter] = defaultdict(Counter)  # "Service.Rpc" -> status code name -> answers
EXAMPLE_DETAILS: dict[tuple[str, str], str] = {}  # (Service.Rpc, status code name) -> the first error's details

SERVICES = {
    "verifier": (verifier_pb2, "VerifierService", verifier_pb2_grpc.VerifierServiceStub),
    "drafter": (drafter_pb2, "DrafterService", drafter_pb2_grpc.DrafterServiceStub),
    "gateway": (gateway_pb2, "GatewayService", gateway_pb2_grpc.GatewayServiceStub),
}

POOL = [f"fz-{i}" for i in range(6)]  # model-server sessions the fuzzer syncs, forks, verifies, ends
G_POOL = [f"gfz-{i}" for i in range(3)]  # gateway sessions the fuzzer generates on, reads, deletes
V_CANARY, D_CANARY, G_CANARY = "canary-verifier", "canary-drafter", "canary-gateway"  # never fuzzed
PROTECTED = {V_CANARY, D_CANARY, G_CANARY, "ref-verifier"}
FUZZ_KEY = "fz-key"  # an allowed-token mask the fuzzer registers on the drafter
PROMPT = "def fibonacci(n):\n"
GREEDY = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0)
WEIRD_IDS = ["", " ", "-", "_", "a" * 64, "a" * 65, "a" * 5000, "é", "sess-é", "日本語", "🙂" * 16, "a b", "a/b",
             "../x", "a\x00b", "a\nb", "fz-0 ", " fz-0", "FZ-0", "fz-0\u200b", "\ud7ff", "\U0010ffff"]


# ---- the servers --------------------------------------------------------------------------------


@dataclass
class Servers:
    vaddr: str
    daddr: str
    gaddr: str
    procs: list
    channels: dict
    stubs: dict
    v_vocab: int
    d_vocab: int
    max_context: int
    baseline: dict = field(default_factory=dict)


def _history(vocab: int, n: int, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729 + 3) % vocab for i in range(n)]


def _generate(stub, **kw) -> tuple[list[int], str, list]:
    """A gateway Generate read to the end: (token ids, text, the messages)."""
    msgs = list(stub.Generate(gateway_pb2.GenerateRequest(**kw), timeout=CALL_TIMEOUT_S))
    ids = [t for m in msgs if m.HasField("delta") for t in m.delta.token_ids]
    assert msgs and msgs[-1].HasField("done"), msgs
    return ids, msgs[-1].done.text, msgs


def _canaries(s: Servers) -> dict:
    """What the canaries answer: a greedy Verify on the verifier canary's history (on a twin session,
    since Verify appends to the session), a greedy Draft on the drafter canary, a gateway generation."""
    v, d, g = s.stubs["verifier"], s.stubs["drafter"], s.stubs["gateway"]
    hv, hd = _history(s.v_vocab, 40, 1), _history(s.d_vocab, 40, 2)
    out = {}
    v.SyncVerifierSession(verifier_pb2.SyncVerifierSessionRequest(session_id="ref-verifier", token_ids=hv),
                          timeout=CALL_TIMEOUT_S)
    r = v.Verify(verifier_pb2.VerifyRequest(session_id="ref-verifier", expect=_check(hv), draft_token_ids=[1, 2, 3],
                                          params=GREEDY), timeout=CALL_TIMEOUT_S)
    v.EndVerifierSession(verifier_pb2.EndVerifierSessionRequest(session_id="ref-verifier"), timeout=CALL_TIMEOUT_S)
    out["verify"] = (r.num_accepted, r.next_token_id, list(r.accepted), r.context.length, r.context.crc32)
    draft = d.Draft(drafter_pb2.DraftRequest(session_id=D_CANARY, expect=_check(hd), num_draft_tokens=6, params=GREEDY),
                    timeout=CALL_TIMEOUT_S)
    out["draft"] = [m.token.token_id for m in draft if m.HasField("token")]
    out["generate"] = _generate(g, prompt=PROMPT, options=gateway_pb2.GenerationOptions(max_new_tokens=16))[:2]
    info = g.GetSession(gateway_pb2.GetSessionRequest(session_id=G_CANARY), timeout=CALL_TIMEOUT_S).session
    out["session"] = (info.turns, info.target_tokens, info.drafter_tokens, info.text)
    return out


@pytest.fixture(scope="module")
def servers(tiny_dirs, tmp_path_factory):
    """A verifier and a drafter holding up to 64 sessions each (the canaries are never evicted by the
    fuzzer's few sessions; idle expiry far beyond a long run), a gateway and a real Redis."""
    t_dir, d_dir = tiny_dirs
    logs = tmp_path_factory.mktemp("grpc-fuzz-logs")
    redis = RedisServer().start()
    procs, channels = [], {}
    extra = ["--max-sessions", "64", "--session-ttl-s", "86400"]
    try:
        v, vaddr = model_server("verifier", str(t_dir), logs, extra=extra)
        procs.append(v)
        d, daddr = model_server("drafter", str(d_dir), logs, extra=extra)
        procs.append(d)
        wait_grpc_healthy(vaddr, v)
        wait_grpc_healthy(daddr, d)
        g, http, gaddr = gateway(vaddr, daddr, redis.url, logs, drafter_timeout_s=10)
        procs.append(g)
        wait_http_ready(http, g)
        stubs = {}
        for kind, addr in (("verifier", vaddr), ("drafter", daddr), ("gateway", gaddr)):
            channels[kind] = grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 256 << 20),
                                                                  ("grpc.max_receive_message_length", 256 << 20)])
            stubs[kind] = SERVICES[kind][2](channels[kind])
        vi = stubs["verifier"].GetVerifierInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=CALL_TIMEOUT_S).info
        di = stubs["drafter"].GetDrafterInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=CALL_TIMEOUT_S).info
        s = Servers(vaddr, daddr, gaddr, procs, channels, stubs, vi.vocab_size, di.vocab_size,
                    vi.max_context_tokens or 512)
        # the canaries, and the pools the fuzzer starts from
        hv, hd = _history(s.v_vocab, 40, 1), _history(s.d_vocab, 40, 2)
        stubs["verifier"].SyncVerifierSession(
            verifier_pb2.SyncVerifierSessionRequest(session_id=V_CANARY, token_ids=hv, prefill=True),
            timeout=CALL_TIMEOUT_S)
        stubs["drafter"].SyncDrafterSession(
            drafter_pb2.SyncDrafterSessionRequest(session_id=D_CANARY, token_ids=hd, prefill=True),
            timeout=CALL_TIMEOUT_S)
        g_stub = stubs["gateway"]
        g_stub.CreateSession(gateway_pb2.CreateSessionRequest(
            session_id=G_CANARY, options=gateway_pb2.GenerationOptions(max_new_tokens=6)), timeout=CALL_TIMEOUT_S)
        _generate(g_stub, session_id=G_CANARY, prompt=PROMPT)
        mask = np.zeros(s.d_vocab, dtype=bool)
        mask[::2] = True
        stubs["drafter"].SetAllowedTokens(drafter_pb2.SetAllowedTokensRequest(
            allowed_key=FUZZ_KEY, vocab_size=s.d_vocab, mask=np.packbits(mask, bitorder="little").tobytes()),
            timeout=CALL_TIMEOUT_S)
        s.baseline = _canaries(s)
        yield s
    finally:
        for ch in channels.values():
            ch.close()
        for p in reversed(procs):
            p.stop()
        redis.stop()


# ---- strategies: random values of each wire type -----------------------------------------------

NAN, INF = float("nan"), float("inf")
I32 = st.one_of(st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31)]), st.integers(-(2**31), 2**31 - 1))
U32 = st.one_of(st.sampled_from([0, 1, 2, 64, 65, 2**31 - 1, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
I64 = st.one_of(st.sampled_from([0, -1, 2**63 - 1, -(2**63)]), st.integers(-(2**63), 2**63 - 1))
U64 = st.one_of(st.sampled_from([0, 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
DOUBLE = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e-300, 5e-324, 1e308, NAN, INF, -INF]),
                   st.floats())
FLOAT = st.one_of(st.sampled_from([0.0, -1.0, 1.0, NAN, INF, -INF, 3.4e38]), st.floats(width=32))
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(WEIRD_IDS), st.text(st.characters(codec="utf-8"), max_size=300))
# prompts near the tiny models' 512-token context: the target's byte-level BPE and the drafter's
# SentencePiece-like tokenizer count these differently (one may overflow where the other fits)
LONG_TEXT = st.builds(lambda c, n: c * n, st.sampled_from(["a", "ab ", "é", "日", "🙂", " ", "\n", "x\u0301"]),
                      st.integers(100, 700))
BYTES = st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"\xff" * 8, b"\x00", b"\xc3\x28", b"\xed\xa0\x80"]))

SCALARS = {
    FD.TYPE_INT32: I32, FD.TYPE_SINT32: I32, FD.TYPE_SFIXED32: I32,
    FD.TYPE_UINT32: U32, FD.TYPE_FIXED32: U32,
    FD.TYPE_INT64: I64, FD.TYPE_SINT64: I64, FD.TYPE_SFIXED64: I64,
    FD.TYPE_UINT64: U64, FD.TYPE_FIXED64: U64,
    FD.TYPE_DOUBLE: DOUBLE, FD.TYPE_FLOAT: FLOAT, FD.TYPE_BOOL: st.booleans(),
    FD.TYPE_STRING: TEXT, FD.TYPE_BYTES: BYTES, FD.TYPE_ENUM: st.integers(0, 3),
}


def _session_ids():
    valid = st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True).filter(lambda x: x not in PROTECTED)
    return st.one_of(st.sampled_from(POOL), st.sampled_from(WEIRD_IDS), valid, st.text(max_size=80))


def _tokens(vocab: int):
    return st.one_of(st.integers(0, vocab - 1), st.sampled_from([vocab - 1, vocab, vocab + 1, -1, 2**31 - 1,
                                                                 -(2**31)]), I32)


def _overrides(kind: str, s: Servers) -> dict:
    """Field-name specific strategies (better than a field's bare wire type)."""
    vocab = s.v_vocab if kind == "verifier" else s.d_vocab
    sid = _session_ids()
    tok = _tokens(vocab)
    return {
        "session_id": sid, "source_session_id": sid,
        "token_ids": tok, "draft_token_ids": tok, "append": tok, "top_ids": tok,
        "num_draft_tokens": st.one_of(st.integers(0, 70), U32),
        "max_new_tokens": st.one_of(st.integers(0, 24), st.sampled_from([4096, 4097, 2**32 - 1]), U32),
        "top_logprobs": st.one_of(st.integers(0, 22), U32),
        "keep": st.one_of(st.integers(0, 60), U32),
        "length": st.one_of(st.integers(0, 60), U32),
        "vocab_size": st.one_of(st.sampled_from([s.d_vocab, s.d_vocab - 1, s.d_vocab + 1, s.d_vocab + 8, 1]), U32),
        "allowed_key": st.one_of(st.sampled_from(["", FUZZ_KEY, "fz-other", "x" * 257]), TEXT),
        "role": st.one_of(st.sampled_from(["system", "user", "assistant", "", "robot"]), TEXT),
        "temperature": st.one_of(st.floats(0, 2), DOUBLE),
        "top_p": st.one_of(st.floats(0, 1), DOUBLE),
        "repetition_penalty": st.one_of(st.floats(0, 3), DOUBLE),
        "stop_below": st.one_of(st.floats(0, 1), DOUBLE),
        "stop_cumulative_below": st.one_of(st.floats(0, 1), DOUBLE),
        "prompt": st.one_of(TEXT, LONG_TEXT), "content": st.one_of(TEXT, LONG_TEXT),
    }


def _huge(elem):
    """A huge repeated field: one value many times (100k token ids is ~0.5 MB on the wire)."""
    return st.builds(lambda x, n: [x] * n, elem, st.sampled_from([513, 4096, 100_000]))


@st.composite
def random_message(draw, desc, overrides: dict, depth: int = 0):
    m = message_factory.GetMessageClass(desc)()
    for fd in desc.fields:
        if not draw(st.booleans()):
            continue
        _set(m, fd, draw(_field_values(fd, overrides, depth)))
    return m


def _repeated(elem, depth: int):
    """A repeated scalar field: a short list, or (not inside many copies of a message) a huge one."""
    return st.one_of(st.lists(elem, max_size=12), _huge(elem)) if depth < 3 else st.lists(elem, max_size=12)


def _field_values(fd, overrides: dict, depth: int):
    if fd.type == FD.TYPE_MESSAGE:
        elem = random_message(fd.message_type, overrides, depth + 1) if depth < 2 else st.just(
            message_factory.GetMessageClass(fd.message_type)())
    else:
        elem = overrides.get(fd.name, SCALARS[fd.type])
    if not fd.is_repeated:
        return elem
    if fd.type == FD.TYPE_MESSAGE:
        # many copies of one small message (its own repeated fields not huge: 2000 x 100k ids is 1 GB)
        small = random_message(fd.message_type, overrides, 3)
        return st.one_of(st.lists(elem, max_size=5),
                         st.builds(lambda x, n: [x] * n, small, st.sampled_from([64, 2000])))
    return _repeated(elem, depth)


def _set(m, fd, value) -> None:
    if fd.is_repeated:
        m.ClearField(fd.name)
        if fd.type == FD.TYPE_MESSAGE:
            for x in value:
                getattr(m, fd.name).add().CopyFrom(x)
        else:
            getattr(m, fd.name).extend(value)
    elif fd.type == FD.TYPE_MESSAGE:
        getattr(m, fd.name).CopyFrom(value)
    else:
        setattr(m, fd.name, value)


def _paths(desc, prefix=(), depth=0):
    """Every field reachable through singular sub-messages, as descriptor chains."""
    out = []
    for fd in desc.fields:
        out.append(prefix + (fd,))
        if fd.type == FD.TYPE_MESSAGE and not fd.is_repeated and depth < 2:
            out.extend(_paths(fd.message_type, prefix + (fd,), depth + 1))
    return out


@st.composite
def mutated(draw, valid, overrides: dict):
    """`valid` with one to three fields replaced by random values (or cleared)."""
    m = type(valid)()
    m.CopyFrom(valid)
    paths = _paths(m.DESCRIPTOR)
    if not paths:
        return m
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        target = m
        for fd in path[:-1]:
            target = getattr(target, fd.name)
        fd = path[-1]
        if draw(st.integers(0, 5)) == 0:
            target.ClearField(fd.name)
        else:
            _set(target, fd, draw(_field_values(fd, overrides, len(path))))
    return m


@st.composite
def raw_bytes(draw, valid):
    """Wire bytes: the valid message's serialisation with bytes flipped / cut / appended, or random."""
    data = bytearray(valid.SerializeToString())
    how = draw(st.sampled_from(["flip", "cut", "append", "random", "bad-utf8"]))
    if how == "flip" and data:
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    elif how == "cut" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif how == "append":
        data += draw(st.binary(min_size=1, max_size=32))
    elif how == "bad-utf8":
        # field 1 (a string in every request that has fields) as length-delimited invalid UTF-8
        data = bytearray(b"\x0a\x04\xff\xfe\xc3\x28") + data
    else:
        data = bytearray(draw(st.binary(max_size=200)))
    return bytes(data)


# ---- valid requests from live state ------------------------------------------------------------


def _check(ids) -> common_pb2.ContextCheck:
    return common_pb2.ContextCheck(length=len(ids), crc32=ids_crc32(ids))


def _valid_params(draw, sampling: bool | None = None) -> common_pb2.SamplingParams:
    if sampling is None:
        sampling = draw(st.booleans())
    if not sampling:
        return common_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0)
    return common_pb2.SamplingParams(temperature=draw(st.floats(0.05, 2.0)), top_k=draw(st.integers(0, 50)),
                                     top_p=draw(st.floats(0.05, 1.0)),
                                     repetition_penalty=draw(st.sampled_from([1.0, 0.8, 1.3])))


def _synced(draw, s: Servers, kind: str) -> tuple[str, list[int]]:
    """A pool session synced (live) with a random valid history; (its id, its ids)."""
    sid = draw(st.sampled_from(POOL))
    vocab = s.v_vocab if kind == "verifier" else s.d_vocab
    ids = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=48))
    if kind == "verifier":
        s.stubs["verifier"].SyncVerifierSession(verifier_pb2.SyncVerifierSessionRequest(session_id=sid, token_ids=ids),
                                                timeout=CALL_TIMEOUT_S)
    else:
        s.stubs["drafter"].SyncDrafterSession(drafter_pb2.SyncDrafterSessionRequest(session_id=sid, token_ids=ids),
                                              timeout=CALL_TIMEOUT_S)
    return sid, ids


def _gateway_session(draw, s: Servers) -> str:
    """A pool gateway session that exists (re-created when deleted, or when its history has grown long)."""
    g = s.stubs["gateway"]
    sid = draw(st.sampled_from(G_POOL))
    try:
        info = g.GetSession(gateway_pb2.GetSessionRequest(session_id=sid), timeout=CALL_TIMEOUT_S).session
        if info.target_tokens < s.max_context // 2:
            return sid
        g.DeleteSession(gateway_pb2.DeleteSessionRequest(session_id=sid), timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as e:
        assert e.code() == SC.NOT_FOUND, e
    g.CreateSession(gateway_pb2.CreateSessionRequest(session_id=sid), timeout=CALL_TIMEOUT_S)
    return sid


def _valid_options(draw) -> gateway_pb2.GenerationOptions:
    o = gateway_pb2.GenerationOptions(max_new_tokens=draw(st.integers(1, 12)))
    if draw(st.booleans()):
        o.temperature = draw(st.sampled_from([0.0, 0.7, 1.3]))
        o.top_k = draw(st.integers(0, 40))
        o.top_p = draw(st.floats(0.1, 1.0))
        o.repetition_penalty = draw(st.sampled_from([1.0, 1.2]))
        o.seed = draw(st.integers(0, 2**63 - 1))
    if draw(st.booleans()):
        o.num_draft_tokens = draw(st.integers(1, 64))
        o.adaptive_draft = draw(st.booleans())
        o.use_drafter = draw(st.booleans())
    return o


def valid_request(draw, s: Servers, kind: str, rpc: str):
    """A request that is valid against the servers' state now (created live where state matters)."""
    v_vocab, d_vocab = s.v_vocab, s.d_vocab
    if rpc in ("GetVerifierInfo", "GetVerifierTokenizer", "GetDrafterInfo", "GetDrafterTokenizer"):
        return getattr(SERVICES[kind][0], rpc + "Request")()
    if rpc == "SyncVerifierSession":
        return verifier_pb2.SyncVerifierSessionRequest(
            session_id=draw(st.sampled_from(POOL)), prefill=draw(st.booleans()),
            token_ids=draw(st.lists(st.integers(0, v_vocab - 1), min_size=1, max_size=64)))
    if rpc == "SyncDrafterSession":
        return drafter_pb2.SyncDrafterSessionRequest(
            session_id=draw(st.sampled_from(POOL)), prefill=draw(st.booleans()),
            token_ids=draw(st.lists(st.integers(0, d_vocab - 1), min_size=1, max_size=64)))
    if rpc in ("ForkVerifierSession", "ForkDrafterSession"):
        src, _ = _synced(draw, s, kind)
        dst = draw(st.sampled_from([p for p in POOL if p != src]))
        cls = verifier_pb2.ForkVerifierSessionRequest if kind == "verifier" else drafter_pb2.ForkDrafterSessionRequest
        return cls(source_session_id=src, session_id=dst)
    if rpc == "EndVerifierSession":
        return verifier_pb2.EndVerifierSessionRequest(session_id=draw(st.sampled_from(POOL)))
    if rpc == "EndDrafterSession":
        return drafter_pb2.EndDrafterSessionRequest(session_id=draw(st.sampled_from(POOL)))
    if rpc == "Verify":
        sid, ids = _synced(draw, s, "verifier")
        params = _valid_params(draw)
        k = draw(st.integers(0, 6))
        drafts = draw(st.lists(st.integers(0, v_vocab - 1), min_size=k, max_size=k))
        req = verifier_pb2.VerifyRequest(session_id=sid, expect=_check(ids), draft_token_ids=drafts, params=params,
                                         round_index=draw(st.integers(0, 2**63 - 1)),
                                         seed=draw(st.integers(0, 2**63 - 1)))
        if params.temperature > 0:
            for x in drafts:
                others = draw(st.lists(st.integers(0, v_vocab - 1), max_size=5))
                row = sorted({x, *others})
                req.q.add(token_ids=row, probs=[draw(st.floats(0.01, 1.0)) for _ in row])
        if draw(st.booleans()):
            req.top_logprobs = draw(st.integers(0, 20))
        return req
    if rpc == "SetAllowedTokens":
        mask = np.array(draw(st.lists(st.booleans(), min_size=d_vocab, max_size=d_vocab)), dtype=bool)
        mask[draw(st.integers(0, d_vocab - 1))] = True
        return drafter_pb2.SetAllowedTokensRequest(allowed_key=draw(st.sampled_from([FUZZ_KEY, "fz-other"])),
                                                   vocab_size=d_vocab,
                                                   mask=np.packbits(mask, bitorder="little").tobytes())
    if rpc in ("Draft", "DraftBlock", "Commit"):
        sid, ids = _synced(draw, s, "drafter")
        edit, after = None, ids
        if rpc == "Commit" or draw(st.booleans()):
            keep = draw(st.integers(0, len(ids)))
            append = draw(st.lists(st.integers(0, d_vocab - 1), min_size=0 if keep else 1, max_size=8))
            edit = drafter_pb2.TokenEdit(keep=keep, append=append)
            after = ids[:keep] + append
        if rpc == "Commit":
            return drafter_pb2.CommitRequest(session_id=sid, edit=edit, expect=_check(after))
        req = drafter_pb2.DraftRequest(session_id=sid, expect=_check(after), num_draft_tokens=draw(st.integers(1, 8)),
                                       round_index=draw(st.integers(0, 2**63 - 1)), params=_valid_params(draw),
                                       seed=draw(st.integers(0, 2**63 - 1)), stop_below=draw(st.floats(0, 0.99)),
                                       allowed_key=draw(st.sampled_from(["", FUZZ_KEY])),
                                       stop_cumulative_below=draw(st.one_of(st.just(0.0), st.floats(0, 0.99))))
        if edit is not None:
            req.edit.CopyFrom(edit)
        return req
    if rpc == "Generate":
        req = gateway_pb2.GenerateRequest(options=_valid_options(draw))
        if draw(st.booleans()):
            req.session_id = _gateway_session(draw, s)
        req.prompt = draw(st.one_of(st.sampled_from([PROMPT, "x", "héllo wörld ", "日本語のテキスト", "🙂\n\t"]),
                                    st.text(min_size=1, max_size=40), LONG_TEXT))
        if draw(st.booleans()):
            req.stop.extend(draw(st.lists(st.text(min_size=1, max_size=5), max_size=4)))
        if draw(st.booleans()):
            req.top_logprobs = draw(st.integers(0, 20))
        return req
    if rpc == "CreateSession":
        req = gateway_pb2.CreateSessionRequest(options=_valid_options(draw))
        if draw(st.booleans()):
            req.session_id = draw(st.from_regex(r"fzc-[A-Za-z0-9_-]{1,20}", fullmatch=True))
        return req
    if rpc == "GetSession":
        return gateway_pb2.GetSessionRequest(session_id=_gateway_session(draw, s))
    if rpc == "DeleteSession":
        return gateway_pb2.DeleteSessionRequest(session_id=draw(st.sampled_from(G_POOL)))
    raise AssertionError(f"no valid request for {rpc}")


# ---- calling and judging -------------------------------------------------------------------------


def _field_names(desc, depth=0) -> set[str]:
    out = set()
    for fd in desc.fields:
        out.add(fd.name)
        if fd.type == FD.TYPE_MESSAGE and depth < 3:
            out |= _field_names(fd.message_type, depth + 1)
    return out


def _short(req) -> str:
    text = repr(req) if not isinstance(req, bytes) else f"raw {req[:200]!r}"
    return text if len(text) < 1500 else text[:1500] + f"... ({len(text)} chars)"


def _judge(method, req, e: grpc.RpcError, cancelled: bool = False) -> None:
    code, details = e.code(), e.details() or ""
    OUTCOMES[f"{method.containing_service.name}.{method.name}"][code.name] += 1
    EXAMPLE_DETAILS.setdefault((f"{method.containing_service.name}.{method.name}", code.name), details[:150])
    if cancelled and code == SC.CANCELLED:
        return
    assert code in ACCEPTED, f"{method.full_name}: {code.name} {details!r}\nrequest: {_short(req)}"
    if code == SC.INVALID_ARGUMENT:
        names = _field_names(method.input_type) | {"request"}
        m = re.match(r"^([A-Za-z_][\w.\[\]]*): \S", details)
        assert m, f"{method.full_name}: INVALID_ARGUMENT without a field: {details!r}\nrequest: {_short(req)}"
        base = re.split(r"[.\[]", m.group(1))[0]
        assert base in names, (f"{method.full_name}: INVALID_ARGUMENT names {m.group(1)!r}, not a field of "
                               f"{method.input_type.name}: {details!r}\nrequest: {_short(req)}")


def _check_ok(kind: str, method, req, resp, s: Servers) -> None:
    """Light checks of an OK answer."""
    OUTCOMES[f"{method.containing_service.name}.{method.name}"]["OK"] += 1
    if isinstance(req, bytes):
        return
    if method.name == "Verify":
        assert len(resp.accepted) == len(req.draft_token_ids)
        assert 0 <= resp.next_token_id < s.v_vocab
    elif method.name == "Draft":
        assert all(0 <= m.token.token_id < s.d_vocab for m in resp if m.HasField("token"))
        assert len([m for m in resp if m.HasField("token")]) <= req.num_draft_tokens
    elif method.name == "DraftBlock":
        assert all(0 <= t.token_id < s.d_vocab for t in resp.tokens) and len(resp.tokens) <= req.num_draft_tokens
        assert resp.HasField("done") != (len(resp.tokens) > 0 and resp.tokens[-1].last)


def _call(s: Servers, kind: str, method, req, cancel_after: int | None) -> None:
    """One call with a deadline; streams read to the end or cancelled after `cancel_after` messages."""
    _, service, _ = SERVICES[kind]
    path = f"/{method.containing_service.full_name}/{method.name}"
    ch = s.channels[kind]
    raw = isinstance(req, bytes)
    ser = None if raw else type(req).SerializeToString
    des = message_factory.GetMessageClass(method.output_type).FromString
    try:
        if method.server_streaming:
            call = ch.unary_stream(path, request_serializer=ser, response_deserializer=des)(req,
                                                                                            timeout=CALL_TIMEOUT_S)
            got = []
            for m in call:
                got.append(m)
                if cancel_after is not None and len(got) >= cancel_after:
                    call.cancel()
                    break
            if cancel_after is None or len(got) < cancel_after:
                _check_ok(kind, method, req, got, s)
        else:
            resp = ch.unary_unary(path, request_serializer=ser, response_deserializer=des)(req, timeout=CALL_TIMEOUT_S)
            _check_ok(kind, method, req, resp, s)
    except grpc.RpcError as e:
        _judge(method, req, e, cancelled=cancel_after is not None)


def _cleanup(s: Servers, kind: str, req) -> None:
    """A random valid id that a Sync or Fork created: ended again (the fuzzer's sessions stay few)."""
    if isinstance(req, bytes) or kind == "gateway" or not hasattr(req, "session_id"):
        return
    sid = req.session_id
    if sid in POOL or sid in PROTECTED or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", sid):
        return
    try:
        if kind == "verifier":
            s.stubs["verifier"].EndVerifierSession(verifier_pb2.EndVerifierSessionRequest(session_id=sid),
                                                   timeout=CALL_TIMEOUT_S)
        else:
            s.stubs["drafter"].EndDrafterSession(drafter_pb2.EndDrafterSessionRequest(session_id=sid),
                                                 timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as e:
        raise AssertionError(f"ending fuzz session {sid!r} on the {kind}: {e.code().name} {e.details()}") from None


def _methods():
    out = []
    for kind, (mod, service, _) in SERVICES.items():
        for m in mod.DESCRIPTOR.services_by_name[service].methods:
            out.append((kind, m.name))
    return out


METHODS = _methods()
FUZZ_SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=not RANDOM,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                HealthCheck.filter_too_much, HealthCheck.large_base_example],
                         phases=[Phase.explicit, Phase.generate])


def _method(kind: str, rpc: str):
    mod, service, _ = SERVICES[kind]
    return mod.DESCRIPTOR.services_by_name[service].methods_by_name[rpc]


def test_every_rpc_is_fuzzed():
    """The RPCs fuzzed are the proto's own (read from the descriptors); a new RPC fails valid_request
    until it has a builder there, and this count until it is updated."""
    names = {r for _, r in METHODS}
    assert {"ForkVerifierSession", "ForkDrafterSession", "Draft", "Verify", "Generate"} <= names
    assert len(METHODS) == 19, METHODS


@pytest.mark.parametrize("kind, rpc", METHODS, ids=[f"{k}.{r}" for k, r in METHODS])
def test_fuzz_rpc(servers, kind, rpc):
    """Random, valid and mutated valid messages; the answer is OK or an accepted error code."""
    method = _method(kind, rpc)
    overrides = _overrides(kind, servers)

    @given(data=st.data())
    @FUZZ_SETTINGS
    def run(data):
        how = data.draw(st.sampled_from(["random", "valid", "mutated", "mutated"]), label="how")
        if how == "random":
            req = data.draw(random_message(method.input_type, overrides), label="request")
        else:
            req = valid_request(data.draw, servers, kind, rpc)
            if how == "mutated":
                req = data.draw(mutated(req, overrides), label="mutated")
        cancel = data.draw(st.one_of(st.none(), st.integers(1, 3)), label="cancel") if method.server_streaming \
            else None
        _call(servers, kind, method, req, cancel)
        _cleanup(servers, kind, req)

    run()


@pytest.mark.parametrize("kind, rpc", METHODS, ids=[f"{k}.{r}" for k, r in METHODS])
def test_fuzz_rpc_wire_bytes(servers, kind, rpc):
    """Undecodable or odd wire bytes: INVALID_ARGUMENT (or, when they happen to decode, any accepted answer)."""
    method = _method(kind, rpc)

    @given(data=st.data())
    @FUZZ_SETTINGS
    def run(data):
        req = data.draw(raw_bytes(valid_request(data.draw, servers, kind, rpc)), label="bytes")
        cancel = 1 if method.server_streaming and data.draw(st.booleans(), label="cancel") else None
        _call(servers, kind, method, req, cancel)
        try:  # what it created, if it decoded to a Sync or Fork of a valid id
            _cleanup(servers, kind, message_factory.GetMessageClass(method.input_type).FromString(req))
        except Exception:  # noqa: BLE001 - undecodable: created nothing
            pass

    run()


def test_forked_sessions_answer_as_fresh_ones(servers):
    """Property: a session forked from another (shared KV blocks, copy on write) and its source, each
    then written on its own, answer a greedy Verify / Draft exactly like sessions synced from scratch
    with the same history -- neither write leaks into the other's cache."""
    v, d = servers.stubs["verifier"], servers.stubs["drafter"]

    def verify(sid, ids, drafts):
        r = v.Verify(verifier_pb2.VerifyRequest(session_id=sid, expect=_check(ids), draft_token_ids=drafts,
                                                params=GREEDY), timeout=CALL_TIMEOUT_S)
        return r.num_accepted, r.next_token_id, r.context.length, r.context.crc32

    def draft(sid, ids, keep, append):
        after = ids[:keep] + append
        r = d.Draft(drafter_pb2.DraftRequest(session_id=sid, edit=drafter_pb2.TokenEdit(keep=keep, append=append),
                                             expect=_check(after), num_draft_tokens=4, params=GREEDY),
                    timeout=CALL_TIMEOUT_S)
        return [m.token.token_id for m in r if m.HasField("token")]

    @given(data=st.data())
    @settings(FUZZ_SETTINGS, max_examples=max(4, MAX_EXAMPLES // 3))  # ~14 calls an example
    def run(data):
        prefill = data.draw(st.booleans(), label="prefill")
        ids = data.draw(st.lists(st.integers(0, servers.v_vocab - 1), min_size=1, max_size=80), label="ids")
        d1, d2 = (data.draw(st.lists(st.integers(0, servers.v_vocab - 1), max_size=5)) for _ in range(2))
        v.SyncVerifierSession(verifier_pb2.SyncVerifierSessionRequest(session_id="fk-a", token_ids=ids,
                                                                      prefill=prefill), timeout=CALL_TIMEOUT_S)
        v.ForkVerifierSession(verifier_pb2.ForkVerifierSessionRequest(source_session_id="fk-a", session_id="fk-b"),
                              timeout=CALL_TIMEOUT_S)
        got = (verify("fk-b", ids, d1), verify("fk-a", ids, d2))
        want = []
        for drafts in (d1, d2):
            v.SyncVerifierSession(verifier_pb2.SyncVerifierSessionRequest(session_id="fk-ref", token_ids=ids),
                                  timeout=CALL_TIMEOUT_S)
            want.append(verify("fk-ref", ids, drafts))
            v.EndVerifierSession(verifier_pb2.EndVerifierSessionRequest(session_id="fk-ref"), timeout=CALL_TIMEOUT_S)
        assert got == tuple(want)

        dids = data.draw(st.lists(st.integers(0, servers.d_vocab - 1), min_size=1, max_size=80), label="dids")
        edits = [(data.draw(st.integers(0, len(dids))), data.draw(st.lists(st.integers(0, servers.d_vocab - 1),
                                                                           min_size=1, max_size=4)))
                 for _ in range(2)]
        d.SyncDrafterSession(drafter_pb2.SyncDrafterSessionRequest(session_id="fk-a", token_ids=dids,
                                                                   prefill=prefill), timeout=CALL_TIMEOUT_S)
        d.ForkDrafterSession(drafter_pb2.ForkDrafterSessionRequest(source_session_id="fk-a", session_id="fk-b"),
                             timeout=CALL_TIMEOUT_S)
        got = (draft("fk-b", dids, *edits[0]), draft("fk-a", dids, *edits[1]))
        want = []
        for keep, append in edits:
            d.SyncDrafterSession(drafter_pb2.SyncDrafterSessionRequest(session_id="fk-ref", token_ids=dids),
                                 timeout=CALL_TIMEOUT_S)
            want.append(draft("fk-ref", dids, keep, append))
            d.EndDrafterSession(drafter_pb2.EndDrafterSessionRequest(session_id="fk-ref"), timeout=CALL_TIMEOUT_S)
        assert got == tuple(want)

    run()


@pytest.mark.parametrize("cancel", [False, True], ids=["read-on", "cancelled"])
def test_delete_during_generate_is_not_undone(servers, cancel):
    """Regression (found by the fuzzer): a DeleteSession while a Generate on that session was still
    running -- or a cancelled one was finishing its round -- was undone by the generation's next
    save, and the session came back (a CreateSession of its id then failed: "already exists")."""
    g = servers.stubs["gateway"]
    sid = f"fz-delete-race-{int(cancel)}"
    g.CreateSession(gateway_pb2.CreateSessionRequest(session_id=sid), timeout=CALL_TIMEOUT_S)
    opts = gateway_pb2.GenerationOptions(max_new_tokens=200, num_draft_tokens=1, adaptive_draft=False)
    call = g.Generate(gateway_pb2.GenerateRequest(session_id=sid, prompt=PROMPT * 4, options=opts),
                      timeout=CALL_TIMEOUT_S)
    next(call)  # the generation is running
    assert g.DeleteSession(gateway_pb2.DeleteSessionRequest(session_id=sid), timeout=CALL_TIMEOUT_S).existed
    if cancel:
        call.cancel()
    else:
        assert list(call)[-1].HasField("done")
    for _ in range(20):  # a cancelled generation ends at its next round
        with pytest.raises(grpc.RpcError) as e:
            g.GetSession(gateway_pb2.GetSessionRequest(session_id=sid), timeout=CALL_TIMEOUT_S)
        assert e.value.code() == SC.NOT_FOUND
        time.sleep(0.05)
    g.CreateSession(gateway_pb2.CreateSessionRequest(session_id=sid), timeout=CALL_TIMEOUT_S)
    g.DeleteSession(gateway_pb2.DeleteSessionRequest(session_id=sid), timeout=CALL_TIMEOUT_S)


@pytest.mark.parametrize("spaces", [600, 500])
def test_prompt_beyond_the_drafters_context_goes_target_only(servers, spaces):
    """Regression (found by the fuzzer): 600 spaces are 150 target tokens but 600 drafter tokens; the
    drafter's "token_ids: ... exceed the model's context" (at its sync; with 500 spaces at a later
    Draft, "num_draft_tokens: ...") failed the request, naming no field of it. The target holds it:
    the request goes on target-only, with exactly the target-only tokens."""
    g = servers.stubs["gateway"]
    opts = dict(max_new_tokens=16, temperature=0.0)
    ids, text, msgs = _generate(g, prompt=" " * spaces, options=gateway_pb2.GenerationOptions(**opts))
    ref_ids, ref_text, _ = _generate(g, prompt=" " * spaces, options=gateway_pb2.GenerationOptions(
        use_drafter=False, **opts))
    assert (ids, text) == (ref_ids, ref_text)
    stats = msgs[-1].done.stats
    assert stats.drafter_fallback and "exceed the model's context" in stats.fallback_reason, stats


def test_the_drafter_ends_a_block_on_its_cumulative_doubt_over_the_wire(servers):
    """DraftRequest.stop_cumulative_below reaches the drafter: a random-init model is never 99.9%
    sure of a token, so the block ends after its first proposal (the same first proposal as the
    unbounded block's); 0 is off; 1 and above are refused naming the field."""
    d = servers.stubs["drafter"]
    hd = _history(servers.d_vocab, 30, 7)
    d.SyncDrafterSession(drafter_pb2.SyncDrafterSessionRequest(session_id="cum-doubt", token_ids=hd),
                         timeout=CALL_TIMEOUT_S)

    def block(stop):
        r = d.Draft(drafter_pb2.DraftRequest(session_id="cum-doubt", expect=_check(hd), num_draft_tokens=6,
                                             params=GREEDY, stop_cumulative_below=stop), timeout=CALL_TIMEOUT_S)
        return [m.token for m in r if m.HasField("token")]

    try:
        full, short = block(0.0), block(0.999)
        assert len(full) == 6 and len(short) == 1 and short[0].last
        assert short[0].token_id == full[0].token_id
        with pytest.raises(grpc.RpcError) as e:
            block(1.0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop_cumulative_below" in e.value.details()
    finally:
        d.EndDrafterSession(drafter_pb2.EndDrafterSessionRequest(session_id="cum-doubt"), timeout=CALL_TIMEOUT_S)


def test_servers_healthy_and_unchanged_after_fuzzing(servers):
    """Every server is up and SERVING; the canaries and a greedy generation answer exactly as before."""
    for p in servers.procs:
        assert p.alive(), f"{p.name} died:\n{p.tail()}"
    for addr in (servers.vaddr, servers.daddr, servers.gaddr):
        with grpc.insecure_channel(addr) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING, addr
    print("\ngRPC fuzz outcomes (answers by status code):")
    for name in sorted(OUTCOMES):
        print(f"  {name:42s} " + ", ".join(f"{c} {n}" for c, n in OUTCOMES[name].most_common()))
    print("the first answer of each error code but INVALID_ARGUMENT:")
    for (name, code), details in sorted(EXAMPLE_DETAILS.items()):
        if code != "INVALID_ARGUMENT":
            print(f"  {name} {code}: {details}")
    after = _canaries(servers)
    assert after == servers.baseline
    # the verifier canary held its history and cache: a greedy Verify on it gives the twin's answer
    hv = _history(servers.v_vocab, 40, 1)
    r = servers.stubs["verifier"].Verify(verifier_pb2.VerifyRequest(
        session_id=V_CANARY, expect=_check(hv), draft_token_ids=[1, 2, 3], params=GREEDY), timeout=CALL_TIMEOUT_S)
    assert (r.num_accepted, r.next_token_id, list(r.accepted), r.context.length, r.context.crc32) == \
        servers.baseline["verify"]
    assert not math.isnan(r.forward_ms)


def test_every_verify_reply_publishes_the_verifier_s_price(servers):
    """A batched verifier's replies carry its price of a forward (crossdraft/runtime/price.py), fitted
    from every forward it ran: the count grows by exactly the one forward a lone block costs, and the
    price of a forward grows with its rows and tokens."""
    from crossdraft.serving import wire

    v = servers.stubs["verifier"]
    ids = _history(servers.v_vocab, 24, 7)
    v.SyncVerifierSession(verifier_pb2.SyncVerifierSessionRequest(session_id="price", token_ids=ids),
                          timeout=CALL_TIMEOUT_S)
    try:
        r1 = v.Verify(verifier_pb2.VerifyRequest(session_id="price", expect=_check(ids), draft_token_ids=[1, 2],
                                                 params=GREEDY), timeout=CALL_TIMEOUT_S)
        r2 = v.Verify(verifier_pb2.VerifyRequest(session_id="price", draft_token_ids=[], params=GREEDY),
                      timeout=CALL_TIMEOUT_S)
    finally:
        v.EndVerifierSession(verifier_pb2.EndVerifierSessionRequest(session_id="price"), timeout=CALL_TIMEOUT_S)
    p1, p2 = wire.price_from_proto(r1), wire.price_from_proto(r2)
    assert p1 is not None and p2 is not None
    assert p1.forwards >= 1 and p2.forwards == p1.forwards + 1
    assert p2.ms(1, 1) > 0 and p2.ms(8, 40) >= p2.ms(8, 8) >= p2.ms(1, 1)


def test_a_draft_stream_ends_with_the_drafter_s_price(servers):
    """The last message of a Draft stream (the last proposal, or the summary when the block ran to its
    length) carries the drafter's price of a batched step, fitted from every forward it ran."""
    from crossdraft.serving import wire

    d = servers.stubs["drafter"]
    ids = _history(servers.d_vocab, 24, 8)
    d.SyncDrafterSession(drafter_pb2.SyncDrafterSessionRequest(session_id="dprice", token_ids=ids),
                         timeout=CALL_TIMEOUT_S)
    try:
        msgs = list(d.Draft(drafter_pb2.DraftRequest(session_id="dprice", expect=_check(ids), num_draft_tokens=3,
                                                     params=GREEDY), timeout=CALL_TIMEOUT_S))
    finally:
        d.EndDrafterSession(drafter_pb2.EndDrafterSessionRequest(session_id="dprice"), timeout=CALL_TIMEOUT_S)
    last = msgs[-1]
    price = wire.price_from_proto(last.done if last.HasField("done") else last.token)
    assert price is not None and price.forwards >= 3 and price.ms(1, 1) > 0
    # only the last message carries it (one message per proposal on the hot path)
    assert not any(m.token.HasField("price") for m in msgs[:-1] if m.HasField("token"))


def test_draft_block_answers_the_block_draft_streams_in_one_reply(servers):
    """DraftBlock: the block Draft streams (same session state, greedy), in one reply whose last proposal
    carries last = true and the drafter's price."""
    from crossdraft.serving import wire

    d = servers.stubs["drafter"]
    ids = _history(servers.d_vocab, 24, 9)
    d.SyncDrafterSession(drafter_pb2.SyncDrafterSessionRequest(session_id="dblock", token_ids=ids),
                         timeout=CALL_TIMEOUT_S)
    req = drafter_pb2.DraftRequest(session_id="dblock", expect=_check(ids), num_draft_tokens=5, params=GREEDY)
    try:  # (proposals stay uncommitted: each call drafts from the same ids)
        streamed = [m.token for m in d.Draft(req, timeout=CALL_TIMEOUT_S) if m.HasField("token")]
        block = list(d.DraftBlock(req, timeout=CALL_TIMEOUT_S).tokens)
    finally:
        d.EndDrafterSession(drafter_pb2.EndDrafterSessionRequest(session_id="dblock"), timeout=CALL_TIMEOUT_S)
    assert len(streamed) == 5 and [t.token_id for t in block] == [t.token_id for t in streamed]
    assert [t.last for t in block] == [False] * 4 + [True]
    assert wire.price_from_proto(block[-1]) is not None and not any(t.HasField("price") for t in block[:-1])
