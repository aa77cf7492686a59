"""Prints, as JSON lines, every Triton launch one device step makes on the CPU (the bookkeeping's kernels: the
exchange, admission, the plan's layout, the commit, the cost fit...): the kernel's module and name, and each
argument as a tensor's dtype, a scalar's value, or a tuple of those. Run with TRITON_INTERPRET=1 (the kernels run
interpreted, so the step goes on with real values); tests/support/compile_for_gpu.py compiles what it prints for a
GPU."""

import dataclasses
import json
import os
import uuid

assert os.environ.get("TRITON_INTERPRET") == "1", "the step runs its kernels in the interpreter"

import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from blink.engine.drive.device_step import DeviceStep  # noqa: E402
from blink.engine.engine import Engine, EngineConfig  # noqa: E402
from blink.engine.model.tiny_model import ensure_tiny_model  # noqa: E402
from blink.shared.slot_table import Request, SlotTable  # noqa: E402


def described(value) -> dict:
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"tuple": [described(v) for v in value]}
    return {"value": value if isinstance(value, bool | int | float | str) or value is None else repr(value)}


def main() -> None:
    interpreted_run = InterpretedFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        # The kernel's arguments, and apart the compile options given at the launch (enable_fp_fusion).
        arguments = dict(zip(self.arg_names, args, strict=False)) | {k: v for k, v in kwargs.items()
                                                                     if k in self.arg_names}
        options = {k: v for k, v in kwargs.items() if k not in self.arg_names}
        print(json.dumps({"module": self.fn.__module__, "name": self.fn.__name__, "options": options,
                          "arguments": {name: described(v) for name, v in arguments.items()}}), flush=True)
        return interpreted_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    tables = []
    InterpretedFunction.run = record
    try:
        # Then a step with drafts (its layout's and publication's variants), its runs laid out as a GPU's
        # attention takes them: prefill chunks.
        for spec in (None, {"method": "ngram", "num_speculative_tokens": 2}):
            engine = Engine(EngineConfig(model=str(ensure_tiny_model()), device="cpu", max_num_seqs=4, swap_space=0,
                                         speculative_config=spec))
            if spec:
                engine.step.speculation = dataclasses.replace(engine.step.speculation, decode_runs=False)
            tables.append(table := SlotTable.create(f"record-{uuid.uuid4().hex[:10]}", engine.geometry(window=8)))
            device = DeviceStep(engine, table)
            table.publish(0, Request([1, 2, 3, 1, 2, 3, 1, 2] if spec else [1, 2, 3], max_tokens=4))
            for _ in range(6):  # admission and a prefill, decodes, the finish (pages released to the prefix cache)
                device.run(device.buckets[0])
            device.close()
    finally:
        InterpretedFunction.run = interpreted_run
        for table in tables:
            table.unlink()


if __name__ == "__main__":
    main()
