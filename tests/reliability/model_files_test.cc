// model_files_test.cc: a model file too large, or too large for memory, is a
// bad file like any other (docs/api.md, section 5): logged and skipped, or
// fatal with --strict; it never ends the process with an uncaught exception.
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "tests/support/files.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

std::filesystem::path ExampleModel() {
  return std::filesystem::path(ATTENTION_SOURCE_DIR) / "models" / "additive_h32.safetensors";
}

// A file of `bytes` zero bytes that takes no disk space.
void Sparse(const std::filesystem::path& path, uintmax_t bytes) {
  std::ofstream(path).close();
  std::filesystem::resize_file(path, bytes);
}

TEST(ModelFilesTest, FileOverTheCapIsSkippedAndTheOthersServed) {
  TempDir repository;
  std::filesystem::copy_file(ExampleModel(), repository.path() / "good.safetensors");
  Sparse(repository.path() / "huge.safetensors", uintmax_t{3} << 30);
  auto server = ServerProcess::Start({"--model-repository", repository.path().string()});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();
  grpc::ClientContext context;
  v1::ListModelsResponse models;
  ASSERT_TRUE(stub->ListModels(&context, v1::ListModelsRequest(), &models).ok());
  std::string names;
  for (const auto& model : models.models()) names += model.name() + " ";
  EXPECT_THAT(names, AllOf(HasSubstr("good"), Not(HasSubstr("huge"))));
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0);
  EXPECT_THAT((*server)->Log(),
              HasSubstr("huge.safetensors: 3221225472 bytes, more than the model file cap of "
                        "1073741824 bytes"));
}

TEST(ModelFilesTest, CapIsAFlagAndStrictMakesItFatal) {
  TempDir repository;
  std::filesystem::copy_file(ExampleModel(), repository.path() / "good.safetensors");
  std::string output;
  EXPECT_EQ(ServerProcess::RunToExit({"--address", "127.0.0.1:0", "--metrics-address", "",
                                      "--model-repository", repository.path().string(),
                                      "--max-model-file-bytes", "100", "--strict"},
                                     {}, &output),
            1);
  EXPECT_THAT(output, AllOf(HasSubstr("cannot start"),
                            HasSubstr("more than the model file cap of 100 bytes")));
}

// Under an address-space limit, loading a 3 GiB file fails to allocate: that
// is reported as the file's problem (here fatal, --strict) instead of ending
// the process with std::bad_alloc (abort, exit 134, before).
TEST(ModelFilesTest, OutOfMemoryWhileLoadingIsReportedNotFatal) {
  if (kSanitizedBuild) GTEST_SKIP() << "a sanitizer's shadow memory does not fit under ulimit -v";
  TempDir repository;
  Sparse(repository.path() / "huge.safetensors", uintmax_t{3} << 30);
  const std::filesystem::path log = repository.path() / "log";
  const std::string command =
      "ulimit -v 2000000; exec '" + ServerBinary().string() +
      "' --address 127.0.0.1:0 --metrics-address '' --model-repository '" +
      repository.path().string() + "' --max-model-file-bytes 0 --strict > '" + log.string() +
      "' 2>&1";
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFEXITED(status)) << "killed by a signal";
  EXPECT_EQ(WEXITSTATUS(status), 1);
  const std::string text = ReadFile(log);
  EXPECT_THAT(text, AllOf(HasSubstr("huge.safetensors: out of memory while loading its "
                                    "3221225472 bytes"),
                          Not(HasSubstr("bad_alloc"))));
}

}  // namespace
}  // namespace attention::testing
