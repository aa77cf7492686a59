"""A stand-in for a Triton kernel that records each launch (its grid, its arguments by name) instead of running it:
what a test checks of a step's launches without a GPU, and what the GPU compile check compiles them with."""

from __future__ import annotations

import inspect
from typing import NamedTuple


class Launch(NamedTuple):
    name: str
    grid: tuple
    arguments: dict


class Launches:
    def __init__(self, name: str, kernel, log: list[Launch]):
        self.name, self.kernel, self.log = name, kernel, log
        self.params = list(inspect.signature(kernel.fn).parameters)

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.log.append(Launch(self.name, grid, dict(zip(self.params, args, strict=False)) | kwargs))
        return record
