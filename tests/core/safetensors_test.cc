// safetensors_test.cc: ParseSafetensors on valid files, on every malformed
// case it must reject, on F16/BF16 bit patterns, and on bulk-corrupted bytes.
#include "core/model/safetensors.h"

#include <gmock/gmock.h>
#include <cpuid.h>
#include <gtest/gtest.h>
#include <immintrin.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "tests/support/safetensors_builder.h"

namespace attention {
namespace {

using ::attention::testing::BuildFile;
using ::attention::testing::F32Tensor;
using ::attention::testing::FileBytes;
using ::attention::testing::HalfTensor;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Asserts that `bytes` is rejected with INVALID_ARGUMENT and a message
// containing `fragment`.
void ExpectInvalid(const std::vector<uint8_t>& bytes, const std::string& fragment) {
  absl::StatusOr<SafetensorsFile> file = ParseSafetensors(bytes);
  ASSERT_FALSE(file.ok()) << "accepted; expected an error containing: " << fragment;
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
  EXPECT_THAT(file.status().message(), HasSubstr(fragment));
}

// A header with one tensor entry `entry` (JSON text) named "w" and `data`.
std::vector<uint8_t> OneEntry(const std::string& entry, const std::vector<uint8_t>& data = {}) {
  return FileBytes(R"({"w":)" + entry + "}", data);
}

std::vector<uint8_t> Zeros(size_t count) { return std::vector<uint8_t>(count, 0); }

TEST(SafetensorsTest, ParsesTensorsAndMetadata) {
  const std::vector<uint8_t> bytes =
      BuildFile({F32Tensor("b", {3}, {1.5f, -2.0f, 0.25f}), F32Tensor("a", {2, 2}, {1, 2, 3, 4})},
                {{"kind", "bilinear"}, {"format", "pt"}});
  absl::StatusOr<SafetensorsFile> file = ParseSafetensors(bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata.at("kind"), "bilinear");
  EXPECT_EQ(file->metadata.at("format"), "pt");
  ASSERT_EQ(file->tensors.size(), 2u);
  EXPECT_THAT(file->tensors.at("a").shape, ElementsAre(2, 2));
  EXPECT_THAT(file->tensors.at("a").data, ElementsAre(1, 2, 3, 4));
  EXPECT_THAT(file->tensors.at("b").shape, ElementsAre(3));
  EXPECT_THAT(file->tensors.at("b").data, ElementsAre(1.5f, -2.0f, 0.25f));
}

TEST(SafetensorsTest, AcceptsScalarsEmptyTensorsAndNoMetadata) {
  const std::vector<uint8_t> bytes = BuildFile(
      {F32Tensor("empty", {0, 3}, {}), F32Tensor("scalar", {}, {7.0f}), F32Tensor("also_empty", {4, 0}, {})});
  absl::StatusOr<SafetensorsFile> file = ParseSafetensors(bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(file->metadata.empty());
  EXPECT_THAT(file->tensors.at("empty").shape, ElementsAre(0, 3));
  EXPECT_TRUE(file->tensors.at("empty").data.empty());
  EXPECT_TRUE(file->tensors.at("scalar").shape.empty());
  EXPECT_THAT(file->tensors.at("scalar").data, ElementsAre(7.0f));
}

TEST(SafetensorsTest, AcceptsAnEmptyHeaderObject) {
  absl::StatusOr<SafetensorsFile> file = ParseSafetensors(FileBytes("{}"));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(file->tensors.empty());
}

TEST(SafetensorsTest, RejectsFilesShorterThanTheLengthPrefix) {
  for (size_t size = 0; size < 8; ++size) {
    ExpectInvalid(std::vector<uint8_t>(size, 0), "too short for the 8-byte header length");
  }
}

TEST(SafetensorsTest, RejectsHeaderLengthsBeyondTheFile) {
  const std::vector<uint8_t> valid = BuildFile({F32Tensor("w", {2}, {1, 2})});
  for (uint64_t length : {uint64_t{valid.size() - 7}, uint64_t{1} << 32, uint64_t{1} << 63,
                          std::numeric_limits<uint64_t>::max(), std::numeric_limits<uint64_t>::max() - 7}) {
    std::vector<uint8_t> bytes = valid;
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(length >> (8 * i));
    ExpectInvalid(bytes, "is beyond the end of the file");
  }
}

TEST(SafetensorsTest, RejectsHeadersThatAreNotJsonObjects) {
  ExpectInvalid(FileBytes(""), "not valid JSON");
  ExpectInvalid(FileBytes("{\"w\": "), "not valid JSON");
  ExpectInvalid(FileBytes("{} trailing"), "not valid JSON");
  ExpectInvalid(FileBytes(std::string("{\"\xff\": 1}")), "not valid JSON");
  ExpectInvalid(FileBytes("[1, 2]"), "header is a JSON array, expected an object");
  ExpectInvalid(FileBytes("\"text\""), "header is a JSON string, expected an object");
  ExpectInvalid(FileBytes("17"), "expected an object");
}

TEST(SafetensorsTest, RejectsDuplicateKeys) {
  ExpectInvalid(FileBytes(R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
                              "w": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}})"),
                "header has the key 'w' twice");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [0], "dtype": "F16", "data_offsets": [0, 0]})"),
                "header has the key 'dtype' twice");
}

TEST(SafetensorsTest, RejectsEntriesMissingAField) {
  ExpectInvalid(OneEntry(R"({"shape": [1], "data_offsets": [0, 4]})", Zeros(4)), "tensor 'w' has no 'dtype'");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "data_offsets": [0, 4]})", Zeros(4)),
                "tensor 'w' has no 'shape'");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [1]})", Zeros(4)), "tensor 'w' has no 'data_offsets'");
  ExpectInvalid(OneEntry("[1, 2]"), "tensor 'w' is a JSON array, expected an object");
}

TEST(SafetensorsTest, RejectsFieldsOfTheWrongJsonType) {
  ExpectInvalid(OneEntry(R"({"dtype": 32, "shape": [1], "data_offsets": [0, 4]})", Zeros(4)),
                "tensor 'w': dtype is a JSON number, expected a string");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": "1", "data_offsets": [0, 4]})", Zeros(4)),
                "tensor 'w': shape is a JSON string, expected an array");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [1], "data_offsets": {"begin": 0}})", Zeros(4)),
                "tensor 'w': data_offsets is a JSON object, expected [begin, end]");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [1], "data_offsets": [0]})", Zeros(4)),
                "data_offsets has 1 elements, expected [begin, end]");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]})", Zeros(4)),
                "data_offsets has 3 elements, expected [begin, end]");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [1], "data_offsets": [0, "4"]})", Zeros(4)),
                "data_offsets[1] is a JSON string, expected a non-negative integer");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [1], "data_offsets": [-4, 4]})", Zeros(4)),
                "data_offsets[0] is a negative integer");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]})", Zeros(4)),
                "data_offsets[1] is a non-integer number");
}

TEST(SafetensorsTest, RejectsBadDimensions) {
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 4]})", Zeros(4)),
                "tensor 'w': shape[1] is a negative integer, expected a non-negative integer");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]})", Zeros(4)),
                "shape[0] is a non-integer number");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [1e0], "data_offsets": [0, 4]})", Zeros(4)),
                "shape[0] is a non-integer number");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [[1]], "data_offsets": [0, 4]})", Zeros(4)),
                "shape[0] is a JSON array");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [1, null], "data_offsets": [0, 4]})", Zeros(4)),
                "shape[1] is a JSON null");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [9223372036854775808], "data_offsets": [0, 4]})"),
                "shape[0] is 9223372036854775808, above the largest int64");
  // Even next to a zero dimension, which would make the element count 0.
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [0, 18446744073709551615], "data_offsets": [0, 0]})"),
                "above the largest int64");
}

TEST(SafetensorsTest, RejectsShapesWhoseByteCountOverflows) {
  // 2^32 * 2^32 elements overflow u64 by themselves...
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]})"),
                "has more bytes than fit in 64 bits");
  // ...2^62 elements fit, but not 2^62 * 4 bytes...
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 0]})"),
                "has more bytes than fit in 64 bits");
  // ...and a product that wraps to exactly 0 must not pass as an empty tensor.
  ExpectInvalid(OneEntry(R"({"dtype": "F16", "shape": [4294967296, 4294967296, 4], "data_offsets": [0, 0]})"),
                "has more bytes than fit in 64 bits");
}

TEST(SafetensorsTest, RejectsUnknownDtypes) {
  for (const char* dtype : {"F64", "I32", "f32", "float32", ""}) {
    ExpectInvalid(
        OneEntry(std::string(R"({"dtype": ")") + dtype + R"(", "shape": [1], "data_offsets": [0, 4]})",
                 Zeros(4)),
        std::string("has dtype '") + dtype + "', expected F32, F16 or BF16");
  }
}

TEST(SafetensorsTest, RejectsOffsetsOutsideTheData) {
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})", Zeros(4)),
                "data_offsets [0, 8] go past the end of the data section (4 bytes)");
  ExpectInvalid(
      OneEntry(R"({"dtype": "F32", "shape": [1], "data_offsets": [18446744073709551612, 0]})", Zeros(4)),
      "end before they begin");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]})", Zeros(4)),
                "data_offsets [4, 0] end before they begin");
  ExpectInvalid(
      OneEntry(
          R"({"dtype": "F32", "shape": [1], "data_offsets": [18446744073709551612, 18446744073709551615]})",
          Zeros(4)),
      "go past the end of the data section");
}

TEST(SafetensorsTest, RejectsByteLengthsThatDisagreeWithTheShape) {
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]})", Zeros(20)),
                "data_offsets [0, 20] hold 20 bytes, but shape [2, 3] of F32 needs 24");
  ExpectInvalid(OneEntry(R"({"dtype": "BF16", "shape": [3], "data_offsets": [0, 12]})", Zeros(12)),
                "shape [3] of BF16 needs 6");
}

TEST(SafetensorsTest, RejectsOverlapsGapsAndTrailingBytes) {
  ExpectInvalid(FileBytes(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                          Zeros(12)),
                "tensors 'a' [0, 8) and 'b' [4, 12) overlap");
  ExpectInvalid(FileBytes(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                              "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
                          Zeros(8)),
                "overlap");
  ExpectInvalid(FileBytes(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                              "b": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}})",
                          Zeros(8)),
                "overlap");
  ExpectInvalid(FileBytes(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                              "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
                          Zeros(12)),
                "data bytes [4, 8) belong to no tensor");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [1], "data_offsets": [4, 8]})", Zeros(8)),
                "data bytes [0, 4) belong to no tensor");
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": [1], "data_offsets": [0, 4]})", Zeros(6)),
                "data section has 2 bytes after the last tensor");
  ExpectInvalid(FileBytes("{}", Zeros(1)), "data section has 1 bytes after the last tensor");
}

TEST(SafetensorsTest, RejectsMetadataThatIsNotAnObjectOfStrings) {
  ExpectInvalid(FileBytes(R"({"__metadata__": ["kind"]})"),
                "'__metadata__' is a JSON array, expected an object of strings");
  ExpectInvalid(FileBytes(R"({"__metadata__": "multi_head"})"), "'__metadata__' is a JSON string");
  ExpectInvalid(FileBytes(R"({"__metadata__": {"kind": "multi_head", "num_heads": 4}})"),
                "'__metadata__' entry 'num_heads' is a JSON number, expected a string");
  ExpectInvalid(FileBytes(R"({"__metadata__": {"nested": {}}})"), "entry 'nested' is a JSON object");
}

TEST(SafetensorsTest, SurvivesDeeplyNestedJson) {
  const int depth = 100000;
  const std::string nested = std::string(depth, '[') + std::string(depth, ']');
  ExpectInvalid(OneEntry(R"({"dtype": "F32", "shape": )" + nested + R"(, "data_offsets": [0, 0]})"),
                "shape[0] is a JSON array");
  ExpectInvalid(FileBytes(std::string(depth, '{')), "not valid JSON");
}

// Exact float32 values of F16 bit patterns, written out independently of any
// converter: normals, the largest finite, subnormals, zeros and specials.
TEST(SafetensorsTest, ConvertsKnownF16Patterns) {
  const std::vector<std::pair<uint16_t, float>> cases = {
      {0x3C00, 1.0f},
      {0xC000, -2.0f},
      {0x3555, 0.333251953125f},
      {0x7BFF, 65504.0f},
      {0x0400, 6.103515625e-05f},         // smallest normal, 2^-14
      {0x0001, 5.9604644775390625e-08f},  // smallest subnormal, 2^-24
      {0x03FF, 6.0975551605224609e-05f},  // largest subnormal, 1023 * 2^-24
      {0x8001, -5.9604644775390625e-08f},
      {0x0000, 0.0f},
      {0x7C00, std::numeric_limits<float>::infinity()},
      {0xFC00, -std::numeric_limits<float>::infinity()},
  };
  std::vector<uint16_t> bits;
  for (const auto& [pattern, value] : cases) bits.push_back(pattern);
  bits.push_back(0x8000);  // -0.0
  bits.push_back(0x7E00);  // quiet NaN
  bits.push_back(0xFC01);  // negative signalling NaN
  absl::StatusOr<SafetensorsFile> file =
      ParseSafetensors(BuildFile({HalfTensor("h", "F16", {static_cast<int64_t>(bits.size())}, bits)}));
  ASSERT_TRUE(file.ok()) << file.status();
  const std::vector<float>& data = file->tensors.at("h").data;
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(data[i], cases[i].second) << "pattern 0x" << std::hex << cases[i].first;
  }
  const size_t n = cases.size();
  EXPECT_EQ(data[n], 0.0f);
  EXPECT_TRUE(std::signbit(data[n]));
  EXPECT_TRUE(std::isnan(data[n + 1]));
  EXPECT_FALSE(std::signbit(data[n + 1]));
  EXPECT_TRUE(std::isnan(data[n + 2]));
  EXPECT_TRUE(std::signbit(data[n + 2]));
}

// The CPU's own half-precision conversion (F16C, on every x86-64 host this
// project runs on), as a reference independent of ours: clang 14 has no
// _Float16 on x86.
__attribute__((target("f16c"))) float CpuHalfToFloat(uint16_t bits) { return _cvtsh_ss(bits); }

bool CpuHasF16c() {
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
}

// Every F16 pattern against the CPU's conversion.
TEST(SafetensorsTest, ConvertsEveryF16PatternLikeTheCpu) {
  if (!CpuHasF16c()) GTEST_SKIP() << "this CPU has no F16C";
  std::vector<uint16_t> bits(65536);
  for (uint32_t i = 0; i < bits.size(); ++i) bits[i] = static_cast<uint16_t>(i);
  absl::StatusOr<SafetensorsFile> file = ParseSafetensors(BuildFile({HalfTensor("h", "F16", {65536}, bits)}));
  ASSERT_TRUE(file.ok()) << file.status();
  const std::vector<float>& data = file->tensors.at("h").data;
  int mismatches = 0;
  for (uint32_t i = 0; i < bits.size(); ++i) {
    const float expected = CpuHalfToFloat(bits[i]);
    const bool same = std::isnan(expected)
                          ? std::isnan(data[i]) && std::signbit(data[i]) == std::signbit(expected)
                          : std::bit_cast<uint32_t>(data[i]) == std::bit_cast<uint32_t>(expected);
    if (!same && ++mismatches <= 10) {
      ADD_FAILURE() << "F16 0x" << std::hex << i << ": got " << data[i] << ", expected " << expected;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(SafetensorsTest, ConvertsKnownBF16Patterns) {
  const std::vector<std::pair<uint16_t, float>> cases = {
      {0x3F80, 1.0f},
      {0xC040, -3.0f},
      {0x3EAB, 0.333984375f},
      {0x7F7F, 3.3895313892515355e+38f},  // largest finite
      {0x0080, 1.1754943508222875e-38f},  // smallest normal, 2^-126
      {0x0001, 9.183549615799121e-41f},   // smallest subnormal, 2^-133
      {0x7F80, std::numeric_limits<float>::infinity()},
      {0xFF80, -std::numeric_limits<float>::infinity()},
  };
  std::vector<uint16_t> bits;
  for (const auto& [pattern, value] : cases) bits.push_back(pattern);
  bits.push_back(0x7FC0);  // NaN
  absl::StatusOr<SafetensorsFile> file = ParseSafetensors(BuildFile({HalfTensor("b", "BF16", {3, 3}, bits)}));
  ASSERT_TRUE(file.ok()) << file.status();
  const std::vector<float>& data = file->tensors.at("b").data;
  EXPECT_THAT(file->tensors.at("b").shape, ElementsAre(3, 3));
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(data[i], cases[i].second) << "pattern 0x" << std::hex << cases[i].first;
  }
  EXPECT_TRUE(std::isnan(data[cases.size()]));
}

TEST(SafetensorsTest, ReadsEachDtypeFromItsOwnOffsets) {
  const std::vector<uint8_t> bytes =
      BuildFile({HalfTensor("half", "F16", {2}, {0x3C00, 0x4000}), F32Tensor("single", {1}, {-0.5f}),
                 HalfTensor("brain", "BF16", {1}, {0x4040})});
  absl::StatusOr<SafetensorsFile> file = ParseSafetensors(bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_THAT(file->tensors.at("half").data, ElementsAre(1.0f, 2.0f));
  EXPECT_THAT(file->tensors.at("single").data, ElementsAre(-0.5f));
  EXPECT_THAT(file->tensors.at("brain").data, ElementsAre(3.0f));
}

std::vector<uint8_t> SampleFile() {
  std::vector<float> values(24);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.5f * static_cast<float>(i) - 3.0f;
  return BuildFile({F32Tensor("W_q.weight", {4, 3}, std::vector<float>(values.begin(), values.begin() + 12)),
                    HalfTensor("W_q.bias", "F16", {4}, {0x3C00, 0xBC00, 0x0001, 0x7BFF}),
                    F32Tensor("W_k.weight", {3, 4}, std::vector<float>(values.begin() + 12, values.end()))},
                   {{"kind", "multi_head"}, {"num_heads", "2"}});
}

// Any proper prefix of a valid file is missing data, so it must be rejected.
TEST(SafetensorsTest, RejectsEveryTruncation) {
  const std::vector<uint8_t> bytes = SampleFile();
  ASSERT_TRUE(ParseSafetensors(bytes).ok());
  for (size_t size = 0; size < bytes.size(); ++size) {
    absl::StatusOr<SafetensorsFile> file = ParseSafetensors(std::span(bytes.data(), size));
    ASSERT_FALSE(file.ok()) << "truncated to " << size << " bytes";
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  }
}

// The header is ASCII, so inverting any byte of it (or any change to the
// length) leaves no valid file. Single-bit flips may leave a valid file (a
// digit turns into another); those must at least parse consistently.
TEST(SafetensorsTest, SurvivesCorruptedHeaders) {
  const std::vector<uint8_t> bytes = SampleFile();
  const uint64_t header_end = 8 + (bytes[0] | (bytes[1] << 8));
  for (size_t position = 0; position < header_end; ++position) {
    std::vector<uint8_t> inverted = bytes;
    inverted[position] ^= 0xFF;
    absl::StatusOr<SafetensorsFile> file = ParseSafetensors(inverted);
    ASSERT_FALSE(file.ok()) << "byte " << position << " inverted";
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
    for (int bit = 0; bit < 8; ++bit) {
      std::vector<uint8_t> flipped = bytes;
      flipped[position] ^= static_cast<uint8_t>(1 << bit);
      absl::StatusOr<SafetensorsFile> parsed = ParseSafetensors(flipped);
      if (position < 8) {
        EXPECT_FALSE(parsed.ok()) << "length bit " << position * 8 + bit << " flipped";
        continue;
      }
      if (!parsed.ok()) {
        EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
        continue;
      }
      for (const auto& [name, tensor] : parsed->tensors) {
        int64_t count = 1;
        for (int64_t dim : tensor.shape) count *= dim;
        EXPECT_EQ(tensor.data.size(), static_cast<size_t>(count)) << name;
      }
    }
  }
}

}  // namespace
}  // namespace attention
