"""Where a model comes from: a checkpoint directory, a GGUF file, a Hub id, or the default model; each resolved to a
checkpoint directory in Hugging Face's layout that the engine loads and the ingress reads its tokenizer from
(`source.resolve`). Torch-free, so that the ingress can use it."""
