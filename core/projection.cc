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

// A BLAS block is rows [begin, end) of every column; a packed block also
// names its panels [panel_begin, panel_end) (panel_end 0 for the BLAS).
struct Block {
  const Projection* projection;
  int64_t begin, end;
  int64_t panel_begin = 0, panel_end = 0;
};

void AddBlocks(const Projection& p, std::vector<Block>& blocks) {
  if (!p.UsesPackedWeights()) {
    for (int64_t begin = 0; begin < p.rows; begin += kProjectionRows) {
      blocks.push_back({&p, begin, std::min(p.rows, begin + kProjectionRows)});
    }
    return;
  }
  const int64_t panels = p.packed->panels();
  for (int64_t begin = 0; begin < p.rows; begin += kPackedGemmRowBlock) {
    for (int64_t panel = 0; panel < panels; panel += kPackedGemmPanelBlock) {
      blocks.push_back({&p, begin, std::min(p.rows, begin + kPackedGemmRowBlock), panel,
                        std::min(panels, panel + kPackedGemmPanelBlock)});
    }
  }
}

}  // namespace

void ProjectAll(const Projection& p) {
  ProjectBlock(p, 0, p.rows, 0, p.UsesPackedWeights() ? p.packed->panels() : 0);
}

void RunProjections(ThreadPool& pool, const std::vector<Projection>& projections,
                    WorkStop* stop) {
  std::vector<Block> blocks;
  for (const Projection& p : projections) AddBlocks(p, blocks);
  pool.ParallelFor(static_cast<int64_t>(blocks.size()), [&](int64_t i) {
    if (stop != nullptr && stop->Stopped()) return;
    const Block& block = blocks[i];
    ProjectBlock(*block.projection, block.begin, block.end, block.panel_begin, block.panel_end);
  });
}

}  // namespace attention::internal
