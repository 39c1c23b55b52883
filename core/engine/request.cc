// request.cc: Validate(), the one place untrusted requests are checked.
#include "core/engine/request.h"

#include <cmath>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

#include "core/kernels/finite.h"
#include "core/status_macros.h"

namespace attention {
namespace {

using LengthMask = AttentionDims::LengthMask;

// a * b, or nullopt on int64 overflow (shapes come from the wire and may be huge).
std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t product;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

std::optional<int64_t> CheckedAdd(int64_t a, int64_t b) {
  int64_t sum;
  if (__builtin_add_overflow(a, b, &sum)) return std::nullopt;
  return sum;
}

}  // namespace

// Checks rank, positive sizes and data length; `axes` names the three axes.
absl::Status CheckTensorShape(absl::string_view field, const TensorView& tensor,
                              absl::string_view axes, size_t rank) {
  const auto& shape = tensor.shape;
  if (shape.size() != rank) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape: expected rank ", rank, " ", axes,
                                                   ", got rank ", shape.size(), " ",
                                                   ShapeString(shape)));
  }
  int64_t product = 1;
  for (size_t axis = 0; axis < shape.size(); ++axis) {
    if (shape[axis] <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".shape[", axis, "]: expected > 0 ",
                                                     axes, ", got ", shape[axis], " in ",
                                                     ShapeString(shape)));
    }
    auto next = CheckedMul(product, shape[axis]);
    if (!next) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shape: product of ", ShapeString(shape), " overflows 64-bit integers"));
    }
    product = *next;
  }
  if (static_cast<uint64_t>(product) != tensor.data.size()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".data: expected ", product,
                                                   " values (product of shape ",
                                                   ShapeString(shape), "), got ",
                                                   tensor.data.size()));
  }
  return absl::OkStatus();
}

absl::Status CheckTensorFinite(absl::string_view field, const TensorView& tensor) {
  const int64_t at = FirstNonFinite(tensor.data);
  if (at < 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ".data[", at, "]: expected a finite value, got ", tensor.data[at]));
}

absl::Status CheckTensorAxis(absl::string_view field, int axis, absl::string_view axis_name,
                             int64_t expected, int64_t actual, absl::string_view why) {
  if (expected == actual) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ".shape[", axis, "] (", axis_name,
                                                 "): expected ", expected, " (", why,
                                                 "), got ", actual));
}

float DefaultScale(const Model& model, const AttentionDims& dims) {
  switch (model.kind) {
    case Kind::kDotProduct:
    case Kind::kBilinear:
      return 1.0f / std::sqrt(static_cast<float>(dims.query_size));
    case Kind::kDistance:
    case Kind::kAdditive:
      return 1.0f;
    case Kind::kMultiHead:
      if (model.terms.scale > 0) return model.terms.scale;
      return 1.0f / std::sqrt(static_cast<float>(HeadSize(model)));
  }
  return 1.0f;
}

namespace {

// The largest position a request may give: rotary angles stay exact in
// double far beyond it.
constexpr int64_t kMaxPosition = int64_t{1} << 40;

// Query rows an engine thread works on at once; scratch is sized for them.
constexpr double kQueryBlockRows = 64;

// "12345", or "more than 2^63" for a double too large for int64.
std::string Count(double value) {
  if (value >= 9.2e18) return "more than 2^63";
  return absl::StrCat(static_cast<int64_t>(value));
}

// Grouped heads: every tensor 4-D, (B, n, heads, d).
bool Grouped(const AttentionRequest& request) { return request.queries.shape.size() == 4; }

// The three tensors' shapes, each on its own (CheckShape): the queries are
// required, keys and values optional. All are 3-D, or (dot_product) all 4-D.
absl::Status CheckShapes(const Model& model, const AttentionRequest& request) {
  if (request.queries.shape.empty() && request.queries.data.empty()) {
    return absl::InvalidArgumentError(
        "queries: required tensor (B, n_q, d_q) is missing");
  }
  if (!Grouped(request)) {
    RETURN_IF_ERROR(CheckTensorShape("queries", request.queries, "(B, n_q, d_q)"));
    if (request.keys) RETURN_IF_ERROR(CheckTensorShape("keys", *request.keys, "(B, n_k, d_k)"));
    if (request.values) {
      RETURN_IF_ERROR(CheckTensorShape("values", *request.values, "(B, n_k, d_v)"));
    }
    return absl::OkStatus();
  }
  if (model.kind != Kind::kDotProduct) {
    return absl::InvalidArgumentError(absl::StrCat(
        "queries.shape: expected rank 3 (B, n_q, d_q), got rank 4 ",
        ShapeString(request.queries.shape), ": grouped heads (B, n_q, H, d) are for dot_product, "
        "and model '", model.name, "' is ", std::string(KindName(model.kind))));
  }
  for (const auto& [field, tensor] :
       {std::pair<absl::string_view, const std::optional<TensorView>*>{"keys", &request.keys},
        {"values", &request.values}}) {
    if (tensor->has_value() && (*tensor)->shape.size() != 4) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shape: expected rank 4 like the queries (all three tensors are 3-D or all "
          "4-D), got rank ", (*tensor)->shape.size(), " ", ShapeString((*tensor)->shape),
          " beside queries of rank 4 ", ShapeString(request.queries.shape)));
    }
  }
  RETURN_IF_ERROR(CheckTensorShape("queries", request.queries, "(B, n_q, H, d)", 4));
  if (request.keys) RETURN_IF_ERROR(CheckTensorShape("keys", *request.keys, "(B, n_k, H_kv, d)", 4));
  if (request.values) {
    RETURN_IF_ERROR(CheckTensorShape("values", *request.values, "(B, n_k, H_kv, d_v)", 4));
  }
  return absl::OkStatus();
}

// The sizes the shapes give, after the self-attention shorthand; for
// grouped heads, the sizes of one head.
AttentionDims SizesOf(const AttentionRequest& request) {
  const TensorView& queries = request.queries;
  const TensorView& keys = ResolvedKeys(request);
  const size_t last = queries.shape.size() - 1;
  AttentionDims dims;
  dims.batch = queries.shape[0];
  dims.num_queries = queries.shape[1];
  dims.query_size = queries.shape[last];
  dims.num_keys = keys.shape[1];
  dims.key_size = keys.shape[last];
  dims.value_size = ResolvedValues(request).shape[last];
  if (Grouped(request)) {
    dims.grouped = true;
    dims.num_heads = queries.shape[2];
    dims.num_kv_heads = keys.shape[2];
  }
  return dims;
}

// Grouped heads: the values' kv heads are the keys', and H is a multiple
// of them.
absl::Status CheckHeads(const AttentionRequest& request, const AttentionDims& dims) {
  if (!dims.grouped) return absl::OkStatus();
  if (request.values) {
    RETURN_IF_ERROR(CheckTensorAxis("values", 2, "H_kv", dims.num_kv_heads,
                                    request.values->shape[2],
                                    request.keys ? "keys' H_kv" : "H, since keys = queries"));
  }
  if (dims.num_heads % dims.num_kv_heads == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "queries.shape[2] (H): expected a multiple of the keys' kv heads H_kv = ",
      dims.num_kv_heads, " (query head h reads kv head h / (H / H_kv)), got ", dims.num_heads));
}

// Keys and values agree with the queries' batch, values with the keys' n_k.
absl::Status CheckBatchAndKeyCounts(const AttentionRequest& request, const AttentionDims& dims) {
  RETURN_IF_ERROR(CheckTensorAxis(request.keys ? "keys" : "queries", 0, "B", dims.batch,
                                  ResolvedKeys(request).shape[0], "queries' batch"));
  if (!request.values) return absl::OkStatus();
  const TensorView& values = *request.values;
  RETURN_IF_ERROR(CheckTensorAxis("values", 0, "B", dims.batch, values.shape[0], "queries' batch"));
  return CheckTensorAxis("values", 1, "n_k", dims.num_keys, values.shape[1],
                         request.keys ? "keys' n_k" : "n_q, since keys = queries");
}

// The feature sizes the model's kind needs: d_k == d_q for the weightless
// kinds, the model's own sizes for the others.
absl::Status CheckModelSizes(const Model& model, const AttentionRequest& request,
                             const AttentionDims& dims) {
  // Name the tensors after the fields the caller actually sent.
  const absl::string_view keys_field = request.keys ? "keys" : "queries (standing in for keys)";
  const absl::string_view values_field =
      request.values ? "values" : (request.keys ? "keys (standing in for values)"
                                                : "queries (standing in for values)");
  if (model.kind == Kind::kDotProduct || model.kind == Kind::kDistance) {
    return CheckTensorAxis(keys_field, dims.grouped ? 3 : 2, "d_k", dims.query_size, dims.key_size,
                           absl::StrCat(std::string(KindName(model.kind)), " needs d_k == d_q"));
  }
  const std::string why = absl::StrCat("model '", model.name, "' input size");
  RETURN_IF_ERROR(CheckTensorAxis("queries", 2, "d_q", model.query_size, dims.query_size, why));
  RETURN_IF_ERROR(CheckTensorAxis(keys_field, 2, "d_k", model.key_size, dims.key_size, why));
  if (model.value_size == 0) return absl::OkStatus();
  return CheckTensorAxis(values_field, 2, "d_v", model.value_size, dims.value_size, why);
}

// The form of the length mask, from how many valid lengths were sent; each
// must be >= 0.
absl::StatusOr<LengthMask> CheckValidLens(const AttentionRequest& request,
                                          const AttentionDims& dims) {
  const int64_t num_lens = static_cast<int64_t>(request.valid_lens.size());
  LengthMask mask;
  if (num_lens == 0) {
    mask = LengthMask::kNone;
  } else if (num_lens == dims.batch) {
    mask = LengthMask::kPerExample;
  } else if (num_lens == dims.batch * dims.num_queries) {  // no overflow: <= queries' size
    mask = LengthMask::kPerQuery;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "valid_lens: expected 0, ", dims.batch, " (B, one per example) or ",
        dims.batch * dims.num_queries, " (B*n_q, one per query) entries, got ", num_lens));
  }
  for (int64_t i = 0; i < num_lens; ++i) {
    if (request.valid_lens[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("valid_lens[", i, "]: expected >= 0, got ",
                                                     request.valid_lens[i]));
    }
  }
  return mask;
}

// Limits::max_request_elements over inputs, output and weights together.
absl::Status CheckElementLimit(const AttentionRequest& request, const AttentionDims& dims,
                               const Limits& limits) {
  if (limits.max_request_elements <= 0) return absl::OkStatus();
  // Each term is at most a validated tensor's size or a product checked here.
  std::optional<int64_t> total = static_cast<int64_t>(request.queries.data.size());
  if (request.keys) total = CheckedAdd(*total, static_cast<int64_t>(request.keys->data.size()));
  if (total && request.values) {
    total = CheckedAdd(*total, static_cast<int64_t>(request.values->data.size()));
  }
  auto output = CheckedMul(dims.batch * dims.num_queries, dims.output_size);
  total = total && output ? CheckedAdd(*total, *output) : std::nullopt;
  if (total && request.return_attention_weights) {
    auto weights = CheckedMul(dims.batch, dims.num_heads);
    if (weights) weights = CheckedMul(*weights, dims.num_queries);
    if (weights) weights = CheckedMul(*weights, dims.num_keys);
    total = weights ? CheckedAdd(*total, *weights) : std::nullopt;
  }
  if (total && *total <= limits.max_request_elements) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "request: expected at most ", limits.max_request_elements,
      " float elements in queries, keys, values, output and weights together, got ",
      total ? absl::StrCat(*total) : std::string("more than 2^63")));
}

// Limits::max_request_work over RequestWork.
absl::Status CheckWorkLimit(const Model& model, const AttentionDims& dims, const Limits& limits) {
  if (limits.max_request_work <= 0) return absl::OkStatus();
  const double work = RequestWork(model, dims);
  if (work <= static_cast<double>(limits.max_request_work)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "request: expected at most ", limits.max_request_work,
      " work units (about one per multiply-add; docs/api.md, section 6.2) for one "
      "request, got ", Count(work), " (B=", dims.batch,
      " n_q=", dims.num_queries, " n_k=", dims.num_keys, " d_k=", dims.key_size,
      " d_v=", dims.value_size, " on ", std::string(KindName(model.kind)),
      "); split it into smaller requests"));
}

// Limits::max_request_scratch_elements over RequestScratch and, for
// additive models, over their projections.
absl::Status CheckScratchLimit(const Model& model, const AttentionDims& dims,
                               const Limits& limits) {
  if (limits.max_request_scratch_elements <= 0) return absl::OkStatus();
  const double scratch = RequestScratch(dims);
  if (scratch > static_cast<double>(limits.max_request_scratch_elements)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request: expected at most ", limits.max_request_scratch_elements,
        " floats of engine scratch per thread, got ", Count(scratch),
        " (64 query rows x (d_q=", dims.query_size, " + d_k=", dims.key_size,
        " + d_v=", dims.value_size, " + output ", dims.output_size,
        ")); feature sizes this wide are refused"));
  }
  // additive projects every query and key to its h hidden units before
  // scoring, all at once, so its projections grow with n_k, not with 64
  // query rows.
  if (model.kind != Kind::kAdditive) return absl::OkStatus();
  const double hidden = static_cast<double>(model.w_q.rows());
  const double projected = static_cast<double>(dims.batch) *
                           (static_cast<double>(dims.num_queries) + dims.num_keys) * hidden;
  if (projected <= static_cast<double>(limits.max_request_scratch_elements)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "request: expected at most ", limits.max_request_scratch_elements,
      " floats of additive projections, got ", Count(projected), " (B=", dims.batch,
      " x (n_q=", dims.num_queries, " + n_k=", dims.num_keys, ") x h=", model.w_q.rows(),
      "); split it into smaller requests"));
}

// position_ids: 0, n_q or B*n_q entries, each >= 0, and only for a model
// whose layer reads positions.
absl::Status CheckPositionIds(const Model& model, const AttentionRequest& request,
                              const AttentionDims& dims) {
  const int64_t count = static_cast<int64_t>(request.position_ids.size());
  if (count == 0) return absl::OkStatus();
  if (model.terms.rotary.dims == 0 && model.terms.alibi_slopes.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "position_ids: model '", model.name,
        "' has neither rotary positions nor ALiBi, so it reads no positions; omit them"));
  }
  if (count != dims.num_queries && count != dims.batch * dims.num_queries) {
    return absl::InvalidArgumentError(absl::StrCat(
        "position_ids: expected 0, ", dims.num_queries, " (n_q, for every example) or ",
        dims.batch * dims.num_queries, " (B*n_q, row-major) entries, got ", count));
  }
  for (int64_t i = 0; i < count; ++i) {
    if (request.position_ids[i] < 0 || request.position_ids[i] > kMaxPosition) {
      return absl::InvalidArgumentError(absl::StrCat("position_ids[", i, "]: expected 0 to ",
                                                     kMaxPosition, ", got ",
                                                     request.position_ids[i]));
    }
  }
  return absl::OkStatus();
}

// sliding_window and softcap: dot_product only (a multi_head model's layer
// fixes its own), a window >= 0 and a finite cap >= 0.
absl::Status CheckScoreTerms(const Model& model, const AttentionRequest& request) {
  if (!request.sliding_window && !request.softcap) return absl::OkStatus();
  if (model.kind != Kind::kDotProduct) {
    return absl::InvalidArgumentError(absl::StrCat(
        request.sliding_window ? "sliding_window" : "softcap",
        ": only dot_product models take it (model '", model.name, "' is ",
        std::string(KindName(model.kind)),
        model.kind == Kind::kMultiHead ? ", whose layer fixes its own window and soft-cap)"
                                       : ")"));
  }
  if (request.sliding_window && *request.sliding_window < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sliding_window: expected >= 0 (0: no window), got ", *request.sliding_window));
  }
  if (request.softcap && !(std::isfinite(*request.softcap) && *request.softcap >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "softcap: expected a finite value >= 0 (0: none), got ", *request.softcap));
  }
  return absl::OkStatus();
}

}  // namespace

double RequestWork(const Model& model, const AttentionDims& dims) {
  const double b = dims.batch, n_q = dims.num_queries, n_k = dims.num_keys;
  const double d_q = dims.query_size, d_k = dims.key_size, d_v = dims.value_size;
  const double scores = b * dims.num_heads * n_q * n_k;
  switch (model.kind) {
    case Kind::kDotProduct:
    case Kind::kDistance:
      return scores * (d_k + d_v + kSoftmaxWork);
    case Kind::kAdditive: {
      const double hidden = static_cast<double>(model.w_q.rows());
      return b * (n_q * d_q + n_k * d_k) * hidden +
             scores * (hidden * kAdditiveHiddenWork + d_v + kSoftmaxWork);
    }
    case Kind::kBilinear:
      return b * n_k * d_k * d_q + scores * (d_q + d_v + kSoftmaxWork);
    case Kind::kMultiHead: {
      const double e = static_cast<double>(model.output_size);
      const double queries = static_cast<double>(QueryWidth(model));
      const double kv = static_cast<double>(KvWidth(model));
      const double head = static_cast<double>(HeadSize(model));
      return b * (n_q * (d_q + e) * queries + n_k * (d_k + d_v) * kv) +
             scores * (2 * head + kSoftmaxWork);
    }
  }
  return scores * (d_k + d_v + kSoftmaxWork);
}

double RequestScratch(const AttentionDims& dims) {
  return kQueryBlockRows * (static_cast<double>(dims.query_size) + dims.key_size +
                            dims.value_size + dims.output_size);
}

const TensorView& ResolvedKeys(const AttentionRequest& request) {
  return request.keys ? *request.keys : request.queries;
}

const TensorView& ResolvedValues(const AttentionRequest& request) {
  return request.values ? *request.values : ResolvedKeys(request);
}

absl::StatusOr<AttentionDims> Validate(const Model& model, const AttentionRequest& request,
                                       const Limits& limits) {
  RETURN_IF_ERROR(CheckShapes(model, request));
  AttentionDims dims = SizesOf(request);
  RETURN_IF_ERROR(CheckBatchAndKeyCounts(request, dims));
  RETURN_IF_ERROR(CheckHeads(request, dims));
  RETURN_IF_ERROR(CheckModelSizes(model, request, dims));
  dims.output_size = model.output_size != 0 ? model.output_size : dims.num_heads * dims.value_size;
  if (model.kind == Kind::kMultiHead) dims.num_heads = model.num_heads;
  absl::StatusOr<LengthMask> length_mask = CheckValidLens(request, dims);
  if (!length_mask.ok()) return length_mask.status();
  dims.length_mask = *length_mask;
  if (request.scale && !std::isfinite(*request.scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("scale: expected a finite value, got ", *request.scale));
  }
  dims.scale = request.scale ? *request.scale : DefaultScale(model, dims);
  RETURN_IF_ERROR(CheckPositionIds(model, request, dims));
  RETURN_IF_ERROR(CheckScoreTerms(model, request));
  RETURN_IF_ERROR(CheckElementLimit(request, dims, limits));
  // Before the finiteness pass: a request refused for its cost is refused
  // cheaply.
  RETURN_IF_ERROR(CheckWorkLimit(model, dims, limits));
  RETURN_IF_ERROR(CheckScratchLimit(model, dims, limits));
  RETURN_IF_ERROR(CheckTensorFinite("queries", request.queries));
  if (request.keys) RETURN_IF_ERROR(CheckTensorFinite("keys", *request.keys));
  if (request.values) RETURN_IF_ERROR(CheckTensorFinite("values", *request.values));
  return dims;
}

}  // namespace attention
