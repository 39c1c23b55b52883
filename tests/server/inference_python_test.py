"""server_inference_python_test: the Open Inference Protocol from Python.

Stubs are generated at test time (grpc_tools.protoc, into a temporary
directory) from proto/inference/grpc_service.proto, as a team with its own
KServe v2 tooling would. Against a real attention-server: every RPC; every
conformance case through ModelInfer with raw bytes (numpy tobytes, what
tritonclient sends) and with typed contents; FP16 inputs (numpy's own
rounding) equal to their FP32 widening; every errors.json entry's code;
ModelStreamInfer in order with errors in place.

    ATTENTION_SERVER_BIN=build/server/attention-server /usr/bin/python3 tests/server/inference_python_test.py
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import grpc
import numpy as np
from grpc_tools import protoc

SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFORMANCE = os.path.join(SOURCE_DIR, "tests", "conformance")
STUBS = tempfile.TemporaryDirectory()


def generate_stubs():
    proto_dir = os.path.join(SOURCE_DIR, "proto")
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    result = protoc.main(["protoc", "-I", proto_dir, "-I", include,
                          "--python_out", STUBS.name, "--grpc_python_out", STUBS.name,
                          os.path.join(proto_dir, "inference", "grpc_service.proto")])
    if result != 0:
        raise RuntimeError("protoc failed on proto/inference/grpc_service.proto")
    sys.path.insert(0, STUBS.name)


generate_stubs()
from inference import grpc_service_pb2 as pb  # noqa: E402
from inference import grpc_service_pb2_grpc as pb_grpc  # noqa: E402


def read_json(*parts):
    with open(os.path.join(CONFORMANCE, *parts)) as f:
        return json.load(f)


class Server:
    """attention-server on 127.0.0.1 with the conformance models, ports picked
    by the system, without the warm-up (server_warmup_python_test covers it;
    under ASan it would take most of this suite's time)."""

    def __init__(self):
        self.dir = tempfile.TemporaryDirectory()
        ports = os.path.join(self.dir.name, "ports")
        self.log_path = os.path.join(self.dir.name, "log")
        self.log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [os.environ["ATTENTION_SERVER_BIN"], "--address", "127.0.0.1:0",
             "--http-address", "127.0.0.1:0",
             "--metrics-address", "127.0.0.1:0", "--port-file", ports, "--threads", "1",
             "--model-repository", os.path.join(CONFORMANCE, "models"), "--strict",
             "--warmup", "false"],
            stdout=self.log, stderr=subprocess.STDOUT)
        give_up = time.monotonic() + 60
        while not os.path.exists(ports):
            if self.process.poll() is not None or time.monotonic() > give_up:
                self.stop()
                raise RuntimeError("attention-server did not start")
            time.sleep(0.05)
        with open(ports) as f:
            lines = dict(line.split() for line in f.read().splitlines())
        self.address = lines["grpc"]

    def stop(self):
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self.log.close()
        self.dir.cleanup()
        return code


def tensor(t):
    return np.asarray(t["data"], dtype=np.float32).reshape(t["shape"])


def infer_request(request, typed=False, float_type=np.float32):
    """The ModelInferRequest meaning the conformance `request` (AttendRequest JSON)."""
    datatype = {np.float32: "FP32", np.float16: "FP16"}[float_type]
    infer = pb.ModelInferRequest(model_name=request["model"], id=request.get("request_id", ""))
    for name in ("queries", "keys", "values"):
        if name not in request:
            continue
        shape = request[name]["shape"]
        data = np.asarray(request[name]["data"], dtype=np.float32)
        entry = infer.inputs.add(name=name, datatype=datatype, shape=shape)
        if typed:
            entry.contents.fp32_contents.extend(data.tolist())
        else:
            infer.raw_input_contents.append(data.astype(float_type).tobytes())
    if request.get("valid_lens"):
        lens = np.asarray(request["valid_lens"], dtype=np.int64)
        entry = infer.inputs.add(name="valid_lens", datatype="INT64", shape=[len(lens)])
        if typed:
            entry.contents.int64_contents.extend(lens.tolist())
        else:
            infer.raw_input_contents.append(lens.tobytes())
    if request.get("causal"):
        infer.parameters["causal"].bool_param = True
    if "scale" in request:
        infer.parameters["scale"].double_param = request["scale"]
    infer.parameters["return_attention_weights"].bool_param = True
    # A parameter of the client's own, which the server ignores.
    infer.parameters["triton_client_tag"].string_param = "python"
    return infer


def outputs(response):
    """{name: ndarray} decoded the way tritonclient does (raw_output_contents)."""
    found = {}
    for tensor_meta, raw in zip(response.outputs, response.raw_output_contents):
        assert tensor_meta.datatype == "FP32"
        found[tensor_meta.name] = np.frombuffer(raw, dtype="<f4").reshape(tuple(tensor_meta.shape))
    return found


class InferencePythonTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server()
        cls.channel = grpc.insecure_channel(cls.server.address)
        cls.stub = pb_grpc.GRPCInferenceServiceStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        assert cls.server.stop() == 0

    def cases(self):
        names = sorted(os.listdir(os.path.join(CONFORMANCE, "cases")))
        self.assertTrue(names)
        return [read_json("cases", name) for name in names]

    def assert_case(self, case, got):
        for name in ("output", "attention_weights"):
            want = tensor(case["expected"][name])
            self.assertEqual(got[name].shape, want.shape, case["name"] + " " + name)
            np.testing.assert_allclose(got[name], want, atol=case["atol"], rtol=case["rtol"],
                                       err_msg=case["name"] + " " + name)

    def test_every_rpc(self):
        self.assertTrue(self.stub.ServerLive(pb.ServerLiveRequest()).live)
        self.assertTrue(self.stub.ServerReady(pb.ServerReadyRequest()).ready)
        self.assertTrue(self.stub.ModelReady(pb.ModelReadyRequest(name="additive_toy")).ready)
        self.assertFalse(self.stub.ModelReady(pb.ModelReadyRequest(name="nope")).ready)
        metadata = self.stub.ServerMetadata(pb.ServerMetadataRequest())
        self.assertEqual(metadata.name, "attention-server")
        self.assertIn("statistics", metadata.extensions)
        model = self.stub.ModelMetadata(pb.ModelMetadataRequest(name="dot_product"))
        self.assertEqual([t.name for t in model.inputs], ["queries", "keys", "values", "valid_lens"])
        self.assertEqual(list(model.inputs[0].shape), [-1, -1, -1])
        self.assertEqual([t.name for t in model.outputs], ["output", "attention_weights"])
        config = self.stub.ModelConfig(pb.ModelConfigRequest(name="dot_product")).config
        self.assertEqual(config.input[3].data_type, pb.TYPE_INT32)
        index = self.stub.RepositoryIndex(pb.RepositoryIndexRequest())
        self.assertIn("additive_toy", [m.name for m in index.models])
        before = self.stub.ModelStatistics(pb.ModelStatisticsRequest(name="distance"))
        case = read_json("cases", "distance_causal.json")
        self.stub.ModelInfer(infer_request(case["request"]))
        after = self.stub.ModelStatistics(pb.ModelStatisticsRequest(name="distance"))
        self.assertEqual(after.model_stats[0].inference_count,
                         before.model_stats[0].inference_count + 1)
        with self.assertRaises(grpc.RpcError) as refused:
            self.stub.ModelMetadata(pb.ModelMetadataRequest(name="nope"))
        self.assertEqual(refused.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_conformance_raw_and_typed(self):
        for case in self.cases():
            for typed in (False, True):
                response = self.stub.ModelInfer(infer_request(case["request"], typed=typed))
                self.assertEqual(response.id, case["name"])
                self.assertEqual(response.model_name, case["request"]["model"])
                self.assert_case(case, outputs(response))

    def test_fp16_inputs_mean_their_widened_values(self):
        for case in self.cases():
            narrow = outputs(self.stub.ModelInfer(
                infer_request(case["request"], float_type=np.float16)))
            widened = dict(case["request"])
            for name in ("queries", "keys", "values"):
                if name in widened:
                    data = np.asarray(widened[name]["data"], dtype=np.float16).astype(np.float32)
                    widened[name] = {"shape": widened[name]["shape"], "data": data.tolist()}
            wide = outputs(self.stub.ModelInfer(infer_request(widened)))
            for name in ("output", "attention_weights"):
                np.testing.assert_allclose(narrow[name], wide[name], atol=1e-5, rtol=0,
                                           err_msg=case["name"] + " " + name)

    def test_every_errors_entry_gets_its_code(self):
        errors = read_json("errors.json")
        self.assertTrue(errors)
        for entry in errors:
            request = entry["request"]
            for name in ("queries", "keys", "values"):
                # JSON's non-finite spellings, as the proto3 JSON form writes them.
                if name in request:
                    request[name]["data"] = [float(v) if isinstance(v, str) else v
                                             for v in request[name]["data"]]
            for typed in (False, True):
                with self.assertRaises(grpc.RpcError, msg=entry["name"]) as refused:
                    self.stub.ModelInfer(infer_request(request, typed=typed))
                self.assertEqual(refused.exception.code().name, entry["expected_code"],
                                 entry["name"] + ": " + refused.exception.details())

    def test_stream_order_and_errors_in_place(self):
        case = read_json("cases", "dot_product_causal_square.json")
        requests = []
        for i in range(9):
            request = infer_request(dict(case["request"], request_id="s%d" % i), typed=i % 2 == 1)
            if i % 4 == 3:
                request.inputs[0].name = "query"  # an unknown input
            requests.append(request)
        answers = list(self.stub.ModelStreamInfer(iter(requests)))
        self.assertEqual([a.infer_response.id for a in answers], ["s%d" % i for i in range(9)])
        for i, answer in enumerate(answers):
            if i % 4 == 3:
                self.assertIn("INVALID_ARGUMENT", answer.error_message)
                self.assertIn("'query'", answer.error_message)
            else:
                self.assertEqual(answer.error_message, "")
                self.assert_case(case, outputs(answer.infer_response))


if __name__ == "__main__":
    unittest.main()
