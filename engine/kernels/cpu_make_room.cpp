// Room for a step's pages on the CPU in one call (blink.engine.kernels.cpu_make_room calls it in the host mode;
// blink.engine.kernels.cpu builds it under torch.ops.blink_cpu): blink.engine.core.paging.make_room, the torch
// reference, whose ~90 small ops each cost a few microseconds of dispatch there. The same algorithm as the device
// step's Triton twin (engine/kernels/make_room.py), as scalar loops over the slots:
// 1. the new pages each slot's tokens reach into (and, with a mirror, whether it starts a page next step), and the
//    keep order (policy.ahead: the resident slots not cancelled first, each group in precedence's order); when the
//    free pages cover every slot's, that is all.
// 2. Short of pages: the victims' order (lexsort of the policy's victim keys, a stable sort), the longest prefix in
//    keep order whose pages fit once every slot after it gives its pages back, the reserve and the deficit.
// 3. The victims in their order while the pages they free fall short; without a mirror, the evicted's counts.
// With prefix caching slots share pages and a page frees only when every slot mapping it gives it back, so what a
// slot keeps or frees is counted per page, by its first holder in keep order or its last candidate in victim order.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// Python's // and % (the reference's), which round toward minus infinity.
int64_t floor_div(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

int64_t floor_mod(int64_t a, int64_t b) {
  const int64_t r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

void check_slots(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t S) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == S && t.is_contiguous(),
              "blink_cpu::make_room: ", name, " must be a contiguous [", S, "] ", dtype, " tensor on the CPU, got ",
              t.sizes(), " ", t.scalar_type(), " on ", t.device());
}

void check_scalar(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 0,
              "blink_cpu::make_room: ", name, " must be a 0-d int64 tensor on the CPU");
}

// The victim keys of each policy (policy.victim_keys: best-effort first, the lowest priority, the longest-running,
// the latest arrival), compared as the reference's lexsort orders them: its packed keys are these fields in their
// limits (a class, a priority, a generated count below the context limit), so plain comparison agrees.
enum class Policy { fcfs, priority, slo };

Policy policy_named(const std::string& name) {
  if (name == "fcfs") return Policy::fcfs;
  if (name == "priority") return Policy::priority;
  TORCH_CHECK(name == "slo", "blink_cpu::make_room: unknown scheduling policy ", name);
  return Policy::slo;
}

// Per-call scratch, kept between calls so that a step allocates nothing but its outputs.
struct Scratch {
  std::vector<int64_t> need, cross, kept_at, victims, victim_at, firsts, frees, first, last;
  std::vector<uint8_t> fits, candidate, seen;
};

}  // namespace

namespace blink_cpu {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>> make_room(
    at::Tensor num_computed, const at::Tensor& pages_held, const at::Tensor& block_table, const at::Tensor& cancel,
    const at::Tensor& service_class, const at::Tensor& priority, const at::Tensor& seq_len,
    const at::Tensor& prompt_len, const at::Tensor& arrival, at::Tensor preemptions, at::Tensor num_preemptions,
    at::Tensor num_recomputes, const at::Tensor& take, const at::Tensor& resident, const at::Tensor& precedence,
    const at::Tensor& num_free, int64_t page_size, int64_t num_pages, bool shared, int64_t null_page,
    const std::string& policy_name, bool mirror) {
  const int64_t S = take.size(0);
  const std::pair<const at::Tensor*, const char*> longs[] = {
      {&num_computed, "num_computed"}, {&pages_held, "pages_held"}, {&service_class, "service_class"},
      {&priority, "priority"}, {&seq_len, "seq_len"}, {&prompt_len, "prompt_len"}, {&arrival, "arrival"},
      {&preemptions, "preemptions"}, {&take, "take"}, {&precedence, "precedence"}};
  for (const auto& [t, name] : longs) check_slots(*t, name, at::kLong, S);
  check_slots(cancel, "cancel", at::kBool, S);
  check_slots(resident, "resident", at::kBool, S);
  check_scalar(num_free, "num_free");
  check_scalar(num_preemptions, "num_preemptions");
  check_scalar(num_recomputes, "num_recomputes");
  TORCH_CHECK(block_table.device().is_cpu() && block_table.scalar_type() == at::kLong && block_table.dim() == 2 &&
                  block_table.size(0) == S && block_table.is_contiguous(),
              "blink_cpu::make_room: block_table must be a contiguous [S, P] int64 tensor on the CPU");
  TORCH_CHECK(page_size > 0, "blink_cpu::make_room: page_size must be positive, got ", page_size);
  const Policy policy = policy_named(policy_name);
  const int64_t P = block_table.size(1);

  const int64_t* done = num_computed.data_ptr<int64_t>();
  const int64_t* held = pages_held.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const bool* cancelled = cancel.data_ptr<bool>();
  const int64_t* tokens = take.data_ptr<int64_t>();
  const bool* res = resident.data_ptr<bool>();
  const int64_t* prec = precedence.data_ptr<int64_t>();
  const int64_t free = *num_free.data_ptr<int64_t>();  // read here, not by item(): a dispatch

  thread_local Scratch w;
  w.need.resize(S), w.cross.resize(S), w.kept_at.assign(S, -1);

  // The new pages each slot's tokens reach into; with a mirror, room for the page a sequence starts next step.
  int64_t need_sum = 0, cross_sum = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t t = tokens[s], end = done[s] + t;
    w.need[s] = t > 0 ? std::max<int64_t>(floor_div(end + page_size - 1, page_size) - held[s], 0) : 0;
    w.cross[s] = (mirror && t > 0 && floor_mod(end, page_size) == 0) ? 1 : 0;
    need_sum += w.need[s], cross_sum += w.cross[s];
  }

  // The keep order: a cancelled request ends in this step's commit, so its pages are the first to give.
  at::Tensor keep_t = at::empty({S}, take.options());
  int64_t* keep = keep_t.data_ptr<int64_t>();
  int64_t k = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t i = 0; i < S; ++i) {
      const int64_t s = prec[i];
      TORCH_CHECK(s >= 0 && s < S, "blink_cpu::make_room: precedence must be a permutation of the slots");
      if ((res[s] && !cancelled[s]) == (pass == 0)) keep[k++] = s;
    }
  }
  for (int64_t i = 0; i < S; ++i) {
    TORCH_CHECK(w.kept_at[keep[i]] < 0, "blink_cpu::make_room: precedence must be a permutation of the slots");
    w.kept_at[keep[i]] = i;
  }

  at::Tensor need_t = at::empty({S}, take.options()), take_t = at::empty({S}, take.options());
  at::Tensor evicted_t = at::empty({S}, resident.options()), reserve_t = at::empty({}, take.options());
  int64_t* need_out = need_t.data_ptr<int64_t>();
  int64_t* take_out = take_t.data_ptr<int64_t>();
  bool* evicted = evicted_t.data_ptr<bool>();
  int64_t* reserved = reserve_t.data_ptr<int64_t>();
  if (need_sum + cross_sum <= free) {  // the free pages cover all: nobody gives any back
    std::copy(w.need.begin(), w.need.end(), need_out);
    std::copy(tokens, tokens + S, take_out);
    std::fill(evicted, evicted + S, false);
    *reserved = cross_sum;
    return {need_t, take_t, evicted_t, reserve_t, keep_t, std::nullopt};
  }

  // The victims' order: the resident cancelled first, then the policy's victim keys; a stable sort (ties by slot).
  const int64_t* klass = service_class.data_ptr<int64_t>();
  const int64_t* prio = priority.data_ptr<int64_t>();
  const int64_t* len = seq_len.data_ptr<int64_t>();
  const int64_t* prompt = prompt_len.data_ptr<int64_t>();
  const int64_t* arrived = arrival.data_ptr<int64_t>();
  w.victims.resize(S), w.victim_at.resize(S);
  for (int64_t s = 0; s < S; ++s) w.victims[s] = s;
  std::stable_sort(w.victims.begin(), w.victims.end(), [&](int64_t a, int64_t b) {
    const bool gives_a = res[a] && cancelled[a], gives_b = res[b] && cancelled[b];
    if (gives_a != gives_b) return gives_a;
    if (policy == Policy::slo && klass[a] != klass[b]) return klass[a] > klass[b];  // best-effort first
    if (policy != Policy::fcfs && prio[a] != prio[b]) return prio[a] > prio[b];     // the lowest priority first
    if (policy == Policy::slo) {  // the longest-running first
      const int64_t generated_a = len[a] - prompt[a], generated_b = len[b] - prompt[b];
      if (generated_a != generated_b) return generated_a > generated_b;
    }
    return arrived[a] > arrived[b];  // the latest arrival first
  });
  for (int64_t v = 0; v < S; ++v) w.victim_at[w.victims[v]] = v;

  // The pages kept by each keep position: with sharing, the distinct pages whose first holder it is.
  w.firsts.assign(S, 0);
  if (shared) {
    if (static_cast<int64_t>(w.first.size()) < num_pages) {
      w.first.resize(num_pages), w.last.resize(num_pages), w.seen.resize(num_pages);
    }
    for (int64_t s = 0; s < S; ++s) {  // only the pages some slot maps are touched: set at rest first
      for (int64_t j = 0, n = std::clamp<int64_t>(held[s], 0, P); j < n; ++j) {
        const int64_t p = table[s * P + j];
        TORCH_CHECK(p >= 0 && p < num_pages, "blink_cpu::make_room: a block table maps page ", p, " of ", num_pages);
        w.first[p] = S, w.last[p] = -1, w.seen[p] = 0;
      }
    }
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t j = 0, n = std::clamp<int64_t>(held[s], 0, P); j < n; ++j) {
        const int64_t p = table[s * P + j];
        w.first[p] = std::min(w.first[p], w.kept_at[s]);
      }
    }
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t j = 0, n = std::clamp<int64_t>(held[s], 0, P); j < n; ++j) {
        const int64_t p = table[s * P + j];
        if (p != null_page && !w.seen[p]) w.seen[p] = 1, ++w.firsts[w.first[p]];
      }
    }
  } else {  // no page is shared: a slot holds its own
    for (int64_t s = 0; s < S; ++s) w.firsts[w.kept_at[s]] += held[s];
  }

  // The longest prefix in keep order whose new pages (and the pages those ahead of it start next step) fit in the
  // free pages and those the slots after it give back.
  int64_t total_kept = 0;
  for (int64_t i = 0; i < S; ++i) total_kept += w.firsts[i];
  w.fits.assign(S, 0);
  int64_t kept = 0, reserve = 0, fitting_need = 0;
  int64_t need_by = 0, cross_before = 0, kept_by = 0;
  for (int64_t i = 0; i < S; ++i) {
    const int64_t s = keep[i];
    need_by += w.need[s], kept_by += w.firsts[i];
    // A prefix: the pages asked for only grow along keep order, and those given back only shrink.
    if (need_by + cross_before <= free + total_kept - kept_by) {
      w.fits[s] = 1, ++kept, reserve += w.cross[s], fitting_need += w.need[s];
    }
    cross_before += w.cross[s];
  }
  const int64_t deficit = fitting_need + reserve - free;

  // The candidates: past the prefix, holding a page no kept slot maps (a null entry maps none).
  w.candidate.assign(S, 0), w.frees.assign(S, 0);
  for (int64_t s = 0; s < S; ++s) {
    if (w.fits[s]) continue;
    if (!shared) {
      w.candidate[s] = held[s] > 0;
      if (w.candidate[s]) w.frees[w.victim_at[s]] = held[s];
      continue;
    }
    for (int64_t j = 0, n = std::clamp<int64_t>(held[s], 0, P); j < n && !w.candidate[s]; ++j) {
      const int64_t p = table[s * P + j];
      w.candidate[s] = p == null_page || w.first[p] >= kept;
    }
  }
  if (shared) {  // the distinct pages whose last holder in victim order is a candidate: they free with it
    for (int64_t s = 0; s < S; ++s) {
      const int64_t at = w.candidate[s] ? w.victim_at[s] : S;
      for (int64_t j = 0, n = std::clamp<int64_t>(held[s], 0, P); j < n; ++j) {
        const int64_t p = table[s * P + j];
        w.last[p] = std::max(w.last[p], at);
      }
    }
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t j = 0, n = std::clamp<int64_t>(held[s], 0, P); j < n; ++j) {
        const int64_t p = table[s * P + j];
        if (p != null_page && w.seen[p] == 1 && w.last[p] < S) ++w.frees[w.last[p]];
        w.seen[p] = 2;
      }
    }
  }

  // The victims in their order while the pages given back before each fall short.
  int64_t given = 0, count = 0;
  for (int64_t v = 0; v < S; ++v) {
    const int64_t s = w.victims[v];
    evicted[s] = w.candidate[s] && given < deficit;
    given += w.frees[v];
  }
  for (int64_t s = 0; s < S; ++s) {
    need_out[s] = w.fits[s] ? w.need[s] : 0;
    // A slot past the prefix still runs if it needs no new page and keeps its own.
    take_out[s] = (w.fits[s] || (w.need[s] == 0 && !evicted[s])) ? tokens[s] : 0;
  }
  *reserved = reserve;
  if (!mirror) {  // paging._count_evictions: with a mirror, what is rotated out is not recomputed
    int64_t* computed = num_computed.data_ptr<int64_t>();
    int64_t* preempted = preemptions.data_ptr<int64_t>();
    for (int64_t s = 0; s < S; ++s) {
      if (!evicted[s]) continue;
      computed[s] = 0;
      if (!cancelled[s]) ++preempted[s], ++count;  // a cancelled one gave its pages back: it was not preempted
    }
    *num_preemptions.data_ptr<int64_t>() += count;
    *num_recomputes.data_ptr<int64_t>() += count;
  }
  at::Tensor victims_t = at::empty({S}, take.options());
  std::copy(w.victims.begin(), w.victims.end(), victims_t.data_ptr<int64_t>());
  return {need_t, take_t, evicted_t, reserve_t, keep_t, victims_t};
}

}  // namespace blink_cpu

TORCH_LIBRARY_FRAGMENT(blink_cpu, m) {
  m.def(
      "make_room(Tensor(a!) num_computed, Tensor pages_held, Tensor block_table, Tensor cancel, Tensor service_class, "
      "Tensor priority, Tensor seq_len, Tensor prompt_len, Tensor arrival, Tensor(b!) preemptions, "
      "Tensor(c!) num_preemptions, Tensor(d!) num_recomputes, Tensor take, Tensor resident, Tensor precedence, "
      "Tensor num_free, int page_size, int num_pages, bool shared, int null_page, str policy, bool mirror) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor?)",
      &blink_cpu::make_room);
}
