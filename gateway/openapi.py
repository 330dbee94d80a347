"""The REST API as an OpenAPI 3.1 document (served at ``GET /openapi.json``).

Written by hand next to the handlers in :mod:`gateway.rest` and kept true by tests: every route of
the app is described here and nothing else (``tests/unit/gateway/test_openapi.py``), and a property-based
run of this document against a real gateway finds no 5xx, no undocumented status code and no
response that breaks its schema (``tests/e2e/test_openapi_fuzz.py``).
"""

from __future__ import annotations

from crossdraft.errors import SESSION_ID_RE

_ERROR = {"$ref": "#/components/responses/Error"}
_INT63 = 2**63 - 1


def _errors(*codes: int) -> dict:
    return {str(c): _ERROR for c in codes}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _generation_properties(max_new_tokens: int) -> dict:
    """Fields shared by completions, chat and session defaults."""
    return {
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": max_new_tokens,
                       "description": "new tokens at most (max_completion_tokens is the same; give one)"},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": max_new_tokens},
        "temperature": {"type": "number", "minimum": 0, "description": "0 = greedy"},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1, "description": "0 = off"},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "description": "1 = off"},
        "seed": {"type": "integer", "minimum": 0, "maximum": _INT63},
        "num_draft_tokens": {"type": "integer", "minimum": 1, "maximum": 64,
                             "description": "initial block size of the drafter"},
        "adaptive_draft": {"type": "boolean", "description": "adapt the block size (default true)"},
        "use_drafter": {"type": "boolean", "description": "false = target-only"},
    }


def _request_schema(chat: bool, max_new_tokens: int) -> dict:
    props = _generation_properties(max_new_tokens)
    props.update({
        "session_id": {"type": "string", "pattern": SESSION_ID_RE.pattern,
                       "description": "continue this session (its history, options and KV caches)"},
        "stream": {"type": "boolean", "description": "server-sent events"},
        "stream_options": {"type": "object", "additionalProperties": False,
                           "properties": {"include_usage": {"type": "boolean"}},
                           "description": "only with stream: true"},
        "stop": {"oneOf": [{"type": "string", "maxLength": 256},
                           {"type": "array", "maxItems": 4,
                            "items": {"type": "string", "minLength": 1, "maxLength": 256}},
                           {"type": "null"}]},
        "n": {"type": "integer", "minimum": 1, "maximum": 16, "description": "completions (not with session_id)"},
        "model": {"type": "string", "description": "accepted and ignored (the gateway serves one model)"},
        "user": {"type": "string", "description": "accepted and ignored"},
        "presence_penalty": {"type": "number", "enum": [0], "description": "only 0 (unsupported)"},
        "frequency_penalty": {"type": "number", "enum": [0], "description": "only 0 (unsupported)"},
        "best_of": {"type": "integer", "enum": [1], "description": "only 1 (unsupported)"},
        "suffix": {"type": ["string", "null"], "enum": ["", None], "description": "only empty (unsupported)"},
    })
    if chat:
        props["messages"] = {"type": "array", "minItems": 1, "items": _ref("ChatMessage")}
        props["logprobs"] = {"type": ["boolean", "null"]}
        props["top_logprobs"] = {"type": "integer", "minimum": 0, "maximum": 20,
                                 "description": "needs logprobs: true"}
        required = ["messages"]
    else:
        props["prompt"] = {"type": "string", "minLength": 1}
        props["logprobs"] = {"type": ["integer", "null"], "minimum": 0, "maximum": 20}
        props["echo"] = {"type": "boolean"}
        required = ["prompt"]
    return {"type": "object", "additionalProperties": False, "required": required, "properties": props}


def _completion_schema(chat: bool) -> dict:
    if chat:
        choice = {"type": "object", "required": ["index", "message", "finish_reason"], "properties": {
            "index": {"type": "integer", "minimum": 0},
            "message": {"type": "object", "required": ["role", "content"],
                        "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}},
            "finish_reason": {"enum": ["stop", "length"]},
            "logprobs": {"oneOf": [_ref("ChatLogprobs"), {"type": "null"}]},
        }}
    else:
        choice = {"type": "object", "required": ["index", "text", "finish_reason", "logprobs"], "properties": {
            "index": {"type": "integer", "minimum": 0},
            "text": {"type": "string"},
            "finish_reason": {"enum": ["stop", "length"]},
            "logprobs": {"oneOf": [_ref("CompletionLogprobs"), {"type": "null"}]},
        }}
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"},
        "object": {"const": "chat.completion" if chat else "text_completion"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "minItems": 1, "items": choice},
        "usage": _ref("Usage"),
        "speculative": _ref("SpeculativeStats"),
        "session_id": {"type": ["string", "null"]},
    }}


def _sse() -> dict:
    """One server-sent event: data is an OpenAI chunk object as JSON, or [DONE] at the end."""
    return {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"],
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
        "description": "with stream: true -- events whose data is an OpenAI chunk object, then [DONE]"}}}


def _health() -> dict:
    return {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}


def openapi_document(max_new_tokens: int = 4096) -> dict:
    """The document; ``max_new_tokens`` is the gateway's --max-new-tokens-limit."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "crossdraft gateway", "version": "1",
                 "description": "Speculative decoding across vocabularies (UAG-TLI), served as an "
                                "OpenAI-compatible REST API. With API keys configured, /v1/* and "
                                "/tokenize, /detokenize need 'Authorization: Bearer <key>'."},
        "paths": {**_generation_paths(), **_model_paths(), **_session_paths(max_new_tokens), **_tokenizer_paths(),
                  **_service_paths()},
        "components": {
            "responses": {"Error": {
                "description": "an error naming the bad field (param) where there is one",
                "headers": {"Retry-After": {"description": "429 / 503: seconds to wait",
                                            "schema": {"type": "string"}}},
                "content": {"application/json": {"schema": _ref("Error")}}}},
            "schemas": _schemas(max_new_tokens),
        },
    }


def _generation_paths() -> dict:
    """/v1/completions and /v1/chat/completions."""

    def generation(chat: bool) -> dict:
        name = "Chat" if chat else "Completion"
        return {"post": {
            "summary": "Chat completion" if chat else "Text completion",
            "description": "Speculative decoding behind an OpenAI-compatible API. Bad input is a 4xx naming "
                           "the field; past the admission limits 429 with Retry-After.",
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": _ref(f"{name}Request")}}},
            "responses": {"200": {"description": "the completion (JSON), or server-sent events with stream",
                                  "content": {"application/json": {"schema": _ref(name)}, **_sse()}},
                          **_errors(400, 401, 404, 409, 413, 429, 503)},
        }}

    return {"/v1/completions": generation(False), "/v1/chat/completions": generation(True)}


def _model_paths() -> dict:
    """/v1/models and /v1/vocab: what the gateway serves."""
    return {
        "/v1/models": {"get": {"summary": "The served model", "responses": {
            "200": {"description": "one model", "content": {"application/json": {"schema": {
                "type": "object", "required": ["object", "data"], "properties": {
                    "object": {"const": "list"},
                    "data": {"type": "array", "items": {"type": "object", "required": ["id", "object"],
                                                       "properties": {"id": {"type": "string"},
                                                                      "object": {"const": "model"},
                                                                      "drafter": {"type": ["string", "null"]},
                                                                      "revision": {
                                                                          "type": "string",
                                                                          "description": "Hub commit served "
                                                                          "('' = catalog or local model)"},
                                                                      "drafter_revision": {
                                                                          "type": "string"}}}}}}}}},
            **_errors(401, 503)}}},
        "/v1/vocab": {"get": {"summary": "Vocabulary-intersection diagnostics", "responses": {
            "200": {"description": "the mapping's statistics",
                    "content": {"application/json": {"schema": {"type": "object"}}}},
            **_errors(401, 503)}}},
    }


def _session_paths(max_new_tokens: int) -> dict:
    """/v1/sessions and /v1/sessions/{sid}."""
    session_request = {"type": "object", "additionalProperties": False,
                       "properties": dict(_generation_properties(max_new_tokens),
                                          session_id={"type": "string", "pattern": SESSION_ID_RE.pattern})}
    session_path = {
        "parameters": [{"name": "sid", "in": "path", "required": True, "schema": {"type": "string"}}],
        "get": {"summary": "A session", "responses": {
            "200": {"description": "the session", "content": {"application/json": {"schema": _ref("Session")}}},
            **_errors(400, 401, 404, 503)}},
        "delete": {"summary": "Delete a session (and its caches on the model servers)", "responses": {
            "200": {"description": "deleted", "content": {"application/json": {"schema": {
                "type": "object", "required": ["session_id", "deleted"],
                "properties": {"session_id": {"type": "string"}, "deleted": {"const": True}}}}}},
            **_errors(400, 401, 404, 503)}},
    }
    return {
        "/v1/sessions": {"post": {
            "summary": "Create a session (default options for its requests)",
            "requestBody": {"required": False,
                            "content": {"application/json": {"schema": session_request}}},
            "responses": {"201": {"description": "created",
                                  "content": {"application/json": {"schema": _ref("Session")}}},
                          **_errors(400, 401, 409, 413, 503)}}},
        "/v1/sessions/{sid}": session_path,
    }


def _tokenizer_paths() -> dict:
    """/tokenize and /detokenize: the target's tokenizer."""
    return {
        "/tokenize": {"post": {
            "summary": "The target's token ids of a prompt (or of chat messages, with its template)",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "additionalProperties": False, "properties": {
                    "prompt": {"type": "string"}, "messages": {"type": "array", "items": _ref("ChatMessage")},
                    "model": {"type": "string"}}}}}},
            "responses": {"200": {"description": "token ids", "content": {"application/json": {"schema": {
                "type": "object", "required": ["tokens", "count"], "properties": {
                    "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                    "count": {"type": "integer", "minimum": 0},
                    "max_model_len": {"type": ["integer", "null"]}}}}}},
                **_errors(400, 401, 413, 503)}}},
        "/detokenize": {"post": {
            "summary": "The target tokenizer's text of token ids",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "additionalProperties": False, "required": ["tokens"], "properties": {
                    "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                    "model": {"type": "string"}}}}}},
            "responses": {"200": {"description": "text", "content": {"application/json": {"schema": {
                "type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}}}},
                **_errors(400, 401, 413, 503)}}},
    }


def _service_paths() -> dict:
    """Probes, metrics and this document."""
    return {
        "/healthz": {"get": {"summary": "Liveness", "responses": {
            "200": {"description": "alive", "content": {"application/json": {"schema": _health()}}}}}},
        "/readyz": {"get": {"summary": "Readiness: Redis and every verifier SERVING", "responses": {
            "200": {"description": "ready", "content": {"application/json": {"schema": _health()}}},
            "503": {"description": "not ready (starting, draining, Redis or a verifier down)",
                    "content": {"application/json": {"schema": _health()}}}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
            "200": {"description": "text exposition format", "content": {"text/plain": {
                "schema": {"type": "string"}}}}}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {
            "200": {"description": "OpenAPI 3.1", "content": {"application/json": {
                "schema": {"type": "object"}}}}}}},
    }


def _schemas(max_new_tokens: int) -> dict:
    """The components' schemas: errors, requests, responses, sessions."""
    return {
            "Error": {"type": "object", "required": ["error"], "properties": {"error": {
                "type": "object", "required": ["message", "type", "code"], "properties": {
                    "message": {"type": "string"}, "type": {"type": "string"},
                    "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}},
            "ChatMessage": {"type": "object", "additionalProperties": True, "required": ["role", "content"],
                            "properties": {"role": {"enum": ["system", "user", "assistant"]},
                                           "content": {"type": "string"}}},
            "CompletionRequest": _request_schema(False, max_new_tokens),
            "ChatRequest": _request_schema(True, max_new_tokens),
            "Completion": _completion_schema(False),
            "Chat": _completion_schema(True),
            "Usage": {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
                      "properties": {k: {"type": "integer", "minimum": 0}
                                     for k in ("prompt_tokens", "completion_tokens", "total_tokens")}},
            "SpeculativeStats": {"type": "object", "required": ["mode", "rounds", "drafted", "accepted"],
                                 "properties": {"mode": {"enum": ["speculative", "target-only"]},
                                                "draft_mode": {"enum": ["tli", "text", ""]},
                                                "draws": {"enum": ["greedy", "coupled", "rejection"]},
                                                "rounds": {"type": "integer", "minimum": 0},
                                                "drafted": {"type": "integer", "minimum": 0},
                                                "accepted": {"type": "integer", "minimum": 0},
                                                "acceptance_rate": {"type": "number", "minimum": 0,
                                                                    "maximum": 1}}},
            "CompletionLogprobs": {"type": "object",
                                   "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
                                   "properties": {
                                       "tokens": {"type": "array", "items": {"type": "string"}},
                                       "token_logprobs": {"type": "array", "items": {"type": "number"}},
                                       "top_logprobs": {"type": "array", "items": {
                                           "type": "object", "additionalProperties": {"type": "number"}}},
                                       "text_offset": {"type": "array", "items": {"type": "integer"}}}},
            "ChatLogprobs": {"type": "object", "required": ["content"], "properties": {"content": {
                "type": "array", "items": {"type": "object", "required": ["token", "logprob", "bytes",
                                                                         "top_logprobs"], "properties": {
                    "token": {"type": "string"}, "logprob": {"type": "number"},
                    "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}},
                    "top_logprobs": {"type": "array"}}}}}},
            "Session": {"type": "object", "required": ["session_id", "turns", "options"], "properties": {
                "session_id": {"type": "string"}, "turns": {"type": "integer", "minimum": 0},
                "target_tokens": {"type": "integer"}, "drafter_tokens": {"type": "integer"},
                "options": {"type": "object"}, "stats": {"type": "object"},
                "text": {"type": "string"}, "messages": {"type": "array"}}},
    }
