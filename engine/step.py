"""One engine step: plan → forward → sample → commit, all tensor work on the engine's device.

The step is split in two so a driver can pick the forward's bucket between the halves: `plan()` leaves
the number of live tokens and the longest context in `plan.sizes`; `run(plan, shape)` does the rest on
shapes fixed by `shape`. The host drive loop reads `plan.sizes` to choose `shape`; the device loops will
choose it on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blink.engine.attention import build_attention_batch
from blink.engine.commit import StepOutput, commit
from blink.engine.kv_cache import PagePool
from blink.engine.model import Transformer
from blink.engine.sampler import SamplerFeatures, SamplingRows, hash32, sample
from blink.engine.scheduler import StepPlan, plan
from blink.engine.state import SlotState


@dataclass(frozen=True)
class StepShape:
    tokens: int  # batch tokens the forward runs on (a bucket of the token budget)
    context: int  # cache rows each token may read (a bucket of the context limit)
    rows: int  # logits rows: min(slots, tokens)


def ladder(top: int, start: int) -> list[int]:
    """Powers of two from `start` below `top`, then `top` itself."""
    sizes, size = [], start
    while size < top:
        sizes.append(size)
        size *= 2
    return [*sizes, top]


class Step:
    def __init__(self, model: Transformer, pool: PagePool, state: SlotState, eos_ids: list[int],
                 token_budget: int):
        self.model, self.pool, self.state = model, pool, state
        self.token_budget = token_budget
        device = state.status.device
        self.eos_ids = torch.tensor(eos_ids or [-1], dtype=torch.int64, device=device)
        self.vocab_hash = hash32(torch.arange(model.cfg.vocab_size, dtype=torch.int64, device=device))
        self.token_buckets = ladder(token_budget, 16)
        self.context_buckets = ladder(state.max_len, max(pool.page_size, 64))

    def plan(self, features: SamplerFeatures) -> StepPlan:
        return plan(self.state, self.pool, self.token_budget, track_prompts=features.penalties)

    def shape_for(self, num_tokens: int, max_context: int) -> StepShape:
        tokens = next(b for b in self.token_buckets if b >= num_tokens)
        context = next(b for b in self.context_buckets if b >= max_context)
        return StepShape(tokens, context, min(self.state.num_slots, tokens))

    def run(self, plan: StepPlan, shape: StepShape, features: SamplerFeatures) -> StepOutput:
        state, pool, model = self.state, self.pool, self.model
        B, R = shape.tokens, shape.rows
        batch = build_attention_batch(plan.token_slot[:B], plan.token_pos[:B], plan.token_valid[:B],
                                      state.block_table, pool.page_size, shape.context,
                                      model.cfg.sliding_window)
        hidden = model.forward(plan.input_ids[:B], plan.token_pos[:B], batch, pool.k, pool.v)
        logits = model.logits(hidden[plan.sample_token[:R]])
        slot = plan.sample_slot[:R]
        rows = SamplingRows(
            temperature=state.temperature[slot], top_p=state.top_p[slot], top_k=state.top_k[slot],
            min_p=state.min_p[slot], repetition_penalty=state.repetition_penalty[slot],
            presence_penalty=state.presence_penalty[slot], frequency_penalty=state.frequency_penalty[slot],
            seed=state.seed[slot], step_index=state.seq_len[slot] - state.prompt_len[slot],
        )
        penalties = (state.output_counts[slot], state.prompt_mask[slot]) if features.penalties else (None, None)
        out = sample(logits, rows, features, self.vocab_hash, *penalties)
        return commit(state, pool, plan, R, out, logits, self.eos_ids, count_outputs=features.penalties)
