// conformance_cases.h: the cases of tests/conformance/cases and
// tests/conformance/layers/cases as the server tests read them (header-only:
// it reports a bad request through gtest, which only the test binaries link).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <set>
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

// The largest |a[i] - b[i]| of two float lists (vectors or a proto's
// repeated field); infinity when their sizes differ.
template <typename A, typename B>
double LargestDifference(const A& a, const B& b) {
  if (static_cast<size_t>(a.size()) != static_cast<size_t>(b.size())) {
    return std::numeric_limits<double>::infinity();
  }
  double largest = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(a.size()); ++i) {
    largest = std::max<double>(largest, std::abs(static_cast<double>(a[i]) - b[i]));
  }
  return largest;
}

// The models `stub`'s server serves with rotary positions: those whose
// answers the positions change (ALiBi reads the tokens' indices, docs/api.md
// 2.8, so its positions change nothing).
inline std::set<std::string> RotaryModels(v1::AttentionService::Stub& stub) {
  grpc::ClientContext context;
  v1::ListModelsResponse response;
  const grpc::Status status = stub.ListModels(&context, v1::ListModelsRequest(), &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  std::set<std::string> names;
  for (const v1::ModelInfo& model : response.models()) {
    if (!model.rope_type().empty()) names.insert(model.name());
  }
  return names;
}

// A rotary layer case with positions, and Attend's answer to it without
// them.
struct PositionsCase {
  ConformanceCase c;
  v1::AttendResponse without;
};

// The layer cases that give positions to a rotary layer (RotaryModels), each
// with Attend's answer without them: what WithSpreadPositions must change.
inline std::vector<PositionsCase> RotaryPositionsCases(v1::AttentionService::Stub& stub) {
  const std::set<std::string> rotary = RotaryModels(stub);
  std::vector<PositionsCase> cases;
  for (ConformanceCase& c : LoadLayerCases()) {
    if (c.request.position_ids().empty() || !rotary.contains(c.request.model())) continue;
    v1::AttendRequest plain = c.request;
    plain.clear_position_ids();
    PositionsCase positions{std::move(c), {}};
    const grpc::Status status =
        AttendWithin(stub, std::chrono::seconds(60), plain, &positions.without);
    EXPECT_TRUE(status.ok()) << positions.c.name << ": " << status.error_message();
    cases.push_back(std::move(positions));
  }
  EXPECT_FALSE(cases.empty()) << "no layer case gives positions to a rotary layer";
  return cases;
}

// `request` (a layer case's) with positions whose distances are not those
// of 0, 1, 2, ...: rotary and ALiBi see only distances, so these change the
// answer where a shift of every position would not. One per query (B*n_q,
// each example its own) or, `per_query` false, n_q for every example.
inline v1::AttendRequest WithSpreadPositions(v1::AttendRequest request, bool per_query) {
  const int64_t batch = request.queries().shape(0), n_q = request.queries().shape(1);
  request.clear_position_ids();
  for (int64_t b = 0; b < (per_query ? batch : 1); ++b) {
    for (int64_t i = 0; i < n_q; ++i) request.add_position_ids(7 * b + i * i * (b + 2));
  }
  return request;
}

}  // namespace attention::testing
