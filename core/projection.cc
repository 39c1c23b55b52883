// projection.cc: projection blocks on the packed GEMM or the BLAS
// (projection.h).
#include "core/projection.h"

#include <algorithm>

#include "core/packed_gemm.h"
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
// weights' panels [panel_begin, panel_end), or (panel_end 0) on the BLAS.
void ProjectBlock(const Projection& p, int64_t begin, int64_t end, int64_t panel_begin,
                  int64_t panel_end) {
  if (panel_end > 0) {
    const PackedKernel kernel = PackedKernelFor(ActiveIsa(), p.packed->precision());
    kernel({p.in, p.in_cols(), p.out, p.out_row_stride(), p.packed}, begin, end, panel_begin,
           panel_end);
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
  pool.ParallelFor(static_cast<int64_t>(blocks.size()), [&](int64_t i) {
    if (stop != nullptr && stop->Stopped()) return;
    const ProjectionBlock& block = blocks[i];
    ProjectBlock(*block.projection, block.begin, block.end, block.panel_begin, block.panel_end);
  });
}

}  // namespace attention::internal
