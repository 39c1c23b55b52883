// wire_fault.cc: the walk over a message's bytes (wire_fault.h).
#include "server/api/grpc/wire_fault.h"

#include <cstdint>
#include <map>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/stubs/common.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace attention::server {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::io::CodedInputStream;

// Deeper than any message of ours nests; a hostile nesting stops here.
constexpr int kMaxDepth = 32;

// The width of one packed element of `field`: 4 or 8 bytes, or 0 for varints.
int PackedWidth(const FieldDescriptor& field) {
  switch (field.cpp_type()) {
    case FieldDescriptor::CPPTYPE_FLOAT:
      return 4;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return 8;
    default:
      break;
  }
  switch (field.type()) {
    case FieldDescriptor::TYPE_FIXED32:
    case FieldDescriptor::TYPE_SFIXED32:
      return 4;
    case FieldDescriptor::TYPE_FIXED64:
    case FieldDescriptor::TYPE_SFIXED64:
      return 8;
    default:
      return 0;
  }
}

std::string FindFault(const Descriptor& type, CodedInputStream& in, const std::string& path,
                      int depth);

// The fault inside one length-delimited field of `length` bytes, or "".
std::string FindFaultInRun(const FieldDescriptor* field, CodedInputStream& in,
                           const std::string& name, uint32_t length, int depth) {
  if (field != nullptr && field->type() == FieldDescriptor::TYPE_MESSAGE) {
    const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
    std::string fault = FindFault(*field->message_type(), in, name + ".", depth + 1);
    in.PopLimit(limit);
    return fault;
  }
  if (field != nullptr && field->is_packable()) {
    const int width = PackedWidth(*field);
    if (width > 0 && length % width != 0) {
      return absl::StrCat(name, ": ", length, " bytes of packed ",
                          field->cpp_type_name(), " values, not a multiple of ", width);
    }
  }
  if (field == nullptr || field->type() != FieldDescriptor::TYPE_STRING) {
    return in.Skip(static_cast<int>(length)) ? "" : name + ": truncated";
  }
  // Strings are names and ids: small enough to read whole.
  std::string text;
  if (!in.ReadString(&text, static_cast<int>(length))) return name + ": truncated";
  if (!google::protobuf::internal::IsStructurallyValidUTF8(text.data(),
                                                           static_cast<int>(text.size()))) {
    return name + ": not valid UTF-8";
  }
  return "";
}

// The fault in one field whose tag was just read, or "".
std::string FindFaultInField(const Descriptor& type, CodedInputStream& in, uint32_t tag,
                             const std::string& name, int depth) {
  const FieldDescriptor* field = type.FindFieldByNumber(static_cast<int>(tag >> 3));
  switch (tag & 7) {
    case 0: {
      uint64_t value = 0;
      return in.ReadVarint64(&value) ? "" : name + ": truncated varint";
    }
    case 1: {
      uint64_t value = 0;
      return in.ReadLittleEndian64(&value) ? "" : name + ": truncated 64-bit value";
    }
    case 5: {
      uint32_t value = 0;
      return in.ReadLittleEndian32(&value) ? "" : name + ": truncated 32-bit value";
    }
    case 2: {
      uint32_t length = 0;
      if (!in.ReadVarint32(&length)) return name + ": truncated length";
      if (static_cast<int64_t>(length) > in.BytesUntilLimit()) {
        return absl::StrCat(name, ": announces ", length, " bytes, ", in.BytesUntilLimit(),
                            " remain");
      }
      return FindFaultInRun(field, in, name, length, depth);
    }
    default:
      return absl::StrCat(name, ": wire type ", tag & 7, " is not one this message uses");
  }
}

std::string FindFault(const Descriptor& type, CodedInputStream& in, const std::string& path,
                      int depth) {
  if (depth > kMaxDepth) return path + ": nested too deeply";
  std::map<int, int> seen;  // repeated message fields, by number: their next index
  while (in.BytesUntilLimit() > 0) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) return path.empty() ? "a field tag is 0 or truncated" : path + ": bad tag";
    const FieldDescriptor* field = type.FindFieldByNumber(static_cast<int>(tag >> 3));
    std::string name = path + (field != nullptr ? field->name() : absl::StrCat("field ", tag >> 3));
    if (field != nullptr && field->is_repeated() &&
        field->type() == FieldDescriptor::TYPE_MESSAGE) {
      absl::StrAppend(&name, "[", seen[field->number()]++, "]");
    }
    if (std::string fault = FindFaultInField(type, in, tag, name, depth); !fault.empty()) {
      return fault;
    }
  }
  return "";
}

}  // namespace

std::string FindWireFault(const Descriptor& type, const grpc::ByteBuffer& bytes) {
  grpc::ByteBuffer copy(bytes);  // shares the slices
  grpc::ProtoBufferReader reader(&copy);
  CodedInputStream in(&reader);
  const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(bytes.Length()));
  std::string fault = FindFault(type, in, "", 0);
  in.PopLimit(limit);
  return fault;
}

}  // namespace attention::server
