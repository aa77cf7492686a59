// The plan's last part for the CPU's host mode in one call: blink.engine.core.scheduler._lay_out (the torch reference,
// about seventy small ops) as scalar loops over the slots and the batch's tokens (blink.engine.kernels.cpu_lay_out
// wraps it; blink.engine.kernels.cpu builds it into torch.ops.blink_cpu). The same outputs, padding included: the
// batch's tokens flat, the decode, chunk and sampling rows, the sizes; with drafts a sampling row per token of each run
// from its last committed one on, and the runs' tokens as decode rows where the attention asks for that (decode_runs).
#include <ATen/core/Tensor.h>
#include <ATen/EmptyTensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace blink_cpu {
namespace {

constexpr int64_t kQueryBlock = 64;  // scheduler.QUERY_BLOCK: prefill chunks are attended in blocks of this many

void check_slots(const at::Tensor& x, const char* name, int64_t S) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kLong && x.dim() == 1 && x.size(0) == S &&
                  x.is_contiguous(),
              "lay_out_plan: ", name, " must be a contiguous int64 CPU tensor of ", S, " slots");
}

}  // namespace

// Returns token_slot, token_pos, token_valid, input_ids; the decode rows' start, length, first_pos, slot and count; the
// chunk rows' five; sample_slot, sample_token, sample_valid; and the packed sizes (PlanSizes's fields in order, the
// counts 0-d views of them), as scheduler._lay_out computes them.
std::vector<at::Tensor> lay_out_plan(const at::Tensor& take_t, const at::Tensor& computed_t, const at::Tensor& seq_t,
                                     const at::Tensor& draft_t, const at::Tensor& tokens_t,
                                     const std::optional<at::Tensor>& entries_t, const at::Tensor& moved_t,
                                     int64_t T, int64_t draft_rows, bool decode_runs) {
  const int64_t S = take_t.numel();
  TORCH_CHECK(S >= 1 && T >= 1, "lay_out_plan: needs a slot and a token budget of at least 1");
  TORCH_CHECK(draft_rows >= 0, "lay_out_plan: draft_rows must be at least 0");
  check_slots(take_t, "take", S);
  check_slots(computed_t, "num_computed", S);
  check_slots(seq_t, "seq_len", S);
  check_slots(draft_t, "draft_len", S);
  if (entries_t) check_slots(*entries_t, "entries", S);
  TORCH_CHECK(moved_t.device().is_cpu() && moved_t.scalar_type() == at::kLong && moved_t.numel() == 2 &&
                  moved_t.is_contiguous(),
              "lay_out_plan: moved must be two int64 counts on the CPU");
  TORCH_CHECK(tokens_t.device().is_cpu() && tokens_t.scalar_type() == at::kInt && tokens_t.dim() == 2 &&
                  tokens_t.size(0) == S && tokens_t.stride(1) == 1,
              "lay_out_plan: tokens must be an int32 CPU tensor [slots, length] with contiguous rows");
  const int64_t* take = take_t.data_ptr<int64_t>();
  const int64_t* computed = computed_t.data_ptr<int64_t>();
  const int64_t* seq = seq_t.data_ptr<int64_t>();
  const int64_t* drafts = draft_t.data_ptr<int64_t>();
  const int32_t* tokens = tokens_t.data_ptr<int32_t>();
  const int64_t width = tokens_t.size(1), row_stride = tokens_t.stride(0);
  const bool with_drafts = draft_rows > 0, runs = with_drafts && decode_runs;

  // Each slot's first batch token (starts), and whether it samples: its tokens reach its sequence's end (with drafts,
  // past them), as the reference's `samples`.
  std::vector<int64_t> starts(S + 1);
  int64_t total = 0;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(take[s] >= 0, "lay_out_plan: take must not be negative");
    starts[s] = total;
    total += take[s];
  }
  starts[S] = total;
  auto samples = [&](int64_t s) { return take[s] > 0 && computed[s] + take[s] == seq[s] + drafts[s]; };
  auto in_run = [&](int64_t s) { return take[s] > 0 && take[s] == 1 + drafts[s]; };

  // The outputs, allocated past the dispatcher (a microsecond of sixteen at::empty's, a tenth of the call).
  auto longs = [](int64_t n) { return at::detail::empty_cpu({n}, at::kLong, {}, {}, {}, {}); };
  auto bools = [](int64_t n) { return at::detail::empty_cpu({n}, at::kBool, {}, {}, {}, {}); };
  const int64_t R = with_drafts ? std::min(draft_rows, T) : S;  // the rows packed from T tokens or S slots
  const int64_t D = runs ? R : S;                                // decode rows
  const int64_t M = T / kQueryBlock + S;                         // scheduler.max_chunk_rows
  const int64_t per_slot = T / kQueryBlock + 1;
  at::Tensor token_slot_t = longs(T), token_pos_t = longs(T);
  at::Tensor token_valid_t = bools(T), input_ids_t = longs(T);
  std::vector<at::Tensor> out = {token_slot_t, token_pos_t, token_valid_t, input_ids_t};
  at::Tensor sizes_t = longs(7);  // PlanSizes's fields; the rows' counts are views of two
  for (int i = 0; i < 4; ++i) out.push_back(longs(D));
  out.push_back(sizes_t.select(0, 2));
  for (int i = 0; i < 4; ++i) out.push_back(longs(M));
  out.push_back(sizes_t.select(0, 3));
  at::Tensor sample_slot_t = longs(R), sample_token_t = longs(R);
  at::Tensor sample_valid_t = bools(with_drafts ? draft_rows : S);
  out.insert(out.end(), {sample_slot_t, sample_token_t, sample_valid_t, sizes_t});
  int64_t* token_slot = token_slot_t.data_ptr<int64_t>();
  int64_t* token_pos = token_pos_t.data_ptr<int64_t>();
  bool* token_valid = token_valid_t.data_ptr<bool>();
  int64_t* input_ids = input_ids_t.data_ptr<int64_t>();
  int64_t *decode_start = out[4].data_ptr<int64_t>(), *decode_length = out[5].data_ptr<int64_t>();
  int64_t *decode_first = out[6].data_ptr<int64_t>(), *decode_slot = out[7].data_ptr<int64_t>();
  int64_t *chunk_start = out[9].data_ptr<int64_t>(), *chunk_length = out[10].data_ptr<int64_t>();
  int64_t *chunk_first = out[11].data_ptr<int64_t>(), *chunk_slot = out[12].data_ptr<int64_t>();
  int64_t* sample_slot = sample_slot_t.data_ptr<int64_t>();
  int64_t* sample_token = sample_token_t.data_ptr<int64_t>();
  bool* sample_valid = sample_valid_t.data_ptr<bool>();

  // The batch's tokens, slot after slot: a token's slot is how many slots end at or before it (searchsorted, right),
  // the last slot past the live ones. With drafts the sampling rows and the runs' decode rows come in batch order.
  int64_t slot = 0, max_context = 0, num_decodes = 0, num_samples = 0;
  for (int64_t t = 0; t < T; ++t) {
    while (slot < S && starts[slot + 1] <= t) ++slot;
    const int64_t s = std::min(slot, S - 1);
    const bool valid = t < total;
    const int64_t pos = valid ? computed[s] + t - starts[s] : 0;
    TORCH_CHECK(pos >= 0 && pos < width, "lay_out_plan: slot ", s, "'s position ", pos, " is outside its tokens");
    token_slot[t] = s;
    token_pos[t] = pos;
    token_valid[t] = valid;
    input_ids[t] = tokens[s * row_stride + pos];
    if (!valid) continue;
    max_context = std::max(max_context, pos + 1);
    if (with_drafts && samples(s) && pos >= seq[s] - 1) {
      if (num_samples < R) sample_token[num_samples] = t;
      ++num_samples;
    }
    if (runs && in_run(s)) {
      if (num_decodes < R) decode_start[num_decodes] = t;
      ++num_decodes;
    }
  }

  if (runs) {  // each token of a run a decode row; the padding is batch token 0's
    for (int64_t r = 0; r < R; ++r) {
      const int64_t t = r < num_decodes ? decode_start[r] : 0;
      decode_start[r] = t;
      decode_length[r] = 1;
      decode_first[r] = token_pos[t];
      decode_slot[r] = token_slot[t];
    }
  } else {  // a decode row per slot computing one token; the padding is slot 0's
    for (int64_t s = 0; s < S; ++s) {
      if (take[s] != 1) continue;
      decode_start[num_decodes] = starts[s];
      decode_length[num_decodes] = take[s];
      decode_first[num_decodes] = computed[s];
      decode_slot[num_decodes] = s;
      ++num_decodes;
    }
    for (int64_t r = num_decodes; r < S; ++r) {
      decode_start[r] = starts[0];
      decode_length[r] = take[0];
      decode_first[r] = computed[0];
      decode_slot[r] = 0;
    }
  }

  if (with_drafts) {  // the token loop packed the rows' tokens
    for (int64_t r = 0; r < R; ++r) {
      const int64_t t = r < num_samples ? sample_token[r] : 0;
      sample_token[r] = t;
      sample_slot[r] = token_slot[t];
    }
    for (int64_t r = 0; r < draft_rows; ++r) sample_valid[r] = r < num_samples;
  } else {  // a row per sampling slot: its last token
    for (int64_t s = 0; s < S; ++s) {
      if (!samples(s)) continue;
      sample_slot[num_samples] = s;
      sample_token[num_samples] = starts[s + 1] - 1;
      ++num_samples;
    }
    for (int64_t r = 0; r < S; ++r) {
      if (r >= num_samples) sample_slot[r] = sample_token[r] = 0;
      sample_valid[r] = r < num_samples;
    }
  }

  // The chunks (every multi-token run that is not a run of decode rows) in blocks of QUERY_BLOCK queries, the last
  // one shorter; at most per_slot blocks a slot and M in all, as the reference's mask and cut; the padding is slot 0's.
  auto chunk_take = [&](int64_t s) { return runs && in_run(s) ? int64_t{0} : take[s]; };
  int64_t num_chunks = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = chunk_take(s);
    const int64_t blocks = n > 1 ? std::min((n + kQueryBlock - 1) / kQueryBlock, per_slot) : 0;
    for (int64_t j = 0; j < blocks; ++j, ++num_chunks) {
      if (num_chunks >= M) continue;
      const int64_t offset = j * kQueryBlock;
      chunk_start[num_chunks] = starts[s] + offset;
      chunk_length[num_chunks] = std::min(n - offset, kQueryBlock);
      chunk_first[num_chunks] = computed[s] + offset;
      chunk_slot[num_chunks] = s;
    }
  }
  for (int64_t r = num_chunks; r < M; ++r) {
    chunk_start[r] = starts[0];
    chunk_length[r] = std::min(chunk_take(0), kQueryBlock);
    chunk_first[r] = computed[0];
    chunk_slot[r] = 0;
  }

  int64_t prompt_entries = 0;
  if (entries_t) {
    const int64_t* entries = entries_t->data_ptr<int64_t>();
    for (int64_t s = 0; s < S; ++s) prompt_entries += entries[s];
  }
  const int64_t* moved = moved_t.data_ptr<int64_t>();
  int64_t* sizes = sizes_t.data_ptr<int64_t>();
  sizes[0] = total;
  sizes[1] = max_context;
  sizes[2] = num_decodes;
  sizes[3] = num_chunks;
  sizes[4] = moved[0];
  sizes[5] = moved[1];
  sizes[6] = prompt_entries;
  return out;
}

TORCH_LIBRARY_FRAGMENT(blink_cpu, m) {
  m.def("lay_out_plan(Tensor take, Tensor num_computed, Tensor seq_len, Tensor draft_len, Tensor tokens, "
        "Tensor? entries, Tensor moved, int token_budget, int draft_rows, bool decode_runs) -> Tensor[]",
        &lay_out_plan);
}

}  // namespace blink_cpu
