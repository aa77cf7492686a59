"""Speculative decoding's counters reach /metrics as vLLM names them: the engine's state, its status answer
(services/engine_service.py), the ingress's gauges (ingress/metrics.py)."""

from __future__ import annotations

from types import SimpleNamespace

from blink.engine import LLM, SamplingParams
from blink.engine.model.tiny_model import ensure_tiny_model
from blink.ingress.metrics import Metrics
from blink.services.engine_service import _speculation_counts
from blink.shared import control


def _render(status: control.EngineStatus) -> str:
    client = SimpleNamespace(running=0, waiting=0, failed_over=0, health=lambda: SimpleNamespace(failovers=0))
    return Metrics("m", "host", "shm").render(client, status, degraded=False).decode()


def _status(**counts) -> control.EngineStatus:
    return control.EngineStatus(state="ready", epoch=1, steps=0, running=0, kv_pages_used=0, kv_pages_total=1,
                                preemptions=0, **counts)


def test_the_engine_s_counters_are_vllm_s_and_reach_the_metrics():
    llm = LLM(str(ensure_tiny_model()), max_num_seqs=2, max_num_batched_tokens=32, page_size=8, max_model_len=96,
              dtype="float32", speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                                   "prompt_lookup_max": 2})
    llm.generate([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=24))
    counts = _speculation_counts(llm.engine)
    assert counts["spec_decode_num_drafts"] > 0 and counts["spec_decode_num_draft_tokens"] >= counts[
        "spec_decode_num_drafts"]
    per_pos = counts["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 3 and sum(per_pos) == counts["spec_decode_num_accepted_tokens"] > 0
    assert per_pos == sorted(per_pos, reverse=True)  # a position is accepted only after the ones before it
    text = _render(_status(**counts))
    # Counters, as vLLM's: `_total` names, a counter's type (rate() over them takes a restarted engine's reset).
    assert f'blink:spec_decode_num_drafts_total{{model_name="m"}} {float(counts["spec_decode_num_drafts"])}' in text
    assert (f'blink:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {float(per_pos[0])}'
            in text)
    assert any(line.startswith("# TYPE blink:spec_decode_num_accepted_tokens") and line.endswith(" counter")
               for line in text.splitlines())


def test_an_engine_that_does_not_speculate_shows_no_speculation_series():
    assert "spec_decode_num_drafts{" not in _render(_status())
