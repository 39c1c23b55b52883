// rest_test.cc: the Open Inference Protocol over HTTP/REST on a real
// attention-server: every conformance case through infer in JSON and with
// the binary tensor extension; every errors.json entry with its HTTP status;
// health, metadata, config, statistics and the repository; bad requests get
// 400 (or 413, 415, 431) naming the field; tokens; REST and gRPC requests
// merged into one batch answer as alone; drain; the deadline header; a
// closed connection cancels; the connection cap and the slow-client timeout.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "nlohmann/json.hpp"
#include "tests/support/conformance_cases.h"
#include "tests/support/files.h"
#include "tests/support/gate.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

constexpr auto kHeldFor = std::chrono::milliseconds(500);

// How a test sends a request's tensors.
enum class Form { kJson, kBinary };

std::string InferPath(const std::string& model) { return "/v2/models/" + model + "/infer"; }

// `tensor`'s data as nested lists of its shape (JSON form of queries).
json Nested(const v1::Tensor& tensor) {
  const int64_t rows = tensor.shape(0);
  const int64_t per_row = rows == 0 ? 0 : tensor.data_size() / rows;
  json outer = json::array();
  for (int64_t r = 0; r < rows; ++r) {
    outer.push_back(std::vector<float>(tensor.data().begin() + r * per_row,
                                       tensor.data().begin() + (r + 1) * per_row));
  }
  return outer;
}

// The REST request that means what `attend` means: its body and headers.
struct RestRequest {
  std::string body;
  std::map<std::string, std::string> headers;
};

RestRequest ToRest(const v1::AttendRequest& attend, Form form) {
  json request = {{"inputs", json::array()}};
  if (!attend.request_id().empty()) request["id"] = attend.request_id();
  std::string binary;
  auto add = [&](const char* name, const std::string& datatype, std::vector<int64_t> shape,
                 json data, const void* bytes, size_t size) {
    json input = {{"name", name}, {"datatype", datatype}, {"shape", shape}};
    if (form == Form::kJson) {
      input["data"] = std::move(data);
    } else {
      input["parameters"] = {{"binary_data_size", size}};
      binary.append(static_cast<const char*>(bytes), size);
    }
    request["inputs"].push_back(input);
  };
  auto add_floats = [&](const char* name, const v1::Tensor& tensor, bool nested) {
    const std::vector<float> data(tensor.data().begin(), tensor.data().end());
    add(name, "FP32", {tensor.shape().begin(), tensor.shape().end()},
        nested ? Nested(tensor) : json(data), data.data(), data.size() * sizeof(float));
  };
  add_floats("queries", attend.queries(), /*nested=*/true);
  if (attend.has_keys()) add_floats("keys", attend.keys(), false);
  if (attend.has_values()) add_floats("values", attend.values(), false);
  if (!attend.valid_lens().empty()) {
    const std::vector<int32_t> lens(attend.valid_lens().begin(), attend.valid_lens().end());
    add("valid_lens", "INT32", {attend.valid_lens_size()}, json(lens), lens.data(),
        lens.size() * sizeof(int32_t));
  }
  if (!attend.position_ids().empty()) {
    // Both integer types: INT64 as JSON, INT32 as binary; [B, n_q] when
    // there is one per query, else [n_q].
    std::vector<int64_t> shape = {attend.position_ids_size()};
    const int64_t batch = attend.queries().shape(0), n_q = attend.queries().shape(1);
    if (attend.position_ids_size() == batch * n_q) shape = {batch, n_q};
    const std::vector<int64_t> ids(attend.position_ids().begin(), attend.position_ids().end());
    const std::vector<int32_t> narrow(ids.begin(), ids.end());
    add("position_ids", form == Form::kJson ? "INT64" : "INT32", shape, json(ids), narrow.data(),
        narrow.size() * sizeof(int32_t));
  }
  json parameters = json::object();
  if (attend.causal()) parameters["causal"] = true;
  if (attend.has_scale()) parameters["scale"] = attend.scale();
  if (attend.has_sliding_window()) parameters["sliding_window"] = attend.sliding_window();
  if (attend.has_softcap()) parameters["softcap"] = attend.softcap();
  if (attend.return_attention_weights()) parameters["return_attention_weights"] = true;
  if (form == Form::kBinary) parameters["binary_data_output"] = true;
  if (!parameters.empty()) request["parameters"] = parameters;
  RestRequest rest;
  rest.body = request.dump();
  if (form == Form::kBinary) {
    rest.headers["Inference-Header-Content-Length"] = std::to_string(rest.body.size());
    rest.body += binary;
  }
  return rest;
}

struct Output {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

// The outputs of a successful infer answer, by name, whichever form each
// came in.
std::map<std::string, Output> ReadOutputs(const HttpResult& result) {
  std::map<std::string, Output> outputs;
  size_t json_length = result.body.size();
  if (const auto it = result.headers.find("inference-header-content-length");
      it != result.headers.end()) {
    json_length = std::stoul(it->second);
  }
  const json answer = json::parse(result.body.substr(0, json_length));
  size_t offset = json_length;
  for (const json& output : answer["outputs"]) {
    Output& out = outputs[output["name"].get<std::string>()];
    EXPECT_EQ(output["datatype"], "FP32");
    out.shape = output["shape"].get<std::vector<int64_t>>();
    if (output.contains("data")) {
      out.data = output["data"].get<std::vector<float>>();
    } else {
      const size_t size = output["parameters"]["binary_data_size"].get<size_t>();
      out.data.resize(size / sizeof(float));
      std::memcpy(out.data.data(), result.body.data() + offset, size);
      offset += size;
    }
  }
  EXPECT_EQ(offset, result.body.size()) << "bytes after the last binary output";
  return outputs;
}

void ExpectNear(const Output& actual, const nlohmann::json& expected, const ConformanceCase& c,
                const std::string& what) {
  ExpectMatchesCase(actual.shape, actual.data, expected, c, what);
}

int HttpStatusOf(const std::string& code) {
  static const std::map<std::string, int> kStatus = {{"INVALID_ARGUMENT", 400},
                                                     {"NOT_FOUND", 404},
                                                     {"RESOURCE_EXHAUSTED", 429},
                                                     {"UNAVAILABLE", 503},
                                                     {"DEADLINE_EXCEEDED", 504}};
  return kStatus.at(code);
}

class ServerRestTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> more_flags = {}) {
    ASSERT_TRUE(gate_.ok());
    auto started = gate_.StartWithConformanceModels(more_flags);
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = *std::move(started);
    ASSERT_FALSE(server_->http_address().empty()) << "no http line in the port file";
  }

  HttpResult Call(const std::string& method, const std::string& target,
                  const std::string& body = "",
                  const std::map<std::string, std::string>& headers = {}) {
    return HttpCall(server_->http_address(), method, target, body, headers);
  }

  HttpResult Infer(const v1::AttendRequest& attend, Form form,
                   std::map<std::string, std::string> headers = {}) {
    RestRequest rest = ToRest(attend, form);
    headers.insert(rest.headers.begin(), rest.headers.end());
    return Call("POST", InferPath(attend.model()), rest.body, headers);
  }

  TestGate gate_;
  std::unique_ptr<ServerProcess> server_;
};

TEST_F(ServerRestTest, EveryConformanceCaseAsJsonAndAsBinary) {
  Start();
  std::vector<ConformanceCase> cases = LoadConformanceCases();
  ASSERT_FALSE(cases.empty());
  // The layers' cases too: their positions as a position_ids input.
  const std::vector<ConformanceCase> layers = LoadLayerCases();
  ASSERT_FALSE(layers.empty());
  cases.insert(cases.end(), layers.begin(), layers.end());
  for (Form form : {Form::kJson, Form::kBinary}) {
    for (const ConformanceCase& c : cases) {
      const HttpResult result = Infer(c.request, form);
      ASSERT_EQ(result.status, 200) << c.name << ": " << result.body << result.error;
      EXPECT_EQ(result.headers.contains("inference-header-content-length"), form == Form::kBinary)
          << c.name;
      std::map<std::string, Output> outputs = ReadOutputs(result);
      ExpectNear(outputs["output"], c.expected["output"], c, "output");
      if (c.request.return_attention_weights()) {
        ExpectNear(outputs["attention_weights"], c.expected["attention_weights"], c, "weights");
      }
    }
  }
  EXPECT_EQ(server_->Stop(), 0) << server_->Log();
}

// position_ids reach the engine over REST as through Attend, in both forms
// (INT64 JSON, INT32 binary) and both shapes: positions whose distances
// change a rotary layer's answer (the cases' own are shifts, which rotary
// does not see) give Attend's answer, not the one without them.
TEST_F(ServerRestTest, PositionIdsMeanWhatAttendsDo) {
  Start();
  auto stub = server_->Stub();
  for (const PositionsCase& positions : RotaryPositionsCases(*stub)) {
    const ConformanceCase& c = positions.c;
    for (bool per_query : {true, false}) {
      const v1::AttendRequest request = WithSpreadPositions(c.request, per_query);
      v1::AttendResponse attended;
      ASSERT_TRUE(AttendWithin(*stub, std::chrono::seconds(60), request, &attended).ok())
          << c.name;
      for (Form form : {Form::kJson, Form::kBinary}) {
        const HttpResult result = Infer(request, form);
        ASSERT_EQ(result.status, 200) << c.name << ": " << result.body << result.error;
        const std::vector<float> output = ReadOutputs(result)["output"].data;
        EXPECT_LE(LargestDifference(output, attended.output().data()), 1e-5) << c.name;
        EXPECT_GT(LargestDifference(output, positions.without.output().data()), 1e-3) << c.name;
      }
    }
  }
  EXPECT_EQ(server_->Stop(), 0) << server_->Log();
}

TEST_F(ServerRestTest, EveryErrorsEntryGetsTheHttpStatusOfItsCode) {
  Start();
  const nlohmann::json errors = ReadJson(ConformanceDir() / "errors.json");
  ASSERT_FALSE(errors.empty());
  for (const nlohmann::json& entry : errors) {
    const v1::AttendRequest request = ParseRequest(entry["request"]);
    for (Form form : {Form::kJson, Form::kBinary}) {
      const HttpResult result = Infer(request, form);
      EXPECT_EQ(result.status, HttpStatusOf(entry["expected_code"]))
          << entry["name"] << ": " << result.body;
      EXPECT_FALSE(json::parse(result.body)["error"].get<std::string>().empty()) << entry["name"];
    }
  }
  EXPECT_EQ(server_->Stop(), 0) << server_->Log();
}

TEST_F(ServerRestTest, HealthMetadataConfigStatisticsAndRepository) {
  Start();
  EXPECT_EQ(Call("GET", "/v2/health/live").status, 200);
  const HttpResult ready = Call("GET", "/v2/health/ready");
  EXPECT_EQ(ready.status, 200);
  EXPECT_EQ(json::parse(ready.body)["ready"], true);
  const json server = json::parse(Call("GET", "/v2").body);
  EXPECT_EQ(server["name"], "attention-server");
  EXPECT_THAT(server["extensions"].get<std::vector<std::string>>(),
              ::testing::Contains("model_repository"));

  for (const std::string path :
       {"/v2/models/mh_torch_small", "/v2/models/mh_torch_small/versions/1"}) {
    const HttpResult metadata = Call("GET", path);
    ASSERT_EQ(metadata.status, 200) << path << metadata.body;
    const json m = json::parse(metadata.body);
    EXPECT_EQ(m["name"], "mh_torch_small");
    EXPECT_EQ(m["versions"], json::array({"1"}));
    EXPECT_EQ(m["inputs"][0]["name"], "queries");
    EXPECT_TRUE(m["inputs"][0]["shape"][0].is_number_integer()) << "shapes are numbers";
  }
  // A layer's metadata and config say what ListModels says of it.
  grpc::ClientContext context;
  v1::ListModelsResponse models;
  ASSERT_TRUE(server_->Stub()->ListModels(&context, v1::ListModelsRequest(), &models).ok());
  int layers = 0;
  for (const v1::ModelInfo& info : models.models()) {
    if (info.rope_type().empty() && !info.alibi()) continue;
    ++layers;
    const json m = json::parse(Call("GET", "/v2/models/" + info.name()).body);
    const json c = json::parse(Call("GET", "/v2/models/" + info.name() + "/config").body);
    const std::map<std::string, std::string> expected = {
        {"num_heads", std::to_string(info.num_heads())},
        {"num_kv_heads", std::to_string(info.num_kv_heads())},
        {"head_dim", std::to_string(info.head_dim())},
        {"rope_type", info.rope_type()},
        {"sliding_window", std::to_string(info.sliding_window())},
        {"alibi", info.alibi() ? "true" : "false"}};
    for (const auto& [name, value] : expected) {
      EXPECT_EQ(m["properties"][name], value) << info.name() << " " << name << ": " << m.dump();
      EXPECT_EQ(c["parameters"][name]["string_value"], value) << info.name() << " " << name;
    }
    EXPECT_EQ(m["inputs"].back()["name"], "position_ids") << info.name();
  }
  EXPECT_GT(layers, 0) << "the conformance repository has the layers";
  EXPECT_EQ(Call("GET", "/v2/models/mh_torch_small/versions/7").status, 404);
  EXPECT_EQ(Call("GET", "/v2/models/no_such_model").status, 404);
  EXPECT_EQ(Call("GET", "/v2/models/dot_product/ready").status, 200);
  EXPECT_EQ(Call("GET", "/v2/models/no_such_model/ready").status, 400);

  const json config = json::parse(Call("GET", "/v2/models/dot_product/config").body);
  EXPECT_EQ(config["name"], "dot_product");
  EXPECT_EQ(config["max_batch_size"], 0);
  EXPECT_EQ(config["input"][0]["data_type"], "TYPE_FP32");
  EXPECT_EQ(config["input"][0]["dims"], json::array({-1, -1, -1}));

  ASSERT_EQ(Infer(SmallRequest("dot_product", "s"), Form::kJson).status, 200);
  const json stats = json::parse(Call("GET", "/v2/models/dot_product/stats").body);
  ASSERT_EQ(stats["model_stats"].size(), 1u);
  EXPECT_EQ(stats["model_stats"][0]["inference_count"], 1);
  EXPECT_EQ(stats["model_stats"][0]["inference_stats"]["success"]["count"], 1);
  EXPECT_GT(json::parse(Call("GET", "/v2/models/stats").body)["model_stats"].size(), 1u);

  const json index = json::parse(Call("POST", "/v2/repository/index", "{\"ready\": true}").body);
  ASSERT_TRUE(index.is_array());
  EXPECT_TRUE(std::any_of(index.begin(), index.end(), [](const json& entry) {
    return entry["name"] == "dot_product" && entry["state"] == "READY" && entry["version"] == "1";
  })) << index.dump();
  EXPECT_EQ(Call("POST", "/v2/repository/models/dot_product/load").status, 400)
      << "refused without --model-control explicit";

  EXPECT_EQ(Call("GET", "/v3/models").status, 404);
  const HttpResult wrong_method = Call("GET", InferPath("dot_product"));
  EXPECT_EQ(wrong_method.status, 405);
  EXPECT_THAT(wrong_method.body, HasSubstr("expected POST"));
  EXPECT_EQ(server_->Stop(), 0) << server_->Log();
}

struct BadRequest {
  std::string name;
  std::string body;
  std::map<std::string, std::string> headers;
  int status;
  std::string message;  // a part of the error that names the field
};

// A body whose JSON part `json_text` is followed by `binary`, with the header
// that says where the binary part starts.
BadRequest WithBinary(std::string name, const std::string& json_text, const std::string& binary,
                      std::string message) {
  return BadRequest{std::move(name),
                    json_text + binary,
                    {{"Inference-Header-Content-Length", std::to_string(json_text.size())}},
                    400,
                    std::move(message)};
}

TEST_F(ServerRestTest, BadRequestsGetTheirStatusAndNameTheField) {
  Start({"--max-message-bytes", "100000"});
  const std::string queries = R"("name": "queries", "datatype": "FP32", "shape": [1, 2, 2])";
  const std::vector<BadRequest> cases = {
      {"json syntax", "{\"inputs\": [", {}, 400, "not valid JSON"},
      {"not an object", "[1, 2]", {}, 400, "expected a JSON object"},
      {"no inputs", "{}", {}, 400, "expected 'inputs'"},
      {"inputs not a list", R"({"inputs": 3})", {}, 400, "inputs: expected a list"},
      {"no name", R"({"inputs": [{"datatype": "FP32"}]})", {}, 400, "inputs[0]: expected a 'name'"},
      {"shape not integers",
       R"({"inputs": [{"name": "queries", "datatype": "FP32", "shape": [1, "2"]}]})",
       {},
       400,
       "inputs[0] 'queries'.shape: expected integers"},
      {"data value not a number",
       "{\"inputs\": [{" + queries + R"(, "data": [1, 2, "3", 4]}]})",
       {},
       400,
       "inputs[0] 'queries'.data[2]: expected a number, got a string"},
      {"data count",
       "{\"inputs\": [{" + queries + R"(, "data": [1, 2, 3]}]})",
       {},
       400,
       "inputs[0] 'queries'.data: 3 values; shape [1, 2, 2] needs 4"},
      {"absurd shape",
       R"({"inputs": [{"name": "queries", "datatype": "FP32",
                       "shape": [1099511627776, 1099511627776], "data": [1]}]})",
       {},
       400,
       "has more than 2^40 elements"},
      {"no data",
       "{\"inputs\": [{" + queries + "}]}",
       {},
       400,
       "expected 'data' or parameters.binary_data_size"},
      {"datatype",
       R"({"inputs": [{"name": "queries", "datatype": "BOOL", "shape": [1], "data": [true]}]})",
       {},
       400,
       "datatype: expected FP32, FP16 or BF16, got 'BOOL'"},
      WithBinary("binary beyond the body",
                 "{\"inputs\": [{" + queries + R"(, "parameters": {"binary_data_size": 16}}]})",
                 "12345678", "only 8 bytes of binary data remain"),
      WithBinary("binary size against the shape",
                 "{\"inputs\": [{" + queries + R"(, "parameters": {"binary_data_size": 8}}]})",
                 "12345678", "are 8 bytes; expected 16"),
      WithBinary("bytes after the inputs",
                 "{\"inputs\": [{" + queries + R"(, "data": [1, 2, 3, 4]}]})", "xx",
                 "2 bytes of binary data follow"),
      {"header length beyond the body",
       "{}",
       {{"Inference-Header-Content-Length", "99"}},
       400,
       "Inference-Header-Content-Length: 99 is longer than the body"},
      {"timeout header",
       "{}",
       {{"Inference-Timeout-Ms", "soon"}},
       400,
       "Inference-Timeout-Ms: expected a positive whole number"},
      {"parameter type",
       "{\"inputs\": [{" + queries + R"(, "data": [1, 2, 3, 4]}], "parameters": {"causal": 1}})",
       {},
       400,
       "parameters 'causal': expected bool_param"},
      {"position_ids datatype",
       "{\"inputs\": [{" + queries + R"(, "data": [1, 2, 3, 4]},
                      {"name": "position_ids", "datatype": "FP32", "shape": [2], "data": [0, 1]}]})",
       {},
       400,
       "inputs 'position_ids': datatype: expected INT32 or INT64, got 'FP32'"},
      {"position_ids for a model that reads none",
       "{\"inputs\": [{" + queries + R"(, "data": [1, 2, 3, 4]},
                      {"name": "position_ids", "datatype": "INT64", "shape": [2], "data": [0, 1]}]})",
       {},
       400,
       "position_ids: model 'dot_product' has neither rotary positions nor ALiBi"},
      {"sliding_window not an integer",
       "{\"inputs\": [{" + queries +
           R"(, "data": [1, 2, 3, 4]}], "parameters": {"sliding_window": 2.5}})",
       {},
       400,
       "parameters 'sliding_window': expected int64_param, got double_param"},
      // A whole number is a float parameter's value like any other, so the
      // engine, not the decoding, refuses this one.
      {"softcap negative, as an integer",
       "{\"inputs\": [{" + queries + R"(, "data": [1, 2, 3, 4]}], "parameters": {"softcap": -1}})",
       {},
       400,
       "softcap: expected a finite value >= 0 (0: none), got -1"},
      {"compressed", "{}", {{"Content-Encoding", "gzip"}}, 415, "'gzip' is not supported"},
      {"body too large", std::string(200000, ' '), {}, 413, "body is larger"},
      {"header too large", "{}", {{"X-Padding", std::string(20000, 'x')}}, 431, "header block"},
  };
  for (const BadRequest& c : cases) {
    const HttpResult result = Call("POST", InferPath("dot_product"), c.body, c.headers);
    EXPECT_EQ(result.status, c.status) << c.name << ": " << result.body << result.error;
    EXPECT_THAT(result.body, HasSubstr(c.message)) << c.name;
  }
  // Each refusal was the dispatcher's and is counted under api="http".
  const std::string metrics = ScrapeMetrics(server_->metrics_address());
  EXPECT_EQ(MetricValue(metrics, "attention_api_requests_total",
                        {{"api", "http"}, {"model", "dot_product"}, {"code", "INVALID_ARGUMENT"}}),
            cases.size() - 3)
      << "all but the transport's own 413 and 431, and the 415";
  EXPECT_EQ(server_->Stop(), 0) << server_->Log();
}

TEST_F(ServerRestTest, TokensGuardEverythingButHealth) {
  const TempDir dir;
  WriteFile(dir.path() / "tokens", "secret-token\n");
  Start({"--auth-token-file", (dir.path() / "tokens").string()});
  const v1::AttendRequest request = SmallRequest("dot_product", "t");
  const HttpResult anonymous = Infer(request, Form::kJson);
  EXPECT_EQ(anonymous.status, 401);
  EXPECT_EQ(anonymous.headers.at("www-authenticate"), "Bearer");
  EXPECT_THAT(anonymous.body, HasSubstr("Authorization: Bearer"));
  EXPECT_EQ(Infer(request, Form::kJson, {{"Authorization", "Bearer wrong"}}).status, 401);
  EXPECT_EQ(Infer(request, Form::kBinary, {{"Authorization", "Bearer secret-token"}}).status, 200);
  EXPECT_EQ(Call("GET", "/v2/models/dot_product").status, 401);
  EXPECT_EQ(
      Call("GET", "/v2/models/dot_product", "", {{"Authorization", "Bearer secret-token"}}).status,
      200);
  EXPECT_EQ(Call("GET", "/v2/health/ready").status, 200);
  EXPECT_EQ(Call("GET", "/v2/health/live").status, 200);
  EXPECT_EQ(server_->Stop(), 0) << server_->Log();
}

TEST_F(ServerRestTest, RestAndGrpcRequestsMergeIntoOneBatchAndAnswerAsAlone) {
  Start({"--max-batch-size", "16", "--max-queue-delay-us", "1000"});
  constexpr int kRequests = 6;
  std::vector<v1::AttendRequest> requests;
  std::vector<v1::AttendResponse> alone(kRequests);
  auto stub = server_->Stub();
  for (int i = 0; i < kRequests; ++i) {
    requests.push_back(SmallRequest("gate", "r" + std::to_string(i), 0.5f * static_cast<float>(i)));
    v1::AttendRequest request = requests[i];
    request.set_model("dot_product");
    ASSERT_TRUE(AttendWithin(*stub, std::chrono::seconds(60), request, &alone[i]).ok());
  }
  auto held = std::async(std::launch::async, [&] { return Infer(requests[0], Form::kBinary); });
  EXPECT_EQ(held.wait_for(kHeldFor), std::future_status::timeout);
  std::vector<std::future<HttpResult>> rest;
  std::vector<std::future<v1::AttendResponse>> grpc;
  for (int i = 1; i < kRequests; ++i) {
    if (i % 2 == 1) {
      rest.push_back(std::async(std::launch::async, [&, i] {
        return Infer(requests[i], i % 4 == 1 ? Form::kJson : Form::kBinary);
      }));
    } else {
      grpc.push_back(std::async(std::launch::async, [&, i] {
        v1::AttendResponse response;
        EXPECT_TRUE(AttendWithin(*stub, std::chrono::seconds(60), requests[i], &response).ok());
        return response;
      }));
    }
  }
  WaitForMetrics(
      server_->metrics_address(),
      [&](const std::string& text) {
        return MetricValue(text, "attention_queue_depth", {{"model", "gate"}}) >= kRequests - 1;
      },
      std::chrono::seconds(30));
  ASSERT_TRUE(gate_.Release(2));

  auto check = [&](const HttpResult& result) {
    ASSERT_EQ(result.status, 200) << result.body;
    const int i = std::stoi(json::parse(result.body.substr(
        0, result.headers.contains("inference-header-content-length")
               ? std::stoul(result.headers.at("inference-header-content-length"))
               : result.body.size()))["id"]
                                .get<std::string>()
                                .substr(1));
    std::map<std::string, Output> outputs = ReadOutputs(result);
    EXPECT_THAT(outputs["output"].data,
                ::testing::Pointwise(::testing::FloatNear(1e-5), alone[i].output().data()));
    EXPECT_THAT(
        outputs["attention_weights"].data,
        ::testing::Pointwise(::testing::FloatNear(1e-5), alone[i].attention_weights().data()));
  };
  check(held.get());
  for (auto& f : rest) check(f.get());
  for (auto& f : grpc) {
    const v1::AttendResponse response = f.get();
    const int i = std::stoi(response.request_id().substr(1));
    EXPECT_THAT(response.output().data(),
                ::testing::Pointwise(::testing::FloatNear(1e-5), alone[i].output().data()));
  }
  const std::string metrics = ScrapeMetrics(server_->metrics_address());
  EXPECT_EQ(MetricValue(metrics, "attention_batch_size_count", {{"model", "gate"}}), 2)
      << "one held batch, then one merged batch of the other five";
  EXPECT_EQ(MetricValue(metrics, "attention_api_requests_total",
                        {{"api", "http"}, {"model", "gate"}, {"code", "OK"}}),
            1 + rest.size());
  EXPECT_EQ(MetricValue(metrics, "attention_api_requests_total",
                        {{"api", "attention"}, {"model", "gate"}, {"code", "OK"}}),
            grpc.size());
  EXPECT_EQ(server_->Stop(), 0) << server_->Log();
}

TEST_F(ServerRestTest, DrainAnswersAcceptedCallsAndRefusesNewOnesWith503) {
  Start({"--shutdown-grace-seconds", "30"});
  auto held = std::async(std::launch::async,
                         [&] { return Infer(SmallRequest("gate", "held"), Form::kJson); });
  EXPECT_EQ(held.wait_for(kHeldFor), std::future_status::timeout);
  server_->Signal(SIGTERM);
  int ready = 200;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (ready == 200 && std::chrono::steady_clock::now() < give_up) {
    ready = Call("GET", "/v2/health/ready").status;
    if (ready == 200) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(ready, 503) << "ready 30 s after SIGTERM";
  EXPECT_EQ(Call("GET", "/v2/health/live").status, 200);
  const HttpResult late = Infer(SmallRequest("dot_product", "late"), Form::kJson);
  EXPECT_EQ(late.status, 503) << late.body;
  EXPECT_THAT(late.body, HasSubstr("shutting down"));

  ASSERT_TRUE(gate_.Release());
  const HttpResult answered = held.get();
  ASSERT_EQ(answered.status, 200) << answered.body;
  EXPECT_EQ(ReadOutputs(answered)["output"].data.size(), 6u);
  EXPECT_EQ(server_->Wait(), 0) << server_->Log();
}

TEST_F(ServerRestTest, DeadlineHeaderEndsAQueuedRequestWith504) {
  Start({"--max-batch-size", "1"});
  auto held = std::async(std::launch::async,
                         [&] { return Infer(SmallRequest("gate", "held"), Form::kJson); });
  EXPECT_EQ(held.wait_for(kHeldFor), std::future_status::timeout);
  auto expiring = std::async(std::launch::async, [&] {
    return Infer(SmallRequest("gate", "late"), Form::kJson, {{"Inference-Timeout-Ms", "300"}});
  });
  WaitForMetrics(
      server_->metrics_address(),
      [](const std::string& text) {
        return MetricValue(text, "attention_queue_depth", {{"model", "gate"}}) >= 1;
      },
      std::chrono::seconds(30));
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  ASSERT_TRUE(gate_.Release(2));
  EXPECT_EQ(held.get().status, 200);
  const HttpResult late = expiring.get();
  EXPECT_EQ(late.status, 504) << late.body;
  EXPECT_THAT(late.body, HasSubstr("deadline"));
  EXPECT_EQ(server_->Stop(), 0) << server_->Log();
}

TEST_F(ServerRestTest, AClientThatClosesItsConnectionCancelsItsRequest) {
  Start({"--max-batch-size", "1"});
  auto held = std::async(std::launch::async,
                         [&] { return Infer(SmallRequest("gate", "held"), Form::kJson); });
  EXPECT_EQ(held.wait_for(kHeldFor), std::future_status::timeout);
  {
    const RestRequest rest = ToRest(SmallRequest("gate", "left"), Form::kJson);
    TcpConnection leaving(server_->http_address());
    ASSERT_TRUE(leaving.Send("POST /v2/models/gate/infer HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                             std::to_string(rest.body.size()) + "\r\n\r\n" + rest.body));
    WaitForMetricAtLeast(server_->metrics_address(), "attention_queue_depth",
                         {{"model", "gate"}}, 1);
  }  // closed while queued
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ASSERT_TRUE(gate_.Release(2));
  EXPECT_EQ(held.get().status, 200);
  const std::string metrics = WaitForMetricAtLeast(
      server_->metrics_address(), "attention_api_requests_total", {{"code", "CANCELLED"}}, 1);
  EXPECT_EQ(MetricValue(metrics, "attention_api_requests_total",
                        {{"api", "http"}, {"model", "gate"}, {"code", "CANCELLED"}}),
            1);
  EXPECT_EQ(MetricValue(metrics, "attention_batch_size_sum", {{"model", "gate"}}), 1)
      << "only the held request was computed";
  EXPECT_EQ(server_->Stop(), 0) << server_->Log();
}

TEST_F(ServerRestTest, ConnectionsAreCappedAndSlowClientsClosed) {
  Start({"--http-max-connections", "2", "--http-timeout-seconds", "0.5"});
  HttpClient first(server_->http_address());
  HttpClient second(server_->http_address());
  ASSERT_EQ(first.Call("GET", "/v2/health/live").status, 200);
  ASSERT_EQ(second.Call("GET", "/v2/health/live").status, 200);
  HttpClient third(server_->http_address());
  EXPECT_EQ(third.Call("GET", "/v2/health/live").status, 0) << "a third connection is closed";
  // Kept alive past the timeout, the first two are closed, which frees
  // their places.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_EQ(first.Call("GET", "/v2/health/live").status, 0);
  EXPECT_EQ(HttpCall(server_->http_address(), "GET", "/v2/health/live").status, 200);

  // A client that never finishes its header block is closed at the timeout.
  TcpConnection slow(server_->http_address());
  ASSERT_TRUE(slow.connected());
  ASSERT_TRUE(slow.Send("POST /v2/models/dot_product/infer HTTP/1.1\r\nHost: x\r\n"));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(slow.ReadUntilClosed());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  EXPECT_EQ(server_->Stop(), 0) << server_->Log();
}

}  // namespace
}  // namespace attention::testing
