"""Structured outputs from a thinking model (vLLM's masking from the end of the reasoning): with --reasoning-parser, the
ingress gives a constrained record the token that ends the think block (reasoning_end_id), and splits the think block
out of the answer as it does without a grammar; where the prompt closed the block, or the marker is not one token, the
grammar masks from the first token and the answer is all content. The official openai client against the ingress, with
a scripted engine writing a Qwen3-style answer into the real slot table."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from tokenizers import AddedToken

from blink.engine.model.tiny_model import train_tokenizer
from blink.ingress.reasoning import PARSERS
from blink.ingress.structured import reasoning_end_id
from blink.shared.grammar import GrammarKind, GrammarSpec
from blink.shared.tokenizer import Tokenizer
from tests.support.scripted_engine import ScriptedEngine, write_chat_model

USER = [{"role": "user", "content": "A person as JSON."}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def thinking_tokenizer(tmp_path_factory):
    """The test tokenizer with Qwen3's think markers as tokens of their own (added, not special: they are text)."""
    tokenizer = train_tokenizer()
    tokenizer.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    path = tmp_path_factory.mktemp("thinking-tokenizer")
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture
def engine(tmp_path, thinking_tokenizer):
    engine = ScriptedEngine(write_chat_model(tmp_path / "model", thinking_tokenizer), max_grammar_bytes=1024,
                            eos_token_ids=(1,))
    yield engine
    engine.close()


def test_a_constrained_answer_keeps_its_think_block(engine):
    end = engine.tokenizer.raw.token_to_id("</think>")
    assert end is not None

    async def run():
        async with engine.ingress(reasoning_parser=PARSERS["qwen3"]) as (_, client):
            engine.answer = '<think>\nTwo fields?\n</think>{"a": 1}'
            whole = await client.chat.completions.create(model="m", messages=USER, response_format=FORMAT)
            assert engine.seen[-1].fields["grammar_kind"] == int(GrammarKind.JSON_SCHEMA)
            assert engine.seen[-1].fields["reasoning_end_id"] == end  # the grammar waits for it
            message = whole.choices[0].message
            assert message.model_extra["reasoning_content"] == "\nTwo fields?\n"
            assert json.loads(message.content) == {"a": 1}

            # Thinking off: the template closed the block in the prompt, so the grammar masks from the first token.
            engine.answer = '{"a": 2}'
            off = {"chat_template_kwargs": {"enable_thinking": False}}
            plain = await client.chat.completions.create(model="m", messages=USER, response_format=FORMAT,
                                                         extra_body=off)
            assert engine.seen[-1].fields["reasoning_end_id"] == -1
            assert json.loads(plain.choices[0].message.content) == {"a": 2}

            engine.answer = "It is 4."  # unconstrained: no token to wait for
            await client.chat.completions.create(model="m", messages=USER)
            assert engine.seen[-1].fields["reasoning_end_id"] == -1
        async with engine.ingress() as (_, client):  # no reasoning parser: masked from the first token
            engine.answer = '{"a": 3}'
            await client.chat.completions.create(model="m", messages=USER, response_format=FORMAT)
            assert engine.seen[-1].fields["reasoning_end_id"] == -1

    asyncio.run(run())


def test_a_forced_tool_call_is_read_after_the_reasoning(engine):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def run():
        async with engine.ingress(reasoning_parser=PARSERS["qwen3"]) as (_, client):
            engine.answer = '<think>Paris, surely.</think>{"city": "Paris"}'
            whole = await client.chat.completions.create(model="m", messages=USER, tools=[weather], tool_choice=named)
            assert engine.seen[-1].fields["reasoning_end_id"] == engine.tokenizer.raw.token_to_id("</think>")
            choice = whole.choices[0]
            assert choice.message.model_extra["reasoning_content"] == "Paris, surely."
            assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
            assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}

    asyncio.run(run())


def test_a_marker_of_several_tokens_masks_from_the_first(tokenizer_dir, thinking_tokenizer):
    """The engine can only wait for one token: where `</think>` is several, the grammar masks from the first one (and
    the ingress leaves the answer unsplit, as before)."""
    grammar = GrammarSpec(GrammarKind.REGEX, "a+")
    for path, waits in ((tokenizer_dir, False), (thinking_tokenizer, True)):
        tokenizer = Tokenizer(path)
        state = SimpleNamespace(reasoning_parser=PARSERS["deepseek_r1"], tokenizer=tokenizer)
        end = tokenizer.raw.token_to_id("</think>")
        assert reasoning_end_id(state, grammar, "<|im_start|>assistant\n") == (end if waits else -1)
        assert reasoning_end_id(state, grammar, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == -1
        assert reasoning_end_id(state, None, "<|im_start|>assistant\n") == -1
