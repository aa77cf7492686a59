"""A checkpoint's tokenizer (tokenizer.json + tokenizer_config.json) through the `tokenizers` library."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    pass


def _chat_template(model_dir: Path, config: dict) -> str | None:
    """tokenizer_config.json's chat_template (a string, or a list of named ones: "default"), else
    chat_template.jinja beside it, as transformers reads them."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    return template if isinstance(template, str) else None


class Tokenizer:
    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)  # where its checkpoint's other files are (generation_config.json)
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{model_dir}: missing tokenizer.json")
        self._tok = _HFTokenizer.from_file(str(path))
        config_path = Path(model_dir) / "tokenizer_config.json"
        self.config: dict = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.chat_template = _chat_template(Path(model_dir), self.config)
        # bos/eos may be stored as AddedToken objects ({"content": ...}); templates want the strings.
        self.special_tokens = {k: v["content"] if isinstance(v, dict) else v for k, v in self.config.items()
                               if k in ("bos_token", "eos_token") and isinstance(v, str | dict)}

    @property
    def raw(self) -> _HFTokenizer:
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    # The batch calls release the GIL while they work (the single ones hold it: seconds for a few MB), so a
    # thread tokenizing a large prompt leaves the ingress's event loop running.
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A TokenizerError for text that is not valid Unicode (a lone surrogate, which JSON's \\ud800 escapes can
        carry)."""
        try:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise TokenizerError(f"the text is not valid Unicode: {e.reason} at character {e.start}") from None
            raise

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    @cached_property
    def max_token_chars(self) -> int:
        """The longest text one token stands for (byte-level vocabularies spell a byte per character)."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def surely_longer_than(self, text: str, num_tokens: int) -> bool:
        """True when `text` cannot encode to `num_tokens` tokens or fewer, decided without encoding it. Each token
        covers at most max_token_chars characters; the factor 4 leaves room for normalizers that shrink text."""
        return len(text) > 4 * num_tokens * self.max_token_chars

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)
