"""A draft model (`--speculative-config '{"model": ..., "num_speculative_tokens": K}'`): a smaller model of the same
tokenizer whose greedy tokens are the drafts the step verifies, run inside the step like the rest.

Its KV lives in pages of its own shape that share the target's page ids: the same block table, the same allocation,
prefix sharing and release, so it needs no bookkeeping of its own. Each step (`DraftModel.propose`, after the plan):

1. the draft runs over the step's whole batch, as laid out for the target: its KV stays in step with the target's
   (the positions the target computes, it computes; what a rejection rolls back, the next step rewrites for both).
   The drafts' own rows hold stale tokens then: their KV is rewritten in 2., and no earlier row reads it.
2. each drafting slot's first draft is the argmax at its last committed token's row; then one forward a draft, a row
   per drafting slot, writes each draft's KV and proposes the next. The last draft's forward only writes its KV,
   which the next step reads should every draft be accepted.

A greedy draft is a point mass, so the settle's acceptance (a row's draw equal to the draft) is exact rejection
sampling: outputs are plain decoding's, greedy and seeded (docs/design.md, "Speculative decoding in the step"). The
drafts are written into `state.tokens` and the step's `input_ids`; the policy that chose how many each slot drafts is
`Speculation.draft`'s, with `lookup` off. Every forward has a fixed shape given by `StepShape` (the host mode's exact
counts, the device step's whole slots), and nothing is read on the host here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from blink.engine.core.scheduler import QueryRows, StepPlan
from blink.engine.core.state import Slots
from blink.engine.model import fp8, huge_pages, quant
from blink.engine.model.checkpoint import load_config
from blink.engine.model.config import ModelConfig
from blink.engine.model.model import Transformer
from blink.shared.checkpoints.source import resolve
from blink.shared.speculative import SpeculativeConfig
from blink.shared.tokenizer import Tokenizer

if TYPE_CHECKING:
    from blink.engine.core.step import StepShape


def load_draft(config: SpeculativeConfig, target: ModelConfig, tokenizer: Tokenizer, max_len: int,
               device: torch.device, load_format: str) -> Transformer | None:
    """The draft model a config names, loaded in the target's dtype on its device (None: the config has none), for
    contexts up to max_len or its own limit if shorter (the engine's context is then cut to it); ValueError for one
    that cannot draft for this target: another tokenizer, more tokens. One rank only (EngineConfig.validate)."""
    if config.model is None:
        return None
    checkpoint = resolve(config.model, revision=config.revision, check=load_config)
    cfg = dataclasses.replace(load_config(checkpoint.path), dtype=target.dtype)
    _same_tokenizer(Tokenizer(checkpoint.path), tokenizer, config.model)
    if cfg.vocab_size > target.vocab_size:
        raise ValueError(f"the draft model {config.model} has {cfg.vocab_size} token embeddings, the model "
                         f"{target.vocab_size}: its drafts would name tokens the model has not")
    if config.quantization != "fp8":
        quant.check(config.quantization, device, load_format, 1)
    fp8.check(config.quantization, cfg.fp8, 1)
    return Transformer.from_checkpoint(checkpoint.path, cfg, min(max_len, cfg.max_position_embeddings), device,
                                       load_format, quantization=config.quantization)


def _same_tokenizer(draft: Tokenizer, target: Tokenizer, name: str) -> None:
    """A draft's token ids must mean what the target's do."""
    ours, theirs = target.raw.get_vocab(with_added_tokens=True), draft.raw.get_vocab(with_added_tokens=True)
    if ours != theirs:
        token = next(t for t in sorted(theirs.keys() | ours.keys()) if ours.get(t) != theirs.get(t))
        raise ValueError(f"the draft model {name} has another tokenizer: {token!r} is token "
                         f"{theirs.get(token)} there and {ours.get(token)} in the model served")


class DraftModel:
    def __init__(self, model: Transformer, num_pages: int, page_size: int):
        self.model, self.page_size = model, page_size
        cfg = model.cfg
        shape = cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim  # PagePool's, in its own dtype
        # As the pool's: zeroed (padding reads finite values), in huge pages on the CPU.
        self.k, self.v = (huge_pages.zeros(shape, cfg.dtype, model.embed.device) for _ in range(2))

    def cost_ratio(self, target: Transformer) -> float:
        """A draft forward's time as a share of the target's, by the mean of their layers' and their weights' ratios: a
        small model's forward costs its launches (a GPU's kernels, a CPU's op dispatch: a layer's worth each), a large
        one's its bytes. (Measured: the 1B shape's captured decode took 0.46 of the 8B's on an H100, where this gives
        0.33; the default model in Q4_1 decoded in 0.71 of its bfloat16 time on the EPYC's 2 cores, where this gives
        0.68.)"""
        layers = self.model.cfg.num_layers / target.cfg.num_layers
        return (layers + self.model.weight_bytes() / target.weight_bytes()) / 2

    def propose(self, state: Slots, plan: StepPlan, shape: StepShape) -> None:
        """Writes each slot's `state.draft_len[s]` drafts after its sequence and into `plan.input_ids`, on the
        step's buckets: shape.draft_rows, the rows a draft's forward computes (at least the drafting slots);
        shape.draft_steps, the forwards after the first (at least the longest draft)."""
        model, kernels, table, page_size = self.model, self.model.kernels, state.block_table, self.page_size
        B, S, rows, context = shape.tokens, state.num_slots, shape.draft_rows, shape.context
        batch = kernels.attention_batch(plan, shape, table, page_size)
        # A draft with fewer token embeddings reads the ones it lacks as its last (their drafts are only rejected).
        ids = plan.input_ids[:B].clamp(max=model.cfg.vocab_size - 1)
        hidden = model.forward(ids, plan.token_pos[:B], batch, self.k, self.v)
        if not rows:
            return
        k = state.draft_len
        # The drafting slots, longest drafts first: the slots still drafting at every later forward are a prefix.
        order = torch.sort(k, descending=True, stable=True).indices[:rows]
        seq = state.seq_len[order]
        slot_of, pos_of = plan.token_slot[:B], plan.token_pos[:B]
        last = plan.token_valid[:B] & (pos_of == state.seq_len[slot_of] - 1)  # a slot's last committed token
        row_of = torch.zeros(S + 1, dtype=torch.int64, device=k.device).scatter_(
            0, torch.where(last, slot_of, S), torch.arange(B, device=k.device))[:S]
        draft = model.logits(hidden[row_of[order]]).argmax(-1)
        start = torch.arange(rows, device=k.device)
        for j in range(1, shape.draft_steps + 1):
            active = k[order] >= j
            pos = torch.where(active, seq - 1 + j, 0)  # a row not drafting computes position 0 into the null page
            state.tokens[order, torch.where(active, pos, state.max_len)] = draft.to(state.tokens.dtype)
            batch = kernels.decode_batch(QueryRows(start, torch.ones_like(start), pos, order, active.sum()),
                                         table, page_size, context)
            hidden = model.forward(draft, pos, batch, self.k, self.v)
            if j < shape.draft_steps:
                draft = model.logits(hidden).argmax(-1)
        drafted = plan.token_valid[:B] & (pos_of >= state.seq_len[slot_of])
        plan.input_ids[:B] = torch.where(drafted, state.tokens[slot_of, pos_of.clamp(max=state.max_len)].long(),
                                         plan.input_ids[:B])
