// tensor.h: the engine's tensor types.
//
// The engine reads row-major float32 data it does not own (TensorView, so a
// server can compute straight from its request messages) and writes tensors it
// owns (Tensor). Shapes are int64 as on the wire; validation checks them
// before any kernel trusts them.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace attention {

// A borrowed row-major float32 tensor. `data` must outlive every use.
struct TensorView {
  std::vector<int64_t> shape;
  std::span<const float> data;
};

// An owned row-major float32 tensor.
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;

  TensorView view() const { return {shape, data}; }
};

// "[2, 3, 4]": how error messages spell a shape.
std::string ShapeString(std::span<const int64_t> shape);

}  // namespace attention
