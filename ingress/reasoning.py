"""Reasoning in a chat model's output, split out as vLLM's `--reasoning-parser NAME` does: the text of the think block
goes to the message's `reasoning_content`, the rest to its `content` (where tool calls are then looked for).

A parser knows the block's markers and whether the output begins inside one, which the prompt's end decides before
the model writes anything (the chat template may open or close the block there):

- `qwen3` (Qwen3, QwQ): `<think>...</think>`. The output is reasoning when it opens with `<think>`, or when the prompt
  did (the thinking-only Qwen3 templates end it with `<think>\\n`); with `enable_thinking: false` the template
  closes an empty block in the prompt and the output is all content.
- `deepseek_r1` (DeepSeek-R1 and its distills): the output is reasoning up to `</think>` (a `<think>` it writes
  first is dropped) unless the prompt closed the block; a reasoning that never ends is all reasoning.

`ReasoningStream` follows one choice's text as it streams: leading text that may still be `<think>` and a tail that
may still be `</think>` are held until the next delta decides them, so streamed and whole answers split the same.
"""

from __future__ import annotations


class ThinkBlockParser:
    """`<think>...</think>` at the start of the output; subclasses say where the output begins without it."""

    name: str
    start = "<think>"
    end = "</think>"
    thinks_unless_closed = False  # an output begins inside the block where the prompt neither opened nor closed one

    def starts_thinking(self, prompt: str) -> bool:
        """Whether the output begins inside the block, before it writes a marker: the prompt's last words say."""
        if self.closed_in(prompt):
            return False
        return prompt.rstrip().endswith(self.start) or self.thinks_unless_closed

    def closed_in(self, prompt: str) -> bool:
        """Whether the prompt closed the block (`enable_thinking: false`): the output is all answer."""
        return prompt.rstrip().endswith(self.end)


class Qwen3Parser(ThinkBlockParser):
    name = "qwen3"


class DeepSeekR1Parser(ThinkBlockParser):
    name = "deepseek_r1"
    thinks_unless_closed = True  # R1's output starts with its reasoning, with or without `<think>`


ReasoningParser = ThinkBlockParser
PARSERS: dict[str, ReasoningParser] = {p.name: p for p in (Qwen3Parser(), DeepSeekR1Parser())}


def _prefix_at_end(text: str, marker: str) -> int:
    """How many characters at the end of `text` may begin `marker` (a marker cut across deltas)."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


class ReasoningStream:
    """One choice: push() the text deltas, then finish(); each returns (reasoning, content) to send now."""

    def __init__(self, parser: ReasoningParser, thinking: bool):
        self.parser = parser
        self.thinking = thinking  # inside the block (the prompt may have opened it)
        self.deciding = True  # at the start, where the output may open the block itself
        self.held = ""

    def push(self, text: str) -> tuple[str, str]:
        self.held += text
        if self.deciding:
            lead = self.held.lstrip()
            if self.parser.start.startswith(lead):  # nothing yet, or the marker's beginning: wait
                return "", ""
            self.deciding = False
            if lead.startswith(self.parser.start):
                self.thinking, self.held = True, lead[len(self.parser.start):]
        if not self.thinking:
            content, self.held = self.held, ""
            return "", content
        at = self.held.find(self.parser.end)
        if at >= 0:
            reasoning, content = self.held[:at], self.held[at + len(self.parser.end):]
            self.thinking, self.held = False, ""
            return reasoning, content
        keep = _prefix_at_end(self.held, self.parser.end)
        reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """What was held: reasoning when the output ended inside the block, else content."""
        held, self.held = self.held, ""
        return (held, "") if self.thinking else ("", held)
