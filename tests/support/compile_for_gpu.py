"""Compiles Blink's Triton kernels for an H100 (sm_90) without a GPU: Triton's front end, its passes and the ptxas
its wheel ships, so code the interpreter accepts but the compiler would not fails here, in CI. The model's and the
sampler's kernels with signatures written here; the exchange kernels with the arguments one device step (on the
CPU, the kernels recorded rather than run) hands them. Run as `python -m tests.support.compile_for_gpu` without
TRITON_INTERPRET (tests/engine/test_kernels.py does)."""

import os
import sys
import uuid

assert os.environ.get("TRITON_INTERPRET") != "1", "the interpreter compiles nothing"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from blink.engine.kernels import activation, attention, exchange, moe, rms_norm, rope_kv, rotation, sampler  # noqa: E402
from tests.support.launches import Launch, Launches  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_one(kernel, name: str, signature: dict[str, str], constexprs: dict) -> bool:
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=TARGET)
    except Exception as e:  # every kernel is tried; the exit status says whether one failed
        print(f"FAIL {name}: {type(e).__name__}: {str(e)[:3000]}")
        return False
    print(f"ok {name}: {len(compiled.asm['cubin'])} bytes of cubin")
    return True


def build(kernel, name: str, constexprs: dict, types: dict[str, str]) -> bool:
    """Compiles `kernel` with these constexprs; an argument not in `types` is an int32 (sizes and strides)."""
    signature = {arg: "constexpr" if arg in constexprs else types.get(arg, "i32") for arg in kernel.arg_names}
    return compile_one(kernel, name, signature, constexprs)


def pointers(dtype: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, f"*{dtype}")


attention_args = {**pointers("bf16", "q_ptr", "out_ptr", "k_ptr", "v_ptr"),
                  **pointers("i64", "table_ptr", "write_ptr", *(f"{g}_{field}" for g in "dc"
                                                                for field in ("start", "length", "first_pos", "slot",
                                                                              "count"))),
                  **pointers("fp32", "span_max", "span_sum", "span_acc"), "locks": "*i32", "scale_log2": "fp32",
                  **pointers("bf16", "k_new", "v_new", "cos_ptr", "sin_ptr"), "pos_ptr": "*i64"}
# A step's one launch: RoPE and the cache write, decode rows splitting their keys beside prefill chunks; chunks
# alone over a written cache, with a window.
both = dict(GROUP=4, HEAD_DIM=64, PAGE_SIZE=16, HAS_WINDOW=False, BLOCK_N=64, BLOCK_D=64, DOT_PRECISION="tf32",
            UPCAST=False, DECODES=True, D_BLOCK_H=4, D_BLOCK_M=16, SPLITS=8, CHUNKS=True, C_QUERIES=64, C_BLOCK_H=4,
            C_BLOCK_M=256, ZERO_PADDING=True, ROPE=True, HALF=32)
chunks = both | dict(HAS_WINDOW=True, DECODES=False, SPLITS=1, ZERO_PADDING=False, ROPE=False)
logits = {"logits": "*fp32", "tokens": "*i64", "passes": "*i32"}
results = [
    build(sampler._sample_kernel, "sampler: draw", dict(GREEDY_BELOW=1e-5, BLOCK=1024, PIVOTS=16),
          logits | pointers("fp32", "temperature", "log_min_p", "top_p")
          | pointers("i64", "top_k", "seed", "step_index")),
    build(sampler._logprobs_kernel, "sampler: logprobs", dict(TOP=20, BLOCK=1024, PIVOTS=16),
          logits | pointers("fp32", "logprob", "lse_out") | pointers("i64", "asked", "top_keys")),
    build(attention._paged_attention_kernel, "attention: rope, cache write, split decodes, chunks, padding", both,
          attention_args),
    build(attention._paged_attention_kernel, "attention: prefill chunks, a window", chunks, attention_args),
    build(activation._silu_and_mul_kernel, "silu(gate) * up", dict(N=8192, BLOCK_R=1, BLOCK=4096),
          pointers("bf16", "x_ptr", "out_ptr")),
    build(rms_norm._rms_norm_kernel, "rms_norm with the residual add", dict(N=2048, BLOCK_R=2, BLOCK=2048, ADD=True),
          pointers("bf16", "x_ptr", "delta_ptr", "sum_ptr", "w_ptr", "out_ptr") | {"eps": "fp32"}),
    build(rope_kv._rope_and_cache_kernel, "rope and the cache write",
          dict(Q_HEADS=32, KV_HEADS=8, HALF=32, BLOCK_T=4, BLOCK_HQ=32, BLOCK_HKV=8, BLOCK_HALF=32),
          pointers("bf16", "q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "k_cache_ptr", "v_cache_ptr", "cos_ptr", "sin_ptr")
          | pointers("i64", "pos_ptr", "write_ptr")),
    build(moe._expert_product_kernel, "experts: gated products",
          dict(N=768, K=2048, GATHER=True, GATED=True, BLOCK_M=moe.BLOCK_M, BLOCK_N=moe.BLOCK_N, BLOCK_K=moe.BLOCK_K,
               PRECISION="tf32", UPCAST=False),
          pointers("bf16", "x_ptr", "w_ptr", "out_ptr") | pointers("i64", "row_ptr", "expert_ptr")),
    build(rotation._copy_pages_kernel, "KV rotation: page copies",
          dict(LAYERS=16, PAGE_ELEMENTS=16 * 8 * 64, PROGRAMS=rotation.PROGRAMS, BLOCK=rotation.BLOCK),
          pointers("bf16", "src_ptr", "dst_ptr") | pointers("i64", "src_ids_ptr", "dst_ids_ptr", "count_ptr")),
]


TYPES = {torch.uint8: "u8", torch.bool: "i1", torch.int32: "i32", torch.int64: "i64", torch.float32: "fp32",
         torch.float64: "fp64"}


def recorded_launches(names: tuple[str, ...]) -> list[Launch]:
    """One device step of the default model on the CPU, with these exchange kernels recorded instead of run."""
    from blink.engine.drive.device_step import DeviceStep
    from blink.engine.engine import Engine, EngineConfig
    from blink.engine.model.tiny_model import ensure_tiny_model
    from blink.shared.slot_table import SlotTable

    launches: list[Launch] = []
    kernels = {name: getattr(exchange, name) for name in names}
    engine = Engine(EngineConfig(model=str(ensure_tiny_model()), device="cpu", max_num_seqs=4, swap_space=0))
    table = SlotTable.create(f"compile-{uuid.uuid4().hex[:10]}", engine.geometry(window=8))
    try:
        for name, kernel in kernels.items():
            setattr(exchange, name, Launches(name, kernel, launches))
        device = DeviceStep(engine, table)
        device.run(device.buckets[0])
        device.close()
    finally:
        for name, kernel in kernels.items():
            setattr(exchange, name, kernel)
        table.unlink()
    return launches


def signature_of(kernel, arguments: dict) -> tuple[dict, dict]:
    constexprs = {p.name: arguments[p.name] for p in kernel.params if p.is_constexpr}
    signature = {}
    for name, value in arguments.items():
        if name in constexprs:
            signature[name] = "constexpr"
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(1 << 31) <= value < (1 << 31) else "i64"
        else:
            signature[name] = "fp32"
    return signature, constexprs


for launch in recorded_launches(("_select", "_admit", "_emit", "_demand")):
    kernel = getattr(exchange, launch.name)
    results.append(compile_one(kernel, f"exchange: {launch.name}", *signature_of(kernel, launch.arguments)))
sys.exit(0 if all(results) else 1)
