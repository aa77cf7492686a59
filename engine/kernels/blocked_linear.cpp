// The CPU's projections on AVX-512 over a weight laid out once in blocks of 64 outputs (blink.engine.model.linear
// calls them for every row count; blink.engine.kernels.cpu builds this file with cpu.cpp, under torch.ops.blink_cpu).
//
// out = x @ w.T + bias, with w [N, K] stored as [N/64][K/E][64][E] (linear.block), E the elements of a 32-bit word
// (2 bfloat16, 1 float32). One step of the k loop reads the 64 outputs' words as four vectors, broadcasts one word of
// each row of x, and accumulates a dot product of pairs (vdpbf16ps, AVX512-BF16) or an FMA (AVX512F): nothing is
// summed across lanes, and a block streams from memory in order. Up to 6 rows of x share every vector of the weight
// (24 accumulators); the k loop is cut into chunks of 1024 whose slice of the block stays in L2 while each group of 6
// rows goes over it. Each output sums its products in one order whatever the row count, so a row's result is the
// same alone or in a batch. Where the compiler targets a CPU without these instructions (-march=native), the dtype's
// blocked_linear_ready says false.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace blink_cpu {
// pool.cpp: at::parallel_for's sections on the kernels' own threads.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);

// A projection's bias as float32 for a kernel's epilogue (undefined without one), checked against its outputs. The
// AMX kernel (amx_linear.cpp, built into the same library) declares and calls it too.
at::Tensor projection_bias(const c10::optional<at::Tensor>& bias, int64_t outputs, const char* op) {
  if (!bias) return {};
  TORCH_CHECK(bias->numel() == outputs, "blink_cpu::", op, ": a bias per output");
  return bias->to(at::kFloat).contiguous();
}

}  // namespace blink_cpu

namespace {

constexpr int64_t BLOCK = 64;     // outputs of a block: four vectors of 16 float32 sums
constexpr int64_t ROWS = 6;       // rows of x per pass over a chunk: 6 x 4 accumulators of the 32 registers
constexpr int64_t CHUNK_K = 1024; // inputs per chunk (a 128 KiB slice of a bfloat16 block); 128, 256: slower

bool blocked_linear_ready(c10::ScalarType dtype) {
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return true;
#endif
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
  return false;
}

#if defined(__AVX512F__)
// acc[r] += x[r] . w over `steps` words, for R rows of x (their words `stride` apart); c holds the 64 sums of each
// row between chunks.
template <int R, bool BF16>
void rows_by_block(const uint32_t* x, int64_t stride, const __m512i* w, int64_t steps, float* c, bool first) {
  __m512 acc[R][4];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < 4; j++) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * BLOCK + j * 16);
  for (int64_t s = 0; s < steps; s++) {
    const __m512i w0 = w[4 * s], w1 = w[4 * s + 1], w2 = w[4 * s + 2], w3 = w[4 * s + 3];
    for (int r = 0; r < R; r++) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(x[r * stride + s]));
      if constexpr (BF16) {
#if defined(__AVX512BF16__)
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)a, (__m512bh)w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)a, (__m512bh)w1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], (__m512bh)a, (__m512bh)w2);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], (__m512bh)a, (__m512bh)w3);
#endif
      } else {
        const __m512 af = _mm512_castsi512_ps(a);
        acc[r][0] = _mm512_fmadd_ps(af, _mm512_castsi512_ps(w0), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(af, _mm512_castsi512_ps(w1), acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(af, _mm512_castsi512_ps(w2), acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(af, _mm512_castsi512_ps(w3), acc[r][3]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int j = 0; j < 4; j++) _mm512_storeu_ps(c + r * BLOCK + j * 16, acc[r][j]);
}

using Pass = void (*)(const uint32_t*, int64_t, const __m512i*, int64_t, float*, bool);

template <bool BF16>
constexpr Pass passes[ROWS + 1] = {nullptr, rows_by_block<1, BF16>, rows_by_block<2, BF16>, rows_by_block<3, BF16>,
                                   rows_by_block<4, BF16>, rows_by_block<5, BF16>, rows_by_block<6, BF16>};

template <bool BF16>
void blocked(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& out) {
  const int64_t M = x.size(0), N = out.size(1), words = w.size(1), chunk = CHUNK_K / (BF16 ? 2 : 1);
  const auto* xs = static_cast<const uint32_t*>(x.data_ptr());
  const auto* ws = static_cast<const __m512i*>(w.data_ptr());
  blink_cpu::parallel_for(0, N / BLOCK, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> sums(M * BLOCK);
    float* c = sums.data();
    for (int64_t b = lo; b < hi; b++) {
      const __m512i* block = ws + b * words * 4;
      for (int64_t s0 = 0; s0 < words; s0 += chunk) {
        const int64_t steps = std::min(chunk, words - s0);
        for (int64_t m0 = 0; m0 < M; m0 += ROWS)
          passes<BF16>[std::min(ROWS, M - m0)](xs + m0 * words + s0, words, block + s0 * 4, steps, c + m0 * BLOCK,
                                               s0 == 0);
      }
      for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < BLOCK; j += 16) {
          __m512 v = _mm512_loadu_ps(c + m * BLOCK + j);
          if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + b * BLOCK + j));
          const int64_t at = m * N + b * BLOCK + j;
          if constexpr (BF16) {
#if defined(__AVX512BF16__)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.data_ptr<at::BFloat16>() + at),
                                (__m256i)_mm512_cvtneps_pbh(v));  // to nearest even, as torch rounds
#endif
          } else {
            _mm512_storeu_ps(out.data_ptr<float>() + at, v);
          }
        }
    }
  });
}
#endif

at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const auto dtype = w.scalar_type();
  TORCH_CHECK(blocked_linear_ready(dtype), "blink_cpu::blocked_linear: this CPU (or this build) has no AVX-512 "
              "products for ", dtype);
  const int64_t words_per = dtype == at::kBFloat16 ? 2 : 1;
  TORCH_CHECK(w.dim() == 4 && w.size(2) == BLOCK && w.size(3) == words_per && w.is_contiguous(),
              "blink_cpu::blocked_linear: a weight laid out by linear.block, got ", w.sizes());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype && x.size(1) == w.size(1) * words_per,
              "blink_cpu::blocked_linear: x [M, K] in the weight's dtype, K = ", w.size(1) * words_per);
  const int64_t N = w.size(0) * BLOCK;
  const at::Tensor bias32 = blink_cpu::projection_bias(bias, N, "blocked_linear");
  auto out = at::empty({x.size(0), N}, x.options());
#if defined(__AVX512F__)
  if (x.size(0) > 0) {
    const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
    if (dtype == at::kBFloat16) blocked<true>(x.contiguous(), w, b, out);
    else blocked<false>(x.contiguous(), w, b, out);
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blink_cpu, m) {
  m.def("blocked_linear_ready(ScalarType dtype) -> bool", &blocked_linear_ready);
  m.def("blocked_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor", &blocked_linear);
}
