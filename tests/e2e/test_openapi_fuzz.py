"""Property-based fuzzing of the REST API from its own OpenAPI document (schemathesis + hypothesis)
against a real gateway on tiny models: generated valid and invalid requests for every operation
never get a 5xx, an undocumented status code, a wrong content type or a response that breaks the
documented schema. Bounded in examples so that it fits CI; `make fuzz` runs more."""

from __future__ import annotations

import os

import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import CHECKS
from schemathesis.specs.openapi import checks as _openapi_checks  # noqa: F401  (registers the OpenAPI checks)

MAX_EXAMPLES = int(os.environ.get("CROSSDRAFT_FUZZ_EXAMPLES", "12"))


def _checks():
    wanted = {"not_a_server_error", "status_code_conformance", "content_type_conformance",
              "response_schema_conformance"}
    found = [c for c in CHECKS.get_all() if c.__name__ in wanted]
    assert {c.__name__ for c in found} == wanted, "schemathesis renamed a check"
    return found


@pytest.fixture(scope="module")
def api(stack):
    doc = requests.get(stack.http + "/openapi.json", timeout=30).json()
    # tiny models hold 512 positions: keep generated requests short (the limit is documented as it is)
    doc["components"]["schemas"]["CompletionRequest"]["properties"]["max_tokens"]["maximum"] = 24
    doc["components"]["schemas"]["ChatRequest"]["properties"]["max_tokens"]["maximum"] = 24
    for name in ("CompletionRequest", "ChatRequest"):
        doc["components"]["schemas"][name]["properties"]["max_completion_tokens"]["maximum"] = 24
        doc["components"]["schemas"][name]["properties"]["n"]["maximum"] = 2
    return schemathesis.openapi.from_dict(doc), stack.http


def _operations():
    from gateway.openapi import openapi_document

    return [(p, m) for p, item in openapi_document()["paths"].items() for m in item if m in ("get", "post", "delete")]


@pytest.mark.parametrize("path, method", _operations())
def test_fuzz_operation(api, path, method):
    schema, base = api
    op = next(o.ok() for o in schema.get_all_operations() if o.ok().path == path and o.ok().method.lower() == method)
    checks = _checks()
    session = requests.Session()

    @hypothesis.given(case=op.as_strategy())
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
    def run(case):
        case.call_and_validate(base_url=base, session=session, checks=checks, timeout=120)

    run()
