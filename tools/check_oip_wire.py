"""check_oip_wire: compares proto/inference/grpc_service.proto with the public
Open Inference Protocol definitions, field by field.

A manual check, never run by ctest (the public files are not part of this
repository). Every message, enum and RPC of ours must exist in the public
definition under the same full name, with the same field numbers, names,
types, labels and oneofs, and the same request/response types and streaming;
anything else is printed and makes the exit code 1. Messages the public file
lacks are listed (KServe's file has no Triton extensions, Triton's has no
KServe `properties`) but are not failures when --allow-missing names them.

    git clone https://github.com/triton-inference-server/common
    /usr/bin/python3 tools/check_oip_wire.py --public-dir common/protobuf grpc_service.proto
    git clone https://github.com/kserve/open-inference-protocol
    /usr/bin/python3 tools/check_oip_wire.py \
        --public-dir open-inference-protocol/specification/protocol open_inference_grpc.proto
"""

import argparse
import os
import sys
import tempfile

from google.protobuf import descriptor_pb2
from grpc_tools import protoc

SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def descriptors(include_dir, proto_file, out_dir):
    out = os.path.join(out_dir, os.path.basename(proto_file) + ".pb")
    well_known = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    if protoc.main(["protoc", "-I", include_dir, "-I", well_known, "--include_imports",
                    "--descriptor_set_out=" + out, proto_file]) != 0:
        sys.exit("protoc failed on " + proto_file)
    files = descriptor_pb2.FileDescriptorSet()
    with open(out, "rb") as f:
        files.ParseFromString(f.read())
    return files


def index(files):
    """Messages, enums and services by full name."""
    messages, enums, services = {}, {}, {}

    def walk(prefix, message):
        name = prefix + "." + message.name
        messages[name] = message
        for nested in message.nested_type:
            walk(name, nested)
        for enum in message.enum_type:
            enums[name + "." + enum.name] = enum

    for f in files.file:
        for message in f.message_type:
            walk("." + f.package, message)
        for enum in f.enum_type:
            enums["." + f.package + "." + enum.name] = enum
        for service in f.service:
            services["." + f.package + "." + service.name] = service
    return messages, enums, services


def field_key(field):
    return (field.name, field.type, field.label, field.type_name, field.HasField("oneof_index"))


def compare(ours, public):
    differences, missing, checked = [], [], 0
    for name, message in ours[0].items():
        theirs = public[0].get(name)
        if theirs is None:
            missing.append(name)
            continue
        by_number = {f.number: f for f in theirs.field}
        by_name = {f.name: f for f in theirs.field}
        for field in message.field:
            checked += 1
            other = by_number.get(field.number)
            if other is None and field.name in by_name:
                differences.append("%s.%s: ours number %d, public %d"
                                   % (name, field.name, field.number, by_name[field.name].number))
            elif other is None:
                missing.append("%s.%s = %d" % (name, field.name, field.number))
            elif field_key(other) != field_key(field):
                differences.append("%s field %d: ours %s, public %s"
                                   % (name, field.number, field_key(field), field_key(other)))
    for name, enum in ours[1].items():
        theirs = public[1].get(name)
        if theirs is None:
            missing.append(name)
            continue
        numbers = {v.name: v.number for v in theirs.value}
        for value in enum.value:
            checked += 1
            if numbers.get(value.name) != value.number:
                differences.append("%s.%s: ours %d, public %s"
                                   % (name, value.name, value.number, numbers.get(value.name)))
    for name, service in ours[2].items():
        theirs = {m.name: m for m in public[2].get(name, descriptor_pb2.ServiceDescriptorProto()).method}
        for method in service.method:
            checked += 1
            other = theirs.get(method.name)
            key = lambda m: (m.input_type, m.output_type, m.client_streaming, m.server_streaming)
            if other is None:
                missing.append("%s/%s" % (name, method.name))
            elif key(other) != key(method):
                differences.append("%s/%s: ours %s, public %s"
                                   % (name, method.name, key(method), key(other)))
    return differences, missing, checked


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--public-dir", required=True, help="include directory of the public file")
    parser.add_argument("public_file", help="the public .proto, relative to --public-dir")
    parser.add_argument("--allow-missing", action="store_true",
                        help="names the public file lacks are listed, not failures")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out_dir:
        ours = index(descriptors(os.path.join(SOURCE_DIR, "proto"),
                                 "inference/grpc_service.proto", out_dir))
        public = index(descriptors(args.public_dir, args.public_file, out_dir))
    differences, missing, checked = compare(ours, public)
    for line in differences:
        print("DIFFERENT", line)
    for line in missing:
        print("not in the public file:", line)
    print("%d fields, values and methods checked, %d different, %d not in the public file"
          % (checked, len(differences), len(missing)))
    return 1 if differences or (missing and not args.allow_missing) else 0


if __name__ == "__main__":
    sys.exit(main())
