// conformance_test.cc: every case of a conformance directory through the engine.
//
// The directory is $ATTENTION_CONFORMANCE_DIR, or the in-repo copy
// tests/conformance. cases/*.json and layers/cases/*.json (Hugging Face's
// layouts, models in layers/models) must match the expected output and
// weights within each case's atol + rtol * |expected|; every errors.json entry
// must be refused with its code (NOT_FOUND for an unknown model, otherwise
// INVALID_ARGUMENT from validation). The causal layer cases run as decoding
// sessions too: a prefill, then one-token steps, whose outputs are the
// case's. The last line printed is `conformance: N/M cases pass`.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/engine/engine.h"
#include "core/model/model_loader.h"
#include "core/sessions/session.h"
#include "tests/support/files.h"

namespace attention {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

fs::path ConformanceDir() {
  const char* dir = std::getenv("ATTENTION_CONFORMANCE_DIR");
  return dir && *dir ? fs::path(dir) : fs::path(ATTENTION_SOURCE_DIR) / "tests" / "conformance";
}

using attention::testing::ReadJson;

// A float from proto3 JSON: a number, or "NaN" / "Infinity" / "-Infinity".
float JsonFloat(const json& value) {
  if (value.is_string()) {
    const auto& s = value.get_ref<const std::string&>();
    if (s == "NaN") return std::nanf("");
    if (s == "Infinity") return INFINITY;
    if (s == "-Infinity") return -INFINITY;
    return std::stof(s);
  }
  return static_cast<float>(value.get<double>());
}

Tensor JsonTensor(const json& tensor) {
  Tensor t;
  for (const json& dim : tensor.value("shape", json::array())) {
    t.shape.push_back(dim.is_string() ? std::stoll(dim.get<std::string>()) : dim.get<int64_t>());
  }
  for (const json& value : tensor.value("data", json::array())) t.data.push_back(JsonFloat(value));
  return t;
}

// Owns the tensors an AttentionRequest views.
struct ParsedRequest {
  std::string model;
  Tensor queries;
  std::optional<Tensor> keys, values;
  std::vector<int32_t> valid_lens;
  std::vector<int64_t> position_ids;
  AttentionRequest request;

  explicit ParsedRequest(const json& j) {
    model = j.value("model", "");
    if (j.contains("queries")) queries = JsonTensor(j["queries"]);
    if (j.contains("keys")) keys = JsonTensor(j["keys"]);
    if (j.contains("values")) values = JsonTensor(j["values"]);
    for (const json& len : j.value("valid_lens", json::array())) valid_lens.push_back(len.get<int32_t>());
    request.queries = queries.view();
    if (keys) request.keys = keys->view();
    if (values) request.values = values->view();
    request.valid_lens = valid_lens;
    for (const json& id : j.value("position_ids", json::array())) {
      position_ids.push_back(id.is_string() ? std::stoll(id.get<std::string>()) : id.get<int64_t>());
    }
    request.position_ids = position_ids;
    request.causal = j.value("causal", false);
    request.return_attention_weights = j.value("return_attention_weights", false);
    if (j.contains("scale")) request.scale = JsonFloat(j["scale"]);
  }
};

// The repository of a conformance directory: built-ins plus models/*.safetensors.
const std::map<std::string, Model>& Models() {
  static const auto* models = [] {
    auto* m = new std::map<std::string, Model>;
    (*m)["dot_product"] = DotProductModel();
    (*m)["distance"] = DistanceModel();
    for (const fs::path& dir : {ConformanceDir() / "models", ConformanceDir() / "layers" / "models"}) {
      if (!fs::is_directory(dir)) continue;
      for (const auto& entry : fs::directory_iterator(dir)) {
        if (entry.path().extension() != ".safetensors") continue;
        absl::StatusOr<Model> model = LoadModel(entry.path());
        if (!model.ok()) {
          ADD_FAILURE() << model.status();
          continue;
        }
        (*m)[model->name] = *std::move(model);
      }
    }
    return m;
  }();
  return *models;
}

const Model* FindModel(const std::string& name) {
  auto it = Models().find(name);
  return it == Models().end() ? nullptr : &it->second;
}

Engine& SharedEngine() {
  static auto* engine = new Engine;
  return *engine;
}

std::string TestName(std::string name) {
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

void ExpectClose(const Tensor& actual, const json& expected_json, double atol, double rtol,
                 const std::string& what) {
  const Tensor expected = JsonTensor(expected_json);
  ASSERT_EQ(actual.shape, expected.shape) << what << " shape";
  ASSERT_EQ(actual.data.size(), expected.data.size()) << what << " size";
  int reported = 0;
  for (size_t i = 0; i < expected.data.size(); ++i) {
    const double diff = std::abs(double{actual.data[i]} - expected.data[i]);
    if (diff > atol + rtol * std::abs(double{expected.data[i]}) && reported++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: expected " << expected.data[i] << ", got "
                    << actual.data[i];
    }
  }
}

std::vector<fs::path> CaseFiles() {
  std::vector<fs::path> files;
  for (const fs::path& dir : {ConformanceDir() / "cases", ConformanceDir() / "layers" / "cases"}) {
    if (!fs::is_directory(dir)) continue;
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.path().extension() == ".json") files.push_back(entry.path());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

// The layer cases a session can replay: causal, every example whole, the
// positions a session gives (0, 1, ...).
std::vector<fs::path> SessionCaseFiles() {
  std::vector<fs::path> files;
  for (const fs::path& file : CaseFiles()) {
    if (file.parent_path().parent_path().filename() != "layers") continue;
    const json request = ReadJson(file)["request"];
    if (request.value("causal", false) && !request.contains("valid_lens") &&
        !request.contains("position_ids")) {
      files.push_back(file);
    }
  }
  return files;
}

std::vector<json> ErrorCases() {
  const fs::path file = ConformanceDir() / "errors.json";
  if (!fs::exists(file)) return {};
  json errors = ReadJson(file);
  return errors.is_array() ? errors.get<std::vector<json>>() : std::vector<json>{};
}

TEST(CaseDirectory, HasCasesAndErrors) {
  EXPECT_FALSE(CaseFiles().empty()) << ConformanceDir();
  EXPECT_FALSE(ErrorCases().empty()) << ConformanceDir();
}

class ConformanceCase : public ::testing::TestWithParam<fs::path> {};

TEST_P(ConformanceCase, MatchesPyTorch) {
  const json c = ReadJson(GetParam());
  ParsedRequest parsed(c["request"]);
  const Model* model = FindModel(parsed.model);
  ASSERT_NE(model, nullptr) << "unknown model " << parsed.model;
  absl::StatusOr<AttentionResult> result = SharedEngine().Attend(*model, parsed.request);
  ASSERT_TRUE(result.ok()) << result.status();
  const double atol = c.value("atol", 1e-5), rtol = c.value("rtol", 1e-4);
  ExpectClose(result->output, c["expected"]["output"], atol, rtol, "output");
  if (c["expected"].contains("attention_weights")) {
    ExpectClose(result->attention_weights, c["expected"]["attention_weights"], atol, rtol,
                "attention_weights");
  }
}

INSTANTIATE_TEST_SUITE_P(Conformance, ConformanceCase, ::testing::ValuesIn(CaseFiles()),
                         [](const auto& info) { return TestName(info.param.stem().string()); });

// A case's request as a self session: the first rows as one prefill step,
// then one step per row; each step's output rows are the case's.
class ConformanceSession : public ::testing::TestWithParam<fs::path> {};

TEST_P(ConformanceSession, StepsMatchTheWholePrefix) {
  const json c = ReadJson(GetParam());
  ParsedRequest parsed(c["request"]);
  const Model* model = FindModel(parsed.model);
  ASSERT_NE(model, nullptr) << "unknown model " << parsed.model;
  const std::vector<int64_t>& shape = parsed.queries.shape;
  const int64_t batch = shape[0], n = shape[1], width = shape[2];
  const Tensor expected = JsonTensor(c["expected"]["output"]);
  const int64_t out_width = expected.shape[2];
  KvBlockPool pool(int64_t{1} << 24);
  absl::StatusOr<std::unique_ptr<Session>> session = Session::Open(
      std::make_shared<Model>(*model), pool, {.memory = SessionMemory::kSelf, .batch = batch});
  ASSERT_TRUE(session.ok()) << session.status();
  const double atol = c.value("atol", 1e-5), rtol = c.value("rtol", 1e-4);
  const int64_t prefill = std::min<int64_t>(3, n);
  for (int64_t begin = 0; begin < n;) {
    const int64_t rows = begin == 0 ? prefill : 1;
    Tensor queries;
    queries.shape = {batch, rows, width};
    for (int64_t b = 0; b < batch; ++b) {
      const auto first = parsed.queries.data.begin() + (b * n + begin) * width;
      queries.data.insert(queries.data.end(), first, first + rows * width);
    }
    SessionStep step{.queries = queries.view()};
    absl::StatusOr<ValidatedStep> validated = ValidateStep(**session, step);
    ASSERT_TRUE(validated.ok()) << validated.status();
    AttentionResult result;
    SharedEngine().RunSteps({&*validated, 1}, {&result, 1});
    ASSERT_TRUE(result.status.ok()) << result.status;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < rows * out_width; ++i) {
        const double want = expected.data[(b * n + begin) * out_width + i];
        const double got = result.output.data[b * rows * out_width + i];
        ASSERT_LE(std::abs(got - want), atol + rtol * std::abs(want))
            << "example " << b << " row " << begin + i / out_width << " column " << i % out_width;
      }
    }
    begin += rows;
  }
}

INSTANTIATE_TEST_SUITE_P(Conformance, ConformanceSession, ::testing::ValuesIn(SessionCaseFiles()),
                         [](const auto& info) { return TestName(info.param.stem().string()); });

class ConformanceError : public ::testing::TestWithParam<json> {};

TEST_P(ConformanceError, IsRefusedWithItsCode) {
  const json& e = GetParam();
  ParsedRequest parsed(e["request"]);
  const Model* model = FindModel(parsed.model);
  if (model == nullptr) {
    // Which models exist is the server's to say: server_conformance_test
    // sends this entry and checks its code.
    GTEST_SKIP() << "no model '" << parsed.model << "' in the core; checked over gRPC";
  }
  absl::StatusOr<AttentionDims> dims = Validate(*model, parsed.request);
  const std::string code = dims.ok() ? "OK" : absl::StatusCodeToString(dims.status().code());
  EXPECT_EQ(code, e.value("expected_code", "")) << dims.status();
  EXPECT_FALSE(dims.ok()) << "an error case was accepted";
}

INSTANTIATE_TEST_SUITE_P(Conformance, ConformanceError, ::testing::ValuesIn(ErrorCases()),
                         [](const auto& info) { return TestName(info.param.value("name", "")); });

// Counts conformance tests as they end, for the summary line.
class CaseCounter : public ::testing::EmptyTestEventListener {
 public:
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (std::string(info.test_suite_name()).find("Conformance") == std::string::npos) return;
    if (info.result()->Skipped()) {
      ++skipped;
      return;
    }
    ++run;
    if (info.result()->Passed()) ++passed;
  }
  int run = 0, passed = 0, skipped = 0;
};

}  // namespace
}  // namespace attention

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto* counter = new attention::CaseCounter;  // owned by the listener list
  ::testing::UnitTest::GetInstance()->listeners().Append(counter);
  const int status = RUN_ALL_TESTS();
  std::cout << "conformance: " << counter->passed << "/" << counter->run << " cases pass, "
            << counter->skipped << " left to server_conformance_test" << std::endl;
  return status;
}
