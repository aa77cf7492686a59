"""blink.engine: the model, KV cache, scheduler, sampler and drive loops."""

from blink.engine.engine import Engine, EngineConfig
from blink.engine.llm import LLM, RequestOutput
from blink.engine.sampling_params import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
