"""OpenAI's error envelope, and the exceptions that map to it."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

MAX_ECHO = 120  # an error never quotes more than this much of the input


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def overloaded() -> APIError:
    return APIError(429, "the server is at capacity; retry shortly", "rate_limit_error", code="overloaded",
                    headers={"Retry-After": "1"})


def engine_unreachable() -> APIError:
    return APIError(503, "the engine is unreachable; retry shortly", "service_unavailable", code="engine_unreachable",
                    headers={"Retry-After": "1"})


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "list", "dict", "none"} or "[" in part)


def _clip(value: object) -> str:
    text = repr(value)
    return text if len(text) <= MAX_ECHO else text[:MAX_ECHO] + "…"


async def api_error_handler(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)


async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    kind = request.headers.get("content-type", "")
    if first.get("loc") == ("body",) and kind and "json" not in kind.lower():  # a form, text: not read as JSON
        return error_response(400, f"the request body must be JSON (content-type: application/json), got "
                              f"content-type {kind[:60]!r}", param=None, code="invalid_json")
    # Drop "body" and the union-member tags pydantic adds ("str", "list[int]", "function-after[...]").
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_type_tag(part)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return error_response(400, "the request body is not valid JSON", param=None, code="invalid_json")
    message = first.get("msg", "invalid value")
    if "input" in first and first.get("type") != "missing":
        message += f" (got {_clip(first['input'])})"
    return error_response(400, f"{param}: {message}" if param else message, param=param, code="invalid_value")


async def http_error_handler(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kinds = {404: "not_found_error", 405: "invalid_request_error"}
    return error_response(exc.status_code, str(exc.detail), kinds.get(exc.status_code, "invalid_request_error"),
                          headers=exc.headers)  # 405's Allow
