"""A GGUF file's tokenizer (llama.cpp's `tokenizer.ggml.*` metadata) as a `tokenizers` Tokenizer.

A GGUF carries the vocabulary, merges and token types but no tokenizer.json; how text is split before the merges is
named by `tokenizer.ggml.pre`, whose meaning lives in llama.cpp (llama-vocab.cpp). The table below follows llama.cpp,
the format's owner: an unknown pre-tokenizer or tokenizer model is refused, never guessed.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from blink.shared.checkpoints.errors import CheckpointError

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")


def _split(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's SMOLLM/STARCODER split: each digit alone, then GPT-2's pattern (the checkpoints' own tokenizer.json)
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


# tokenizer.ggml.pre -> the pre-tokenizer the merges were learned with.
PRE_TOKENIZERS = {
    "default": _gpt2, "gpt2": _gpt2,
    "smollm": _digits_then_gpt2, "starcoder": _digits_then_gpt2, "refact": _digits_then_gpt2,
    "llama3": lambda: _split(_LLAMA3), "llama-v3": lambda: _split(_LLAMA3), "llama-bpe": lambda: _split(_LLAMA3),
    "smaug-bpe": lambda: _split(_LLAMA3),
    "qwen2": lambda: _split(_QWEN2), "deepseek-r1-qwen": lambda: _split(_QWEN2),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


def build_tokenizer(meta: dict) -> Tokenizer:
    """meta: the file's `tokenizer.ggml.*` fields, keys without the prefix."""
    kind, pre = meta.get("model"), meta.get("pre", "default")
    if kind != "gpt2":
        raise CheckpointError(f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level "
                                    "BPE: Llama 3, Qwen, SmolLM)")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
                                    f"{', '.join(sorted(PRE_TOKENIZERS))}")
    tokens: list[str] = meta["tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                     ignore_merges=pre in ("llama3", "llama-v3", "llama-bpe")))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    types = meta.get("token_type") or [1] * len(tokens)
    # Control tokens (<|im_end|>) are special and skipped when decoding; user-defined ones (<think>) are matched whole.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types, strict=True) if kind == _USER_DEFINED])
    bos = meta.get("bos_token_id")
    if meta.get("add_bos_token") and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)])
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer
