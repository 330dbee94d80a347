"""The REST layer's errors: crossdraft's error types as HTTP statuses in OpenAI's error shape
(``{"error": {message, type, param, code}}``), the statuses named in docs/layout.md's conventions."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from crossdraft.errors import (
    CrossdraftError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)

RETRY_AFTER_S = 1  # 429 / 503: when to try again (a round or two frees KV memory; a restart takes longer)


def error_response(exc: Exception) -> JSONResponse:
    status, etype, param = 500, "server_error", None
    msg = str(exc)
    if isinstance(exc, InvalidArgument):
        status, etype, param = 400, "invalid_request_error", exc.field
        if "longer than" in msg:
            status = 413
    elif isinstance(exc, NotFound):
        status, etype, param = 404, "not_found_error", exc.what
    elif isinstance(exc, FailedPrecondition):
        status, etype = 409, "conflict_error"
        head, sep, _ = msg.partition(": ")
        param = head if sep and head.isidentifier() else None  # e.g. "session_id: session 'x' already exists"
    elif isinstance(exc, ResourceExhausted):
        status, etype = 429, "rate_limit_error"
    elif isinstance(exc, Unavailable):
        status, etype = 503, "service_unavailable"
    elif isinstance(exc, Unauthenticated):
        status, etype, param = 401, "authentication_error", "authorization"
    elif not isinstance(exc, CrossdraftError):
        msg = f"internal error ({type(exc).__name__})"
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return JSONResponse({"error": {"message": msg, "type": etype, "param": param, "code": status}}, status_code=status,
                        headers=headers)


async def http_error(request: Request, exc: HTTPException):
    # unknown paths (404) and wrong methods (405) answer in the same JSON error shape as the rest
    etype = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    msg = f"{exc.detail}: {request.method} {request.url.path}"
    return JSONResponse({"error": {"message": msg, "type": etype, "param": None, "code": exc.status_code}},
                        status_code=exc.status_code, headers=exc.headers)
