"""check_tritonclient_http: Triton's own HTTP client (tritonclient.http) against
a running attention-server's REST port. A local check, not run in CI: it
needs Triton's client sources, which are not part of this repository.

    git clone https://github.com/triton-inference-server/client /tmp/triton-client
    apt-get install python3-geventhttpclient python3-rapidjson
    /usr/bin/python3 tools/check_tritonclient_http.py \\
        --tritonclient /tmp/triton-client/src/python/library --url 127.0.0.1:8000

Exits non-zero when an answer is wrong: every health, metadata, config,
repository and statistics call, and infer with binary and JSON tensors both
ways, FP16 inputs, the default binary outputs and an unknown model's 404.
"""
import argparse
import sys

import numpy as np


def reference(queries, causal):
    scores = queries @ queries.transpose(0, 2, 1) / np.sqrt(queries.shape[-1])
    if causal:
        n = queries.shape[1]
        scores = np.where(np.tril(np.ones((n, n))) > 0, scores, -1e6)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return weights @ queries, weights


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tritonclient", required=True, help="src/python/library of Triton's client")
    parser.add_argument("--url", required=True, help="HOST:PORT of --http-address")
    args = parser.parse_args()
    sys.path.insert(0, args.tritonclient)
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(args.url)
    problems = []

    def expect(condition, what):
        print(("ok   " if condition else "FAIL ") + what)
        if not condition:
            problems.append(what)

    expect(client.is_server_live() and client.is_server_ready(), "server live and ready")
    expect(client.get_server_metadata()["name"] == "attention-server", "server metadata")
    expect(client.is_model_ready("dot_product"), "model ready")
    expect(client.get_model_metadata("dot_product")["inputs"][0]["shape"] == [-1, -1, -1],
           "model metadata")
    expect(client.get_model_config("dot_product")["max_batch_size"] == 0, "model config")
    expect(any(m["name"] == "dot_product" for m in client.get_model_repository_index()),
           "repository index")

    queries = np.random.default_rng(0).random((2, 4, 8), dtype=np.float32)
    want_output, want_weights = reference(queries.astype(np.float64), causal=True)
    for binary in (True, False):
        tensor = httpclient.InferInput("queries", list(queries.shape), "FP32")
        tensor.set_data_from_numpy(queries, binary_data=binary)
        outputs = [httpclient.InferRequestedOutput("output", binary_data=binary),
                   httpclient.InferRequestedOutput("attention_weights", binary_data=not binary)]
        result = client.infer("dot_product", [tensor], outputs=outputs,
                              parameters={"causal": True}, request_id="r1")
        expect(np.abs(result.as_numpy("output") - want_output).max() < 1e-5
               and np.abs(result.as_numpy("attention_weights") - want_weights).max() < 1e-5
               and result.get_response()["id"] == "r1",
               f"infer, binary inputs {binary}")

    tensor = httpclient.InferInput("queries", list(queries.shape), "FP16")
    tensor.set_data_from_numpy(queries.astype(np.float16))
    result = client.infer("dot_product", [tensor], timeout=10**6)
    expect(result.as_numpy("output").shape == (2, 4, 8), "FP16 input, default binary outputs")
    try:
        client.infer("no_such_model", [tensor])
        expect(False, "unknown model refused")
    except InferenceServerException as error:
        expect(error.status() == "404", f"unknown model refused: {error.status()} {error.message()}")
    stats = client.get_inference_statistics("dot_product")["model_stats"][0]
    expect(stats["inference_count"] >= 3, "statistics count the calls")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
