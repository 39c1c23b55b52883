// model_loader_test.cc: LoadModel / ParseModel on the conformance and example
// models, on each layout and kind built here (Hugging Face's with the config
// keys it reads), and on every way a model file can be wrong.
#include "core/model/model_loader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "core/model/layer_config.h"
#include "tests/support/files.h"
#include "tests/support/safetensors_builder.h"

namespace attention {
namespace {

using ::attention::testing::BuildFile;
using ::attention::testing::F32Tensor;
using ::attention::testing::HalfTensor;
using ::attention::testing::ReadFile;
using ::attention::testing::ReadJson;
using ::attention::testing::TensorBytes;
using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace fs = std::filesystem;

const fs::path kConformanceDir = fs::path(ATTENTION_SOURCE_DIR) / "tests" / "conformance";
const fs::path kExampleModelsDir = fs::path(ATTENTION_SOURCE_DIR) / "models";

using Metadata = std::map<std::string, std::string>;

// `count` distinct values first, first + 1, ... so a misplaced row shows.
std::vector<float> Sequence(int64_t count, float first = 0.0f) {
  std::vector<float> values(count);
  for (int64_t i = 0; i < count; ++i) values[i] = first + static_cast<float>(i);
  return values;
}

// An F32 tensor of `shape` holding Sequence(product, first).
TensorBytes Weight(std::string name, std::vector<int64_t> shape, float first = 0.0f) {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  return F32Tensor(std::move(name), std::move(shape), Sequence(count, first));
}

// The parsed model with its multi_head weights rebuilt row-major (a loaded
// model holds them only packed), so the tests below read them as the file
// gave them.
absl::StatusOr<Model> Parse(const std::string& name, const std::vector<TensorBytes>& tensors,
                            const Metadata& metadata) {
  absl::StatusOr<Model> model = ParseModel(name, BuildFile(tensors, metadata));
  if (model.ok()) UnpackProjections(*model);
  return model;
}

// Asserts INVALID_ARGUMENT whose message is "<name>.safetensors: " + a message
// containing `fragment`.
void ExpectInvalid(const absl::StatusOr<Model>& model, const std::string& name, const std::string& fragment) {
  ASSERT_FALSE(model.ok()) << "loaded; expected an error containing: " << fragment;
  EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument) << model.status();
  EXPECT_THAT(std::string(model.status().message()), StartsWith(name + ".safetensors: "));
  EXPECT_THAT(model.status().message(), HasSubstr(fragment));
}

void ExpectMatrix(const RowMatrix& matrix, int64_t rows, int64_t cols, const std::vector<float>& values) {
  ASSERT_EQ(matrix.rows(), rows);
  ASSERT_EQ(matrix.cols(), cols);
  EXPECT_EQ(std::vector<float>(matrix.data(), matrix.data() + matrix.size()), values);
}

void ExpectVector(const Vector& vector, const std::vector<float>& values) {
  EXPECT_EQ(std::vector<float>(vector.data(), vector.data() + vector.size()), values);
}

std::vector<fs::path> ModelFiles(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path());
  }
  return files;
}

// A fresh directory for files this test writes.
fs::path TempDir() {
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path dir = fs::path(::testing::TempDir()) /
                 (std::string("model_loader_test_") + test->name() + "_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

TEST(ModelLoaderTest, LoadsEveryConformanceModel) {
  const std::vector<fs::path> files = ModelFiles(kConformanceDir / "models");
  ASSERT_FALSE(files.empty());
  for (const fs::path& file : files) {
    absl::StatusOr<Model> model = LoadModel(file);
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ(model->name, file.stem().string());
  }
}

// The sizes each conformance case needs, read from its request and expected
// response, must be the sizes its model reports.
TEST(ModelLoaderTest, ConformanceModelsFitTheirCases) {
  int checked = 0;
  for (const fs::directory_entry& entry : fs::directory_iterator(kConformanceDir / "cases")) {
    const nlohmann::json test_case = ReadJson(entry.path());
    const std::string case_name = test_case["name"];
    const nlohmann::json& request = test_case["request"];
    const fs::path file = kConformanceDir / "models" / (request["model"].get<std::string>() + ".safetensors");
    if (!fs::exists(file)) continue;  // a built-in model
    SCOPED_TRACE(case_name);
    absl::StatusOr<Model> model = LoadModel(file);
    ASSERT_TRUE(model.ok()) << model.status();

    const nlohmann::json& queries = request["queries"]["shape"];
    const nlohmann::json& keys = request.contains("keys") ? request["keys"]["shape"] : queries;
    const nlohmann::json& values = request.contains("values") ? request["values"]["shape"] : keys;
    const nlohmann::json& output = test_case["expected"]["output"]["shape"];
    const nlohmann::json& weights = test_case["expected"]["attention_weights"]["shape"];
    EXPECT_EQ(model->query_size, queries[2].get<int64_t>());
    EXPECT_EQ(model->key_size, keys[2].get<int64_t>());
    if (weights.size() == 4) {
      EXPECT_EQ(model->kind, Kind::kMultiHead);
      EXPECT_EQ(model->num_heads, weights[1].get<int64_t>());
      EXPECT_EQ(model->value_size, values[2].get<int64_t>());
      EXPECT_EQ(model->output_size, output[2].get<int64_t>());
      EXPECT_EQ(model->packed_o.out_cols(), model->output_size);
      EXPECT_EQ(model->packed_q.out_cols(), model->output_size);
    } else {
      EXPECT_THAT(case_name, StartsWith(std::string(KindName(model->kind))));
      EXPECT_EQ(model->num_heads, 0);
      EXPECT_EQ(model->value_size, 0);
      EXPECT_EQ(model->output_size, 0);
      EXPECT_EQ(output[2], values[2]);
    }
    ++checked;
  }
  EXPECT_GE(checked, 10);
}

// The numbers in a name mean what models/README.md says: `_e` the model width
// E, `_h` the heads (additive: hidden units), `_d` the query and key size.
int64_t NumberAfter(const std::string& name, const std::string& tag) {
  std::smatch match;
  if (!std::regex_search(name, match, std::regex(tag + "(\\d+)"))) return -1;
  return std::stoll(match[1]);
}

TEST(ModelLoaderTest, LoadsEveryExampleModelWithTheSizesItsNameGives) {
  const std::vector<fs::path> files = ModelFiles(kExampleModelsDir);
  ASSERT_GE(files.size(), 4u);
  for (const fs::path& file : files) {
    const std::string name = file.stem().string();
    SCOPED_TRACE(name);
    absl::StatusOr<Model> model = LoadModel(file);
    ASSERT_TRUE(model.ok()) << model.status();
    switch (model->kind) {
      case Kind::kMultiHead: {
        EXPECT_THAT(name, StartsWith("mh_"));
        EXPECT_EQ(model->output_size, NumberAfter(name, "_e"));
        EXPECT_EQ(model->num_heads, NumberAfter(name, "_h"));
        // `_kv`: the key/value heads of a grouped model; without it, one per head.
        const int64_t kv_heads = NumberAfter(name, "_kv");
        EXPECT_EQ(KvHeads(*model), kv_heads > 0 ? kv_heads : model->num_heads);
        break;
      }
      case Kind::kAdditive:
        EXPECT_THAT(name, StartsWith("additive_"));
        EXPECT_EQ(model->w_q.rows(), NumberAfter(name, "_h"));
        break;
      case Kind::kBilinear:
        EXPECT_THAT(name, StartsWith("bilinear_"));
        EXPECT_EQ(model->query_size, NumberAfter(name, "_d"));
        EXPECT_EQ(model->key_size, NumberAfter(name, "_d"));
        break;
      default:
        ADD_FAILURE() << "example models show the kinds with weights, not " << KindName(model->kind);
    }
  }
}

TEST(ModelLoaderTest, LoadsAdditive) {
  absl::StatusOr<Model> model = Parse(
      "add",
      {Weight("W_q.weight", {3, 4}), Weight("W_k.weight", {3, 2}, 100), Weight("w_v.weight", {1, 3}, 200)},
      {{"kind", "additive"}});
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->name, "add");
  EXPECT_EQ(model->kind, Kind::kAdditive);
  EXPECT_EQ(model->query_size, 4);
  EXPECT_EQ(model->key_size, 2);
  EXPECT_EQ(model->value_size, 0);
  EXPECT_EQ(model->output_size, 0);
  EXPECT_EQ(model->num_heads, 0);
  ExpectMatrix(model->w_q, 3, 4, Sequence(12));
  ExpectMatrix(model->w_k, 3, 2, Sequence(6, 100));
  ExpectMatrix(model->w_v, 1, 3, Sequence(3, 200));
}

TEST(ModelLoaderTest, LoadsBilinearFromF16) {
  absl::StatusOr<Model> model = Parse(
      "bil", {HalfTensor("W_k.weight", "F16", {2, 3}, {0x3C00, 0x4000, 0xC200, 0x0001, 0x3800, 0x0000})},
      {{"kind", "bilinear"}});
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->kind, Kind::kBilinear);
  EXPECT_EQ(model->query_size, 2);
  EXPECT_EQ(model->key_size, 3);
  EXPECT_EQ(model->value_size, 0);
  ExpectMatrix(model->w_k, 2, 3, {1.0f, 2.0f, -3.0f, 5.9604644775390625e-08f, 0.5f, 0.0f});
}

TEST(ModelLoaderTest, LoadsD2lMultiHeadWithoutBiasesAsZeroBiases) {
  absl::StatusOr<Model> model = Parse("d2l",
                                      {Weight("W_q.weight", {6, 5}), Weight("W_k.weight", {6, 4}, 100),
                                       Weight("W_v.weight", {6, 3}, 200), Weight("W_o.weight", {6, 6}, 300)},
                                      {{"kind", "multi_head"}, {"num_heads", "3"}});
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->kind, Kind::kMultiHead);
  EXPECT_EQ(model->num_heads, 3);
  EXPECT_EQ(model->query_size, 5);
  EXPECT_EQ(model->key_size, 4);
  EXPECT_EQ(model->value_size, 3);
  EXPECT_EQ(model->output_size, 6);
  ExpectMatrix(model->w_q, 6, 5, Sequence(30));
  ExpectMatrix(model->w_k, 6, 4, Sequence(24, 100));
  ExpectMatrix(model->w_v, 6, 3, Sequence(18, 200));
  ExpectMatrix(model->w_o, 6, 6, Sequence(36, 300));
  for (const Vector* bias : {&model->b_q, &model->b_k, &model->b_v, &model->b_o}) {
    ExpectVector(*bias, std::vector<float>(6, 0.0f));
  }
}

TEST(ModelLoaderTest, LoadsD2lMultiHeadBiasesFromBF16) {
  std::vector<TensorBytes> tensors;
  for (const char* projection : {"W_q", "W_k", "W_v", "W_o"}) {
    tensors.push_back(
        HalfTensor(std::string(projection) + ".weight", "BF16", {2, 2}, {0x3F80, 0, 0, 0x3F80}));
    tensors.push_back(HalfTensor(std::string(projection) + ".bias", "BF16", {2}, {0x4040, 0xC000}));
  }
  absl::StatusOr<Model> model = Parse("d2l_bf16", tensors, {{"kind", "multi_head"}, {"num_heads", "1"}});
  ASSERT_TRUE(model.ok()) << model.status();
  ExpectMatrix(model->w_o, 2, 2, {1, 0, 0, 1});
  for (const Vector* bias : {&model->b_q, &model->b_k, &model->b_v, &model->b_o})
    ExpectVector(*bias, {3.0f, -2.0f});
}

// Rows [0,E) of in_proj_weight are W_q, [E,2E) W_k, [2E,3E) W_v; the bias
// likewise.
TEST(ModelLoaderTest, SplitsTorchPackedProjections) {
  absl::StatusOr<Model> model =
      Parse("torch",
            {Weight("in_proj_weight", {12, 4}), Weight("in_proj_bias", {12}, 100),
             Weight("out_proj.weight", {4, 4}, 200), Weight("out_proj.bias", {4}, 300)},
            {{"kind", "multi_head"}, {"num_heads", "2"}});
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->num_heads, 2);
  EXPECT_EQ(model->query_size, 4);
  EXPECT_EQ(model->key_size, 4);
  EXPECT_EQ(model->value_size, 4);
  EXPECT_EQ(model->output_size, 4);
  ExpectMatrix(model->w_q, 4, 4, Sequence(16));
  ExpectMatrix(model->w_k, 4, 4, Sequence(16, 16));
  ExpectMatrix(model->w_v, 4, 4, Sequence(16, 32));
  ExpectMatrix(model->w_o, 4, 4, Sequence(16, 200));
  ExpectVector(model->b_q, Sequence(4, 100));
  ExpectVector(model->b_k, Sequence(4, 104));
  ExpectVector(model->b_v, Sequence(4, 108));
  ExpectVector(model->b_o, Sequence(4, 300));
}

TEST(ModelLoaderTest, LoadsTorchSeparateProjections) {
  absl::StatusOr<Model> model =
      Parse("kvdim",
            {Weight("q_proj_weight", {6, 6}), Weight("k_proj_weight", {6, 2}, 100),
             Weight("v_proj_weight", {6, 5}, 200), Weight("in_proj_bias", {18}, 300),
             Weight("out_proj.weight", {6, 6}, 400), Weight("out_proj.bias", {6}, 500)},
            {{"kind", "multi_head"}, {"num_heads", "3"}});
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->query_size, 6);
  EXPECT_EQ(model->key_size, 2);
  EXPECT_EQ(model->value_size, 5);
  EXPECT_EQ(model->output_size, 6);
  ExpectMatrix(model->w_k, 6, 2, Sequence(12, 100));
  ExpectMatrix(model->w_v, 6, 5, Sequence(30, 200));
  ExpectVector(model->b_v, Sequence(6, 312));
}

// torch.nn.MultiheadAttention(bias=False) writes neither bias.
TEST(ModelLoaderTest, LoadsTorchWithoutBiasesAsZeroBiases) {
  absl::StatusOr<Model> model =
      Parse("nobias", {Weight("in_proj_weight", {6, 2}), Weight("out_proj.weight", {2, 2})},
            {{"kind", "multi_head"}, {"num_heads", "2"}});
  ASSERT_TRUE(model.ok()) << model.status();
  for (const Vector* bias : {&model->b_q, &model->b_k, &model->b_v, &model->b_o})
    ExpectVector(*bias, {0.0f, 0.0f});
}

TEST(ModelLoaderTest, LoadsWeightlessAliasesOfTheBuiltIns) {
  for (Kind kind : {Kind::kDotProduct, Kind::kDistance}) {
    absl::StatusOr<Model> model = Parse("alias", {}, {{"kind", std::string(KindName(kind))}});
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ(model->kind, kind);
    EXPECT_EQ(model->name, "alias");
    EXPECT_EQ(model->query_size, 0);
    EXPECT_EQ(model->key_size, 0);
    ExpectInvalid(Parse("alias", {Weight("W_k.weight", {2, 2})}, {{"kind", std::string(KindName(kind))}}),
                  "alias",
                  "unexpected tensor 'W_k.weight' with shape [2, 2] in a " + std::string(KindName(kind)) +
                      " model (it has no weights)");
  }
}

TEST(ModelLoaderTest, IgnoresOtherMetadata) {
  absl::StatusOr<Model> model =
      Parse("bil", {Weight("W_k.weight", {2, 2})}, {{"kind", "bilinear"}, {"format", "pt"}});
  EXPECT_TRUE(model.ok()) << model.status();
}

TEST(ModelLoaderTest, HoldsMultiHeadWeightsOnlyPacked) {
  const absl::StatusOr<Model> model =
      ParseModel("torch", BuildFile({Weight("in_proj_weight", {12, 4}),
                                     Weight("out_proj.weight", {4, 4}, 200)},
                                    {{"kind", "multi_head"}, {"num_heads", "2"}}));
  ASSERT_TRUE(model.ok()) << model.status();
  for (const RowMatrix* weight : {&model->w_q, &model->w_k, &model->w_v, &model->w_o}) {
    EXPECT_EQ(weight->size(), 0);
  }
  for (const Vector* bias : {&model->b_q, &model->b_k, &model->b_v, &model->b_o}) {
    EXPECT_EQ(bias->size(), 0);
  }
  for (const PackedWeights* packed :
       {&model->packed_q, &model->packed_k, &model->packed_v, &model->packed_o}) {
    EXPECT_EQ(packed->out_cols(), 4);
    EXPECT_EQ(packed->in_cols(), 4);
    EXPECT_EQ(packed->precision(), Precision::kFp32);
  }
}

// 1 + 2^-9 is halfway between two BF16 values: a bf16 model holds it
// rounded to 1 (even); 1 + 3 * 2^-9 rounds up to 1 + 2^-7.
TEST(ModelLoaderTest, ReadsPrecisionAndRoundsBf16WeightsOnce) {
  const std::vector<float> values = {1.0f + 1.0f / 512, 1.0f + 3.0f / 512, -2.0f, 0.5f};
  const std::vector<TensorBytes> torch = {F32Tensor("in_proj_weight", {6, 2}, Sequence(12)),
                                          F32Tensor("out_proj.weight", {2, 2}, values)};
  for (const auto& [given, expected] :
       std::vector<std::pair<std::string, Precision>>{{"", Precision::kFp32},
                                                      {"fp32", Precision::kFp32},
                                                      {"bf16", Precision::kBf16}}) {
    SCOPED_TRACE("precision \"" + given + "\"");
    Metadata metadata = {{"kind", "multi_head"}, {"num_heads", "1"}};
    if (!given.empty()) metadata["precision"] = given;
    absl::StatusOr<Model> model = Parse("p", torch, metadata);
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ(model->precision, expected);
    EXPECT_EQ(model->packed_o.precision(), expected);
    ExpectMatrix(model->w_o, 2, 2,
                 expected == Precision::kBf16
                     ? std::vector<float>{1.0f, 1.0f + 1.0f / 128, -2.0f, 0.5f}
                     : values);
  }
}

TEST(ModelLoaderTest, PrecisionAppliesToKindsWithProductsItChanges) {
  const Metadata bf16_dot = {{"kind", "dot_product"}, {"precision", "bf16"}};
  EXPECT_EQ(Parse("d", {}, bf16_dot)->precision, Precision::kBf16);
  const Metadata bf16_bilinear = {{"kind", "bilinear"}, {"precision", "bf16"}};
  EXPECT_EQ(Parse("b", {Weight("W_k.weight", {2, 2})}, bf16_bilinear)->precision,
            Precision::kFp32);
}

TEST(ModelLoaderTest, ForcedFp32LoadsABf16ModelAsFp32) {
  const std::vector<uint8_t> file =
      BuildFile({Weight("in_proj_weight", {6, 2}), Weight("out_proj.weight", {2, 2})},
                {{"kind", "multi_head"}, {"num_heads", "1"}, {"precision", "bf16"}});
  const absl::StatusOr<Model> forced = ParseModel("p", file, /*force_fp32=*/true);
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_EQ(forced->precision, Precision::kFp32);
  EXPECT_EQ(forced->packed_q.precision(), Precision::kFp32);
  EXPECT_EQ(ParseModel("p", file)->precision, Precision::kBf16);
}

TEST(ModelLoaderTest, ReadsTheKvCacheDtypeOfEveryKind) {
  EXPECT_FALSE(Parse("d", {}, {{"kind", "dot_product"}})->kv_cache_dtype.has_value());
  for (const auto& [name, dtype] : std::vector<std::pair<std::string, KvDtype>>{
           {"float32", KvDtype::kFloat32}, {"bfloat16", KvDtype::kBfloat16},
           {"float16", KvDtype::kFloat16}}) {
    EXPECT_EQ(Parse("d", {}, {{"kind", "dot_product"}, {"kv_cache_dtype", name}})->kv_cache_dtype,
              dtype);
    EXPECT_EQ(Parse("b", {Weight("W_k.weight", {2, 2})},
                    {{"kind", "bilinear"}, {"kv_cache_dtype", name}})
                  ->kv_cache_dtype,
              dtype);
  }
}

TEST(ModelLoaderTest, RejectsUnknownKvCacheDtypeNamingTheKey) {
  for (const char* value : {"bf16", "fp16", "Float32", ""}) {
    ExpectInvalid(Parse("d", {}, {{"kind", "dot_product"}, {"kv_cache_dtype", value}}), "d",
                  "__metadata__ \"kv_cache_dtype\" is \"" + std::string(value) +
                      "\", expected float32, bfloat16 or float16");
  }
}

TEST(ModelLoaderTest, RejectsUnknownPrecisionNamingTheKey) {
  const std::vector<TensorBytes> torch = {Weight("in_proj_weight", {6, 2}),
                                          Weight("out_proj.weight", {2, 2})};
  for (const char* value : {"BF16", "fp16", ""}) {
    const Metadata metadata = {{"kind", "multi_head"}, {"num_heads", "1"}, {"precision", value}};
    ExpectInvalid(Parse("mh", torch, metadata), "mh",
                  "__metadata__ \"precision\" is \"" + std::string(value) +
                      "\", expected fp32 or bf16");
    // Even where it would be overridden.
    ExpectInvalid(ParseModel("b", BuildFile({Weight("W_k.weight", {2, 2})},
                                            {{"kind", "bilinear"}, {"precision", value}}),
                             /*force_fp32=*/true),
                  "b", "\"precision\"");
  }
}

TEST(ModelLoaderTest, RejectsMissingOrUnknownKinds) {
  ExpectInvalid(Parse("m", {Weight("W_k.weight", {2, 2})}, {}), "m", "__metadata__ has no \"kind\"");
  ExpectInvalid(Parse("m", {Weight("W_k.weight", {2, 2})}, {{"format", "pt"}}), "m",
                "__metadata__ has no \"kind\"");
  ExpectInvalid(Parse("m", {Weight("W_k.weight", {2, 2})}, {{"kind", "Bilinear"}}), "m",
                "__metadata__ \"kind\" is \"Bilinear\", expected additive, bilinear or multi_head");
}

TEST(ModelLoaderTest, RejectsBadNumHeads) {
  const std::vector<TensorBytes> torch = {Weight("in_proj_weight", {24, 8}),
                                          Weight("out_proj.weight", {8, 8})};
  ExpectInvalid(Parse("mh", torch, {{"kind", "multi_head"}}), "mh",
                "multi_head model has no __metadata__ \"num_heads\"");
  for (const char* heads : {"0", "-2", "+2", " 2", "2 ", "2.0", "0x2", "two", "", "99999999999999999999"}) {
    ExpectInvalid(Parse("mh", torch, {{"kind", "multi_head"}, {"num_heads", heads}}), "mh",
                  "\"num_heads\" is \"" + std::string(heads) + "\", expected a positive decimal integer");
  }
  ExpectInvalid(Parse("mh", torch, {{"kind", "multi_head"}, {"num_heads", "3"}}), "mh",
                "num_heads 3 does not divide the model width E = 8");
  ExpectInvalid(Parse("mh", torch, {{"kind", "multi_head"}, {"num_heads", "16"}}), "mh",
                "num_heads 16 does not divide the model width E = 8");
  ExpectInvalid(Parse("add", {Weight("W_k.weight", {2, 2})}, {{"kind", "bilinear"}, {"num_heads", "2"}}),
                "add", "__metadata__ \"num_heads\" is given, but a bilinear model has no heads");
}

TEST(ModelLoaderTest, NamesTheTensorAndBothShapesOnAMismatch) {
  ExpectInvalid(Parse("mh",
                      {Weight("W_q.weight", {8, 8}), Weight("W_k.weight", {8, 8}),
                       Weight("W_v.weight", {8, 8}), Weight("W_o.weight", {4, 5})},
                      {{"kind", "multi_head"}, {"num_heads", "2"}}),
                "mh", "tensor 'W_o.weight' has shape [4, 5], expected [8, 8]");
  ExpectInvalid(
      Parse("add", {Weight("W_q.weight", {7, 4}), Weight("W_k.weight", {6, 4}), Weight("w_v.weight", {1, 7})},
            {{"kind", "additive"}}),
      "add", "tensor 'W_k.weight' has shape [6, 4], expected [7, d_k]");
  ExpectInvalid(
      Parse("add", {Weight("W_q.weight", {7, 4}), Weight("W_k.weight", {7, 4}), Weight("w_v.weight", {2, 7})},
            {{"kind", "additive"}}),
      "add", "tensor 'w_v.weight' has shape [2, 7], expected [1, 7]");
  ExpectInvalid(
      Parse("add", {Weight("W_q.weight", {7, 4}), Weight("W_k.weight", {7, 4}), Weight("w_v.weight", {7})},
            {{"kind", "additive"}}),
      "add", "tensor 'w_v.weight' has shape [7], expected [1, 7]");
  ExpectInvalid(Parse("bil", {Weight("W_k.weight", {2, 2, 1})}, {{"kind", "bilinear"}}), "bil",
                "tensor 'W_k.weight' has shape [2, 2, 1], expected [d_q, d_k]");
  ExpectInvalid(Parse("bil", {Weight("W_k.weight", {0, 3})}, {{"kind", "bilinear"}}), "bil",
                "tensor 'W_k.weight' has shape [0, 3], expected [d_q, d_k]");
}

TEST(ModelLoaderTest, NamesTheExpectedShapeOfAMissingTensor) {
  ExpectInvalid(
      Parse("add", {Weight("W_q.weight", {7, 4}), Weight("W_k.weight", {7, 3})}, {{"kind", "additive"}}),
      "add", "missing tensor 'w_v.weight' (expected shape [1, 7])");
  ExpectInvalid(Parse("bil", {}, {{"kind", "bilinear"}}), "bil",
                "missing tensor 'W_k.weight' (expected shape [d_q, d_k])");
  ExpectInvalid(
      Parse("t", {Weight("out_proj.weight", {4, 4})}, {{"kind", "multi_head"}, {"num_heads", "2"}}), "t",
      "missing tensor 'in_proj_weight' (expected shape [12, 4]) or q_proj_weight, k_proj_weight and "
      "v_proj_weight");
  ExpectInvalid(Parse("t", {Weight("in_proj_weight", {12, 4}), Weight("in_proj_bias", {12})},
                      {{"kind", "multi_head"}, {"num_heads", "2"}}),
                "t", "missing tensor 'out_proj.weight' (expected shape [E, E])");
  ExpectInvalid(Parse("kv",
                      {Weight("q_proj_weight", {4, 4}), Weight("v_proj_weight", {4, 3}),
                       Weight("out_proj.weight", {4, 4})},
                      {{"kind", "multi_head"}, {"num_heads", "2"}}),
                "kv", "missing tensor 'k_proj_weight' (expected shape [4, d_k])");
}

TEST(ModelLoaderTest, RejectsTorchShapeMismatches) {
  const Metadata metadata = {{"kind", "multi_head"}, {"num_heads", "2"}};
  ExpectInvalid(Parse("t", {Weight("in_proj_weight", {12, 5}), Weight("out_proj.weight", {4, 4})}, metadata),
                "t", "tensor 'in_proj_weight' has shape [12, 5], expected [12, 4]");
  ExpectInvalid(Parse("t",
                      {Weight("in_proj_weight", {12, 4}), Weight("out_proj.weight", {4, 4}),
                       Weight("in_proj_bias", {4}), Weight("out_proj.bias", {4})},
                      metadata),
                "t", "tensor 'in_proj_bias' has shape [4], expected [12]");
  ExpectInvalid(Parse("t", {Weight("in_proj_weight", {12, 4}), Weight("out_proj.weight", {4, 6})}, metadata),
                "t", "tensor 'out_proj.weight' has shape [4, 6], expected [E, E]");
  ExpectInvalid(Parse("kv",
                      {Weight("q_proj_weight", {4, 3}), Weight("k_proj_weight", {4, 3}),
                       Weight("v_proj_weight", {4, 3}), Weight("out_proj.weight", {4, 4})},
                      metadata),
                "kv", "tensor 'q_proj_weight' has shape [4, 3], expected [4, 4]");
}

TEST(ModelLoaderTest, RejectsUnexpectedTensors) {
  ExpectInvalid(Parse("bil", {Weight("W_k.weight", {2, 2}), Weight("W_k.bias", {2})}, {{"kind", "bilinear"}}),
                "bil", "unexpected tensor 'W_k.bias' with shape [2] in a bilinear model (W_k.weight)");
  ExpectInvalid(Parse("add",
                      {Weight("W_q.weight", {3, 4}), Weight("W_k.weight", {3, 2}),
                       Weight("w_v.weight", {1, 3}), Weight("W_v.weight", {1, 3})},
                      {{"kind", "additive"}}),
                "add", "unexpected tensor 'W_v.weight'");
  // torch's add_bias_kv appends learned keys: a different model, not ignorable.
  ExpectInvalid(
      Parse(
          "t",
          {Weight("in_proj_weight", {12, 4}), Weight("out_proj.weight", {4, 4}), Weight("bias_k", {1, 1, 4})},
          {{"kind", "multi_head"}, {"num_heads", "2"}}),
      "t",
      "unexpected tensor 'bias_k' with shape [1, 1, 4] in a torch.nn.MultiheadAttention multi_head model");
  ExpectInvalid(
      Parse("d2l",
            {Weight("W_q.weight", {2, 2}), Weight("W_k.weight", {2, 2}), Weight("W_v.weight", {2, 2}),
             Weight("W_o.weight", {2, 2}), Weight("W_0.weight", {2, 2})},
            {{"kind", "multi_head"}, {"num_heads", "1"}}),
      "d2l", "unexpected tensor 'W_0.weight'");
}

TEST(ModelLoaderTest, RejectsInconsistentMultiHeadLayouts) {
  const Metadata metadata = {{"kind", "multi_head"}, {"num_heads", "1"}};
  const std::vector<TensorBytes> d2l = {Weight("W_q.weight", {2, 2}), Weight("W_k.weight", {2, 2}),
                                        Weight("W_v.weight", {2, 2}), Weight("W_o.weight", {2, 2})};
  std::vector<TensorBytes> some_biases = d2l;
  some_biases.push_back(Weight("W_q.bias", {2}));
  some_biases.push_back(Weight("W_o.bias", {2}));
  ExpectInvalid(Parse("d2l", some_biases, metadata), "d2l",
                "d2l layout has W_q.bias, W_o.bias but not W_k.bias, W_v.bias: give all four biases or none");

  std::vector<TensorBytes> mixed = d2l;
  mixed.push_back(Weight("out_proj.bias", {2}));
  ExpectInvalid(
      Parse("mix", mixed, metadata), "mix",
      "mixes the d2l layout ('W_q.weight') and the torch.nn.MultiheadAttention layout ('out_proj.bias')");

  ExpectInvalid(Parse("both",
                      {Weight("in_proj_weight", {6, 2}), Weight("q_proj_weight", {2, 2}),
                       Weight("out_proj.weight", {2, 2})},
                      metadata),
                "both", "has both in_proj_weight and q/k/v_proj_weight");
  ExpectInvalid(Parse("half",
                      {Weight("in_proj_weight", {6, 2}), Weight("in_proj_bias", {6}),
                       Weight("out_proj.weight", {2, 2})},
                      metadata),
                "half", "has in_proj_bias but not out_proj.bias");
  ExpectInvalid(Parse("none", {Weight("weight", {2, 2})}, metadata), "none",
                "multi_head model has neither the d2l tensors");
}

TEST(ModelLoaderTest, RejectsNonFiniteWeights) {
  ExpectInvalid(
      ParseModel("nan", BuildFile({HalfTensor("W_k.weight", "F16", {2, 2}, {0x3C00, 0x3C00, 0x7E00, 0x3C00})},
                                  {{"kind", "bilinear"}})),
      "nan", "tensor 'W_k.weight' has the non-finite value nan at element 2");
  ExpectInvalid(ParseModel("inf", BuildFile({HalfTensor("W_k.weight", "BF16", {1, 2}, {0x3F80, 0xFF80})},
                                            {{"kind", "bilinear"}})),
                "inf", "has the non-finite value -inf at element 1");
}

TEST(ModelLoaderTest, NamesTheFileOnFormatErrors) {
  ExpectInvalid(ParseModel("broken", std::vector<uint8_t>{1, 2, 3}), "broken", "file has 3 bytes");
}

TEST(ModelLoaderTest, LoadModelNamesTheModelAfterTheFileStem) {
  const fs::path dir = TempDir();
  const fs::path path = dir / "my_model.safetensors";
  const std::vector<uint8_t> bytes = BuildFile({Weight("W_k.weight", {2, 3})}, {{"kind", "bilinear"}});
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  absl::StatusOr<Model> model = LoadModel(path);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->name, "my_model");
  EXPECT_EQ(model->key_size, 3);

  const fs::path bad = dir / "bad.safetensors";
  std::ofstream(bad, std::ios::binary) << "not a model";
  absl::StatusOr<Model> broken = LoadModel(bad);
  ASSERT_FALSE(broken.ok());
  EXPECT_EQ(broken.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(broken.status().message()), StartsWith(bad.string() + ": header length"));
  fs::remove_all(dir);
}

TEST(ModelLoaderTest, LoadModelReportsUnreadablePaths) {
  const fs::path dir = TempDir();
  absl::StatusOr<Model> missing = LoadModel(dir / "absent.safetensors");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr((dir / "absent.safetensors").string()));

  const fs::path subdir = dir / "dir.safetensors";
  fs::create_directory(subdir);
  absl::StatusOr<Model> directory = LoadModel(subdir);
  ASSERT_FALSE(directory.ok());
  EXPECT_EQ(directory.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(directory.status().message(), HasSubstr(subdir.string()));
  fs::remove_all(dir);
}

// Truncations and inverted header bytes of a real model file are rejected
// with the file's name, never a crash.
TEST(ModelLoaderTest, RejectsCorruptedConformanceModel) {
  const std::string file = ReadFile(kConformanceDir / "models" / "mh_torch_kvdim.safetensors");
  const std::vector<uint8_t> bytes(file.begin(), file.end());
  ASSERT_TRUE(ParseModel("kv", bytes).ok());
  for (size_t size = 0; size < bytes.size(); ++size) {
    absl::StatusOr<Model> model = ParseModel("kv", std::span(bytes.data(), size));
    ASSERT_FALSE(model.ok()) << "truncated to " << size;
    EXPECT_THAT(std::string(model.status().message()), StartsWith("kv.safetensors: "));
  }
  const size_t header_end = 8 + (bytes[0] | (bytes[1] << 8));
  for (size_t position = 0; position < header_end; ++position) {
    std::vector<uint8_t> corrupted = bytes;
    corrupted[position] ^= 0xFF;
    absl::StatusOr<Model> model = ParseModel("kv", corrupted);
    ASSERT_FALSE(model.ok()) << "byte " << position << " inverted";
    EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument);
  }
}

// ---- Hugging Face's layout: q/k/v/o_proj with the config in the metadata ----

// A Llama-shaped config: hidden 16, 4 query heads of 4 columns over 2 kv heads.
nlohmann::json HfConfig() {
  return {{"model_type", "llama"}, {"hidden_size", 16}, {"num_attention_heads", 4},
          {"num_key_value_heads", 2}, {"head_dim", 4}, {"max_position_embeddings", 2048}};
}

// The projections of a layer with hidden 16 whose queries have `query_width`
// = H hd rows and keys and values `kv_width` = H_kv hd, each with distinct
// values; by default HfConfig()'s (4 heads, 2 kv heads, head_dim 4).
std::vector<TensorBytes> HfTensors(int64_t query_width = 16, int64_t kv_width = 8) {
  return {Weight("q_proj.weight", {query_width, 16}), Weight("k_proj.weight", {kv_width, 16}, 1000),
          Weight("v_proj.weight", {kv_width, 16}, 2000), Weight("o_proj.weight", {16, query_width}, 3000)};
}

// The metadata of a layer with `config`, plus `extra` keys.
Metadata HfMetadata(const nlohmann::json& config, const Metadata& extra = {}) {
  Metadata metadata = {{"kind", "multi_head"}, {"config", config.dump()}};
  metadata.insert(extra.begin(), extra.end());
  return metadata;
}

absl::StatusOr<Model> ParseHf(const nlohmann::json& config, const Metadata& extra = {},
                              const std::vector<TensorBytes>& tensors = HfTensors()) {
  return Parse("hf", tensors, HfMetadata(config, extra));
}

// The sliding window the layer `layer_index` of `config` gets; -1 if it does
// not load.
int64_t WindowOf(const nlohmann::json& config, int64_t layer_index) {
  absl::StatusOr<Model> model = ParseHf(config, {{"layer_index", std::to_string(layer_index)}});
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? model->terms.sliding_window : -1;
}

// `config` with `changes` merged in (a null value removes the key).
nlohmann::json With(nlohmann::json config, const nlohmann::json& changes) {
  config.merge_patch(changes);
  return config;
}

TEST(ModelLoaderTest, LoadsHfLayerWithGroupedHeadsAndDefaultRotary) {
  absl::StatusOr<Model> model = ParseHf(HfConfig());
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->kind, Kind::kMultiHead);
  EXPECT_EQ(model->num_heads, 4);
  EXPECT_EQ(model->num_kv_heads, 2);
  EXPECT_EQ(model->head_size, 4);
  EXPECT_EQ(model->query_size, 16);
  EXPECT_EQ(model->key_size, 16);
  EXPECT_EQ(model->value_size, 16);
  EXPECT_EQ(model->output_size, 16);
  ExpectMatrix(model->w_q, 16, 16, Sequence(256));
  ExpectMatrix(model->w_k, 8, 16, Sequence(128, 1000));
  ExpectMatrix(model->w_v, 8, 16, Sequence(128, 2000));
  ExpectMatrix(model->w_o, 16, 16, Sequence(256, 3000));
  // Llama has no biases: each is zero.
  ExpectVector(model->b_q, std::vector<float>(16, 0.0f));
  ExpectVector(model->b_k, std::vector<float>(8, 0.0f));
  ExpectVector(model->b_v, std::vector<float>(8, 0.0f));
  ExpectVector(model->b_o, std::vector<float>(16, 0.0f));
  const LayerTerms& terms = model->terms;
  EXPECT_EQ(terms.rotary.type, "default");
  EXPECT_EQ(terms.rotary.dims, 4);
  EXPECT_FALSE(terms.rotary.interleaved);
  EXPECT_EQ(terms.rotary.theta, 10000.0);
  EXPECT_EQ(terms.rotary.attention_factor, 1.0);
  ASSERT_EQ(terms.rotary.inv_freq.size(), 2u);
  EXPECT_DOUBLE_EQ(terms.rotary.inv_freq[0], 1.0);
  EXPECT_DOUBLE_EQ(terms.rotary.inv_freq[1], 0.01);  // 10000^(-2/4)
  EXPECT_EQ(terms.sliding_window, 0);
  EXPECT_EQ(terms.softcap, 0.0f);
  EXPECT_EQ(terms.scale, 0.0f);  // 1/sqrt(head_dim)
  EXPECT_EQ(terms.norm_eps, 1e-6);
  EXPECT_TRUE(terms.q_norm.empty());
  EXPECT_TRUE(terms.k_norm.empty());
  EXPECT_TRUE(terms.sinks.empty());
  EXPECT_TRUE(terms.alibi_slopes.empty());
}

// Without head_dim, a head is hidden_size / num_attention_heads; kv heads
// default to the query heads.
TEST(ModelLoaderTest, HfLayerSizesDefaultFromHiddenSize) {
  const nlohmann::json config = With(HfConfig(), {{"head_dim", nullptr}, {"num_key_value_heads", nullptr}});
  absl::StatusOr<Model> model = ParseHf(config, {}, HfTensors(16, 16));
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->num_kv_heads, 4);
  EXPECT_EQ(model->head_size, 4);
}

// Each projection's bias is optional on its own (Qwen 2: q, k and v only);
// one absent is zero. qk-norm weights per head or over the projection, and
// sinks per head, are taken as given.
TEST(ModelLoaderTest, LoadsHfOptionalTensorsEachOnItsOwn) {
  std::vector<TensorBytes> tensors = HfTensors();
  tensors.push_back(Weight("q_proj.bias", {16}, 100));
  tensors.push_back(Weight("k_proj.bias", {8}, 200));
  tensors.push_back(Weight("v_proj.bias", {8}, 300));
  absl::StatusOr<Model> qwen2 = ParseHf(HfConfig(), {}, tensors);
  ASSERT_TRUE(qwen2.ok()) << qwen2.status();
  ExpectVector(qwen2->b_q, Sequence(16, 100));
  ExpectVector(qwen2->b_k, Sequence(8, 200));
  ExpectVector(qwen2->b_v, Sequence(8, 300));
  ExpectVector(qwen2->b_o, std::vector<float>(16, 0.0f));

  tensors = HfTensors();
  tensors.push_back(Weight("o_proj.bias", {16}, 400));
  tensors.push_back(Weight("q_norm.weight", {4}, 10));
  tensors.push_back(Weight("k_norm.weight", {4}, 20));
  tensors.push_back(Weight("sinks", {4}, -2));
  absl::StatusOr<Model> per_head = ParseHf(HfConfig(), {}, tensors);
  ASSERT_TRUE(per_head.ok()) << per_head.status();
  ExpectVector(per_head->b_q, std::vector<float>(16, 0.0f));
  ExpectVector(per_head->b_o, Sequence(16, 400));
  EXPECT_EQ(per_head->terms.q_norm, Sequence(4, 10));
  EXPECT_EQ(per_head->terms.k_norm, Sequence(4, 20));
  EXPECT_EQ(per_head->terms.sinks, Sequence(4, -2));

  tensors = HfTensors();
  tensors.push_back(Weight("q_norm.weight", {16}, 10));
  tensors.push_back(Weight("k_norm.weight", {8}, 20));
  absl::StatusOr<Model> flat = ParseHf(With(HfConfig(), {{"rms_norm_eps", 1e-5}}), {}, tensors);
  ASSERT_TRUE(flat.ok()) << flat.status();
  EXPECT_EQ(flat->terms.q_norm, Sequence(16, 10));
  EXPECT_EQ(flat->terms.k_norm, Sequence(8, 20));
  EXPECT_EQ(flat->terms.norm_eps, 1e-5);
}

TEST(ModelLoaderTest, HfWindowOnEveryLayerByDefault) {
  const nlohmann::json mistral = With(HfConfig(), {{"model_type", "mistral"}, {"sliding_window", 4}});
  for (int64_t layer : {0, 1, 5, 31}) EXPECT_EQ(WindowOf(mistral, layer), 4) << layer;
  // Mistral v0.2 and later write "sliding_window": null: no window.
  EXPECT_EQ(WindowOf(With(mistral, {{"sliding_window", nullptr}}), 3), 0);
  EXPECT_EQ(WindowOf(HfConfig(), 3), 0);
  // No layer_index: layer 0.
  absl::StatusOr<Model> model = ParseHf(mistral);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->terms.sliding_window, 4);
}

TEST(ModelLoaderTest, HfWindowOnQwenLayersFromMaxWindowLayers) {
  for (const char* type : {"qwen2", "qwen3", "qwen2_moe"}) {
    SCOPED_TRACE(type);
    const nlohmann::json qwen = With(HfConfig(), {{"model_type", type},
                                                  {"sliding_window", 8},
                                                  {"use_sliding_window", true},
                                                  {"max_window_layers", 2}});
    EXPECT_EQ(WindowOf(qwen, 0), 0);
    EXPECT_EQ(WindowOf(qwen, 1), 0);
    EXPECT_EQ(WindowOf(qwen, 2), 8);
    EXPECT_EQ(WindowOf(qwen, 7), 8);
    // Qwen's released configs carry a sliding_window with the flag off.
    const nlohmann::json off = With(qwen, {{"use_sliding_window", false}});
    EXPECT_EQ(WindowOf(off, 2), 0);
    EXPECT_EQ(WindowOf(With(qwen, {{"use_sliding_window", nullptr}}), 2), 0);
  }
}

TEST(ModelLoaderTest, HfWindowOnGemma2EvenLayers) {
  const nlohmann::json gemma2 = With(HfConfig(), {{"model_type", "gemma2"}, {"sliding_window", 4}});
  EXPECT_EQ(WindowOf(gemma2, 0), 4);
  EXPECT_EQ(WindowOf(gemma2, 1), 0);
  EXPECT_EQ(WindowOf(gemma2, 2), 4);
  EXPECT_EQ(WindowOf(gemma2, 25), 0);
}

// layer_types, where the config has it, decides for every model type.
TEST(ModelLoaderTest, HfWindowFromLayerTypes) {
  const nlohmann::json types = {"sliding_attention", "full_attention", "full_attention",
                                "sliding_attention"};
  for (const char* type : {"gpt_oss", "gemma2", "qwen3", "mistral"}) {
    SCOPED_TRACE(type);
    const nlohmann::json config = With(HfConfig(), {{"model_type", type},
                                                    {"sliding_window", 6},
                                                    {"use_sliding_window", false},
                                                    {"layer_types", types}});
    EXPECT_EQ(WindowOf(config, 0), 6);
    EXPECT_EQ(WindowOf(config, 1), 0);
    EXPECT_EQ(WindowOf(config, 2), 0);
    EXPECT_EQ(WindowOf(config, 3), 6);
  }
}

TEST(ModelLoaderTest, HfScaleFromQueryPreAttnScalarAndSoftcap) {
  absl::StatusOr<Model> gemma2 = ParseHf(With(HfConfig(), {{"model_type", "gemma2"},
                                                           {"query_pre_attn_scalar", 256},
                                                           {"attn_logit_softcapping", 50.0}}));
  ASSERT_TRUE(gemma2.ok()) << gemma2.status();
  EXPECT_EQ(gemma2->terms.scale, 1.0f / 16);
  EXPECT_EQ(gemma2->terms.softcap, 50.0f);
  // Gemma 2's attn_logit_softcapping may be null: no soft-cap.
  absl::StatusOr<Model> uncapped =
      ParseHf(With(HfConfig(), {{"query_pre_attn_scalar", 2}, {"attn_logit_softcapping", nullptr}}));
  ASSERT_TRUE(uncapped.ok()) << uncapped.status();
  EXPECT_FLOAT_EQ(uncapped->terms.scale, 1.0f / std::sqrt(2.0f));
  EXPECT_EQ(uncapped->terms.softcap, 0.0f);
}

// transformers v5 writes rope_parameters (with rope_theta inside) where v4
// wrote rope_theta and rope_scaling: both give the same rotary.
TEST(ModelLoaderTest, HfRopeParametersEqualRopeScaling) {
  const nlohmann::json llama3 = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                                 {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 64}};
  const nlohmann::json yarn = {{"rope_type", "yarn"}, {"factor", 32.0}, {"beta_fast", 32.0},
                               {"beta_slow", 1.0}, {"original_max_position_embeddings", 4096},
                               {"truncate", false}};
  const nlohmann::json linear = {{"rope_type", "linear"}, {"factor", 4.0}};
  for (const nlohmann::json& scaling : {llama3, yarn, linear, nlohmann::json{{"rope_type", "default"}}}) {
    SCOPED_TRACE(scaling.dump());
    const nlohmann::json base = With(HfConfig(), {{"head_dim", 4}, {"max_position_embeddings", 131072}});
    const nlohmann::json v4 = With(base, {{"rope_theta", 500000.0}, {"rope_scaling", scaling}});
    const nlohmann::json v5 = With(base, {{"rope_parameters", With(scaling, {{"rope_theta", 500000.0}})}});
    absl::StatusOr<Model> old_form = ParseHf(v4);
    absl::StatusOr<Model> new_form = ParseHf(v5);
    ASSERT_TRUE(old_form.ok()) << old_form.status();
    ASSERT_TRUE(new_form.ok()) << new_form.status();
    const RotaryEmbedding& a = old_form->terms.rotary;
    const RotaryEmbedding& b = new_form->terms.rotary;
    EXPECT_EQ(a.type, scaling["rope_type"].get<std::string>());
    EXPECT_EQ(a.type, b.type);
    EXPECT_EQ(a.theta, 500000.0);
    EXPECT_EQ(b.theta, 500000.0);
    EXPECT_EQ(a.dims, b.dims);
    EXPECT_EQ(a.inv_freq, b.inv_freq);
    EXPECT_EQ(a.attention_factor, b.attention_factor);
  }
  // Scaling changes the frequencies (or the test above compares nothing).
  absl::StatusOr<Model> plain = ParseHf(With(HfConfig(), {{"rope_theta", 500000.0}}));
  absl::StatusOr<Model> scaled =
      ParseHf(With(HfConfig(), {{"rope_theta", 500000.0}, {"rope_scaling", linear}}));
  ASSERT_TRUE(plain.ok() && scaled.ok());
  EXPECT_DOUBLE_EQ(scaled->terms.rotary.inv_freq[1], plain->terms.rotary.inv_freq[1] / 4);
}

// v5's rope_parameters per layer type: the layer's own entry.
TEST(ModelLoaderTest, HfRopeParametersPerLayerType) {
  const nlohmann::json config = With(
      HfConfig(), {{"sliding_window", 4},
                   {"layer_types", nlohmann::json::array({"sliding_attention", "full_attention"})},
                   {"rope_parameters",
                    {{"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10000.0}}},
                     {"full_attention",
                      {{"rope_type", "linear"}, {"factor", 8.0}, {"rope_theta", 1000000.0}}}}}});
  absl::StatusOr<Model> local = ParseHf(config, {{"layer_index", "0"}});
  absl::StatusOr<Model> global = ParseHf(config, {{"layer_index", "1"}});
  ASSERT_TRUE(local.ok()) << local.status();
  ASSERT_TRUE(global.ok()) << global.status();
  EXPECT_EQ(local->terms.rotary.type, "default");
  EXPECT_EQ(local->terms.rotary.theta, 10000.0);
  EXPECT_EQ(local->terms.sliding_window, 4);
  EXPECT_EQ(global->terms.rotary.type, "linear");
  EXPECT_EQ(global->terms.rotary.theta, 1000000.0);
  EXPECT_EQ(global->terms.sliding_window, 0);
}

TEST(ModelLoaderTest, HfMetadataFlagsAndAgreeingNumHeads) {
  absl::StatusOr<Model> model = ParseHf(
      With(HfConfig(), {{"partial_rotary_factor", 0.5}}),
      {{"rope_interleaved", "true"}, {"num_heads", "4"}, {"layer_index", "3"}, {"format", "pt"}});
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_TRUE(model->terms.rotary.interleaved);
  EXPECT_EQ(model->terms.rotary.dims, 2);
  absl::StatusOr<Model> alibi = ParseHf(HfConfig(), {{"alibi", "true"}});
  ASSERT_TRUE(alibi.ok()) << alibi.status();
  EXPECT_EQ(alibi->terms.alibi_slopes, AlibiSlopes(4));
  EXPECT_EQ(alibi->terms.rotary.dims, 0);
}

TEST(ModelLoaderTest, RejectsHfRopeTheEngineDoesNotCompute) {
  for (const char* type : {"dynamic", "longrope", "su", "ntk"}) {
    const std::string expected =
        "rope_type\" is \"" + std::string(type) + "\", expected default, linear, llama3 or yarn";
    ExpectInvalid(ParseHf(With(HfConfig(), {{"rope_scaling", {{"rope_type", type}, {"factor", 2.0}}}})),
                  "hf", "config \"rope_scaling." + expected);
    // transformers v4's older key "type", and v5's rope_parameters, each
    // named as the config spells it.
    ExpectInvalid(ParseHf(With(HfConfig(), {{"rope_scaling", {{"type", type}, {"factor", 2.0}}}})), "hf",
                  "config \"rope_scaling.type\" is \"" + std::string(type) + "\", expected default");
    ExpectInvalid(ParseHf(With(HfConfig(), {{"rope_parameters", {{"rope_type", type}, {"factor", 2.0}}}})),
                  "hf", "config \"rope_parameters." + expected);
  }
  ExpectInvalid(ParseHf(With(HfConfig(), {{"rope_scaling", {{"rope_type", "dynamic"}}}})), "hf",
                "(dynamic and longrope scale with the sequence's length");
  ExpectInvalid(ParseHf(With(HfConfig(), {{"rope_scaling", {{"rope_type", 3}}}})), "hf",
                "config \"rope_scaling.rope_type\" is 3, expected default");
  ExpectInvalid(ParseHf(With(HfConfig(), {{"rope_scaling", "linear"}})), "hf",
                "config \"rope_scaling\" is \"linear\", expected an object");
  ExpectInvalid(ParseHf(With(HfConfig(), {{"rope_theta", "big"}})), "hf",
                "config \"rope_theta\" is \"big\", expected a finite number");
}

TEST(ModelLoaderTest, RejectsHfHeadsNotAMultipleOfKvHeads) {
  ExpectInvalid(ParseHf(With(HfConfig(), {{"num_key_value_heads", 3}})), "hf",
                "config \"num_attention_heads\" 4 is not a multiple of \"num_key_value_heads\" 3");
  ExpectInvalid(ParseHf(With(HfConfig(), {{"num_key_value_heads", 0}})), "hf",
                "config \"num_key_value_heads\" is 0, expected an integer >= 1");
  ExpectInvalid(ParseHf(With(HfConfig(), {{"num_attention_heads", nullptr}})), "hf",
                "config has no \"num_attention_heads\"");
  ExpectInvalid(ParseHf(With(HfConfig(), {{"num_attention_heads", "4"}})), "hf",
                "config \"num_attention_heads\" is \"4\", expected an integer >= 1");
}

TEST(ModelLoaderTest, RejectsHfTensorsOfTheWrongShape) {
  const auto replaced = [](const std::string& name, std::vector<int64_t> shape) {
    std::vector<TensorBytes> tensors;
    for (TensorBytes& tensor : HfTensors()) {
      if (tensor.name != name) tensors.push_back(std::move(tensor));
    }
    tensors.push_back(Weight(name, std::move(shape)));
    return tensors;
  };
  ExpectInvalid(ParseHf(HfConfig(), {}, replaced("q_proj.weight", {12, 16})), "hf",
                "tensor 'q_proj.weight' has shape [12, 16], expected [16, hidden]");
  ExpectInvalid(ParseHf(HfConfig(), {}, replaced("q_proj.weight", {16, 12})), "hf",
                "tensor 'q_proj.weight' has 12 columns, but config \"hidden_size\" is 16");
  ExpectInvalid(ParseHf(HfConfig(), {}, replaced("k_proj.weight", {16, 16})), "hf",
                "tensor 'k_proj.weight' has shape [16, 16], expected [8, 16]");
  ExpectInvalid(ParseHf(HfConfig(), {}, replaced("v_proj.weight", {8, 15})), "hf",
                "tensor 'v_proj.weight' has shape [8, 15], expected [8, 16]");
  ExpectInvalid(ParseHf(HfConfig(), {}, replaced("o_proj.weight", {12, 16})), "hf",
                "tensor 'o_proj.weight' has shape [12, 16], expected [16, ");
  ExpectInvalid(ParseHf(HfConfig(), {}, replaced("o_proj.weight", {16, 8})), "hf",
                "tensor 'o_proj.weight' has 8 columns, expected H * head_dim = 16");

  const auto with = [](std::vector<TensorBytes> extra) {
    std::vector<TensorBytes> tensors = HfTensors();
    for (TensorBytes& tensor : extra) tensors.push_back(std::move(tensor));
    return tensors;
  };
  ExpectInvalid(ParseHf(HfConfig(), {}, with({Weight("q_proj.bias", {8})})), "hf",
                "tensor 'q_proj.bias' has shape [8], expected [16]");
  ExpectInvalid(ParseHf(HfConfig(), {}, with({Weight("q_norm.weight", {8})})), "hf",
                "tensor 'q_norm.weight' has shape [8], expected [16] or [4] (one head)");
  ExpectInvalid(ParseHf(HfConfig(), {}, with({Weight("k_norm.weight", {16})})), "hf",
                "tensor 'k_norm.weight' has shape [16], expected [8] or [4] (one head)");
  ExpectInvalid(ParseHf(HfConfig(), {}, with({Weight("q_norm.weight", {4, 4})})), "hf",
                "tensor 'q_norm.weight' has shape [4, 4], expected [16] or [4] (one head)");
  ExpectInvalid(ParseHf(HfConfig(), {}, with({Weight("sinks", {2})})), "hf",
                "tensor 'sinks' has shape [2], expected [4]");
  ExpectInvalid(ParseHf(HfConfig(), {}, with({Weight("qkv_proj.weight", {32, 16})})), "hf",
                "unexpected tensor 'qkv_proj.weight' with shape [32, 16] in a Hugging Face multi_head model");
  ExpectInvalid(ParseHf(HfConfig(), {}, with({Weight("rotary_emb.inv_freq", {2})})), "hf",
                "unexpected tensor 'rotary_emb.inv_freq'");
  std::vector<TensorBytes> no_k = HfTensors();
  no_k.erase(no_k.begin() + 1);
  ExpectInvalid(ParseHf(HfConfig(), {}, no_k), "hf",
                "missing tensor 'k_proj.weight' (expected shape [8, 16])");
}

TEST(ModelLoaderTest, RejectsHfMetadataWithoutAJsonConfig) {
  ExpectInvalid(Parse("hf", HfTensors(), {{"kind", "multi_head"}}), "hf",
                "needs __metadata__ \"config\": the model's config.json as a string");
  // The torch layout's key alone is not enough either.
  ExpectInvalid(Parse("hf", HfTensors(), {{"kind", "multi_head"}, {"num_heads", "4"}}), "hf",
                "needs __metadata__ \"config\"");
  for (const char* text : {"{\"num_attention_heads\": 4", "[4]", "4", "", "null"}) {
    ExpectInvalid(Parse("hf", HfTensors(), {{"kind", "multi_head"}, {"config", text}}), "hf",
                  "__metadata__ \"config\" is not a JSON object");
  }
}

TEST(ModelLoaderTest, RejectsHfNumHeadsDisagreeingWithTheConfig) {
  ExpectInvalid(ParseHf(HfConfig(), {{"num_heads", "8"}}), "hf",
                "__metadata__ \"num_heads\" is 8, but config \"num_attention_heads\" is 4");
  ExpectInvalid(ParseHf(HfConfig(), {{"num_heads", "four"}}), "hf",
                "__metadata__ \"num_heads\" is \"four\", expected a decimal integer >= 1");
}

TEST(ModelLoaderTest, RejectsHfLayerIndexBeyondLayerTypes) {
  const nlohmann::json config =
      With(HfConfig(), {{"sliding_window", 4},
                        {"layer_types", nlohmann::json::array({"sliding_attention", "full_attention"})}});
  ExpectInvalid(ParseHf(config, {{"layer_index", "2"}}), "hf",
                "config \"layer_types\" is [\"sliding_attention\",\"full_attention\"], expected an array "
                "of strings with an entry for layer_index 2");
  ExpectInvalid(ParseHf(With(config, {{"layer_types", "sliding_attention"}})), "hf",
                "config \"layer_types\" is \"sliding_attention\", expected an array");
  ExpectInvalid(ParseHf(config, {{"layer_index", "-1"}}), "hf",
                "__metadata__ \"layer_index\" is \"-1\", expected a decimal integer >= 0");
  ExpectInvalid(ParseHf(config, {{"rope_interleaved", "yes"}}), "hf",
                "__metadata__ \"rope_interleaved\" is \"yes\", expected true or false");
}

TEST(ModelLoaderTest, RejectsHfOddRotaryDims) {
  // head_dim 4 * 0.25 = 1, 6 * 0.5 = 3, 5 * 1 = 5: rotary turns pairs.
  ExpectInvalid(ParseHf(With(HfConfig(), {{"partial_rotary_factor", 0.25}})), "hf",
                "config: rotary dims head_dim * partial_rotary_factor = 1, expected an even number >= 2");
  const nlohmann::json six = With(HfConfig(), {{"head_dim", 6}, {"partial_rotary_factor", 0.5}});
  ExpectInvalid(ParseHf(six, {}, HfTensors(24, 12)), "hf",
                "rotary dims head_dim * partial_rotary_factor = 3");
  ExpectInvalid(ParseHf(With(HfConfig(), {{"partial_rotary_factor", 1.5}})), "hf",
                "config \"partial_rotary_factor\" is 1.5, expected a number in (0, 1]");
  // ALiBi needs no rotary, so its head_dim may be odd.
  ExpectInvalid(ParseHf(With(HfConfig(), {{"head_dim", 5}}), {}, HfTensors(20, 10)), "hf",
                "rotary dims head_dim * partial_rotary_factor = 5");
  EXPECT_TRUE(ParseHf(With(HfConfig(), {{"head_dim", 5}}), {{"alibi", "true"}}, HfTensors(20, 10)).ok());
}

}  // namespace
}  // namespace attention
