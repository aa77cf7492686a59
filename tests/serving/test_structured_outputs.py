"""Structured outputs through the official `openai` SDK against `blink serve` (the host mode, the tiny random model):
response_format (the SDK's `parse` with a pydantic model, json_schema, json_object), vLLM's structured_outputs and
guided_* fields (on completions and chat; a GBNF grammar too), forced and named tool calls, and the 400s. The model
is random, so its answers are garbage: that they still parse is the mask's doing. Only completed answers are
validated (a JSON cut by max_tokens ends `length`), and most must complete."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from blink.bench.lib.server import running_server
from blink.engine.model.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.slow  # a whole deployment

MODEL = "blink-tiny-llama-v1"
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "address": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 0, "maximum": 999}},
                    "required": ["zip"]}},
        "required": ["name", "address"]},
    "array_enum": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"]},
    "any_of_optional": {"type": "object", "properties": {
        "id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"}]},
        "note": {"type": "string", "maxLength": 4}},
        "required": ["id"]},
    "string_format": {"type": "object", "properties": {"day": {"type": "string", "format": "date"}},
                      "required": ["day"]},
}


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=20)
    toys: list[Literal["ball", "rope"]] = Field(max_length=2)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ensure_tiny_model()
    with running_server(tmp_path_factory.mktemp("serve"), "--max-num-seqs", "8", "--max-grammar-bytes", "4096") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _sampling(seeded: bool) -> dict:
    return {"temperature": 1.0, "seed": 7} if seeded else {"temperature": 0.0}


def _chat_text(client, stream: bool, **body) -> tuple[str, str]:
    """The answer's text and finish_reason, streamed or not."""
    if not stream:
        choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, **body).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **body):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_json_schemas_are_followed(client, stream, seeded):
    completed = 0
    for name, schema in SCHEMAS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        text, finish = _chat_text(client, stream, response_format=fmt, max_tokens=120, **_sampling(seeded))
        assert finish in ("stop", "length"), (name, finish)
        if finish == "stop":
            jsonschema.validate(json.loads(text), schema)
            completed += 1
    assert completed >= len(SCHEMAS) - 1


def test_the_sdk_s_parse_with_a_pydantic_model(client):
    parsed = 0
    for seed in range(4):
        choice = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Pet, max_tokens=120,
                                               temperature=1.0, seed=seed).choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(choice.message.parsed, Pet)
            parsed += 1
    assert parsed >= 3


def test_json_object_and_vllm_s_structured_outputs(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"},
                                         max_tokens=60, temperature=0.0).choices[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.message.content), dict)
    else:  # cut: still the start of an object
        assert out.message.content.lstrip().startswith("{")
    schema = SCHEMAS["array_enum"]
    for body in ({"structured_outputs": {"json": schema}}, {"guided_json": schema}):
        choice = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=80, temperature=0.0,
                                           extra_body=body).choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_regexes_and_choices(client, stream):
    cases = [({"guided_regex": r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"}, r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"),
             ({"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, r"\d{3}-\d{4}"),
             ({"guided_choice": ["yes", "no", "maybe so"]}, r"yes|no|maybe so"),
             ({"structured_outputs": {"choice": ["alpha", "beta"]}}, r"alpha|beta")]
    for body, pattern in cases:
        for seed in range(3):
            if stream:
                text, finish = "", None
                for chunk in client.completions.create(model=MODEL, prompt="Answer:", max_tokens=30, temperature=1.0,
                                                       seed=seed, stream=True, extra_body=body):
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
            else:
                choice = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=30, temperature=1.0,
                                                   seed=seed, extra_body=body).choices[0]
                text, finish = choice.text, choice.finish_reason
            assert finish == "stop", (body, text)
            assert re.fullmatch(pattern, text), (body, text)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_vllm_s_fields_on_chat_completions(client, stream):
    """vLLM takes guided_choice, guided_regex and structured_outputs on chat as on completions (the SDK's
    extra_body): the assistant's content follows them."""
    schema = SCHEMAS["array_enum"]
    cases = [({"guided_choice": ["yes", "no", "maybe so"]}, r"yes|no|maybe so"),
             ({"guided_regex": r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"}, r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"),
             ({"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, r"\d{3}-\d{4}"),
             ({"structured_outputs": {"choice": ["alpha", "beta"]}}, r"alpha|beta"),
             ({"structured_outputs": {"json": schema}}, None)]
    for body, pattern in cases:
        for seed in range(2):
            text, finish = _chat_text(client, stream, extra_body=body, max_tokens=120, temperature=1.0, seed=seed)
            assert finish == "stop", (body, text)
            if pattern is None:
                jsonschema.validate(json.loads(text), schema)
            else:
                assert re.fullmatch(pattern, text), (body, text)


# A GBNF grammar of several rules (xgrammar's and llguidance's syntax), and the language it spells as a regex.
GBNF = """root ::= greeting " " name "!"
greeting ::= "hello" | "hi"
name ::= [a-z] [a-z]? [a-z]?"""
GBNF_LANGUAGE = r"(hello|hi) [a-z]{1,3}!"


def test_a_gbnf_grammar_is_followed(client):
    """guided_grammar on completions and structured_outputs' grammar on chat, streamed: each answer is a sentence of
    the grammar."""
    for seed in range(3):
        choice = client.completions.create(model=MODEL, prompt="Greet:", max_tokens=30, temperature=1.0, seed=seed,
                                           extra_body={"guided_grammar": GBNF}).choices[0]
        assert choice.finish_reason == "stop" and re.fullmatch(GBNF_LANGUAGE, choice.text), choice.text
        text, finish = _chat_text(client, True, extra_body={"structured_outputs": {"grammar": GBNF}}, max_tokens=30,
                                  temperature=1.0, seed=seed)
        assert finish == "stop" and re.fullmatch(GBNF_LANGUAGE, text), text


def test_unconstrained_requests_beside_constrained_ones_answer_as_alone(client):
    prompts = ["Once upon a time", "The weather today", "List three colors"]

    def plain(prompt: str) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.0).choices[0].text

    def constrained(i: int) -> str:
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}}
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, max_tokens=60,
                                              temperature=1.0, seed=i).choices[0].message.content

    alone = [plain(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        mixed = [pool.submit(constrained, i) for i in range(4)]
        beside = [pool.submit(plain, p) for p in prompts]
        mixed += [pool.submit(constrained, i) for i in range(4, 8)]
        assert [f.result() for f in beside] == alone
        assert all(f.result().lstrip().startswith("{") for f in mixed)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
    "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_and_named_tool_calls(client, stream):
    named = {"type": "function", "function": {"name": "get_time"}}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice, parallel in (("required", False), ("required", None), (named, None)):
        body = {"tools": TOOLS, "tool_choice": choice, "max_tokens": 200, "temperature": 1.0, "seed": 3}
        if parallel is not None:
            body["parallel_tool_calls"] = parallel
        if stream:
            calls: dict[int, dict] = {}
            finish = None
            for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **body):
                for c in chunk.choices:
                    finish = c.finish_reason or finish
                    for call in c.delta.tool_calls or []:
                        entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                        entry["name"] += call.function.name or ""
                        entry["arguments"] += call.function.arguments or ""
            found = [calls[i] for i in sorted(calls)]
        else:
            out = client.chat.completions.create(model=MODEL, messages=MESSAGES, **body).choices[0]
            finish = out.finish_reason
            found = [{"name": c.function.name, "arguments": c.function.arguments} for c in out.message.tool_calls or []]
        if parallel is None and choice == "required" and finish == "length":
            continue  # a random model may list calls past max_tokens: the list is cut, not wrong
        assert finish == "tool_calls", (choice, finish)
        assert found
        if choice is named:
            assert [c["name"] for c in found] == ["get_time"]
        if parallel is False:
            assert len(found) == 1
        for call in found:
            jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_a_json_cut_by_max_tokens_ends_with_length(client):
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 50}}, "required": ["text"]}
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0.0,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "long", "schema": schema}})
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content.lstrip().startswith("{")


# The library's own words differ by backend (--structured-outputs-backend): llguidance's first, then xgrammar's.
@pytest.mark.parametrize(("body", "param", "words"), [
    ({"guided_json": {"type": "colour"}}, "guided_json", "invalid JSON schema: (Invalid|Unsupported) type"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": {"not": {"type": "string"}}}, "guided_json", "#/not"),
    ({"guided_regex": "(ab"}, "guided_regex", "invalid regex: .*(unclosed group|parenthesis)"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "invalid grammar: .*(not found|not defined)"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "one structured output at a time"),
    ({"guided_choice": ["a"], "ignore_eos": True}, "guided_choice", "ignore_eos"),
    ({"guided_json": {"enum": ["x" * 5000]}}, None, "--max-grammar-bytes"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, None, "exactly one"),
])
def test_what_cannot_be_served_is_a_400(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=body)
    error = e.value.body
    assert re.search(words, error["message"]), error
    if param is not None:
        assert error["param"] == param


def test_bad_response_formats_and_tool_choices_are_400s(client):
    with pytest.raises(openai.BadRequestError):  # json_schema without its schema object
        client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_schema"})
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "not among the tools" in e.value.body["message"]


def test_metrics_count_structured_requests(server, client):
    import httpx

    client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={"guided_choice": ["a", "b"]})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={"guided_regex": "("})
    text = httpx.get(f"{server.url}/metrics").text
    served = re.search(r'blink:structured_output_requests_total\{kind="grammar",model_name="[^"]+",outcome="host"\} '
                       r'(\S+)', text)
    refused = re.search(r'blink:structured_output_requests_total\{kind="regex",model_name="[^"]+",'
                        r'outcome="refused"\} (\S+)', text)
    assert served and float(served.group(1)) >= 1
    assert refused and float(refused.group(1)) >= 1
    why = re.search(r'blink:structured_output_refused_requests_total\{kind="regex",model_name="[^"]+",'
                    r'reason="invalid"\} (\S+)', text)
    assert why and float(why.group(1)) >= 1
    ended = re.search(r'blink:structured_output_engine_ended_requests_total\{model_name="[^"]+",'
                      r'reason="failed"\} (\S+)', text)
    assert ended and float(ended.group(1)) == 0  # the engine compiles what the ingress did, with the same library


def test_metrics_count_what_the_engine_ended(tmp_path_factory):
    """A Lark grammar passes the ingress's llguidance and fails the engine's xgrammar (GBNF only): the engine ends
    the request, and /metrics counts it there, beside the ingress's count of it as served on the host."""
    import httpx

    pytest.importorskip("xgrammar")
    with running_server(tmp_path_factory.mktemp("xgrammar"), "--max-num-seqs", "4",
                        "--structured-outputs-backend", "xgrammar") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        out = client.completions.create(model=MODEL, prompt="x", max_tokens=8,
                                        extra_body={"guided_grammar": 'start: "a" | "b"'})
        assert out.choices[0].text == ""
        plain = client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0.0)
        assert plain.usage.completion_tokens >= 1  # the engine serves on
        text = httpx.get(f"{server.url}/metrics").text
    ended = re.search(r'blink:structured_output_engine_ended_requests_total\{model_name="[^"]+",'
                      r'reason="failed"\} (\S+)', text)
    assert ended and float(ended.group(1)) == 1, text


# /v1/responses, stateless, served as chat (blink.ingress.responses_api), through the SDK's newer surface.
RESPONSE_TOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
                  for t in TOOLS]


def test_responses_text_instructions_and_a_schema(client):
    cut = client.responses.create(model=MODEL, input="hi", instructions="Be brief.", max_output_tokens=6,
                                  temperature=0.0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output_text and cut.usage.output_tokens == 6 and cut.usage.input_tokens > 0
    schema = {**SCHEMAS["array_enum"], "additionalProperties": False}
    answer = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "JSON please"}]}],
        max_output_tokens=80, temperature=0.0,
        text={"format": {"type": "json_schema", "name": "tags", "schema": schema, "strict": True}})
    assert answer.status == "completed"
    jsonschema.validate(json.loads(answer.output_text), schema)


def test_responses_function_tools_and_their_outputs_back(client):
    out = client.responses.create(model=MODEL, input="weather?", tools=RESPONSE_TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, max_output_tokens=150, temperature=0.0)
    calls = [o for o in out.output if o.type == "function_call"]
    assert out.status == "completed" and len(calls) == 1
    schemas = {t["name"]: t["parameters"] for t in RESPONSE_TOOLS}
    jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])
    # The call and its output given back, as an agent loop does: a new turn on the chat path.
    back = client.responses.create(model=MODEL, tools=RESPONSE_TOOLS, tool_choice="none", max_output_tokens=4,
                                   temperature=0.0, input=[
                                       {"role": "user", "content": "weather?"},
                                       {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                                        "arguments": calls[0].arguments},
                                       {"type": "function_call_output", "call_id": calls[0].call_id,
                                        "output": "sunny"}])
    assert back.output_text


def test_responses_stream_events_as_the_sdk_reads_them(client):
    schema = SCHEMAS["nested"]
    with client.responses.stream(model=MODEL, input="hi", max_output_tokens=120, temperature=0.0,
                                 text={"format": {"type": "json_schema", "name": "n", "schema": schema}}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    jsonschema.validate(json.loads(final.output_text), schema)
    events = list(client.responses.create(model=MODEL, input="hi", tools=RESPONSE_TOOLS, stream=True,
                                          tool_choice={"type": "function", "name": "get_time"},
                                          max_output_tokens=100, temperature=0.0))
    assert [e.type for e in events][-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                                             "response.completed"]
    call = events[-1].response.output[0]
    assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), TOOLS[1]["function"]["parameters"])


def test_responses_refuse_what_is_stateful(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="hi", store=True)
