"""Build hook: generate the gRPC stubs from proto/ into pegaflow/_proto/ at install time.

The stubs are never committed (see .gitignore); every `pip install .` or `pip install -e .`
regenerates them from the .proto files, so the wire contract has one source of truth.
"""

from __future__ import annotations

import glob
import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from setuptools.command.egg_info import egg_info

HERE = os.path.dirname(os.path.abspath(__file__))


def generate_stubs() -> None:
    import grpc_tools
    from grpc_tools import protoc  # build-system requirement

    protos = sorted(glob.glob(os.path.join(HERE, "proto", "*.proto")))
    if not protos:  # a source tree without proto/ would build a package whose every command fails
        raise RuntimeError(f"no .proto files in {os.path.join(HERE, 'proto')}: cannot build the gRPC stubs")
    out = os.path.join(HERE, "pegaflow", "_proto")
    os.makedirs(out, exist_ok=True)
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    for proto in protos:
        # -I<virtual>=<physical> makes generated imports read `from pegaflow._proto import x_pb2`.
        args = [
            "protoc",
            f"-Ipegaflow/_proto={os.path.join(HERE, 'proto')}",
            f"-I{include}",
            f"--python_out={HERE}",
            f"--pyi_out={HERE}",
            f"--grpc_python_out={HERE}",
            f"pegaflow/_proto/{os.path.basename(proto)}",
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {proto}")
    init = os.path.join(out, "__init__.py")
    if not os.path.exists(init):
        with open(init, "w") as f:
            f.write('"""Generated gRPC stubs (built from proto/ by the install; do not edit)."""\n')


class BuildPy(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


class EggInfo(egg_info):
    def run(self) -> None:
        generate_stubs()
        super().run()


setup(
    cmdclass={"build_py": BuildPy, "egg_info": EggInfo},
    ext_modules=[
        Extension("pegaflow.client._pagecopy", ["pegaflow/native/pagecopy.c"], extra_compile_args=["-O3"]),
        Extension("pegaflow.core._sketch", ["pegaflow/native/sketch.c"], extra_compile_args=["-O3"]),
        Extension("pegaflow.core._blockindex", ["pegaflow/native/blockindex.c"], extra_compile_args=["-O3"]),
        Extension("pegaflow.meta._metaview", ["pegaflow/native/metaview.c"], extra_compile_args=["-O3"]),
    ],
)
