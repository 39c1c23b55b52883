// run_server.h: runs attention-server until SIGTERM or SIGINT.
//
// Start-up: logging, credentials, the model repository (built-ins plus every
// readable file; bad files are logged with their reason, or are fatal with
// --strict), one batcher per model, the gRPC server with health checking and
// reflection, the metrics endpoint, then a summary of all of it in the log.
//
// Shutdown on SIGTERM/SIGINT: health turns NOT_SERVING, new requests are
// refused with UNAVAILABLE, every accepted request is answered (calls still
// open after --shutdown-grace-seconds are cancelled), then RunServer returns 0.
#pragma once

#include "server/config/server_config.h"

namespace attention::server {

// The process exit code: 0 after a clean shutdown, non-zero when start-up
// failed (the reason is logged).
int RunServer(const ServerConfig& config);

}  // namespace attention::server
