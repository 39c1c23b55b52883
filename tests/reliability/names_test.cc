// names_test.cc: what a client controls in the log and in error messages
// (docs/api.md, section 6.2). `model` and `request_id` longer than 256 bytes
// are refused; a name holding a newline or a terminal escape cannot forge a
// log line or reach the client's terminal raw; a flood of bad requests costs
// a bounded number of log lines, with a count of those left out.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

v1::AttendRequest Request(const std::string& model, const std::string& id) {
  v1::AttendRequest request;
  request.set_model(model);
  request.set_request_id(id);
  v1::Tensor* queries = request.mutable_queries();
  for (int64_t s : {1, 2, 2}) queries->add_shape(s);
  for (float v : {1.0f, 2.0f, 3.0f, 4.0f}) queries->add_data(v);
  return request;
}

int CountLines(const std::string& log, const std::string& needle) {
  int lines = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StrContains(line, needle)) ++lines;
  }
  return lines;
}

TEST(NamesTest, LongNamesAreRefusedNamingTheFieldAndTheCap) {
  auto server = ServerProcess::Start({});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();
  EXPECT_TRUE(AttendWithin(*stub, std::chrono::seconds(30), Request("dot_product", std::string(256, 'i'))).ok());

  grpc::Status refused = AttendWithin(*stub, std::chrono::seconds(30), Request(std::string(300, 'm'), "r"));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(refused.error_message(), "model: expected at most 256 bytes, got 300");
  refused = AttendWithin(*stub, std::chrono::seconds(30), Request("dot_product", std::string(1 << 20, 'i')));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(refused.error_message(), "request_id: expected at most 256 bytes, got 1048576");
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0);
  // The megabyte id is not written out whole.
  EXPECT_LT((*server)->Log().size(), 64u << 10);
}

TEST(NamesTest, ControlCharactersAreEscapedInMessagesAndBothLogFormats) {
  const std::string forged = "2030-01-01 00:00:00.000 [info] forged line";
  const std::string evil_model = "no_such\n" + forged + "\x1b[2J";
  for (const char* format : {"text", "json"}) {
    SCOPED_TRACE(format);
    auto server = ServerProcess::Start({"--log-format", format});
    ASSERT_TRUE(server.ok()) << server.status();
    auto stub = (*server)->Stub();
    const grpc::Status refused = AttendWithin(*stub, std::chrono::seconds(30), Request(evil_model, "id\r\n" + forged));
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(refused.error_message(),
                AllOf(HasSubstr("no_such\\n2030"), HasSubstr("\\x1b[2J"), Not(HasSubstr("\n")),
                      Not(HasSubstr("\x1b"))));
    stub.reset();
    EXPECT_EQ((*server)->Stop(), 0);
    const std::string log = (*server)->Log();
    EXPECT_THAT(log, HasSubstr("request failed"));
    EXPECT_THAT(log, Not(HasSubstr("\x1b")));
    for (absl::string_view line : absl::StrSplit(log, '\n')) {
      EXPECT_FALSE(absl::StartsWith(line, "2030-01-01")) << "forged log line: " << line;
    }
  }
}

TEST(NamesTest, RefusalFloodIsLoggedAtABoundedRateWithACount) {
  auto server = ServerProcess::Start({});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();
  constexpr int kFlood = 400;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kFlood; ++i) {
    EXPECT_EQ(AttendWithin(*stub, std::chrono::seconds(30), Request("no_such_model", "flood")).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // A new one-second window: this line is written, with the count.
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  EXPECT_EQ(AttendWithin(*stub, std::chrono::seconds(30), Request("no_such_model", "after")).error_code(),
            grpc::StatusCode::NOT_FOUND);
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0);
  const std::string log = (*server)->Log();

  const int written = CountLines(log, "request failed");
  EXPECT_LE(written, 20 * (static_cast<int>(seconds) + 2)) << "over " << seconds << " s";
  int64_t left_out = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    const size_t end = line.find(" more failed requests not logged)");
    if (end == absl::string_view::npos) continue;
    int64_t count = 0;
    ASSERT_TRUE(absl::SimpleAtoi(line.substr(line.rfind(" (", end) + 2,
                                             end - line.rfind(" (", end) - 2),
                                 &count))
        << line;
    left_out += count;
  }
  EXPECT_GT(left_out, 0);
  EXPECT_EQ(written + left_out, kFlood + 1);
}

}  // namespace
}  // namespace attention::testing
