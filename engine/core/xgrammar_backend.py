"""xgrammar behind blink.shared.grammar.Backend, for the engine: `--structured-outputs-backend xgrammar`.

xgrammar (what vLLM and SGLang default to) imports torch and transformers, so it lives with the engine, never in
shared/ or the ingress (which checks specs with llguidance: blink.shared.grammar_backends).
`pip install blink-serve[xgrammar]`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from blink.shared.grammar import KIND_WORDS, GrammarError, GrammarKind, GrammarSpec
from blink.shared.grammar_backends import first_line


class XGrammar:
    """xgrammar (what vLLM and SGLang default to). A `grammar` is its EBNF (GBNF); a choice the EBNF of its
    literals. JSON schemas compile with any whitespace between items, at most `max_whitespace` in a row."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int], max_whitespace: int):
        import torch
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self._xgr, self._torch, self.max_whitespace = xgr, torch, max_whitespace
        info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tokenizer),
                                                  vocab_size=vocab_size, stop_token_ids=stop_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # our cache: GrammarCompiler

    def compile(self, spec: GrammarSpec) -> Any:
        c = self._compiler
        try:
            if spec.kind == GrammarKind.JSON_SCHEMA:
                return c.compile_json_schema(spec.text, any_whitespace=True, max_whitespace_cnt=self.max_whitespace)
            if spec.kind == GrammarKind.REGEX:
                return c.compile_regex(spec.text)
            if spec.kind == GrammarKind.EBNF:
                return c.compile_grammar(spec.text)
        except (RuntimeError, ValueError, TypeError) as e:  # the library's words: why the spec is invalid
            raise GrammarError(f"invalid {KIND_WORDS[spec.kind]}: {first_line(e)}") from None
        raise GrammarError(f"unknown grammar kind {int(spec.kind)}")

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: np.ndarray, row: int) -> None:
        matcher.fill_next_token_bitmask(self._torch.from_numpy(bitmask), row)  # the same memory

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)
