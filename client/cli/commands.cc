// commands.cc: models, health, attend (one request or a stream) and bench
// (see commands.h).
#include "client/cli/commands.h"

#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <optional>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/cli/bench_report.h"
#include "client/cli/inference_request.h"
#include "client/cli/proto_json.h"

namespace attention::client {
namespace {

int Fail(const absl::Status& status) {
  std::cerr << "error: " << absl::StatusCodeToString(status.code()) << ": "
            << status.message() << "\n";
  return kExitFailed;
}

int BadInput(const absl::Status& status) {
  std::cerr << "error: " << status.message() << "\n";
  return kExitBadInput;
}

absl::StatusOr<attention::v1::AttendRequest> RequestFromFile(const std::string& path) {
  absl::StatusOr<std::string> json = ReadInput(path);
  if (!json.ok()) return json.status();
  return ParseAttendRequest(*json);
}

// The requests of a JSON-lines text, one per non-blank line.
absl::StatusOr<std::vector<attention::v1::AttendRequest>> ParseAttendRequestLines(
    const std::string& text) {
  std::vector<attention::v1::AttendRequest> requests;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    absl::StatusOr<attention::v1::AttendRequest> request =
        ParseAttendRequest(std::string(line));
    if (!request.ok()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("line %d: %s", line_number, request.status().message()));
    }
    requests.push_back(*std::move(request));
  }
  if (requests.empty()) {
    return absl::InvalidArgumentError("no request: expected one AttendRequest per line");
  }
  return requests;
}

// A request shaped for the model as the server describes it.
absl::StatusOr<attention::v1::AttendRequest> GeneratedRequest(
    const attention::v1::ListModelsResponse& models, const GeneratedRequestShape& shape) {
  std::vector<std::string> names;
  for (const attention::v1::ModelInfo& model : models.models()) {
    if (model.name() == shape.model) return GenerateRequest(shape, model);
    names.push_back(model.name());
  }
  return absl::NotFoundError(absl::StrFormat("--model '%s' is not served; the models are: %s",
                                             shape.model, absl::StrJoin(names, ", ")));
}

}  // namespace

int RunModels(AttentionClient& client, bool json) {
  absl::StatusOr<attention::v1::ListModelsResponse> models = client.ListModels();
  if (!models.ok()) return Fail(models.status());
  if (json) {
    std::cout << ToJson(*models, /*pretty=*/true) << "\n";
    return kExitOk;
  }
  // Sizes of 0 mean the model takes any size.
  const auto size = [](int64_t n) { return n == 0 ? std::string("any") : std::to_string(n); };
  std::cout << absl::StrFormat("%-24s %-12s %5s %6s %6s %6s %6s\n", "NAME", "KIND", "HEADS",
                               "D_Q", "D_K", "D_V", "D_OUT");
  for (const attention::v1::ModelInfo& m : models->models()) {
    std::cout << absl::StrFormat("%-24s %-12s %5d %6s %6s %6s %6s\n", m.name(), m.kind(),
                                 m.num_heads(), size(m.query_size()), size(m.key_size()),
                                 size(m.value_size()), size(m.output_size()));
  }
  return kExitOk;
}

int RunRepository(AttentionClient& client, bool json) {
  absl::StatusOr<inference::RepositoryIndexResponse> index = client.RepositoryIndex();
  if (!index.ok()) return Fail(index.status());
  if (json) {
    std::cout << ToJson(*index, /*pretty=*/true) << "\n";
    return kExitOk;
  }
  std::cout << absl::StrFormat("%-24s %-8s %-12s %s\n", "NAME", "VERSION", "STATE", "REASON");
  for (const auto& m : index->models()) {
    std::cout << absl::StrFormat("%-24s %-8s %-12s %s\n", m.name(), m.version(), m.state(),
                                 m.reason());
  }
  return kExitOk;
}

int RunLoad(AttentionClient& client, const std::string& model) {
  if (absl::Status status = client.LoadModel(model); !status.ok()) return Fail(status);
  std::cout << "loaded " << model << "\n";
  return kExitOk;
}

int RunUnload(AttentionClient& client, const std::string& model) {
  if (absl::Status status = client.UnloadModel(model); !status.ok()) return Fail(status);
  std::cout << "unloaded " << model << "\n";
  return kExitOk;
}

int RunHealth(AttentionClient& client, const std::string& service) {
  using grpc::health::v1::HealthCheckResponse;
  absl::StatusOr<HealthCheckResponse::ServingStatus> status = client.Health(service);
  if (!status.ok()) return Fail(status.status());
  std::cout << HealthCheckResponse::ServingStatus_Name(*status) << "\n";
  return *status == HealthCheckResponse::SERVING ? kExitOk : kExitFailed;
}

int RunAttend(AttentionClient& client, const std::string& input, bool pretty) {
  absl::StatusOr<std::string> json = ReadInput(input);
  if (!json.ok()) return BadInput(json.status());
  absl::StatusOr<attention::v1::AttendRequest> request = ParseAttendRequest(*json);
  if (!request.ok()) return BadInput(request.status());
  absl::StatusOr<attention::v1::AttendResponse> response = client.Attend(*request);
  if (!response.ok()) return Fail(response.status());
  std::cout << ToJson(*response, pretty) << "\n";
  return kExitOk;
}

int RunAttendStream(AttentionClient& client, const std::string& input) {
  absl::StatusOr<std::string> text = ReadInput(input);
  if (!text.ok()) return BadInput(text.status());
  absl::StatusOr<std::vector<attention::v1::AttendRequest>> requests =
      ParseAttendRequestLines(*text);
  if (!requests.ok()) return BadInput(requests.status());
  absl::StatusOr<AttentionClient::StreamResults> results = client.AttendStream(*requests);
  if (!results.ok()) return Fail(results.status());
  size_t failed = 0;
  for (size_t i = 0; i < results->size(); ++i) {
    const absl::StatusOr<attention::v1::AttendResponse>& result = (*results)[i];
    if (result.ok()) {
      std::cout << ToJson(*result, /*pretty=*/false) << "\n";
      continue;
    }
    ++failed;
    attention::v1::AttendResponse answer;
    answer.set_request_id((*requests)[i].request_id());
    answer.set_model((*requests)[i].model());
    answer.mutable_error()->set_code(static_cast<int32_t>(result.status().code()));
    answer.mutable_error()->set_message(std::string(result.status().message()));
    std::cout << ToJson(answer, /*pretty=*/false) << "\n";
  }
  if (failed == 0) return kExitOk;
  std::cerr << "error: " << failed << " of " << results->size() << " requests failed\n";
  return kExitFailed;
}

int RunSessionBench(AttentionClient& client, const BenchCommand& command) {
  const SessionBenchOptions options{.model = command.shape.model,
                                    .sessions = command.sessions,
                                    .steps = command.steps_per_session,
                                    .tokens_per_step = command.tokens_per_step,
                                    .dim = command.shape.dim};
  if (absl::Status valid = ValidateSessionBench(options); !valid.ok()) return BadInput(valid);
  absl::StatusOr<attention::v1::ListModelsResponse> models = client.ListModels();
  if (!models.ok()) return Fail(models.status());
  int64_t query_size = -1;
  for (const attention::v1::ModelInfo& model : models->models()) {
    if (model.name() == options.model) query_size = model.query_size();
  }
  if (query_size < 0) {
    return BadInput(absl::NotFoundError(
        absl::StrFormat("--model '%s' is not served (`attention-client models`)", options.model)));
  }
  const SessionBenchResult result = RunSessions(client, options, query_size);
  std::cout << (command.json ? FormatSessionJson(command.target, options, result) + "\n"
                             : FormatSessionReport(command.target, options, result));
  return result.steps > result.errors ? kExitOk : kExitFailed;
}

int RunBench(AttentionClient& client, const BenchCommand& command) {
  if (command.sessions > 0) return RunSessionBench(client, command);
  if (absl::Status valid = LoadGenerator::Validate(command.load); !valid.ok()) {
    return BadInput(valid);
  }
  absl::StatusOr<attention::v1::AttendRequest> request;
  if (!command.request_file.empty()) {
    request = RequestFromFile(command.request_file);
  } else {
    absl::StatusOr<attention::v1::ListModelsResponse> models = client.ListModels();
    if (!models.ok()) return Fail(models.status());
    request = GeneratedRequest(*models, command.shape);
  }
  if (!request.ok()) return BadInput(request.status());

  const BenchSetup setup{.target = command.target, .model = request->model(),
                         .api = command.api, .load = command.load};
  const bool show_progress = isatty(STDERR_FILENO) == 1;
  std::optional<inference::ModelInferRequest> infer_request;
  if (command.api == "inference") infer_request = ToModelInferRequest(*request);
  LoadGenerator generator = infer_request ? LoadGenerator(client, *infer_request, command.load)
                                          : LoadGenerator(client, *request, command.load);
  const LoadResult result = generator.Run([&](const LoadProgress& progress) {
    if (show_progress) std::cerr << "\r" << FormatProgress(setup, progress) << std::flush;
  });
  // Erases the progress line so the report starts on a clean line.
  if (show_progress) std::cerr << "\r\033[K" << std::flush;

  std::cout << (command.json ? FormatJson(setup, result) + "\n" : FormatReport(setup, result));
  return result.requests > result.errors ? kExitOk : kExitFailed;
}

}  // namespace attention::client
