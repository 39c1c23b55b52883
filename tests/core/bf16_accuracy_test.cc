// bf16_accuracy_test.cc: the accuracy contract of bf16 models (docs/api.md
// 5.5) against an independent reference. Each case of tests/bf16/cases (made
// by tools/make_bf16_cases.py: the multi_head conformance cases and random
// draws at tile edges, with and without masks) holds a model, a request, the
// float64 answer and the error PyTorch 1.13 makes running the same model in
// torch.bfloat16. A bf16 model's answer must stay within twice that error,
// and within PyTorch's BF16 tolerance (atol = rtol = 5e-2). ctest runs it
// once per path (core_bf16_accuracy_test/<isa>): on a host with AVX512_BF16
// the avx512 run is the fallback that widens BF16-held weights to FP32.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "core/engine/engine.h"
#include "core/model/model.h"
#include "core/model/safetensors.h"
#include "tests/support/files.h"

namespace attention {
namespace {

namespace fs = std::filesystem;

constexpr double kTorchTolerance = 5e-2;

struct Case {
  std::string name;
  Model model;
  Tensor queries;
  std::optional<Tensor> keys, values;
  Tensor expected;
  std::vector<int32_t> valid_lens;
  bool causal = false;
  std::optional<float> scale;
  double torch_bf16_error = 0;
};

const std::string& Meta(const SafetensorsFile& file, const std::string& key) {
  return file.metadata.at(key);
}

Case ReadCase(const fs::path& path) {
  const std::string bytes = testing::ReadFile(path);
  absl::StatusOr<SafetensorsFile> file = ParseSafetensors(
      {reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()});
  EXPECT_TRUE(file.ok()) << path << ": " << file.status();
  Case c;
  c.name = path.stem().string();
  auto& t = file->tensors;
  const auto matrix = [&](const char* name) {
    const Tensor& w = t.at(name);
    return RowMatrix(Eigen::Map<const RowMatrix>(w.data.data(), w.shape[0], w.shape[1]));
  };
  const auto vector = [&](const char* name) {
    return Vector(Eigen::Map<const Vector>(t.at(name).data.data(), t.at(name).shape[0]));
  };
  Model& m = c.model;
  m.name = c.name;
  m.kind = Kind::kMultiHead;
  m.num_heads = std::stoll(Meta(*file, "num_heads"));
  m.w_q = matrix("w_q");
  m.w_k = matrix("w_k");
  m.w_v = matrix("w_v");
  m.w_o = matrix("w_o");
  m.b_q = vector("b_q");
  m.b_k = vector("b_k");
  m.b_v = vector("b_v");
  m.b_o = vector("b_o");
  m.query_size = m.w_q.cols();
  m.key_size = m.w_k.cols();
  m.value_size = m.w_v.cols();
  m.output_size = m.w_o.rows();
  c.queries = t.at("queries");
  if (t.contains("keys")) c.keys = t.at("keys");
  if (t.contains("values")) c.values = t.at("values");
  c.expected = t.at("expected");
  for (absl::string_view len : absl::StrSplit(Meta(*file, "valid_lens"), ',', absl::SkipEmpty())) {
    int32_t value = 0;
    EXPECT_TRUE(absl::SimpleAtoi(len, &value)) << len;
    c.valid_lens.push_back(value);
  }
  c.causal = Meta(*file, "causal") == "1";
  if (!Meta(*file, "scale").empty()) c.scale = std::stof(Meta(*file, "scale"));
  c.torch_bf16_error = std::stod(Meta(*file, "torch_bf16_error"));
  return c;
}

std::vector<Case> ReadCases() {
  std::vector<fs::path> paths;
  for (const auto& entry : fs::directory_iterator(fs::path(ATTENTION_SOURCE_DIR) / "tests" /
                                                  "bf16" / "cases")) {
    if (entry.path().extension() == ".safetensors") paths.push_back(entry.path());
  }
  std::sort(paths.begin(), paths.end());
  std::vector<Case> cases;
  for (const fs::path& path : paths) cases.push_back(ReadCase(path));
  return cases;
}

// The case's answer from its model packed in `precision`.
std::vector<float> Answer(const Case& c, Precision precision) {
  Model model = c.model;
  model.precision = precision;
  PackProjections(model);
  AttentionRequest request{c.queries.view(), std::nullopt, std::nullopt, c.valid_lens, c.causal,
                           false, c.scale};
  if (c.keys) request.keys = c.keys->view();
  if (c.values) request.values = c.values->view();
  static Engine engine(EngineOptions{.num_threads = 2});
  absl::StatusOr<AttentionResult> result = engine.Attend(model, request);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? result->output.data : std::vector<float>(c.expected.data.size());
}

double MaxError(const std::vector<float>& answer, const std::vector<float>& expected) {
  double error = 0;
  for (size_t i = 0; i < answer.size(); ++i) {
    error = std::max(error, std::abs(double{answer[i]} - expected[i]));
  }
  return error;
}

TEST(Bf16AccuracyTest, EveryCaseWithinTwicePyTorchsBf16ErrorAndItsTolerance) {
  const std::vector<Case> cases = ReadCases();
  ASSERT_GE(cases.size(), 20u) << "run tools/make_bf16_cases.py";
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::vector<float> answer = Answer(c, Precision::kBf16);
    ASSERT_EQ(answer.size(), c.expected.data.size());
    const double error = MaxError(answer, c.expected.data);
    std::cout << c.name << ": bf16 error " << error << ", PyTorch bf16 " << c.torch_bf16_error
              << " (" << error / c.torch_bf16_error << "x)\n";
    EXPECT_LE(error, 2 * c.torch_bf16_error);
    for (size_t i = 0; i < answer.size(); ++i) {
      ASSERT_LE(std::abs(double{answer[i]} - c.expected.data[i]),
                kTorchTolerance + kTorchTolerance * std::abs(c.expected.data[i]))
          << "element " << i;
    }
  }
}

// The data's own check: the fp32 model of every case is far closer than
// any BF16 error, so the recorded answers are the reference's.
TEST(Bf16AccuracyTest, Fp32ModelsMatchTheReference) {
  for (const Case& c : ReadCases()) {
    SCOPED_TRACE(c.name);
    EXPECT_LE(MaxError(Answer(c, Precision::kFp32), c.expected.data), 1e-4);
  }
}

}  // namespace
}  // namespace attention
