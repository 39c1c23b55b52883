// session_state.h: what a decoding session holds (core/sessions/session.h), and the
// pool its blocks come from (internal to the engine: session.cc opens and
// validates, session_steps.cc runs the steps).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "core/kernels/float16.h"
#include "core/sessions/session.h"

namespace attention {

class KvBlockPool::Impl {
 public:
  Impl(int64_t capacity_bytes, Reclaim reclaim)
      : capacity_bytes_(capacity_bytes), reclaim_(std::move(reclaim)) {}
  ~Impl();

  int64_t capacity_bytes() const { return capacity_bytes_; }
  int64_t used_bytes() const;

  // Appends `count` blocks of kKvBlockRows x `width` floats to `blocks`, all
  // or none. When they do not fit, asks the Reclaim for room as long as it
  // ends sessions; then RESOURCE_EXHAUSTED naming the capacity (PoolWasFull).
  absl::Status Allocate(int64_t width, int64_t count, std::vector<float*>& blocks,
                        const Session* asking);
  void Release(int64_t width, std::span<float* const> blocks);

 private:
  // Moves `count` blocks of `width` into `blocks`, kept ones first; the
  // caller holds mu_ and checked they fit.
  void TakeLocked(int64_t width, int64_t count, std::vector<float*>& blocks);
  // Frees kept blocks until held and kept blocks fit in the budget.
  void MakeRoom();

  const int64_t capacity_bytes_;
  const Reclaim reclaim_;  // null: a full pool refuses
  mutable std::mutex mu_;
  int64_t used_bytes_ = 0;                       // held by sessions
  int64_t kept_bytes_ = 0;                       // freed, kept for reuse
  std::map<int64_t, std::vector<float*>> kept_;  // by width
};

namespace internal {

// One example's rows of one tensor of a session's memory: row t is row
// t % kKvBlockRows of blocks[t / kKvBlockRows]. A row of `width` elements is
// cut into `heads` slices of width / heads (a kv head's), and a block holds
// its rows head-major, [head][row][width / heads], as vLLM's paged cache
// does: one head's keys are contiguous within a block, so the task that
// reads that head streams them. Row-major blocks would put a head's slices
// a whole row apart, each on a page of its own at 4 KiB rows, where the
// hardware prefetchers (which stay within a page) never run ahead.
// Elements are `dtype`'s: float32, or 16 bits (bfloat16, float16) rounded
// once by Put, so a 16-bit block is half the bytes (StoredWidth).
struct BlockRows {
  std::vector<float*> blocks;
  // Blocks [0, dropped) went back to the pool (null here): their rows are
  // behind every later query's sliding window.
  int64_t dropped = 0;
  KvDtype dtype = KvDtype::kFloat32;

  // Element offset of head h's slice of row t in its block.
  static int64_t Offset(int64_t t, int64_t width, int64_t heads, int64_t h) {
    return (h * kKvBlockRows + t % kKvBlockRows) * (width / heads);
  }
  // Head h's slice of row t of float32 rows; the block's next rows of that
  // head follow it.
  float* Head(int64_t t, int64_t width, int64_t heads, int64_t h) const {
    return blocks[t / kKvBlockRows] + Offset(t, width, heads, h);
  }
  // The same of 16-bit rows.
  uint16_t* Head16(int64_t t, int64_t width, int64_t heads, int64_t h) const {
    return reinterpret_cast<uint16_t*>(blocks[t / kKvBlockRows]) + Offset(t, width, heads, h);
  }
  // Row t of float32 rows of one head: the block's next rows follow it.
  float* Row(int64_t t, int64_t width) const { return Head(t, width, 1, 0); }
  // Row t from `row` (`width` floats), each head's slice into its place,
  // rounded to the dtype.
  void Put(int64_t t, int64_t width, int64_t heads, const float* row) const {
    const int64_t slice = width / heads;
    for (int64_t h = 0; h < heads; ++h) {
      if (dtype == KvDtype::kFloat32) {
        std::copy_n(row + h * slice, slice, Head(t, width, heads, h));
        continue;
      }
      uint16_t* out = Head16(t, width, heads, h);
      for (int64_t c = 0; c < slice; ++c) out[c] = RoundKv(dtype, row[h * slice + c]);
    }
  }
  // Rows [t, t + count) of one head (all in t's block) as float32 rows of
  // `width`: in place for float32 rows, else widened into `widened`.
  const float* Rows(int64_t t, int64_t count, int64_t width, std::vector<float>& widened) const {
    if (dtype == KvDtype::kFloat32) return Row(t, width);
    widened.resize(count * width);
    const uint16_t* in = Head16(t, width, 1, 0);
    for (int64_t i = 0; i < count * width; ++i) widened[i] = WidenKv(dtype, in[i]);
    return widened.data();
  }
};

// Floats of a block row that holds `width` elements of `dtype`: the pool
// counts a block's bytes through it, so a 16-bit block takes half.
inline int64_t StoredWidth(int64_t width, KvDtype dtype) {
  return (width * KvDtypeBytes(dtype) + 3) / 4;
}

// Blocks that hold `rows` rows.
inline int64_t BlocksFor(int64_t rows) { return (rows + kKvBlockRows - 1) / kKvBlockRows; }

}  // namespace internal

class Session::State {
 public:
  State(std::shared_ptr<const Model> model, KvBlockPool::Impl& pool, SessionMemory memory,
        int64_t batch, KvDtype kv_dtype);
  ~State();

  // Blocks for `rows` rows of every example's keys and values, taken from
  // the pool all or none.
  absl::Status Reserve(int64_t rows);
  // Returns the blocks past those `rows` rows need.
  void Trim(int64_t rows);
  // Gives the pool back the blocks whose rows no later step can see: those
  // wholly before length - window + 1 (a windowed self session's memory
  // stays within window + 2 blocks per example).
  void DropBehindWindow();
  // The window every step attends through (the model's layer's, or a
  // dot_product session's own); 0: none.
  int64_t window() const;
  // The first key row still held (0 unless blocks were dropped).
  int64_t first_held_row() const;
  // Undoes a step that failed: the blocks past `length` go back to the pool
  // (rows written past it are not part of the session), and a dot_product
  // session with no rows forgets the row width its first step gave it.
  void Rollback();
  int64_t held_bytes() const;
  // Work units of a step (or a piece of one) with sizes `dims`
  // (RequestWork), less the projections of the keys before it, which the
  // session made once: all n_k for cross memory, the n_k - n_q before the
  // piece's own rows for self memory.
  double StepWork(const AttentionDims& dims) const;

  std::shared_ptr<const Model> model;
  KvBlockPool::Impl& pool;
  const Session* owner = nullptr;  // null until Open() made the Session
  const SessionMemory memory;
  const int64_t batch;
  // What the blocks hold per element (every example's keys and values).
  const KvDtype kv_dtype;
  int64_t length = 0;      // rows per example that steps have committed
  int64_t max_length = 0;  // 0: none
  std::optional<float> scale;
  // Floats per row of the key and value blocks (0 for a dot_product self
  // session until its first step gives d), and the sizes the model's inputs
  // have (d_k, d_v of the keys and values; for self memory, d_q). The
  // blocks hold what the scores read: multi_head's projections W x + b,
  // additive's W_k k, the other kinds' rows as given.
  int64_t key_width = 0, value_width = 0;
  int64_t key_size = 0, value_size = 0;
  // dot_product self memory: a row is its own key and value, held once
  // (unless the steps bring values of their own).
  bool values_are_keys = false;
  // dot_product self memory over grouped heads (4-D rows), fixed by the
  // first step: H query heads, H_kv kv heads (0: 3-D rows). key_size and
  // value_size are then one head's, key_width = H_kv key_size.
  int64_t heads = 0, kv_heads = 0;
  // The heads a key or value row of the blocks is cut into (BlockRows):
  // multi_head's kv heads, a grouped dot_product session's H_kv, else 1.
  int64_t row_heads() const;
  // dot_product self memory: the window and soft-cap of every step.
  int64_t sliding_window = 0;
  float softcap = 0;
  std::vector<int32_t> valid_lens;  // cross: empty or one per example
  // distance cross memory: -scale/2 |k|^2 of every key, per example.
  std::vector<std::vector<float>> key_bias;
  std::vector<internal::BlockRows> keys, values;  // per example
  // Session::MarkEnded's; any thread.
  mutable std::mutex ended_mu;
  absl::Status ended;
};

namespace internal {

// Appends `rows` tokens of random keys and values (uniform in [-1, 1), from
// `seed`) to every example of a self session whose first step fixed its row
// widths, with no attention computed for them: for benchmarks of steps at
// contexts whose prefill would cost minutes of causal attention. The rows
// are as a step would hold them, so later steps read them as any others.
absl::Status AppendUncomputed(Session& session, int64_t rows, uint32_t seed);

}  // namespace internal
}  // namespace attention
