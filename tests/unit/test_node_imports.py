"""A node with no Redis never imports redis-py (pegaflow/cluster/seeds.py): ~90 ms of CPU at
every start. The modules that publish still import it when the node has Redis to talk to."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import pegaflow.node.cli, pegaflow.node.daemon  # what every node start imports
print(",".join(sorted(m for m in sys.modules if m == "redis" or m.startswith("redis."))))
import pegaflow.node.publishing  # what a node with --redis-url imports at start
print("redis" in sys.modules)
"""


def test_a_node_without_redis_does_not_import_redis_py() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    before, after = out.stdout.splitlines()
    assert before == "", f"imported at every node start: {before}"
    assert after == "True"  # the probe sees redis-py once something loads it
