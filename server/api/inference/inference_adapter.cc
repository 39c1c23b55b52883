// inference_adapter.cc: decoding ModelInferRequest, encoding its response,
// and the model descriptions of ModelMetadata and ModelConfig.
#include "server/api/inference/inference_adapter.h"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/kernels/float16.h"
#include "server/observability/request_names.h"

namespace attention::server {
namespace {

static_assert(std::endian::native == std::endian::little,
              "raw tensor contents are little-endian and copied as they are");

using InputTensor = inference::ModelInferRequest::InferInputTensor;

// The protocol's datatype names used here, with their byte widths.
enum class DataType { kFp32, kFp16, kBf16, kInt32, kInt64 };

struct DataTypeInfo {
  absl::string_view name;
  DataType type;
  int64_t bytes;
};

constexpr DataTypeInfo kDataTypes[] = {
    {"FP32", DataType::kFp32, 4},   {"FP16", DataType::kFp16, 2},   {"BF16", DataType::kBf16, 2},
    {"INT32", DataType::kInt32, 4}, {"INT64", DataType::kInt64, 8},
};

const DataTypeInfo* FindDataType(absl::string_view name) {
  for (const DataTypeInfo& info : kDataTypes) {
    if (info.name == name) return &info;
  }
  return nullptr;
}

bool IsFloat(DataType type) {
  return type == DataType::kFp32 || type == DataType::kFp16 || type == DataType::kBf16;
}

std::string ShapeString(const google::protobuf::RepeatedField<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status InputError(absl::string_view name, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("inputs '", name, "': ", what));
}

template <typename T>
T ReadLittleEndian(const char* bytes) {
  T value;
  std::memcpy(&value, bytes, sizeof(T));
  return value;
}

// Checks that a typed contents list holds `expected` values.
absl::Status CheckTypedCount(const InputTensor& input, absl::string_view field, int64_t got,
                             int64_t expected) {
  if (got == expected) return absl::OkStatus();
  return InputError(
      input.name(),
      absl::StrCat("contents.", field, " holds ", got, " values; expected ", expected, " (shape ",
                   ShapeString(input.shape()), ", ", input.datatype(), ")"));
}

// One input's data: the raw bytes when `raw` is set, else the typed list of
// its datatype.
struct InputData {
  const InputTensor* input;
  const DataTypeInfo* type;
  int64_t count;
  const std::string* raw;  // nullptr: typed contents
};

absl::StatusOr<InputData> Locate(const InputTensor& input, const std::string* raw) {
  const DataTypeInfo* type = FindDataType(input.datatype());
  absl::StatusOr<int64_t> count = ElementCount(input);
  if (!count.ok()) return count.status();
  const bool integers = input.name() == kValidLensInput || input.name() == kPositionIdsInput;
  if (type == nullptr || IsFloat(type->type) == integers) {
    return InputError(input.name(), absl::StrCat("datatype: expected ",
                                                 integers ? "INT32 or INT64" : "FP32, FP16 or BF16",
                                                 ", got '", input.datatype(), "'"));
  }
  if (raw != nullptr) {
    if (input.has_contents()) {
      return InputError(input.name(),
                        "contents: must be empty when the request uses raw_input_contents");
    }
    const int64_t expected = *count * type->bytes;
    if (static_cast<int64_t>(raw->size()) != expected) {
      return InputError(
          input.name(),
          absl::StrCat("its raw bytes (raw_input_contents; binary_data_size over REST) are ",
                       raw->size(), " bytes; expected ", expected, " (shape ",
                       ShapeString(input.shape()), ", ", type->name, ", ", type->bytes,
                       " bytes each)"));
    }
    return InputData{&input, type, *count, raw};
  }
  const inference::InferTensorContents& contents = input.contents();
  absl::Status counted;
  switch (type->type) {
    case DataType::kFp32:
      counted = CheckTypedCount(input, "fp32_contents", contents.fp32_contents_size(), *count);
      break;
    case DataType::kInt32:
      counted = CheckTypedCount(input, "int_contents", contents.int_contents_size(), *count);
      break;
    case DataType::kInt64:
      counted = CheckTypedCount(input, "int64_contents", contents.int64_contents_size(), *count);
      break;
    case DataType::kFp16:
    case DataType::kBf16:
      // The protocol has no typed field for 16-bit floats.
      if (*count != 0) {
        return InputError(input.name(), absl::StrCat(type->name,
                                                     " data: expected in raw_input_contents, "
                                                     "got typed contents"));
      }
      break;
  }
  if (!counted.ok()) return counted;
  return InputData{&input, type, *count, nullptr};
}

Tensor ToFloatTensor(const InputData& data) {
  Tensor tensor;
  tensor.shape.assign(data.input->shape().begin(), data.input->shape().end());
  tensor.data.resize(static_cast<size_t>(data.count));
  if (data.raw == nullptr) {
    if (data.type->type == DataType::kFp32) {
      const auto& typed = data.input->contents().fp32_contents();
      std::copy(typed.begin(), typed.end(), tensor.data.begin());
    }
    return tensor;
  }
  const char* bytes = data.raw->data();
  switch (data.type->type) {
    case DataType::kFp32:
      std::memcpy(tensor.data.data(), bytes, tensor.data.size() * sizeof(float));
      break;
    case DataType::kFp16:
      for (size_t i = 0; i < tensor.data.size(); ++i) {
        tensor.data[i] = HalfToFloat(ReadLittleEndian<uint16_t>(bytes + 2 * i));
      }
      break;
    case DataType::kBf16:
      for (size_t i = 0; i < tensor.data.size(); ++i) {
        tensor.data[i] = BFloat16ToFloat(ReadLittleEndian<uint16_t>(bytes + 2 * i));
      }
      break;
    case DataType::kInt32:
    case DataType::kInt64:
      break;  // Locate() keeps integer types away from float inputs
  }
  return tensor;
}

// INT64 lengths saturate to int32: every length >= n_k masks nothing and every
// negative one is refused by validation, so saturating keeps the meaning.
int32_t Saturate(int64_t length) {
  return static_cast<int32_t>(std::clamp<int64_t>(length, std::numeric_limits<int32_t>::min(),
                                                  std::numeric_limits<int32_t>::max()));
}

// The values of an INT32 or INT64 input, as int64.
std::vector<int64_t> ToIntegers(const InputData& data) {
  std::vector<int64_t> values(static_cast<size_t>(data.count));
  const bool wide = data.type->type == DataType::kInt64;
  for (size_t i = 0; i < values.size(); ++i) {
    if (data.raw != nullptr) {
      const char* at = data.raw->data() + i * static_cast<size_t>(data.type->bytes);
      values[i] = wide ? ReadLittleEndian<int64_t>(at) : ReadLittleEndian<int32_t>(at);
    } else {
      values[i] = wide ? data.input->contents().int64_contents(static_cast<int>(i))
                       : data.input->contents().int_contents(static_cast<int>(i));
    }
  }
  return values;
}

std::vector<int32_t> ToLengths(const InputData& data) {
  const std::vector<int64_t> wide = ToIntegers(data);
  std::vector<int32_t> lengths(wide.size());
  std::transform(wide.begin(), wide.end(), lengths.begin(), Saturate);
  return lengths;
}

// A per-query input (valid_lens, position_ids) of shape [x] or [B, n_q]: the
// two forms validation tells apart by length once flattened, where x is B
// for valid_lens and n_q for position_ids; any other shape would be misread,
// so it is refused.
absl::Status CheckPerQueryShape(const InputTensor& input, const Tensor& queries) {
  const auto& shape = input.shape();
  if (shape.size() == 1) return absl::OkStatus();
  // queries are (B, n_q, d) or, grouped heads, (B, n_q, H, d).
  const bool batched = queries.shape.size() >= 3;
  if (shape.size() == 2 && batched && shape[0] == queries.shape[0] &&
      shape[1] == queries.shape[1]) {
    return absl::OkStatus();
  }
  const bool lens = input.name() == kValidLensInput;
  std::string expected = lens ? "[B] or [B, n_q]" : "[n_q] or [B, n_q]";
  if (batched) {
    expected = absl::StrCat("[", queries.shape[lens ? 0 : 1], "] or [", queries.shape[0], ", ",
                            queries.shape[1], "]");
  }
  return InputError(input.name(),
                    absl::StrCat("shape: expected ", expected, ", got ", ShapeString(shape)));
}

absl::string_view ParameterKind(const inference::InferParameter& parameter) {
  switch (parameter.parameter_choice_case()) {
    case inference::InferParameter::kBoolParam:
      return "bool_param";
    case inference::InferParameter::kInt64Param:
      return "int64_param";
    case inference::InferParameter::kStringParam:
      return "string_param";
    case inference::InferParameter::kDoubleParam:
      return "double_param";
    case inference::InferParameter::kUint64Param:
      return "uint64_param";
    case inference::InferParameter::PARAMETER_CHOICE_NOT_SET:
      break;
  }
  return "nothing";
}

absl::Status ParameterError(absl::string_view name, absl::string_view expected,
                            const inference::InferParameter& got) {
  return absl::InvalidArgumentError(
      absl::StrCat("parameters '", name, "': expected ", expected, ", got ", ParameterKind(got)));
}

// Reads the request parameters the binding knows; any other parameter is
// ignored, as Triton does, since clients add their own.
absl::Status ReadParameters(const inference::ModelInferRequest& proto,
                            DecodedInferRequest* decoded) {
  for (const auto& [name, parameter] : proto.parameters()) {
    if (name == kCausalParameter || name == kReturnWeightsParameter) {
      if (!parameter.has_bool_param()) return ParameterError(name, "bool_param", parameter);
      if (name == kCausalParameter) {
        decoded->request.causal = parameter.bool_param();
      } else {
        decoded->returns_weights |= parameter.bool_param();
      }
    } else if (name == kScaleParameter || name == kSoftcapParameter) {
      if (!parameter.has_double_param()) return ParameterError(name, "double_param", parameter);
      (name == kScaleParameter ? decoded->request.scale : decoded->request.softcap) =
          static_cast<float>(parameter.double_param());
    } else if (name == kSlidingWindowParameter) {
      if (!parameter.has_int64_param()) return ParameterError(name, "int64_param", parameter);
      decoded->request.sliding_window = parameter.int64_param();
    }
  }
  return absl::OkStatus();
}

// A sequence_id as the request gives it: an integer (int64 or uint64) or a
// string; 0 and "" name no sequence.
absl::StatusOr<std::optional<std::variant<int64_t, std::string>>> ReadSequenceId(
    const inference::InferParameter& parameter) {
  using Id = std::variant<int64_t, std::string>;
  switch (parameter.parameter_choice_case()) {
    case inference::InferParameter::kInt64Param:
      if (parameter.int64_param() == 0) return std::nullopt;
      return std::optional<Id>(parameter.int64_param());
    case inference::InferParameter::kUint64Param:
      if (parameter.uint64_param() == 0) return std::nullopt;
      if (parameter.uint64_param() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return absl::InvalidArgumentError(absl::StrCat("parameters '", kSequenceIdParameter,
                                                       "': expected at most 2^63-1, got ",
                                                       parameter.uint64_param()));
      }
      return std::optional<Id>(static_cast<int64_t>(parameter.uint64_param()));
    case inference::InferParameter::kStringParam:
      if (parameter.string_param().empty()) return std::nullopt;
      return std::optional<Id>(parameter.string_param());
    default:
      return ParameterError(kSequenceIdParameter, "int64_param, uint64_param or string_param",
                            parameter);
  }
}

// session_memory: "self" (every request's rows are appended) or "cross"
// (keys and values fixed at sequence_start).
absl::StatusOr<SessionMemory> ReadSessionMemory(const inference::InferParameter& parameter) {
  if (!parameter.has_string_param()) {
    return ParameterError(kSessionMemoryParameter, "string_param", parameter);
  }
  if (parameter.string_param() == "self") return SessionMemory::kSelf;
  if (parameter.string_param() == "cross") return SessionMemory::kCross;
  return absl::InvalidArgumentError(absl::StrCat("parameters '", kSessionMemoryParameter,
                                                 "': expected \"self\" or \"cross\", got \"",
                                                 Printable(parameter.string_param()), "\""));
}

// An empty list means the default output only; a list means exactly those.
absl::Status ReadRequestedOutputs(const inference::ModelInferRequest& proto,
                                  DecodedInferRequest* decoded) {
  if (proto.outputs().empty()) return absl::OkStatus();
  decoded->returns_output = false;
  bool named_weights = false;
  for (int i = 0; i < proto.outputs_size(); ++i) {
    const std::string& name = proto.outputs(i).name();
    bool* seen = name == kOutputOutput    ? &decoded->returns_output
                 : name == kWeightsOutput ? &named_weights
                                          : nullptr;
    if (seen == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("outputs[", i, "] '", name, "': expected '",
                                                     kOutputOutput, "' or '", kWeightsOutput, "'"));
    }
    if (*seen) {
      return absl::InvalidArgumentError(
          absl::StrCat("outputs[", i, "] '", name, "': requested twice"));
    }
    *seen = true;
  }
  decoded->returns_weights |= named_weights;
  return absl::OkStatus();
}

void AddOutput(absl::string_view name, const Tensor& tensor,
               inference::ModelInferResponse* response) {
  auto* output = response->add_outputs();
  output->set_name(std::string(name));
  output->set_datatype("FP32");
  output->mutable_shape()->Assign(tensor.shape.begin(), tensor.shape.end());
  response->add_raw_output_contents()->assign(reinterpret_cast<const char*>(tensor.data.data()),
                                              tensor.data.size() * sizeof(float));
}

// -1 where the request chooses the size (0 in Model means any).
int64_t SizeOrAny(int64_t size) { return size == 0 ? -1 : size; }

struct TensorSpec {
  absl::string_view name;
  absl::string_view datatype;
  inference::DataType config_type;
  std::vector<int64_t> shape;
  bool optional;
};

// Whether `model` reads the tokens' positions (rotary or ALiBi), so that
// position_ids is one of its inputs.
bool ReadsPositions(const Model& model) {
  return model.terms.rotary.dims > 0 || !model.terms.alibi_slopes.empty();
}

std::vector<TensorSpec> InputSpecs(const Model& model) {
  std::vector<TensorSpec> specs = {
      {kQueriesInput, "FP32", inference::TYPE_FP32, {-1, -1, SizeOrAny(model.query_size)}, false},
      {kKeysInput, "FP32", inference::TYPE_FP32, {-1, -1, SizeOrAny(model.key_size)}, true},
      {kValuesInput, "FP32", inference::TYPE_FP32, {-1, -1, SizeOrAny(model.value_size)}, true},
      {kValidLensInput, "INT32", inference::TYPE_INT32, {-1}, true},
  };
  if (ReadsPositions(model)) {
    specs.push_back({kPositionIdsInput, "INT64", inference::TYPE_INT64, {-1, -1}, true});
  }
  return specs;
}

// `value` as the shortest text that reads back as it: whole numbers in
// full ("1000000", not "1e+06"), as a config.json writes them.
template <typename T>
std::string NumberText(T value) {
  if (value == std::floor(value) && std::abs(value) < T(1e15)) {
    return absl::StrCat(static_cast<int64_t>(value));
  }
  char text[64];
  const auto written = std::to_chars(text, text + sizeof(text), value);
  return std::string(text, written.ptr);
}

// The multi_head layer's shape and terms (docs/api.md section 5.6), as
// ModelMetadata's properties and ModelConfig's parameters give them: heads,
// kv heads, head_dim, the rotary positions and the window; nothing for the
// other kinds, whose sizes the tensor shapes say.
std::vector<std::pair<std::string, std::string>> LayerProperties(const Model& model) {
  if (model.kind != Kind::kMultiHead) return {};
  const LayerTerms& terms = model.terms;
  std::vector<std::pair<std::string, std::string>> properties = {
      {"num_heads", absl::StrCat(model.num_heads)},
      {"num_kv_heads", absl::StrCat(KvHeads(model))},
      {"head_dim", absl::StrCat(HeadSize(model))},
      {"sliding_window", absl::StrCat(terms.sliding_window)},
      {"softcap", NumberText(terms.softcap)},
      {"alibi", terms.alibi_slopes.empty() ? "false" : "true"},
      {"sinks", terms.sinks.empty() ? "false" : "true"},
      {"rope_type", terms.rotary.dims > 0 ? terms.rotary.type : ""},
  };
  if (terms.rotary.dims > 0) {
    properties.insert(properties.end(),
                      {{"rope_theta", NumberText(terms.rotary.theta)},
                       {"rope_interleaved", terms.rotary.interleaved ? "true" : "false"},
                       {"rotary_dim", absl::StrCat(terms.rotary.dims)}});
  }
  return properties;
}

std::vector<TensorSpec> OutputSpecs(const Model& model) {
  const int64_t width = model.kind == Kind::kMultiHead ? model.output_size : model.value_size;
  std::vector<int64_t> weights = {-1, -1, -1};
  if (model.kind == Kind::kMultiHead) weights = {-1, SizeOrAny(model.num_heads), -1, -1};
  return {
      {kOutputOutput, "FP32", inference::TYPE_FP32, {-1, -1, SizeOrAny(width)}, false},
      {kWeightsOutput, "FP32", inference::TYPE_FP32, weights, true},
  };
}

}  // namespace

bool IsFloatParameter(absl::string_view name) {
  return name == kScaleParameter || name == kSoftcapParameter;
}

absl::StatusOr<int64_t> ElementCount(const InputTensor& input) {
  constexpr int64_t kMaxElements = int64_t{1} << 40;
  int64_t count = 1;
  for (int64_t size : input.shape()) {
    if (size < 0) {
      return InputError(input.name(), absl::StrCat("shape ", ShapeString(input.shape()),
                                                   ": expected sizes >= 0, got ", size));
    }
    if (size != 0 && count > kMaxElements / size) {
      return InputError(input.name(), absl::StrCat("shape ", ShapeString(input.shape()),
                                                   " has more than 2^40 elements"));
    }
    count *= size;
  }
  return count;
}

absl::Status DecodeInferRequest(const inference::ModelInferRequest& proto,
                                DecodedInferRequest* decoded) {
  const bool raw = !proto.raw_input_contents().empty();
  if (raw && proto.raw_input_contents_size() != proto.inputs_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("raw_input_contents: expected one entry per input (", proto.inputs_size(),
                     "), got ", proto.raw_input_contents_size()));
  }
  std::vector<const InputTensor*> per_query_inputs;
  for (int i = 0; i < proto.inputs_size(); ++i) {
    const InputTensor& input = proto.inputs(i);
    const absl::string_view name = input.name();
    const bool known = name == kQueriesInput || name == kKeysInput || name == kValuesInput ||
                       name == kValidLensInput || name == kPositionIdsInput;
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat(
          "inputs[", i, "] '", name, "': expected one of '", kQueriesInput, "', '", kKeysInput,
          "', '", kValuesInput, "', '", kValidLensInput, "', '", kPositionIdsInput, "'"));
    }
    for (int j = 0; j < i; ++j) {
      if (proto.inputs(j).name() == name) {
        return absl::InvalidArgumentError(
            absl::StrCat("inputs[", i, "] '", name, "': given twice (also inputs[", j, "])"));
      }
    }
    absl::StatusOr<InputData> data = Locate(input, raw ? &proto.raw_input_contents(i) : nullptr);
    if (!data.ok()) return data.status();
    if (name == kQueriesInput) {
      decoded->queries = ToFloatTensor(*data);
    } else if (name == kKeysInput) {
      decoded->keys = ToFloatTensor(*data);
    } else if (name == kValuesInput) {
      decoded->values = ToFloatTensor(*data);
    } else if (name == kValidLensInput) {
      decoded->valid_lens = ToLengths(*data);
      per_query_inputs.push_back(&input);
    } else {
      decoded->position_ids = ToIntegers(*data);
      per_query_inputs.push_back(&input);
    }
  }
  const bool has_queries =
      std::any_of(proto.inputs().begin(), proto.inputs().end(),
                  [](const InputTensor& t) { return t.name() == kQueriesInput; });
  if (!has_queries) {
    return absl::InvalidArgumentError(
        absl::StrCat("inputs: expected an input named '", kQueriesInput, "', got none"));
  }
  for (const InputTensor* input : per_query_inputs) {
    if (absl::Status s = CheckPerQueryShape(*input, decoded->queries); !s.ok()) return s;
  }
  if (absl::Status s = ReadParameters(proto, decoded); !s.ok()) return s;
  if (absl::Status s = ReadRequestedOutputs(proto, decoded); !s.ok()) return s;

  AttentionRequest& request = decoded->request;
  request.queries = decoded->queries.view();
  if (decoded->keys) request.keys = decoded->keys->view();
  if (decoded->values) request.values = decoded->values->view();
  request.valid_lens = decoded->valid_lens;
  request.position_ids = decoded->position_ids;
  request.return_attention_weights = decoded->returns_weights;
  return absl::OkStatus();
}

absl::StatusOr<std::optional<SequenceParameters>> ReadSequenceParameters(
    const inference::ModelInferRequest& proto) {
  SequenceParameters sequence;
  std::optional<std::variant<int64_t, std::string>> id;
  for (const auto& [name, parameter] : proto.parameters()) {
    if (name == kSequenceIdParameter) {
      absl::StatusOr<std::optional<std::variant<int64_t, std::string>>> read =
          ReadSequenceId(parameter);
      if (!read.ok()) return read.status();
      id = *std::move(read);
    } else if (name == kSequenceStartParameter || name == kSequenceEndParameter) {
      if (!parameter.has_bool_param()) return ParameterError(name, "bool_param", parameter);
      (name == kSequenceStartParameter ? sequence.start : sequence.end) = parameter.bool_param();
    } else if (name == kSessionMemoryParameter) {
      absl::StatusOr<SessionMemory> memory = ReadSessionMemory(parameter);
      if (!memory.ok()) return memory.status();
      sequence.memory = *memory;
    }
  }
  if (sequence.memory.has_value() && !sequence.start) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameters '", kSessionMemoryParameter, "': expected only with '",
                     kSequenceStartParameter, "' (a sequence keeps the memory it opened with)"));
  }
  if (!id.has_value()) {
    if (sequence.start || sequence.end) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameters '", sequence.start ? kSequenceStartParameter : kSequenceEndParameter,
          "': expected with a non-zero '", kSequenceIdParameter, "', got none"));
    }
    return std::nullopt;
  }
  sequence.id = *std::move(id);
  return std::optional<SequenceParameters>(std::move(sequence));
}

void EncodeInferResponse(const inference::ModelInferRequest& proto,
                         const DecodedInferRequest& decoded, const AttentionResult& result,
                         inference::ModelInferResponse* response, int64_t version) {
  response->set_model_name(proto.model_name());
  response->set_model_version(std::to_string(version));
  response->set_id(proto.id());
  if (decoded.returns_output) AddOutput(kOutputOutput, result.output, response);
  if (decoded.returns_weights) AddOutput(kWeightsOutput, result.attention_weights, response);
}

absl::StatusOr<std::optional<int64_t>> ParseModelVersion(std::string_view text) {
  if (text.empty()) return std::optional<int64_t>();
  int64_t version = 0;
  const bool digits =
      std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (!digits || text.front() == '0' ||
      !absl::SimpleAtoi(absl::string_view(text.data(), text.size()), &version)) {
    return absl::NotFoundError(absl::StrCat(
        "model_version: expected a version number (1, 2, ...) or empty for the newest, got '",
        Printable(text), "'"));
  }
  return std::optional<int64_t>(version);
}

inference::ModelMetadataResponse ToModelMetadata(const Model& model,
                                                 const std::vector<int64_t>& versions) {
  inference::ModelMetadataResponse metadata;
  metadata.set_name(model.name);
  for (int64_t version : versions) metadata.add_versions(std::to_string(version));
  metadata.set_platform("attention");
  auto fill = [](const TensorSpec& spec, auto* tensor) {
    tensor->set_name(std::string(spec.name));
    tensor->set_datatype(std::string(spec.datatype));
    tensor->mutable_shape()->Assign(spec.shape.begin(), spec.shape.end());
  };
  for (const TensorSpec& spec : InputSpecs(model)) fill(spec, metadata.add_inputs());
  for (const TensorSpec& spec : OutputSpecs(model)) fill(spec, metadata.add_outputs());
  (*metadata.mutable_properties())["kind"] = std::string(KindName(model.kind));
  (*metadata.mutable_properties())["precision"] = std::string(PrecisionName(model.precision));
  (*metadata.mutable_properties())["kv_cache_dtype"] =
      std::string(KvDtypeName(model.kv_cache_dtype.value_or(KvDtype::kFloat32)));
  for (auto& [name, value] : LayerProperties(model)) {
    (*metadata.mutable_properties())[name] = std::move(value);
  }
  return metadata;
}

inference::ModelConfig ToModelConfig(const Model& model) {
  inference::ModelConfig config;
  config.set_name(model.name);
  config.set_platform("attention");
  config.set_backend("attention");
  // The batch axis is each request's own (B); merging requests is the
  // server's business, not the client's.
  config.set_max_batch_size(0);
  for (const TensorSpec& spec : InputSpecs(model)) {
    auto* input = config.add_input();
    input->set_name(std::string(spec.name));
    input->set_data_type(spec.config_type);
    input->mutable_dims()->Assign(spec.shape.begin(), spec.shape.end());
    input->set_optional(spec.optional);
  }
  for (const TensorSpec& spec : OutputSpecs(model)) {
    auto* output = config.add_output();
    output->set_name(std::string(spec.name));
    output->set_data_type(spec.config_type);
    output->mutable_dims()->Assign(spec.shape.begin(), spec.shape.end());
  }
  (*config.mutable_parameters())["precision"].set_string_value(
      std::string(PrecisionName(model.precision)));
  (*config.mutable_parameters())["kv_cache_dtype"].set_string_value(
      std::string(KvDtypeName(model.kv_cache_dtype.value_or(KvDtype::kFloat32))));
  for (auto& [name, value] : LayerProperties(model)) {
    (*config.mutable_parameters())[name].set_string_value(std::move(value));
  }
  return config;
}

}  // namespace attention::server
