// repository_views.h: the registry as the APIs describe it: attention.v1's
// ListModels and the Open Inference Protocol's RepositoryIndex
// (docs/api.md, sections 1 and 9.1).
#pragma once

#include "attention.pb.h"
#include "inference/grpc_service.pb.h"
#include "server/repository/registry.h"

namespace attention::server {

// Every model with a ready version (every model known, with
// `include_unavailable`), in name order; each with its versions and states,
// the versions still unloading included.
void ListRegistry(const ModelRegistry& registry, bool include_unavailable,
                  v1::ListModelsResponse* response);

// One entry per model version, state "READY", "LOADING", "UNLOADING" or
// "UNAVAILABLE" (failed, with its reason); only the ready ones with
// `ready_only`.
void IndexRegistry(const ModelRegistry& registry, bool ready_only,
                   inference::RepositoryIndexResponse* response);

}  // namespace attention::server
