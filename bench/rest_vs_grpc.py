"""rest_vs_grpc: REST binary infer against gRPC ModelInfer on one
attention-server, the same request through each, alternating rounds (the
targets: REST throughput on small requests at least 70% of gRPC's; REST
latency on [8, 512, 64] within 1.3x of gRPC's).

Both sides use a C load generator of the same design (one thread, event
loop, fixed request body): wrk for HTTP/1.1, h2load for gRPC over HTTP/2 (a
gRPC message is a length-prefixed body with two headers). Each checks that
every answer is 200; h2load cannot read gRPC trailers, so a gRPC call is also
checked once with grpcio before the rounds.

    apt-get install wrk nghttp2-client
    /usr/bin/python3 bench/rest_vs_grpc.py [--rounds 3] [--seconds 10]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

import numpy as np

import bench_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def inference_pb(directory):
    from grpc_tools import protoc
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    if protoc.main(["protoc", "-I", os.path.join(ROOT, "proto"), "-I", include,
                    f"--python_out={directory}", f"--grpc_python_out={directory}",
                    "inference/grpc_service.proto"]) != 0:
        raise RuntimeError("protoc failed")
    sys.path.insert(0, directory)
    from inference import grpc_service_pb2, grpc_service_pb2_grpc
    return grpc_service_pb2, grpc_service_pb2_grpc


def bodies(pb, shape, directory, name):
    """The same self-attention request as a REST binary body and a gRPC frame."""
    queries = np.random.default_rng(0).random(shape, dtype=np.float32)
    header = ('{"inputs":[{"name":"queries","datatype":"FP32","shape":%s,'
              '"parameters":{"binary_data_size":%d}}],'
              '"parameters":{"binary_data_output":true}}' % (list(shape), queries.nbytes))
    rest = os.path.join(directory, f"{name}.rest")
    with open(rest, "wb") as f:
        f.write(header.encode() + queries.tobytes())
    request = pb.ModelInferRequest(model_name="dot_product")
    request.inputs.add(name="queries", datatype="FP32", shape=list(shape))
    request.raw_input_contents.append(queries.tobytes())
    message = request.SerializeToString()
    grpc_file = os.path.join(directory, f"{name}.grpc")
    with open(grpc_file, "wb") as f:
        f.write(b"\0" + len(message).to_bytes(4, "big") + message)
    return rest, len(header), grpc_file, request


def run_wrk(address, body, header_length, concurrency, seconds, directory):
    script = os.path.join(directory, "wrk.lua")
    with open(script, "w") as f:
        f.write(f'wrk.method = "POST"\n'
                f'wrk.body = io.open("{body}", "rb"):read("*a")\n'
                f'wrk.headers["Inference-Header-Content-Length"] = "{header_length}"\n'
                'done = function(summary, latency, requests)\n'
                '  io.write(string.format("p50_us %d\\n", latency:percentile(50)))\n'
                'end\n')
    out = subprocess.run(["wrk", "-t1", f"-c{concurrency}", f"-d{seconds}s", "-s", script,
                          f"http://{address}/v2/models/dot_product/infer"],
                         capture_output=True, text=True, check=True).stdout
    if "Non-2xx" in out:
        raise RuntimeError("REST answers that are not 200:\n" + out)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = float(re.search(r"p50_us (\d+)", out).group(1)) / 1000
    return rps, p50


def run_h2load(address, body, concurrency, seconds):
    out = subprocess.run(["h2load", "-c", str(concurrency), "-m", "1", "-t", "1",
                          "-D", str(seconds), "--warm-up-time", "1", "-d", body,
                          "-H", "content-type: application/grpc", "-H", "te: trailers",
                          f"http://{address}/inference.GRPCInferenceService/ModelInfer"],
                         capture_output=True, text=True, check=True).stdout
    status = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    if status is None or any(int(status.group(i)) for i in (2, 3, 4)):
        raise RuntimeError("gRPC answers that are not 200:\n" + out)
    rps = float(re.search(r"finished in .*?, ([\d.]+) req/s", out).group(1))
    median = re.search(r"time for request:\s+\S+\s+\S+\s+(\S+)", out).group(1)
    scale = 1e-3 if median.endswith("us") else 1.0
    return rps, float(median.rstrip("ums")) * scale


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        pb, pb_grpc = inference_pb(directory)
        server, addresses = bench_server.start(
            os.path.join(ROOT, "build", "server", "attention-server"),
            flags=["--http-address", "127.0.0.1:0", "--metrics-address", ""])
        try:
            import grpc
            stub = pb_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(addresses["grpc"]))
            print(subprocess.run(["sh", "-c", "lscpu | grep 'Model name'"], capture_output=True,
                                 text=True).stdout.strip(),
                  f"| load average {os.getloadavg()[0]:.2f}")
            for name, shape, concurrency in (("small", (1, 8, 64), 16),
                                             ("large", (8, 512, 64), 1)):
                rest, header_length, grpc_body, request = bodies(pb, shape, directory, name)
                stub.ModelInfer(request, timeout=30)  # the gRPC body is a valid call
                runs = {"rest": [], "grpc": []}
                for _ in range(args.rounds):
                    runs["rest"].append(run_wrk(addresses["http"], rest, header_length,
                                                concurrency, args.seconds, directory))
                    runs["grpc"].append(run_h2load(addresses["grpc"], grpc_body, concurrency,
                                                   args.seconds))
                for side, results in runs.items():
                    print(f"{name} {list(shape)} c={concurrency} {side}: " +
                          ", ".join(f"{rps:.0f} req/s p50 {p50:.2f} ms" for rps, p50 in results))
                rps = {side: statistics.median(r[0] for r in results)
                       for side, results in runs.items()}
                p50 = {side: statistics.median(r[1] for r in results)
                       for side, results in runs.items()}
                print(f"{name}: REST/gRPC throughput {rps['rest'] / rps['grpc']:.2f}, "
                      f"p50 latency {p50['rest'] / p50['grpc']:.2f}x (medians of {args.rounds})")
        finally:
            bench_server.stop(server)


if __name__ == "__main__":
    main()
