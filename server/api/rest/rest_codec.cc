// rest_codec.cc: REST bodies <-> Open Inference Protocol messages, with
// RapidJSON (fast on the long number lists tensors are).
#include "server/api/rest/rest_codec.h"

#include <charconv>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "google/protobuf/dynamic_message.h"
#include "rapidjson/document.h"
#include "rapidjson/error/en.h"
#include "rapidjson/stringbuffer.h"
#include "rapidjson/writer.h"
#include "server/api/inference/inference_adapter.h"

namespace attention::server {
namespace {

using rapidjson::Value;
using JsonWriter = rapidjson::Writer<rapidjson::StringBuffer>;
namespace protobuf = google::protobuf;

// Deeper `data` nesting than any tensor rank has.
constexpr int kMaxDataDepth = 32;

absl::Status Invalid(absl::string_view where, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", what));
}

const char* JsonType(const Value& value) {
  switch (value.GetType()) {
    case rapidjson::kNullType:
      return "null";
    case rapidjson::kFalseType:
    case rapidjson::kTrueType:
      return "a bool";
    case rapidjson::kObjectType:
      return "an object";
    case rapidjson::kArrayType:
      return "an array";
    case rapidjson::kStringType:
      return "a string";
    case rapidjson::kNumberType:
      return "a number";
  }
  return "a value";
}

absl::Status WrongType(absl::string_view where, absl::string_view expected, const Value& got) {
  return Invalid(where, absl::StrCat("expected ", expected, ", got ", JsonType(got)));
}

// The JSON part of `body`, parsed in place into `document`.
absl::Status ParseJson(std::string_view text, rapidjson::Document* document) {
  // Iterative: nesting depth costs no stack.
  document->Parse<rapidjson::kParseIterativeFlag | rapidjson::kParseStopWhenDoneFlag>(text.data(),
                                                                                      text.size());
  if (document->HasParseError()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the request body is not valid JSON: ",
                     rapidjson::GetParseError_En(document->GetParseError()), " (at byte ",
                     document->GetErrorOffset(), ")"));
  }
  if (!document->IsObject()) return WrongType("the request body", "a JSON object", *document);
  return absl::OkStatus();
}

// A JSON parameter as the protocol's typed parameter. Integers given for a
// float parameter (`scale`, `softcap`) of the request are numbers like any
// other.
absl::Status ReadParameter(absl::string_view where, const Value& value,
                           inference::InferParameter* parameter) {
  absl::string_view name = where;
  const bool float_parameter =
      absl::ConsumePrefix(&name, "parameters.") && IsFloatParameter(name);
  if (value.IsBool()) {
    parameter->set_bool_param(value.GetBool());
  } else if (value.IsInt64() && !float_parameter) {
    parameter->set_int64_param(value.GetInt64());
  } else if (value.IsNumber()) {
    parameter->set_double_param(value.GetDouble());
  } else if (value.IsString()) {
    parameter->set_string_param(std::string(value.GetString(), value.GetStringLength()));
  } else {
    return WrongType(where, "a bool, number or string", value);
  }
  return absl::OkStatus();
}

absl::Status ReadParameters(absl::string_view where, const Value& object,
                            protobuf::Map<std::string, inference::InferParameter>* parameters) {
  if (!object.IsObject()) return WrongType(where, "an object", object);
  for (const auto& member : object.GetObject()) {
    const std::string name(member.name.GetString(), member.name.GetStringLength());
    const std::string field = absl::StrCat(where, ".", name);
    if (absl::Status s = ReadParameter(field, member.value, &(*parameters)[name]); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

// How one input's JSON values become bytes.
enum class Element { kFloat, kInt32, kInt64 };

template <typename T>
void Append(T value, std::string* bytes) {
  char raw[sizeof(T)];
  std::memcpy(raw, &value, sizeof(T));
  bytes->append(raw, sizeof(T));
}

// Appends the numbers of `data`, a flat or nested list, to `bytes`.
absl::Status Flatten(const std::string& where, const Value& data, Element element, int depth,
                     int64_t* count, std::string* bytes) {
  if (!data.IsArray()) return WrongType(where, "a list of numbers", data);
  if (depth > kMaxDataDepth) return Invalid(where, "lists nested deeper than 32");
  for (const Value& item : data.GetArray()) {
    if (item.IsArray()) {
      if (absl::Status s = Flatten(where, item, element, depth + 1, count, bytes); !s.ok()) {
        return s;
      }
      continue;
    }
    const std::string at = absl::StrCat(where, "[", *count, "]");
    if (element == Element::kFloat) {
      if (!item.IsNumber()) return WrongType(at, "a number", item);
      Append(static_cast<float>(item.GetDouble()), bytes);
    } else if (element == Element::kInt32) {
      if (!item.IsInt()) return WrongType(at, "a 32-bit integer", item);
      Append(static_cast<int32_t>(item.GetInt()), bytes);
    } else {
      if (!item.IsInt64()) return WrongType(at, "a 64-bit integer", item);
      Append(static_cast<int64_t>(item.GetInt64()), bytes);
    }
    ++*count;
  }
  return absl::OkStatus();
}

// The element type JSON data of `datatype` is written in; float types
// travel as FP32. nullopt: a datatype the protocol adapter refuses.
std::optional<Element> ElementOf(std::string* datatype) {
  if (*datatype == "FP32" || *datatype == "FP16" || *datatype == "BF16") {
    *datatype = "FP32";
    return Element::kFloat;
  }
  if (*datatype == "INT32") return Element::kInt32;
  if (*datatype == "INT64") return Element::kInt64;
  return std::nullopt;
}

absl::Status ReadShape(const std::string& where, const Value& input,
                       inference::ModelInferRequest::InferInputTensor* tensor) {
  const auto shape = input.FindMember("shape");
  if (shape == input.MemberEnd()) return Invalid(where, "expected a 'shape'");
  if (!shape->value.IsArray())
    return WrongType(where + ".shape", "a list of integers", shape->value);
  for (const Value& size : shape->value.GetArray()) {
    if (!size.IsInt64()) return WrongType(where + ".shape", "integers", size);
    tensor->add_shape(size.GetInt64());
  }
  return absl::OkStatus();
}

absl::Status ReadString(const std::string& where, const Value& object, const char* field,
                        std::string* out) {
  const auto member = object.FindMember(field);
  if (member == object.MemberEnd()) return Invalid(where, absl::StrCat("expected a '", field, "'"));
  if (!member->value.IsString())
    return WrongType(absl::StrCat(where, ".", field), "a string", member->value);
  out->assign(member->value.GetString(), member->value.GetStringLength());
  return absl::OkStatus();
}

// The binary sections of a request, taken in input order.
struct BinaryCursor {
  std::string_view rest;
};

// One input's data: its JSON `data`, or `binary_data_size` bytes of the
// binary sections.
absl::Status ReadInputData(const std::string& where, const Value& input,
                           inference::ModelInferRequest::InferInputTensor* tensor,
                           BinaryCursor* binary, std::string* bytes) {
  const auto parameters = tensor->parameters().find("binary_data_size");
  const auto data = input.FindMember("data");
  if (parameters != tensor->parameters().end()) {
    if (data != input.MemberEnd()) {
      return Invalid(where, "has both 'data' and parameters.binary_data_size; expected one");
    }
    const inference::InferParameter& size = parameters->second;
    if (!size.has_int64_param() || size.int64_param() < 0) {
      return Invalid(where + ".parameters.binary_data_size", "expected a non-negative integer");
    }
    if (static_cast<uint64_t>(size.int64_param()) > binary->rest.size()) {
      return Invalid(where + ".parameters.binary_data_size",
                     absl::StrCat(size.int64_param(), " bytes, but only ", binary->rest.size(),
                                  " bytes of binary data remain in the body"));
    }
    bytes->assign(binary->rest.substr(0, size.int64_param()));
    binary->rest.remove_prefix(size.int64_param());
    tensor->mutable_parameters()->erase("binary_data_size");
    return absl::OkStatus();
  }
  if (data == input.MemberEnd()) {
    return Invalid(where, "expected 'data' or parameters.binary_data_size");
  }
  const std::optional<Element> element = ElementOf(tensor->mutable_datatype());
  // A datatype the adapter refuses is named by it, before its data matter.
  if (!element) return absl::OkStatus();
  int64_t count = 0;
  if (absl::Status s = Flatten(where + ".data", data->value, *element, 0, &count, bytes); !s.ok()) {
    return s;
  }
  absl::StatusOr<int64_t> expected = ElementCount(*tensor);
  if (!expected.ok()) return expected.status();
  if (count != *expected) {
    return Invalid(where + ".data",
                   absl::StrCat(count, " values; shape [", absl::StrJoin(tensor->shape(), ", "),
                                "] needs ", *expected));
  }
  return absl::OkStatus();
}

absl::Status ReadInput(int index, const Value& input, BinaryCursor* binary,
                       inference::ModelInferRequest* proto) {
  std::string where = absl::StrCat("inputs[", index, "]");
  if (!input.IsObject()) return WrongType(where, "an object", input);
  auto* tensor = proto->add_inputs();
  if (absl::Status s = ReadString(where, input, "name", tensor->mutable_name()); !s.ok()) return s;
  where = absl::StrCat(where, " '", tensor->name(), "'");
  if (absl::Status s = ReadString(where, input, "datatype", tensor->mutable_datatype()); !s.ok()) {
    return s;
  }
  if (absl::Status s = ReadShape(where, input, tensor); !s.ok()) return s;
  if (const auto parameters = input.FindMember("parameters"); parameters != input.MemberEnd()) {
    if (absl::Status s =
            ReadParameters(where + ".parameters", parameters->value, tensor->mutable_parameters());
        !s.ok()) {
      return s;
    }
  }
  return ReadInputData(where, input, tensor, binary, proto->add_raw_input_contents());
}

absl::Status ReadOutputs(const Value& outputs, inference::ModelInferRequest* proto) {
  if (!outputs.IsArray()) return WrongType("outputs", "a list", outputs);
  int index = 0;
  for (const Value& output : outputs.GetArray()) {
    const std::string where = absl::StrCat("outputs[", index++, "]");
    if (!output.IsObject()) return WrongType(where, "an object", output);
    auto* requested = proto->add_outputs();
    if (absl::Status s = ReadString(where, output, "name", requested->mutable_name()); !s.ok()) {
      return s;
    }
    if (const auto parameters = output.FindMember("parameters"); parameters != output.MemberEnd()) {
      if (absl::Status s = ReadParameters(where + ".parameters", parameters->value,
                                          requested->mutable_parameters());
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ReadInferObject(const Value& object, BinaryCursor* binary,
                             inference::ModelInferRequest* proto) {
  if (const auto id = object.FindMember("id"); id != object.MemberEnd()) {
    if (!id->value.IsString()) return WrongType("id", "a string", id->value);
    proto->set_id(std::string(id->value.GetString(), id->value.GetStringLength()));
  }
  if (const auto parameters = object.FindMember("parameters"); parameters != object.MemberEnd()) {
    if (absl::Status s =
            ReadParameters("parameters", parameters->value, proto->mutable_parameters());
        !s.ok()) {
      return s;
    }
  }
  const auto inputs = object.FindMember("inputs");
  if (inputs == object.MemberEnd()) return Invalid("the request", "expected 'inputs'");
  if (!inputs->value.IsArray()) return WrongType("inputs", "a list", inputs->value);
  int index = 0;
  for (const Value& input : inputs->value.GetArray()) {
    if (absl::Status s = ReadInput(index++, input, binary, proto); !s.ok()) return s;
  }
  if (const auto outputs = object.FindMember("outputs"); outputs != object.MemberEnd()) {
    if (absl::Status s = ReadOutputs(outputs->value, proto); !s.ok()) return s;
  }
  if (!binary->rest.empty()) {
    return Invalid("the request body",
                   absl::StrCat(binary->rest.size(),
                                " bytes of binary data follow the inputs' binary_data_size"));
  }
  return absl::OkStatus();
}

bool BoolParameter(const protobuf::Map<std::string, inference::InferParameter>& parameters,
                   const char* name, bool fallback) {
  const auto it = parameters.find(name);
  if (it == parameters.end() || !it->second.has_bool_param()) return fallback;
  return it->second.bool_param();
}

// Whether output `name` goes back as a binary section.
bool WantsBinary(const inference::ModelInferRequest& request, const std::string& name) {
  const bool fallback = BoolParameter(request.parameters(), "binary_data_output", false);
  for (const auto& output : request.outputs()) {
    if (output.name() == name) return BoolParameter(output.parameters(), "binary_data", fallback);
  }
  return fallback;
}

void WriteOutput(const inference::ModelInferResponse::InferOutputTensor& output,
                 const std::string& raw, bool binary, JsonWriter& writer) {
  writer.StartObject();
  writer.Key("name");
  writer.String(output.name().c_str(), output.name().size());
  writer.Key("datatype");
  writer.String(output.datatype().c_str(), output.datatype().size());
  writer.Key("shape");
  writer.StartArray();
  for (int64_t size : output.shape()) writer.Int64(size);
  writer.EndArray();
  if (binary) {
    writer.Key("parameters");
    writer.StartObject();
    writer.Key("binary_data_size");
    writer.Uint64(raw.size());
    writer.EndObject();
  } else {
    writer.Key("data");
    writer.StartArray();
    char text[32];
    for (size_t i = 0; i + sizeof(float) <= raw.size(); i += sizeof(float)) {
      float value;
      std::memcpy(&value, raw.data() + i, sizeof(float));
      // The shortest text that reads back as the same float, which a
      // double's would not be (0.1f is 0.10000000149011612 as a double).
      const auto end = std::to_chars(text, text + sizeof(text), value).ptr;
      writer.RawValue(text, end - text, rapidjson::kNumberType);
    }
    writer.EndArray();
  }
  writer.EndObject();
}

void WriteField(const protobuf::Message& message, const protobuf::FieldDescriptor& field, int index,
                JsonWriter& writer);

void WriteMessage(const protobuf::Message& message, JsonWriter& writer) {
  const protobuf::Reflection& reflection = *message.GetReflection();
  const protobuf::Descriptor& type = *message.GetDescriptor();
  writer.StartObject();
  for (int f = 0; f < type.field_count(); ++f) {
    const protobuf::FieldDescriptor* field = type.field(f);
    // Zero counts are written, as clients read them; an unset oneof member
    // or message is not there.
    const bool optional = field->containing_oneof() != nullptr ||
                          (!field->is_repeated() && field->message_type() != nullptr);
    if (optional && !reflection.HasField(message, field)) continue;
    writer.Key(field->name().c_str(), field->name().size());
    if (field->is_map()) {
      writer.StartObject();
      for (int i = 0; i < reflection.FieldSize(message, field); ++i) {
        const protobuf::Message& entry = reflection.GetRepeatedMessage(message, field, i);
        const protobuf::Reflection& entry_reflection = *entry.GetReflection();
        const protobuf::Descriptor& entry_type = *entry.GetDescriptor();
        const std::string key = entry_reflection.GetString(entry, entry_type.map_key());
        writer.Key(key.c_str(), key.size());
        WriteField(entry, *entry_type.map_value(), -1, writer);
      }
      writer.EndObject();
    } else if (field->is_repeated()) {
      writer.StartArray();
      for (int i = 0; i < reflection.FieldSize(message, field); ++i) {
        WriteField(message, *field, i, writer);
      }
      writer.EndArray();
    } else {
      WriteField(message, *field, -1, writer);
    }
  }
  writer.EndObject();
}

// One value of `field` (element `index` when repeated, else -1).
void WriteField(const protobuf::Message& message, const protobuf::FieldDescriptor& field, int index,
                JsonWriter& writer) {
  const protobuf::Reflection& r = *message.GetReflection();
  const bool repeated = index >= 0;
  using F = protobuf::FieldDescriptor;
  switch (field.cpp_type()) {
    case F::CPPTYPE_INT32:
      writer.Int(repeated ? r.GetRepeatedInt32(message, &field, index)
                          : r.GetInt32(message, &field));
      break;
    case F::CPPTYPE_INT64:
      writer.Int64(repeated ? r.GetRepeatedInt64(message, &field, index)
                            : r.GetInt64(message, &field));
      break;
    case F::CPPTYPE_UINT32:
      writer.Uint(repeated ? r.GetRepeatedUInt32(message, &field, index)
                           : r.GetUInt32(message, &field));
      break;
    case F::CPPTYPE_UINT64:
      writer.Uint64(repeated ? r.GetRepeatedUInt64(message, &field, index)
                             : r.GetUInt64(message, &field));
      break;
    case F::CPPTYPE_DOUBLE:
      writer.Double(repeated ? r.GetRepeatedDouble(message, &field, index)
                             : r.GetDouble(message, &field));
      break;
    case F::CPPTYPE_FLOAT:
      writer.Double(repeated ? r.GetRepeatedFloat(message, &field, index)
                             : r.GetFloat(message, &field));
      break;
    case F::CPPTYPE_BOOL:
      writer.Bool(repeated ? r.GetRepeatedBool(message, &field, index)
                           : r.GetBool(message, &field));
      break;
    case F::CPPTYPE_ENUM: {
      const std::string& name =
          (repeated ? r.GetRepeatedEnum(message, &field, index) : r.GetEnum(message, &field))
              ->name();
      writer.String(name.c_str(), name.size());
      break;
    }
    case F::CPPTYPE_STRING: {
      const std::string value =
          repeated ? r.GetRepeatedString(message, &field, index) : r.GetString(message, &field);
      writer.String(value.c_str(), value.size());
      break;
    }
    case F::CPPTYPE_MESSAGE:
      WriteMessage(
          repeated ? r.GetRepeatedMessage(message, &field, index) : r.GetMessage(message, &field),
          writer);
      break;
  }
}

}  // namespace

absl::Status ParseRestInferRequest(std::string_view body, std::optional<size_t> json_length,
                                   inference::ModelInferRequest* proto) {
  if (json_length && *json_length > body.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Inference-Header-Content-Length: ", *json_length,
                     " is longer than the body (", body.size(), " bytes)"));
  }
  const size_t length = json_length.value_or(body.size());
  rapidjson::Document document;
  if (absl::Status s = ParseJson(body.substr(0, length), &document); !s.ok()) return s;
  BinaryCursor binary{body.substr(length)};
  return ReadInferObject(document, &binary, proto);
}

RestBody WriteRestInferResponse(const inference::ModelInferRequest& request,
                                const inference::ModelInferResponse& response) {
  rapidjson::StringBuffer buffer;
  JsonWriter writer(buffer);
  writer.StartObject();
  writer.Key("model_name");
  writer.String(response.model_name().c_str(), response.model_name().size());
  writer.Key("model_version");
  writer.String(response.model_version().c_str(), response.model_version().size());
  if (!response.id().empty()) {
    writer.Key("id");
    writer.String(response.id().c_str(), response.id().size());
  }
  writer.Key("outputs");
  writer.StartArray();
  std::vector<const std::string*> sections;
  for (int i = 0; i < response.outputs_size(); ++i) {
    const bool binary = WantsBinary(request, response.outputs(i).name());
    WriteOutput(response.outputs(i), response.raw_output_contents(i), binary, writer);
    if (binary) sections.push_back(&response.raw_output_contents(i));
  }
  writer.EndArray();
  writer.EndObject();
  RestBody body;
  body.bytes.assign(buffer.GetString(), buffer.GetSize());
  if (sections.empty()) return body;
  body.json_length = body.bytes.size();
  for (const std::string* section : sections) body.bytes += *section;
  return body;
}

std::string ProtoToJson(const protobuf::Message& message) {
  // Reflection reads a copy that libprotobuf made itself. On a generated
  // message, libprotobuf's reflection would read map fields laid out by this
  // binary's build, which a TSan build changes (map_field.h adds members
  // under __SANITIZE_THREAD__) while Debian's libprotobuf is not rebuilt:
  // reading "properties" crashed there. A copy is cheap for these answers.
  protobuf::DynamicMessageFactory factory;
  std::unique_ptr<protobuf::Message> copy(factory.GetPrototype(message.GetDescriptor())->New());
  copy->ParseFromString(message.SerializeAsString());
  rapidjson::StringBuffer buffer;
  JsonWriter writer(buffer);
  WriteMessage(*copy, writer);
  return std::string(buffer.GetString(), buffer.GetSize());
}

std::string ErrorJson(std::string_view message) {
  rapidjson::StringBuffer buffer;
  JsonWriter writer(buffer);
  writer.StartObject();
  writer.Key("error");
  writer.String(message.data(), message.size());
  writer.EndObject();
  return std::string(buffer.GetString(), buffer.GetSize());
}

absl::StatusOr<bool> ReadBoolField(std::string_view body, const char* field, bool fallback) {
  if (body.empty()) return fallback;
  rapidjson::Document document;
  if (absl::Status s = ParseJson(body, &document); !s.ok()) return s;
  const rapidjson::Document& read = document;
  const auto member = read.FindMember(field);
  if (member == read.MemberEnd()) return fallback;
  if (!member->value.IsBool()) return WrongType(field, "a bool", member->value);
  return member->value.GetBool();
}

}  // namespace attention::server
