"""The OpenAPI document describes exactly the REST API the gateway serves: every route and method,
and the request fields the handlers accept (the fuzz run in tests/e2e/test_openapi_fuzz.py checks
the responses against it)."""

from __future__ import annotations

import schemathesis

from gateway import rest, rest_input
from gateway.openapi import openapi_document


def test_every_route_is_documented_and_nothing_else():
    doc = openapi_document()
    served = set()
    for r in rest.RestApi(lambda: None).routes():
        for m in r.methods - {"HEAD"}:
            served.add((r.path, m.lower()))
    documented = {(p, m) for p, item in doc["paths"].items() for m in item if m in ("get", "post", "delete")}
    assert served == documented


def test_request_fields_are_the_ones_the_handlers_accept():
    schemas = openapi_document()["components"]["schemas"]
    shared = set(rest_input.REST_OPTIONS) | set(rest_input.NEUTRAL)
    shared |= {"stream", "session_id", "stop", "stream_options", "n"}
    assert set(schemas["CompletionRequest"]["properties"]) == shared | {"prompt", "logprobs", "echo"}
    assert set(schemas["ChatRequest"]["properties"]) == shared | {"messages", "logprobs", "top_logprobs"}


def test_the_document_loads_as_openapi_with_every_operation():
    schema = schemathesis.openapi.from_dict(openapi_document(512))
    ops = [o.ok() for o in schema.get_all_operations()]
    assert len(ops) == sum(1 for item in openapi_document()["paths"].values()
                           for m in item if m in ("get", "post", "delete"))
    assert openapi_document(512)["components"]["schemas"]["CompletionRequest"]["properties"]["max_tokens"][
        "maximum"] == 512
