"""vLLM's --reasoning-parser: a thinking model's `<think>` block split out into reasoning_content, streamed and not,
before tool calls are looked for in the rest; the official openai client against the ingress, with a scripted engine
writing a Qwen3-style answer into the real slot table."""

from __future__ import annotations

import asyncio
import json

import pytest

from blink.ingress.reasoning import PARSERS, ReasoningStream
from blink.ingress.tools import PARSERS as TOOL_PARSERS
from blink.shared.settings import REASONING_PARSERS, Settings
from tests.support.scripted_engine import ScriptedEngine, write_chat_model

OPEN = "<|im_start|>assistant\n<think>\n"  # the end of a prompt whose template opened the block
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3's with enable_thinking false
PLAIN = "<|im_start|>assistant\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
USER = [{"role": "user", "content": "What is 2 + 2?"}]


def test_every_parser_is_a_setting():
    assert set(PARSERS) == set(REASONING_PARSERS)
    assert all(Settings(reasoning_parser=name).reasoning_parser == name for name in PARSERS)
    with pytest.raises(ValueError):
        Settings(reasoning_parser="granite")


@pytest.mark.parametrize("parser, prompt, text, reasoning, content", [
    ("qwen3", PLAIN, "<think>\nTwo and two.\n</think>\n\nIt is 4.", "\nTwo and two.\n", "\n\nIt is 4."),
    ("qwen3", OPEN, "Two and two.\n</think>\n\nIt is 4.", "Two and two.\n", "\n\nIt is 4."),  # thinking-only
    ("qwen3", CLOSED, "It is 4.", "", "It is 4."),  # enable_thinking false
    ("qwen3", PLAIN, "It is 4. </think> Or so.", "", "It is 4. </think> Or so."),  # never opened
    ("qwen3", PLAIN, "\n<think>Cut off", "Cut off", ""),  # ended inside the block (max_tokens)
    ("qwen3", PLAIN, "<this is not a think block>", "", "<this is not a think block>"),
    ("qwen3", PLAIN, "<thi", "", "<thi"),  # the marker's beginning, then the end
    ("deepseek_r1", PLAIN, "Two and two.</think>It is 4.", "Two and two.", "It is 4."),  # R1 writes no <think>
    ("deepseek_r1", PLAIN, "<think>Two and two.</think>It is 4.", "Two and two.", "It is 4."),
    ("deepseek_r1", OPEN, "Two and two.</think>It is 4.", "Two and two.", "It is 4."),
    ("deepseek_r1", CLOSED, "It is 4.", "", "It is 4."),
    ("deepseek_r1", PLAIN, "Still thinking", "Still thinking", ""),
])
def test_streams_split_the_same_wherever_the_text_is_cut(parser, prompt, text, reasoning, content):
    thinking = PARSERS[parser].starts_thinking(prompt)
    for cut in range(1, len(text) + 1):
        stream = ReasoningStream(PARSERS[parser], thinking)
        pieces = [stream.push(text[i:i + cut]) for i in range(0, len(text), cut)] + [stream.finish()]
        assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == (reasoning, content), cut


@pytest.fixture
def engine(tmp_path, tokenizer_dir):
    engine = ScriptedEngine(write_chat_model(tmp_path / "model", tokenizer_dir))
    yield engine
    engine.close()


async def _streamed(client, **request) -> tuple[str, str, dict[int, str], str | None]:
    """(reasoning, content, each call's name and arguments, finish reason) of a streamed answer."""
    reasoning, content, calls, finish = "", "", {}, None
    async for chunk in await client.chat.completions.create(model="m", stream=True, **request):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls[call.index] = calls.get(call.index, "") + (call.function.name or "") + call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, calls, finish


def test_the_openai_client_gets_reasoning_content_whole_and_streamed(engine):
    engine.answer = "<think>\nTwo and two make four.\n</think>\n\nIt is 4."

    async def run():
        async with engine.ingress(reasoning_parser=PARSERS["qwen3"]) as (_, client):
            whole = await client.chat.completions.create(model="m", messages=USER)
            message = whole.choices[0].message
            assert message.model_extra["reasoning_content"] == "\nTwo and two make four.\n"
            assert message.content == "\n\nIt is 4." and whole.choices[0].finish_reason == "stop"
            assert await _streamed(client, messages=USER) == ("\nTwo and two make four.\n", "\n\nIt is 4.", {}, "stop")

            # Thinking off: the template closes the block in the prompt; the answer is all content.
            engine.answer = "It is 4."
            off = {"chat_template_kwargs": {"enable_thinking": False}}
            plain = await client.chat.completions.create(model="m", messages=USER, extra_body=off)
            assert plain.choices[0].message.content == "It is 4."
            assert plain.choices[0].message.model_extra["reasoning_content"] is None
            assert await _streamed(client, messages=USER, extra_body=off) == ("", "It is 4.", {}, "stop")

            # A template that opens the block in the prompt: the answer starts inside it.
            engine.answer = "Two and two.\n</think>\n\nIt is 4."
            opened = {"chat_template_kwargs": {"think_in_prompt": True}}
            assert await _streamed(client, messages=USER, extra_body=opened) == ("Two and two.\n", "\n\nIt is 4.",
                                                                                {}, "stop")
        async with engine.ingress() as (_, client):  # no parser: the text as the model wrote it
            engine.answer = "<think>\nHm.\n</think>\n\nIt is 4."
            reply = await client.chat.completions.create(model="m", messages=USER)
            assert reply.choices[0].message.content == engine.answer
            assert "reasoning_content" not in (reply.choices[0].message.model_extra or {})

    asyncio.run(run())


def test_tool_calls_are_found_after_the_reasoning(engine):
    async def run():
        async with engine.ingress(reasoning_parser=PARSERS["qwen3"], tool_parser=TOOL_PARSERS["hermes"]) as (_, client):
            engine.answer = "<think>\nI should look it up.\n</think>\n\n" + CALL
            whole = await client.chat.completions.create(model="m", messages=USER, tools=[WEATHER])
            choice = whole.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning_content"] == (
                "\nI should look it up.\n")
            assert choice.message.content == "\n\n"
            assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
            reasoning, content, calls, finish = await _streamed(client, messages=USER, tools=[WEATHER])
            assert (reasoning, content, finish) == ("\nI should look it up.\n", "\n\n", "tool_calls")
            assert calls == {0: 'get_weather{"city": "Paris"}'}

            # A call the model only considers while thinking is reasoning, not a call.
            engine.answer = f"<think>Maybe {CALL}? No.</think>It is sunny."
            whole = await client.chat.completions.create(model="m", messages=USER, tools=[WEATHER])
            choice = whole.choices[0]
            assert not choice.message.tool_calls and choice.finish_reason == "stop"
            assert choice.message.model_extra["reasoning_content"] == f"Maybe {CALL}? No."
            assert choice.message.content == "It is sunny."

    asyncio.run(run())
