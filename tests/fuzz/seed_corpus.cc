// seed_corpus.cc: conformance data -> seed inputs, and target dispatch.
#include "tests/fuzz/seed_corpus.h"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <utility>

#include <nlohmann/json.hpp>

#include "attention.pb.h"
#include "google/protobuf/util/json_util.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_targets.h"

namespace attention::fuzz {
namespace {

std::vector<uint8_t> ReadFile(const std::filesystem::path& path) {
  std::ifstream stream(path, std::ios::binary);
  FUZZ_CHECK(stream.good(), "cannot read %s", path.c_str());
  return {std::istreambuf_iterator<char>(stream), std::istreambuf_iterator<char>()};
}

std::vector<uint8_t> Bytes(const std::string& text) { return {text.begin(), text.end()}; }

// (name, request JSON) of every case file and errors.json entry.
std::vector<std::pair<std::string, std::string>> ConformanceRequests(
    const std::filesystem::path& conformance_dir) {
  std::vector<std::pair<std::string, std::string>> requests;
  for (const auto& entry : std::filesystem::directory_iterator(conformance_dir / "cases")) {
    const std::vector<uint8_t> text = ReadFile(entry.path());
    const nlohmann::json json = nlohmann::json::parse(text.begin(), text.end());
    requests.emplace_back(entry.path().stem().string(), json.at("request").dump());
  }
  const std::vector<uint8_t> text = ReadFile(conformance_dir / "errors.json");
  for (const nlohmann::json& error : nlohmann::json::parse(text.begin(), text.end())) {
    requests.emplace_back("error_" + error.at("name").get<std::string>(),
                          error.at("request").dump());
  }
  std::sort(requests.begin(), requests.end());
  return requests;
}

}  // namespace

std::vector<SeedInput> ConformanceSeeds(const std::string& target,
                                        const std::filesystem::path& conformance_dir) {
  std::vector<SeedInput> seeds;
  if (target == "model_file") {
    seeds = ReadDirectory(conformance_dir / "models");
  } else if (target == "request_json") {
    for (const auto& [name, json] : ConformanceRequests(conformance_dir)) {
      seeds.push_back({name + ".json", Bytes(json)});
    }
  } else if (target == "request_proto") {
    for (const auto& [name, json] : ConformanceRequests(conformance_dir)) {
      v1::AttendRequest request;
      // Requests the JSON parser rejects (shapes beyond int64) have no binary form.
      if (!google::protobuf::util::JsonStringToMessage(json, &request).ok()) continue;
      seeds.push_back({name + ".pb", Bytes(request.SerializeAsString())});
    }
  } else {
    FUZZ_CHECK(false, "unknown fuzz target '%s'", target.c_str());
  }
  return seeds;
}

std::vector<SeedInput> ReadDirectory(const std::filesystem::path& directory) {
  std::vector<SeedInput> inputs;
  if (!std::filesystem::is_directory(directory)) return inputs;
  for (const auto& entry : std::filesystem::directory_iterator(directory)) {
    if (entry.is_regular_file()) {
      inputs.push_back({entry.path().filename().string(), ReadFile(entry.path())});
    }
  }
  std::sort(inputs.begin(), inputs.end(),
            [](const SeedInput& a, const SeedInput& b) { return a.name < b.name; });
  return inputs;
}

void RunTarget(const std::string& target, const std::vector<uint8_t>& bytes) {
  if (target == "model_file") {
    FuzzModelFile(bytes);
  } else if (target == "request_json") {
    FuzzAttendRequest(bytes, RequestEncoding::kProtoJson);
  } else if (target == "request_proto") {
    FuzzAttendRequest(bytes, RequestEncoding::kBinaryProto);
  } else {
    FUZZ_CHECK(false, "unknown fuzz target '%s'", target.c_str());
  }
}

}  // namespace attention::fuzz
