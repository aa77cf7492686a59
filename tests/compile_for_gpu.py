"""Compiles the sampler and attention kernels for an H100 (sm_90) without a GPU: Triton's front end, its passes
and the ptxas its wheel ships, so code the interpreter accepts but the compiler would not fails here, in CI.
Run as `python -m tests.compile_for_gpu` without TRITON_INTERPRET (tests/test_kernels.py does)."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "the interpreter compiles nothing"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from blink.engine.kernels import attention as A  # noqa: E402
from blink.engine.kernels import sampler as S  # noqa: E402

target = GPUTarget("cuda", 90, 32)

failed = []


def build(fn, signature, constexprs, name):
    try:
        k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target)
        print("ok", name, len(k.asm["cubin"]), "bytes of cubin")
    except Exception as e:  # every kernel is tried; the exit status says whether one failed
        print("FAIL", name, type(e).__name__, str(e)[:3000])
        failed.append(name)

sig = {"logits": "*fp32", "stride": "i32", "V": "i32", "temperature": "*fp32", "log_min_p": "*fp32",
       "top_k": "*i64", "top_p": "*fp32", "noise_key": "*i32", "tokens": "*i64", "passes": "*i32",
       "GREEDY_BELOW": "constexpr", "BLOCK": "constexpr", "PIVOTS": "constexpr"}
build(S._sample_kernel, sig, {"GREEDY_BELOW": 1e-5, "BLOCK": 1024, "PIVOTS": 16}, "sample")
sig = {"logits": "*fp32", "stride": "i32", "V": "i32", "asked": "*i64", "tokens": "*i64", "logprob": "*fp32",
       "lse_out": "*fp32", "top_keys": "*i64", "passes": "*i32", "TOP": "constexpr", "KEEP": "constexpr",
       "BLOCK": "constexpr", "PIVOTS": "constexpr"}
build(S._logprobs_kernel, sig, {"TOP": 20, "KEEP": 32, "BLOCK": 1024, "PIVOTS": 16}, "logprobs")
ptr = "*bf16"
names = ["q_ptr", "out_ptr", "k_ptr", "v_ptr", "table_ptr", "start_ptr", "length_ptr", "first_pos_ptr", "slot_ptr",
         "count_ptr", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kp", "stride_ks", "stride_kh",
         "stride_vp", "stride_vs", "stride_vh", "stride_table", "scale_log2", "window", "span_max", "span_sum",
         "span_acc", "heads"]
types = [ptr, ptr, ptr, ptr, "*i64", "*i64", "*i64", "*i64", "*i64", "*i64"] + ["i32"] * 11 + ["fp32", "i32",
         "*fp32", "*fp32", "*fp32", "i32"]
sig = dict(zip(names, types, strict=True))
const = dict(GROUP=4, HEAD_DIM=64, PAGE_SIZE=16, HAS_WINDOW=False, BLOCK_H=4, BLOCK_M=16, BLOCK_N=64, BLOCK_D=64,
             DOT_PRECISION="tf32", UPCAST=False, SPLITS=8)
sig.update({k: "constexpr" for k in const})
build(A._paged_attention_kernel, sig, const, "attention split 8")
const["SPLITS"] = 1
build(A._paged_attention_kernel, sig, const, "attention split 1")
sig = {"out_ptr": ptr, "start_ptr": "*i64", "count_ptr": "*i64", "span_max": "*fp32", "span_sum": "*fp32",
       "span_acc": "*fp32", "stride_ot": "i32", "stride_oh": "i32", "heads": "i32", "HEAD_DIM": "constexpr",
       "SPLITS": "constexpr", "BLOCK_D": "constexpr"}
build(A._merge_spans_kernel, sig, dict(HEAD_DIM=64, SPLITS=8, BLOCK_D=64), "merge spans")
sys.exit(1 if failed else 0)
