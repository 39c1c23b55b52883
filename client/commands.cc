// commands.cc: models, health, attend and bench (see commands.h).
#include "client/commands.h"

#include <unistd.h>

#include <cstdio>
#include <iostream>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/bench_report.h"
#include "client/proto_json.h"

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

int RunBench(AttentionClient& client, const BenchCommand& command) {
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
                         .load = command.load};
  const bool show_progress = isatty(STDERR_FILENO) == 1;
  LoadGenerator generator(client, *request, command.load);
  const LoadResult result = generator.Run([&](const LoadProgress& progress) {
    if (show_progress) std::cerr << "\r" << FormatProgress(setup, progress) << std::flush;
  });
  // Erases the progress line so the report starts on a clean line.
  if (show_progress) std::cerr << "\r\033[K" << std::flush;

  std::cout << (command.json ? FormatJson(setup, result) + "\n" : FormatReport(setup, result));
  return result.requests > result.errors ? kExitOk : kExitFailed;
}

}  // namespace attention::client
