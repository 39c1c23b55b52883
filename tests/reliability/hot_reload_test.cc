// hot_reload_test.cc: a model repository that changes while the server is
// under load (docs/api.md, section 5.4).
//
// Closed-loop load (16 calls in flight) on model `a` while a model `b`
// appears, `a`'s weights are replaced (answers switch, checked by value), `a`
// is replaced by a corrupt file (the previous weights keep serving, the
// failure counter rises) and `a` is removed (NOT_FOUND, but only once the
// calls in flight on it are answered): no call fails except those NOT_FOUND.
// Then: a file written slowly is not read before it is complete; versions
// side by side and the version policy, through attention.v1 and the Open
// Inference Protocol; explicit load and unload, refused without the token or
// with model control off; the CLI's load, unload and repository; and 100
// reloads of a 64 MB model leave the server's memory where one load left it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "attention.grpc.pb.h"
#include "inference/grpc_service.grpc.pb.h"
#include "tests/support/files.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/safetensors_builder.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

constexpr char kPoll[] = "0.5";
constexpr auto kPollPlusTwo = std::chrono::milliseconds(2500);

// A bilinear model whose W_k is `factor` x identity (2 x 2).
std::string BilinearBytes(float factor) {
  const std::vector<uint8_t> bytes = BuildFile(
      {F32Tensor("W_k.weight", {2, 2}, {factor, 0, 0, factor})}, {{"kind", "bilinear"}});
  return std::string(bytes.begin(), bytes.end());
}

// One query [1, 0] over keys [1, 0], [0, 1] with values equal to the keys:
// the scores are factor/sqrt(2) and 0, so output[0] is the logistic of
// factor/sqrt(2) and tells which weights answered.
v1::AttendRequest Probe(const std::string& model, std::optional<int64_t> version = std::nullopt) {
  v1::AttendRequest request;
  request.set_model(model);
  if (version) request.set_version(*version);
  for (int64_t size : {1, 1, 2}) request.mutable_queries()->add_shape(size);
  for (float value : {1.0f, 0.0f}) request.mutable_queries()->add_data(value);
  for (int64_t size : {1, 2, 2}) request.mutable_keys()->add_shape(size);
  for (float value : {1.0f, 0.0f, 0.0f, 1.0f}) request.mutable_keys()->add_data(value);
  return request;
}

float Expected(float factor) { return 1.0f / (1.0f + std::exp(-factor / std::sqrt(2.0f))); }

// The factor whose answer `output0` is (one of 1, 2, 3), or 0 for none.
int FactorOf(float output0) {
  for (int factor : {1, 2, 3}) {
    if (std::abs(output0 - Expected(static_cast<float>(factor))) < 1e-5) return factor;
  }
  return 0;
}

struct Reply {
  grpc::Status status;
  int factor = 0;
  int64_t version = 0;
};

Reply Attend(v1::AttentionService::Stub& stub, const v1::AttendRequest& request) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::AttendResponse response;
  Reply reply{stub.Attend(&context, request, &response)};
  if (reply.status.ok() && response.output().data_size() == 2) {
    reply.factor = FactorOf(response.output().data(0));
    reply.version = response.model_version();
  }
  return reply;
}

// Polls `probe` until it returns true or `limit` passes; the time it took.
std::optional<Clock::duration> Within(Clock::duration limit, const std::function<bool()>& probe) {
  const Clock::time_point start = Clock::now();
  while (Clock::now() - start < limit) {
    if (probe()) return Clock::now() - start;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return std::nullopt;
}

v1::ListModelsResponse ListModels(v1::AttentionService::Stub& stub, bool all = true) {
  grpc::ClientContext context;
  v1::ListModelsRequest request;
  request.set_include_unavailable(all);
  v1::ListModelsResponse response;
  EXPECT_TRUE(stub.ListModels(&context, request, &response).ok());
  return response;
}

const v1::ModelInfo* FindInfo(const v1::ListModelsResponse& list, const std::string& name) {
  for (const auto& model : list.models()) {
    if (model.name() == name) return &model;
  }
  return nullptr;
}

// What one load thread saw, in order.
struct Observed {
  std::vector<Reply> replies;
};

class LoadOn {
 public:
  LoadOn(const ServerProcess& server, const std::string& model, int calls_in_flight) {
    for (int i = 0; i < calls_in_flight; ++i) observed_.emplace_back(std::make_unique<Observed>());
    for (const auto& observed : observed_) {
      threads_.emplace_back([this, &server, model, seen = observed.get()] {
        auto stub = server.Stub();
        while (!stop_.load()) seen->replies.push_back(Attend(*stub, Probe(model)));
      });
    }
  }
  // Stops and returns what each thread saw.
  std::vector<std::unique_ptr<Observed>> Stop() {
    stop_.store(true);
    for (auto& thread : threads_) thread.join();
    threads_.clear();
    return std::move(observed_);
  }
  ~LoadOn() {
    if (!threads_.empty()) Stop();
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::unique_ptr<Observed>> observed_;
  std::vector<std::thread> threads_;
};

// A counter family is exported only once it has counted something, so an
// absent one reads 0 here (the first test sees it at 1, so a rename fails it).
double LoadFailures(const std::string& metrics_address, const std::string& model) {
  return MetricValue(ScrapeMetrics(metrics_address), "attention_model_load_failures_total",
                     {{"model", model}})
      .value_or(0);
}

TEST(HotReloadTest, ReplacesAddsAndRemovesModelsUnderLoadWithoutFailingACall) {
  TempDir repo;
  ReplaceFile(repo.path() / "a.safetensors", BilinearBytes(1));
  auto server = ServerProcess::Start({"--model-repository", repo.path().string(),
                                      "--repository-poll-seconds", kPoll});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();
  ASSERT_EQ(Attend(*stub, Probe("a")).factor, 1);

  LoadOn load(**server, "a", 16);

  // A new model is served within poll + 2 s.
  ReplaceFile(repo.path() / "b.safetensors", BilinearBytes(3));
  const auto b_served = Within(kPollPlusTwo, [&] { return Attend(*stub, Probe("b")).factor == 3; });
  EXPECT_TRUE(b_served) << "b not served within poll + 2 s";
  const std::string metrics = ScrapeMetrics((*server)->metrics_address());
  EXPECT_EQ(MetricValue(metrics, "attention_model_info",
                        {{"model", "b"}, {"version", "1"}, {"kind", "bilinear"}}),
            1);

  // a's weights are replaced: answers switch to them.
  ReplaceFile(repo.path() / "a.safetensors", BilinearBytes(2));
  EXPECT_TRUE(Within(kPollPlusTwo, [&] { return Attend(*stub, Probe("a")).factor == 2; }))
      << "a's new weights not served within poll + 2 s";

  // A corrupt replacement is refused; the previous weights keep serving.
  ReplaceFile(repo.path() / "a.safetensors", BilinearBytes(1).substr(0, 30));
  EXPECT_TRUE(Within(kPollPlusTwo, [&] {
    return LoadFailures((*server)->metrics_address(), "a") == 1;
  })) << "the corrupt file was not reported";
  for (int i = 0; i < 20; ++i) EXPECT_EQ(Attend(*stub, Probe("a")).factor, 2);
  const v1::ListModelsResponse listed = ListModels(*stub);
  const v1::ModelInfo* a_info = FindInfo(listed, "a");
  ASSERT_NE(a_info, nullptr);
  ASSERT_EQ(a_info->versions_size(), 1) << a_info->DebugString();
  EXPECT_EQ(a_info->versions(0).state(), v1::MODEL_VERSION_STATE_READY);
  EXPECT_THAT(a_info->versions(0).reason(), HasSubstr("reload failed"));

  // a is removed: NOT_FOUND from then on.
  fs::remove(repo.path() / "a.safetensors");
  EXPECT_TRUE(Within(kPollPlusTwo, [&] {
    return Attend(*stub, Probe("a")).status.error_code() == grpc::StatusCode::NOT_FOUND;
  }));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const std::vector<std::unique_ptr<Observed>> observed = load.Stop();

  int ok = 0, not_found = 0;
  for (const auto& thread : observed) {
    int last_factor = 1;
    bool gone = false;
    for (const Reply& reply : thread->replies) {
      if (reply.status.error_code() == grpc::StatusCode::NOT_FOUND) {
        gone = true;
        ++not_found;
        continue;
      }
      ASSERT_TRUE(reply.status.ok()) << CodeName(reply.status.error_code()) << ": "
                                     << reply.status.error_message();
      EXPECT_FALSE(gone) << "a answered after it was NOT_FOUND";
      ++ok;
      // Each thread's calls are sequential: once on the new weights, never
      // back on the old ones; never a mixture (factor 0).
      EXPECT_GE(reply.factor, last_factor);
      EXPECT_NE(reply.factor, 3) << "b's weights answered a request for a";
      last_factor = reply.factor;
    }
    EXPECT_TRUE(gone);
  }
  EXPECT_GT(ok, 100);
  EXPECT_GT(not_found, 0);
  const std::string after = ScrapeMetrics((*server)->metrics_address());
  EXPECT_EQ(MetricValue(after, "attention_model_info", {{"model", "a"}}), 0)
      << "a removed but still listed as served";
  EXPECT_EQ(MetricValue(after, "attention_model_info", {{"model", "b"}}), 1);
  EXPECT_EQ(Attend(*stub, Probe("b")).factor, 3);
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0);
}

TEST(HotReloadTest, AFileWrittenSlowlyIsNotReadBeforeItIsComplete) {
  TempDir repo;
  auto server = ServerProcess::Start({"--model-repository", repo.path().string(),
                                      "--repository-poll-seconds", "1"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();
  const std::string bytes = BilinearBytes(2);
  {
    std::ofstream out(repo.path() / "slow.safetensors", std::ios::binary);
    // Pieces every 100 ms for 3 s: three polls see a file that is not done
    // (a whole poll interval without a write would pass for complete).
    const size_t pieces = 30;
    for (size_t i = 0; i < pieces; ++i) {
      const size_t begin = bytes.size() * i / pieces, end = bytes.size() * (i + 1) / pieces;
      out.write(bytes.data() + begin, static_cast<std::streamsize>(end - begin));
      out.flush();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      EXPECT_EQ(FindInfo(ListModels(*stub), "slow"), nullptr) << "read after piece " << i;
    }
  }
  EXPECT_TRUE(
      Within(std::chrono::seconds(5), [&] { return Attend(*stub, Probe("slow")).factor == 2; }));
  EXPECT_EQ(LoadFailures((*server)->metrics_address(), "slow"), 0)
      << "a half-written file was read";
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0);
}

// An Open Inference Protocol ModelInfer of Probe(model).
inference::ModelInferRequest InferProbe(const std::string& model, const std::string& version) {
  inference::ModelInferRequest request;
  request.set_model_name(model);
  request.set_model_version(version);
  auto add = [&](const char* name, std::vector<int64_t> shape, std::vector<float> data) {
    auto* input = request.add_inputs();
    input->set_name(name);
    input->set_datatype("FP32");
    for (int64_t size : shape) input->add_shape(size);
    std::string raw(data.size() * sizeof(float), '\0');
    std::memcpy(raw.data(), data.data(), raw.size());
    request.add_raw_input_contents(raw);
  };
  add("queries", {1, 1, 2}, {1, 0});
  add("keys", {1, 2, 2}, {1, 0, 0, 1});
  return request;
}

struct InferReply {
  grpc::Status status;
  int factor = 0;
  std::string version;
};

InferReply Infer(inference::GRPCInferenceService::Stub& stub, const std::string& model,
                 const std::string& version) {
  grpc::ClientContext context;
  inference::ModelInferResponse response;
  InferReply reply{stub.ModelInfer(&context, InferProbe(model, version), &response), 0, ""};
  if (reply.status.ok() && response.raw_output_contents_size() == 1) {
    float output0;
    std::memcpy(&output0, response.raw_output_contents(0).data(), sizeof output0);
    reply.factor = FactorOf(output0);
    reply.version = response.model_version();
  }
  return reply;
}

class VersionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directory(repo_.path() / "m");
    ReplaceFile(repo_.path() / "m" / "1.safetensors", BilinearBytes(1));
    ReplaceFile(repo_.path() / "m" / "2.safetensors", BilinearBytes(2));
  }
  TempDir repo_;
};

TEST_F(VersionsTest, PolicyAllServesVersionsSideBySide) {
  auto server = ServerProcess::Start(
      {"--model-repository", repo_.path().string(), "--version-policy", "all"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();

  Reply newest = Attend(*stub, Probe("m"));
  EXPECT_EQ(newest.factor, 2);
  EXPECT_EQ(newest.version, 2);
  Reply first = Attend(*stub, Probe("m", 1));
  EXPECT_EQ(first.factor, 1);
  EXPECT_EQ(first.version, 1);
  EXPECT_EQ(Attend(*stub, Probe("m", 2)).factor, 2);
  Reply unknown = Attend(*stub, Probe("m", 7));
  EXPECT_EQ(unknown.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(unknown.status.error_message(), HasSubstr("no version 7"));
  EXPECT_EQ(Attend(*stub, Probe("nothing", 1)).status.error_code(), grpc::StatusCode::NOT_FOUND);

  const v1::ListModelsResponse listed = ListModels(*stub, false);
  const v1::ModelInfo* info = FindInfo(listed, "m");
  ASSERT_NE(info, nullptr);
  EXPECT_EQ(info->version(), 2);
  ASSERT_EQ(info->versions_size(), 2);
  for (const auto& version : info->versions()) {
    EXPECT_EQ(version.state(), v1::MODEL_VERSION_STATE_READY);
    EXPECT_EQ(version.kind(), "bilinear");
  }

  auto infer = inference::GRPCInferenceService::NewStub((*server)->Channel());
  EXPECT_EQ(Infer(*infer, "m", "1").factor, 1);
  InferReply oip_newest = Infer(*infer, "m", "");
  EXPECT_EQ(oip_newest.factor, 2);
  EXPECT_EQ(oip_newest.version, "2");
  EXPECT_EQ(Infer(*infer, "m", "7").status.error_code(), grpc::StatusCode::NOT_FOUND);
  InferReply bad = Infer(*infer, "m", "one");
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(bad.status.error_message(), HasSubstr("model_version"));
  {
    grpc::ClientContext context;
    inference::ModelReadyRequest request;
    request.set_name("m");
    request.set_version("1");
    inference::ModelReadyResponse ready;
    ASSERT_TRUE(infer->ModelReady(&context, request, &ready).ok());
    EXPECT_TRUE(ready.ready());
  }
  {
    grpc::ClientContext context;
    inference::ModelMetadataRequest request;
    request.set_name("m");
    inference::ModelMetadataResponse metadata;
    ASSERT_TRUE(infer->ModelMetadata(&context, request, &metadata).ok());
    EXPECT_THAT(metadata.versions(), ::testing::ElementsAre("1", "2"));
  }
  {
    grpc::ClientContext context;
    inference::RepositoryIndexResponse index;
    ASSERT_TRUE(infer->RepositoryIndex(&context, {}, &index).ok());
    std::vector<std::string> versions;
    for (const auto& model : index.models()) {
      if (model.name() == "m") versions.push_back(model.version() + " " + model.state());
    }
    EXPECT_THAT(versions, ::testing::ElementsAre("1 READY", "2 READY"));
  }
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0);
}

TEST_F(VersionsTest, PolicyLatestServesTheNewestOnly) {
  ReplaceFile(repo_.path() / "broken.safetensors", "not a model");
  auto server = ServerProcess::Start({"--model-repository", repo_.path().string()});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();
  Reply newest = Attend(*stub, Probe("m"));
  EXPECT_EQ(newest.factor, 2);
  EXPECT_EQ(newest.version, 2);
  EXPECT_EQ(Attend(*stub, Probe("m", 1)).status.error_code(), grpc::StatusCode::NOT_FOUND);

  EXPECT_EQ(FindInfo(ListModels(*stub, false), "broken"), nullptr);
  const v1::ListModelsResponse all = ListModels(*stub, true);
  const v1::ModelInfo* broken = FindInfo(all, "broken");
  ASSERT_NE(broken, nullptr);
  ASSERT_EQ(broken->versions_size(), 1);
  EXPECT_EQ(broken->versions(0).state(), v1::MODEL_VERSION_STATE_FAILED);
  EXPECT_THAT(broken->versions(0).reason(), HasSubstr("broken.safetensors"));
  auto infer = inference::GRPCInferenceService::NewStub((*server)->Channel());
  grpc::ClientContext context;
  inference::RepositoryIndexResponse index;
  ASSERT_TRUE(infer->RepositoryIndex(&context, {}, &index).ok());
  bool listed = false;
  for (const auto& model : index.models()) {
    if (model.name() != "broken") continue;
    listed = true;
    EXPECT_EQ(model.state(), "UNAVAILABLE");
    EXPECT_FALSE(model.reason().empty());
  }
  EXPECT_TRUE(listed);
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0);
}

grpc::Status Control(inference::GRPCInferenceService::Stub& stub, bool load,
                     const std::string& model, const std::string& token) {
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  if (load) {
    inference::RepositoryModelLoadRequest request;
    request.set_model_name(model);
    inference::RepositoryModelLoadResponse response;
    return stub.RepositoryModelLoad(&context, request, &response);
  }
  inference::RepositoryModelUnloadRequest request;
  request.set_model_name(model);
  inference::RepositoryModelUnloadResponse response;
  return stub.RepositoryModelUnload(&context, request, &response);
}

TEST(ModelControlTest, ExplicitLoadAndUnloadNeedTheTokenAndTheFlag) {
  TempDir repo;
  ReplaceFile(repo.path() / "a.safetensors", BilinearBytes(1));
  TempDir secrets;
  WriteFile(secrets.path() / "tokens", "operator-token\n");
  auto server = ServerProcess::Start({"--model-repository", repo.path().string(),
                                      "--model-control", "explicit", "--auth-token-file",
                                      (secrets.path() / "tokens").string()});
  ASSERT_TRUE(server.ok()) << server.status();
  auto infer = inference::GRPCInferenceService::NewStub((*server)->Channel());
  auto stub = (*server)->Stub();
  auto attend = [&](const std::string& model) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer operator-token");
    v1::AttendResponse response;
    return stub->Attend(&context, Probe(model), &response).error_code();
  };

  EXPECT_EQ(Control(*infer, false, "a", "").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Control(*infer, false, "a", "wrong").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(attend("a"), grpc::StatusCode::OK);

  ASSERT_TRUE(Control(*infer, false, "a", "operator-token").ok());
  EXPECT_EQ(attend("a"), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Control(*infer, true, "a", "").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(attend("a"), grpc::StatusCode::NOT_FOUND);

  // A model copied in is loaded on request, without polling.
  ReplaceFile(repo.path() / "fresh.safetensors", BilinearBytes(2));
  ASSERT_TRUE(Control(*infer, true, "fresh", "operator-token").ok());
  EXPECT_EQ(attend("fresh"), grpc::StatusCode::OK);
  ASSERT_TRUE(Control(*infer, true, "a", "operator-token").ok());
  EXPECT_EQ(attend("a"), grpc::StatusCode::OK);

  const grpc::Status built_in = Control(*infer, false, "dot_product", "operator-token");
  EXPECT_EQ(built_in.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(built_in.error_message(), HasSubstr("built in"));
  EXPECT_EQ(Control(*infer, true, "missing", "operator-token").error_code(),
            grpc::StatusCode::NOT_FOUND);
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0);
}

TEST(ModelControlTest, LoadAndUnloadAreRefusedWithoutExplicitControl) {
  TempDir repo;
  ReplaceFile(repo.path() / "a.safetensors", BilinearBytes(1));
  auto server = ServerProcess::Start({"--model-repository", repo.path().string()});
  ASSERT_TRUE(server.ok()) << server.status();
  auto infer = inference::GRPCInferenceService::NewStub((*server)->Channel());
  for (bool load : {true, false}) {
    const grpc::Status refused = Control(*infer, load, "a", "");
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(refused.error_message(), HasSubstr("--model-control explicit"));
  }
  auto stub = (*server)->Stub();
  EXPECT_EQ(Attend(*stub, Probe("a")).factor, 1);
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0);
}

// attention-client's exit code and standard output for `args`.
int RunClient(const std::string& args, std::string* output) {
  const std::string command =
      std::string(ATTENTION_BINARY_DIR) + "/client/attention-client " + args + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return -1;
  char buffer[4096];
  for (size_t n; (n = fread(buffer, 1, sizeof buffer, pipe)) > 0;) output->append(buffer, n);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(ModelControlTest, TheCliLoadsUnloadsAndListsTheRepository) {
  TempDir repo;
  ReplaceFile(repo.path() / "a.safetensors", BilinearBytes(1));
  ReplaceFile(repo.path() / "broken.safetensors", "not a model");
  auto server = ServerProcess::Start({"--model-repository", repo.path().string(),
                                      "--model-control", "explicit"});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string target = "--target " + (*server)->address() + " ";
  std::string output;
  EXPECT_EQ(RunClient(target + "unload a", &output), 0) << output;
  auto stub = (*server)->Stub();
  EXPECT_EQ(Attend(*stub, Probe("a")).status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(RunClient(target + "load a", &output), 0) << output;
  EXPECT_EQ(Attend(*stub, Probe("a")).factor, 1);
  output.clear();
  EXPECT_EQ(RunClient(target + "load missing", &output), 1);
  EXPECT_THAT(output, HasSubstr("missing.safetensors"));
  output.clear();
  EXPECT_EQ(RunClient(target + "repository", &output), 0);
  EXPECT_THAT(output, ::testing::ContainsRegex("a +1 +READY"));
  EXPECT_THAT(output, ::testing::ContainsRegex("broken +1 +UNAVAILABLE +.*broken.safetensors"));
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0);
}

TEST(ReloadMemoryTest, AHundredReloadsOfA64MegabyteModelKeepMemoryFlat) {
  if (kSanitizedBuild) GTEST_SKIP() << "resident sizes mean nothing under a sanitizer";
  TempDir repo;
  constexpr int kSize = 4096;  // W_k 4096 x 4096 float32: 64 MiB
  {
    // Zero weights load like any others.
    const std::vector<uint8_t> bytes = BuildFile(
        {TensorBytes{"W_k.weight", "F32", {kSize, kSize},
                     std::vector<uint8_t>(size_t{kSize} * kSize * sizeof(float), 0)}},
        {{"kind", "bilinear"}});
    WriteFile(repo.path() / "big.safetensors", std::string(bytes.begin(), bytes.end()));
  }
  auto server = ServerProcess::Start({"--model-repository", repo.path().string(),
                                      "--model-control", "explicit"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto infer = inference::GRPCInferenceService::NewStub((*server)->Channel());
  ASSERT_TRUE(Control(*infer, true, "big", "").ok());
  const int64_t one_load = ResidentBytes((*server)->pid());
  ASSERT_GT(one_load, int64_t{64} << 20);
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(Control(*infer, true, "big", "").ok()) << i;
  const int64_t hundred_loads = ResidentBytes((*server)->pid());
  EXPECT_LT(hundred_loads, one_load * 11 / 10)
      << "resident " << (one_load >> 20) << " MiB after one load, " << (hundred_loads >> 20)
      << " MiB after 100";
  EXPECT_EQ((*server)->Stop(), 0);
}

}  // namespace
}  // namespace attention::testing
