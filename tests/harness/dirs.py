"""Directories of a run: scratch directories removed when the process exits, and where the
engines put vLLM's IPC sockets."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

VLLM_RPC = "VLLM_RPC_BASE_PATH"


def temp_dir_removed_at_exit(prefix: str, dir: str | os.PathLike[str] | None = None) -> str:  # noqa: A002
    """A fresh directory (mode 0700) in ``dir`` (default: the system temporary directory),
    removed when this process exits: where processes started from here put files a killed
    one leaves behind, and where a benchmark puts its logs, models and SSD tier files."""
    path = tempfile.mkdtemp(prefix=prefix, dir=dir)
    atexit.register(shutil.rmtree, path, True)
    return path


@functools.cache
def vllm_rpc_dir() -> str:
    """Where the engines started from here put their ZeroMQ IPC sockets: vLLM names them
    ``$VLLM_RPC_BASE_PATH/<uuid4>`` (default: the system temporary directory) and a killed
    engine leaves them there. The test run sets it (tests/conftest.py); a benchmark run
    outside pytest gets a directory of its own, removed when it exits."""
    path = os.environ.get(VLLM_RPC)
    if path:
        return path
    return temp_dir_removed_at_exit("pf-vllm-rpc-")  # short: a Unix socket path has at most 107 bytes
