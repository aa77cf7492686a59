"""Schemathesis against `blink serve`'s own /openapi.json: generated requests to every operation never get a 5xx,
and every answer is what the schema says it may be (status codes, content types, bodies)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from blink.bench.lib.server import running_server
from blink.engine.model.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.slow  # a whole deployment

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ensure_tiny_model()
    with running_server(tmp_path_factory.mktemp("serve"), "--max-num-seqs", "8", "--max-model-len", "256",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as server:
        yield server


@pytest.fixture(scope="module")
def api(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api")


@schema.parametrize()
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_generated_requests_get_what_the_schema_promises(case, server):
    if isinstance(case.body, dict):  # bounded work: it is the answers' shapes that are checked
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(key), int) and case.body[key] > 4:
                case.body[key] = 4
    case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=60)
