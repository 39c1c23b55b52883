// flash_kernel.h: fused scaled-dot-product attention for one (example, head).
//
// Scores of the dot-product family share one form,
//
//   s[i,j] = scale * (q_i . k_j) + query_bias[i] + key_bias[j]
//
// (dot_product and multi_head heads: no biases; bilinear: q already mapped by
// W_k; distance: scale * q.k - scale/2 |q|^2 - scale/2 |k|^2). The kernel
// walks key tiles with an online softmax, so no (n_q x n_k) matrix is formed,
// and each query's key loop stops at its allowed bound
//
//   bound(i) = min(valid_len(i), n_k, causal ? i + 1 : n_k)
//
// keys at or past the bound are disallowed (score -1e6, docs/api.md); a
// query with bound 0 gets uniform weights over all n_k keys, i.e. the mean of
// the values. Exactly so: if a row's allowed scores are themselves near or
// below -1e6, its disallowed keys carry weight, and the kernel computes that
// row on an exact path. Rows whose float scores or sums overflow (a finite
// request with a huge scale or huge inputs) are computed again in double,
// where no product of float inputs overflows, so they get the rule's answer
// (finite huge scores: the weight goes to the largest).
//
// A problem may carry a WorkStop, polled between blocks of its work (query
// tiles, and chunks of keys within a tile): once it says stop, the kernel
// returns and leaves the rows it did not finish unspecified.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "core/kernels/float16.h"
#include "core/kernels/packed_weights.h"
#include "core/kernels/tile_sizes.h"

namespace attention {

// Work units (docs/api.md, section 6.2: about one multiply-add each) a
// kernel does between two polls of a problem's WorkStop: about a millisecond
// of one core, so a stopped request stops costing CPU within milliseconds,
// and a poll (a clock read, a call-state check) costs well under 0.1%.
inline constexpr int64_t kStopPollWork = int64_t{1} << 24;

// Whether the request a problem belongs to should stop (its caller's
// deadline passed, or the caller went away). Polled from any thread of the
// engine; once Stopped() returned true it must keep returning true.
class WorkStop {
 public:
  virtual bool Stopped() = 0;

 protected:
  ~WorkStop() = default;
};

// Value rows a problem was given unfinished. The engine projects only the
// value rows that allowed keys read (core/engine/run_multi_head.cc, RowsRead); a
// row whose allowed scores sit near or below -1e6 gives its disallowed keys
// weight and so reads the rest, which it asks for first. Complete() makes
// all n_k value rows readable; thread-safe and idempotent, since every head
// of an example may ask at once.
class PendingValues {
 public:
  virtual void Complete() = 0;

 protected:
  ~PendingValues() = default;
};

// Which keys each query of one (example, head) may see: [First(i),
// Allowed(i)).
struct KeyBounds {
  // Per-query lengths [n_q] if set, else `valid_len` for all queries
  // (INT32_MAX: no length mask).
  const int32_t* valid_lens = nullptr;
  int32_t valid_len = INT32_MAX;
  bool causal = false;
  // A sliding window: key j is allowed for query i only if
  // first_query + i - j < window (0: none). first_query is the index of
  // query 0 among the keys (a decoding step's: the tokens before it).
  int64_t window = 0;
  int64_t first_query = 0;

  // min(valid_len(i), n_k, causal ? i + 1 : n_k); at most First(i) means no
  // key is allowed.
  int64_t Allowed(int64_t query, int64_t num_keys) const;
  // The first key the window allows query i: 0 without a window.
  int64_t First(int64_t query) const {
    return window > 0 ? std::max<int64_t>(0, first_query + query - window + 1) : 0;
  }
};

// What the attention layers of today's decoder models add to a head's
// scores (core/model/layer_terms.h), in the order they apply:
//
//   s = scale * q_i . k_j;  s += alibi_slope * (j - (first_query + i));
//   s = softcap * tanh(s / softcap);
//
// then disallowed keys (KeyBounds, window included) get -1e6, and the
// softmax takes `sink` as one more logit whose weight is dropped. A problem
// with any of them (or a window) runs on flash_terms.cc's kernel.
struct ScoreTerms {
  float alibi_slope = 0;  // 0: none
  float softcap = 0;      // 0: none
  bool has_sink = false;
  float sink = 0;

  bool any() const { return alibi_slope != 0 || softcap != 0 || has_sink; }
};

// One attention problem: an (example, head) slice. Pointers are not owned.
struct FlashProblem {
  const float* queries = nullptr;  // (n_q x head_size), row stride query_stride
  const float* keys = nullptr;     // (n_k x head_size), row stride key_stride
  const float* values = nullptr;   // (n_k x value_size), row stride value_stride
  float* output = nullptr;         // (n_q x value_size), row stride output_stride
  int64_t query_stride = 0, key_stride = 0, value_stride = 0, output_stride = 0;
  int64_t num_queries = 0, num_keys = 0, head_size = 0, value_size = 0;
  float scale = 1.0f;
  const float* query_bias = nullptr;  // [n_q] or null
  const float* key_bias = nullptr;    // [n_k] or null
  KeyBounds bounds;
  ScoreTerms terms;
  // The distance kind: the biases are -scale/2 |q|^2 and -scale/2 |k|^2, and
  // a row recomputed in double takes -scale/2 |q - k|^2 from q and k instead,
  // since those float biases may have overflowed.
  bool distance = false;
  // bf16: QK^T and P V in BF16 where the path has them (flash_tile.h); the
  // attention weights a caller asks for, and the rows recomputed exactly,
  // stay FP32.
  Precision precision = Precision::kFp32;
  WorkStop* stop = nullptr;  // null: never stops
  // Set when value rows at or past the largest bound are not computed yet.
  PendingValues* pending_values = nullptr;
  // Keys and values in blocks (a decoding session's, core/sessions/session.h),
  // read in place: key j is row j % block_rows of key_blocks[j / block_rows]
  // from column block_column (values alike, from value_blocks and column
  // value_block_column), with the row strides above; `keys` and `values`
  // are unused. block_rows is a multiple of kFlashKeyTile, so no key tile
  // straddles two blocks.
  const float* const* key_blocks = nullptr;
  const float* const* value_blocks = nullptr;
  int64_t block_rows = 0;
  int64_t block_column = 0;
  int64_t value_block_column = 0;
  // Keys below it are not held (a windowed session gave their blocks back,
  // as no query's window reaches them): they are left out of every softmax,
  // also where the -1e6 rule would give masked keys weight. Only problems
  // with a window (has_terms()) have it.
  int64_t first_held_key = 0;
  // What the blocks hold per element: float32, or a 16-bit session's
  // bfloat16 or float16 (core/kernels/float16.h), the blocks then arrays of
  // uint16_t with the columns and strides above counted in them. The
  // one-row kernel widens them in registers; the lane and terms kernels a
  // block's rows at a time (internal::PagedKeyRows); only the rare exact
  // paths (weights asked for, rows whose masked keys weigh or that
  // overflow) gather a whole context, as they do float32 blocks.
  KvDtype kv_dtype = KvDtype::kFloat32;

  bool Stopped() const { return stop != nullptr && stop->Stopped(); }
  // Before reading a value row at or past a query's bound.
  void CompleteValues() const {
    if (pending_values != nullptr) pending_values->Complete();
  }
  int64_t AllowedKeys(int64_t query) const { return bounds.Allowed(query, num_keys); }
  // Terms or a window: the problem runs on flash_terms.cc's kernel.
  bool has_terms() const { return terms.any() || bounds.window > 0; }
  bool paged() const { return key_blocks != nullptr; }
};

// Writes output rows [query_begin, query_end) of `problem`. Thread-safe for
// disjoint row ranges. Returns false when the problem's WorkStop stopped it
// (then some of those rows are unspecified). A bf16 problem on a path with
// BF16 products has its keys and values rounded into pairs once per call
// (flash_tile.h), so a call over many query tiles costs less than one per
// tile (PairsKeysPerCall).
bool FlashAttention(const FlashProblem& problem, int64_t query_begin, int64_t query_end);

// Whether FlashAttention pairs `problem`'s keys and values per call on the
// active path: then callers give each call many query tiles.
bool PairsKeysPerCall(const FlashProblem& problem);

// As FlashAttention, and also writes the attention weights of those rows into
// `weights` (n_q x n_k, row stride weights_stride), disallowed keys included.
bool AttentionWithWeights(const FlashProblem& problem, int64_t query_begin, int64_t query_end,
                          float* weights, int64_t weights_stride);

// Split-K (flash-decoding): a problem's keys cut into ranges computed apart,
// each on its own thread, then merged. A range's share of query row r is
// the max of its allowed scores among the range's keys (max[r]; the lowest
// float, or -inf, when it has none), the sum of exp(s - max) (sum[r]) and
// the unnormalised output sum_j exp(s_j - max) v_j (accumulator, value_size
// floats a row).
struct KeyRangePart {
  float* max = nullptr;
  float* sum = nullptr;
  float* accumulator = nullptr;
};

// Whether a problem may be split: one whose keys FlashAttention would not
// pair per call (PairsKeysPerCall), which reads them as they are held.
bool SplitsKeys(const FlashProblem& problem);

// Rows [query_begin, query_end) (at most kFlashQueryTile) of `problem` over
// its keys [key_begin, key_end) only, into `part`, on the active path's
// kernel (or flash_terms.cc's for a problem with terms). Returns false
// when the problem's WorkStop stopped it.
bool FlashAttentionOverKeys(const FlashProblem& problem, int64_t query_begin, int64_t query_end,
                            int64_t key_begin, int64_t key_end, const KeyRangePart& part);

// The output of rows [query_begin, query_end) from the parts of ranges
// that together cover every key: their shares rescaled to the largest max
// and added (a log-sum-exp combine), then normalised as FlashAttention
// does; a row that needs FlashAttention's other answers (no allowed key,
// disallowed keys that weigh, float overflow) is computed again unsplit.
void MergeKeyRanges(const FlashProblem& problem, int64_t query_begin, int64_t query_end,
                    std::span<const KeyRangePart> parts);

namespace internal {

// Rows [first, first + count) of a paged problem's keys, all within the
// block that holds `first`, as float32 rows of stride key_stride: the
// block's own for float32 blocks, else widened into `widened` (count x
// key_stride). PagedValueRows: the same of its values.
const float* PagedKeyRows(const FlashProblem& p, int64_t first, int64_t count,
                          std::vector<float>& widened);
const float* PagedValueRows(const FlashProblem& p, int64_t first, int64_t count,
                            std::vector<float>& widened);

}  // namespace internal

// Most floats one buffer of a thread's kernel scratch keeps between calls
// (1 MiB): an oversized problem's larger buffers are freed when it is done,
// so a thread's scratch returns to what ordinary problems need.
inline constexpr int64_t kKeptKernelScratchFloats = int64_t{1} << 18;

}  // namespace attention
