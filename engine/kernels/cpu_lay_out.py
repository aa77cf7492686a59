"""The plan's last part for the CPU's host mode in one C++ call (cpu_lay_out.cpp, torch.ops.blink_cpu.lay_out_plan):
blink.engine.core.scheduler._lay_out (the torch reference: the batch's tokens flat, the decode, chunk and sampling
rows, the sizes; about seventy small ops) with its arguments and its plan, drafts and decode_runs included.
tests/engine/test_lay_out_kernel.py holds it to the reference field by field, as it does the device step's Triton twin
(blink.engine.kernels.lay_out); tests/engine/test_cpu_lay_out.py, an engine's tokens with it bound."""

from __future__ import annotations

import torch

from blink.engine.core.rotation import PageMoves
from blink.engine.core.scheduler import QueryRows, StepPlan
from blink.engine.core.state import Slots
from blink.engine.kernels.cpu import ops


def lay_out(state: Slots, take: torch.Tensor, entries: torch.Tensor | None, moves: PageMoves | None,
            moved: torch.Tensor, token_budget: int, draft_rows: int = 0, decode_runs: bool = False) -> StepPlan:
    """scheduler._lay_out's arguments and plan."""
    # The tokens' four, the decode rows' and the chunk rows' four and count (0-d views of the sizes), the sampling
    # rows' three, the sizes.
    out = ops().lay_out_plan.default(take, state.num_computed, state.seq_len, state.draft_len, state.tokens, entries,
                                     moved, token_budget, draft_rows, decode_runs)
    return StepPlan(take, *out[:4], QueryRows(*out[4:9]), QueryRows(*out[9:14]), *out[14:17], entries, moves,
                    out[17])
