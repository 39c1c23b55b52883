"""session_decode: a decode (512 steps of one token, a torch-layout
multi_head model with E=512 and 8 heads) through one attention-server, the
same run, four ways: a session from the Python client (AttendSession), the
prefix resent every step (Attend, causal), and through the Open Inference
Protocol with Triton's sequence parameters against ModelInfer resending the
prefix; and, as the request pipeline's floor, 512 one-token Attend calls
without any prefix (not a decode: each token attends to itself only). Reports wall time, the server's CPU time (utime + stime from
/proc) and the bytes of the request messages sent, and checks that the last
step's output equals the last row of the causal Attend on the whole prefix.

Run with the Python client's virtual environment (tests/client/python_install.sh):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \\
      build/tests/python-client-venv/bin/python bench/session_decode.py \\
      --server build/server/attention-server [--steps 512]
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np

import bench_server
from rest_vs_grpc import inference_pb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "mh_torch_e512_h8"


def server_cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(binary, directory, flags=(), embed_dim=512, heads=8):
    """attention-server with `flags` over a repository holding the E=embed_dim model."""
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "make_service_model.py"),
                    directory, "--embed-dim", str(embed_dim), "--heads", str(heads)], check=True,
                   stdout=subprocess.DEVNULL)
    process, addresses = bench_server.start(
        binary, directory, ["--metrics-address", "", "--http-address", "", *flags])
    return process, addresses["grpc"]


def measure(name, pid, run):
    cpu = server_cpu_seconds(pid)
    start = time.perf_counter()
    last, sent = run()
    wall = time.perf_counter() - start
    print(f"{name:<44} wall {wall:7.3f} s  server CPU {server_cpu_seconds(pid) - cpu:7.3f} s  "
          f"sent {sent / 1e6:8.2f} MB")
    return last


def infer_request(pb, rows, parameters):
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="queries", datatype="FP32", shape=list(rows.shape))
    request.raw_input_contents.append(np.ascontiguousarray(rows, dtype="<f4").tobytes())
    for key, value in parameters.items():
        if isinstance(value, bool):
            request.parameters[key].bool_param = value
        elif isinstance(value, int):
            request.parameters[key].int64_param = value
    return request


def last_row(pb_response):
    output = np.frombuffer(pb_response.raw_output_contents[0], dtype="<f4")
    return output.reshape(list(pb_response.outputs[0].shape))[:, -1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=os.path.join(ROOT, "build/server/attention-server"))
    parser.add_argument("--steps", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        pb, pb_grpc = inference_pb(directory)
        process, address = start_server(args.server, directory)
        try:
            run(args.steps, address, process.pid, pb, pb_grpc)
        finally:
            bench_server.stop(process)


def run(steps, address, pid, pb, pb_grpc):
    tokens = np.random.default_rng(25).uniform(-1, 1, (1, steps, 512)).astype(np.float32)
    import attention_client  # here: start_server() is also used without the client installed
    client = attention_client.AttentionClient(address, timeout=60)
    channel = grpc.insecure_channel(address, [("grpc.max_receive_message_length", -1)])
    infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
    client.attend(tokens[:, :1], model=MODEL, causal=True)  # connection and first-call costs

    def session():
        with client.session(MODEL) as s:
            for t in range(steps):
                last = s.step(tokens[:, t:t + 1]).output
        return last, steps * (tokens[:, :1].nbytes + 16)

    def prefix():
        sent = 0
        for t in range(steps):
            last = client.attend(tokens[:, :t + 1], model=MODEL, causal=True).output[:, -1:]
            sent += tokens[:, :t + 1].nbytes + 32
        return last, sent

    def sequence():
        sent = 0
        for t in range(steps):
            request = infer_request(pb, tokens[:, t:t + 1],
                                    {"sequence_id": 25, "sequence_start": t == 0,
                                     "sequence_end": t == steps - 1})
            sent += request.ByteSize()
            last = last_row(infer(request))
        return last, sent

    def one_token():
        sent = 0
        for t in range(steps):
            last = client.attend(tokens[:, t:t + 1], model=MODEL).output
            sent += tokens[:, :1].nbytes + 32
        return last, sent

    def oip_prefix():
        sent = 0
        for t in range(steps):
            request = infer_request(pb, tokens[:, :t + 1], {"causal": True})
            sent += request.ByteSize()
            last = last_row(infer(request))
        return last, sent

    print(f"{steps} decode steps of 1 token, {MODEL} (E=512, 8 heads, torch layout)")
    results = {name: measure(name, pid, fn) for name, fn in (
        ("Python client, session (AttendSession)", session),
        ("Python client, prefix resent (Attend)", prefix),
        ("OIP ModelInfer, sequence parameters", sequence),
        ("OIP ModelInfer, prefix resent", oip_prefix),
        ("Python client, one-token Attend (no prefix)", one_token))}
    reference = results["Python client, prefix resent (Attend)"]
    del results["Python client, one-token Attend (no prefix)"]  # not the decode's answer
    for name, last in results.items():
        print(f"  {name}: last row max |diff| vs prefix Attend "
              f"{float(np.abs(last - reference).max()):.2e}")


if __name__ == "__main__":
    main()
