// scratch_memory_test.cc: per-thread engine scratch that grew for one
// oversized request is given back after it, so the server's resident memory
// returns near its level before. Without it, an additive model with
// many hidden units kept n_k x h floats of tanh features per engine thread
// for the rest of its life (51 MiB from a 200 KB request here), and the fused
// kernel's buffers (64 x d_v floats, a row of n_k scores) only grew.
//
// Resident sizes say nothing under ASan or TSan (shadow memory): the bounds
// are checked in the plain build only (kSanitizedBuild).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/safetensors_builder.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

using std::chrono::milliseconds;

constexpr int64_t kHidden = 256;
constexpr int64_t kMiB = int64_t{1} << 20;

std::vector<float> RandomFloats(std::mt19937& rng, int64_t count) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(count);
  for (float& x : v) x = normal(rng);
  return v;
}

void AddTensor(v1::Tensor* tensor, std::vector<int64_t> shape, std::mt19937& rng) {
  int64_t size = 1;
  for (int64_t d : shape) {
    tensor->add_shape(d);
    size *= d;
  }
  for (float x : RandomFloats(rng, size)) tensor->add_data(x);
}

// additive, d_q = d_k = 1 and h = 256: each key costs 4 bytes on the wire
// and 256 floats of tanh features.
void WriteWideAdditiveModel(const std::filesystem::path& file) {
  std::mt19937 rng(5);
  const std::vector<uint8_t> bytes =
      BuildFile({F32Tensor("W_q.weight", {kHidden, 1}, RandomFloats(rng, kHidden)),
                 F32Tensor("W_k.weight", {kHidden, 1}, RandomFloats(rng, kHidden)),
                 F32Tensor("w_v.weight", {1, kHidden}, RandomFloats(rng, kHidden))},
                {{"kind", "additive"}});
  std::ofstream(file, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                              static_cast<std::streamsize>(bytes.size()));
}

int64_t SettledResidentBytes(pid_t pid) {
  // The answer is sent before the engine thread's last frees can be seen.
  std::this_thread::sleep_for(milliseconds(200));
  return ResidentBytes(pid);
}

TEST(ScratchMemoryTest, OversizedRequestsGiveTheirScratchBack) {
  TempDir repository;
  WriteWideAdditiveModel(repository.path() / "wide_additive.safetensors");
  // No scratch cap: what is checked here is that scratch is given back, not
  // that validation refuses it.
  auto server = ServerProcess::Start({"--threads", "1", "--model-repository",
                                      repository.path().string(),
                                      "--max-request-scratch-elements", "0"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();
  std::mt19937 rng(6);

  // Ordinary requests first, so the baseline holds what they keep.
  v1::AttendRequest ordinary;
  ordinary.set_model("wide_additive");
  AddTensor(ordinary.mutable_queries(), {1, 16, 1}, rng);
  AddTensor(ordinary.mutable_keys(), {1, 64, 1}, rng);
  AddTensor(ordinary.mutable_values(), {1, 64, 4}, rng);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(AttendWithin(*stub, milliseconds(60000), ordinary).ok());
    ASSERT_TRUE(AttendWithin(*stub, milliseconds(60000), SelfAttentionRequest(2, 64, 32, i)).ok());
  }
  const pid_t pid = (*server)->pid();
  const int64_t baseline = SettledResidentBytes(pid);
  ASSERT_GT(baseline, 0);

  // 50,000 keys: 200 KB of keys, 12.8 million floats (51 MiB) of features
  // if they were formed at once.
  v1::AttendRequest long_rows;
  long_rows.set_model("wide_additive");
  AddTensor(long_rows.mutable_queries(), {1, 2, 1}, rng);
  AddTensor(long_rows.mutable_keys(), {1, 50000, 1}, rng);
  AddTensor(long_rows.mutable_values(), {1, 50000, 1}, rng);
  // dot_product with values 30,000 wide: 64 x 30,000 floats (7.3 MiB) of
  // the fused kernel's accumulator.
  v1::AttendRequest wide_values;
  wide_values.set_model("dot_product");
  AddTensor(wide_values.mutable_queries(), {1, 1, 1}, rng);
  AddTensor(wide_values.mutable_keys(), {1, 1, 1}, rng);
  AddTensor(wide_values.mutable_values(), {1, 1, 30000}, rng);
  for (const v1::AttendRequest* request : {&long_rows, &wide_values}) {
    const grpc::Status status = AttendWithin(*stub, milliseconds(60000), *request);
    ASSERT_TRUE(status.ok()) << request->model() << ": " << status.error_message();
  }
  const int64_t after = SettledResidentBytes(pid);
  const int64_t peak = PeakResidentBytes(pid);
  std::cout << "RSS: baseline " << baseline / kMiB << " MiB, after " << after / kMiB
            << " MiB, peak " << peak / kMiB << " MiB\n";
  if (!kSanitizedBuild) {
    EXPECT_LT(after - baseline, 16 * kMiB)
        << "RSS " << baseline / kMiB << " MiB before, " << after / kMiB << " MiB after";
  }
  // Still serving, and right.
  const v1::AttendRequest check = SelfAttentionRequest(1, 8, 8, 99);
  v1::AttendResponse answer;
  ASSERT_TRUE(AttendWithin(*stub, milliseconds(60000), check, &answer).ok());
  EXPECT_EQ(CheckAnswer(check, answer), "");
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0);
}

}  // namespace
}  // namespace attention::testing
