"""--quantization's values (vLLM's flag), for the served model and a draft model alike (no torch: the settings import
it). What each means is blink.engine.model.quant's (int8, int4, gguf) and blink.engine.model.fp8's (fp8)."""

QUANTIZATIONS = ("int8", "int4", "gguf", "fp8")
