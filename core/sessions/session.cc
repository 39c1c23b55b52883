// session.cc: the block pool, opening a session and validating its steps
// (core/sessions/session.h); Engine::RunSteps runs them (session_steps.cc).
#include "core/sessions/session.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <new>
#include <optional>
#include <random>
#include <bit>
#include <string>
#include <utility>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/engine/projection.h"
#include "core/sessions/session_state.h"
#include "core/status_macros.h"

namespace attention {
namespace {

constexpr std::align_val_t kBlockAlignment{64};

// Marks the refusal of a pool that was full then (PoolWasFull), apart from
// one too large for the empty pool.
constexpr absl::string_view kPoolFullPayload = "attention.session-pool-full";

int64_t BlockBytes(int64_t width) {
  return kKvBlockRows * width * static_cast<int64_t>(sizeof(float));
}

void FreeBlock(float* block) { ::operator delete(block, kBlockAlignment); }

}  // namespace

KvBlockPool::Impl::Impl(int64_t capacity_bytes, Reclaim reclaim, bool prefix_sharing)
    : capacity_bytes_(capacity_bytes),
      reclaim_(std::move(reclaim)),
      prefix_sharing_(prefix_sharing),
      seed_(std::random_device()() * uint64_t{0x100000000} + std::random_device()()) {}

KvBlockPool::Impl::~Impl() {
  for (auto& [width, blocks] : kept_) {
    for (float* block : blocks) FreeBlock(block);
  }
  for (float* block : cached_) FreeBlock(block);
  for (float* block : cached_outputs_) FreeBlock(block);
}

int64_t KvBlockPool::Impl::used_bytes() const {
  std::lock_guard lock(mu_);
  return used_bytes_;
}

KvBlockPool::PrefixStats KvBlockPool::Impl::prefix_stats() const {
  std::lock_guard lock(mu_);
  return {shared_bytes_, cached_bytes_, query_tokens_, hit_tokens_};
}

void KvBlockPool::Impl::MakeRoom() {
  const auto over = [this] { return used_bytes_ + kept_bytes_ + cached_bytes_ > capacity_bytes_; };
  for (auto it = kept_.begin(); it != kept_.end() && over();) {
    std::vector<float*>& blocks = it->second;
    while (!blocks.empty() && over()) {
      FreeBlock(blocks.back());
      blocks.pop_back();
      kept_bytes_ -= BlockBytes(it->first);
    }
    it = blocks.empty() ? kept_.erase(it) : std::next(it);
  }
  while (!cached_outputs_.empty() && over()) EvictLocked(cached_outputs_);
  while (!cached_.empty() && over()) EvictLocked(cached_);
}

void KvBlockPool::Impl::EvictLocked(std::list<float*>& lru) {
  float* block = lru.front();
  lru.pop_front();
  const auto keyed = keyed_.find(block);
  cached_bytes_ -= BlockBytes(keyed->second.width);
  by_key_.erase(keyed->second.key);
  keyed_.erase(keyed);
  FreeBlock(block);
}

absl::Status KvBlockPool::Impl::Allocate(int64_t width, int64_t count,
                                         std::vector<float*>& blocks, const Session* asking) {
  if (count <= 0) return absl::OkStatus();
  const int64_t bytes = count * BlockBytes(width);
  for (;;) {
    int64_t used = 0;
    {
      std::lock_guard lock(mu_);
      if (used_bytes_ + bytes <= capacity_bytes_) {
        TakeLocked(width, count, blocks);
        return absl::OkStatus();
      }
      used = used_bytes_;
    }
    // Another thread may take the room an ended session gave back before
    // this one looks again: then it asks again, while sessions can be ended.
    if (reclaim_ == nullptr || !reclaim_(asking, bytes)) {
      absl::Status full = absl::ResourceExhaustedError(
          absl::StrCat("session memory: the pool's capacity of ", capacity_bytes_,
                       " bytes is full (", used, " bytes held by sessions, ", bytes,
                       " more needed)"));
      full.SetPayload(kPoolFullPayload, absl::Cord());
      return full;
    }
  }
}

void KvBlockPool::Impl::TakeLocked(int64_t width, int64_t count, std::vector<float*>& blocks) {
  std::vector<float*>& kept = kept_[width];
  const int64_t reused = std::min<int64_t>(count, static_cast<int64_t>(kept.size()));
  blocks.insert(blocks.end(), kept.end() - reused, kept.end());
  kept.resize(kept.size() - reused);
  kept_bytes_ -= reused * BlockBytes(width);
  used_bytes_ += count * BlockBytes(width);
  // The fresh blocks are in used_bytes_ now: the kept ones give way to them.
  MakeRoom();
  for (int64_t i = reused; i < count; ++i) {
    blocks.push_back(static_cast<float*>(
        ::operator new(static_cast<size_t>(BlockBytes(width)), kBlockAlignment)));
  }
}

void KvBlockPool::Impl::Release(int64_t width, std::span<float* const> blocks) {
  if (blocks.empty()) return;
  std::lock_guard lock(mu_);
  const int64_t bytes = BlockBytes(width);
  for (float* block : blocks) {
    const auto keyed = keyed_.find(block);
    if (keyed == keyed_.end()) {
      used_bytes_ -= bytes;
      kept_bytes_ += bytes;
      kept_[width].push_back(block);
      continue;
    }
    Keyed& info = keyed->second;
    if (--info.holders == 1) shared_bytes_ -= bytes;
    if (info.holders > 0) continue;
    used_bytes_ -= bytes;
    cached_bytes_ += bytes;
    std::list<float*>& lru = info.outputs ? cached_outputs_ : cached_;
    info.lru = lru.insert(lru.end(), block);
  }
}

float* KvBlockPool::Impl::Acquire(const BlockKey& key) {
  std::lock_guard lock(mu_);
  const auto found = by_key_.find(key);
  if (found == by_key_.end()) return nullptr;
  float* block = found->second;
  Keyed& info = keyed_.at(block);
  const int64_t bytes = BlockBytes(info.width);
  // From the cache, the block's bytes move from cached to used: the pool
  // holds no more than it did.
  if (info.holders == 0) {
    (info.outputs ? cached_outputs_ : cached_).erase(info.lru);
    cached_bytes_ -= bytes;
    used_bytes_ += bytes;
  } else if (info.holders == 1) {
    shared_bytes_ += bytes;
  }
  ++info.holders;
  return block;
}

void KvBlockPool::Impl::Publish(float* block, int64_t width, const BlockKey& key) {
  std::lock_guard lock(mu_);
  if (keyed_.contains(block) || by_key_.contains(key)) return;
  by_key_.emplace(key, block);
  keyed_.emplace(block, Keyed{key, width, 1, {}});
}

bool KvBlockPool::Impl::Has(const BlockKey& key) const {
  std::lock_guard lock(mu_);
  return by_key_.contains(key);
}

float* KvBlockPool::Impl::TakeForCache(int64_t width) {
  std::lock_guard lock(mu_);
  const int64_t bytes = BlockBytes(width);
  used_bytes_ += bytes;
  if (auto same = kept_.find(width); same != kept_.end() && !same->second.empty()) {
    float* block = same->second.back();
    same->second.pop_back();
    kept_bytes_ -= bytes;
    return block;
  }
  // Kept blocks give way to it; cached ones do not (MakeRoom frees them too).
  for (auto it = kept_.begin();
       it != kept_.end() && used_bytes_ + kept_bytes_ + cached_bytes_ > capacity_bytes_;) {
    std::vector<float*>& blocks = it->second;
    while (!blocks.empty() && used_bytes_ + kept_bytes_ + cached_bytes_ > capacity_bytes_) {
      FreeBlock(blocks.back());
      blocks.pop_back();
      kept_bytes_ -= BlockBytes(it->first);
    }
    it = blocks.empty() ? kept_.erase(it) : std::next(it);
  }
  if (used_bytes_ + kept_bytes_ + cached_bytes_ > capacity_bytes_) {
    used_bytes_ -= bytes;
    return nullptr;
  }
  return static_cast<float*>(::operator new(static_cast<size_t>(bytes), kBlockAlignment));
}

void KvBlockPool::Impl::CacheOutputs(float* block, int64_t width, const BlockKey& key) {
  std::lock_guard lock(mu_);
  const int64_t bytes = BlockBytes(width);
  used_bytes_ -= bytes;
  if (by_key_.contains(key)) {
    FreeBlock(block);
    return;
  }
  cached_bytes_ += bytes;
  by_key_.emplace(key, block);
  keyed_.emplace(block, Keyed{key, width, 0, cached_outputs_.insert(cached_outputs_.end(), block),
                              true});
}

void KvBlockPool::Impl::CountLookup(int64_t queried, int64_t found) {
  std::lock_guard lock(mu_);
  query_tokens_ += queried;
  hit_tokens_ += found;
}

uint64_t KvBlockPool::Impl::ModelSerial(const std::shared_ptr<const Model>& model) {
  std::lock_guard lock(mu_);
  auto& [alive, serial] = model_serials_[model.get()];
  if (alive.lock() != model) {
    alive = model;
    serial = next_model_serial_++;
  }
  return serial;
}

KvBlockPool::KvBlockPool(int64_t capacity_bytes, Reclaim reclaim, bool prefix_sharing)
    : impl_(std::make_unique<Impl>(std::max<int64_t>(capacity_bytes, 0), std::move(reclaim),
                                   prefix_sharing)) {}

KvBlockPool::PrefixStats KvBlockPool::prefix_stats() const { return impl_->prefix_stats(); }

bool PoolWasFull(const absl::Status& status) {
  return status.code() == absl::StatusCode::kResourceExhausted &&
         status.GetPayload(kPoolFullPayload).has_value();
}

KvBlockPool::~KvBlockPool() = default;

int64_t KvBlockPool::capacity_bytes() const { return impl_->capacity_bytes(); }

int64_t KvBlockPool::used_bytes() const { return impl_->used_bytes(); }

struct Session::State::Chain {
  uint64_t model_serial = 0;
  // Per example: the key of the session's last full block (zero before the
  // first), and the hash of the rows since, begun with it (Begin).
  std::vector<BlockKey> last;
  std::vector<XXH3_state_t> rows;
};

Session::State::State(std::shared_ptr<const Model> model, KvBlockPool::Impl& pool,
                      SessionMemory memory, int64_t batch, KvDtype kv_dtype)
    : model(std::move(model)),
      pool(pool),
      memory(memory),
      batch(batch),
      kv_dtype(kv_dtype),
      keys(batch, internal::BlockRows{.blocks = {}, .dropped = 0, .dtype = kv_dtype}),
      values(batch, internal::BlockRows{.blocks = {}, .dropped = 0, .dtype = kv_dtype}) {}

Session::State::~State() { Trim(0); }

absl::Status Session::State::Reserve(int64_t rows) {
  const int64_t more = internal::BlocksFor(rows) - static_cast<int64_t>(keys[0].blocks.size());
  if (more <= 0) return absl::OkStatus();
  // A session larger than the whole pool is refused before any other
  // session is asked to make room for it.
  const int64_t key_floats = internal::StoredWidth(key_width, kv_dtype);
  const int64_t value_floats = internal::StoredWidth(value_width, kv_dtype);
  const int64_t needed =
      more * batch * (BlockBytes(key_floats) + (values_are_keys ? 0 : BlockBytes(value_floats)));
  if (held_bytes() + needed > pool.capacity_bytes()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session memory: the session would hold ", held_bytes() + needed, " bytes (", rows,
        " rows of ", batch, " examples), more than the pool's capacity of ",
        pool.capacity_bytes(), " bytes"));
  }
  std::vector<float*> new_keys, new_values;
  RETURN_IF_ERROR(pool.Allocate(key_floats, more * batch, new_keys, owner));
  if (!values_are_keys) {
    if (absl::Status status = pool.Allocate(value_floats, more * batch, new_values, owner);
        !status.ok()) {
      pool.Release(key_floats, new_keys);
      return status;
    }
  }
  for (int64_t b = 0; b < batch; ++b) {
    keys[b].blocks.insert(keys[b].blocks.end(), new_keys.begin() + b * more,
                          new_keys.begin() + (b + 1) * more);
    if (!values_are_keys) {
      values[b].blocks.insert(values[b].blocks.end(), new_values.begin() + b * more,
                              new_values.begin() + (b + 1) * more);
    }
  }
  return absl::OkStatus();
}

void Session::State::Trim(int64_t rows) {
  for (int64_t b = 0; b < batch; ++b) {
    for (auto [tensor, width] : {std::pair{&keys[b], internal::StoredWidth(key_width, kv_dtype)},
                                 {&values[b], internal::StoredWidth(value_width, kv_dtype)}}) {
      const size_t kept = static_cast<size_t>(std::max(internal::BlocksFor(rows), tensor->dropped));
      if (tensor->blocks.size() <= kept) continue;
      pool.Release(width, std::span(tensor->blocks).subspan(kept));
      tensor->blocks.resize(kept);
    }
  }
}

int64_t Session::State::window() const {
  if (memory != SessionMemory::kSelf) return 0;
  return model->kind == Kind::kMultiHead ? model->terms.sliding_window : sliding_window;
}

int64_t Session::State::row_heads() const {
  if (model->kind == Kind::kMultiHead) return KvHeads(*model);
  return kv_heads > 0 ? kv_heads : 1;
}

int64_t Session::State::first_held_row() const {
  return keys.empty() ? 0 : keys[0].dropped * kKvBlockRows;
}

void Session::State::DropBehindWindow() {
  if (window() == 0 || length < window()) return;
  const int64_t behind = (length - window() + 1) / kKvBlockRows;
  for (int64_t b = 0; b < batch; ++b) {
    for (auto [tensor, width] : {std::pair{&keys[b], internal::StoredWidth(key_width, kv_dtype)},
                                 {&values[b], internal::StoredWidth(value_width, kv_dtype)}}) {
      const int64_t end = std::min<int64_t>(behind, static_cast<int64_t>(tensor->blocks.size()));
      if (end <= tensor->dropped) continue;
      pool.Release(width, std::span(tensor->blocks).subspan(tensor->dropped, end - tensor->dropped));
      std::fill(tensor->blocks.begin() + tensor->dropped, tensor->blocks.begin() + end, nullptr);
      tensor->dropped = end;
    }
  }
}

void Session::State::Rollback() {
  Trim(length);
  shared_until = length;
  row_keys.clear();
  if (memory == SessionMemory::kSelf && length == 0 && model->kind == Kind::kDotProduct) {
    key_width = value_width = key_size = value_size = heads = kv_heads = 0;
    values_are_keys = true;
  }
}

double Session::State::StepWork(const AttentionDims& dims) const {
  const int64_t held = memory == SessionMemory::kSelf ? dims.num_keys - dims.num_queries
                                                      : dims.num_keys;
  const double held_rows = static_cast<double>(batch) * static_cast<double>(held);
  double work = RequestWork(*model, dims);
  if (model->kind == Kind::kMultiHead) {
    work -= held_rows * static_cast<double>((key_size + value_size) * KvWidth(*model));
  } else if (model->kind == Kind::kAdditive) {
    work -= held_rows * static_cast<double>(key_size * model->w_q.rows());
  }
  return work;
}

int64_t Session::State::held_bytes() const {
  int64_t bytes = 0;
  const int64_t key_bytes = BlockBytes(internal::StoredWidth(key_width, kv_dtype));
  const int64_t value_bytes = BlockBytes(internal::StoredWidth(value_width, kv_dtype));
  for (int64_t b = 0; b < batch; ++b) {
    bytes += static_cast<int64_t>(keys[b].blocks.size() - keys[b].dropped) * key_bytes +
             static_cast<int64_t>(values[b].blocks.size() - values[b].dropped) * value_bytes;
  }
  return bytes;
}


namespace {

BlockKey KeyOf(const XXH128_hash_t& hash) { return {hash.low64, hash.high64}; }

// The pool's key of one tensor of the block whose rows hash to `block`:
// keys 0, values 1.
BlockKey TensorKey(const BlockKey& block, uint64_t tensor, uint64_t seed) {
  return KeyOf(XXH3_128bits_withSeed(&block, sizeof(block), seed + 1 + tensor));
}

// Example b's hash of a block's rows, begun with the key of the block
// before it and everything that makes the same rows give other keys and
// values: the model object, the example, the scale, the window, the
// soft-cap, the row widths and heads, the dtype they are held in, and the
// block size. Rotary positions
// are the rows' places in the session, which the chain from its first row
// fixes.
void Begin(const Session::State& state, int64_t b, const BlockKey& last, XXH3_state_t& hash) {
  const Session::State::Chain& chain = *state.chain;
  XXH3_128bits_reset_withSeed(&hash, state.pool.seed());
  XXH3_128bits_update(&hash, &last, sizeof(last));
  const uint64_t params[] = {chain.model_serial,
                             static_cast<uint64_t>(b),
                             state.scale.has_value(),
                             std::bit_cast<uint32_t>(state.scale.value_or(0.0f)),
                             static_cast<uint64_t>(state.sliding_window),
                             std::bit_cast<uint32_t>(state.softcap),
                             static_cast<uint64_t>(state.key_width),
                             static_cast<uint64_t>(state.value_width),
                             static_cast<uint64_t>(state.key_size),
                             static_cast<uint64_t>(state.value_size),
                             static_cast<uint64_t>(state.heads),
                             static_cast<uint64_t>(state.kv_heads),
                             state.values_are_keys,
                             static_cast<uint64_t>(state.kv_dtype),
                             static_cast<uint64_t>(kKvBlockRows)};
  XXH3_128bits_update(&hash, params, sizeof(params));
}

// Feeds example b's rows of `step` (whose row 0 is the session's row `at`)
// into `hash`, chained from `last`; each time a block fills, calls
// full(block index, its key), and stops early when that returns false.
// With `row_keys`, appends the hash of the rows up to each row fed.
template <typename Full>
void ChainRows(const Session::State& state, const SessionStep& step, int64_t b, int64_t at,
               XXH3_state_t& hash, BlockKey& last, Full full,
               std::vector<BlockKey>* row_keys = nullptr) {
  const int64_t n = step.queries.shape[1];
  const TensorView* tensors[] = {&step.queries, step.keys ? &*step.keys : nullptr,
                                 step.values ? &*step.values : nullptr};
  for (int64_t i = 0; i < n; ++i) {
    for (const TensorView* tensor : tensors) {
      if (tensor == nullptr) continue;
      const size_t width = tensor->data.size() / static_cast<size_t>(state.batch * n);
      XXH3_128bits_update(&hash, tensor->data.data() + (b * n + i) * static_cast<int64_t>(width),
                          width * sizeof(float));
    }
    if (row_keys != nullptr) row_keys->push_back(KeyOf(XXH3_128bits_digest(&hash)));
    const int64_t row = at + i + 1;
    if (row % kKvBlockRows != 0) continue;
    last = KeyOf(XXH3_128bits_digest(&hash));
    if (!full(row / kKvBlockRows - 1, last)) return;
    Begin(state, b, last, hash);
  }
}

// Example b's hash of the rows after the session's last full block, and
// that block's key, as the next row should be fed.
void Resume(const Session::State& state, int64_t b, XXH3_state_t& hash, BlockKey& last) {
  if (state.length == 0) {
    last = {};
    Begin(state, b, last, hash);
    return;
  }
  last = state.chain->last[static_cast<size_t>(b)];
  XXH3_copyState(&hash, &state.chain->rows[static_cast<size_t>(b)]);
}

}  // namespace

void Session::State::ShareHeldBlocks(const SessionStep& step) {
  shared_until = length;
  row_keys.clear();
  if (chain == nullptr) return;
  const int64_t n = step.queries.shape[1];
  const int64_t blocks = length % kKvBlockRows == 0 ? n / kKvBlockRows : 0;
  // One-token steps are decoding, not prompts: they are not counted.
  const int64_t queried = n > 1 ? batch * n : 0;
  // Outputs of steps with weights are not cached: asking for weights
  // computes them otherwise, to other bits.
  const bool outputs = batch == 1 && n > 1 && !step.return_attention_weights;
  int64_t taken = 0;
  std::vector<std::vector<BlockKey>> found(static_cast<size_t>(batch));
  if (blocks > 0 || outputs) {
    for (int64_t b = 0; b < batch; ++b) {
      std::vector<BlockKey>& keys_of = found[static_cast<size_t>(b)];
      XXH3_state_t hash;
      BlockKey last;
      Resume(*this, b, hash, last);
      ChainRows(
          *this, step, b, length, hash, last,
          [&](int64_t, const BlockKey& key) {
            if (static_cast<int64_t>(keys_of.size()) < blocks) keys_of.push_back(key);
            return outputs || static_cast<int64_t>(keys_of.size()) < blocks;
          },
          outputs ? &row_keys : nullptr);
    }
    const uint64_t seed = pool.seed();
    for (; taken < blocks; ++taken) {
      // Every example's key and value blocks of this block, or none.
      std::vector<std::pair<float*, int64_t>> got;
      for (int64_t b = 0; b < batch; ++b) {
        const BlockKey& key = found[static_cast<size_t>(b)][static_cast<size_t>(taken)];
        if (float* block = pool.Acquire(TensorKey(key, 0, seed))) {
          got.emplace_back(block, internal::StoredWidth(key_width, kv_dtype));
        }
        if (values_are_keys) continue;
        if (float* block = pool.Acquire(TensorKey(key, 1, seed))) {
          got.emplace_back(block, internal::StoredWidth(value_width, kv_dtype));
        }
      }
      if (static_cast<int64_t>(got.size()) != batch * (values_are_keys ? 1 : 2)) {
        for (const auto& [block, width] : got) pool.Release(width, {&block, 1});
        break;
      }
      for (int64_t b = 0, at = 0; b < batch; ++b) {
        keys[b].blocks.push_back(got[static_cast<size_t>(at++)].first);
        if (!values_are_keys) values[b].blocks.push_back(got[static_cast<size_t>(at++)].first);
      }
    }
  }
  shared_until = length + taken * kKvBlockRows;
  pool.CountLookup(queried, batch * taken * kKvBlockRows);
}

namespace {

// The pool's key of the outputs of rows [at, at + rows) of a session, of
// `width` floats each, whose rows up to the last hash to `last_row`.
BlockKey OutputsKey(const BlockKey& last_row, int64_t at, int64_t rows, int64_t width,
                    uint64_t seed) {
  const uint64_t key[] = {last_row.low, last_row.high, static_cast<uint64_t>(at),
                          static_cast<uint64_t>(rows), static_cast<uint64_t>(width)};
  return KeyOf(XXH3_128bits_withSeed(key, sizeof(key), seed + 3));
}

}  // namespace

bool Session::State::CopyCachedOutputs(int64_t first, int64_t rows, std::vector<float>& output) {
  if (row_keys.empty() || rows == 0 || rows > kKvBlockRows || length + first + rows > shared_until) {
    return false;
  }
  const int64_t width = static_cast<int64_t>(output.size()) / rows;
  float* block = pool.Acquire(OutputsKey(row_keys[static_cast<size_t>(first + rows - 1)],
                                         length + first, rows, width, pool.seed()));
  if (block == nullptr) return false;
  std::copy_n(block, rows * width, output.begin());
  pool.Release(width, {&block, 1});
  return true;
}

void Session::State::CacheOutputs(int64_t first, int64_t rows, const std::vector<float>& output) {
  if (row_keys.empty() || rows == 0 || rows > kKvBlockRows) return;
  const int64_t width = static_cast<int64_t>(output.size()) / rows;
  const BlockKey key = OutputsKey(row_keys[static_cast<size_t>(first + rows - 1)], length + first,
                                  rows, width, pool.seed());
  if (pool.Has(key)) return;
  float* block = pool.TakeForCache(width);
  if (block == nullptr) return;
  std::copy_n(output.begin(), rows * width, block);
  pool.CacheOutputs(block, width, key);
}

void Session::State::Commit(const SessionStep& step) {
  if (chain != nullptr) {
    const uint64_t seed = pool.seed();
    for (int64_t b = 0; b < batch; ++b) {
      XXH3_state_t& hash = chain->rows[static_cast<size_t>(b)];
      BlockKey& last = chain->last[static_cast<size_t>(b)];
      if (length == 0) Resume(*this, b, hash, last);
      ChainRows(*this, step, b, length, hash, last, [&](int64_t block, const BlockKey& key) {
        pool.Publish(keys[b].blocks[block], internal::StoredWidth(key_width, kv_dtype),
                     TensorKey(key, 0, seed));
        if (!values_are_keys) {
          pool.Publish(values[b].blocks[block], internal::StoredWidth(value_width, kv_dtype),
                       TensorKey(key, 1, seed));
        }
        return true;
      });
    }
  }
  length += step.queries.shape[1];
  shared_until = length;
  row_keys.clear();
  DropBehindWindow();
}

namespace {

absl::Status CheckSelfOpen(const Model& model, const SessionOpen& open) {
  if (model.kind != Kind::kMultiHead && model.kind != Kind::kDotProduct) {
    return absl::InvalidArgumentError(absl::StrCat(
        "memory: self memory needs a multi_head or dot_product model, got model '", model.name,
        "' of kind ", std::string(KindName(model.kind)), "; open it with cross memory"));
  }
  if (open.keys || open.values || !open.valid_lens.empty()) {
    return absl::InvalidArgumentError(
        "keys: expected none for self memory (each step's rows are its keys and values)");
  }
  if (open.batch < 1) {
    return absl::InvalidArgumentError(absl::StrCat("batch: expected >= 1, got ", open.batch));
  }
  if (model.kind == Kind::kMultiHead &&
      (model.key_size != model.query_size || model.value_size != model.query_size)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "memory: self memory needs d_q == d_k == d_v (a step's rows are its keys and values), ",
        "model '", model.name, "' has d_q=", model.query_size, " d_k=", model.key_size,
        " d_v=", model.value_size));
  }
  return absl::OkStatus();
}

// Empty, or one valid length >= 0 per example.
absl::Status CheckCrossValidLens(std::span<const int32_t> valid_lens, int64_t batch) {
  if (!valid_lens.empty() && static_cast<int64_t>(valid_lens.size()) != batch) {
    return absl::InvalidArgumentError(absl::StrCat("valid_lens: expected 0 or ", batch,
                                                   " (B, one per example) entries, got ",
                                                   valid_lens.size()));
  }
  for (size_t i = 0; i < valid_lens.size(); ++i) {
    if (valid_lens[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("valid_lens[", i, "]: expected >= 0, got ", valid_lens[i]));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckCrossOpen(const Model& model, const SessionOpen& open, const Limits& limits) {
  if (model.kind == Kind::kMultiHead &&
      (model.terms.rotary.dims > 0 || !model.terms.k_norm.empty() ||
       !model.terms.alibi_slopes.empty() || model.terms.sliding_window > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "memory: model '", model.name,
        "' is a decoder layer (rotary positions, qk-norm, ALiBi or a window over its own "
        "tokens): open self memory"));
  }
  if (!open.keys) {
    return absl::InvalidArgumentError("keys: required for cross memory, (B, n_k, d_k)");
  }
  const TensorView& keys = *open.keys;
  RETURN_IF_ERROR(CheckTensorShape("keys", keys, "(B, n_k, d_k)"));
  const TensorView& values = open.values ? *open.values : keys;
  const absl::string_view values_field = open.values ? "values" : "keys (standing in for values)";
  if (open.values) {
    RETURN_IF_ERROR(CheckTensorShape("values", values, "(B, n_k, d_v)"));
    RETURN_IF_ERROR(CheckTensorAxis("values", 0, "B", keys.shape[0], values.shape[0], "keys' B"));
    RETURN_IF_ERROR(
        CheckTensorAxis("values", 1, "n_k", keys.shape[1], values.shape[1], "keys' n_k"));
  }
  const std::string why = absl::StrCat("model '", model.name, "' input size");
  if (model.key_size != 0) {
    RETURN_IF_ERROR(CheckTensorAxis("keys", 2, "d_k", model.key_size, keys.shape[2], why));
  }
  if (model.value_size != 0) {
    RETURN_IF_ERROR(
        CheckTensorAxis(values_field, 2, "d_v", model.value_size, values.shape[2], why));
  }
  RETURN_IF_ERROR(CheckCrossValidLens(open.valid_lens, keys.shape[0]));
  const int64_t elements = static_cast<int64_t>(keys.data.size() + values.data.size());
  if (limits.max_request_elements > 0 && elements > limits.max_request_elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("keys: expected at most ", limits.max_request_elements,
                     " float elements in keys and values together, got ", elements));
  }
  RETURN_IF_ERROR(CheckTensorFinite("keys", keys));
  return CheckTensorFinite(values_field, values);
}

absl::Status CheckOpen(const Model& model, const SessionOpen& open, const Limits& limits) {
  if (open.scale && !std::isfinite(*open.scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("scale: expected a finite value, got ", *open.scale));
  }
  if (open.max_length < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_length: expected >= 0, got ", open.max_length));
  }
  if ((open.sliding_window != 0 || open.softcap != 0) &&
      (model.kind != Kind::kDotProduct || open.memory != SessionMemory::kSelf)) {
    return absl::InvalidArgumentError(absl::StrCat(
        open.sliding_window != 0 ? "sliding_window" : "softcap",
        ": only dot_product self memory takes it (a multi_head model's layer fixes its own)"));
  }
  if (open.sliding_window < 0 || !(std::isfinite(open.softcap) && open.softcap >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        open.sliding_window < 0 ? "sliding_window" : "softcap", ": expected >= 0 (0: none), got ",
        open.sliding_window < 0 ? absl::StrCat(open.sliding_window) : absl::StrCat(open.softcap)));
  }
  return open.memory == SessionMemory::kSelf ? CheckSelfOpen(model, open)
                                             : CheckCrossOpen(model, open, limits);
}

// Example b's n_k rows of `rows` (B, n_k, width) into `memory`'s blocks of
// rows cut into `heads` (BlockRows): projected by `projection` (its in, out
// and rows are set here), or copied. float32 rows of one head go straight
// into their block; others are projected a block at a time into
// `rows_of_block` and put head by head, rounded to the memory's dtype.
void FillBlocks(const TensorView& rows, int64_t b, const internal::Projection* projection,
                const internal::BlockRows& memory, int64_t memory_width, int64_t heads) {
  const int64_t n_k = rows.shape[1], width = rows.shape[2];
  const bool in_place = heads == 1 && memory.dtype == KvDtype::kFloat32;
  std::vector<float> rows_of_block;
  for (int64_t first = 0; first < n_k; first += kKvBlockRows) {
    const int64_t count = std::min(kKvBlockRows, n_k - first);
    const float* in = rows.data.data() + (b * n_k + first) * width;
    const float* held = in;
    if (projection != nullptr) {
      if (!in_place) rows_of_block.resize(count * memory_width);
      internal::Projection part = *projection;
      part.in = in;
      part.out = in_place ? memory.Row(first, memory_width) : rows_of_block.data();
      part.rows = count;
      internal::ProjectAll(part);
      if (in_place) continue;
      held = rows_of_block.data();
    } else if (in_place) {
      std::copy_n(in, count * width, memory.Row(first, memory_width));
      continue;
    }
    for (int64_t r = 0; r < count; ++r) {
      memory.Put(first + r, memory_width, heads, held + r * memory_width);
    }
  }
}

// distance: the key biases -scale/2 |k|^2 of example b (core/kernels/flash_kernel.h),
// of the keys as the memory holds them (rounded to its dtype).
std::vector<float> DistanceKeyBias(const TensorView& keys, int64_t b, float scale,
                                   KvDtype dtype) {
  const int64_t n_k = keys.shape[1], d_k = keys.shape[2];
  RowMatrix k = Eigen::Map<const RowMatrix>(keys.data.data() + b * n_k * d_k, n_k, d_k);
  if (dtype != KvDtype::kFloat32) {
    k = k.unaryExpr([dtype](float x) { return WidenKv(dtype, RoundKv(dtype, x)); });
  }
  std::vector<float> bias(n_k);
  Eigen::Map<Vector>(bias.data(), n_k) = -(0.5f * scale) * k.rowwise().squaredNorm();
  return bias;
}

// The products cross memory keeps of its keys and values, or null for rows
// kept as given: multi_head projects both (W x + b), additive its keys
// (W_k k).
struct CrossProjections {
  std::optional<internal::Projection> keys, values;
};

CrossProjections CrossProjectionsOf(const Model& model) {
  using internal::Projection;
  if (model.kind == Kind::kMultiHead) {
    return {Projection{nullptr, nullptr, 0, &model.w_k, &model.b_k, true, &model.packed_k},
            Projection{nullptr, nullptr, 0, &model.w_v, &model.b_v, true, &model.packed_v}};
  }
  if (model.kind == Kind::kAdditive) {
    return {Projection{nullptr, nullptr, 0, &model.w_k, nullptr}, std::nullopt};
  }
  return {};
}

absl::Status FillCrossMemory(const SessionOpen& open, Session::State& state) {
  const Model& model = *state.model;
  const TensorView& keys = *open.keys;
  const TensorView& values = open.values ? *open.values : keys;
  const CrossProjections projections = CrossProjectionsOf(model);
  state.key_size = keys.shape[2];
  state.value_size = values.shape[2];
  state.key_width = projections.keys ? projections.keys->out_cols() : state.key_size;
  state.value_width = projections.values ? projections.values->out_cols() : state.value_size;
  state.valid_lens.assign(open.valid_lens.begin(), open.valid_lens.end());
  const int64_t n_k = keys.shape[1];
  RETURN_IF_ERROR(state.Reserve(n_k));
  for (int64_t b = 0; b < state.batch; ++b) {
    FillBlocks(keys, b, projections.keys ? &*projections.keys : nullptr, state.keys[b],
               state.key_width, state.row_heads());
    FillBlocks(values, b, projections.values ? &*projections.values : nullptr, state.values[b],
               state.value_width, state.row_heads());
    if (model.kind == Kind::kDistance) {
      state.key_bias.push_back(
          DistanceKeyBias(keys, b, open.scale ? *open.scale : DefaultScale(model, {}),
                          state.kv_dtype));
    }
  }
  state.length = n_k;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Session>> Session::Open(std::shared_ptr<const Model> model,
                                                       KvBlockPool& pool, const SessionOpen& open,
                                                       const Limits& limits) {
  if (model == nullptr) return absl::InvalidArgumentError("model: required");
  RETURN_IF_ERROR(CheckOpen(*model, open, limits));
  const bool self = open.memory == SessionMemory::kSelf;
  const int64_t batch = self ? open.batch : open.keys->shape[0];
  auto state = std::make_unique<State>(std::move(model), *pool.impl_, open.memory, batch,
                                       open.kv_dtype);
  state->scale = open.scale;
  state->max_length = self ? open.max_length : 0;
  state->sliding_window = open.sliding_window;
  state->softcap = open.softcap;
  if (self) {
    const Model& m = *state->model;
    state->values_are_keys = m.kind == Kind::kDotProduct;
    state->key_size = state->value_size = m.query_size;
    state->key_width = state->value_width = m.kind == Kind::kMultiHead ? KvWidth(m) : 0;
    if (pool.impl_->prefix_sharing()) {
      state->chain = std::make_unique<State::Chain>();
      state->chain->model_serial = pool.impl_->ModelSerial(state->model);
      state->chain->last.resize(static_cast<size_t>(open.batch));
      state->chain->rows.resize(static_cast<size_t>(open.batch));
    }
  } else {
    RETURN_IF_ERROR(FillCrossMemory(open, *state));
  }
  return std::unique_ptr<Session>(new Session(std::move(state)));
}

Session::Session(std::unique_ptr<State> state) : state_(std::move(state)) { state_->owner = this; }

void Session::MarkEnded(absl::Status why) {
  std::lock_guard lock(state_->ended_mu);
  state_->ended = std::move(why);
}

absl::Status Session::ended() const {
  std::lock_guard lock(state_->ended_mu);
  return state_->ended;
}

Session::~Session() = default;

const Model& Session::model() const { return *state_->model; }
SessionMemory Session::memory() const { return state_->memory; }
int64_t Session::batch() const { return state_->batch; }
int64_t Session::length() const { return state_->length; }
int64_t Session::held_bytes() const { return state_->held_bytes(); }

namespace {

// The queries' d_q a step must have: the model's, or for the weightless
// kinds the size of the keys held (any, before a self session's first step).
absl::Status CheckStepQueries(const Session::State& state, const TensorView& queries) {
  RETURN_IF_ERROR(CheckTensorShape("queries", queries, "(B, n_new, d_q)"));
  RETURN_IF_ERROR(
      CheckTensorAxis("queries", 0, "B", state.batch, queries.shape[0], "the session's batch"));
  const Model& model = *state.model;
  if (model.query_size != 0) {
    return CheckTensorAxis("queries", 2, "d_q", model.query_size, queries.shape[2],
                           absl::StrCat("model '", model.name, "' input size"));
  }
  if (state.memory == SessionMemory::kSelf && state.length == 0) return absl::OkStatus();
  return CheckTensorAxis(
      "queries", 2, "d_q", state.key_size, queries.shape[2],
      absl::StrCat(std::string(KindName(model.kind)), " needs d_q == the session's d_k"));
}

absl::Status CheckStepLength(const Session::State& state, int64_t new_rows) {
  if (state.memory != SessionMemory::kSelf) return absl::OkStatus();
  const int64_t limit = state.max_length > 0 ? state.max_length : INT32_MAX;
  if (state.length + new_rows <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat("queries: the session holds ", state.length,
                                                   " tokens and this step brings ", new_rows,
                                                   ", past its max_length of ", limit));
}

// 3-D rows, or (dot_product self memory) 4-D rows over grouped heads; the
// same kind as the session's first step; a step's own keys and values only
// with 4-D rows.
absl::Status CheckStepRank(const Session::State& state, const SessionStep& step) {
  const bool grouped = step.queries.shape.size() == 4;
  if (!grouped && (step.keys || step.values)) {
    return absl::InvalidArgumentError(absl::StrCat(
        step.keys ? "keys" : "values",
        ": a step carries its own keys and values only in a dot_product self session over "
        "grouped heads (4-D queries (B, n_new, H, d))"));
  }
  const bool self_dot_product =
      state.memory == SessionMemory::kSelf && state.model->kind == Kind::kDotProduct;
  if (grouped && !self_dot_product) {
    return absl::InvalidArgumentError(absl::StrCat(
        "queries.shape: expected rank 3 (B, n_new, d_q), got rank 4 ",
        ShapeString(step.queries.shape),
        ": grouped heads are for dot_product self memory"));
  }
  if (state.key_width != 0 && grouped != (state.heads > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "queries.shape: expected rank ", state.heads > 0 ? 4 : 3, " as the session's first step, got rank ",
        step.queries.shape.size(), " ", ShapeString(step.queries.shape)));
  }
  return absl::OkStatus();
}

// One of a grouped step's tensors: (B, n_new, heads, width), finite; with
// heads and width as the session holds them once it has rows (0: any).
absl::Status CheckGroupedTensor(absl::string_view field, const TensorView& tensor,
                                absl::string_view axes, const TensorView& queries, int64_t heads,
                                int64_t width, absl::string_view why) {
  if (tensor.shape.size() != 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shape: expected rank 4 like the queries, got rank ", tensor.shape.size(), " ",
        ShapeString(tensor.shape)));
  }
  RETURN_IF_ERROR(CheckTensorShape(field, tensor, axes, 4));
  RETURN_IF_ERROR(CheckTensorAxis(field, 0, "B", queries.shape[0], tensor.shape[0], "the queries' B"));
  RETURN_IF_ERROR(
      CheckTensorAxis(field, 1, "n_new", queries.shape[1], tensor.shape[1], "the queries' n_new"));
  if (heads > 0) RETURN_IF_ERROR(CheckTensorAxis(field, 2, "heads", heads, tensor.shape[2], why));
  if (width > 0) RETURN_IF_ERROR(CheckTensorAxis(field, 3, "width", width, tensor.shape[3], why));
  return CheckTensorFinite(field, tensor);
}

// A step of grouped heads: queries (B, n_new, H, d), keys (B, n_new, H_kv,
// d; absent: the queries), values (B, n_new, H_kv, d_v; absent: the keys),
// H a multiple of H_kv, all as the session's first step had them.
absl::Status CheckGroupedStep(const Session::State& state, const SessionStep& step) {
  const TensorView& queries = step.queries;
  RETURN_IF_ERROR(CheckTensorShape("queries", queries, "(B, n_new, H, d)", 4));
  RETURN_IF_ERROR(
      CheckTensorAxis("queries", 0, "B", state.batch, queries.shape[0], "the session's batch"));
  const bool held = state.key_width != 0;
  const absl::string_view why = "as the session's first step";
  if (held) {
    RETURN_IF_ERROR(CheckTensorAxis("queries", 2, "H", state.heads, queries.shape[2], why));
    RETURN_IF_ERROR(CheckTensorAxis("queries", 3, "d", state.key_size, queries.shape[3], why));
  }
  const int64_t heads = queries.shape[2];
  int64_t kv_heads = heads;
  if (step.keys) {
    RETURN_IF_ERROR(CheckGroupedTensor("keys", *step.keys, "(B, n_new, H_kv, d)", queries,
                                       held ? state.kv_heads : 0, queries.shape[3], why));
    kv_heads = step.keys->shape[2];
  } else if (held && state.kv_heads != heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keys: required: the session holds ", state.kv_heads, " kv heads, and the queries (", heads,
        " heads) cannot stand in for them"));
  }
  if (heads % kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "queries.shape[2] (H): expected a multiple of the keys' kv heads H_kv = ", kv_heads,
        " (query head h reads kv head h / (H / H_kv)), got ", heads));
  }
  if (held && step.values.has_value() == state.values_are_keys) {
    return absl::InvalidArgumentError(
        state.values_are_keys
            ? "values: the session holds its keys as its values (its first step had none); "
              "step without values"
            : "values: required: the session holds values apart from its keys");
  }
  if (!step.values) return absl::OkStatus();
  return CheckGroupedTensor("values", *step.values, "(B, n_new, H_kv, d_v)", queries, kv_heads,
                            held ? state.value_size : 0, why);
}

AttentionDims StepDims(const Session::State& state, const SessionStep& step) {
  const Model& model = *state.model;
  const bool self = state.memory == SessionMemory::kSelf;
  AttentionDims dims;
  dims.batch = state.batch;
  dims.num_queries = step.queries.shape[1];
  dims.query_size = step.queries.shape[2];
  dims.num_keys = self ? state.length + dims.num_queries : state.length;
  dims.key_size = self ? dims.query_size : state.key_size;
  dims.value_size = self ? dims.query_size : state.value_size;
  dims.output_size = model.output_size != 0 ? model.output_size : dims.value_size;
  dims.num_heads = model.kind == Kind::kMultiHead ? model.num_heads : 1;
  if (step.queries.shape.size() == 4) {
    dims.grouped = true;
    dims.num_heads = step.queries.shape[2];
    dims.num_kv_heads = step.keys ? step.keys->shape[2] : dims.num_heads;
    dims.query_size = dims.key_size = step.queries.shape[3];
    dims.value_size = step.values ? step.values->shape[3] : dims.key_size;
    dims.output_size = dims.num_heads * dims.value_size;
  }
  if (!state.valid_lens.empty()) dims.length_mask = AttentionDims::LengthMask::kPerExample;
  dims.scale = state.scale ? *state.scale : DefaultScale(model, dims);
  return dims;
}

// Limits over what a step computes: its queries, output and weights, and its
// work, in which the rows held are not projected again (State::StepWork).
absl::Status CheckStepLimits(const Session::State& state, const SessionStep& step,
                             const AttentionDims& dims, const Limits& limits) {
  const double weights =
      step.return_attention_weights ? static_cast<double>(dims.weight_elements()) : 0.0;
  const double elements = static_cast<double>(step.queries.data.size()) +
                          static_cast<double>(step.keys ? step.keys->data.size() : 0) +
                          static_cast<double>(step.values ? step.values->data.size() : 0) +
                          static_cast<double>(dims.output_elements()) + weights;
  if (limits.max_request_elements > 0 && elements > limits.max_request_elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("queries: expected at most ", limits.max_request_elements,
                     " float elements in queries, output and weights together, got ", elements));
  }
  // A step is computed in pieces of at most the limit's work (ChunkRows),
  // so what must fit is its costliest piece of one row: the last.
  AttentionDims last_row = dims;
  last_row.num_queries = 1;
  const double work = state.StepWork(last_row);
  if (limits.max_request_work > 0 && work > static_cast<double>(limits.max_request_work)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "queries: expected at most ", limits.max_request_work,
        " work units for one token of a step, got ", work, " (B=", dims.batch,
        " length=", dims.num_keys, "); the session is too long for this server"));
  }
  const double scratch = RequestScratch(dims);
  if (limits.max_request_scratch_elements > 0 &&
      scratch > static_cast<double>(limits.max_request_scratch_elements)) {
    return absl::InvalidArgumentError(
        absl::StrCat("queries: expected at most ", limits.max_request_scratch_elements,
                     " floats of engine scratch per thread, got ", scratch));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ValidatedStep> ValidateStep(Session& session, const SessionStep& step,
                                           const Limits& limits) {
  const Session::State& state = *session.state_;
  RETURN_IF_ERROR(CheckStepRank(state, step));
  if (step.queries.shape.size() == 4) {
    RETURN_IF_ERROR(CheckGroupedStep(state, step));
  } else {
    RETURN_IF_ERROR(CheckStepQueries(state, step.queries));
  }
  RETURN_IF_ERROR(CheckStepLength(state, step.queries.shape[1]));
  const AttentionDims dims = StepDims(state, step);
  RETURN_IF_ERROR(CheckStepLimits(state, step, dims, limits));
  RETURN_IF_ERROR(CheckTensorFinite("queries", step.queries));
  return ValidatedStep{&session, &step, dims, nullptr};
}

int64_t ChunkRows(const ValidatedStep& step, double max_work) {
  const Session::State& state = *step.session->state_;
  const int64_t rest = step.dims.num_queries - step.done_rows;
  if (max_work <= 0) return rest;
  // The piece of `rows` rows, after the done_rows before it.
  auto work = [&](int64_t rows) {
    AttentionDims piece = step.dims;
    piece.num_queries = rows;
    if (state.memory == SessionMemory::kSelf) piece.num_keys = state.length + step.done_rows + rows;
    return state.StepWork(piece);
  };
  // Work grows with the rows: the largest count within max_work, by halves.
  int64_t fits = 1, over = rest + 1;
  if (work(rest) <= max_work) return rest;
  while (over - fits > 1) {
    const int64_t mid = fits + (over - fits) / 2;
    (work(mid) <= max_work ? fits : over) = mid;
  }
  return fits;
}

void AbandonStep(const ValidatedStep& step) { step.session->state_->Rollback(); }

namespace internal {

absl::Status AppendUncomputed(Session& session, int64_t rows, uint32_t seed) {
  Session::State& state = *session.state_;
  if (state.memory != SessionMemory::kSelf || state.key_width == 0) {
    return absl::FailedPreconditionError(
        "AppendUncomputed: a self session whose first step fixed its rows");
  }
  RETURN_IF_ERROR(state.Reserve(state.length + rows));
  // No step brought these rows: no key names them or any row after them.
  state.chain.reset();
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> row(std::max(state.key_width, state.value_width));
  const auto put = [&](const internal::BlockRows& memory, int64_t t, int64_t width) {
    for (int64_t c = 0; c < width; ++c) row[c] = uniform(rng);
    memory.Put(t, width, state.row_heads(), row.data());
  };
  for (int64_t b = 0; b < state.batch; ++b) {
    for (int64_t t = state.length; t < state.length + rows; ++t) {
      put(state.keys[b], t, state.key_width);
      if (!state.values_are_keys) put(state.values[b], t, state.value_width);
    }
  }
  state.length += rows;
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace attention
