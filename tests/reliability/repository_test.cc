// repository_test.cc: a model repository full of broken files.
//
// Next to two good models: an empty file, a truncated copy of a good model,
// garbage, a header length beyond the file, NaN weights, a directory, a
// dangling symlink, a symlink loop, a named pipe (a naive reader would block
// on it forever), a symlink to /dev/zero, a non-model file, and every
// hand-made hostile model file of tests/fuzz/regressions. The server starts,
// serves exactly the good models (answering them correctly), names every
// bad file in its log with a reason, answers NOT_FOUND for them, and with
// --strict refuses to start.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "core/model/model_loader.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "tests/support/files.h"
#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// A safetensors file from its header text and data bytes.
std::string Safetensors(const std::string& header, const std::string& data) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return bytes + header + data;
}

class FaultRepositoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const fs::path repo = dir_.path();
    const fs::path models = ConformanceDir() / "models";
    fs::copy_file(models / "bilinear_small.safetensors", repo / "good_bilinear.safetensors");
    fs::copy_file(models / "mh_torch_small.safetensors", repo / "good_multi_head.safetensors");
    good_ = {"good_bilinear", "good_multi_head"};

    const std::string model = ReadFile(models / "mh_torch_small.safetensors");
    Bad("empty", "");
    Bad("truncated", model.substr(0, model.size() / 2));
    Bad("garbage", "\x89PNG\r\n\x1a\n this is not a model at all");
    Bad("header_beyond_file", Safetensors(std::string(64, ' '), "").substr(0, 40));
    Bad("no_kind", Safetensors(R"({"W_k.weight": {"dtype": "F32", "shape": [1, 1], "data_offsets": [0, 4]}})",
                               std::string(4, '\0')));
    // F16 0x7E00 is NaN.
    Bad("nan_weight", Safetensors(R"({"__metadata__": {"kind": "bilinear"}, )"
                                  R"("W_k.weight": {"dtype": "F16", "shape": [1, 1], "data_offsets": [0, 2]}})",
                                  std::string("\x00\x7e", 2)));
    fs::create_directory(repo / "a_directory.safetensors");
    bad_.push_back("a_directory");
    fs::create_symlink(repo / "no_such_target", repo / "dangling.safetensors");
    bad_.push_back("dangling");
    fs::create_symlink(repo / "loop_b.safetensors", repo / "loop_a.safetensors");
    fs::create_symlink(repo / "loop_a.safetensors", repo / "loop_b.safetensors");
    bad_.insert(bad_.end(), {"loop_a", "loop_b"});
    ASSERT_EQ(mkfifo((repo / "named_pipe.safetensors").c_str(), 0600), 0);
    bad_.push_back("named_pipe");
    fs::create_symlink("/dev/zero", repo / "endless.safetensors");
    bad_.push_back("endless");
    WriteFile(repo / "README.txt", "not a model: ignored without a word");

    // The hostile files are judged by the loader itself: the point here is
    // that the server agrees with it and survives every one.
    for (const auto& entry : fs::directory_iterator(
             fs::path(ATTENTION_SOURCE_DIR) / "tests" / "fuzz" / "regressions" / "model_file")) {
      const std::string name = entry.path().stem().string();
      if (!name.starts_with("hostile-")) continue;
      const std::string stem = "fuzz_" + name.substr(8);
      fs::copy_file(entry.path(), repo / (stem + ".safetensors"));
      (LoadModel(repo / (stem + ".safetensors")).ok() ? good_ : bad_).push_back(stem);
    }
  }

  void Bad(const std::string& name, const std::string& bytes) {
    WriteFile(dir_.path() / (name + ".safetensors"), bytes);
    bad_.push_back(name);
  }

  TempDir dir_;
  std::vector<std::string> good_, bad_;
};

TEST_F(FaultRepositoryTest, ServesTheGoodModelsAndNamesEveryBadFile) {
  auto server = ServerProcess::Start({"--model-repository", dir_.path().string()});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();

  grpc::ClientContext list_context;
  v1::ListModelsResponse list;
  ASSERT_TRUE(stub->ListModels(&list_context, v1::ListModelsRequest(), &list).ok());
  std::set<std::string> served;
  for (const auto& model : list.models()) served.insert(model.name());
  std::set<std::string> expected(good_.begin(), good_.end());
  expected.insert({"dot_product", "distance"});
  EXPECT_EQ(served, expected);

  for (const std::string& name : bad_) {
    v1::AttendRequest request = SelfAttentionRequest(1, 2, 2, 0);
    request.set_model(name);
    grpc::ClientContext context;
    v1::AttendResponse response;
    EXPECT_EQ(stub->Attend(&context, request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND)
        << name;
  }

  // A good model answers as its conformance case says.
  const nlohmann::json case_json = nlohmann::json::parse(
      ReadFile(ConformanceDir() / "cases" / "bilinear_valid_lens_1d.json"));
  v1::AttendRequest request;
  ASSERT_TRUE(
      google::protobuf::util::JsonStringToMessage(case_json.at("request").dump(), &request).ok());
  request.set_model("good_bilinear");
  grpc::ClientContext context;
  v1::AttendResponse response;
  ASSERT_TRUE(stub->Attend(&context, request, &response).ok());
  const std::vector<float> expected_output = case_json.at("expected").at("output").at("data");
  ASSERT_EQ(response.output().data_size(), static_cast<int>(expected_output.size()));
  for (size_t i = 0; i < expected_output.size(); ++i) {
    EXPECT_NEAR(response.output().data(static_cast<int>(i)), expected_output[i],
                1e-5 + 1e-4 * std::abs(expected_output[i]))
        << "output[" << i << "]";
  }
  EXPECT_EQ(HealthStatus((*server)->Channel()), "SERVING");
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0);

  const std::string log = (*server)->Log();
  for (const std::string& name : bad_) {
    EXPECT_THAT(log, HasSubstr("model skipped: " + (dir_.path() / name).string() + ".safetensors: "))
        << name << " is not reported with its reason";
  }
  EXPECT_THAT(log, ::testing::Not(HasSubstr("README")));
}

TEST_F(FaultRepositoryTest, StrictRefusesToStartAndNamesABadFile) {
  std::string output;
  const int code = ServerProcess::RunToExit({"--address", "127.0.0.1:0", "--metrics-address", "",
                                             "--model-repository", dir_.path().string(), "--strict"},
                                            {}, &output);
  EXPECT_NE(code, 0);
  bool named = false;
  for (const std::string& name : bad_) named |= output.find(name + ".safetensors") != std::string::npos;
  EXPECT_TRUE(named) << output;
}

}  // namespace
}  // namespace attention::testing
