"""An in-process ingress over a real slot table, answered by a thread that plays the engine: it writes the text a
test scripts, a token every 2 ms (at most the record's max_tokens, then `length`), and keeps each request's prompt
text and the sampling fields its record carried."""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from blink.ingress.app import create_app
from blink.ingress.metrics import Metrics
from blink.ingress.slots import SlotClient
from blink.ingress.state import IngressState
from blink.shared.control import EngineInfo
from blink.shared.slot_table import Finish, Geometry, SlotTable
from blink.shared.tokenizer import Tokenizer

RECORDED = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "grammar_kind",
            "reasoning_end_id")
# As Qwen3's: tools in the system turn, and an empty think block closed in the prompt with enable_thinking false;
# think_in_prompt opens one there instead (as Qwen3's thinking-only models and DeepSeek-R1's templates do).
THINKING_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif think_in_prompt is defined and think_in_prompt %}<think>\n{% endif %}{% endif %}")


def write_chat_model(target: Path, tokenizer_dir: Path, template: str = THINKING_TEMPLATE) -> Path:
    """A tokenizer and its chat template, as a checkpoint directory holds them."""
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_dir / "tokenizer.json", target / "tokenizer.json")
    (target / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return target


@dataclass
class Seen:
    prompt: str
    fields: dict[str, float] = field(default_factory=dict)  # RECORDED, as the slot record carried them


class ScriptedEngine:
    def __init__(self, model_dir: Path, names: tuple[str, ...] = ("m",), max_model_len: int = 512,
                 max_grammar_bytes: int = 0, eos_token_ids: tuple[int, ...] = ()):
        self.model_dir = model_dir
        self.tokenizer = Tokenizer(model_dir)
        self.table = SlotTable.create(f"test-{uuid.uuid4().hex[:10]}",
                                      Geometry(4, max_model_len, 64, max_grammar_bytes=max_grammar_bytes))
        self.answer = ""  # what every request is answered
        self.seen: list[Seen] = []
        self.info = EngineInfo(slot_table=self.table.path.name, num_slots=4, epoch=1, served_model_names=list(names),
                               model_dir=str(model_dir), max_model_len=max_model_len,
                               vocab_size=self.tokenizer.vocab_size, eos_token_ids=list(eos_token_ids),
                               device="cpu", drive="host", pid=0, max_grammar_bytes=max_grammar_bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        left: dict[int, tuple[list[int], Finish]] = {}  # slot -> tokens still to write (as its window makes room)
        while not self._stop.wait(0.002):
            for slot in self.table.submitted().tolist():
                self.table.admit(slot)
                record = self.table.slots[slot]
                prompt = record["prompt"][: int(record["prompt_len"])].tolist()
                self.seen.append(Seen(self.tokenizer.decode(prompt, False),
                                      {name: record[name].item() for name in RECORDED}))
                tokens = self.tokenizer.encode(self.answer, add_special_tokens=False)
                cap = int(record["max_tokens"])
                left[slot] = tokens[:cap], Finish.STOP if len(tokens) <= cap else Finish.LENGTH
            for slot, (tokens, reason) in list(left.items()):
                if tokens and self.table.room(slot):  # a token a tick: streams come in many chunks
                    self.table.emit(slot, tokens.pop(0))
                if not tokens:
                    self.table.finish(slot, reason)
                    del left[slot]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.table.close()
        self.table.unlink()

    @contextlib.asynccontextmanager
    async def ingress(self, **state_options) -> AsyncIterator[tuple[httpx.AsyncClient, openai.AsyncOpenAI]]:
        """The ingress app on this table (IngressState's fields as given), as a plain HTTP client and the official
        openai client."""
        client = SlotClient(self.table, max_waiting=8)
        client.start()
        state = IngressState(info=self.info, tokenizer=self.tokenizer, client=client,
                             metrics=Metrics(self.info.model, "host", "shm"), **state_options)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://ingress")
        try:
            yield http, openai.AsyncOpenAI(base_url="http://ingress/v1", api_key="unused", http_client=http)
        finally:
            await http.aclose()
            await client.stop()
