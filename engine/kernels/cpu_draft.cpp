// The drafts' proposal for the CPU's host mode in one call (blink.engine.kernels.cpu_draft.draft calls it; built by
// blink.engine.kernels.cpu into torch.ops.blink_cpu): Speculation.draft, the torch reference, is ~170 small ops, a
// few microseconds of dispatch each; engine/kernels/draft.py is its Triton twin for the device step.
//
// Plain loops over the slots: which may draft (decoding one token, no penalty, no prompt left to score, not held
// off); for each of those, the latest earlier occurrence of its last n tokens (the longest n in [lookup_min,
// lookup_max]) found by scanning its own history backwards (16 positions compared with its last token at a time),
// then the step-cost fit's threshold on its acceptance rate for drafts after a match of that n (spec_rate's column
// n - 1; a retry of that column for a slot below it), the depth that pays and the room cap; then the fit to the budget and the
// free pages in the budget's order, the match lengths of the drafts kept (draft_n), and the drafts copied after each
// sequence. Without lookup (a draft model's drafts: Speculation.lookup off) there is no search and no copy: every
// slot that may draft offers K tokens under its rate of column 0, and the draft model writes them in the step.
// Floats are computed in the reference's dtypes and order (the threshold in float64, then rounded to float32; the
// rates in float32), so every output equals the reference's.
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t MAX_DRAFT = 64;  // the drafts a slot copies, read before written (MAX_SPECULATIVE_TOKENS is less)

// A 1-D tensor's elements through its stride, its dtype, device and length checked.
template <typename T>
struct Vec {
  T* p;
  int64_t stride;
  T& operator[](int64_t i) const { return p[i * stride]; }
};

template <typename T>
Vec<T> vec(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "blink_cpu::plan_drafts: ", name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == c10::CppTypeToScalarType<T>::value, "blink_cpu::plan_drafts: ", name, " must be ",
              c10::CppTypeToScalarType<T>::value, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() <= 1 && t.numel() == n, "blink_cpu::plan_drafts: ", name, " must have ", n, " elements, got ",
              t.sizes());
  return {t.data_ptr<T>(), t.dim() == 1 ? t.stride(0) : 0};
}

int64_t floor_div(int64_t a, int64_t b) {  // Python's //, which the reference's page counts use
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

// Bit b set where block[b] == key, b < 16: the search's candidates (where a match's last token is), 16 at a time.
inline uint32_t equal16(const int32_t* block, int32_t key) {
#if defined(__AVX512F__)
  return _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(block), _mm512_set1_epi32(key));
#elif defined(__AVX2__)
  const __m256i k = _mm256_set1_epi32(key);
  const auto half = [&](const int32_t* p) {
    const __m256i eq = _mm256_cmpeq_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), k);
    return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(eq)));
  };
  return half(block) | half(block + 8) << 8;
#else
  uint32_t mask = 0;
  for (int b = 0; b < 16; ++b) mask |= static_cast<uint32_t>(block[b] == key) << b;
  return mask;
#endif
}

// torch's clamp(min=lo): a NaN stays NaN.
template <typename T>
T clamp_min(T x, T lo) { return std::isnan(x) ? x : std::max(x, lo); }

at::Tensor plan_drafts(const at::Tensor& live_t, const at::Tensor& take_t, const at::Tensor& order_t,
                       const at::Tensor& cap_t, const at::Tensor& seq_len_t, const at::Tensor& computed_t,
                       const at::Tensor& max_tokens_t, const at::Tensor& repetition_t, const at::Tensor& presence_t,
                       const at::Tensor& frequency_t, const at::Tensor& prompt_logprobs_t, const at::Tensor& scored_t,
                       const at::Tensor& prompt_len_t, const at::Tensor& draft_off_t,
                       const at::Tensor& service_class_t, const at::Tensor& room_t, const at::Tensor& pages_held_t,
                       const at::Tensor& cost_t, const at::Tensor& num_free_t, at::Tensor tokens_t,
                       at::Tensor draft_len_t, at::Tensor draft_n_t, at::Tensor spec_rate_t, int64_t K,
                       bool lookup, int64_t lookup_min, int64_t lookup_max, double share, double draft_ratio,
                       int64_t page, bool by_class,
                       double retry_d, double min_rate_d) {
  const int64_t S = take_t.numel();
  TORCH_CHECK(K >= 1 && K <= MAX_DRAFT, "blink_cpu::plan_drafts: k must be in [1, ", MAX_DRAFT, "], got ", K);
  TORCH_CHECK(lookup_min >= 1 && lookup_max >= lookup_min, "blink_cpu::plan_drafts: bad lookup range [", lookup_min,
              ", ", lookup_max, "]");
  TORCH_CHECK(page >= 1, "blink_cpu::plan_drafts: page_size must be positive");
  auto live = vec<bool>(live_t, S, "live");
  auto take = vec<int64_t>(take_t, S, "take");
  auto order = vec<int64_t>(order_t, S, "order");
  auto cap = vec<int64_t>(cap_t, 1, "cap");
  auto seq_len = vec<int64_t>(seq_len_t, S, "seq_len");
  auto computed = vec<int64_t>(computed_t, S, "num_computed");
  auto max_tokens = vec<int64_t>(max_tokens_t, S, "max_tokens");
  auto repetition = vec<float>(repetition_t, S, "repetition_penalty");
  auto presence = vec<float>(presence_t, S, "presence_penalty");
  auto frequency = vec<float>(frequency_t, S, "frequency_penalty");
  auto prompt_logprobs = vec<int64_t>(prompt_logprobs_t, S, "prompt_logprobs");
  auto scored = vec<int64_t>(scored_t, S, "scored");
  auto prompt_len = vec<int64_t>(prompt_len_t, S, "prompt_len");
  auto draft_off = vec<bool>(draft_off_t, S, "draft_off");
  auto service_class = vec<int64_t>(service_class_t, S, "service_class");
  auto room = vec<int64_t>(room_t, S, "room");
  auto pages_held = vec<int64_t>(pages_held_t, S, "pages_held");
  auto num_free = vec<int64_t>(num_free_t, 1, "num_free");
  auto draft_len = vec<int64_t>(draft_len_t, S, "draft_len");
  auto draft_n = vec<int64_t>(draft_n_t, S, "draft_n");
  TORCH_CHECK(spec_rate_t.device().is_cpu() && spec_rate_t.scalar_type() == at::kFloat && spec_rate_t.dim() == 2 &&
                  spec_rate_t.size(0) == S && spec_rate_t.size(1) >= lookup_max,
              "blink_cpu::plan_drafts: spec_rate must be the CPU's float32 [S, n] with a column per match length up "
              "to lookup_max ", lookup_max, ", got ", spec_rate_t.scalar_type(), " ", spec_rate_t.sizes());
  float* spec_rate = spec_rate_t.data_ptr<float>();
  const int64_t rate_row = spec_rate_t.stride(0), rate_col = spec_rate_t.stride(1);
  TORCH_CHECK(cost_t.device().is_cpu() && cost_t.scalar_type() == at::kDouble && cost_t.dim() == 1 &&
                  cost_t.numel() >= 2,
              "blink_cpu::plan_drafts: cost must be the CPU's float64 [per_step, per_token, ...]");
  TORCH_CHECK(tokens_t.device().is_cpu() && tokens_t.scalar_type() == at::kInt && tokens_t.dim() == 2 &&
                  tokens_t.size(0) == S && tokens_t.size(1) >= 1 && tokens_t.stride(1) == 1,
              "blink_cpu::plan_drafts: tokens must be the CPU's int32 [S, max_len + 1], rows contiguous");
  const double per_step = cost_t.data_ptr<double>()[0], per_token = cost_t.data_ptr<double>()[cost_t.stride(0)];
  int32_t* tokens = tokens_t.data_ptr<int32_t>();
  const int64_t row = tokens_t.stride(0), max_len = tokens_t.size(1) - 1;
  // The reference's Python floats meet float32 tensors: torch rounds them to float32 first.
  const float retry = static_cast<float>(retry_d);
  const float min_rate = static_cast<float>(min_rate_d);

  // Who may draft, and the step's sums the threshold reads.
  std::vector<uint8_t> able(S);
  int64_t tokens_sum = 0, sampling = 0, able_sensitive = 0;
  bool any_able = false;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t seq = seq_len[s], t = take[s];
    tokens_sum += t;
    sampling += (t > 0 && computed[s] + t == seq);
    const bool decoding = live[s] && t == 1 && seq - computed[s] == 1 && max_tokens[s] > 0;
    const bool penalised = repetition[s] != 1.0f || presence[s] != 0.0f || frequency[s] != 0.0f;
    const bool scoring = prompt_logprobs[s] >= 0 && scored[s] < prompt_len[s] - 1;
    able[s] = decoding && !penalised && !scoring && !draft_off[s];
    able_sensitive += able[s] && by_class && service_class[s] == 0;
    any_able |= able[s];
  }
  at::Tensor k_t = at::zeros({S}, take_t.options());
  int64_t* k = k_t.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) draft_len[s] = 0;
  if (!any_able) return k_t;  // nothing else changes

  // Speculation.threshold: what a draft costs by the fit, times the drafts its kind's slots would add.
  const double step = per_step + per_token * static_cast<double>(tokens_sum);
  const double per_draft = step > 0 ? per_token * share / clamp_min(step, 1e-12) : 0.0;
  const double forward = step > 0 ? per_step * draft_ratio / clamp_min(step, 1e-12) : 0.0;  // a draft model's
  // Speculation.propose for each able slot, then its rate for drafts after a match of the n found and its caps:
  // k[s] its wanted draft, start[s] where it is copied from, length[s] the n of its match.
  std::vector<int64_t> start(S, 0), length(S, 0), latest(lookup_max + 1);
  bool any = false;
  for (int64_t s = 0; s < S; ++s) {
    if (!able[s]) continue;
    const int64_t seq = seq_len[s];
    TORCH_CHECK(seq >= 1 && seq <= max_len, "blink_cpu::plan_drafts: slot ", s, "'s seq_len ", seq,
                " is outside its tokens [1, ", max_len, "]");
    // A draft model's drafts (Speculation.lookup off): K for any able slot, under the rate of column 0.
    int64_t found = K;
    length[s] = lookup ? 0 : 1;
    if (lookup) {
      const int32_t* history = tokens + s * row;
      // Backwards from the latest possible end (j < seq - 1), so the first match of n tokens is the latest; only where
      // the last token is (16 compared at a time) is the match's length counted.
      std::fill(latest.begin(), latest.end(), -1);
      const auto done = [&](int64_t j) {  // j ends a match of one token at least
        int64_t n = 1;
        while (n < lookup_max && j - n >= 0 && history[j - n] == history[seq - 1 - n]) ++n;
        for (int64_t m = n; m >= 1 && latest[m] < 0; --m) latest[m] = j;
        return latest[lookup_max] >= 0;  // none longer counts, nor any earlier
      };
      const int32_t key = history[seq - 1];
      bool over = false;
      int64_t j = seq - 2;
      for (; j >= 15 && !over; j -= 16) {
        uint32_t mask = equal16(history + j - 15, key);
        while (mask != 0 && !over) {
          const int b = 31 - __builtin_clz(mask);  // the latest candidate first
          over = done(j - 15 + b);
          mask &= ~(1u << b);
        }
      }
      for (; j >= 0 && !over; --j) {
        if (history[j] == key) over = done(j);
      }
      found = 0;
      for (int64_t n = lookup_max; n >= lookup_min; --n) {
        if (latest[n] >= 0) {
          start[s] = latest[n] + 1;
          found = std::min(seq - latest[n] - 1, K);
          length[s] = n;
          break;
        }
      }
    }
    if (length[s] == 0) continue;  // no match: no drafts, and no rate of a length to retry
    // The slot's rate for drafts after a match of this length: a short match's drafts fail more often.
    float& column = spec_rate[s * rate_row + (length[s] - 1) * rate_col];
    const float rate = column;
    const bool sensitive = by_class && service_class[s] == 0;
    const double drafting = std::max(static_cast<double>(sensitive ? able_sensitive : sampling), 1.0);
    const double scaled = per_draft * drafting;  // rounded before the sum, as the reference's (built without FMA)
    const float need = clamp_min(static_cast<float>(scaled + forward), min_rate);
    if (!(rate >= need)) {
      column = rate + retry * (1.0f - rate);  // regains some rate, so it tries again later
      continue;
    }
    any = true;
    int64_t want = std::min({found, max_tokens[s] - (seq - prompt_len[s]) - 1, max_len - seq - 1});
    // As deep as a draft token pays: the j-th is kept about rate**j of the time (float32 products, as the reference).
    int64_t depth = 1;
    for (float kept = rate * rate; depth < K && kept >= need; kept *= rate) ++depth;
    want = std::min({want, room[s] - 1, depth});
    k[s] = std::clamp(want, int64_t{0}, K);
  }
  if (!any) {
    for (int64_t s = 0; s < S; ++s) draft_n[s] = 0;
    return k_t;
  }

  // Speculation._fit: the budget the plan left and the free pages it leaves, in the budget's order.
  int64_t base = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t ends = computed[s] + take[s];
    const int64_t held = std::max(pages_held[s], floor_div(ends + page - 1, page));
    if (take[s] > 0) base += held - pages_held[s];
  }
  const int64_t left = cap[0] - tokens_sum, free_pages = num_free[0];
  int64_t before = 0, extra_sum = 0;
  for (int64_t o = 0; o < S; ++o) {
    const int64_t s = order[o];
    TORCH_CHECK(s >= 0 && s < S, "blink_cpu::plan_drafts: order must be a permutation of the slots, got ", s);
    const int64_t wanted = k[s];
    const int64_t cut = std::min(std::max(left - before, int64_t{0}), wanted);
    before += wanted;
    const int64_t ends = computed[s] + take[s];
    const int64_t held = std::max(pages_held[s], floor_div(ends + page - 1, page));
    extra_sum += std::max(floor_div(ends + cut + page - 1, page) - held, int64_t{0});
    k[s] = extra_sum + base <= free_pages ? cut : 0;
  }

  // The drafts follow an earlier occurrence: read before the sequence's end, written after it.
  int32_t copied[MAX_DRAFT];
  for (int64_t s = 0; s < S; ++s) {
    draft_len[s] = k[s];
    draft_n[s] = k[s] > 0 ? length[s] : 0;  // the match length the drafts in flight followed, for the settle
    if (!lookup) continue;  // the draft model writes its drafts in the step
    int32_t* history = tokens + s * row;
    const int64_t seq = seq_len[s];
    for (int64_t i = 0; i < k[s]; ++i) copied[i] = history[std::min(start[s] + i, max_len)];
    for (int64_t i = 0; i < k[s]; ++i) history[seq + i] = copied[i];
  }
  return k_t;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blink_cpu, m) {
  m.def("plan_drafts(Tensor live, Tensor take, Tensor order, Tensor cap, Tensor seq_len, Tensor num_computed, "
        "Tensor max_tokens, Tensor repetition_penalty, Tensor presence_penalty, Tensor frequency_penalty, "
        "Tensor prompt_logprobs, Tensor scored, Tensor prompt_len, Tensor draft_off, Tensor service_class, "
        "Tensor room, Tensor pages_held, Tensor cost, Tensor num_free, Tensor(a!) tokens, Tensor(b!) draft_len, "
        "Tensor(c!) draft_n, Tensor(d!) spec_rate, int k, bool lookup, int lookup_min, int lookup_max, float share, "
        "float draft_ratio, int page_size, bool by_class, float retry, float min_rate) -> Tensor",
        &plan_drafts);
}
