// conformance_cases.h: the cases of tests/conformance/cases and
// tests/conformance/layers/cases as the server tests read them (header-only:
// it reports a bad request through gtest, which only the test binaries link).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/support/files.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {

struct ConformanceCase {
  std::string name;
  v1::AttendRequest request;
  nlohmann::json expected;
  double atol = 0;
  double rtol = 0;
};

// The request of a conformance case or error entry; a failed test (and an
// empty request) when it does not parse.
inline v1::AttendRequest ParseRequest(const nlohmann::json& json) {
  absl::StatusOr<v1::AttendRequest> request = RequestFromJson(json);
  EXPECT_TRUE(request.ok()) << request.status();
  return request.ok() ? *std::move(request) : v1::AttendRequest();
}

// Every case of `directory`, sorted by name.
inline std::vector<ConformanceCase> LoadCasesOf(const std::filesystem::path& directory) {
  std::vector<ConformanceCase> cases;
  for (const auto& entry : std::filesystem::directory_iterator(directory)) {
    const nlohmann::json json = ReadJson(entry.path());
    cases.push_back(ConformanceCase{json["name"], ParseRequest(json["request"]), json["expected"],
                                    json["atol"].get<double>(), json["rtol"].get<double>()});
  }
  std::sort(cases.begin(), cases.end(),
            [](const ConformanceCase& a, const ConformanceCase& b) { return a.name < b.name; });
  return cases;
}

// Every case of cases/ (models/), sorted by name.
inline std::vector<ConformanceCase> LoadConformanceCases() {
  return LoadCasesOf(ConformanceDir() / "cases");
}

// Every case of layers/cases/ (Hugging Face's layout, layers/models/), sorted
// by name; a server runs them on ConformanceRepository().
inline std::vector<ConformanceCase> LoadLayerCases() {
  return LoadCasesOf(ConformanceDir() / "layers" / "cases");
}

// That an output of shape `shape` and values `data` is the case's
// `expected` (its "output" or "attention_weights"), within its tolerances.
inline void ExpectMatchesCase(const std::vector<int64_t>& shape, const std::vector<float>& data,
                              const nlohmann::json& expected, const ConformanceCase& c,
                              const std::string& what) {
  ASSERT_EQ(shape, expected["shape"].get<std::vector<int64_t>>()) << c.name << " " << what;
  const std::vector<double> want = expected["data"].get<std::vector<double>>();
  ASSERT_EQ(data.size(), want.size()) << c.name << " " << what;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_LE(std::abs(data[i] - want[i]), c.atol + c.rtol * std::abs(want[i]))
        << c.name << " " << what << "[" << i << "]";
  }
}

}  // namespace attention::testing
