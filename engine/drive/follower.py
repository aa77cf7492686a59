"""The host mode's ranks past the first, with tensor parallelism (`blink serve --tensor-parallel-size N`).

Rank 0's engine service reads the slot table and, before each step, sends every other rank what it read: the
records it admitted, the windows' cancel flags and room (blink.engine.drive.host.StepInputs). A follower admits
the same records, mirrors the same windows and runs the same step; the scheduler's decisions are tensor code on
the same state, and the collectives in the forward pass keep the ranks in lock-step and the sampled tokens equal.
It publishes nothing: rank 0 alone writes the table.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

import numpy as np

from blink.engine.drive.host import HostRank, StepInputs
from blink.engine.engine import Engine, EngineConfig


def follow(model: str | None, engine_options: dict, inbox: Connection) -> None:
    """A rank's life (blink.engine.ranks.RankMain): steps on rank 0's inputs until it sends None or goes away."""
    follower = Follower(Engine(EngineConfig(model=model, **engine_options)))
    while (inputs := inbox.recv()) is not None:
        follower.step(inputs)


class Follower:
    """A rank past the first: rank 0's admissions and windows in, the same step, nothing out."""

    def __init__(self, engine: Engine):
        self.rank = HostRank(engine)
        self.records: np.ndarray | None = None  # indexed by slot as the table's, of its record type (on first use)

    def step(self, inputs: StepInputs) -> None:
        rank = self.rank
        if inputs.admitted:
            if self.records is None:
                self.records = np.zeros(rank.engine.state.num_slots, dtype=inputs.records.dtype)
            self.records[inputs.admitted] = inputs.records
            rank.admit(self.records, inputs.admitted, inputs.now)
        if not np.array_equal(inputs.windows.slots, np.fromiter(rank.asked, dtype=np.int64)):
            # Both ranks admit and finish the same requests unless their steps diverged: then stop, and the engine
            # fails over, rather than serve tokens the ranks disagree on.
            raise RuntimeError(f"tensor-parallel rank {rank.engine.config.tensor_parallel_rank} holds slots "
                               f"{sorted(rank.asked)}, rank 0 {sorted(inputs.windows.slots.tolist())}")
        rank.step(inputs.windows)
