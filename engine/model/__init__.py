"""blink.engine.model: the decoder of the supported architectures, its config and checkpoint, attention (the torch
reference), RoPE, the default random model."""
