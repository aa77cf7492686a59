"""Speculative decoding as it is served (issue 41), on the real default checkpoint (SmolLM2-135M-Instruct), float32:
stop strings and max_tokens falling inside an accepted run of drafts end the choice where plain decoding's does (the
ingress matches stop strings, engine/core/speculation.py publishes a run of tokens a step), and `blink serve` started
with `--speculative-config` answers with plain decoding's text and counts its drafts in /metrics."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import openai
import pytest
import torch

from blink.bench.lib.server import running_server
from blink.engine import LLM, SamplingParams
from blink.engine.drive.host import HostDriver
from blink.engine.engine import Engine, EngineConfig
from blink.ingress.chat import render_chat
from blink.ingress.client import Stream
from blink.ingress.generate import choice_deltas
from blink.ingress.metrics import Metrics
from blink.ingress.protocol import ChatMessage, CompletionRequest
from blink.shared.checkpoints import default_model
from blink.shared.slot_table import Finish, Request, SlotTable

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
# Answers that copy their input: drafts looked up in the prompt are accepted in runs of several tokens.
SENTENCE = "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank."
RECORD = 'Copy this JSON exactly: {"name": "Alice", "city": "Paris", "age": 31, "pets": ["cat", "dog"]}'
ENGINE = dict(dtype="float32", max_num_seqs=2, max_model_len=256, num_pages=40)


def _chat_ids(tokenizer, question: str) -> list[int]:
    """The prompt `blink serve` makes of a one-message chat: the checkpoint's template, rendered by the ingress."""
    text = render_chat(tokenizer, [ChatMessage(role="user", content=question)], True)
    return tokenizer.encode(text, add_special_tokens=False)


class SteppedClient:
    """The ingress's client (IngressClient's submit and outputs) over a slot table whose engine a HostDriver steps once
    a read, so each output is what one step published: a whole run where drafts were accepted."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.table = SlotTable.create(f"test-{uuid.uuid4().hex[:10]}", engine.geometry(window=16))
        self.driver = HostDriver(engine, self.table)
        # A step-cost fit the machine's load cannot move: the slot drafts alike, so its runs are the same, every time.
        self.driver.rank.cost_model.observe = lambda *timed: None
        engine.step.cost.fit.copy_(torch.tensor([0.010, 0.0002], dtype=torch.float64))
        self.reads: list[list[int]] = []

    async def submit(self, request: Request) -> Stream:
        self.table.publish(0, request)
        return Stream(0, asyncio.Queue())

    async def outputs(self, stream: Stream):
        self.reads = []
        finish = Finish.NONE
        try:
            while finish == Finish.NONE:
                self.driver.step()
                out = self.table.read(stream.slot)
                self.reads.append(out.tokens)
                finish = out.finish
                yield out
        finally:
            if finish == Finish.NONE:  # the choice ended first (a stop string): cancelled, as the ingress's client does
                self.table.cancel(stream.slot)
                for _ in range(100):
                    self.driver.step()
                    if self.table.read(stream.slot).finish != Finish.NONE:
                        break
                else:
                    raise AssertionError("a cancelled request never finished")
            self.table.free(stream.slot)

    def answer(self, prompt: list[int], max_tokens: int, stop: list[str]) -> tuple[list[int], str, Finish]:
        """A greedy choice through the ingress's choice_deltas: its tokens, text and finish."""
        fields = CompletionRequest(model="m", prompt=prompt, max_tokens=max_tokens, stop=stop)
        request = Request(prompt, max_tokens, temperature=0.0)
        eos = list(self.engine.generation.eos_token_ids)

        async def run():
            metrics = Metrics(default_model.NAME, "host", "shm")
            return [d async for d in choice_deltas(self, self.engine.tokenizer, request, fields, 0, metrics, eos)]

        deltas = asyncio.run(run())
        return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), deltas[-1].finish

    def close(self) -> None:
        self.table.unlink()


@pytest.fixture(scope="module")
def stepped():
    """(plain, speculating): the default model served through SteppedClient without drafts and with them."""
    clients = SteppedClient(Engine(EngineConfig(**ENGINE))), SteppedClient(Engine(EngineConfig(**ENGINE,
                                                                                                speculative_config=SPEC)))
    yield clients
    for client in clients:
        client.close()


def _read_holding(reads: list[list[int]], index: int) -> tuple[int, int]:
    """(tokens before, tokens after) the generated token at `index` in the read that held it."""
    done = 0
    for tokens in reads:
        if index < done + len(tokens):
            return index - done, done + len(tokens) - index - 1
        done += len(tokens)
    raise AssertionError(f"token {index} was never read")


def _stop_inside_a_run(client: SteppedClient, prompt: list[int], across: bool) -> str:
    """A stop string that first completes at a token strictly inside a run of accepted drafts of the client's
    answer: that token's text, or (across) the two characters before it and its first two. Found in the answer
    itself, so the test holds whatever runs the speculation policy makes. The answer is taken twice: the first
    caches the prompt, and a cached prompt's one-token first step may draft, which shifts the runs after it."""
    for _ in range(2):
        client.answer(prompt, 48, [])
    reads = client.reads
    tokens = [t for read in reads for t in read]
    text = client.engine.tokenizer.decode(tokens)
    for i in range(len(tokens)):
        if min(_read_holding(reads, i)) == 0:
            continue
        start, end = (len(client.engine.tokenizer.decode(tokens[:n])) for n in (i, i + 1))
        stop = text[start - 2:start + 2] if across else text[start:end]
        if stop.strip() and len(stop) == (4 if across else end - start) and start < text.find(stop) + len(stop) <= end:
            return stop
    raise AssertionError(f"no token strictly inside a run could end the answer: {reads}")


@pytest.mark.slow
@pytest.mark.parametrize(("question", "across"), [(SENTENCE, False), (SENTENCE, True), (RECORD, False)],
                         ids=["a-token", "across-tokens", "json"])
def test_a_stop_string_inside_an_accepted_run_ends_the_choice_where_plain_decoding_s_does(stepped, question, across):
    """The stop string completes at a token the engine published amid accepted drafts, with more of the run after
    it: the choice's tokens, text and finish are plain decoding's, and the run's later tokens are dropped."""
    plain, speculating = stepped
    prompt = _chat_ids(speculating.engine.tokenizer, question)
    stop = _stop_inside_a_run(speculating, prompt, across)
    want = plain.answer(prompt, 48, [stop])
    accepted = int(speculating.engine.state.spec_counts[2])
    got = speculating.answer(prompt, 48, [stop])
    assert got == want and want[2] == Finish.STOP and stop not in want[1]
    before, after = _read_holding(speculating.reads, len(got[0]) - 1)
    assert before > 0 and after > 0, speculating.reads  # inside a run: a step's tokens on both sides of it
    assert int(speculating.engine.state.spec_counts[2]) > accepted
    assert int(speculating.engine.pool.num_free) == speculating.engine.pool.usable_pages  # the cancel left nothing


@pytest.mark.slow
def test_max_tokens_inside_an_accepted_run_ends_the_choice_where_plain_decoding_s_does(stepped):
    """A limit that falls inside a run the engine would otherwise have emitted whole: the run is cut there, the
    finish is `length`, the tokens and text plain decoding's."""
    plain, speculating = stepped
    prompt = _chat_ids(speculating.engine.tokenizer, SENTENCE)
    speculating.answer(prompt, 48, [])
    whole = speculating.reads
    # The first token strictly inside a run: a limit there cuts the run short.
    limit = next(i for i in range(sum(map(len, whole))) if min(_read_holding(whole, i)) > 0) + 1
    got = speculating.answer(prompt, limit, [])
    assert got == plain.answer(prompt, limit, []) and got[2] == Finish.LENGTH and len(got[0]) == limit
    assert _read_holding(speculating.reads, limit - 1)[0] > 0  # it ended a run of accepted drafts


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(dtype="float32", num_pages=64)  # no model: the default, plain decoding


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("BLINK_MODEL", raising=False)  # the tests serve the tiny model unless they say otherwise
        # JSON on the command line, as vLLM's users pass it; the services must get it as JSON too.
        with running_server(tmp_path_factory.mktemp("serve"), "--dtype", "float32",
                            "--speculative-config", json.dumps(SPEC)) as server:
            yield server


def _metric(server, name: str) -> float:
    prefix = f'{name}{{model_name="{default_model.NAME}"}}'
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


@pytest.mark.slow
def test_a_speculating_deployment_answers_with_plain_decoding_s_text_and_counts_its_drafts(server, offline):
    """Greedy chats whose answers repeat their prompts, served with n-gram drafts: the offline engine's text without
    them, token counts included; stop strings within the answers end it as they would there; /metrics shows drafts
    proposed and accepted."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120)
    params = SamplingParams(temperature=0, max_tokens=48)
    for question, stop in ((SENTENCE, " jumps"), (RECORD, "Paris")):
        expected = offline.generate([_chat_ids(offline.tokenizer, question)], params)[0]
        messages = [{"role": "user", "content": question}]
        reply = client.chat.completions.create(model=default_model.NAME, messages=messages, max_tokens=48,
                                               temperature=0)
        assert reply.choices[0].message.content == expected.text
        assert reply.choices[0].finish_reason == expected.finish_reason
        assert reply.usage.completion_tokens == len(expected.token_ids)
        cut = client.chat.completions.create(model=default_model.NAME, messages=messages, max_tokens=48,
                                             temperature=0, stop=[stop])
        # The ingress stops at the token that completes the stop string: the tokens up to it are counted.
        counted = next(k for k in range(1, len(expected.token_ids) + 1)
                       if stop in offline.tokenizer.decode(expected.token_ids[:k]))
        assert cut.choices[0].message.content == expected.text[: expected.text.index(stop)]
        assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == counted
    assert _metric(server, "blink:spec_decode_num_drafts_total") > 0
    assert _metric(server, "blink:spec_decode_num_draft_tokens_total") > 0
    assert _metric(server, "blink:spec_decode_num_accepted_tokens_total") > 0
