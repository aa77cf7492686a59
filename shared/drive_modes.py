"""The engine's drive modes, declared once: settings (--drive), `blink doctor` and the engine (blink.engine.drive.modes,
which builds each one's driver) read them here. A new one is an entry below and its driver's file."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DriveMode:
    name: str
    summary: str  # for --drive's help
    how: str  # blink doctor's, where it can run
    needs_cuda: bool  # doctor says it cannot run where torch or a CUDA GPU is missing, without asking the engine
    grammars: bool = False  # masks structured outputs' grammars (every mode does; doctor names those on the host)
    # Walks them on the device: those that lower to a token automaton (blink.shared.grammar_backends.device_regex).
    walks_grammars: bool = False


# Best first: what `auto` tries.
MODES = {m.name: m for m in (
    DriveMode("persistent", "a loop on the GPU, no host work per token",
              "the step loops on the GPU in a CUDA graph WHILE node: no host work", needs_cuda=True, grammars=True,
              walks_grammars=True),
    DriveMode("graph", "CUDA graph replays queued ahead by a host thread",
              "the step captured as CUDA graphs, replayed ahead by a host thread", needs_cuda=True, grammars=True,
              walks_grammars=True),
    DriveMode("host", "a host loop; the CPU path",
              "always: a host loop steps the engine (the CPU path, and the baseline)", needs_cuda=False,
              grammars=True),
)}
DRIVE_MODES = tuple(MODES)

HELP = ("how the engine's step is driven: " + ", ".join(f"{m.name} ({m.summary})" for m in MODES.values())
        + ", auto (the best this machine supports)")
