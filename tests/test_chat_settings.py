"""vLLM's serving settings (issue 37), against an in-process ingress answered by a scripted engine: list flags and
several served model names."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil

import pytest

from blink.services.cli import add_settings_flags, settings_from_args
from blink.services.watchdog import ProcessSupervisor
from blink.shared.settings import Settings
from tests.scripted_engine import ScriptedEngine

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def model_dir(tmp_path, tokenizer_dir):
    """A tokenizer with a chat template, as a checkpoint directory holds it."""
    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return tmp_path


def _settings(*flags: str) -> Settings:
    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    return settings_from_args(parser.parse_args(list(flags)))


def test_list_flags_as_vllm_takes_them(monkeypatch):
    assert _settings("--served-model-name", "a", "b").served_model_name == ["a", "b"]
    given = _settings("--served-model-name", '["a", "b"]')
    assert given.served_model_name == ["a", "b"]
    for bad in (["--served-model-name", "[x"], ["--served-model-name", "a", ""]):
        with pytest.raises(ValueError):
            _settings(*bad)
    # `blink serve` hands its settings to the services as BLINK_* variables, which they read back the same.
    for name, value in ProcessSupervisor(given).env.items():
        if name.startswith("BLINK_"):
            monkeypatch.setenv(name, value)
    assert Settings().model_dump() == given.model_dump()
    monkeypatch.setenv("BLINK_SERVED_MODEL_NAME", "one")  # compose's plain variable
    assert Settings().served_model_name == ["one"]
    monkeypatch.setenv("BLINK_SERVED_MODEL_NAME", "")  # compose's unset one
    assert Settings().served_model_name is None


def test_several_served_model_names(model_dir):
    engine = ScriptedEngine(model_dir, names=("first", "second"))
    engine.answer = "Hello."

    async def run():
        async with engine.ingress() as (http, client):
            listed = await client.models.list()
            assert [m.id for m in listed.data] == ["first", "second"]
            for name in ("first", "second"):
                reply = await client.chat.completions.create(model=name, messages=USER)
                assert reply.model == "first" and reply.choices[0].message.content == "Hello."
            r = await http.post("/v1/completions", json={"model": "third", "prompt": "x"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"
            assert "'first', 'second'" in r.json()["error"]["message"]

    try:
        asyncio.run(run())
    finally:
        engine.close()
