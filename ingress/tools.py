"""Tool calls in a chat model's output, as vLLM's `--enable-auto-tool-choice --tool-call-parser NAME` finds them.

A parser knows where a model's tool calls start and how each is written:

- `hermes` (Hermes, Qwen 2.5/3, and most templates that render `tools`): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`, one or more, after any text;
- `llama3_json` (Llama 3.1/3.2's JSON tool calling): the whole answer is `{"name": ..., "parameters": {...}}`
  (optionally after `<|python_tag|>`), several joined by `;`.

`ToolStream` follows one choice's text as it streams: text before a call goes out as content at once; from the
first marker on the text is held until the choice ends, then parsed into OpenAI's `tool_calls` (each call's whole
arguments in one delta, which clients accumulate as they would fragments). Text that looked like a call but does
not parse is given back as content, not lost.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it: a string
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _call(obj: object, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments already encoded
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser:
    name = "hermes"
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """(content before the calls, the calls), or None when the text holds no well-formed call."""
        at = text.find(self.start)
        if at < 0:
            return None
        calls = []
        for body in self._block.findall(text[at:]):
            try:
                call = _call(json.loads(body), "arguments")
            except (ValueError, RecursionError):  # RecursionError: JSON nested past Python's stack
                return None
            if call is None:
                return None
            calls.append(call)
        return (text[:at], calls) if calls else None

    def call_start(self, seen: str, unsent: str) -> int | None:
        """Where in `unsent` (the tail of `seen`, the choice's text so far, not yet streamed) a call begins, if one
        does: from there on the text is held for `parse`."""
        at = unsent.find(self.start)
        return at if at >= 0 else None

    def undecided(self, seen: str, unsent: str) -> int:
        """How many characters at the end of `unsent` may still begin a call (held back until the next delta)."""
        return next((n for n in range(min(len(self.start) - 1, len(unsent)), 0, -1)
                     if self.start.startswith(unsent[-n:])), 0)


class Llama3JsonParser:
    name = "llama3_json"
    start = "{"
    _tag = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        body = text.strip()
        if body.startswith(self._tag):
            body = body[len(self._tag):].strip()
        if not body.startswith("{"):
            return None
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except (ValueError, RecursionError):  # RecursionError: JSON nested past Python's stack
                return None
            call = _call(obj, "parameters")
            if call is None:
                return None
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \n\t;":
                at += 1
        return ("", calls) if calls else None

    def call_start(self, seen: str, unsent: str) -> int | None:
        """A Llama 3 call is the whole answer: it begins at the start, when the answer's first characters say so
        (nothing was streamed before: `undecided` held the leading whitespace)."""
        stripped = seen.lstrip()
        return 0 if stripped.startswith("{") or stripped.startswith(self._tag) else None

    def undecided(self, seen: str, unsent: str) -> int:
        return len(unsent) if not seen.strip() else 0


class ForcedParser:
    """tool_choice "required" or a named function: the output was constrained to the calls' JSON
    (blink.ingress.structured builds the schemas as vLLM does), so the whole answer is held and read as calls: a list
    of {"name", "parameters"}, or the named function's arguments."""

    name = "forced"

    def __init__(self, function: str | None):
        self.function = function  # None: "required", any of the tools

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):  # cut by max_tokens: given back as content
            return None
        if self.function is not None:
            return ("", [ToolCall(self.function, text.strip())]) if isinstance(obj, dict) else None
        calls = [_call(item, "parameters") for item in obj] if isinstance(obj, list) else []
        return ("", calls) if calls and all(calls) else None

    def call_start(self, seen: str, unsent: str) -> int | None:
        return 0  # the whole answer is the calls

    def undecided(self, seen: str, unsent: str) -> int:
        return 0


class FirstCallOnly:
    """parallel_tool_calls false: another parser's first call only, as OpenAI answers (and vLLM keeps), whatever
    else the model wrote."""

    def __init__(self, parser: HermesParser | Llama3JsonParser | ForcedParser):
        self.parser, self.name = parser, parser.name

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        parsed = self.parser.parse(text)
        return None if parsed is None else (parsed[0], parsed[1][:1])

    def call_start(self, seen: str, unsent: str) -> int | None:
        return self.parser.call_start(seen, unsent)

    def undecided(self, seen: str, unsent: str) -> int:
        return self.parser.undecided(seen, unsent)


ToolParser = HermesParser | Llama3JsonParser | ForcedParser | FirstCallOnly
PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser())}


class ToolStream:
    """One streaming choice: push() the text deltas, then finish(); each returns (content to send now, calls)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.held = ""  # text from the first possible marker on
        self.holding = False
        self.seen = ""  # everything so far (Llama 3's calls are the whole answer)

    def push(self, text: str) -> str:
        self.seen += text
        if self.holding:
            self.held += text
            return ""
        unsent = self.held + text
        at = self.parser.call_start(self.seen, unsent)
        if at is not None:
            self.holding, self.held = True, unsent[at:]
            return unsent[:at]
        # Keep back a tail that could still begin a call (a marker cut across deltas).
        keep = self.parser.undecided(self.seen, unsent)
        self.held = unsent[len(unsent) - keep:]
        return unsent[:len(unsent) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left: the held text as calls, or as content when it does not parse."""
        held, self.held = self.held, ""
        if not self.holding:
            return held, []
        parsed = self.parser.parse(held)
        if parsed is None:
            return held, []
        content, calls = parsed
        return content, calls
