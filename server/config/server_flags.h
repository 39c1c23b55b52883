// server_flags.h: attention-server's command line (CLI11).
//
// Every flag --some-name is also read from ATTENTION_SOME_NAME; a flag given
// on the command line wins over the environment. --help lists each flag with
// its default.
#pragma once

#include "CLI/CLI.hpp"
#include "server/config/server_config.h"

namespace attention::server {

// Registers every flag of ServerConfig on `app`, bound to `config`, whose
// current values are shown as the defaults.
void AddServerFlags(CLI::App& app, ServerConfig* config);

}  // namespace attention::server
