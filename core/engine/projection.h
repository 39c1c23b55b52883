// projection.h: the engine's projections (y = x W^T + b) and where each runs:
// on the packed GEMM (core/kernels/packed_gemm.h) or on the BLAS, in row and panel
// blocks spread over the pool (internal to the engine).
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <vector>

#include "core/kernels/cpu_features.h"
#include "core/kernels/flash_kernel.h"
#include "core/model/model.h"
#include "core/kernels/packed_weights.h"

namespace attention {

class ThreadPool;

namespace internal {

using ConstMatrixMap = Eigen::Map<const RowMatrix>;
using MatrixMap = Eigen::Map<RowMatrix>;

// out (rows x out_cols) = in (rows x in_cols) * weight^T + bias, or
// in * weight when `transposed` is false (bilinear's q^T W_k); or, when
// `packed` holds them, the same weight and bias packed.
struct Projection {
  const float* in;
  float* out;
  int64_t rows;
  const RowMatrix* weight;  // unread (and may be empty) when packed
  const Vector* bias;       // null: none
  bool transposed = true;
  // The same weight and bias packed (core/kernels/packed_weights.h); null or empty: none.
  const PackedWeights* packed = nullptr;
  int64_t out_stride = 0;  // floats between output rows; 0: out_cols()

  int64_t in_cols() const {
    if (UsesPackedWeights()) return packed->in_cols();
    return transposed ? weight->cols() : weight->rows();
  }
  int64_t out_cols() const {
    if (UsesPackedWeights()) return packed->out_cols();
    return transposed ? weight->rows() : weight->cols();
  }
  int64_t out_row_stride() const { return out_stride != 0 ? out_stride : out_cols(); }
  // Projections with packed weights (multi_head models, PackProjections) run
  // on them on every path, whatever their rows: the model holds them in no
  // other form. On the avx512 and avx2 paths the packed kernel was never
  // slower than the BLAS at any row count; the portable path's is scalar
  // (BENCHMARKS.md, "Projections"). The others run on the BLAS.
  bool UsesPackedWeights() const { return packed != nullptr && !packed->empty(); }
  // The same product over rows [first, first + count) only.
  Projection Rows(int64_t first, int64_t count) const {
    Projection part = *this;
    part.in += first * in_cols();
    part.out += first * out_row_stride();
    part.rows = count;
    return part;
  }
};

// The whole of one projection on the calling thread.
void ProjectAll(const Projection& p);

// A unit of projection work one thread takes: rows [begin, end) of every
// column on the BLAS (panel_end 0), or of the packed weights' panels
// [panel_begin, panel_end) only.
struct ProjectionBlock {
  const Projection* projection;
  int64_t begin, end;
  int64_t panel_begin = 0, panel_end = 0;
};

// The blocks RunProjections hands out over a pool of `threads`: packed
// products in row blocks times blocks of panels, the panel blocks narrower
// when the rows are too few to give every thread work; BLAS products in row
// blocks. Each output element is computed by one block, and its sum runs in
// the same order whatever the blocks, so the result does not depend on
// `threads`. The blocks point into `projections`.
std::vector<ProjectionBlock> ProjectionBlocks(const std::vector<Projection>& projections,
                                              int threads);

// Every projection of `projections`, in blocks spread over the pool. Where
// the kernel multiplies BF16 pairs (PackedKernelReadsPairs), the products'
// input rows are first rounded to pairs once, in row blocks over the pool,
// for all the blocks that read them (the same bits as each block rounding
// its own). With a `stop`, each block asks it first, so a stopped request's
// remaining blocks are skipped (a block is at most a few milliseconds of
// one core). Only a group of one request passes its stop (LoneStop): the
// rows of a larger group's products belong to all of its requests.
void RunProjections(ThreadPool& pool, const std::vector<Projection>& projections,
                    WorkStop* stop = nullptr);

}  // namespace internal
}  // namespace attention
