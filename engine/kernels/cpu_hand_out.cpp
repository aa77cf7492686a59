// The plan's head and token hand-out for the CPU's host mode, one call each in place of the ~40-90 small torch ops of
// blink.engine.core.scheduler._head and _hand_out (blink.engine.kernels.cpu_hand_out wraps them with their
// signatures; blink.engine.kernels.hand_out is the same algorithm as Triton kernels for the device step).
//
// Every order is the policy's stable lexsort (engine/core/policy.py): the keys of known width packed into one int64
// exactly as lexsort packs them, then (slo) the TTFT deadline, then the arrival; ties go to the lower slot index. A
// sort with the index as its last key is a total order, so std::sort gives the stable sort's one answer.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// The policies in blink.engine.core.policy.POLICIES' order (the wrapper passes the index).
enum Policy : int64_t { FCFS = 0, BY_PRIORITY = 1, SLO = 2 };
constexpr int64_t ADMITTED = 1, RUNNING = 2;  // blink.engine.core.state.SlotStatus

void check(const at::Tensor& t, c10::ScalarType dtype, int64_t S, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "blink_cpu::", op, ": ", name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == dtype, "blink_cpu::", op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == S && t.is_contiguous(), "blink_cpu::", op, ": ", name,
              " must be a contiguous [", S, "]");
}

struct Keys {  // one slot's sort keys, most significant first
  int64_t head;
  double deadline;
  int64_t arrival;
  int64_t slot;
};

// torch's sort order of float64: NaN after everything, equal to NaN; -0.0 equal to 0.0.
inline bool deadline_less(double a, double b) { return a < b || (std::isnan(b) && !std::isnan(a)); }

inline bool before(const Keys& a, const Keys& b) {
  if (a.head != b.head) return a.head < b.head;
  if (deadline_less(a.deadline, b.deadline)) return true;
  if (deadline_less(b.deadline, a.deadline)) return false;
  if (a.arrival != b.arrival) return a.arrival < b.arrival;
  return a.slot < b.slot;
}

struct KeyInputs {
  const int64_t* service_class;
  const int64_t* priority;
  const double* ttft_deadline;
  const int64_t* arrival;
  int64_t policy, prio_base, prio_bits;
};

// Writes order[rank] = slot by the policy's keys: budget_keys with `first` = demand > 0 and prefill = demand > 1
// where demand is given, else keep_keys with no slot first. `keys` is scratch of S entries.
void sort_slots(const KeyInputs& in, const int64_t* demand, int64_t S, std::vector<Keys>& keys, int64_t* order) {
  for (int64_t s = 0; s < S; s++) {
    int64_t head = demand ? (demand[s] <= 0) : 1;  // ~first
    if (in.policy == SLO) head = (head << 1) | in.service_class[s];
    if (demand) head = (head << 1) | (demand[s] > 1);
    if (in.policy != FCFS) head = (head << in.prio_bits) | (in.priority[s] - in.prio_base);
    keys[s] = {head, in.policy == SLO ? in.ttft_deadline[s] : 0.0, in.arrival[s], s};
  }
  std::sort(keys.begin(), keys.begin() + S, before);
  for (int64_t r = 0; r < S; r++) order[r] = keys[r].slot;
}

KeyInputs key_inputs(const at::Tensor& service_class, const at::Tensor& priority, const at::Tensor& ttft_deadline,
                     const at::Tensor& arrival, int64_t policy, int64_t prio_base, int64_t prio_bits, int64_t S,
                     const char* op) {
  TORCH_CHECK(policy == FCFS || policy == BY_PRIORITY || policy == SLO, "blink_cpu::", op, ": unknown policy ",
              policy);
  check(service_class, at::kLong, S, op, "service_class");
  check(priority, at::kLong, S, op, "priority");
  check(ttft_deadline, at::kDouble, S, op, "ttft_deadline");
  check(arrival, at::kLong, S, op, "arrival");
  return {service_class.data_ptr<int64_t>(), priority.data_ptr<int64_t>(), ttft_deadline.data_ptr<double>(),
          arrival.data_ptr<int64_t>(), policy, prio_base, prio_bits};
}

// scheduler._head: ADMITTED slots start RUNNING (trusting their drafts); returns (running, resident, precedence,
// live, starting). mirror_free: the host mirror's free page count, when there is a mirror (then _hold_new holds new
// requests back behind rotated ones that wait).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> plan_head(
    at::Tensor status, at::Tensor spec_rate, const at::Tensor& rotated, const at::Tensor& paused,
    const at::Tensor& cancel, const at::Tensor& num_computed, const at::Tensor& pages_held,
    const at::Tensor& service_class, const at::Tensor& priority, const at::Tensor& ttft_deadline,
    const at::Tensor& arrival, const c10::optional<at::Tensor>& mirror_free, int64_t hold_below, int64_t policy,
    int64_t prio_base, int64_t prio_bits, double first_rate) {
  const char* op = "plan_head";
  const int64_t S = status.numel();
  check(status, at::kLong, S, op, "status");
  TORCH_CHECK(spec_rate.device().is_cpu() && spec_rate.scalar_type() == at::kFloat && spec_rate.dim() == 2 &&
                  spec_rate.size(0) == S,
              "blink_cpu::plan_head: spec_rate must be the CPU's float32 [", S, ", n] (a rate per match length), got ",
              spec_rate.scalar_type(), " ", spec_rate.sizes());
  check(rotated, at::kBool, S, op, "rotated");
  check(paused, at::kBool, S, op, "paused");
  check(cancel, at::kBool, S, op, "cancel");
  check(num_computed, at::kLong, S, op, "num_computed");
  check(pages_held, at::kLong, S, op, "pages_held");
  const KeyInputs in = key_inputs(service_class, priority, ttft_deadline, arrival, policy, prio_base, prio_bits, S, op);
  if (mirror_free) {
    TORCH_CHECK(mirror_free->device().is_cpu() && mirror_free->numel() == 1 && mirror_free->scalar_type() == at::kLong,
                "blink_cpu::plan_head: mirror_free must be one int64 on the CPU");
  }

  const auto bools = status.options().dtype(at::kBool);
  at::Tensor running = at::empty({S}, bools), resident = at::empty({S}, bools), live = at::empty({S}, bools),
             starting = at::empty({S}, bools), precedence = at::empty({S}, status.options());
  int64_t* st = status.data_ptr<int64_t>();
  float* rate = spec_rate.data_ptr<float>();
  const int64_t rate_row = spec_rate.stride(0), rate_col = spec_rate.stride(1), lengths = spec_rate.size(1);
  const bool *rot = rotated.data_ptr<bool>(), *pause = paused.data_ptr<bool>(), *canc = cancel.data_ptr<bool>();
  const int64_t *computed = num_computed.data_ptr<int64_t>(), *held = pages_held.data_ptr<int64_t>();
  bool *run = running.data_ptr<bool>(), *res = resident.data_ptr<bool>(), *lv = live.data_ptr<bool>(),
       *start = starting.data_ptr<bool>();
  int64_t* order = precedence.data_ptr<int64_t>();

  bool any_rotated = false;
  for (int64_t s = 0; s < S; s++) {
    if (st[s] == ADMITTED) {
      st[s] = RUNNING;
      for (int64_t n = 0; n < lengths; n++) rate[s * rate_row + n * rate_col] = static_cast<float>(first_rate);
    }
    run[s] = st[s] == RUNNING;
    res[s] = run[s] && !rot[s];
    any_rotated |= rot[s];
  }
  std::vector<Keys> keys(S);
  sort_slots(in, nullptr, S, keys, order);

  // _hold_new: new requests wait behind a rotated one that waits to come back (all of them while the mirror is nearly
  // full), bar the latency-sensitive; none without a mirror or with nothing rotated.
  bool hold_all = false;
  int64_t first_waiting = S;  // the rank of the first waiting slot in precedence
  if (mirror_free && any_rotated) {
    for (int64_t r = 0; r < S && first_waiting == S; r++) {
      const int64_t s = order[r];
      if (rot[s] && run[s] && !canc[s] && !pause[s]) first_waiting = r;
    }
    hold_all = first_waiting < S && mirror_free->item<int64_t>() < hold_below;
  }
  std::vector<int64_t> rank;
  if (first_waiting < S && !hold_all) {  // a slot ranked behind the first waiting one is held
    rank.resize(S);
    for (int64_t r = 0; r < S; r++) rank[order[r]] = r;
  }
  for (int64_t s = 0; s < S; s++) {
    const bool fresh = res[s] && computed[s] == 0 && held[s] == 0;
    bool held_back = false;
    if (fresh && first_waiting < S && !(policy == SLO && in.service_class[s] == 0))
      held_back = hold_all || rank[s] > first_waiting;
    lv[s] = res[s] && !pause[s] && !canc[s] && !held_back;
    start[s] = fresh && !held_back && !canc[s];
  }
  return {running, resident, precedence, live, starting};
}

// scheduler._hand_out (and _score_prompts where prompt_rows > 0): the token budget handed out in the policy's order
// up to its cap; returns (take, entries or None, order, cap). cost: [per_step, per_token, ...] float64.
std::tuple<at::Tensor, c10::optional<at::Tensor>, at::Tensor, at::Tensor> plan_hand_out(
    const at::Tensor& live, const at::Tensor& seq_len, const at::Tensor& num_computed,
    const at::Tensor& prompt_logprobs, const at::Tensor& scored, const at::Tensor& prompt_len, const at::Tensor& room,
    const at::Tensor& service_class, const at::Tensor& priority, const at::Tensor& ttft_deadline,
    const at::Tensor& arrival, const at::Tensor& tpot_slo, const at::Tensor& cost, int64_t budget, int64_t floor,
    int64_t prompt_rows, int64_t policy, int64_t prio_base, int64_t prio_bits) {
  const char* op = "plan_hand_out";
  const int64_t S = live.numel();
  check(live, at::kBool, S, op, "live");
  check(seq_len, at::kLong, S, op, "seq_len");
  check(num_computed, at::kLong, S, op, "num_computed");
  check(prompt_logprobs, at::kLong, S, op, "prompt_logprobs");
  check(scored, at::kLong, S, op, "scored");
  check(prompt_len, at::kLong, S, op, "prompt_len");
  check(room, at::kLong, S, op, "room");
  check(tpot_slo, at::kDouble, S, op, "tpot_slo");
  const KeyInputs in = key_inputs(service_class, priority, ttft_deadline, arrival, policy, prio_base, prio_bits, S, op);
  TORCH_CHECK(cost.device().is_cpu() && cost.scalar_type() == at::kDouble && cost.dim() == 1 && cost.size(0) >= 2 &&
                  cost.is_contiguous(),
              "blink_cpu::plan_hand_out: cost must be a contiguous float64 [per_step, per_token, ...] on the CPU");

  const auto longs = seq_len.options();
  at::Tensor take = at::empty({S}, longs), order = at::empty({S}, longs), cap = at::empty({}, longs);
  c10::optional<at::Tensor> entries;
  const bool *lv = live.data_ptr<bool>();
  const int64_t *len = seq_len.data_ptr<int64_t>(), *computed = num_computed.data_ptr<int64_t>(),
                *asks_for = prompt_logprobs.data_ptr<int64_t>(), *done = scored.data_ptr<int64_t>(),
                *plen = prompt_len.data_ptr<int64_t>(), *rm = room.data_ptr<int64_t>();
  int64_t *tk = take.data_ptr<int64_t>(), *ord = order.data_ptr<int64_t>();

  // Each slot's demand; a request that publishes its prompt's logprobs computes no more than its window has room for.
  std::vector<int64_t> demand(S);
  for (int64_t s = 0; s < S; s++) {
    int64_t d = lv[s] ? len[s] - computed[s] : 0;
    if (prompt_rows && asks_for[s] >= 0 && done[s] < plen[s] - 1) d = std::min(d, rm[s]);
    demand[s] = d;
  }

  // policy.token_cap: slo keeps the tightest TPOT SLO of the decoding slots by the step-time model, in float64 as
  // torch computes it (amin propagates a NaN; nan_to_num sends NaN and +inf to the budget).
  int64_t limit = budget;
  if (policy == SLO) {
    const double* tpot = tpot_slo.data_ptr<double>();
    double tightest = std::numeric_limits<double>::infinity();
    for (int64_t s = 0; s < S; s++) {
      if (demand[s] != 1) continue;
      if (std::isnan(tpot[s]) || std::isnan(tightest)) tightest = std::numeric_limits<double>::quiet_NaN();
      else tightest = std::min(tightest, tpot[s]);
    }
    const double* fit = cost.data_ptr<double>();
    double tokens = (tightest - fit[0]) / fit[1];
    if (std::isnan(tokens) || tokens == std::numeric_limits<double>::infinity()) tokens = static_cast<double>(budget);
    else if (tokens == -std::numeric_limits<double>::infinity()) tokens = std::numeric_limits<double>::lowest();
    tokens = std::min(std::max(std::floor(tokens), static_cast<double>(floor)), static_cast<double>(budget));
    limit = static_cast<int64_t>(tokens);
  }
  *cap.data_ptr<int64_t>() = limit;

  std::vector<Keys> keys(S);
  sort_slots(in, demand.data(), S, keys, ord);

  // In the budget's order: each slot takes what the cap leaves after those before it.
  int64_t before_sum = 0;
  for (int64_t r = 0; r < S; r++) {
    const int64_t s = ord[r], wanted = demand[s];
    tk[s] = std::min(std::max(limit - before_sum, int64_t{0}), wanted);
    before_sum += wanted;
  }
  if (prompt_rows) {  // _score_prompts: the prompt rows handed out in the same order
    entries = at::empty({S}, longs);
    int64_t* ent = entries->data_ptr<int64_t>();
    int64_t rows_before = 0;
    for (int64_t r = 0; r < S; r++) {
      const int64_t s = ord[r];
      const int64_t start = std::max(computed[s], done[s]);
      const int64_t e = asks_for[s] >= 0 ? std::max(std::min(computed[s] + tk[s], plen[s] - 1) - start, int64_t{0})
                                         : 0;
      const int64_t allowed = std::max(prompt_rows - rows_before, int64_t{0});
      rows_before += e;
      // A cut slot computes up to its last allowed position (the positions it scored before are recomputed).
      if (e > allowed) tk[s] = std::max(start + allowed - computed[s], int64_t{0});
      ent[s] = std::min(e, allowed);
    }
  }
  return {take, entries, order, cap};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blink_cpu, m) {
  m.def("plan_head(Tensor(a!) status, Tensor(b!) spec_rate, Tensor rotated, Tensor paused, Tensor cancel, "
        "Tensor num_computed, Tensor pages_held, Tensor service_class, Tensor priority, Tensor ttft_deadline, "
        "Tensor arrival, Tensor? mirror_free, int hold_below, int policy, int prio_base, int prio_bits, "
        "float first_rate) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        &plan_head);
  m.def("plan_hand_out(Tensor live, Tensor seq_len, Tensor num_computed, Tensor prompt_logprobs, Tensor scored, "
        "Tensor prompt_len, Tensor room, Tensor service_class, Tensor priority, Tensor ttft_deadline, Tensor arrival, "
        "Tensor tpot_slo, Tensor cost, int budget, int floor, int prompt_rows, int policy, int prio_base, "
        "int prio_bits) -> (Tensor, Tensor?, Tensor, Tensor)",
        &plan_hand_out);
}
