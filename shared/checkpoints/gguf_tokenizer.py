"""A GGUF file's tokenizer (llama.cpp's `tokenizer.ggml.*` metadata) as a `tokenizers` Tokenizer.

A GGUF carries the vocabulary, merges (or scores) and token types but no tokenizer.json. Two tokenizer models:
`gpt2`, byte-level BPE, where `tokenizer.ggml.pre` names how text is split before the merges; and `llama`,
SentencePiece BPE (Llama 2, Mistral, Mixtral), whose merges follow the pieces' scores. Their meaning lives in
llama.cpp (llama-vocab.cpp), the format's owner, and is followed here: an unknown pre-tokenizer or tokenizer model is
refused, never guessed.
"""

from __future__ import annotations

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

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
SPACE = "\u2581"  # SentencePiece's visible space


def build_tokenizer(meta: dict) -> Tokenizer:
    """meta: the file's `tokenizer.ggml.*` fields, keys without the prefix."""
    kind = meta.get("model")
    if kind == "gpt2":
        tokenizer = _byte_level(meta)
    elif kind == "llama":
        tokenizer = _sentencepiece(meta)
    else:
        raise CheckpointError(f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE: "
                              "Llama 3, Qwen, SmolLM), llama (SentencePiece BPE: Llama 2, Mistral, Mixtral)")
    tokens: list[str] = meta["tokens"]
    types = meta.get("token_type") or [1] * len(tokens)
    # Control tokens (<|im_end|>) are special and skipped when decoding; user-defined ones (<think>) are matched whole.
    special = (TokenType.UNKNOWN, TokenType.CONTROL)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, type_ in zip(tokens, types, strict=True) if type_ in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, type_ in zip(tokens, types, strict=True) if type_ == TokenType.USER_DEFINED])
    bos = meta.get("bos_token_id")
    # SentencePiece files add BOS unless they say not to (llama.cpp's default for the llama model)
    if meta.get("add_bos_token", kind == "llama") and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)])
    elif kind == "gpt2":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _byte_level(meta: dict) -> Tokenizer:
    pre = meta.get("pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
                              f"{', '.join(sorted(PRE_TOKENIZERS))}")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(meta["tokens"])}, merges=merges,
                                     ignore_merges=pre in ("llama3", "llama-v3", "llama-bpe")))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(meta: dict) -> Tokenizer:
    """As llama.cpp's SPM tokenizer: a space before the text (add_space_prefix), spaces as ▁, BPE over pieces whose
    merges follow the merged piece's score, bytes (<0x41>) for what no piece covers."""
    tokens: list[str] = meta["tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = ([tuple(m.split(" ", 1)) for m in meta["merges"]] if meta.get("merges")
              else _merges_by_score(vocab, meta["scores"]))
    unk = meta.get("unknown_token_id")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True,
                                     unk_token=tokens[unk] if unk is not None else None))
    prefix = [normalizers.Prepend(SPACE)] if meta.get("add_space_prefix", True) else []
    tokenizer.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                           *strip])
    return tokenizer


def _merges_by_score(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges the pair whose merged piece scores highest: every split of every piece into two
    pieces of the vocabulary, best merged score first (ties: the longer left piece, then the longer right)."""
    merges = []
    for piece, index in vocab.items():
        merges += [(piece[:i], piece[i:], scores[index]) for i in range(1, len(piece))
                   if piece[:i] in vocab and piece[i:] in vocab]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]
