// The CPU's fused kernels (blink.engine.kernels.cpu builds this file once per machine and registers the ops under
// torch.ops.blink_cpu). Each replaces a chain of small torch ops in the forward, which on the CPU costs the
// dispatcher a few microseconds per op whatever the op's size: an RMSNorm was 9 ops, a layer's attention about 30.
// Numerics follow the torch reference (blink.engine.model.kernel_sets.TorchKernels): elementwise work rounds to the
// model's dtype where the reference's ops do, reductions and attention run in float32. One file (over 400 lines):
// its kernels share the dtype helpers below, and torch's JIT build would not see a change to a header.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace blink_cpu {
// pool.cpp: at::parallel_for's sections on the kernels' own threads.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);
}  // namespace blink_cpu

namespace {

// The model's dtype to float and back; float32 passes through, bfloat16 rounds to nearest even as torch does
// (c10::BFloat16's own conversions, written on the bits so that loops over them vectorize).
inline float load(float v) { return v; }
inline float load(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
template <typename T>
inline T store(float v);
template <>
inline float store<float>(float v) { return v; }
template <>
inline c10::BFloat16 store<c10::BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(v != v ? 0x7fc0u : rounded), c10::BFloat16::from_bits());
}
// What a torch op on T tensors returns: the float result rounded to T.
template <typename T>
inline float round_to(float v) { return load(store<T>(v)); }

template <typename F>
void for_dtype(const at::Tensor& t, const char* op, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(float{});
  } else if (t.scalar_type() == at::kBFloat16) {
    f(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, "blink_cpu::", op, ": float32 or bfloat16, got ", t.scalar_type());
  }
}

// weight * (x * rsqrt(mean(x^2) + eps)).to(T) over rows of `n`, as transformers' LlamaRMSNorm.
template <typename T>
void norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t n, double eps, int64_t ld_x, int64_t ld_out) {
  blink_cpu::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; r++) {
      const T* xr = x + r * ld_x;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < n; i++) squares += load(xr[i]) * load(xr[i]);
      const float inv = 1.f / std::sqrt(squares / n + static_cast<float>(eps));
      T* o = out + r * ld_out;
#pragma omp simd
      for (int64_t i = 0; i < n; i++) o[i] = store<T>(load(weight[i]) * round_to<T>(load(xr[i]) * inv));
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1 && weight.is_contiguous() && weight.numel() == x.size(-1),
              "blink_cpu: rows with a contiguous last dimension and a weight of that size");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "blink_cpu: x and weight in one dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  const at::Tensor rows = x.reshape({-1, x.size(-1)});  // a view for the projections' outputs
  auto out = at::empty(x.sizes(), x.options());
  for_dtype(x, "rms_norm", [&](auto t) {
    using T = decltype(t);
    norm_rows<T>(rows.data_ptr<T>(), weight.data_ptr<T>(), out.data_ptr<T>(), rows.size(0), rows.size(1), eps,
                 rows.stride(0), rows.size(1));
  });
  return out;
}

// (x + delta, rms_norm(x + delta)): the residual stream and the next sublayer's input, in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  check_rows(x, weight);
  TORCH_CHECK(x.is_contiguous() && delta.is_contiguous() && x.sizes() == delta.sizes() &&
                  x.scalar_type() == delta.scalar_type(),
              "blink_cpu::add_rms_norm: contiguous x and delta of one shape and dtype");
  auto sum = at::empty_like(x), out = at::empty_like(x);
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  for_dtype(x, "add_rms_norm", [&](auto t) {
    using T = decltype(t);
    const T *a = x.data_ptr<T>(), *b = delta.data_ptr<T>();
    T* s = sum.data_ptr<T>();
    blink_cpu::parallel_for(0, rows * n, 4096, [&](int64_t lo, int64_t hi) {
#pragma omp simd
      for (int64_t i = lo; i < hi; i++) s[i] = store<T>(load(a[i]) + load(b[i]));
    });
    norm_rows<T>(s, weight.data_ptr<T>(), out.data_ptr<T>(), rows, n, eps, n, n);
  });
  return {sum, out};
}

// x * cos + roll(x, D/2) * signed_sin over one head, rounded as the reference's three ops round.
template <typename T>
inline void rotate(const T* x, const T* cos, const T* signed_sin, T* out, int64_t D) {
  const int64_t half = D / 2;
#pragma omp simd
  for (int64_t d = 0; d < half; d++)
    out[d] = store<T>(round_to<T>(load(x[d]) * load(cos[d])) + round_to<T>(load(x[d + half]) * load(signed_sin[d])));
#pragma omp simd
  for (int64_t d = half; d < D; d++)
    out[d] = store<T>(round_to<T>(load(x[d]) * load(cos[d])) + round_to<T>(load(x[d - half]) * load(signed_sin[d])));
}

// Rotates q and k, writes the rotated k and v to their cache rows, and returns the rotated q. q: [B, Hq, D], k, v:
// [B, Hkv, D] (views of the fused projection: the last dimension contiguous); cos, signed_sin: [B, 1, D]
// (blink.engine.model.rope.step_rope); write_rows: [B] flat cache rows; caches: [pages, page_size, Hkv, D].
at::Tensor rope_and_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                          const at::Tensor& signed_sin, const at::Tensor& write_rows, at::Tensor& k_cache,
                          at::Tensor& v_cache) {
  const int64_t B = q.size(0), Hq = q.size(1), Hkv = k.size(1), D = q.size(2);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && D % 2 == 0,
              "blink_cpu::rope_and_cache: q, k, v with a contiguous, even last dimension");
  TORCH_CHECK(cos.is_contiguous() && signed_sin.is_contiguous() && cos.numel() == B * D &&
                  signed_sin.numel() == B * D,
              "blink_cpu::rope_and_cache: cos and sin tables of [B, 1, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(2) == Hkv && k_cache.size(3) == D &&
                  write_rows.scalar_type() == at::kLong && write_rows.is_contiguous() && write_rows.numel() == B,
              "blink_cpu::rope_and_cache: contiguous caches of [pages, page_size, Hkv, D] and int64 rows");
  const int64_t cache_rows = k_cache.size(0) * k_cache.size(1);
  const int64_t* rows = write_rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++)
    TORCH_CHECK(rows[b] >= 0 && rows[b] < cache_rows, "blink_cpu::rope_and_cache: cache row out of range");
  auto q_out = at::empty({B, Hq, D}, q.options());
  for_dtype(q, "rope_and_cache", [&](auto t) {
    using T = decltype(t);
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
    const T *cp = cos.data_ptr<T>(), *sp = signed_sin.data_ptr<T>();
    T *qo = q_out.data_ptr<T>(), *kc = k_cache.data_ptr<T>(), *vc = v_cache.data_ptr<T>();
    blink_cpu::parallel_for(0, B, 4, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; b++) {
        const T *c = cp + b * D, *sn = sp + b * D;
        for (int64_t h = 0; h < Hq; h++) rotate(qp + b * q.stride(0) + h * q.stride(1), c, sn, qo + (b * Hq + h) * D, D);
        T *kr = kc + rows[b] * Hkv * D, *vr = vc + rows[b] * Hkv * D;
        for (int64_t h = 0; h < Hkv; h++) {
          rotate(kp + b * k.stride(0) + h * k.stride(1), c, sn, kr + h * D, D);
          std::copy_n(vp + b * v.stride(0) + h * v.stride(1), D, vr + h * D);
        }
      }
    });
  });
  return q_out;
}

// e^x for x <= 0 (softmax's shifted scores) to about 2 ulp, in a form loops vectorize: 2^(x log2 e) split into an
// integer power, put in the exponent bits, and a degree-6 polynomial of the fraction.
inline float exp_nonpositive(float x) {
  const float t = std::max(x * 1.44269504088896341f, -126.f);
  const float whole = std::floor(t), f = t - whole;  // f in [0, 1)
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(whole) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

constexpr int64_t kMaxHeadDim = BLINK_MAX_HEAD_DIM;  // blink.engine.kernels.cpu.MAX_HEAD_DIM

// A sequence's keys (and values) from `first` on, page by page: where each key's head h starts in the caches.
struct Keys {
  const int64_t* page_of;  // the sequence's block-table row
  int64_t page_size, per_token, head;  // cache rows per page, elements per cache row, the head's first element
  int64_t first, page = 0, in_page = 0;
  Keys(const int64_t* page_of, int64_t page_size, int64_t per_token, int64_t head, int64_t first)
      : page_of(page_of), page_size(page_size), per_token(per_token), head(head), first(first) { rewind(); }
  void rewind() { page = first / page_size, in_page = first % page_size; }
  int64_t offset() const { return (page_of[page] * page_size + in_page) * per_token + head; }
  void next() {
    if (++in_page == page_size) in_page = 0, page++;
  }
};

#if defined(__AVX512F__)
// 16 keys' or values' elements as float32 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// exp_nonpositive on 16 lanes: the same operations in the same order, so a lane equals the scalar's result.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-126.f));
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, whole);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  for (const float c : {1.339887440266574e-3f, 9.618437357674640e-3f, 5.550332471162809e-2f, 2.402264791363012e-1f,
                        6.931472028550421e-1f, 1.0f})
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(whole), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// Each of G rows of n scores to e^(s - max), in place, and its sum to total[g].
inline void softmax_rows(float* scores, int64_t G, int64_t n, float* total) {
  for (int64_t g = 0; g < G; g++) {
    float* sg = scores + g * n;
    const int64_t whole = n / 16 * 16;
    float top = -INFINITY;
    if (whole) {
      __m512 m = _mm512_loadu_ps(sg);
      for (int64_t j = 16; j < whole; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sg + j));
      top = _mm512_reduce_max_ps(m);
    }
    for (int64_t j = whole; j < n; j++) top = std::max(top, sg[j]);
    __m512 sum16 = _mm512_setzero_ps();
    for (int64_t j = 0; j < whole; j += 16) {
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(sg + j), _mm512_set1_ps(top)));
      _mm512_storeu_ps(sg + j, e);
      sum16 = _mm512_add_ps(sum16, e);
    }
    float sum = _mm512_reduce_add_ps(sum16);
    for (int64_t j = whole; j < n; j++) {
      sg[j] = exp_nonpositive(sg[j] - top);
      sum += sg[j];
    }
    total[g] = sum;
  }
}

// One row and key-value head of decode_attention for a head_dim of 16 C, on AVX-512: each key's G dot products as
// vectors over the head's dimensions, the softmax 16 keys at a time, and the values added into outputs held in
// registers, up to 16 vectors of them per pass over the values (added through memory, each key's sum waited on the
// store of the one before: the values' pass ran at a third of the keys' speed). query: [G, D] float32; scores:
// [G, n]; total: [G].
template <int C, typename T>
void attend_avx512(const float* query, int64_t G, const T* kc, const T* vc, Keys keys, int64_t n, float scale,
                   float* scores, float* total, T* o) {
  constexpr int64_t D = 16 * C, GB = C >= 16 ? 1 : 16 / C;  // query heads per pass over the values
  for (int64_t j = 0; j < n; j++, keys.next()) {
    const T* key = kc + keys.offset();
    __m512 k[C];
    for (int c = 0; c < C; c++) k[c] = load16(key + 16 * c);
    for (int64_t g = 0; g < G; g++) {
      const float* qg = query + g * D;
      __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
      for (int c = 1; c < C; c++) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), k[c], dot);
      scores[g * n + j] = _mm512_reduce_add_ps(dot) * scale;
    }
  }
  softmax_rows(scores, G, n, total);
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const int64_t heads = std::min(GB, G - g0);
    __m512 acc[GB][C];
    for (int64_t g = 0; g < GB; g++)
      for (int c = 0; c < C; c++) acc[g][c] = _mm512_setzero_ps();
    keys.rewind();
    for (int64_t j = 0; j < n; j++, keys.next()) {
      const T* value = vc + keys.offset();
      __m512 v[C];
      for (int c = 0; c < C; c++) v[c] = load16(value + 16 * c);
      for (int64_t g = 0; g < GB; g++) {
        if (g == heads) break;
        const __m512 p = _mm512_set1_ps(scores[(g0 + g) * n + j]);
        for (int c = 0; c < C; c++) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
      }
    }
    for (int64_t g = 0; g < heads; g++) {
      alignas(64) float sums[D];
      for (int c = 0; c < C; c++) _mm512_store_ps(sums + 16 * c, acc[g][c]);
      for (int64_t d = 0; d < D; d++) o[(g0 + g) * D + d] = store<T>(sums[d] / total[g0 + g]);
    }
  }
}
#endif

#if defined(__AVX512BF16__)
// The lane sums of 16 vectors as one vector, v[j]'s in lane j: a tree of unpacks and 128-bit shuffles, 45 operations
// where 16 horizontal sums take about 130.
inline __m512 sum_lanes16(const __m512 v[16]) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; i++)  // lane L of 128 bits: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++) {  // lane L: the 4 keys' sums over lane L
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; i++)  // [quad a over lanes 0-1, a over 2-3, b over 0-1, b over 2-3]
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// attend_avx512 for bfloat16 caches on AVX512-BF16, 1.15-1.25x as fast: a bfloat16 query and key are multiplied as
// they are stored, pairs of products summed in float32 (vdpbf16ps: exact products, the float reference's values to
// rounding; inputs below 2^-126 count as 0), 16 keys' dot products summed across lanes at once (sum_lanes16); a
// value's 32 elements widened by a shift and a mask, its even and odd elements summed apart.
template <int C>
void attend_bf16(const c10::BFloat16* query, int64_t G, const c10::BFloat16* kc, const c10::BFloat16* vc, Keys keys,
                 int64_t n, float scale, float* scores, float* total, c10::BFloat16* o) {
  constexpr int64_t D = 16 * C, W = C / 2, GB = C >= 16 ? 1 : 16 / C;  // W: vectors of 32 elements a head
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    const c10::BFloat16* key[16];
    for (int64_t j = 0; j < m; j++, keys.next()) key[j] = kc + keys.offset();
    for (int64_t g = 0; g < G; g++) {
      __m512bh q[W];
      for (int w = 0; w < W; w++) q[w] = (__m512bh)_mm512_loadu_si512(query + g * D + 32 * w);
      __m512 dots[16];
      for (int64_t j = 0; j < 16; j++) {
        dots[j] = _mm512_setzero_ps();
        if (j < m)
          for (int w = 0; w < W; w++)
            dots[j] = _mm512_dpbf16_ps(dots[j], (__m512bh)_mm512_loadu_si512(key[j] + 32 * w), q[w]);
      }
      _mm512_mask_storeu_ps(scores + g * n + j0, static_cast<__mmask16>((1u << m) - 1),
                            _mm512_mul_ps(sum_lanes16(dots), _mm512_set1_ps(scale)));
    }
  }
  softmax_rows(scores, G, n, total);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const int64_t heads = std::min(GB, G - g0);
    __m512 even[GB][W], odd[GB][W];
    for (int64_t g = 0; g < GB; g++)
      for (int w = 0; w < W; w++) even[g][w] = odd[g][w] = _mm512_setzero_ps();
    keys.rewind();
    for (int64_t j = 0; j < n; j++, keys.next()) {
      const c10::BFloat16* value = vc + keys.offset();
      __m512 lo[W], hi[W];
      for (int w = 0; w < W; w++) {
        const __m512i bits = _mm512_loadu_si512(value + 32 * w);
        lo[w] = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
        hi[w] = _mm512_castsi512_ps(_mm512_and_si512(bits, high));
      }
      for (int64_t g = 0; g < GB; g++) {
        if (g == heads) break;
        const __m512 p = _mm512_set1_ps(scores[(g0 + g) * n + j]);
        for (int w = 0; w < W; w++) {
          even[g][w] = _mm512_fmadd_ps(p, lo[w], even[g][w]);
          odd[g][w] = _mm512_fmadd_ps(p, hi[w], odd[g][w]);
        }
      }
    }
    for (int64_t g = 0; g < heads; g++) {
      alignas(64) float e[16], d[16];
      const float sum = total[g0 + g];
      for (int w = 0; w < W; w++) {
        _mm512_store_ps(e, even[g][w]);
        _mm512_store_ps(d, odd[g][w]);
        c10::BFloat16* out = o + (g0 + g) * D + 32 * w;
        for (int i = 0; i < 16; i++) {
          out[2 * i] = store<c10::BFloat16>(e[i] / sum);
          out[2 * i + 1] = store<c10::BFloat16>(d[i] / sum);
        }
      }
    }
  }
}
#endif

// One-query rows straight from the cache pages, in float32 (the reference upcasts its decodes too): for each row
// r < count (a scalar tensor: the plan's), the token at `token[r]` attends to its sequence's keys up to
// `position[r]` (the last `window` of them when window > 0) and its result is written to out[token[r]]. Row and
// key-value-head pairs run in parallel; a pair's query heads share each key and value as it is read.
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_table, const at::Tensor& slot, const at::Tensor& token,
                      const at::Tensor& position, const at::Tensor& count, double scale, int64_t window,
                      at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(D <= kMaxHeadDim, "blink_cpu::decode_attention: head_dim up to ", kMaxHeadDim, ", got ", D);
  const int64_t cache_pages = k_cache.size(0), page_size = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && out.size(0) >= B && out.size(1) == Hq && out.size(2) == D &&
                  out.scalar_type() == q.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(3) == D && Hq % Hkv == 0,
              "blink_cpu::decode_attention: contiguous q of [B, Hq, D] and out of [B or more, Hq, D], caches of "
              "[pages, page_size, Hkv, D]");
  const at::Tensor table = block_table.to(at::kLong).contiguous(), slots = slot.to(at::kLong).contiguous();
  const at::Tensor tokens = token.to(at::kLong).contiguous(), positions = position.to(at::kLong).contiguous();
  const int64_t rows = std::min<int64_t>(count.item<int64_t>(), slots.numel()), G = Hq / Hkv;
  const int64_t pages = table.size(1);
  const int64_t *table_p = table.data_ptr<int64_t>(), *slot_p = slots.data_ptr<int64_t>();
  const int64_t *token_p = tokens.data_ptr<int64_t>(), *pos_p = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; r++) {  // every index the rows read, checked before any is
    TORCH_CHECK(token_p[r] >= 0 && token_p[r] < B && pos_p[r] >= 0 && pos_p[r] < pages * page_size &&
                    slot_p[r] >= 0 && slot_p[r] < table.size(0),
                "blink_cpu::decode_attention: a row's token, position or slot out of range");
    for (int64_t i = 0; i <= pos_p[r] / page_size; i++) {
      const int64_t page = table_p[slot_p[r] * pages + i];
      TORCH_CHECK(page >= 0 && page < cache_pages, "blink_cpu::decode_attention: a page out of range");
    }
  }
  const float softmax_scale = static_cast<float>(scale);
  for_dtype(q, "decode_attention", [&](auto t) {
    using T = decltype(t);
    const T *qp = q.data_ptr<T>(), *kc = k_cache.data_ptr<T>(), *vc = v_cache.data_ptr<T>();
    T* op = out.data_ptr<T>();
    blink_cpu::parallel_for(0, rows * Hkv, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> query(G * D), acc(G * D), scores, total(G);
      alignas(64) float row[kMaxHeadDim];  // on the stack, aliasing nothing; kept small (cpu.py says why)
      for (int64_t task = lo; task < hi; task++) {
        // Rows from both ends in turn: a prefill chunk's rows attend to ever more keys, and each thread takes a
        // contiguous run of tasks, so a run in row order would give the last thread the longest rows.
        const int64_t i = task / Hkv, r = i % 2 == 0 ? i / 2 : rows - 1 - i / 2;
        const int64_t h = task % Hkv, b = token_p[r], pos = pos_p[r];
        const int64_t* page_of = table_p + slot_p[r] * pages;
        const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0, n = pos + 1 - first;
        Keys keys(page_of, page_size, Hkv * D, h * D, first);
        const T* qh = qp + (b * Hq + h * G) * D;
        scores.resize(G * n);
        T* o = op + (b * Hq + h * G) * D;
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (D == 64 || D == 128 || D == 256) {
            float *s = scores.data(), *sums = total.data();
            if (D == 64) attend_bf16<4>(qh, G, kc, vc, keys, n, softmax_scale, s, sums, o);
            if (D == 128) attend_bf16<8>(qh, G, kc, vc, keys, n, softmax_scale, s, sums, o);
            if (D == 256) attend_bf16<16>(qh, G, kc, vc, keys, n, softmax_scale, s, sums, o);
            continue;
          }
        }
#endif
        for (int64_t i = 0; i < G * D; i++) query[i] = load(qh[i]);
#if defined(__AVX512F__)
        if (D == 64 || D == 128 || D == 256) {  // the head sizes of most models; the loops below take any other
          float *s = scores.data(), *sums = total.data();
          if (D == 64) attend_avx512<4>(query.data(), G, kc, vc, keys, n, softmax_scale, s, sums, o);
          if (D == 128) attend_avx512<8>(query.data(), G, kc, vc, keys, n, softmax_scale, s, sums, o);
          if (D == 256) attend_avx512<16>(query.data(), G, kc, vc, keys, n, softmax_scale, s, sums, o);
          continue;
        }
#endif
        // Each key and value is converted once into `row`, which the query heads then share: read through the
        // cache's pointer per head, the loops ran 2.5x slower at 512 keys.
        for (int64_t j = 0; j < n; j++, keys.next()) {
          const T* key = kc + keys.offset();
#pragma omp simd
          for (int64_t d = 0; d < D; d++) row[d] = load(key[d]);
          for (int64_t g = 0; g < G; g++) {
            const float* qg = query.data() + g * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) dot += qg[d] * row[d];
            scores[g * n + j] = dot * softmax_scale;
          }
        }
        for (int64_t g = 0; g < G; g++) {
          float* sg = scores.data() + g * n;
          const float top = *std::max_element(sg, sg + n);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < n; j++) {
            sg[j] = exp_nonpositive(sg[j] - top);
            sum += sg[j];
          }
          total[g] = sum;
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        keys.rewind();
        for (int64_t j = 0; j < n; j++, keys.next()) {
          const T* value = vc + keys.offset();
#pragma omp simd
          for (int64_t d = 0; d < D; d++) row[d] = load(value[d]);
          for (int64_t g = 0; g < G; g++) {
            const float p = scores[g * n + j];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) ag[d] += p * row[d];
          }
        }
        for (int64_t g = 0; g < G; g++)
#pragma omp simd
          for (int64_t d = 0; d < D; d++) o[g * D + d] = store<T>(acc[g * D + d] / total[g]);
      }
    });
  });
}

// A step of decode rows only, from the fused projection's output to the attention's: qkv [B, (Hq + 2 Hkv) * D]
// split into heads, q and k rotated, k and v written to the cache, and each row attended. Rows no decode row covers
// (a bucket's padding) stay zero, as the reference leaves them. The same kernels as the separate ops, in one call:
// at batch 1 each op from Python costs more than its work.
at::Tensor decode_step_attention(const at::Tensor& qkv, int64_t Hq, int64_t Hkv, const at::Tensor& cos,
                                 const at::Tensor& signed_sin, const at::Tensor& write_rows, at::Tensor& k_cache,
                                 at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& slot,
                                 const at::Tensor& token, const at::Tensor& position, const at::Tensor& count,
                                 double scale, int64_t window) {
  const int64_t B = qkv.size(0), D = k_cache.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (Hq + 2 * Hkv) * D,
              "blink_cpu::decode_step_attention: qkv of [B, (Hq + 2 Hkv) * head_dim]");
  const at::Tensor heads = qkv.view({B, Hq + 2 * Hkv, D});
  const at::Tensor q = rope_and_cache(heads.narrow(1, 0, Hq), heads.narrow(1, Hq, Hkv), heads.narrow(1, Hq + Hkv, Hkv),
                                      cos, signed_sin, write_rows, k_cache, v_cache);
  auto out = at::zeros({B, Hq, D}, q.options());
  decode_attention(q, k_cache, v_cache, block_table, slot, token, position, count, scale, window, out);
  return out;
}

// silu(gate) * up over rows of [gate | up] (the fused projection's output), by torch's own two ops: one call.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  const int64_t n = gate_up.size(-1) / 2;
  return at::silu(gate_up.narrow(-1, 0, n)).mul_(gate_up.narrow(-1, n, n));
}

}  // namespace

TORCH_LIBRARY(blink_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)", &add_rms_norm);
  m.def("rope_and_cache(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor signed_sin, Tensor write_rows, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache) -> Tensor",
        &rope_and_cache);
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor slot, Tensor token, "
        "Tensor position, Tensor count, float scale, int window, Tensor(a!) out) -> ()",
        &decode_attention);
  m.def("decode_step_attention(Tensor qkv, int Hq, int Hkv, Tensor cos, Tensor signed_sin, Tensor write_rows, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_table, Tensor slot, Tensor token, Tensor position, "
        "Tensor count, float scale, int window) -> Tensor",
        &decode_step_attention);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &silu_and_mul);
}
