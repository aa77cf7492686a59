"""The grammar backends (blink.shared.grammar_backends) on the tiny model's tokenizer: llguidance (the default) and
xgrammar refuse the same bad specs, walk the same answers, bound JSON's whitespace alike, allow only the end token once
a grammar is complete, and fill the same bitmask layout, which the engine applies (blink.engine.core.grammar); and the
ingress's structured path runs with torch, transformers and xgrammar hidden."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from blink.engine.core.grammar import SlotGrammars, make_backend
from blink.engine.model.tiny_model import ensure_tiny_model
from blink.shared.grammar import GrammarError, GrammarKind, GrammarSpec
from blink.shared.grammar_backends import BACKENDS
from blink.shared.tokenizer import Tokenizer

EOS = 1
ANSWERS = [  # a spec and an answer it allows
    (GrammarSpec(GrammarKind.REGEX, r"[a-c]{3,6}"), "abcabc"),
    (GrammarSpec.choice(["north", "south west"]), "south west"),
    (GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
     '{ "a": 12}'),
    (GrammarSpec(GrammarKind.EBNF, 'root ::= "x" [0-9] [0-9]'), "x42"),
]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(ensure_tiny_model())


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tokenizer):
    if request.param == "xgrammar":
        pytest.importorskip("xgrammar")
    return make_backend(request.param, tokenizer.raw, tokenizer.vocab_size, [EOS])


def _allowed(backend, matcher, vocab: int) -> set[int]:
    bitmask = np.zeros((2, (vocab + 31) // 32), dtype=np.int32)
    backend.fill(matcher, bitmask, 1)
    assert not bitmask[0].any()  # only its row
    bits = np.unpackbits(bitmask[1].view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


@pytest.mark.parametrize(("spec", "words"), [
    (GrammarSpec.json_schema({"type": "colour"}), "invalid JSON schema"),
    (GrammarSpec(GrammarKind.REGEX, "(ab"), "invalid regex"),
    (GrammarSpec(GrammarKind.EBNF, "root ::= missing"), "invalid grammar"),
    (GrammarSpec(GrammarKind.EBNF, 'root ::= "a" | ('), "invalid grammar"),
])
def test_bad_specs_are_grammar_errors(backend, spec, words):
    with pytest.raises(GrammarError, match=words):
        backend.compile(spec)


@pytest.mark.parametrize(("spec", "text"), ANSWERS, ids=["regex", "choice", "json", "gbnf"])
def test_an_answer_walks_to_the_end_token_alone(backend, tokenizer, spec, text):
    matcher = backend.matcher(backend.compile(spec))
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert token in _allowed(backend, matcher, tokenizer.vocab_size)
        assert backend.accept(matcher, token)
    assert _allowed(backend, matcher, tokenizer.vocab_size) == {EOS}  # complete: only the end
    assert backend.accept(matcher, EOS)


def test_the_backends_allow_alike(tokenizer):
    """Step by step along each answer, llguidance allows what xgrammar does, or less: xgrammar also allows some
    non-canonical tokenizations of forced text (' w' where llguidance wants ' west')."""
    pytest.importorskip("xgrammar")
    vocab = tokenizer.vocab_size
    guidance, xgrammar = (make_backend(n, tokenizer.raw, vocab, [EOS]) for n in ("guidance", "xgrammar"))
    for spec, text in ANSWERS:
        g, x = guidance.matcher(guidance.compile(spec)), xgrammar.matcher(xgrammar.compile(spec))
        for token in tokenizer.encode(text, add_special_tokens=False):
            allowed = _allowed(guidance, g, vocab)
            assert token in allowed and allowed <= _allowed(xgrammar, x, vocab), spec
            assert guidance.accept(g, token) and xgrammar.accept(x, token)


def test_json_objects_are_closed_and_whitespace_is_bounded(backend, tokenizer):
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})

    def walks(text: str) -> bool:
        matcher = backend.matcher(backend.compile(spec))
        return all(backend.accept(matcher, t) for t in tokenizer.encode(text, add_special_tokens=False))

    assert walks('{\n   "a": 1}')  # 4 whitespace characters in a row
    assert not walks('{\n    "a": 1}')  # 5
    assert not walks('{"a": 1, "b"')  # no property the schema does not name (xgrammar's strict mode)


def test_the_mask_layout_the_engine_applies():
    """Bit b of word w allows token 32 * w + b (the sign bit included), on the host path and the torch one."""
    vocab, allowed = 100, {0: [0, 31, 32, 99], 2: [5, 64]}
    bitmask = np.zeros((3, 4), dtype=np.int32)
    for row, tokens in allowed.items():
        for t in tokens:
            bitmask[row, t // 32] |= np.uint32(1 << t % 32).view(np.int32)
    grammars = SlotGrammars(None, vocab, [EOS])
    for dtype in (torch.float32, torch.bfloat16):  # numpy fills the first, torch the second
        logits = torch.zeros(3, vocab, dtype=dtype)
        grammars._apply(logits, bitmask, [0, 2])
        assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == allowed[0]
        assert torch.isfinite(logits[1]).all()  # an unconstrained row untouched
        assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == allowed[2]


TORCH_HIDDEN = """
import asyncio, sys
from types import SimpleNamespace

class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "triton", "xgrammar"):
            raise ImportError(f"{name} is hidden")

sys.meta_path.insert(0, Hidden())
import blink.ingress.app
from blink.ingress.errors import APIError
from blink.ingress.metrics import Metrics
from blink.ingress.structured import check_grammar
from blink.shared.grammar import GrammarKind, GrammarSpec
from blink.shared.tokenizer import Tokenizer

async def off_loop(f, *args):
    return f(*args)

info = SimpleNamespace(drive="host", max_grammar_bytes=4096, model="m", vocab_size=1174, eos_token_ids=[1])
state = SimpleNamespace(info=info, metrics=Metrics("m", "host", "shm"), grammars=None, grammar_timeout_s=10.0,
                        tokenizer=Tokenizer(sys.argv[1]), off_loop=off_loop)
asyncio.run(check_grammar(state, GrammarSpec.json_schema({"type": "object"}), "response_format"))
try:
    asyncio.run(check_grammar(state, GrammarSpec(GrammarKind.REGEX, "(ab"), "guided_regex"))
    raise SystemExit("an invalid regex passed")
except APIError as e:
    assert e.status == 400 and "invalid regex" in e.message, e.message
assert not any(m.split(".")[0] in ("torch", "transformers", "xgrammar") for m in sys.modules)
print("checked without torch")
"""


def test_the_ingress_checks_grammars_without_torch():
    """The ingress extra installs no torch: its structured path (the guidance backend) imports none."""
    done = subprocess.run([sys.executable, "-c", TORCH_HIDDEN, str(ensure_tiny_model())], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "checked without torch" in done.stdout, done.stdout + done.stderr


def test_the_ingress_extra_pulls_no_torch():
    import re
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = {re.split(r"[<>=;\[ ]", d, maxsplit=1)[0] for d in extras["ingress"]}
    assert "llguidance" in names
    assert not names & {"torch", "transformers", "triton", "xgrammar"}
    assert any(d.startswith("xgrammar") for d in extras["xgrammar"])  # still there, for those who choose it


def test_an_engine_without_its_backend_s_library_refuses_grammars(monkeypatch, tokenizer):
    """The record is ended (a GrammarError, as an invalid spec), never the host loop (an ImportError)."""
    from blink.shared.request_schema import Request
    from blink.shared.slot_table import Geometry, slot_dtype, write_request

    monkeypatch.setitem(sys.modules, "llguidance", None)  # its import raises ImportError
    g = Geometry(1, 8, 4, max_grammar_bytes=64)
    records = np.zeros(1, dtype=slot_dtype(g))
    write_request(records[0], Request(prompt=[1, 2], max_tokens=3, grammar_kind=int(GrammarKind.REGEX), grammar="a+"),
                  g)
    grammars = SlotGrammars(tokenizer.raw, tokenizer.vocab_size, [EOS], "guidance")
    assert grammars.ready(records, [0]) == ([], [0])
    assert grammars.admit(records, [0]) == [0]
    with pytest.raises(GrammarError, match="needs llguidance"):
        grammars.compiler  # noqa: B018
