"""Zeroed int32 tickets for kernels whose programs hand a group's last work to the last of them to finish (a split
row's merge, a drawn row's finish): each group's last program leaves its ticket at zero again, so one allocation
serves every launch, graphs' replays included."""

from __future__ import annotations

import torch

_TICKETS: dict[tuple[str, torch.device], torch.Tensor] = {}


def tickets(user: str, device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed tickets of `user`'s own on `device`, allocated once (before a graph captures them: the
    device modes run every bucket before capturing)."""
    held = _TICKETS.get((user, device))
    if held is None or held.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{user}'s tickets must grow before capture: run the bucket once first")
        held = _TICKETS[(user, device)] = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
    return held
