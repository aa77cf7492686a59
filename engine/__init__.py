"""blink.engine: the model, KV cache, scheduler, sampler and drive loops."""

from blink.engine.engine import Engine, EngineConfig
from blink.engine.llm import LLM, CompletionOutput, Logprob, RequestOutput
from blink.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Engine", "EngineConfig", "Logprob", "RequestOutput", "SamplingParams"]
