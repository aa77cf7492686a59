"""CPU lists as operators write them (`0-3,8`), checked against the CPUs this process may use."""

from __future__ import annotations

import os

CPU_LIST = r"^\d+(-\d+)?(,\d+(-\d+)?)*$"


def parse_cpus(text: str) -> list[int]:
    cpus = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    if unusable := set(cpus) - os.sched_getaffinity(0):
        raise ValueError(f"CPUs {sorted(unusable)} are not among this process's {sorted(os.sched_getaffinity(0))}")
    return cpus
