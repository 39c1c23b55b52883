// json-codec-bench: the REST codec's JSON work with each of the build's two
// JSON libraries, to show why the REST codec (server/api/rest/rest_codec.cc)
// uses RapidJSON while the rest of the project uses nlohmann_json.
//
// A REST infer request carries its tensors as JSON number lists; its
// answer writes the output the same way. Per library, for a list of N
// floats (N = 512: [1, 8, 64]; N = 32,768: [8, 64, 64]; N = 262,144:
// [8, 512, 64]) inside a KServe v2 body:
//   json_parse/<library>/floats:N  parse the body and read every number as a float
//   json_write/<library>/floats:N  write the number list of N floats
// RapidJSON is parsed with the codec's own flags (iterative, stop when done).
//
//   build/bench/json-codec-bench --benchmark_min_time=0.2
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "nlohmann/json.hpp"
#include "rapidjson/document.h"
#include "rapidjson/stringbuffer.h"
#include "rapidjson/writer.h"

namespace {

std::vector<float> Floats(int64_t n) {
  std::mt19937 random(42);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(n);
  for (float& v : values) v = uniform(random);
  return values;
}

// A REST infer body whose one input holds `n` floats.
std::string Body(int64_t n) {
  rapidjson::StringBuffer buffer;
  rapidjson::Writer<rapidjson::StringBuffer> writer(buffer);
  writer.StartObject();
  writer.Key("inputs");
  writer.StartArray();
  writer.StartObject();
  writer.Key("name");
  writer.String("queries");
  writer.Key("datatype");
  writer.String("FP32");
  writer.Key("shape");
  writer.StartArray();
  writer.Int64(n);
  writer.EndArray();
  writer.Key("data");
  writer.StartArray();
  for (float v : Floats(n)) writer.Double(v);
  writer.EndArray();
  writer.EndObject();
  writer.EndArray();
  writer.EndObject();
  return buffer.GetString();
}

void SetCounters(benchmark::State& state, size_t bytes) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["floats"] = static_cast<double>(state.range(0));
}

void ParseRapidJson(benchmark::State& state) {
  const std::string body = Body(state.range(0));
  std::vector<float> out(state.range(0));
  for (auto _ : state) {
    rapidjson::Document document;
    document.Parse<rapidjson::kParseIterativeFlag | rapidjson::kParseStopWhenDoneFlag>(
        body.data(), body.size());
    const rapidjson::Value& data = document["inputs"][0]["data"];
    size_t i = 0;
    for (const rapidjson::Value& item : data.GetArray()) out[i++] = static_cast<float>(item.GetDouble());
    benchmark::DoNotOptimize(out.data());
  }
  SetCounters(state, body.size());
}

void ParseNlohmann(benchmark::State& state) {
  const std::string body = Body(state.range(0));
  std::vector<float> out(state.range(0));
  for (auto _ : state) {
    const nlohmann::json document = nlohmann::json::parse(body);
    const nlohmann::json& data = document["inputs"][0]["data"];
    size_t i = 0;
    for (const nlohmann::json& item : data) out[i++] = item.get<float>();
    benchmark::DoNotOptimize(out.data());
  }
  SetCounters(state, body.size());
}

void WriteRapidJson(benchmark::State& state) {
  const std::vector<float> values = Floats(state.range(0));
  size_t bytes = 0;
  for (auto _ : state) {
    rapidjson::StringBuffer buffer;
    rapidjson::Writer<rapidjson::StringBuffer> writer(buffer);
    writer.StartArray();
    for (float v : values) writer.Double(v);
    writer.EndArray();
    bytes = buffer.GetSize();
    benchmark::DoNotOptimize(buffer.GetString());
  }
  SetCounters(state, bytes);
}

void WriteNlohmann(benchmark::State& state) {
  const std::vector<float> values = Floats(state.range(0));
  size_t bytes = 0;
  for (auto _ : state) {
    nlohmann::json list = nlohmann::json::array();
    for (float v : values) list.push_back(static_cast<double>(v));
    const std::string text = list.dump();
    bytes = text.size();
    benchmark::DoNotOptimize(text.data());
  }
  SetCounters(state, bytes);
}

void Sizes(benchmark::internal::Benchmark* b) {
  b->ArgName("floats")->Arg(512)->Arg(32768)->Arg(262144)->Unit(benchmark::kMicrosecond);
}

BENCHMARK(ParseRapidJson)->Name("json_parse/rapidjson")->Apply(Sizes);
BENCHMARK(ParseNlohmann)->Name("json_parse/nlohmann")->Apply(Sizes);
BENCHMARK(WriteRapidJson)->Name("json_write/rapidjson")->Apply(Sizes);
BENCHMARK(WriteNlohmann)->Name("json_write/nlohmann")->Apply(Sizes);

}  // namespace

BENCHMARK_MAIN();
