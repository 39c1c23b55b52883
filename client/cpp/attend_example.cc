// attend_example.cc: the C++ client library in a few lines, as the README
// shows it: dot-product attention for one query over three keys, then the
// answer and the attention weights printed.
//
//   build/client/attention-client-example 127.0.0.1:50051[,127.0.0.1:50052...]
#include <iostream>

#include "client/cpp/attention_client.h"

int main(int argc, char** argv) {
  attention::client::ClientOptions options;
  if (argc > 1) options.target = argv[1];
  options.timeout = absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<attention::client::AttentionClient>> client =
      attention::client::AttentionClient::Create(options);
  if (!client.ok()) {
    std::cerr << client.status() << "\n";
    return 2;
  }

  // queries (B=1, n_q=1, d=2); keys (1, 3, 2); values (1, 3, 1).
  attention::v1::AttendRequest request;
  request.set_model("dot_product");
  request.set_return_attention_weights(true);
  for (int64_t n : {1, 1, 2}) request.mutable_queries()->add_shape(n);
  for (float x : {1.0f, 0.0f}) request.mutable_queries()->add_data(x);
  for (int64_t n : {1, 3, 2}) request.mutable_keys()->add_shape(n);
  for (float x : {1.0f, 0.0f, 0.0f, 1.0f, -1.0f, 0.0f}) request.mutable_keys()->add_data(x);
  for (int64_t n : {1, 3, 1}) request.mutable_values()->add_shape(n);
  for (float x : {10.0f, 20.0f, 30.0f}) request.mutable_values()->add_data(x);

  absl::StatusOr<attention::v1::AttendResponse> response = (*client)->Attend(request);
  if (!response.ok()) {
    std::cerr << response.status() << "\n";
    return 1;
  }
  std::cout << "output:";
  for (float x : response->output().data()) std::cout << " " << x;
  std::cout << "\nweights:";
  for (float w : response->attention_weights().data()) std::cout << " " << w;
  std::cout << "\n";
  return 0;
}
