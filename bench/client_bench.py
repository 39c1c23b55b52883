"""client_bench.py: the time of one call through each client path, against
one attention-server on 127.0.0.1 (BENCHMARKS.md,
"Sessions and clients"). One call at a time, self-attention on `dot_product` (queries
only: the server takes keys = values = queries), at each --shape.

Paths:
  cpp          attention-client bench --concurrency 1 (Attend)
  cpp-infer    attention-client bench --concurrency 1 --api inference
               (Open Inference Protocol ModelInfer, raw contents)
  py           the attention-client package: attend(q), the packed float
               field written from and read into numpy memory
  py-qkv       the same, attend(q, q, q) (keys and values sent too)
  py-old       the list-based client of main at f50c5dd (`git show`), attend(q)
  py-infer     ModelInfer with raw_input_contents from plain grpcio stubs
               generated from proto/inference/grpc_service.proto (what
               Triton's client sends), np.frombuffer on raw_output_contents
  node         the Node package (client/node): attend with a Float32Array,
               over node:http2
  node-grpcjs  the same at 2187477 (`git show`), attend over grpc-js
  node-old     the same at a0a89a0, before its request buffer was reused
               and answers were views on the received bytes
  torch        PyTorch in-process: bmm, softmax, bmm (no server)

Each path runs in its own process, --calls calls after --warmup calls, and
reports the median time per call and the CPU time its process spent per
call (all its threads: what the client costs, whatever else runs on the
machine); --rounds rounds, paths in a rotated order each round, and the
medians over rounds are printed, with each path against cpp: the ratio of
the medians and the median of the rounds' ratios. The C++ client's own loop
reports its p50 over --seconds; its CPU per call is its process's rusage over warm-up and
window (the start of the process included) divided by the calls made.

Run with the Python of a virtual environment the package is installed in
(tests/client/python_install.sh), which also sees Debian's python3-torch:

    bash tests/client/python_install.sh /tmp/attention-venv
    env -u OPENBLAS_CORETYPE /tmp/attention-venv/bin/python bench/client_bench.py \\
        --build build --rounds 5
"""

import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import bench_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ("cpp", "cpp-infer", "py", "py-qkv", "py-old", "py-infer", "node", "node-grpcjs", "node-old",
         "torch")
OLD_CLIENT_COMMIT = "f50c5dd"
# The Node package at these commits: its own files; node_modules and proto are today's.
OLD_NODE_COMMITS = {"node-grpcjs": "2187477", "node-old": "a0a89a0"}


def queries(shape):
    return np.random.default_rng(20240601).normal(size=shape).astype(np.float32)


def timed(call, warmup, calls):
    """(median wall seconds, process CPU seconds) per call of `call()`."""
    for _ in range(warmup):
        call()
    times = []
    cpu_start = time.process_time()
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times), (time.process_time() - cpu_start) / calls


def python_call(path, target, q, scratch):
    """A function making one call of `path` (a Python one) with queries q."""
    if path in ("py", "py-qkv"):
        import attention_client
        client = attention_client.AttentionClient(target)
        if path == "py":
            return lambda: client.attend(q)
        return lambda: client.attend(q, q, q)
    if path == "py-old":
        source = subprocess.run(["git", "-C", REPO, "show",
                                 f"{OLD_CLIENT_COMMIT}:client/python/attention_client.py"],
                                check=True, capture_output=True, text=True).stdout
        module_path = os.path.join(scratch, "old_attention_client.py")
        with open(module_path, "w") as f:
            # Its stubs came from ../../proto relative to itself.
            f.write(source.replace('os.path.join(os.path.dirname(os.path.abspath(__file__)), '
                                   '"..", "..", "proto")', repr(os.path.join(REPO, "proto"))))
        spec = importlib.util.spec_from_file_location("old_attention_client", module_path)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        client = old.AttentionClient(target)
        return lambda: client.attend(q)
    if path == "py-infer":
        return infer_call(target, q, scratch)
    if path == "torch":
        import torch
        tq = torch.from_numpy(q)
        scale = 1.0 / np.sqrt(q.shape[-1])

        def attend():
            with torch.inference_mode():
                weights = torch.softmax(torch.bmm(tq, tq.transpose(1, 2)) * scale, dim=-1)
                return torch.bmm(weights, tq)
        return attend
    raise ValueError(path)


def infer_call(target, q, scratch):
    """ModelInfer with raw contents, stubs generated from the repository's proto."""
    import grpc
    from grpc_tools import protoc
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    proto_dir = os.path.join(REPO, "proto")
    if protoc.main(["protoc", "-I", proto_dir, "-I", include, "--python_out", scratch,
                    "--grpc_python_out", scratch,
                    os.path.join(proto_dir, "inference", "grpc_service.proto")]) != 0:
        raise RuntimeError("protoc failed on proto/inference/grpc_service.proto")
    sys.path.insert(0, scratch)
    from inference import grpc_service_pb2 as pb
    from inference import grpc_service_pb2_grpc as pb_grpc
    channel = grpc.insecure_channel(target, [("grpc.max_receive_message_length", -1)])
    stub = pb_grpc.GRPCInferenceServiceStub(channel)

    def attend():
        request = pb.ModelInferRequest(model_name="dot_product")
        request.inputs.add(name="queries", datatype="FP32", shape=q.shape)
        request.raw_input_contents.append(q.tobytes())
        response = stub.ModelInfer(request)
        return np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(
            tuple(response.outputs[0].shape))
    return attend


def old_node_client(scratch, path):
    """client/node's attention_client.js of OLD_NODE_COMMITS[path] in `scratch`,
    beside today's node_modules and proto copy (npm ci made them)."""
    node_dir = os.path.join(REPO, "client", "node")
    old_dir = os.path.join(scratch, path)
    os.makedirs(old_dir)
    for name in ("attention_client.js", "wire.js"):
        with open(os.path.join(old_dir, name), "w") as f:
            f.write(subprocess.run(["git", "-C", REPO, "show",
                                    f"{OLD_NODE_COMMITS[path]}:client/node/{name}"],
                                   check=True, capture_output=True, text=True).stdout)
    for name in ("node_modules", "proto"):
        os.symlink(os.path.join(node_dir, name), os.path.join(old_dir, name))
    return os.path.join(old_dir, "attention_client.js")


def worker(args):
    """One path in this process: prints its median seconds per call."""
    q = queries(args.shape)
    with tempfile.TemporaryDirectory() as scratch:
        call = python_call(args.worker, args.target, q, scratch)
        seconds, cpu = timed(call, args.warmup, args.calls)
        print(json.dumps({"seconds": seconds, "cpu": cpu}))


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(path, args, target, shape):
    """(median wall seconds, CPU seconds) per call of `path` at `shape`, in a
    process of its own."""
    b, n, d = shape
    if path in ("cpp", "cpp-infer"):
        command = [os.path.join(args.build, "client", "attention-client"), "--target", target,
                   "bench", "--concurrency", "1", "--duration", str(args.seconds),
                   "--warmup", "1", "--json", "--model", "dot_product", "--batch", str(b),
                   "--n", str(n), "--dim", str(d), "--self-attention",
                   "--api", "inference" if path == "cpp-infer" else "attention"]
        cpu_start = children_cpu()
        report = json.loads(subprocess.run(command, check=True, capture_output=True,
                                           text=True).stdout)
        calls = report["requests"] * (1 + 1 / args.seconds)  # the warm-up ran at the same rate
        return report["latency_ms"]["p50"] / 1000, (children_cpu() - cpu_start) / calls
    if path.startswith("node"):
        command = ["node", os.path.join(REPO, "bench", "client_bench.js"), target,
                   f"{b},{n},{d}", str(args.warmup), str(args.calls)]
        if path in OLD_NODE_COMMITS:
            command.append(args.old_node[path])
    else:
        command = [sys.executable, __file__, "--worker", path, "--target", target,
                   "--shape", f"{b},{n},{d}", "--warmup", str(args.warmup),
                   "--calls", str(args.calls)]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{path} failed: {run.stderr[-2000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return result["seconds"], result["cpu"]


def start_server(args):
    """attention-server of --build, without OPENBLAS_CORETYPE and ATTENTION_ISA set: the
    process and its gRPC address."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "ATTENTION_ISA")}
    server, addresses = bench_server.start(
        os.path.join(args.build, "server", "attention-server"),
        flags=["--http-address", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0"], env=env,
        timeout=60)
    return server, addresses["grpc"]


def print_table(shape, paths, seconds, rounds):
    """Medians over rounds of wall time and CPU per call, and each against
    cpp's: the ratio of the medians, and the median of each round's ratio (a
    round runs the paths back to back, so the machine's load, which moves
    from round to round, moves both sides of it alike)."""
    wall = {path: statistics.median(s for s, _ in seconds[path]) for path in paths}
    cpu = {path: statistics.median(c for _, c in seconds[path]) for path in paths}
    print(f"\nshape {list(shape)}, median of {rounds} rounds")
    print(f"{'path':<10} {'ms/call':>8} {'vs cpp':>7} {'per round':>9} {'CPU us/call':>12} "
          f"{'CPU - cpp':>10}  rounds (ms/call)")
    for path in paths:
        ratio = round_ratio = extra = ""
        if "cpp" in paths:
            ratio = f"{wall[path] / wall['cpp']:.2f}x"
            round_ratio = f"{statistics.median(s / c for (s, _), (c, _) in zip(seconds[path], seconds['cpp'])):.2f}x"
            extra = f"{(cpu[path] - cpu['cpp']) * 1e6:.0f}"
        rounds_text = " ".join(f"{s * 1e3:.3f}" for s, _ in seconds[path])
        print(f"{path:<10} {wall[path] * 1e3:>8.3f} {ratio:>7} {round_ratio:>9} {cpu[path] * 1e6:>12.0f} "
              f"{extra:>10}  {rounds_text}")


def shape_arg(text):
    shape = tuple(int(x) for x in text.split(","))
    if len(shape) != 3:
        raise argparse.ArgumentTypeError(f"a shape is B,n,d; got {text!r}")
    return shape


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default=os.path.join(REPO, "build"))
    parser.add_argument("--shape", type=shape_arg, action="append",
                        help="B,n,d (repeatable; default 8,512,64 and 1,1,1024)")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=3, help="the C++ client's window")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.shape = args.shape[0]
        return worker(args)
    shapes = args.shape or [(8, 512, 64), (1, 1, 1024)]
    paths = args.paths.split(",")
    if shutil.which("node") is None:
        paths = [path for path in paths if not path.startswith("node")]
    model = next(line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines()
        if line.startswith("Model name"))
    print(f"CPU: {model}, {os.cpu_count()} CPUs; load average at start "
          f"{open('/proc/loadavg').read().split()[0]}")
    with tempfile.TemporaryDirectory() as scratch:
        server, target = start_server(args)
        args.old_node = {path: old_node_client(scratch, path) for path in paths if path in OLD_NODE_COMMITS}
        try:
            for shape in shapes:
                seconds = {path: [] for path in paths}
                for round_index in range(args.rounds):
                    shift = round_index % len(paths)
                    for path in paths[shift:] + paths[:shift]:
                        seconds[path].append(measure(path, args, target, shape))
                print_table(shape, paths, seconds, args.rounds)
        finally:
            bench_server.stop(server, timeout=60)
    print(f"load average at end {open('/proc/loadavg').read().split()[0]}")


if __name__ == "__main__":
    main()
