// model_loader.h: attention models from safetensors files.
//
// A model file is `<name>.safetensors` whose `__metadata__` names its kind
// ("additive", "bilinear", "multi_head" with "num_heads") and, optionally,
// the precision its products compute in ("precision": "fp32", the default,
// or "bf16"; docs/api.md). The multi-head
// layout (d2l `W_q.weight`... or torch.nn.MultiheadAttention `in_proj_weight`
// / `q_proj_weight`...) is recognised from the tensor names. F16 and BF16
// tensors are widened to float32. Any fault (truncated file, header beyond the
// file, offsets out of range or overlapping, unknown dtype, missing or
// mis-shaped tensor, bad metadata) is an error that names the file and the
// problem; nothing here aborts on bad bytes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "core/model/model.h"

namespace attention {

// Reads and parses `path`; the model's name is the file stem. A file larger
// than `max_file_bytes` (0: no cap) is refused unread (RESOURCE_EXHAUSTED),
// and running out of memory while loading is an error (RESOURCE_EXHAUSTED),
// not an exception. `force_fp32` loads a bf16 model as fp32 (the server's
// --force-fp32); its "precision" value must still be a known one.
absl::StatusOr<Model> LoadModel(const std::filesystem::path& path, uint64_t max_file_bytes = 0,
                                bool force_fp32 = false);

// Parses the bytes of a safetensors model file. `name` names the model (and
// the file in error messages).
absl::StatusOr<Model> ParseModel(const std::string& name, std::span<const uint8_t> bytes,
                                 bool force_fp32 = false);

}  // namespace attention
