// The commit's per-slot settle on the CPU, each as one call over the step's sampling rows: commit.settle (plain
// steps) and Speculation.settle (steps with drafts), the torch references in engine/core/commit.py and
// engine/core/speculation.py, whose ~60-90 small ops cost a few microseconds of dispatch each in the host mode.
// blink.engine.kernels.cpu_commit wraps these ops with the references' signatures; blink.engine.kernels.cpu builds
// this file with cpu.cpp, under torch.ops.blink_cpu.
//
// Each op follows its reference row by row, in the reference's order: every read of the state a reference makes
// before a write is made before that write here, and where rows collide on one entry the later row wins, as the
// reference's scatters do on the CPU. The invalid rows' writes into the token history's trash column are made too,
// so the whole state is the reference's.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// SlotStatus and Finish (engine/core/state.py, shared/slot_table.py): settle_codes hands them to the wrapper, which
// refuses to run should they differ from Python's.
constexpr int64_t RUNNING = 2, FINISHED = 3;
constexpr int64_t STOP = 1, LENGTH = 2, ABORT = 3;

void check_tensor(const at::Tensor& t, at::ScalarType type, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "blink_cpu::", op, ": ", name, " must be on the CPU, not ", t.device());
  TORCH_CHECK(t.scalar_type() == type, "blink_cpu::", op, ": ", name, " must be ", type, ", not ", t.scalar_type());
}

// A [n...] tensor read as a flat array (n entries at least, contiguous).
template <typename T>
T* flat(const at::Tensor& t, at::ScalarType type, int64_t n, const char* op, const char* name) {
  check_tensor(t, type, op, name);
  TORCH_CHECK(t.dim() == 1 && t.size(0) >= n && t.is_contiguous(), "blink_cpu::", op, ": ", name,
              " must be a contiguous vector of ", n, " entries at least, not ", t.sizes());
  return t.data_ptr<T>();
}

// A [rows, n] tensor whose rows are contiguous.
template <typename T>
T* table(const at::Tensor& t, at::ScalarType type, int64_t rows, const char* op, const char* name) {
  check_tensor(t, type, op, name);
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && (t.stride(1) == 1 || t.size(1) <= 1), "blink_cpu::", op, ": ",
              name, " must be [", rows, ", n] with contiguous rows, not ", t.sizes());
  return t.data_ptr<T>();
}

// The slot state both settles read and write ([S] each unless said).
struct State {
  int64_t S, max_len, tokens_stride, vocab, counts_stride, stops, stops_stride;
  int32_t* tokens;  // [S, max_len + 1], the last column the trash
  int64_t* seq_len;
  int32_t* output_counts;  // [S, vocab]
  const int64_t* max_tokens;
  const int64_t* prompt_len;
  const int64_t* stop_ids;  // [S, stops], -1 where none
  const bool* ignore_eos;
  int64_t* status;
  const bool* cancel;
  int64_t* finish_reason;
  const int64_t* eos;
  int64_t num_eos;

  State(const char* op, const at::Tensor& tokens_, const at::Tensor& seq_len_, const at::Tensor& output_counts_,
        const at::Tensor& max_tokens_, const at::Tensor& prompt_len_, const at::Tensor& stop_ids_,
        const at::Tensor& ignore_eos_, const at::Tensor& status_, const at::Tensor& cancel_,
        const at::Tensor& finish_reason_, const at::Tensor& eos_ids) {
    S = seq_len_.size(0);
    seq_len = flat<int64_t>(seq_len_, at::kLong, S, op, "seq_len");
    tokens = table<int32_t>(tokens_, at::kInt, S, op, "tokens");
    max_len = tokens_.size(1) - 1;
    TORCH_CHECK(max_len >= 0, "blink_cpu::", op, ": tokens needs its trash column");
    tokens_stride = tokens_.stride(0);
    output_counts = table<int32_t>(output_counts_, at::kInt, S, op, "output_counts");
    vocab = output_counts_.size(1);
    counts_stride = output_counts_.stride(0);
    max_tokens = flat<int64_t>(max_tokens_, at::kLong, S, op, "max_tokens");
    prompt_len = flat<int64_t>(prompt_len_, at::kLong, S, op, "prompt_len");
    stop_ids = table<int64_t>(stop_ids_, at::kLong, S, op, "stop_ids");
    stops = stop_ids_.size(1);
    stops_stride = stop_ids_.stride(0);
    ignore_eos = flat<bool>(ignore_eos_, at::kBool, S, op, "ignore_eos");
    status = flat<int64_t>(status_, at::kLong, S, op, "status");
    cancel = flat<bool>(cancel_, at::kBool, S, op, "cancel");
    finish_reason = flat<int64_t>(finish_reason_, at::kLong, S, op, "finish_reason");
    num_eos = eos_ids.numel();
    eos = flat<int64_t>(eos_ids, at::kLong, num_eos, op, "eos_ids");
  }

  // commit.ends_request for one row: its token stops the request (a stop id, or eos unless ignored).
  bool stops_request(int64_t s, int64_t tok) const {
    const int64_t* ids = stop_ids + s * stops_stride;
    for (int64_t j = 0; j < stops; ++j) {
      if (ids[j] == tok) return true;
    }
    if (ignore_eos[s]) return false;
    for (int64_t e = 0; e < num_eos; ++e) {
      if (eos[e] == tok) return true;
    }
    return false;
  }
  // ... and the request is at its length limit once its sequence is n long.
  bool too_long(int64_t s, int64_t n) const { return n - prompt_len[s] >= max_tokens[s] || n >= max_len; }

  void write_token(const char* op, int64_t s, int64_t column, int64_t tok) {
    TORCH_CHECK(column >= 0 && column <= max_len, "blink_cpu::", op, ": token position ", column, " of slot ", s,
                " is past the history's ", max_len + 1, " columns");
    tokens[s * tokens_stride + column] = static_cast<int32_t>(tok);
  }
  void count_token(const char* op, int64_t s, int64_t tok) {
    TORCH_CHECK(tok >= 0 && tok < vocab, "blink_cpu::", op, ": token ", tok, " is outside the vocabulary of ", vocab);
    output_counts[s * counts_stride + tok] += 1;
  }
  // A running slot cancelled ends now unless the step ended it; a slot with a reason is FINISHED with it.
  int64_t finish(int64_t s, int64_t reason) {
    if (status[s] == RUNNING && cancel[s] && reason == 0) reason = ABORT;
    if (reason != 0) {
      finish_reason[s] = reason;
      status[s] = FINISHED;
    }
    return reason;
  }
};

// The sampling rows: slot, whether the row sampled, its token; and the sampler's logprobs when the step has them.
struct Rows {
  int64_t R;
  const int64_t* slot;
  const bool* sampled;
  const int64_t* token;
  const float* logprob = nullptr;
  const int64_t* top_ids = nullptr;
  const float* top_logprobs = nullptr;
  bool with_logprobs = false;  // not logprob != nullptr: an empty tensor's data is null
  int64_t top = 0, ids_row = 0, ids_col = 0, lps_row = 0, lps_col = 0;

  Rows(const char* op, int64_t rows, int64_t S, const at::Tensor& sample_slot, const at::Tensor& sample_valid,
       const at::Tensor& sampled_tokens, const c10::optional<at::Tensor>& logprob_,
       const c10::optional<at::Tensor>& top_ids_, const c10::optional<at::Tensor>& top_logprobs_)
      : R(rows) {
    TORCH_CHECK(rows >= 0, "blink_cpu::", op, ": rows must be 0 or more, not ", rows);
    slot = flat<int64_t>(sample_slot, at::kLong, R, op, "sample_slot");
    sampled = flat<bool>(sample_valid, at::kBool, R, op, "sample_valid");
    token = flat<int64_t>(sampled_tokens, at::kLong, R, op, "the sampled tokens");
    for (int64_t r = 0; r < R; ++r) {
      TORCH_CHECK(slot[r] >= 0 && slot[r] < S, "blink_cpu::", op, ": row ", r, "'s slot ", slot[r], " is not one of ",
                  S);
    }
    TORCH_CHECK(logprob_.has_value() == top_ids_.has_value() && top_ids_.has_value() == top_logprobs_.has_value(),
                "blink_cpu::", op, ": the logprob, top ids and top logprobs come together");
    with_logprobs = logprob_.has_value();
    if (!with_logprobs) return;
    logprob = flat<float>(*logprob_, at::kFloat, R, op, "logprob");
    check_tensor(*top_ids_, at::kLong, op, "top_ids");
    check_tensor(*top_logprobs_, at::kFloat, op, "top_logprobs");
    TORCH_CHECK(top_ids_->dim() == 2 && top_ids_->size(0) >= R && top_ids_->sizes() == top_logprobs_->sizes(),
                "blink_cpu::", op, ": top_ids and top_logprobs must be [rows, top] alike, not ", top_ids_->sizes(),
                " and ", top_logprobs_->sizes());
    top_ids = top_ids_->data_ptr<int64_t>();
    top_logprobs = top_logprobs_->data_ptr<float>();
    top = top_ids_->size(1);
    ids_row = top_ids_->stride(0), ids_col = top_ids_->stride(1);
    lps_row = top_logprobs_->stride(0), lps_col = top_logprobs_->stride(1);
  }

  bool logprobs() const { return with_logprobs; }
  // [n], [n, top] and [n, top] filled as the references' per_slot fills (0, -1, 0).
  std::vector<at::Tensor> logprob_outputs(int64_t n) const {
    const auto floats = at::TensorOptions().dtype(at::kFloat), longs = at::TensorOptions().dtype(at::kLong);
    return {at::full({n}, 0.0, floats), at::full({n, top}, -1, longs), at::full({n, top}, 0.0, floats)};
  }
  // Row r's logprobs into entry `at` of those outputs.
  void copy_logprobs(int64_t r, int64_t at, std::vector<at::Tensor>& out) const {
    out[0].data_ptr<float>()[at] = logprob[r];
    int64_t* ids = out[1].data_ptr<int64_t>() + at * top;
    float* lps = out[2].data_ptr<float>() + at * top;
    for (int64_t t = 0; t < top; ++t) {
      ids[t] = top_ids[r * ids_row + t * ids_col];
      lps[t] = top_logprobs[r * lps_row + t * lps_col];
    }
  }
};

// commit.settle: [token, reason, row_slot] and, when the step computed logprobs, [logprob, top_ids, top_logprobs]
// per slot after them.
std::vector<at::Tensor> settle_slots(const at::Tensor& sample_slot, const at::Tensor& sample_valid, int64_t rows,
                                     const at::Tensor& sampled_tokens, const c10::optional<at::Tensor>& logprob,
                                     const c10::optional<at::Tensor>& top_ids,
                                     const c10::optional<at::Tensor>& top_logprobs, const at::Tensor& eos_ids,
                                     bool count_outputs, const at::Tensor& tokens, const at::Tensor& seq_len,
                                     const at::Tensor& output_counts, const at::Tensor& max_tokens,
                                     const at::Tensor& prompt_len, const at::Tensor& stop_ids,
                                     const at::Tensor& ignore_eos, const at::Tensor& status, const at::Tensor& cancel,
                                     const at::Tensor& finish_reason) {
  const char* op = "settle_slots";
  State st(op, tokens, seq_len, output_counts, max_tokens, prompt_len, stop_ids, ignore_eos, status, cancel,
           finish_reason, eos_ids);
  const Rows in(op, rows, st.S, sample_slot, sample_valid, sampled_tokens, logprob, top_ids, top_logprobs);
  const int64_t S = st.S, R = in.R;
  const auto longs = at::TensorOptions().dtype(at::kLong);
  at::Tensor token = at::full({S}, -1, longs), reason = at::zeros({S}, longs), row_slot = at::empty({R}, longs);
  int64_t* token_out = token.data_ptr<int64_t>();
  int64_t* reason_out = reason.data_ptr<int64_t>();
  int64_t* row_slot_out = row_slot.data_ptr<int64_t>();
  std::vector<at::Tensor> lp = in.logprobs() ? in.logprob_outputs(S) : std::vector<at::Tensor>{};

  // max_tokens 0 (the prompt's logprobs only): the row ends its request without a token. Each row's position is
  // its slot's length before any row's token counts, as the reference's one gather reads it.
  auto valid = [&](int64_t r) { return in.sampled[r] && st.max_tokens[in.slot[r]] > 0; };
  for (int64_t r = 0; r < R; ++r) {
    const int64_t s = in.slot[r];
    st.write_token(op, s, valid(r) ? st.seq_len[s] : st.max_len, in.token[r]);
  }
  for (int64_t r = 0; r < R; ++r) {
    if (valid(r)) st.seq_len[in.slot[r]] += 1;
  }
  if (count_outputs) {
    for (int64_t r = 0; r < R; ++r) {
      if (valid(r)) st.count_token(op, in.slot[r], in.token[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t s = in.slot[r], tok = in.token[r];
    row_slot_out[r] = valid(r) ? s : -1;
    if (!in.sampled[r]) continue;
    const bool stopped = valid(r) && st.stops_request(s, tok);
    reason_out[s] = stopped ? STOP : st.too_long(s, st.seq_len[s]) ? LENGTH : 0;
    if (!valid(r)) continue;
    token_out[s] = tok;
    if (in.logprobs()) in.copy_logprobs(r, s, lp);
  }
  for (int64_t s = 0; s < S; ++s) {
    reason_out[s] = st.finish(s, reason_out[s]);
    if (reason_out[s] == ABORT) token_out[s] = -1;  // aborts emit nothing
  }
  std::vector<at::Tensor> out{token, reason, row_slot};
  out.insert(out.end(), lp.begin(), lp.end());
  return out;
}

// Speculation.settle: [token, reason, row_slot, run tokens, run counts] and, when the step computed logprobs, the
// runs' [logprob, top_ids, top_logprobs] after them; runs are [S, K + 1].
std::vector<at::Tensor> settle_runs(const at::Tensor& sample_slot, const at::Tensor& sample_valid,
                                    const at::Tensor& sample_token, const at::Tensor& token_pos, int64_t rows,
                                    const at::Tensor& sampled_tokens, const c10::optional<at::Tensor>& logprob,
                                    const c10::optional<at::Tensor>& top_ids,
                                    const c10::optional<at::Tensor>& top_logprobs, const at::Tensor& eos_ids,
                                    bool count_outputs, int64_t K, double decay, const at::Tensor& tokens,
                                    const at::Tensor& seq_len, const at::Tensor& num_computed,
                                    const at::Tensor& draft_len, const at::Tensor& draft_n,
                                    const at::Tensor& output_counts,
                                    const at::Tensor& max_tokens, const at::Tensor& prompt_len,
                                    const at::Tensor& stop_ids, const at::Tensor& ignore_eos, const at::Tensor& status,
                                    const at::Tensor& cancel, const at::Tensor& finish_reason,
                                    const at::Tensor& spec_rate, const at::Tensor& spec_counts,
                                    const at::Tensor& spec_accepted_per_pos) {
  const char* op = "settle_runs";
  State st(op, tokens, seq_len, output_counts, max_tokens, prompt_len, stop_ids, ignore_eos, status, cancel,
           finish_reason, eos_ids);
  const Rows in(op, rows, st.S, sample_slot, sample_valid, sampled_tokens, logprob, top_ids, top_logprobs);
  const int64_t S = st.S, R = in.R, run = K + 1;
  TORCH_CHECK(K >= 0, "blink_cpu::", op, ": K must be 0 or more, not ", K);
  const int64_t* sample_tok = flat<int64_t>(sample_token, at::kLong, R, op, "sample_token");
  const int64_t* pos = flat<int64_t>(token_pos, at::kLong, 0, op, "token_pos");
  const int64_t T = token_pos.size(0);
  int64_t* computed = flat<int64_t>(num_computed, at::kLong, S, op, "num_computed");
  int64_t* drafts = flat<int64_t>(draft_len, at::kLong, S, op, "draft_len");
  const int64_t* match = flat<int64_t>(draft_n, at::kLong, S, op, "draft_n");
  check_tensor(spec_rate, at::kFloat, op, "spec_rate");
  TORCH_CHECK(spec_rate.dim() == 2 && spec_rate.size(0) == S, "blink_cpu::", op,
              ": spec_rate must be [", S, ", n], a column per match length, not ", spec_rate.sizes());
  float* rate = spec_rate.data_ptr<float>();
  const int64_t rate_row = spec_rate.stride(0), rate_col = spec_rate.stride(1), lengths = spec_rate.size(1);
  int64_t* counters = flat<int64_t>(spec_counts, at::kLong, 3, op, "spec_counts");
  TORCH_CHECK(spec_accepted_per_pos.numel() > 0, "blink_cpu::", op, ": spec_accepted_per_pos needs an entry");
  const int64_t P = spec_accepted_per_pos.size(0);
  int64_t* per_pos = flat<int64_t>(spec_accepted_per_pos, at::kLong, P, op, "spec_accepted_per_pos");

  const auto longs = at::TensorOptions().dtype(at::kLong);
  at::Tensor first_token = at::empty({S}, longs), reason = at::zeros({S}, longs), row_slot = at::empty({R}, longs);
  at::Tensor run_tokens = at::full({S, run}, -1, longs), count = at::zeros({S}, longs);
  int64_t* first_out = first_token.data_ptr<int64_t>();
  int64_t* reason_out = reason.data_ptr<int64_t>();
  int64_t* row_slot_out = row_slot.data_ptr<int64_t>();
  int64_t* run_out = run_tokens.data_ptr<int64_t>();
  int64_t* emitted = count.data_ptr<int64_t>();  // each slot's emitted tokens, then its count
  std::vector<at::Tensor> lp = in.logprobs() ? in.logprob_outputs(S * run) : std::vector<at::Tensor>{};
  if (in.logprobs()) {
    lp[0] = lp[0].view({S, run});
    lp[1] = lp[1].view({S, run, in.top});
    lp[2] = lp[2].view({S, run, in.top});
  }

  // Per row: its offset in its slot's run, its slot's first row, and its flags; the `earlier` counts are how many
  // rows before it broke the run or ended the request (an exclusive running count, as the reference's cumsum).
  enum Flag : uint8_t { BREAKS = 1, STOPPED = 2, TOO_LONG = 4, LIVE = 8, VALID = 16 };
  std::vector<int64_t> offset(R), first(R), breaks_before(R + 1, 0), ends_before(R + 1, 0);
  std::vector<uint8_t> flags(R, 0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t s = in.slot[r], seq = st.seq_len[s], tok = in.token[r];
    TORCH_CHECK(sample_tok[r] >= 0 && sample_tok[r] < T, "blink_cpu::", op, ": row ", r, "'s token ", sample_tok[r],
                " is not one of the batch's ", T);
    const int64_t i = in.sampled[r] ? pos[sample_tok[r]] - (seq - 1) : 0;
    TORCH_CHECK(i >= 0, "blink_cpu::", op, ": row ", r, " is before its slot's last committed token");
    offset[r] = i;
    first[r] = std::max<int64_t>(r - i, 0);
    const int64_t draft_next = st.tokens[s * st.tokens_stride + std::min(seq + i, st.max_len)];
    uint8_t f = 0;
    if (in.sampled[r] && (i >= drafts[s] || tok != draft_next)) f |= BREAKS;  // the correction, or the bonus token
    if (st.stops_request(s, tok)) f |= STOPPED;
    if (st.too_long(s, seq + i + 1)) f |= TOO_LONG;
    flags[r] = f;
    breaks_before[r + 1] = breaks_before[r] + ((f & BREAKS) != 0);
    ends_before[r + 1] = ends_before[r] + ((f & (STOPPED | TOO_LONG)) != 0);
  }
  auto earlier = [&](const std::vector<int64_t>& before, int64_t r) { return before[r] > before[first[r]]; };
  for (int64_t r = 0; r < R; ++r) {
    const int64_t s = in.slot[r];
    if (in.sampled[r] && !earlier(breaks_before, r) && !earlier(ends_before, r)) {
      flags[r] |= LIVE;
      if (st.max_tokens[s] > 0) flags[r] |= VALID;
    }
  }
  // Every draft read above before a row's token overwrites it.
  for (int64_t r = 0; r < R; ++r) {
    const int64_t s = in.slot[r];
    const bool valid = flags[r] & VALID;
    st.write_token(op, s, valid ? st.seq_len[s] + offset[r] : st.max_len, in.token[r]);
    row_slot_out[r] = valid ? s : -1;
    if (valid) emitted[s] += 1;
  }
  if (count_outputs) {
    for (int64_t r = 0; r < R; ++r) {
      if (flags[r] & VALID) st.count_token(op, in.slot[r], in.token[r]);
    }
  }

  // vLLM's counters (drafts, draft tokens, accepted tokens, accepted per position) and each slot's rate.
  std::vector<int64_t> accepted(S, 0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t s = in.slot[r], i = offset[r];
    if (in.sampled[r] && i < drafts[s] && !(flags[r] & BREAKS) && !earlier(breaks_before, r)) {
      accepted[s] += 1;
      per_pos[std::min(i, P - 1)] += 1;
    }
  }
  const float past = static_cast<float>(decay), now = static_cast<float>(1.0 - decay);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t k = drafts[s];
    counters[0] += k > 0;
    counters[1] += k;
    counters[2] += accepted[s];
    // The rate of the match length the drafts followed (column draft_n - 1), as the reference's gather finds it.
    const int64_t c = std::max<int64_t>(match[s] - 1, 0);
    TORCH_CHECK(c < lengths, "blink_cpu::", op, ": slot ", s, "'s draft_n ", match[s], " is past spec_rate's ",
                lengths, " match lengths");
    float& r = rate[s * rate_row + c * rate_col];
    // float32 as the reference: decay * rate + ((1 - decay) * a) / tried, tried = min(a + 1, k) (up to the first
    // draft that failed)
    const int64_t tried = std::min(accepted[s] + 1, k);
    if (k > 0) r = past * r + now * static_cast<float>(accepted[s]) / static_cast<float>(tried);
  }

  // A slot's reason: the largest of its live rows'.
  for (int64_t r = 0; r < R; ++r) {
    if (!(flags[r] & LIVE)) continue;
    const int64_t f = flags[r];
    const int64_t row_reason = (f & STOPPED) && (f & VALID) ? STOP : (f & TOO_LONG) ? LENGTH : 0;
    reason_out[in.slot[r]] = std::max(reason_out[in.slot[r]], row_reason);
  }
  for (int64_t s = 0; s < S; ++s) {
    const int64_t k = drafts[s];
    // Valid KV: the last committed token and the accepted drafts; the rest is overwritten when recomputed.
    if (k > 0) computed[s] -= std::max<int64_t>(k + 1 - emitted[s], 0);
    st.seq_len[s] += emitted[s];
    drafts[s] = 0;
    reason_out[s] = st.finish(s, reason_out[s]);
    if (reason_out[s] == ABORT) emitted[s] = 0;  // aborts emit nothing
  }

  // The runs: entry i of a slot is its valid row at offset i.
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = offset[r];
    if (!(flags[r] & VALID) || i > K) continue;
    const int64_t at = in.slot[r] * run + i;
    run_out[at] = in.token[r];
    if (in.logprobs()) in.copy_logprobs(r, at, lp);
  }
  for (int64_t s = 0; s < S; ++s) first_out[s] = emitted[s] > 0 ? run_out[s * run] : -1;
  std::vector<at::Tensor> out{first_token, reason, row_slot, run_tokens, count};
  out.insert(out.end(), lp.begin(), lp.end());
  return out;
}

std::vector<int64_t> settle_codes() { return {RUNNING, FINISHED, STOP, LENGTH, ABORT}; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(blink_cpu, m) {
  m.def("settle_codes() -> int[]", &settle_codes);
  m.def("settle_slots(Tensor sample_slot, Tensor sample_valid, int rows, Tensor sampled_tokens, Tensor? logprob, "
        "Tensor? top_ids, Tensor? top_logprobs, Tensor eos_ids, bool count_outputs, Tensor(a!) tokens, "
        "Tensor(b!) seq_len, Tensor(c!) output_counts, Tensor max_tokens, Tensor prompt_len, Tensor stop_ids, "
        "Tensor ignore_eos, Tensor(d!) status, Tensor cancel, Tensor(e!) finish_reason) -> Tensor[]",
        &settle_slots);
  m.def("settle_runs(Tensor sample_slot, Tensor sample_valid, Tensor sample_token, Tensor token_pos, int rows, "
        "Tensor sampled_tokens, Tensor? logprob, Tensor? top_ids, Tensor? top_logprobs, Tensor eos_ids, "
        "bool count_outputs, int K, float decay, Tensor(a!) tokens, Tensor(b!) seq_len, Tensor(c!) num_computed, "
        "Tensor(d!) draft_len, Tensor draft_n, Tensor(e!) output_counts, Tensor max_tokens, Tensor prompt_len, "
        "Tensor stop_ids, Tensor ignore_eos, Tensor(f!) status, Tensor cancel, Tensor(g!) finish_reason, "
        "Tensor(h!) spec_rate, Tensor(i!) spec_counts, Tensor(j!) spec_accepted_per_pos) -> Tensor[]",
        &settle_runs);
}
