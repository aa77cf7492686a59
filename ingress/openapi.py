"""The OpenAPI schema as the ingress serves: the error envelope for the statuses it answers (never FastAPI's
422: validation errors are 400s), content types that match (/health: empty, /metrics: Prometheus text), and the
bearer scheme on every route the API key guards (blink.ingress.guard)."""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel

from blink.ingress.guard import OPEN_PATHS


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(BaseModel):
    """OpenAI's error body (blink.ingress.errors)."""

    error: ErrorDetail


# What each answer means; every route may give the first ones, a route that takes a body the next, and the
# generation routes the last.
_ANY = {"404": "no such route", "405": "the route does not take this method (see Allow)"}
_WITH_BODY = {"400": "an invalid request (the message names the field)", "408": "the body arrived too slowly",
              "413": "the body is larger than --max-request-bytes"}
_GENERATING = {"429": "the server is at capacity (Retry-After)", "503": "draining, or the engine is unreachable"}


def describe(app: FastAPI, secured: bool) -> None:
    make_schema = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = make_schema()
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        envelope = ErrorEnvelope.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(envelope.pop("$defs", {}), ErrorEnvelope=envelope)
        for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422, which this server never sends
            schemas.pop(unused, None)
        if secured:
            schema["components"]["securitySchemes"] = {
                "apiKey": {"type": "http", "scheme": "bearer", "description": "the server's --api-key"}}
        for path, operations in schema.get("paths", {}).items():
            for method, operation in operations.items():
                answers = operation.setdefault("responses", {})
                answers.pop("422", None)
                errors = dict(_ANY)
                if method in ("post", "put", "patch"):
                    errors |= _WITH_BODY
                if path.startswith("/v1/"):
                    errors |= _GENERATING
                if secured and path not in OPEN_PATHS:
                    operation["security"] = [{"apiKey": []}]
                    errors["401"] = "a missing or wrong API key"
                for status, meaning in errors.items():
                    answers.setdefault(status, {"description": meaning, "content": {"application/json": {
                        "schema": {"$ref": "#/components/schemas/ErrorEnvelope"}}}})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
