"""Chat tool calling as vLLM's --enable-auto-tool-choice --tool-call-parser: the parsers, and the official openai
client against the ingress, with a scripted engine writing a tool call into the real slot table."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import uuid

import httpx
import openai
import pytest

from blink.engine.model.tiny_model import ensure_tiny_model
from blink.ingress.app import create_app
from blink.ingress.metrics import Metrics
from blink.ingress.slots import SlotClient
from blink.ingress.state import IngressState
from blink.ingress.tools import PARSERS, ToolStream
from blink.shared.control import EngineInfo
from blink.shared.slot_table import Finish, Geometry, SlotTable
from blink.shared.tokenizer import Tokenizer

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]}}}
# A Hermes-style template (as Qwen 2.5's): the tools' JSON in the system turn, earlier calls and results inline.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("text, content, names", [
    ("Let me check. " + CALL, "Let me check. ", ["get_weather"]),
    (CALL + CALL.replace("Paris", "Oslo"), "", ["get_weather", "get_weather"]),
    ("no call here", None, None),
    ("<tool_call>{not json}</tool_call>", None, None),  # given back as content
    ('<tool_call>{"name": "f", "arguments": ' + "[" * 5000, None, None),  # nested past Python's stack
    ('<tool_call>{"name": "f", "arguments": "' + "[" * 5000 + '"}', None, None),  # and as an encoded string
])
def test_hermes_parser(text, content, names):
    parsed = PARSERS["hermes"].parse(text)
    if names is None:
        assert parsed is None
        return
    got_content, calls = parsed
    assert got_content == content and [c.name for c in calls] == names
    assert json.loads(calls[0].arguments)["city"] == "Paris"


def test_llama3_json_parser_and_streams_that_cut_the_marker_anywhere():
    content, calls = PARSERS["llama3_json"].parse("<|python_tag|>" + LLAMA_CALL)
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    assert PARSERS["llama3_json"].parse("The answer is {1}") is None
    for parser, text, before in ((PARSERS["hermes"], "Sure. " + CALL, "Sure. "), (PARSERS["llama3_json"], LLAMA_CALL,
                                                                                   "")):
        for cut in range(1, 12):
            stream = ToolStream(parser)
            sent = "".join(stream.push(text[i:i + cut]) for i in range(0, len(text), cut))
            tail, calls = stream.finish()
            assert sent == before and tail == "" and calls, (parser.name, cut)
    stream = ToolStream(PARSERS["hermes"])
    assert stream.push("a <tool") == "a " and stream.push("box>") == "<toolbox>"  # not a marker after all
    assert stream.finish() == ("", [])
    stream = ToolStream(PARSERS["llama3_json"])  # leading whitespace waits for the first character that decides
    assert stream.push("\n ") == "" and stream.push("Hi {") == "\n Hi {" and stream.push("x") == "x"
    assert stream.finish() == ("", [])
    assert PARSERS["llama3_json"].parse("[" * 5000) is None and PARSERS["llama3_json"].parse("{" * 5000) is None


@pytest.fixture
def served(tmp_path):
    """The ingress (in-process, the hermes parser) over a fresh slot table, a thread answering every request with
    `answer` (a mutable list holding the text) as an engine would, and what each request's prompt was."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(ensure_tiny_model() / "tokenizer.json", model_dir / "tokenizer.json")
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    tokenizer = Tokenizer(model_dir)
    table = SlotTable.create(f"test-{uuid.uuid4().hex[:10]}", Geometry(4, 512, 64))
    answer, prompts, stop = [""], [], threading.Event()

    def engine() -> None:
        left: dict[int, list[int]] = {}  # slot -> tokens still to write, as its window makes room
        while not stop.wait(0.002):
            for slot in table.submitted().tolist():
                table.admit(slot)
                record = table.slots[slot]
                prompts.append(tokenizer.decode(record["prompt"][: int(record["prompt_len"])].tolist(), False))
                left[slot] = tokenizer.encode(answer[0], add_special_tokens=False)
            for slot, tokens in list(left.items()):
                while tokens and table.room(slot):
                    table.emit(slot, tokens.pop(0))
                if not tokens:
                    table.finish(slot, Finish.STOP)
                    del left[slot]

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    info = EngineInfo(slot_table=table.path.name, num_slots=4, epoch=1, served_model_names=["m"],
                      model_dir=str(model_dir), max_model_len=512, vocab_size=tokenizer.vocab_size, eos_token_ids=[],
                      device="cpu", drive="host", pid=0)

    async def client_for(state_options: dict):
        client = SlotClient(table, max_waiting=8)
        client.start()
        state = IngressState(info=info, tokenizer=tokenizer, client=client, metrics=Metrics("m", "host", "shm"),
                             **state_options)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://ingress")
        return openai.AsyncOpenAI(base_url="http://ingress/v1", api_key="unused", http_client=http), client

    yield client_for, answer, prompts
    stop.set()
    thread.join()
    table.close()
    table.unlink()


def test_the_openai_client_gets_tool_calls_whole_and_streamed(served):
    client_for, answer, prompts = served
    answer[0] = "Let me look. " + CALL
    messages = [{"role": "user", "content": "Weather in Paris?"}]

    async def run():
        openai_client, slots = await client_for({"tool_parser": PARSERS["hermes"]})
        try:
            whole = await openai_client.chat.completions.create(model="m", messages=messages, tools=[WEATHER],
                                                                parallel_tool_calls=True, store=False)
            choice = whole.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look. "
            call = choice.message.tool_calls[0]
            assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "celsius"
            assert '"name": "get_weather"' in prompts[-1]  # the tools went through the chat template

            content, calls, finish = "", {}, None
            stream = await openai_client.chat.completions.create(model="m", messages=messages, tools=[WEATHER],
                                                                 stream=True)
            async for chunk in stream:
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for c in delta.tool_calls or []:
                    calls.setdefault(c.index, "")
                    calls[c.index] += c.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            assert content == "Let me look. " and finish == "tool_calls"
            assert json.loads(calls[0]) == {"city": "Paris", "unit": "celsius"}

            # The call and its result, sent back: rendered through the template, arguments as a mapping.
            answer[0] = "It is 18 degrees in Paris."
            back = [*messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "18C"}]
            reply = await openai_client.chat.completions.create(model="m", messages=back, tools=[WEATHER])
            assert reply.choices[0].message.content == answer[0] and reply.choices[0].finish_reason == "stop"
            assert '"arguments": {"city": "Paris", "unit": "celsius"}' in prompts[-1]

            # tool_choice none: the text as it is.
            answer[0] = CALL
            plain = await openai_client.chat.completions.create(model="m", messages=messages, tools=[WEATHER],
                                                                tool_choice="none")
            assert plain.choices[0].message.content == CALL and not plain.choices[0].message.tool_calls
        finally:
            await slots.stop()

    asyncio.run(run())


@pytest.mark.parametrize("options, extra, param", [
    ({}, {}, "tool_choice"),  # tools, but the server finds no calls: vLLM's 400
    ({"tool_parser": PARSERS["hermes"]}, {"store": True}, "store"),
    # Forced calls need a grammar (tests/serving/test_structured_outputs.py); this engine's table carries none.
    ({"tool_parser": PARSERS["hermes"]}, {"tool_choice": "required"}, "tool_choice"),
    ({"tool_parser": PARSERS["hermes"]}, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
])
def test_what_needs_a_parser_or_a_grammar_area_is_a_clear_400(served, options, extra, param):
    client_for, _, _ = served

    async def run():
        openai_client, slots = await client_for(options)
        try:
            with pytest.raises(openai.BadRequestError) as e:
                await openai_client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], **extra)
            assert e.value.body["param"] == param
        finally:
            await slots.stop()

    asyncio.run(run())
