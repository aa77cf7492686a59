"""Incremental detokenization that never splits a character, with stop strings held back until decided."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


@dataclass
class TextDelta:
    text: str
    stopped: bool = False  # a stop string matched: the request ends here


@dataclass
class Detokenizer:
    tokenizer: Tokenizer
    stop: list[str] = field(default_factory=list)
    include_stop: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0  # stop strings count only once more tokens than this are out (vLLM's)

    def __post_init__(self) -> None:
        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        self._pending = ""  # decoded text not yet released: it may start a stop string
        self._ids: list[int] = []
        self._released = 0  # characters handed out so far
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def push(self, token_id: int) -> TextDelta:
        self._ids.append(token_id)
        piece = self._stream.step(self.tokenizer, token_id) or ""
        text = self._pending + piece
        for stop in self.stop if len(self._ids) > self.min_tokens else ():
            at = text.find(stop)
            if at >= 0:
                self._pending = ""
                return self._release(text[: at + len(stop)] if self.include_stop else text[:at], stopped=True)
        keep = min(self._hold, len(text))
        self._pending = text[len(text) - keep:] if keep else ""
        return self._release(text[: len(text) - keep])

    def flush(self) -> TextDelta:
        """The rest, once the engine ended the request: what was held back, and bytes of an unfinished
        character, decoded as a whole decode would (so the text equals decoding every token), stop-checked."""
        whole = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
        rest = whole[self._released:]
        self._pending = ""
        for stop in self.stop if len(self._ids) > self.min_tokens else ():
            at = rest.find(stop)
            if at >= 0:
                return self._release(rest[: at + len(stop)] if self.include_stop else rest[:at], stopped=True)
        return self._release(rest)

    def _release(self, text: str, stopped: bool = False) -> TextDelta:
        self._released += len(text)
        return TextDelta(text, stopped)
