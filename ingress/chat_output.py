"""One chat choice's text into the parts of OpenAI's message, as vLLM splits them: reasoning first (the reasoning
parser's think block), then tool calls in what is left (the tool parser's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from blink.ingress.reasoning import ReasoningParser, ReasoningStream
from blink.ingress.tools import ToolCall, ToolParser, ToolStream


@dataclass
class Parts:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ChoiceText:
    """push() each delta's text, then finish() with the last; each returns the parts to send now."""

    def __init__(self, reasoning: ReasoningParser | None, thinking: bool, tools: ToolParser | None):
        """thinking: the prompt left the output inside a think block (ReasoningParser.starts_thinking)."""
        self.reasoning = ReasoningStream(reasoning, thinking) if reasoning is not None else None
        self.tools = ToolStream(tools) if tools is not None else None

    def push(self, text: str) -> Parts:
        reasoning, content = self.reasoning.push(text) if self.reasoning else ("", text)
        return Parts(reasoning, self.tools.push(content) if self.tools else content)

    def finish(self, text: str) -> Parts:
        parts = self.push(text)
        if self.reasoning:
            reasoning, content = self.reasoning.finish()
            parts.reasoning += reasoning
            parts.content += self.tools.push(content) if self.tools else content
        if self.tools:
            tail, parts.calls = self.tools.finish()
            parts.content += tail
        return parts
