"""setup.py: the build step pyproject.toml cannot declare. The gRPC stubs of
attention.proto are generated into the built package by Debian's protoc and
grpc_python_plugin, so nothing runs protoc at import and nothing reads the
repository at run time.

The proto comes from the repository (../../proto) when building from a
checkout, or from the copy an sdist carries (proto/).
"""

import os
import shutil
import subprocess
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_FILE = os.path.join("attention", "v1", "attention.proto")
PROTO_ROOTS = (os.path.join(HERE, "proto"), os.path.join(HERE, "..", "..", "proto"))
# grpc_python_plugin imports the messages as a top-level package named after
# the proto's path; inside attention_client they sit beside it.
ABSOLUTE_IMPORT = "from attention.v1 import attention_pb2"
RELATIVE_IMPORT = "from . import attention_pb2"


def proto_root():
    for root in PROTO_ROOTS:
        if os.path.isfile(os.path.join(root, PROTO_FILE)):
            return root
    raise SystemExit(f"attention-client: {PROTO_FILE} is in none of "
                     + ", ".join(os.path.normpath(root) for root in PROTO_ROOTS))


def tool(name, debian_package):
    path = shutil.which(name)
    if path is None:
        raise SystemExit(f"attention-client: building needs {name} on PATH "
                         f"(Debian: {debian_package})")
    return path


def generate_stubs(package_dir):
    """Writes attention_pb2.py and attention_pb2_grpc.py into package_dir.

    protoc itself rather than grpc_tools.protoc: Debian's grpc_tools bundles
    a protoc too old for the proto's `optional` fields."""
    protoc = tool("protoc", "protobuf-compiler")
    plugin = tool("grpc_python_plugin", "protobuf-compiler-grpc")
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([protoc, f"-I{proto_root()}", f"--python_out={out}", f"--grpc_out={out}",
                        f"--plugin=protoc-gen-grpc={plugin}", PROTO_FILE], check=True)
        generated = os.path.join(out, "attention", "v1")
        shutil.copy(os.path.join(generated, "attention_pb2.py"), package_dir)
        with open(os.path.join(generated, "attention_pb2_grpc.py")) as f:
            grpc_source = f.read()
    if ABSOLUTE_IMPORT not in grpc_source:
        raise SystemExit(f"attention-client: grpc_python_plugin's output no longer holds "
                         f"'{ABSOLUTE_IMPORT}'; setup.py must learn its new import")
    with open(os.path.join(package_dir, "attention_pb2_grpc.py"), "w") as f:
        f.write(grpc_source.replace(ABSOLUTE_IMPORT, RELATIVE_IMPORT))


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        generate_stubs(os.path.join(self.build_lib, "attention_client"))


class SdistWithProto(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        target = os.path.join(base_dir, "proto", PROTO_FILE)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy(os.path.join(proto_root(), PROTO_FILE), target)


# Build products go to a directory of this process, not into the source tree
# (pip builds a local directory in place): no stale files from an earlier
# build end up in the wheel, and two builds of one checkout do not collide.
SCRATCH = tempfile.TemporaryDirectory(prefix="attention-client-build-")
setup(cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProto},
      options={"build": {"build_base": os.path.join(SCRATCH.name, "build")},
               "egg_info": {"egg_base": SCRATCH.name}})
