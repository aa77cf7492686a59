"""Compiles Blink's Triton kernels for an H100 (sm_90) without a GPU: Triton's front end, its passes and the ptxas
its wheel ships, so code the interpreter accepts but the compiler would not fails here, in CI. The model's and the
sampler's kernels with signatures written here; every kernel one device step launches (the bookkeeping's) with the
arguments it hands them, recorded on the CPU and run by the interpreter. Run as
`python -m tests.support.compile_for_gpu` without TRITON_INTERPRET (tests/engine/test_kernels.py does)."""

import importlib
import json
import os
import subprocess
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "the interpreter compiles nothing"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import blink.engine.kernels.page_sharing as page_sharing  # noqa: E402
from blink.engine.kernels import (  # noqa: E402
    activation,
    attention,
    cache_rows,
    draft,
    fp8_linear,
    logprobs,
    moe,
    rms_norm,
    rope_kv,
    rotation,
    sampler,
    step_sampler,
)

TARGET = GPUTarget("cuda", 90, 32)


def compile_one(kernel, name: str, signature: dict[str, str], constexprs: dict, options: dict | None = None) -> bool:
    """options: the compile options the kernel is launched with (enable_fp_fusion)."""
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=TARGET,
                                  options=options)
    except Exception as e:  # every kernel is tried; the exit status says whether one failed
        print(f"FAIL {name}: {type(e).__name__}: {str(e)[:3000]}")
        return False
    print(f"ok {name}: {len(compiled.asm['cubin'])} bytes of cubin")
    return True


def build(kernel, name: str, constexprs: dict, types: dict[str, str], options: dict | None = None) -> bool:
    """Compiles `kernel` with these constexprs; an argument not in `types` is an int32 (sizes and strides)."""
    signature = {arg: "constexpr" if arg in constexprs else types.get(arg, "i32") for arg in kernel.arg_names}
    return compile_one(kernel, name, signature, constexprs, options)


def pointers(dtype: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, f"*{dtype}")


attention_args = {**pointers("bf16", "q_ptr", "out_ptr", "k_ptr", "v_ptr"),
                  **pointers("i64", "table_ptr", "write_ptr", *(f"{g}_{field}" for g in "dc"
                                                                for field in ("start", "length", "first_pos", "slot",
                                                                              "count"))),
                  **pointers("fp32", "span_max", "span_sum", "span_acc"), "locks": "*i32", "scale_log2": "fp32",
                  **pointers("bf16", "k_new", "v_new", "cos_ptr", "sin_ptr"), "pos_ptr": "*i64", "kv_scales": "*fp32"}
# A step's one launch: RoPE and the cache write, decode rows splitting their keys beside prefill chunks; chunks
# alone over a written cache, with a window.
both = dict(GROUP=4, HEAD_DIM=64, PAGE_SIZE=16, HAS_WINDOW=False, BLOCK_N=64, BLOCK_D=64, DOT_PRECISION="tf32",
            UPCAST=False, DECODES=True, D_BLOCK_H=4, D_BLOCK_M=16, SPLITS=8, CHUNKS=True, C_QUERIES=64, C_BLOCK_H=4,
            C_BLOCK_M=256, ZERO_PADDING=True, ROPE=True, HALF=32, FP8=False, FP8_MAX=0.0, ROUND_BITS=0)
chunks = both | dict(HAS_WINDOW=True, DECODES=False, SPLITS=1, ZERO_PADDING=False, ROPE=False)
# FP8 pages (--kv-cache-dtype fp8 / fp8_e5m2): the same launch over float8 caches with the layer's scales.
fp8_pages = both | dict(FP8=True, FP8_MAX=448.0)
rope_kv_args = (pointers("bf16", "q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "cos_ptr", "sin_ptr")
                | pointers("i64", "pos_ptr", "write_ptr") | {"kv_scales": "*fp32"})
rope_kv_sizes = dict(Q_HEADS=32, KV_HEADS=8, HALF=32, BLOCK_T=4, BLOCK_HQ=32, BLOCK_HKV=8, BLOCK_HALF=32,
                     FP8=False, FP8_MAX=0.0, ROUND_BITS=0)
logits = {"logits": "*fp32", "tokens": "*i64", "passes": "*i32"}
edit_flags = dict(PENALTIES=True, BIAS=True, HOLD=True, NB=128, NS=16, NE=2, SEEN=64)
results = [
    build(sampler._params_kernel, "sampler: the draw's words", dict(GREEDY_BELOW=1e-5, DRAW=8),
          pointers("fp32", "temperature", "log_min_p", "top_p") | pointers("i64", "top_k", "seed", "step_index")
          | pointers("i32", "draw", "passes")),
    build(sampler._plan_kernel, "sampler: the filters' plan over chunks",
          dict(CHUNK=4096, CHUNKS=32, M=64, BINS=512, BLOCK=1024, PIVOTS=16, DRAW=8),
          {"logits": "*fp32", "stats": "*fp32"} | pointers("i32", "draw", "cand", "tickets", "passes")),
    build(sampler._draw_kernel, "sampler: the draw over chunks", dict(CHUNK=4096, DRAW=8),
          {"logits": "*fp32", "draw": "*i32", "best": "*i64"}),
    build(logprobs._logprobs_kernel, "logprobs: scored over chunks",
          dict(TOP=20, CELLS=64, CHUNK=4096, CHUNKS=32, M=64, BINS=512, BLOCK=1024, PIVOTS=16),
          logits | pointers("fp32", "logprob", "lse_out", "stats") | pointers("i64", "asked", "top_keys")
          | pointers("i32", "cand", "ids", "tickets")),
    # The step's sampling and its cache rows: the Triton kernel set's (the recorded step runs the CPU's).
    build(step_sampler._edit_kernel, "step sampler: the edits and the draw's words, every feature",
          edit_flags | dict(RANDOM=True, GREEDY_BELOW=1e-5, DRAW=8),
          pointers("fp32", "logits", "temperature", "top_p", "min_p", "repetition", "presence", "frequency", "bias",
                   "saved")
          | pointers("i64", "sample_slot", "sample_token", "token_pos", "top_k", "seed", "prompt_len", "min_tokens",
                     "seq_len", "stop_ids", "bias_ids", "eos_ids")
          | pointers("i32", "tokens", "counts", "passes", "draw") | {"ignore_eos": "*i1"},
          options={"enable_fp_fusion": False}),
    build(step_sampler._draw_finish_kernel, "step sampler: the draw over chunks, the token, the raw row",
          edit_flags | dict(CHUNK=4096, CHUNKS=32, DRAW=8),
          pointers("fp32", "logits", "repetition", "presence", "frequency", "bias", "saved")
          | pointers("i64", "sample_slot", "sample_token", "token_pos", "prompt_len", "min_tokens", "seq_len",
                     "stop_ids", "bias_ids", "eos_ids", "best", "out_token")
          | pointers("i32", "tokens", "draw", "tickets") | {"ignore_eos": "*i1"}),
    build(step_sampler._score_kernel, "step sampler: logprobs and prompt scores over chunks, the top sorted",
          dict(LOGPROBS=True, TOP=20, TOP_ROOM=32, CELLS=64, CHUNK=4096, CHUNKS=32, M=64, BINS=512, BLOCK=1024,
               PIVOTS=16),
          pointers("fp32", "logits", "stats", "out_logprob", "top_logprobs")
          | pointers("i64", "sample_slot", "asked", "out_token", "prompt_slot", "prompt_token", "top_ids", "top_keys")
          | pointers("i32", "cand", "ids", "tickets", "passes")),
    build(step_sampler._rows_kernel, "step sampler: the rows read", dict(BLOCK=256),
          pointers("i64", "sample_token", "token_slot", "token_pos", "num_computed", "scored", "entries", "rows_read",
                   "prompt_slot", "prompt_token", "first") | {"token_valid": "*i1", "tokens": "*i32"}),
    build(cache_rows._write_rows_kernel, "the cache rows", dict(BLOCK=256),
          pointers("i64", "token_slot", "token_pos", "table", "out") | {"token_valid": "*i1"}),
    build(attention._paged_attention_kernel, "attention: rope, cache write, split decodes, chunks, padding", both,
          attention_args),
    build(attention._paged_attention_kernel, "attention: prefill chunks, a window", chunks, attention_args),
    build(attention._paged_attention_kernel, "attention: FP8 E4M3 pages", fp8_pages,
          attention_args | pointers("fp8e4nv", "k_ptr", "v_ptr")),
    build(attention._paged_attention_kernel, "attention: FP8 E5M2 pages", fp8_pages | dict(FP8_MAX=57344.0),
          attention_args | pointers("fp8e5", "k_ptr", "v_ptr")),
    build(activation._silu_and_mul_kernel, "silu(gate) * up", dict(N=8192, BLOCK_R=1, BLOCK=4096),
          pointers("bf16", "x_ptr", "out_ptr")),
    build(rms_norm._rms_norm_kernel, "rms_norm with the residual add", dict(N=2048, BLOCK_R=2, BLOCK=2048, ADD=True),
          pointers("bf16", "x_ptr", "delta_ptr", "sum_ptr", "w_ptr", "out_ptr") | {"eps": "fp32"}),
    build(rope_kv._rope_and_cache_kernel, "rope and the cache write", rope_kv_sizes,
          rope_kv_args | pointers("bf16", "k_cache_ptr", "v_cache_ptr")),
    build(rope_kv._rope_and_cache_kernel, "rope and the cache write, FP8 pages", rope_kv_sizes | dict(FP8=True,
          FP8_MAX=448.0), rope_kv_args | pointers("fp8e4nv", "k_cache_ptr", "v_cache_ptr")),
    build(moe._expert_product_kernel, "experts: gated products",
          dict(N=768, K=2048, GATHER=True, GATED=True, BLOCK_M=moe.BLOCK_M, BLOCK_N=moe.BLOCK_N, BLOCK_K=moe.BLOCK_K,
               PRECISION="tf32", UPCAST=False),
          pointers("bf16", "x_ptr", "w_ptr", "out_ptr") | pointers("i64", "row_ptr", "expert_ptr")),
    # FP8 block-scaled products (engine/model/fp8.py): a decode's 16-row tile and a batch's 64x128 (Hopper's wgmma)
    *(build(fp8_linear._block_fp8_kernel, f"fp8 block product, {bm}x{bn} tiles",
            dict(K=4096, GROUP_N=128, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128),
            pointers("fp8e4nv", "x_ptr", "w_ptr") | pointers("fp32", "xs_ptr", "ws_ptr") | pointers("bf16", "out_ptr"))
      for bm, bn in ((16, 64), (64, 128))),
    *(build(fp8_linear._quantize_kernel, f"fp8 activations, groups of {group}{', static' * static}",
            dict(K=14336, GROUP=group, BLOCK=min(group, 4096), STATIC=static),
            pointers("bf16", "x_ptr") | pointers("fp8e4nv", "q_ptr") | pointers("fp32", "s_ptr", "static_ptr"))
      for group, static in ((14336, False), (128, False), (14336, True))),
    build(rotation._copy_pages_kernel, "KV rotation: page copies",
          dict(LAYERS=16, PAGE_ELEMENTS=16 * 8 * 64, PROGRAMS=rotation.PROGRAMS, BLOCK=rotation.BLOCK),
          pointers("bf16", "src_ptr", "dst_ptr") | pointers("i64", "src_ids_ptr", "dst_ids_ptr", "count_ptr")),
    # The drafts' proposal as the slo policy runs it (the recorded step's policy is fcfs): latency-sensitive slots;
    # looked up (ngram), and a draft model's (no lookup, no copy).
    *(build(draft._propose, f"drafts: the proposal, slo, {name}",
            dict(K=4, LOOKUP=lookup, LOOKUP_MAX=4, POLICY=draft.SLO.value, BLOCK_S=256, BLOCK_J=draft.HISTORY_BLOCK,
                 BLOCK_N=4),
            pointers("i64", "take", "seq_len", "computed", "max_tokens", "prompt_logprobs", "scored", "prompt_len",
                     "service_class", "room", "wanted_out", "start_out", "match_out")
            | pointers("fp32", "repetition", "presence", "frequency", "spec_rate") | pointers("i1", "live", "draft_off")
            | {"cost": "*fp64", "tokens": "*i32", "share_bits": "i64", "ratio_bits": "i64", "RETRY": "fp32",
               "MIN_RATE": "fp32"}, options={"enable_fp_fusion": False})
      for name, lookup in (("ngram", True), ("a draft model's", False))),
    build(draft._fit, "drafts: the fit, a draft model's", dict(COPY=False, BLOCK_S=256, BLOCK_K=4),
          pointers("i64", "order", "wanted", "start", "match", "take", "seq_len", "computed", "pages_held",
                   "num_free", "cap", "draft_len", "draft_n", "k_out") | {"tokens": "*i32"}),
    # Who maps which page: launched only when the pool runs short (the recorded step never does).
    *(build(kernel, f"page sharing: {kernel.__name__}", constexprs | dict(WIDTH=257, BLOCK=512),
            pointers("i64", "held", "table", "mark", "epoch", "position", "extremes", "counts")
            | {"kept": "*i1", "out": "*i1"})
      for kernel, constexprs in ((page_sharing._mark, {}), (page_sharing._frees, {}),
                                 (page_sharing._extreme, dict(LAST=True)), (page_sharing._extreme, dict(LAST=False)),
                                 (page_sharing._count, dict(REST=-1)),
                                 (page_sharing._count, dict(REST=page_sharing.AT_REST["amin"])))),
]


TYPES = {"uint8": "u8", "bool": "i1", "int32": "i32", "int64": "i64", "float32": "fp32", "float64": "fp64",
         "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8e4nv"}


def recorded_launches() -> list[dict]:
    """Every Triton launch of one device step on the CPU, recorded by a child process that runs the step with its
    kernels interpreted (tests/support/record_launches.py): a kernel added to the step is compiled here unnamed."""
    env = os.environ | {"TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "tests.support.record_launches"], env=env, capture_output=True,
                         text=True, check=True, timeout=600).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def value_of(described: dict):
    return tuple(value_of(d) for d in described["tuple"]) if "tuple" in described else described["value"]


def type_of(described: dict):
    """Triton's signature type of an argument as record_launches describes it (a tuple's, a tuple of types)."""
    if "tuple" in described:
        return tuple(type_of(d) for d in described["tuple"])
    if "tensor" in described:
        return "*" + TYPES[described["tensor"]]
    value = described["value"]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(1 << 31) <= value < (1 << 31) else "i64"
    return "fp32"


def signature_of(kernel, arguments: dict) -> tuple[dict, dict]:
    constexprs = {p.name: value_of(arguments[p.name]) for p in kernel.params if p.is_constexpr}
    signature = {name: "constexpr" if name in constexprs else type_of(d) for name, d in arguments.items()}
    return signature, constexprs


seen = set()
for launch in recorded_launches():
    kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
    signature, constexprs = signature_of(kernel, launch["arguments"])
    key = (launch["module"], launch["name"], json.dumps([signature, constexprs, launch["options"]], sort_keys=True))
    if key not in seen:
        seen.add(key)
        results.append(compile_one(kernel, f"the device step's {launch['module']}.{launch['name']}", signature,
                                   constexprs, launch["options"] or None))
sys.exit(0 if all(results) else 1)
