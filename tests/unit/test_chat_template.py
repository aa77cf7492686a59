"""Chat templates as checkpoints store them: a string, a list of named templates, or chat_template.jinja."""

from __future__ import annotations

import json
import shutil

from blink.ingress.chat import render_chat
from blink.ingress.protocol import ChatMessage
from blink.shared.tokenizer import Tokenizer

TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def _render(model_dir) -> str:
    return render_chat(Tokenizer(model_dir), [ChatMessage(role="user", content="hi")], add_generation_prompt=False)


def test_template_forms_and_added_token_specials(tokenizer_dir, tmp_path):
    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {"bos_token": {"content": "<s>", "special": True}, "chat_template": TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert _render(tmp_path) == "<s>[user] hi\n"

    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATE}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert _render(tmp_path) == "<s>[user] hi\n"

    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    assert _render(tmp_path) == "<s>[user] hi\n"
