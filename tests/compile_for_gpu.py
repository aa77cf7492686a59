"""Compiles the model's and the sampler's Triton kernels for an H100 (sm_90) without a GPU: Triton's front end, its
passes and the ptxas its wheel ships, so code the interpreter accepts but the compiler would not fails here, in CI.
Run as `python -m tests.compile_for_gpu` without TRITON_INTERPRET (tests/test_kernels.py does)."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "the interpreter compiles nothing"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from blink.engine.kernels import attention, moe, rms_norm, rope_kv, rotation, sampler  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def build(kernel, name: str, constexprs: dict, types: dict[str, str]) -> bool:
    """Compiles `kernel` with these constexprs; an argument not in `types` is an int32 (sizes and strides)."""
    signature = {arg: "constexpr" if arg in constexprs else types.get(arg, "i32") for arg in kernel.arg_names}
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=TARGET)
    except Exception as e:  # every kernel is tried; the exit status says whether one failed
        print(f"FAIL {name}: {type(e).__name__}: {str(e)[:3000]}")
        return False
    print(f"ok {name}: {len(compiled.asm['cubin'])} bytes of cubin")
    return True


def pointers(dtype: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, f"*{dtype}")


attention_args = {**pointers("bf16", "q_ptr", "out_ptr", "k_ptr", "v_ptr"),
                  **pointers("i64", "table_ptr", "start_ptr", "length_ptr", "first_pos_ptr", "slot_ptr", "count_ptr"),
                  **pointers("fp32", "span_max", "span_sum", "span_acc"), "scale_log2": "fp32"}
decode = dict(GROUP=4, HEAD_DIM=64, PAGE_SIZE=16, HAS_WINDOW=False, BLOCK_H=4, BLOCK_M=16, BLOCK_N=64, BLOCK_D=64,
              DOT_PRECISION="tf32", UPCAST=False, SPLITS=8)
chunk = decode | dict(HAS_WINDOW=True, BLOCK_M=64, SPLITS=1)
logits = {"logits": "*fp32", "tokens": "*i64", "passes": "*i32"}
results = [
    build(sampler._sample_kernel, "sampler: draw", dict(GREEDY_BELOW=1e-5, BLOCK=1024, PIVOTS=16),
          logits | pointers("fp32", "temperature", "log_min_p", "top_p") | {"top_k": "*i64", "noise_key": "*i32"}),
    build(sampler._logprobs_kernel, "sampler: logprobs", dict(TOP=20, BLOCK=1024, PIVOTS=16),
          logits | pointers("fp32", "logprob", "lse_out") | pointers("i64", "asked", "top_keys")),
    build(attention._paged_attention_kernel, "attention: decode rows, keys split", decode, attention_args),
    build(attention._paged_attention_kernel, "attention: prefill chunks, a window", chunk, attention_args),
    build(attention._merge_spans_kernel, "attention: merge spans", dict(HEAD_DIM=64, SPLITS=8, BLOCK_D=64),
          attention_args),
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
sys.exit(0 if all(results) else 1)
