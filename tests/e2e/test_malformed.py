"""Malformed requests against the real stack: each one gets the exact 4xx / gRPC status and an error
that names the offending field; afterwards the gateway still answers correctly and /metrics has
counted the rejections."""

from __future__ import annotations

import json
import re

import grpc
import pytest
import requests

from crossdraft.v1 import gateway_pb2, gateway_pb2_grpc

EXISTING = "malformed-existing"  # a session every table case may refer to (created by the fixture)
MISSING = "malformed-never-created"
OK_PROMPT = "def fibonacci(n):\n"
TIMEOUT = 60


@pytest.fixture(scope="module")
def existing_session(stack):
    r = requests.post(stack.http + "/v1/sessions", json={"session_id": EXISTING, "max_tokens": 4}, timeout=TIMEOUT)
    assert r.status_code == 201, r.text
    return EXISTING


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.grpc) as ch:
        yield gateway_pb2_grpc.GatewayServiceStub(ch)


def _raw(obj) -> bytes:
    return json.dumps(obj).encode()


C, CHAT, S = "/v1/completions", "/v1/chat/completions", "/v1/sessions"


def P(**kw):
    """A completions body: a valid prompt plus `kw` (a value of ... drops the key)."""
    d = {"prompt": OK_PROMPT, "max_tokens": 4}
    d.update(kw)
    return {k: v for k, v in d.items() if v is not ...}


MSGS = [{"role": "user", "content": "hi"}]

# (id, method, path, body: dict/list/str -> JSON, bytes -> raw, None -> no body, status, param, message part)
REST_CASES = [
    ("invalid-json", "POST", C, b'{"prompt": "abc",', 400, "body", "not valid JSON"),
    ("empty-body", "POST", C, b"", 400, "body", "not valid JSON"),
    ("bad-utf8", "POST", C, b'{"prompt": "\xff\xfe"}', 400, "body", "UTF-8"),
    ("json-list", "POST", C, [1, 2, 3], 400, "body", "JSON object"),
    ("json-string", "POST", C, "prompt", 400, "body", "JSON object"),
    ("json-null", "POST", C, b"null", 400, "body", "JSON object"),
    ("deeply-nested-json", "POST", C, b"[" * 200_000 + b"]" * 200_000, 400, "body", "nested"),
    ("missing-prompt", "POST", C, P(prompt=...), 400, "prompt", "required"),
    ("prompt-int", "POST", C, P(prompt=5), 400, "prompt", "string"),
    ("prompt-list", "POST", C, P(prompt=["a", "b"]), 400, "prompt", "string"),
    ("prompt-null", "POST", C, P(prompt=None), 400, "prompt", "string"),
    ("prompt-empty", "POST", C, P(prompt=""), 400, "prompt", "empty"),
    ("prompt-lone-surrogate", "POST", C, b'{"prompt": "ab\\ud800cd", "max_tokens": 4}', 400, "prompt", "UTF-8"),
    ("prompt-too-long", "POST", C, P(prompt="a" * 200_001), 413, "prompt", "longer than 200000"),
    ("max_tokens-negative", "POST", C, P(max_tokens=-1), 400, "max_tokens", ">= 1"),
    ("max_tokens-zero", "POST", C, P(max_tokens=0), 400, "max_tokens", ">= 1"),
    ("max_tokens-string", "POST", C, P(max_tokens="8"), 400, "max_tokens", "integer"),
    ("max_tokens-float", "POST", C, P(max_tokens=8.5), 400, "max_tokens", "integer"),
    ("max_tokens-bool", "POST", C, P(max_tokens=True), 400, "max_tokens", "integer"),
    ("max_tokens-above-limit", "POST", C, P(max_tokens=4097), 400, "max_tokens", "<= 4096"),
    ("max_completion_tokens-zero", "POST", C, P(max_tokens=..., max_completion_tokens=0), 400, "max_completion_tokens",
     ">= 1"),
    ("max_tokens-and-max_completion_tokens", "POST", C, P(max_completion_tokens=8), 400, "max_completion_tokens",
     "only one"),
    # past the target's context (512 tokens): the REST field is named, not the gateway's option
    ("max_tokens-past-the-context", "POST", C, P(max_tokens=510), 400, "max_tokens",
     "+ max_tokens (510) exceeds the context"),
    ("max_completion_tokens-past-the-context", "POST", C, P(max_tokens=..., max_completion_tokens=510), 400,
     "max_completion_tokens", "+ max_completion_tokens (510) exceeds the context"),
    ("temperature-negative", "POST", C, P(temperature=-0.5), 400, "temperature", ">= 0"),
    ("temperature-string", "POST", C, P(temperature="hot"), 400, "temperature", "number"),
    ("temperature-nan", "POST", C, b'{"prompt": "abc", "max_tokens": 4, "temperature": NaN}', 400, "temperature",
     "finite"),
    ("temperature-infinity", "POST", C, b'{"prompt": "abc", "max_tokens": 4, "temperature": Infinity}', 400,
     "temperature", "finite"),
    ("top_p-zero", "POST", C, P(top_p=0), 400, "top_p", "(0, 1]"),
    ("top_p-1.5", "POST", C, P(top_p=1.5), 400, "top_p", "(0, 1]"),
    ("top_k-negative", "POST", C, P(top_k=-1), 400, "top_k", ">= 0"),
    ("top_k-float", "POST", C, P(top_k=2.5), 400, "top_k", "integer"),
    ("top_k-overflows-int32", "POST", C, P(top_k=2**31), 400, "top_k", "<="),
    ("repetition_penalty-zero", "POST", C, P(repetition_penalty=0), 400, "repetition_penalty", "> 0"),
    ("seed-negative", "POST", C, P(seed=-1), 400, "seed", ">= 0"),
    ("seed-string", "POST", C, P(seed="x"), 400, "seed", "integer"),
    ("seed-above-uint63", "POST", C, P(seed=2**64), 400, "seed", "<="),
    ("num_draft_tokens-zero", "POST", C, P(num_draft_tokens=0), 400, "num_draft_tokens", ">= 1"),
    ("num_draft_tokens-100", "POST", C, P(num_draft_tokens=100), 400, "num_draft_tokens", "<= 64"),
    ("adaptive_draft-string", "POST", C, P(adaptive_draft="no"), 400, "adaptive_draft", "boolean"),
    ("use_drafter-int", "POST", C, P(use_drafter=0), 400, "use_drafter", "boolean"),
    ("stream-string", "POST", C, P(stream="yes"), 400, "stream", "boolean"),
    ("unknown-field", "POST", C, P(frobnicate=1), 400, "frobnicate", "unknown field"),
    ("n-too-many", "POST", C, P(n=17), 400, "n", "<= 16"),
    ("logprobs-too-many", "POST", C, P(logprobs=21), 400, "logprobs", "<= 20"),
    ("stop-empty-string", "POST", C, P(stop=["\n", ""]), 400, "stop[1]", "non-empty"),
    ("stop-too-many", "POST", C, P(stop=["a", "b", "c", "d", "e"]), 400, "stop", "at most 4"),
    ("stop-not-text", "POST", C, P(stop={"a": 1}), 400, "stop", "string"),
    ("session_id-unknown", "POST", C, P(session_id=MISSING), 404, "session_id", MISSING),
    ("session_id-bad-chars", "POST", C, P(session_id="bad id!"), 400, "session_id", "letters, digits"),
    ("session_id-too-long", "POST", C, P(session_id="a" * 65), 400, "session_id", "1-64"),
    ("session_id-int", "POST", C, P(session_id=7), 400, "session_id", "string"),
    # chat
    ("chat-messages-missing", "POST", CHAT, {"max_tokens": 4}, 400, "messages", "required"),
    ("chat-messages-not-list", "POST", CHAT, {"messages": "hi"}, 400, "messages", "non-empty list"),
    ("chat-messages-empty", "POST", CHAT, {"messages": []}, 400, "messages", "non-empty list"),
    ("chat-element-not-object", "POST", CHAT, {"messages": ["hi"]}, 400, "messages[0]", "object"),
    ("chat-bad-role", "POST", CHAT, {"messages": MSGS + [{"role": "robot", "content": "x"}]}, 400, "messages[1].role",
     "robot"),
    ("chat-role-missing", "POST", CHAT, {"messages": [{"content": "x"}]}, 400, "messages[0].role", "None"),
    ("chat-content-int", "POST", CHAT, {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content",
     "string"),
    ("chat-content-lone-surrogate", "POST", CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400,
     "messages[0].content", "UTF-8"),
    ("chat-prompt-field", "POST", CHAT, {"messages": MSGS, "prompt": "x"}, 400, "prompt", "unknown field"),
    ("chat-bad-option", "POST", CHAT, {"messages": MSGS, "top_p": 2}, 400, "top_p", "(0, 1]"),
    ("chat-too-long", "POST", CHAT, {"messages": [{"role": "user", "content": "a" * 200_001}]}, 413, "messages",
     "longer than"),
    ("chat-no-template", "POST", CHAT, {"messages": MSGS}, 400, "messages", "chat template"),
    # sessions
    ("session-bad-option", "POST", S, {"temperature": -1}, 400, "temperature", ">= 0"),
    ("session-bad-max_tokens", "POST", S, {"max_tokens": "lots"}, 400, "max_tokens", "integer"),
    ("session-unknown-field", "POST", S, {"prompt": "x"}, 400, "prompt", "unknown field"),
    ("session-bad-id", "POST", S, {"session_id": "no/slashes"}, 400, "session_id", "letters, digits"),
    ("session-id-int", "POST", S, {"session_id": 12}, 400, "session_id", "string"),
    ("session-top_k-overflows-int32", "POST", S, {"top_k": 2**40}, 400, "top_k", "<="),
    ("session-max_completion_tokens-zero", "POST", S, {"max_completion_tokens": 0}, 400, "max_completion_tokens",
     ">= 1"),
    ("session-body-list", "POST", S, [1], 400, "body", "JSON object"),
    ("session-duplicate", "POST", S, {"session_id": EXISTING}, 409, "session_id", "already exists"),
    ("session-get-unknown", "GET", f"{S}/{MISSING}", None, 404, "session_id", MISSING),
    ("session-delete-unknown", "DELETE", f"{S}/{MISSING}", None, 404, "session_id", MISSING),
    ("session-get-bad-id", "GET", f"{S}/bad.id", None, 400, "session_id", "letters, digits"),
    ("session-delete-bad-id", "DELETE", f"{S}/bad.id", None, 400, "session_id", "letters, digits"),
    ("chat-on-session-no-template", "POST", CHAT, {"messages": MSGS, "session_id": EXISTING}, 400, "messages",
     "chat template"),
    # routing
    ("wrong-method-get-completions", "GET", C, None, 405, None, "Method Not Allowed"),
    ("wrong-method-put-sessions", "PUT", S, {}, 405, None, "Method Not Allowed"),
    ("unknown-path", "POST", "/v1/nope", {}, 404, None, "Not Found"),
]


@pytest.mark.parametrize("case", REST_CASES, ids=[c[0] for c in REST_CASES])
def test_rest_malformed(stack, existing_session, case):
    _, method, path, body, status, param, part = case
    kw = {}
    if isinstance(body, bytes):
        kw = {"data": body, "headers": {"Content-Type": "application/json"}}
    elif body is not None:
        kw = {"data": _raw(body), "headers": {"Content-Type": "application/json"}}
    r = requests.request(method, stack.http + path, timeout=TIMEOUT, **kw)
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json"), r.text[:500]
    err = r.json()["error"]
    assert err["code"] == status
    assert err["param"] == param, err
    assert part in err["message"], err
    if status == 405:
        assert "POST" in r.headers["allow"]
    if param is not None:
        assert err["message"].startswith(f"{param}:"), err
        assert err["type"] in ("invalid_request_error", "not_found_error", "conflict_error")


def _opts(**kw):
    return gateway_pb2.GenerationOptions(**kw)


G = gateway_pb2.GenerateRequest
M = gateway_pb2.ChatMessage
GOOD_MSG = [M(role="user", content="hi")]
INV, NF, FP = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION

# (id, rpc, request, code, field, message part)
GRPC_CASES = [
    ("prompt-and-messages", "Generate", G(prompt="abc", messages=GOOD_MSG), INV, "prompt", "exactly one"),
    ("neither", "Generate", G(), INV, "prompt", "empty"),
    ("neither-with-options", "Generate", G(options=_opts(max_new_tokens=4)), INV, "prompt", "empty"),
    ("unknown-session", "Generate", G(prompt="abc", session_id=MISSING), NF, "session_id", MISSING),
    ("bad-session-chars", "Generate", G(prompt="abc", session_id="bad id!"), INV, "session_id", "letters, digits"),
    ("prompt-too-long", "Generate", G(prompt="a" * 200_001), INV, "prompt", "longer than"),
    ("temperature-negative", "Generate", G(prompt="abc", options=_opts(temperature=-1)), INV, "temperature", ">= 0"),
    ("temperature-nan", "Generate", G(prompt="abc", options=_opts(temperature=float("nan"))), INV, "temperature",
     "finite"),
    ("top_p-2", "Generate", G(prompt="abc", options=_opts(top_p=2)), INV, "top_p", "(0, 1]"),
    ("top_k-negative", "Generate", G(prompt="abc", options=_opts(top_k=-1)), INV, "top_k", ">= 0"),
    ("repetition_penalty-negative", "Generate", G(prompt="abc", options=_opts(repetition_penalty=-1)), INV,
     "repetition_penalty", "> 0"),
    ("max_new_tokens-zero-set", "Generate", G(prompt="abc", options=_opts(max_new_tokens=0)), INV, "max_new_tokens",
     ">= 1"),
    ("max_new_tokens-100000", "Generate", G(prompt="abc", options=_opts(max_new_tokens=100000)), INV, "max_new_tokens",
     "<= 4096"),
    ("num_draft_tokens-65", "Generate", G(prompt="abc", options=_opts(num_draft_tokens=65)), INV, "num_draft_tokens",
     "<= 64"),
    ("num_draft_tokens-zero-set", "Generate", G(prompt="abc", options=_opts(num_draft_tokens=0)), INV,
     "num_draft_tokens", ">= 1"),
    ("seed-above-int63", "Generate", G(prompt="abc", options=_opts(seed=2**64 - 1)), INV, "seed", "<="),
    ("role-robot", "Generate", G(messages=[M(role="robot", content="beep")]), INV, "messages[0].role", "robot"),
    ("role-empty", "Generate", G(messages=GOOD_MSG + [M(content="x")]), INV, "messages[1].role",
     "system, user or assistant"),
    ("chat-no-template", "Generate", G(messages=GOOD_MSG), INV, "messages", "chat template"),
    ("get-unknown", "GetSession", gateway_pb2.GetSessionRequest(session_id=MISSING), NF, "session_id", MISSING),
    ("get-empty-id", "GetSession", gateway_pb2.GetSessionRequest(), INV, "session_id", "1-64"),
    ("get-bad-id", "GetSession", gateway_pb2.GetSessionRequest(session_id="a b"), INV, "session_id", "letters, digits"),
    ("delete-bad-id", "DeleteSession", gateway_pb2.DeleteSessionRequest(session_id="a/b"), INV, "session_id", "1-64"),
    ("create-bad-id", "CreateSession", gateway_pb2.CreateSessionRequest(session_id="bad id!"), INV, "session_id",
     "letters, digits"),
    ("create-id-too-long", "CreateSession", gateway_pb2.CreateSessionRequest(session_id="x" * 65), INV, "session_id",
     "1-64"),
    ("create-bad-option", "CreateSession", gateway_pb2.CreateSessionRequest(options=_opts(top_p=0)), INV, "top_p",
     "(0, 1]"),
    ("create-duplicate", "CreateSession", gateway_pb2.CreateSessionRequest(session_id=EXISTING), FP, "session_id",
     "already exists"),
]


def _call(stub, rpc, req):
    fn = getattr(stub, rpc)
    if rpc == "Generate":
        return list(fn(req, timeout=TIMEOUT))
    return fn(req, timeout=TIMEOUT)


@pytest.mark.parametrize("case", GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_grpc_malformed(stub, existing_session, case):
    _, rpc, req, code, field, part = case
    with pytest.raises(grpc.RpcError) as ei:
        _call(stub, rpc, req)
    e = ei.value
    assert e.code() == code, (e.code(), e.details())
    assert e.details().startswith(f"{field}:"), e.details()
    assert part in e.details(), e.details()


def test_grpc_delete_unknown_session_reports_not_existed(stub):
    """DeleteSession is idempotent by contract: an unknown id is OK with existed=false (REST says 404)."""
    assert stub.DeleteSession(gateway_pb2.DeleteSessionRequest(session_id=MISSING), timeout=TIMEOUT).existed is False


def _rejected(stack) -> dict:
    text = requests.get(stack.http + "/metrics", timeout=TIMEOUT).text
    out = {"rest": 0.0, "grpc": 0.0}
    for api in out:
        m = re.search(rf'crossdraft_requests_total\{{api="{api}",status="rejected"\}} ([0-9.e+]+)', text)
        out[api] = float(m.group(1)) if m else 0.0
    return out


def test_still_healthy_after_the_table_and_rejections_are_counted(stack, stub, engine, existing_session):
    assert stack.gw.alive() and stack.verifier.alive() and stack.drafter.alive()
    before = _rejected(stack)
    assert before["rest"] >= 30  # the REST table above (when run in the same module)
    for body in (P(max_tokens=0), P(prompt=5), P(top_p=9)):
        assert requests.post(stack.http + C, json=body, timeout=TIMEOUT).status_code == 400
    for req in (G(), G(prompt="abc", options=_opts(temperature=-1))):
        with pytest.raises(grpc.RpcError):
            _call(stub, "Generate", req)
    after = _rejected(stack)
    assert after["rest"] - before["rest"] == 3
    assert after["grpc"] - before["grpc"] == 2

    # a valid request still gives exactly the in-process engine's greedy text, on REST and gRPC
    ref = engine.generate(OK_PROMPT, max_new_tokens=16, use_drafter=False)
    r = requests.post(stack.http + C, json={"prompt": OK_PROMPT, "max_tokens": 16}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref.text
    assert r.json()["speculative"]["mode"] == "speculative"
    out = _call(stub, "Generate", G(prompt=OK_PROMPT, options=_opts(max_new_tokens=16)))
    assert out[-1].done.text == ref.text
    # the session the table hammered is intact and still usable
    info = requests.get(f"{stack.http}/v1/sessions/{EXISTING}", timeout=TIMEOUT).json()
    assert info["turns"] == 0 and info["options"]["max_tokens"] == 4
    r = requests.post(stack.http + C, json={"prompt": OK_PROMPT, "session_id": EXISTING}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["session_id"] == EXISTING
