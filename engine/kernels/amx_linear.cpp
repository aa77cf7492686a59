// bfloat16 projections on Intel's AMX tiles over the plain weight (blink.engine.model.linear calls them for every row
// count; blink.engine.kernels.cpu builds this file with cpu.cpp, under torch.ops.blink_cpu).
//
// out = x @ w.T with w as the model holds it, [N, K] row-major: the weight is the tiles' A operand (16 of its rows
// by 32 of its columns, read in place with its row stride) and x, laid out as pairs of k (VNNI), the B operand, so
// a C tile is 16 outputs of 16 rows of x, transposed on the way out. The weight is read once whatever the row
// count, so a decode step costs what reading the weights costs, with no second copy of them in oneDNN's layout.
// Where the compiler targets a CPU without AMX (-march=native elsewhere), amx_ready() says false and nothing runs.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <functional>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define BLINK_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace blink_cpu {
// pool.cpp: at::parallel_for's sections on the kernels' own threads.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);
// blocked_linear.cpp's: the bias as float32, checked.
at::Tensor projection_bias(const c10::optional<at::Tensor>& bias, int64_t outputs, const char* op);
}  // namespace blink_cpu

namespace {

constexpr int64_t TILE = 16;       // rows of every tile, and the outputs (or rows of x) one tile holds
constexpr int64_t TILE_K = 32;     // bfloat16 columns of an A tile: 64 bytes
constexpr int64_t ROW_GROUP = 4;   // C tiles (16 rows of x each) accumulated per pass over a block of the weight

bool amx_ready() {
#ifdef BLINK_AMX
  // Linux hands a process the tiles' state only when asked (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA).
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
#else
  return false;
#endif
}

#ifdef BLINK_AMX
struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// x [M, K] as B tiles: [ceil(M/16)][K/2][16 rows of x][2], zero past M.
at::Tensor pairs_of_k(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  auto out = at::zeros({(M + TILE - 1) / TILE, K / 2, TILE, 2}, x.options());
  const auto* src = static_cast<const uint32_t*>(x.data_ptr());  // a pair of bfloat16 as one word
  auto* dst = static_cast<uint32_t*>(out.data_ptr());
  const __m512i stride = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(TILE));
  for (int64_t m = 0; m < M; m++) {
    uint32_t* d = dst + (m / TILE) * (K / 2) * TILE + m % TILE;
    const uint32_t* s = src + m * (K / 2);
    for (int64_t p = 0; p < K / 2; p += 16) _mm512_i32scatter_epi32(d + p * TILE, stride, _mm512_loadu_si512(s + p), 4);
  }
  return out;
}

void linear_tiles(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), blocks = (M + TILE - 1) / TILE;
  const at::Tensor xv = pairs_of_k(x);
  const auto* a_base = static_cast<const char*>(w.data_ptr());
  const auto* b_base = static_cast<const char*>(xv.data_ptr());
  auto* o = static_cast<c10::BFloat16*>(out.data_ptr());
  const int64_t b_block = K * TILE * 2;  // bytes of one 16-row block of x's pairs
  blink_cpu::parallel_for(0, N / TILE, 1, [&](int64_t lo, int64_t hi) {
    TileConfig config;
    for (int t = 0; t < 8; t++) config.rows[t] = TILE, config.bytes_per_row[t] = TILE_K * 2;
    _tile_loadconfig(&config);  // per thread: oneDNN's kernels on the same threads load their own
    alignas(64) float c[ROW_GROUP][TILE][TILE];  // [x's row block][output][row of x]
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(TILE));
    for (int64_t n = lo; n < hi; n++) {
      const char* a = a_base + n * TILE * K * 2;
      for (int64_t b0 = 0; b0 < blocks; b0 += ROW_GROUP) {
        const int64_t group = std::min(ROW_GROUP, blocks - b0);
        const char* b = b_base + b0 * b_block;
        // Tiles 0-3 accumulate, 4 holds the weight's block, 5 and 6 take x's blocks in turn. The tile
        // instructions name their registers as immediates, hence the unrolled group.
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < K; k += TILE_K) {
          _tile_loadd(4, a + k * 2, K * 2);
          const char* bk = b + k * TILE * 2;
          _tile_loadd(5, bk, TILE_K * 2);
          _tile_dpbf16ps(0, 4, 5);
          if (group > 1) {
            _tile_loadd(6, bk + b_block, TILE_K * 2);
            _tile_dpbf16ps(1, 4, 6);
          }
          if (group > 2) {
            _tile_loadd(5, bk + 2 * b_block, TILE_K * 2);
            _tile_dpbf16ps(2, 4, 5);
          }
          if (group > 3) {
            _tile_loadd(6, bk + 3 * b_block, TILE_K * 2);
            _tile_dpbf16ps(3, 4, 6);
          }
        }
        _tile_stored(0, c[0], TILE * 4);
        if (group > 1) _tile_stored(1, c[1], TILE * 4);
        if (group > 2) _tile_stored(2, c[2], TILE * 4);
        if (group > 3) _tile_stored(3, c[3], TILE * 4);
        const __m512 add = bias ? _mm512_loadu_ps(bias + n * TILE) : _mm512_setzero_ps();
        for (int64_t g = 0; g < group; g++) {
          for (int64_t r = 0; r < TILE && (b0 + g) * TILE + r < M; r++) {
            const __m512 sums = _mm512_add_ps(_mm512_i32gather_ps(column, &c[g][0][r], 4), add);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + ((b0 + g) * TILE + r) * N + n * TILE),
                                (__m256i)_mm512_cvtneps_pbh(sums));  // to nearest even, as torch rounds
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_ready(), "blink_cpu::amx_linear: this CPU (or this build) has no AMX tiles");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "blink_cpu::amx_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "blink_cpu::amx_linear: bfloat16 x and a contiguous bfloat16 weight");
  TORCH_CHECK(w.size(0) % TILE == 0 && w.size(1) % TILE_K == 0,
              "blink_cpu::amx_linear: a weight of whole tiles (outputs by 16, inputs by 32), got ", w.sizes());
  const at::Tensor bias32 = blink_cpu::projection_bias(bias, w.size(0), "amx_linear");
  auto out = at::empty({x.size(0), w.size(0)}, x.options());
#ifdef BLINK_AMX
  if (x.size(0) > 0) linear_tiles(x.contiguous(), w, bias32.defined() ? bias32.data_ptr<float>() : nullptr, out);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blink_cpu, m) {
  m.def("amx_ready() -> bool", &amx_ready);
  m.def("amx_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor", &amx_linear);
}
