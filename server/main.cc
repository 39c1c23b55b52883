// main.cc: attention-server, the gRPC attention inference service.
#include "CLI/CLI.hpp"
#include "server/run_server.h"
#include "server/server_config.h"
#include "server/server_flags.h"

int main(int argc, char** argv) {
  attention::server::ServerConfig config;
  CLI::App app{
      "attention-server: serves attention models over gRPC (attention.v1.AttentionService).\n"
      "Every flag can also be set as ATTENTION_<FLAG> (e.g. ATTENTION_MAX_BATCH_SIZE); a flag on "
      "the command line wins."};
  attention::server::AddServerFlags(app, &config);
  CLI11_PARSE(app, argc, argv);
  return attention::server::RunServer(config);
}
