"""HTTP errors and their JSON bodies, in the shape of the API the client speaks.

OpenAI and Responses: ``{"error":{"message","type","code"?,"param"?}}``; Anthropic:
``{"type":"error","error":{"type","message"}}``.  Every 4xx/5xx the server sends goes through
here, so no client ever sees a traceback or an HTML page."""

from __future__ import annotations

import json

from starlette.responses import Response

from ds4_mlx.frontends.server.events import BackendError

OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                405: "invalid_request_error", 408: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                421: "invalid_request_error",
                422: "invalid_request_error", 429: "rate_limit_error", 503: "server_error",
                500: "server_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   405: "invalid_request_error", 408: "invalid_request_error", 409: "invalid_request_error", 415: "invalid_request_error",
                   421: "invalid_request_error",
                   413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
                   503: "overloaded_error", 500: "api_error"}


class ApiError(BackendError):
    """An error the HTTP side finds itself (body, limits, auth, routing, queue)."""


def protocol_of_path(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_body(err: BackendError, protocol: str) -> dict:
    if protocol == "anthropic":
        inner = {"type": ANTHROPIC_TYPES.get(err.status, "api_error"), "message": err.message}
        if err.code:
            inner["code"] = err.code
        inner.update(err.extra)
        return {"type": "error", "error": inner}
    inner = {"message": err.message, "type": OPENAI_TYPES.get(err.status, "server_error")}
    if err.code:
        inner["code"] = err.code
    if err.param:
        inner["param"] = err.param
    inner.update(err.extra)
    return {"error": inner}


def error_response(err: BackendError, protocol: str, extra_headers: dict | None = None) -> Response:
    headers = dict(extra_headers or {})
    headers.update(err.headers)
    return Response(json.dumps(error_body(err, protocol), ensure_ascii=False),
                    status_code=err.status, media_type="application/json", headers=headers)


def stream_error_event(message: str, protocol: str) -> str:
    """Mid-stream failure, as ds4 sends it: an ``event: error`` SSE frame."""
    if protocol == "anthropic":
        data = {"type": "error", "error": {"type": "api_error", "message": message}}
    else:
        data = {"error": {"message": message, "type": "server_error"}}
    return "event: error\ndata: " + json.dumps(data, ensure_ascii=False) + "\n\n"
