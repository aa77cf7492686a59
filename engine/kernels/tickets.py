"""Zeroed int32 tickets for kernels whose programs hand a group's last work to the last of them to finish (a split
row's merge, a sampled row's plan, finish and scores): each group's last program leaves its ticket at zero again, so
one allocation serves every launch, graphs' replays included."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TICKETS: dict[tuple[str, torch.device], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # kept alive: a graph captured before they were outgrown still points at them


def tickets(user: str, device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed tickets of `user`'s own on `device`, allocated once (before a graph captures them: the
    device modes run every bucket before capturing)."""
    held = _TICKETS.get((user, device))
    if held is None or held.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{user}'s tickets must grow before capture: run the bucket once first")
        if held is not None:
            _OUTGROWN.append(held)
        held = _TICKETS[(user, device)] = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
    return held


@triton.jit
def last_to_finish(ticket, group):
    """Whether this program is the last of its group of `group` to get here; that one sees the others' stores (read
    them with cache_modifier=".cg", past this SM's cache) and leaves the ticket at zero for the next launch."""
    tl.debug_barrier()  # every thread's stores issued before the ticket releases them
    last = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == group - 1
    if last:
        tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")
    return last
