// reflection_flag_test.cc: --reflection (docs/api.md, section 6.4): on by
// default; `--reflection false` (or ATTENTION_REFLECTION=false) takes the
// reflection service away, so anonymous callers cannot list the API.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "reflection.grpc.pb.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

grpc::StatusCode ListServices(const ServerProcess& server) {
  auto reflection = grpc::reflection::v1alpha::ServerReflection::NewStub(server.Channel());
  grpc::ClientContext context;
  auto stream = reflection->ServerReflectionInfo(&context);
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_list_services("");
  stream->Write(request);
  stream->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  while (stream->Read(&response)) {
  }
  return stream->Finish().error_code();
}

TEST(ReflectionFlagTest, OnByDefaultOffByFlagOrEnvironment) {
  const std::vector<std::pair<std::vector<std::string>, std::map<std::string, std::string>>>
      setups = {{{}, {}}, {{"--reflection", "false"}, {}}, {{}, {{"ATTENTION_REFLECTION", "false"}}}};
  const grpc::StatusCode expected[] = {grpc::StatusCode::OK, grpc::StatusCode::UNIMPLEMENTED,
                                       grpc::StatusCode::UNIMPLEMENTED};
  for (size_t i = 0; i < setups.size(); ++i) {
    SCOPED_TRACE(i);
    auto server = ServerProcess::Start(setups[i].first, setups[i].second);
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ(ListServices(**server), expected[i]);
    EXPECT_EQ((*server)->Stop(), 0);
  }
}

}  // namespace
}  // namespace attention::testing
