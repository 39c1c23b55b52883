// projection.cc: projection blocks on the packed GEMM or the BLAS
// (projection.h).
#include "core/engine/projection.h"

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <utility>

#include "core/engine/group_scratch.h"
#include "core/huge_pages.h"
#include "core/kernels/packed_gemm.h"
#include "core/thread_pool.h"

namespace attention::internal {
namespace {

using StridedMatrixMap = Eigen::Map<RowMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;

// Rows per BLAS projection task: a GEMM this tall runs near peak.
constexpr int64_t kProjectionRows = 256;

// A packed task: rows x panels. With few rows the panels give the tasks
// (a 1-row product over N = 1024 is 8 tasks of 128 columns); with many the
// rows do, and 96 rows (a multiple of 8 and 3 rows per micro-kernel) of 4
// panels read the same 4 x 128 KiB of panels (K = 1024) from L2 12-32 times.
constexpr int64_t kPackedGemmRowBlock = 96;
constexpr int64_t kPackedGemmPanelBlock = 4;

// Blocks per pool thread that narrower panel blocks are cut for when the
// rows are few (a batch of single tokens, a decode step): tasks are handed
// out as threads ask, so a worker that wakes late still finds some, and a
// pool wider than the blocks of 4 panels (8 for N = 1024) is not left idle.
constexpr int64_t kBlocksPerThread = 2;

// Packed blocks of `projections` with blocks of `panel_block` panels.
int64_t PackedBlocks(const std::vector<Projection>& projections, int64_t panel_block) {
  int64_t blocks = 0;
  for (const Projection& p : projections) {
    if (!p.UsesPackedWeights()) continue;
    const int64_t row_blocks = (p.rows + kPackedGemmRowBlock - 1) / kPackedGemmRowBlock;
    blocks += row_blocks * ((p.packed->panels() + panel_block - 1) / panel_block);
  }
  return blocks;
}

// Panels per packed block: kPackedGemmPanelBlock, or fewer (down to one
// panel) while the packed blocks would not give each of `threads` threads
// kBlocksPerThread. A block's panels do not change how any output element is
// summed (over k in one panel, in order), so neither does this.
int64_t PanelBlock(const std::vector<Projection>& projections, int threads) {
  int64_t block = kPackedGemmPanelBlock;
  if (threads == 1) return block;
  while (block > 1 && PackedBlocks(projections, block) < kBlocksPerThread * threads) --block;
  return block;
}

// Rows [begin, end) of a projection on the calling thread: on the packed
// weights' panels [panel_begin, panel_end), reading its input's BF16 pairs
// where given (in_pairs: those of its row 0) and its bf16 weights widened
// where given (widened), or (panel_end 0) on the BLAS.
void ProjectBlock(const Projection& p, int64_t begin, int64_t end, int64_t panel_begin,
                  int64_t panel_end, const uint32_t* in_pairs = nullptr,
                  const float* widened = nullptr) {
  if (panel_end > 0) {
    const PackedKernel kernel = PackedKernelFor(ActiveIsa(), p.packed->precision());
    kernel({p.in, p.in_cols(), p.out, p.out_row_stride(), p.packed, in_pairs, widened}, begin,
           end, panel_begin, panel_end);
    return;
  }
  const int64_t rows = end - begin;
  ConstMatrixMap in(p.in + begin * p.in_cols(), rows, p.in_cols());
  StridedMatrixMap out(p.out + begin * p.out_row_stride(), rows, p.out_cols(),
                       Eigen::OuterStride<>(p.out_row_stride()));
  // The bias is written first and the product added to it (BLAS beta = 1),
  // so the output is not read and written again after the product.
  if (p.bias) {
    out.rowwise() = p.bias->transpose();
  } else {
    out.setZero();
  }
  if (p.transposed) {
    out.noalias() += in * p.weight->transpose();
  } else {
    out.noalias() += in * *p.weight;
  }
}

void AddBlocks(const Projection& p, int64_t panel_block, std::vector<ProjectionBlock>& blocks) {
  if (!p.UsesPackedWeights()) {
    for (int64_t begin = 0; begin < p.rows; begin += kProjectionRows) {
      blocks.push_back({&p, begin, std::min(p.rows, begin + kProjectionRows)});
    }
    return;
  }
  const int64_t panels = p.packed->panels();
  for (int64_t begin = 0; begin < p.rows; begin += kPackedGemmRowBlock) {
    for (int64_t panel = 0; panel < panels; panel += panel_block) {
      blocks.push_back({&p, begin, std::min(p.rows, begin + kPackedGemmRowBlock), panel,
                        std::min(panels, panel + panel_block)});
    }
  }
}

// Most words of input pairs kept between calls (4 MiB, KeptBuffers): those
// of an input of 2,048 tokens at E = 1,024. A larger call's are freed after
// it, as GroupScratch frees an oversized group's buffers.
constexpr int64_t kKeptPairWords = int64_t{1} << 20;

// The inputs of a call's products whose kernel multiplies BF16 pairs
// (PackedKernelReadsPairs), rounded to pairs before the products run. A
// product's kernel would round its rows once per task, and every panel
// block of a row block is a task: Q, K and V at E = 512 (12 blocks of 4
// panels) rounded each input row 12 times, stalling on its cache misses
// (BENCHMARKS.md, "BF16"). Here the inputs merge into runs of rows, so that
// an input row is rounded once however many products read it: self-
// attention's Q, K and V read the same rows, and the K and V rows each
// example reads (run_multi_head.cc) lie inside Q's. The rounding is the
// kernel's own function on the same rows, so the products' bits do not
// change.
class InputPairs {
 public:
  explicit InputPairs(const std::vector<Projection>& projections);
  InputPairs(const InputPairs&) = delete;
  InputPairs& operator=(const InputPairs&) = delete;

  // Rounds every run, in row blocks spread over the pool, each asking
  // `stop` (if any) first.
  void Round(ThreadPool& pool, WorkStop* stop);
  // The pairs of projection i's row 0, or null: its kernel reads no pairs.
  const uint32_t* For(size_t i) const { return of_[i]; }

 private:
  // Rows [0, rows) from `in`, in_cols floats each, rounded into the run's
  // words from `first_word` on.
  struct Run {
    const float* in;
    int64_t rows, in_cols, first_word;

    int64_t row_words() const { return (in_cols + 1) / 2; }
  };

  // Adds p's rows to the last run if they start on its grid of rows (a
  // whole number of rows from its first, up to one past its last), else
  // starts a run; returns p's first row in its run.
  int64_t Place(const Projection& p);
  // Points words_ at `total` words: the kept ones (KeptBuffersOfThread), or
  // for an oversized call its own.
  void TakeWords(int64_t total);

  std::vector<Run> runs_;
  std::vector<const uint32_t*> of_;
  uint32_t* words_ = nullptr;
  std::vector<uint32_t> once_;
};

uintptr_t Address(const float* x) { return reinterpret_cast<uintptr_t>(x); }

// The indices of the products whose kernel reads pairs, by width, grid of
// rows (the address modulo a row's bytes) and address: the products whose
// rows overlap on one grid come together, each starting where or after the
// one before it.
std::vector<size_t> ReadingPairs(const std::vector<Projection>& projections) {
  std::vector<size_t> reading;
  for (size_t i = 0; i < projections.size(); ++i) {
    const Projection& p = projections[i];
    if (p.rows > 0 && p.UsesPackedWeights() &&
        PackedKernelReadsPairs(ActiveIsa(), p.packed->precision())) {
      reading.push_back(i);
    }
  }
  const auto key = [&](size_t i) {
    const Projection& p = projections[i];
    const uintptr_t row_bytes = static_cast<uintptr_t>(p.in_cols()) * sizeof(float);
    return std::tuple(p.in_cols(), Address(p.in) % row_bytes, Address(p.in));
  };
  std::sort(reading.begin(), reading.end(), [&](size_t a, size_t b) { return key(a) < key(b); });
  return reading;
}

InputPairs::InputPairs(const std::vector<Projection>& projections)
    : of_(projections.size(), nullptr) {
  const std::vector<size_t> reading = ReadingPairs(projections);
  if (reading.empty()) return;
  std::vector<std::pair<size_t, int64_t>> run_and_row(reading.size());
  for (size_t j = 0; j < reading.size(); ++j) {
    const int64_t row = Place(projections[reading[j]]);
    run_and_row[j] = {runs_.size() - 1, row};
  }
  int64_t total = 0;
  for (Run& run : runs_) {
    run.first_word = total;
    total += run.rows * run.row_words();
  }
  TakeWords(total);
  for (size_t j = 0; j < reading.size(); ++j) {
    const Run& run = runs_[run_and_row[j].first];
    of_[reading[j]] = words_ + run.first_word + run_and_row[j].second * run.row_words();
  }
}

int64_t InputPairs::Place(const Projection& p) {
  const int64_t in_cols = p.in_cols();
  const uintptr_t row_bytes = static_cast<uintptr_t>(in_cols) * sizeof(float);
  if (!runs_.empty()) {
    Run& run = runs_.back();
    const uintptr_t offset = Address(p.in) - Address(run.in);
    if (run.in_cols == in_cols && offset <= run.rows * row_bytes && offset % row_bytes == 0) {
      const int64_t row = static_cast<int64_t>(offset / row_bytes);
      run.rows = std::max(run.rows, row + p.rows);
      return row;
    }
  }
  runs_.push_back({p.in, p.rows, in_cols, 0});
  return 0;
}

void InputPairs::TakeWords(int64_t total) {
  std::vector<uint32_t>& words = total <= kKeptPairWords ? KeptBuffersOfThread().pairs : once_;
  GrowOnHugePages(words, static_cast<size_t>(total));
  words_ = words.data();
}

void InputPairs::Round(ThreadPool& pool, WorkStop* stop) {
  struct RowBlock {
    const Run* run;
    int64_t begin, end;
  };
  std::vector<RowBlock> blocks;
  for (const Run& run : runs_) {
    for (int64_t begin = 0; begin < run.rows; begin += kPackedGemmRowBlock) {
      blocks.push_back({&run, begin, std::min(run.rows, begin + kPackedGemmRowBlock)});
    }
  }
  pool.ParallelFor(static_cast<int64_t>(blocks.size()), [&](int64_t i) {
    if (stop != nullptr && stop->Stopped()) return;
    const RowBlock& b = blocks[i];
    const Run& run = *b.run;
    RoundToBf16Pairs(run.in + b.begin * run.in_cols, run.in_cols, b.end - b.begin, run.in_cols,
                     words_ + run.first_word + b.begin * run.row_words());
  });
}

// Fewest rows, over all of a call's products on the same bf16 weights, for
// which WidenedWeights widens them once for the call: below it the blocks
// are few rows each, which the kernel widens in registers at about fp32's
// speed, and widening whole weights would cost more than their products.
constexpr int64_t kWidenPerCallRows = 32;

// Most floats of widened weights kept between calls (4 MiB, KeptBuffers):
// Q, K and V at E = 512. Weights beyond it are widened per block, as
// without WidenedWeights (at E = 1,024 a block of 96 rows widens a panel in
// about 3% of its time).
constexpr int64_t kKeptWidenedFloats = int64_t{1} << 20;

// Alignment of the widened panels, in bytes: the kernel's aligned loads.
constexpr uintptr_t kWidenedAlignment = 64;

// The bf16 weights of a call's products on a path without BF16 products
// (PackedKernelWidens), widened to FP32 once for the call before the
// products run, so that every block of every product on them reads fp32
// panels as an fp32 model's blocks do. The kernel would widen each panel
// once per block, and blocks of fewer than 32 rows in registers, slower
// than fp32 by up to a third at 3 rows: K and V of a masked request are a
// product per example of its allowed rows, in blocks of 96 and a remainder
// of any size (BENCHMARKS.md, "BF16 fallback"). The same panels, the same
// sums in the same order: the products' bits do not change.
class WidenedWeights {
 public:
  explicit WidenedWeights(const std::vector<Projection>& projections);
  WidenedWeights(const WidenedWeights&) = delete;
  WidenedWeights& operator=(const WidenedWeights&) = delete;

  // Widens every weight, in blocks of panels spread over the pool, each
  // asking `stop` (if any) first.
  void Widen(ThreadPool& pool, WorkStop* stop);
  // Projection i's weights widened, or null: its kernel widens its own.
  const float* For(size_t i) const { return of_[i]; }

 private:
  struct Weights {
    const PackedWeights* weights;
    float* widened;
  };

  std::vector<Weights> weights_;
  std::vector<const float*> of_;
};

WidenedWeights::WidenedWeights(const std::vector<Projection>& projections)
    : of_(projections.size(), nullptr) {
  // Rows per distinct bf16 weights, in the order first seen.
  std::vector<std::pair<const PackedWeights*, int64_t>> rows;
  for (const Projection& p : projections) {
    if (p.rows == 0 || !p.UsesPackedWeights() ||
        !PackedKernelWidens(ActiveIsa(), p.packed->precision())) {
      continue;
    }
    auto it = std::find_if(rows.begin(), rows.end(),
                           [&](const auto& entry) { return entry.first == p.packed; });
    if (it == rows.end()) {
      rows.emplace_back(p.packed, p.rows);
    } else {
      it->second += p.rows;
    }
  }
  std::vector<float>& kept = KeptBuffersOfThread().widened;
  int64_t total = 0;
  std::vector<int64_t> offsets;
  for (const auto& [weights, count] : rows) {
    const int64_t floats = weights->panels() * weights->in_cols() * kPanelWidth;
    if (count < kWidenPerCallRows || total + floats > kKeptWidenedFloats) continue;
    weights_.push_back({weights, nullptr});
    offsets.push_back(total);
    total += floats;
  }
  if (weights_.empty()) return;
  const size_t floats = static_cast<size_t>(total) + kWidenedAlignment / sizeof(float);
  GrowOnHugePages(kept, floats);
  float* const base = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(kept.data()) + kWidenedAlignment - 1) & ~(kWidenedAlignment - 1));
  for (size_t w = 0; w < weights_.size(); ++w) weights_[w].widened = base + offsets[w];
  for (size_t i = 0; i < projections.size(); ++i) {
    for (const Weights& w : weights_) {
      if (projections[i].rows > 0 && projections[i].packed == w.weights) of_[i] = w.widened;
    }
  }
}

void WidenedWeights::Widen(ThreadPool& pool, WorkStop* stop) {
  struct PanelBlock {
    const Weights* weights;
    int64_t begin, end;
  };
  std::vector<PanelBlock> blocks;
  for (const Weights& w : weights_) {
    const int64_t panels = w.weights->panels();
    for (int64_t begin = 0; begin < panels; begin += kPackedGemmPanelBlock) {
      blocks.push_back({&w, begin, std::min(panels, begin + kPackedGemmPanelBlock)});
    }
  }
  pool.ParallelFor(static_cast<int64_t>(blocks.size()), [&](int64_t i) {
    if (stop != nullptr && stop->Stopped()) return;
    const PanelBlock& b = blocks[i];
    WidenBf16Panels(ActiveIsa(), *b.weights->weights, b.begin, b.end, b.weights->widened);
  });
}

}  // namespace

void ProjectAll(const Projection& p) {
  ProjectBlock(p, 0, p.rows, 0, p.UsesPackedWeights() ? p.packed->panels() : 0);
}

std::vector<ProjectionBlock> ProjectionBlocks(const std::vector<Projection>& projections,
                                              int threads) {
  const int64_t panel_block = PanelBlock(projections, threads);
  std::vector<ProjectionBlock> blocks;
  for (const Projection& p : projections) AddBlocks(p, panel_block, blocks);
  return blocks;
}

void RunProjections(ThreadPool& pool, const std::vector<Projection>& projections,
                    WorkStop* stop) {
  const std::vector<ProjectionBlock> blocks = ProjectionBlocks(projections, pool.num_threads());
  InputPairs pairs(projections);
  pairs.Round(pool, stop);
  WidenedWeights widened(projections);
  widened.Widen(pool, stop);
  pool.ParallelFor(static_cast<int64_t>(blocks.size()), [&](int64_t i) {
    if (stop != nullptr && stop->Stopped()) return;
    const ProjectionBlock& block = blocks[i];
    const auto index = static_cast<size_t>(block.projection - projections.data());
    ProjectBlock(*block.projection, block.begin, block.end, block.panel_begin, block.panel_end,
                 pairs.For(index), widened.For(index));
  });
}

}  // namespace attention::internal
