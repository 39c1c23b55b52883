// safetensors.cc: ParseSafetensors, checked step by step (length prefix, JSON
// header, tensor entries, data layout) before any data byte is read.
#include "core/model/safetensors.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "core/kernels/float16.h"
#include "core/status_macros.h"

namespace attention {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kLengthPrefixBytes = 8;
constexpr absl::string_view kMetadataKey = "__metadata__";
// Longest excerpt of a JSON parser message quoted in an error; the parser
// quotes the offending token, which may be long or binary.
constexpr size_t kMaxQuotedChars = 160;

enum class DType { kF32, kF16, kBF16 };

struct DTypeInfo {
  absl::string_view name;
  DType dtype;
  uint64_t size_bytes;
};

constexpr std::array<DTypeInfo, 3> kDTypes = {{
    {"F32", DType::kF32, 4},
    {"F16", DType::kF16, 2},
    {"BF16", DType::kBF16, 2},
}};

// A tensor entry of the header, checked against the data section size.
struct Entry {
  std::string name;
  const DTypeInfo* dtype;
  std::vector<int64_t> shape;
  uint64_t begin;
  uint64_t end;
};

uint16_t ReadU16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

uint32_t ReadU32(const uint8_t* p) {
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}

uint64_t ReadU64(const uint8_t* p) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | p[i];
  return value;
}

absl::Status Invalid(absl::string_view message) { return absl::InvalidArgumentError(message); }

// Makes a parser message safe to quote: printable ASCII only, bounded length.
std::string Printable(absl::string_view text) {
  std::string out;
  for (char c : text.substr(0, kMaxQuotedChars)) {
    out += (c >= 0x20 && c < 0x7f) ? c : '?';
  }
  if (text.size() > kMaxQuotedChars) out += "...";
  return out;
}

// What a JSON value that should have been a non-negative integer is instead.
std::string NotAnIndex(const Json& value) {
  if (value.is_number_float()) return "a non-integer number";
  if (value.is_number_integer()) return "a negative integer";
  return absl::StrCat("a JSON ", value.type_name());
}

// Parses the header text, rejecting duplicate keys in any object (the JSON
// library would keep only the last one).
absl::StatusOr<Json> ParseHeaderJson(absl::string_view text) {
  std::vector<std::set<std::string>> keys_of_open_objects;
  std::optional<std::string> duplicate_key;
  auto track_keys = [&](int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        keys_of_open_objects.emplace_back();
        break;
      case Json::parse_event_t::object_end:
        keys_of_open_objects.pop_back();
        break;
      case Json::parse_event_t::key:
        if (!keys_of_open_objects.back().insert(parsed.get<std::string>()).second && !duplicate_key) {
          duplicate_key = parsed.get<std::string>();
        }
        break;
      default:
        break;
    }
    return true;
  };
  Json header;
  try {
    header = Json::parse(text.begin(), text.end(), track_keys);
  } catch (const Json::exception& e) {
    return Invalid(absl::StrCat("header is not valid JSON: ", Printable(e.what())));
  }
  if (duplicate_key) {
    return Invalid(absl::StrCat("header has the key '", Printable(*duplicate_key), "' twice"));
  }
  if (!header.is_object()) {
    return Invalid(absl::StrCat("header is a JSON ", header.type_name(), ", expected an object"));
  }
  return header;
}

absl::StatusOr<std::map<std::string, std::string>> ParseMetadata(const Json& value) {
  if (!value.is_object()) {
    return Invalid(absl::StrCat("'", kMetadataKey, "' is a JSON ", value.type_name(),
                                ", expected an object of strings"));
  }
  std::map<std::string, std::string> metadata;
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      return Invalid(absl::StrCat("'", kMetadataKey, "' entry '", Printable(key), "' is a JSON ",
                                  item.type_name(), ", expected a string"));
    }
    metadata.emplace(key, item.get<std::string>());
  }
  return metadata;
}

// Reads a JSON number that must be a non-negative integer (shape dimensions
// and offsets).
std::optional<uint64_t> NonNegativeInteger(const Json& value) {
  if (!value.is_number_unsigned()) return std::nullopt;
  return value.get<uint64_t>();
}

// Checks one tensor entry of the header against a data section of
// `data_size` bytes.
absl::StatusOr<Entry> ParseEntry(const std::string& name, const Json& value, uint64_t data_size) {
  const std::string where = absl::StrCat("tensor '", Printable(name), "'");
  if (!value.is_object()) {
    return Invalid(absl::StrCat(where, " is a JSON ", value.type_name(),
                                ", expected an object with dtype, shape and data_offsets"));
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(field)) return Invalid(absl::StrCat(where, " has no '", field, "'"));
  }
  Entry entry;
  entry.name = name;

  const Json& dtype = value["dtype"];
  if (!dtype.is_string()) {
    return Invalid(absl::StrCat(where, ": dtype is a JSON ", dtype.type_name(), ", expected a string"));
  }
  const std::string& dtype_name = dtype.get_ref<const std::string&>();
  const auto known = std::find_if(kDTypes.begin(), kDTypes.end(),
                                  [&](const DTypeInfo& info) { return info.name == dtype_name; });
  if (known == kDTypes.end()) {
    return Invalid(
        absl::StrCat(where, " has dtype '", Printable(dtype_name), "', expected F32, F16 or BF16"));
  }
  entry.dtype = &*known;

  const Json& shape = value["shape"];
  if (!shape.is_array()) {
    return Invalid(absl::StrCat(where, ": shape is a JSON ", shape.type_name(), ", expected an array"));
  }
  // Elements are counted in uint64 with an overflow check; a dimension must
  // also fit the int64 shapes the engine uses.
  uint64_t num_elements = 1;
  bool overflow = false;
  bool has_zero_dim = false;
  for (size_t axis = 0; axis < shape.size(); ++axis) {
    const std::optional<uint64_t> dim = NonNegativeInteger(shape[axis]);
    if (!dim) {
      return Invalid(absl::StrCat(where, ": shape[", axis, "] is ", NotAnIndex(shape[axis]),
                                  ", expected a non-negative integer"));
    }
    if (*dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Invalid(absl::StrCat(where, ": shape[", axis, "] is ", *dim, ", above the largest int64"));
    }
    has_zero_dim |= *dim == 0;
    if (*dim != 0 && num_elements > std::numeric_limits<uint64_t>::max() / *dim) overflow = true;
    num_elements *= *dim;
    entry.shape.push_back(static_cast<int64_t>(*dim));
  }
  // A zero dimension makes the product 0 however large the others are.
  if (!has_zero_dim &&
      (overflow || num_elements > std::numeric_limits<uint64_t>::max() / entry.dtype->size_bytes)) {
    return Invalid(
        absl::StrCat(where, ": shape ", ShapeString(entry.shape), " has more bytes than fit in 64 bits"));
  }
  const uint64_t expected_bytes = num_elements * entry.dtype->size_bytes;

  const Json& offsets = value["data_offsets"];
  if (!offsets.is_array()) {
    return Invalid(
        absl::StrCat(where, ": data_offsets is a JSON ", offsets.type_name(), ", expected [begin, end]"));
  }
  if (offsets.size() != 2) {
    return Invalid(
        absl::StrCat(where, ": data_offsets has ", offsets.size(), " elements, expected [begin, end]"));
  }
  std::array<uint64_t, 2> bounds{};
  for (size_t i = 0; i < bounds.size(); ++i) {
    const std::optional<uint64_t> offset = NonNegativeInteger(offsets[i]);
    if (!offset) {
      return Invalid(absl::StrCat(where, ": data_offsets[", i, "] is ", NotAnIndex(offsets[i]),
                                  ", expected a non-negative integer"));
    }
    bounds[i] = *offset;
  }
  const auto [begin, end] = bounds;
  if (end < begin) {
    return Invalid(absl::StrCat(where, ": data_offsets [", begin, ", ", end, "] end before they begin"));
  }
  if (end > data_size) {
    return Invalid(absl::StrCat(where, ": data_offsets [", begin, ", ", end,
                                "] go past the end of the data section (", data_size, " bytes)"));
  }
  if (end - begin != expected_bytes) {
    return Invalid(absl::StrCat(where, ": data_offsets [", begin, ", ", end, "] hold ", end - begin,
                                " bytes, but shape ", ShapeString(entry.shape), " of ", entry.dtype->name,
                                " needs ", expected_bytes));
  }
  entry.begin = begin;
  entry.end = end;
  return entry;
}

// The tensors must tile [0, data_size) exactly: no overlap, no gap, nothing
// after the last one.
absl::Status CheckLayout(std::vector<const Entry*> entries, uint64_t data_size) {
  std::sort(entries.begin(), entries.end(), [](const Entry* a, const Entry* b) {
    return std::pair(a->begin, a->end) < std::pair(b->begin, b->end);
  });
  uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const Entry* entry : entries) {
    if (entry->begin < covered) {
      return Invalid(absl::StrCat("tensors '", Printable(previous->name), "' [", previous->begin, ", ",
                                  previous->end, ") and '", Printable(entry->name), "' [", entry->begin, ", ",
                                  entry->end, ") overlap"));
    }
    if (entry->begin > covered) {
      return Invalid(absl::StrCat("data bytes [", covered, ", ", entry->begin,
                                  ") belong to no tensor (the tensors must be contiguous)"));
    }
    covered = entry->end;
    previous = entry;
  }
  if (covered != data_size) {
    return Invalid(absl::StrCat("data section has ", data_size - covered,
                                " bytes after the last tensor (it is ", data_size,
                                " bytes, the tensors end at ", covered, ")"));
  }
  return absl::OkStatus();
}

Tensor Convert(const Entry& entry, const uint8_t* data) {
  Tensor tensor;
  tensor.shape = entry.shape;
  const uint64_t count = (entry.end - entry.begin) / entry.dtype->size_bytes;
  tensor.data.resize(count);
  const uint8_t* bytes = data + entry.begin;
  switch (entry.dtype->dtype) {
    case DType::kF32:
      for (uint64_t i = 0; i < count; ++i) tensor.data[i] = std::bit_cast<float>(ReadU32(bytes + 4 * i));
      break;
    case DType::kF16:
      for (uint64_t i = 0; i < count; ++i) tensor.data[i] = HalfToFloat(ReadU16(bytes + 2 * i));
      break;
    case DType::kBF16:
      for (uint64_t i = 0; i < count; ++i) tensor.data[i] = BFloat16ToFloat(ReadU16(bytes + 2 * i));
      break;
  }
  return tensor;
}

}  // namespace

absl::StatusOr<SafetensorsFile> ParseSafetensors(std::span<const uint8_t> bytes) {
  if (bytes.size() < kLengthPrefixBytes) {
    return Invalid(absl::StrCat("file has ", bytes.size(), " bytes, too short for the 8-byte header length"));
  }
  const uint64_t header_size = ReadU64(bytes.data());
  const uint64_t after_prefix = bytes.size() - kLengthPrefixBytes;
  if (header_size > after_prefix) {
    return Invalid(absl::StrCat("header length ", header_size, " is beyond the end of the file (",
                                after_prefix, " bytes after the length)"));
  }
  const absl::string_view header_text(reinterpret_cast<const char*>(bytes.data() + kLengthPrefixBytes),
                                      header_size);
  absl::StatusOr<Json> header = ParseHeaderJson(header_text);
  if (!header.ok()) return header.status();

  const uint8_t* data = bytes.data() + kLengthPrefixBytes + header_size;
  const uint64_t data_size = after_prefix - header_size;
  SafetensorsFile file;
  std::vector<Entry> entries;
  for (const auto& [key, value] : header->items()) {
    if (key == kMetadataKey) {
      absl::StatusOr<std::map<std::string, std::string>> metadata = ParseMetadata(value);
      if (!metadata.ok()) return metadata.status();
      file.metadata = *std::move(metadata);
      continue;
    }
    absl::StatusOr<Entry> entry = ParseEntry(key, value, data_size);
    if (!entry.ok()) return entry.status();
    entries.push_back(*std::move(entry));
  }
  std::vector<const Entry*> layout;
  for (const Entry& entry : entries) layout.push_back(&entry);
  RETURN_IF_ERROR(CheckLayout(std::move(layout), data_size));

  for (const Entry& entry : entries) file.tensors.emplace(entry.name, Convert(entry, data));
  return file;
}

}  // namespace attention
