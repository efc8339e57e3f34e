"""Errors as OpenAI-style bodies: ``{"error": {"message", "type", "code", "param"}}``.

Every failure the server reports — bad JSON, a wrong field, an engine
``RequestError``, an unknown route, a bug — leaves in this shape, so clients
(the OpenAI SDK included) show the message instead of a bare status line. A
bug is a 500 like any other error: the client's keep-alive connection stays
usable for its next request (``UnexpectedErrorMiddleware``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hicache.engine.api import RequestError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}

# At most this many validation problems are spelt out in one message.
_MAX_LISTED = 3

logger = logging.getLogger(__name__)


class APIError(Exception):
    """A failure to report to the client with ``status`` and ``message``."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def error_payload(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    error_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "code": status, "param": param}}


def error_response(
    status: int, message: str, param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_payload(status, message, param), status_code=status, headers=headers)


def describe_validation_error(
    error: ValidationError | RequestValidationError,
) -> tuple[str, str | None]:
    """A one-line message for the client, and the first offending field's name."""
    problems: list[str] = []
    first_param: str | None = None
    for item in error.errors():
        # Union branch tags ("~one", "~batch": a field that is one item or a list) are
        # not part of the field's path.
        loc = [str(part) for part in item.get("loc", ())
               if part != "body" and not str(part).startswith("~")]
        path = ".".join(loc)
        kind = item.get("type", "")
        if kind == "json_invalid":
            problems.append(f"the request body is not valid JSON ({item.get('msg', '')})")
        elif kind == "extra_forbidden":
            problems.append(f"unrecognized field {path!r}")
        elif kind == "missing":
            problems.append(f"{path}: this field is required")
        elif kind == "model_type" and not path:
            problems.append("the request body must be a JSON object")
        else:
            message = str(item.get("msg", "invalid value")).removeprefix("Value error, ")
            shown = _short(item.get("input"))
            if path and message.startswith(loc[-1]):
                # Our validators' messages start with the field's name: add only its parents.
                where = "".join(f"{part}." for part in loc[:-1])
            else:
                where = f"{path}: " if path else ""
            got = f" (got {shown})" if shown is not None and kind != "value_error" else ""
            problems.append(f"{where}{message}{got}")
        if first_param is None and path:
            first_param = path
        if len(problems) == _MAX_LISTED:
            break
    message = "; ".join(dict.fromkeys(problems)) or "invalid request"
    return message, first_param


def _short(value: Any) -> str | None:
    if isinstance(value, dict | list):
        return None  # the whole object: not worth echoing
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error_response(error.status, error.message, error.param, error.headers)

    @app.exception_handler(RequestError)
    async def _refused(request: Request, error: RequestError) -> JSONResponse:
        return error_response(400, str(error))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(error)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        detail = error.detail if isinstance(error.detail, str) else json.dumps(error.detail)
        return error_response(error.status_code, detail, headers=error.headers)

    app.add_middleware(UnexpectedErrorMiddleware)


class UnexpectedErrorMiddleware:
    """A bug in a route is a 500 in this module's shape, and the connection stays usable.

    Starlette's own last-resort handler sends the 500 and then re-raises, and
    uvicorn closes the connection of any request whose app raised: a client
    reusing its keep-alive connection then fails its next request with a reset.
    Here the error is logged with its traceback and answered, and nothing is
    re-raised, unless the response had already begun: then its head is gone and
    only closing the connection tells the client it was cut short.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = False

        async def watched(message: Message) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as error:
            route = f"{scope.get('method', '')} {scope.get('path', '')}"
            logger.error("unhandled error in %s", route, exc_info=error)
            if finished:
                return  # the client has its whole answer; the error came after it
            if started:
                raise
            message = f"internal server error: {type(error).__name__}: {error}"
            await error_response(500, message)(scope, receive, send)
