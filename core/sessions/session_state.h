// session_state.h: what a decoding session holds (core/sessions/session.h), and the
// pool its blocks come from (internal to the engine: session.cc opens and
// validates, session_steps.cc runs the steps).
#pragma once

#include <algorithm>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "core/kernels/float16.h"
#include "core/sessions/session.h"

namespace attention {

// The key of a full block of a self session (KvBlockPool's prefix sharing):
// XXH3-128 of the key of the block before it, the session's parameters and
// the block's input rows, with a seed drawn when the pool is made. 128 bits
// suffice without comparing the rows themselves: the chance that any two of
// 2^40 blocks ever keyed collide is below 2^-48, and with the seed secret to
// the process a client cannot aim at another's key.
struct BlockKey {
  uint64_t low = 0, high = 0;
  bool operator==(const BlockKey&) const = default;
};

class KvBlockPool::Impl {
 public:
  Impl(int64_t capacity_bytes, Reclaim reclaim, bool prefix_sharing);
  ~Impl();

  int64_t capacity_bytes() const { return capacity_bytes_; }
  int64_t used_bytes() const;
  PrefixStats prefix_stats() const;
  bool prefix_sharing() const { return prefix_sharing_; }
  uint64_t seed() const { return seed_; }

  // Appends `count` blocks of kKvBlockRows x `width` floats to `blocks`, all
  // or none. When they do not fit, asks the Reclaim for room as long as it
  // ends sessions; then RESOURCE_EXHAUSTED naming the capacity (PoolWasFull).
  absl::Status Allocate(int64_t width, int64_t count, std::vector<float*>& blocks,
                        const Session* asking);
  // Gives up one holder of each block: a block with none left is kept for
  // reuse, or cached if keyed.
  void Release(int64_t width, std::span<float* const> blocks);

  // The block keyed `key`, with one more holder (from the cache, if no
  // session held it); null if there is none.
  float* Acquire(const BlockKey& key);
  // Keys `block`, held by the caller, unless it is keyed already or another
  // block has that key.
  void Publish(float* block, int64_t width, const BlockKey& key);
  // Output caching (Session::State::CacheOutputs): whether a block is keyed
  // `key`.
  bool Has(const BlockKey& key) const;
  // A block of `width` for a cache, held by the caller until CacheOutputs,
  // from room the pool has (kept blocks give way to it, cached ones do not)
  // without asking its Reclaim; null when there is none.
  float* TakeForCache(int64_t width);
  // Keys `block` (from TakeForCache, filled) and caches it with no holder,
  // the first of the cache to give way; freed if `key` has a block already.
  void CacheOutputs(float* block, int64_t width, const BlockKey& key);
  // A prompt's rows looked up, and those found.
  void CountLookup(int64_t queried, int64_t found);
  // A number for `model` that no other model object alive or gone ever
  // had, for keys: an address may be reused by a later model.
  uint64_t ModelSerial(const std::shared_ptr<const Model>& model);

 private:
  struct BlockKeyHash {
    size_t operator()(const BlockKey& key) const { return static_cast<size_t>(key.low); }
  };
  // A keyed block: its holders (0: cached, at `lru` in cached_, or in
  // cached_outputs_ for a block of outputs).
  struct Keyed {
    BlockKey key;
    int64_t width = 0;
    int64_t holders = 0;
    std::list<float*>::iterator lru;
    bool outputs = false;
  };
  // Frees the cached block at the front of `lru`.
  void EvictLocked(std::list<float*>& lru);

  // Moves `count` blocks of `width` into `blocks`, kept ones first; the
  // caller holds mu_ and checked they fit.
  void TakeLocked(int64_t width, int64_t count, std::vector<float*>& blocks);
  // Frees kept blocks, then cached outputs, then cached keys and values,
  // least recently freed first, until held, kept and cached blocks fit in
  // the budget: outputs only save time, keys and values a prompt's memory.
  void MakeRoom();

  const int64_t capacity_bytes_;
  const Reclaim reclaim_;  // null: a full pool refuses
  const bool prefix_sharing_;
  const uint64_t seed_;
  mutable std::mutex mu_;
  int64_t used_bytes_ = 0;                       // held by sessions
  int64_t kept_bytes_ = 0;                       // freed, kept for reuse
  std::map<int64_t, std::vector<float*>> kept_;  // by width
  int64_t shared_bytes_ = 0, cached_bytes_ = 0;
  int64_t query_tokens_ = 0, hit_tokens_ = 0;
  std::unordered_map<float*, Keyed> keyed_;
  std::unordered_map<BlockKey, float*, BlockKeyHash> by_key_;
  std::list<float*> cached_;  // keyed blocks no session holds, least recently freed first
  std::list<float*> cached_outputs_;  // the same, of outputs
  std::map<const Model*, std::pair<std::weak_ptr<const Model>, uint64_t>> model_serials_;
  uint64_t next_model_serial_ = 1;
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
  // Prefix sharing, for the first piece of a self step whose blocks were
  // not yet taken: when the session is at a block boundary, the step's full
  // blocks whose keys the pool holds (all examples', keys' and values'), in
  // order up to the first missing, are taken as the session's next blocks,
  // and shared_until marks their rows. Rollback() gives them back.
  void ShareHeldBlocks(const SessionStep& step);
  // A self step's rows are the session's: length grows by them, and each
  // block they fill is keyed in the pool for later sessions to share.
  void Commit(const SessionStep& step);

  // The hash chain of a self session's rows (session.cc); null when the
  // pool shares no prefixes, for cross memory, and once rows no step brought
  // were appended (AppendUncomputed), which no key could name.
  struct Chain;
  std::unique_ptr<Chain> chain;
  // Rows [length, shared_until) of the step under way are in blocks taken
  // by ShareHeldBlocks, which hold them already: nothing writes them.
  int64_t shared_until = 0;
  // Output caching, for a self session of B = 1 and a step asking no
  // weights. A causal self session's output for row i depends only on rows
  // [0, i] and its parameters, and its bits on the piece that computed it
  // too (how the engine cuts a piece's work among threads depends on its
  // rows): so a piece's outputs are cached keyed by the hash of every row
  // up to its last and by the piece's first row and count, in a block of
  // the pool (pieces of at most kKvBlockRows rows), and a later session's
  // piece of the same rows and bounds, in its shared blocks, copies them
  // instead of computing them. ShareHeldBlocks fills row_keys: per row of
  // the step, the hash of the rows up to it (empty: no caching).
  std::vector<BlockKey> row_keys;
  // Copies the cached outputs of the step's rows [first, first + rows) into
  // `output` ((1, rows, width)); false, and nothing copied, when there are
  // none or the rows are not all in shared blocks.
  bool CopyCachedOutputs(int64_t first, int64_t rows, std::vector<float>& output);
  // Caches the outputs `output` ((1, rows, width)) of the step's rows
  // [first, first + rows) when the pool has room.
  void CacheOutputs(int64_t first, int64_t rows, const std::vector<float>& output);

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
