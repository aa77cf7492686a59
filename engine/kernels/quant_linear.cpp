// The CPU's projections over 8- and 4-bit weights on AVX-512 VNNI (blink.engine.model.quant lays the weights out and
// calls them; blink.engine.kernels.cpu builds this file with the others, under torch.ops.blink_cpu).
//
// A weight is codes q (unsigned, 8 or 4 bits) with w = d * q + b, d and b per output and group of 32 inputs (GGUF's
// Q8_0, Q4_0, Q4_1 and Q4_K all take this form, b folding in their zero point or min), or per output ("channel":
// --quantization int8). Each row of x is quantized on the fly to int8 per group of 32 (dx, its amax / 127, as
// llama.cpp's Q8_0 dot quantizes activations), so a group's dot product is integer: I = sum q * xq by vpdpbusd
// (unsigned codes times signed activations, 4 products a lane), and sum w * x = dx * (d * I + b * S), S = sum xq.
// Blocked like blocked_linear.cpp: 64 outputs a block, a step reads their 4 codes of 4 inputs as four vectors and
// broadcasts one 32-bit word of each row's xq; 8-bit codes are [N/64][K/4][64][4] bytes, 4-bit codes hold two steps
// a byte ([N/64][K/8][64][4], the low nibble the even step). Grouped d and b are float16 [N/64][K/32][64]; channel d
// and b float32 [N].
// GGUF's Q6_K ("6 bits") is w = D * s * (q - 32), q 0..63 laid out as 8-bit codes, s an int8 scale per 16 inputs
// (d: int8 [N/64][K/16][64]) and D a float per 256 (b: float32 [N/64][K/256][64]): each half group's integer dot
// I - 32 * S is multiplied by its s in integers (|s * (I - 32 * S)| < 2^23: exact), then by D * dx in floats.
// Without VNNI in the compiler's target, quant_linear_ready says false (the torch reference runs).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace blink_cpu {
// pool.cpp: at::parallel_for's sections on the kernels' own threads.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);
at::Tensor projection_bias(const c10::optional<at::Tensor>& bias, int64_t outputs, const char* op);
}

namespace {

constexpr int64_t BLOCK = 64;      // outputs of a block
constexpr int64_t GROUP = 32;      // inputs of a group: one activation scale (and one weight scale, grouped)
constexpr int64_t ROWS = 3;        // rows of x per pass: 3 x 4 integer and 3 x 4 float accumulators
constexpr int64_t CHUNK_G = 32;    // groups per chunk (1024 inputs), as blocked_linear.cpp's k chunks
constexpr int64_t SUB = 16;        // 6 bits: inputs of an int8 sub-block scale
constexpr int64_t SUPER = 256;     // 6 bits: inputs of a super-block's float scale

bool quant_linear_ready() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {  // bfloat16: the high half of a float32
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// xq: int8 per group of 32 (round to nearest even of x * 127 / amax); dx = amax / 127; xs = dx * sum of the group's xq;
// hs (6 bits only, else null): the integer sum of each half group's xq.
template <typename T>
void quantize_row(const T* x, int64_t K, int8_t* xq, float* dx, float* xs, int32_t* hs) {
  for (int64_t g = 0; g < K / GROUP; g++) {
    const __m512 a = load16(x + g * GROUP), b = load16(x + g * GROUP + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512i ia = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
    const __m512i ib = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * GROUP), _mm512_cvtepi32_epi8(ia));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * GROUP + 16), _mm512_cvtepi32_epi8(ib));
    const float d = amax / 127.0f;
    dx[g] = d;
    xs[g] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib)));
    if (hs) {
      hs[2 * g] = _mm512_reduce_add_epi32(ia);
      hs[2 * g + 1] = _mm512_reduce_add_epi32(ib);
    }
  }
}

// The four vectors of codes of step s of a group (64 outputs x 4 inputs); 4-bit: step pairs share bytes.
template <int BITS>
inline void step_codes(const uint8_t* group, int s, __m512i w[4]) {
  if constexpr (BITS == 8) {
    for (int j = 0; j < 4; j++) w[j] = _mm512_loadu_si512(group + s * 256 + j * 64);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
      const __m512i v = _mm512_loadu_si512(group + (s / 2) * 256 + j * 64);
      w[j] = _mm512_and_si512(s % 2 ? _mm512_srli_epi16(v, 4) : v, low);
    }
  }
}

struct Rows {  // R rows of x, quantized: their codes, scales and sums, from group g0 on
  const int8_t* xq;
  const float* dx;
  const float* xs;
  const int32_t* hs;  // half-group sums (6 bits), 2 * groups a row
  int64_t K, groups;  // row strides: K bytes of xq, K / 32 scales
};

// c[r] (64 sums a row) += the products of `count` groups from g0, for R rows. Grouped: d, b float16 per group;
// channel: the sum of dx * I only (d and b are applied once, at the end).
template <int R, int BITS, bool GROUPED>
void pass(const Rows& x, int64_t g0, int64_t count, const uint8_t* codes, const uint16_t* d, const uint16_t* b,
          float* c, bool first) {
  constexpr int64_t GROUP_BYTES = GROUP * BLOCK * BITS / 8;
  __m512 acc[R][4];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < 4; j++) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * BLOCK + j * 16);
  for (int64_t g = g0; g < g0 + count; g++) {
    const uint8_t* group = codes + g * GROUP_BYTES;
    __m512i dot[R][4];
    for (int r = 0; r < R; r++)
      for (int j = 0; j < 4; j++) dot[r][j] = _mm512_setzero_si512();
    for (int s = 0; s < GROUP / 4; s++) {
      __m512i w[4];
      step_codes<BITS>(group, s, w);
      for (int r = 0; r < R; r++) {
        int32_t word;
        std::memcpy(&word, x.xq + r * x.K + g * GROUP + s * 4, 4);
        const __m512i a = _mm512_set1_epi32(word);
        for (int j = 0; j < 4; j++) dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], w[j], a);
      }
    }
    for (int j = 0; j < 4; j++) {
      if constexpr (GROUPED) {
        const __m512 dj = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * BLOCK + j * 16)));
        const __m512 bj = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + g * BLOCK + j * 16)));
        for (int r = 0; r < R; r++) {
          const __m512 scale = _mm512_mul_ps(dj, _mm512_set1_ps(x.dx[r * x.groups + g]));
          acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][j]), scale, acc[r][j]);
          acc[r][j] = _mm512_fmadd_ps(bj, _mm512_set1_ps(x.xs[r * x.groups + g]), acc[r][j]);
        }
      } else {
        for (int r = 0; r < R; r++)
          acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][j]), _mm512_set1_ps(x.dx[r * x.groups + g]),
                                      acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int j = 0; j < 4; j++) _mm512_storeu_ps(c + r * BLOCK + j * 16, acc[r][j]);
}

// 6 bits: as `pass` with 8-bit codes, each half group's dot taken apart: c[r] += D * dx * s * (I - 32 * S), s the
// int8 scales of the block's sub-blocks (sub), D its super-blocks' floats (super).
template <int R>
void pass6(const Rows& x, int64_t g0, int64_t count, const uint8_t* codes, const int8_t* sub, const float* super,
           float* c, bool first) {
  constexpr int64_t GROUP_BYTES = GROUP * BLOCK;
  __m512 acc[R][4];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < 4; j++) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * BLOCK + j * 16);
  for (int64_t g = g0; g < g0 + count; g++) {
    const uint8_t* group = codes + g * GROUP_BYTES;
    const float* dg = super + (g * GROUP / SUPER) * BLOCK;
    for (int h = 0; h < 2; h++) {
      __m512i dot[R][4];
      for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) dot[r][j] = _mm512_setzero_si512();
      for (int s = h * 4; s < h * 4 + 4; s++) {
        __m512i w[4];
        step_codes<8>(group, s, w);
        for (int r = 0; r < R; r++) {
          int32_t word;
          std::memcpy(&word, x.xq + r * x.K + g * GROUP + s * 4, 4);
          const __m512i a = _mm512_set1_epi32(word);
          for (int j = 0; j < 4; j++) dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], w[j], a);
        }
      }
      const int8_t* sh = sub + (2 * g + h) * BLOCK;
      for (int j = 0; j < 4; j++) {
        const __m512i sj = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sh + j * 16)));
        const __m512 dj = _mm512_loadu_ps(dg + j * 16);
        for (int r = 0; r < R; r++) {
          const int32_t half_sum = x.hs[r * 2 * x.groups + 2 * g + h];
          const __m512i centred = _mm512_sub_epi32(dot[r][j], _mm512_set1_epi32(32 * half_sum));
          const __m512 scale = _mm512_mul_ps(dj, _mm512_set1_ps(x.dx[r * x.groups + g]));
          acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(sj, centred)), scale, acc[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int j = 0; j < 4; j++) _mm512_storeu_ps(c + r * BLOCK + j * 16, acc[r][j]);
}

using Pass = void (*)(const Rows&, int64_t, int64_t, const uint8_t*, const uint16_t*, const uint16_t*, float*, bool);
using Pass6 = void (*)(const Rows&, int64_t, int64_t, const uint8_t*, const int8_t*, const float*, float*, bool);

template <int BITS, bool GROUPED>
constexpr Pass passes[ROWS + 1] = {nullptr, pass<1, BITS, GROUPED>, pass<2, BITS, GROUPED>, pass<3, BITS, GROUPED>};
constexpr Pass6 passes6[ROWS + 1] = {nullptr, pass6<1>, pass6<2>, pass6<3>};

template <typename T, int BITS, bool GROUPED>
void run(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& b, const float* bias,
         at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), groups = K / GROUP;
  auto xq = at::empty({M, K}, x.options().dtype(at::kChar));
  auto scales = at::empty({2, M, groups}, x.options().dtype(at::kFloat));
  auto halves = at::empty({BITS == 6 ? M * 2 * groups : 0}, x.options().dtype(at::kInt));
  const T* xs = static_cast<const T*>(x.data_ptr());
  int8_t* q = xq.data_ptr<int8_t>();
  float* dx = scales.data_ptr<float>();
  float* sums = dx + M * groups;
  int32_t* hs = BITS == 6 ? halves.data_ptr<int32_t>() : nullptr;
  blink_cpu::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; m++)
      quantize_row(xs + m * K, K, q + m * K, dx + m * groups, sums + m * groups, hs ? hs + m * 2 * groups : nullptr);
  });
  std::vector<float> row_sums(GROUPED ? 0 : M);  // channel: b multiplies sum over groups of dx * S, once a row
  for (int64_t m = 0; m < (GROUPED ? 0 : M); m++) {
    float s = 0.0f;
    for (int64_t g = 0; g < groups; g++) s += sums[m * groups + g];
    row_sums[m] = s;
  }
  const auto* cs = codes.data_ptr<uint8_t>();
  const int64_t block_bytes = K * BLOCK * (BITS == 6 ? 8 : BITS) / 8;  // 6-bit codes a byte each
  blink_cpu::parallel_for(0, N / BLOCK, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> acc(M * BLOCK);
    float* c = acc.data();
    for (int64_t blk = lo; blk < hi; blk++) {
      const bool halfs = GROUPED && BITS != 6;  // float16 d and b per group
      const uint16_t* db = halfs ? static_cast<const uint16_t*>(d.data_ptr()) + blk * groups * BLOCK : nullptr;
      const uint16_t* bb = halfs ? static_cast<const uint16_t*>(b.data_ptr()) + blk * groups * BLOCK : nullptr;
      for (int64_t g0 = 0; g0 < groups; g0 += CHUNK_G) {
        const int64_t count = std::min(CHUNK_G, groups - g0);
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
          const Rows rows{q + m0 * K, dx + m0 * groups, sums + m0 * groups, hs ? hs + m0 * 2 * groups : nullptr, K,
                          groups};
          if constexpr (BITS == 6) {
            passes6[std::min(ROWS, M - m0)](rows, g0, count, cs + blk * block_bytes,
                                            d.data_ptr<int8_t>() + blk * (K / SUB) * BLOCK,
                                            b.data_ptr<float>() + blk * (K / SUPER) * BLOCK, c + m0 * BLOCK, g0 == 0);
          } else {
            passes<BITS, GROUPED>[std::min(ROWS, M - m0)](rows, g0, count, cs + blk * block_bytes, db, bb,
                                                          c + m0 * BLOCK, g0 == 0);
          }
        }
      }
      for (int64_t m = 0; m < M; m++) {
        for (int64_t j = 0; j < BLOCK; j += 16) {
          __m512 v = _mm512_loadu_ps(c + m * BLOCK + j);
          if constexpr (!GROUPED) {
            const float* dc = d.data_ptr<float>() + blk * BLOCK + j;
            const float* bc = b.data_ptr<float>() + blk * BLOCK + j;
            v = _mm512_fmadd_ps(_mm512_loadu_ps(bc), _mm512_set1_ps(row_sums[m]),
                                _mm512_mul_ps(_mm512_loadu_ps(dc), v));
          }
          if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + blk * BLOCK + j));
          const int64_t at = m * N + blk * BLOCK + j;
          if constexpr (std::is_same_v<T, float>) {
            _mm512_storeu_ps(out.data_ptr<float>() + at, v);
          } else {
            alignas(64) float lanes[16];
            _mm512_store_ps(lanes, v);
            auto* o = out.data_ptr<at::BFloat16>() + at;
            for (int i = 0; i < 16; i++) o[i] = c10::BFloat16(lanes[i]);  // to nearest even, as torch rounds
          }
        }
      }
    }
  });
}

template <typename T>
void dispatch(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& b, int64_t bits,
              bool grouped, const float* bias, at::Tensor& out) {
  if (bits == 6) {
    run<T, 6, true>(x, codes, d, b, bias, out);
  } else if (bits == 8) {
    grouped ? run<T, 8, true>(x, codes, d, b, bias, out) : run<T, 8, false>(x, codes, d, b, bias, out);
  } else {
    grouped ? run<T, 4, true>(x, codes, d, b, bias, out) : run<T, 4, false>(x, codes, d, b, bias, out);
  }
}
#endif

// out = x @ w.T + bias for a weight laid out by blink.engine.model.quant (codes, d, b; see the top of this file).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& b,
                        int64_t bits, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(quant_linear_ready(), "blink_cpu::quant_linear: this CPU (or this build) has no AVX-512 VNNI");
  TORCH_CHECK(bits == 8 || bits == 6 || bits == 4, "blink_cpu::quant_linear: 8-, 6- or 4-bit codes, got ", bits);
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte && codes.size(2) == BLOCK && codes.size(3) == 4 &&
              codes.is_contiguous(), "blink_cpu::quant_linear: codes laid out by quant.lay_out, got ", codes.sizes());
  const int64_t N = codes.size(0) * BLOCK, K = codes.size(1) * (bits == 4 ? 8 : 4);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && K % GROUP == 0 &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "blink_cpu::quant_linear: x [M, K] in float32 or bfloat16, K = ", K);
  const bool grouped = d.scalar_type() == at::kHalf;
  if (bits == 6) {
    TORCH_CHECK(K % SUPER == 0 && d.scalar_type() == at::kChar && b.scalar_type() == at::kFloat &&
                d.numel() == N * K / SUB && b.numel() == N * K / SUPER && d.is_contiguous() && b.is_contiguous(),
                "blink_cpu::quant_linear: 6 bits take int8 scales per 16 inputs and float32 ones per 256, K = ", K);
  } else if (grouped) {
    TORCH_CHECK(d.numel() == N * K / GROUP && b.numel() == N * K / GROUP && b.scalar_type() == at::kHalf &&
                d.is_contiguous() && b.is_contiguous(), "blink_cpu::quant_linear: float16 scales per 32 inputs");
  } else {
    TORCH_CHECK(d.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && d.numel() == N && b.numel() == N &&
                d.is_contiguous() && b.is_contiguous(), "blink_cpu::quant_linear: float32 scales per output");
  }
  const at::Tensor bias32 = blink_cpu::projection_bias(bias, N, "quant_linear");
  auto out = at::empty({x.size(0), N}, x.options());
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if (x.size(0) > 0) {
    const float* bp = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
    const at::Tensor xc = x.contiguous();
    if (x.scalar_type() == at::kFloat) dispatch<float>(xc, codes, d, b, bits, grouped, bp, out);
    else dispatch<c10::BFloat16>(xc, codes, d, b, bits, grouped, bp, out);
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blink_cpu, m) {
  m.def("quant_linear_ready() -> bool", &quant_linear_ready);
  m.def("quant_linear(Tensor x, Tensor codes, Tensor d, Tensor b, int bits, Tensor? bias) -> Tensor", &quant_linear);
}
