// inference_request.h: an AttendRequest restated as an Open Inference
// Protocol ModelInferRequest, so `attention-client bench --api inference`
// loads the server with exactly the request `--api attention` sends.
//
// Tensors go in raw_input_contents (FP32 little-endian, valid_lens INT32,
// position_ids INT64), as Triton's clients send them; causal, scale,
// sliding_window, softcap and return_attention_weights become request
// parameters (docs/api.md section 9).
#pragma once

#include "attention.pb.h"
#include "inference/grpc_service.pb.h"

namespace attention::client {

inference::ModelInferRequest ToModelInferRequest(const attention::v1::AttendRequest& request);

}  // namespace attention::client
