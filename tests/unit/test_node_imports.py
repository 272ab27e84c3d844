"""What the daemons import, and when: a node with no Redis never imports redis-py
(pegaflow/cluster/seeds.py: ~90 ms of CPU at every start; the modules that publish still
import it when the node has Redis to talk to), and both daemons parse their flags before
they import the rest, so a bad flag or --help costs 0.15 s of CPU instead of 0.4-0.7 s."""

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


BAD_FLAG = """
import sys
from pegaflow.{pkg} import cli
try:
    cli.main(["--no-such-flag"])
except SystemExit as exc:
    assert exc.code == 2, exc.code
print(",".join(m for m in ("grpc", "redis", "structlog", "numpy") if m in sys.modules))
"""


def test_a_bad_flag_is_answered_before_the_daemons_imports() -> None:
    for pkg in ("node", "meta"):
        out = subprocess.run([sys.executable, "-c", BAD_FLAG.format(pkg=pkg)], capture_output=True, text=True,
                             timeout=60, check=True)
        assert "unrecognized arguments: --no-such-flag" in out.stderr
        assert out.stdout.strip() == "", f"pegaflow.{pkg}.cli loaded {out.stdout.strip()} for a bad flag"


# A node whose port is taken and a metaserver whose Redis does not answer: both end with
# their one-line error after their imports, and report what those imports loaded.
STARTED = """
import socket, sys
taken = socket.create_server(("127.0.0.1", 0))
port = taken.getsockname()[1]
from pegaflow.{pkg} import cli
args = {{"node": ["--addr", f"127.0.0.1:{{port}}", "--pool-size", "16mb", "--http-addr", "off"],
         "meta": ["--redis-url", f"redis://127.0.0.1:{{port}}/0", "--addr", "127.0.0.1:0"]}}["{pkg}"]
try:
    cli.main(args)
except SystemExit as exc:
    assert exc.code == 1, exc.code
print("structlog" in sys.modules, sys.modules.get("rich", "absent"))
"""


def test_the_daemons_load_structlog_without_rich() -> None:
    """rich (installed with transformers) costs each start ~0.1 s of CPU, for pretty
    tracebacks the daemons do not print (pegaflow/common/startup.py)."""
    for pkg in ("node", "meta"):
        out = subprocess.run([sys.executable, "-c", STARTED.format(pkg=pkg)], capture_output=True, text=True,
                             timeout=60, check=True)
        assert "error:" in out.stderr, out.stderr  # it got as far as its start-up error
        assert out.stdout.split() == ["True", "None"], f"pegaflow-{pkg}: {out.stdout} {out.stderr[-500:]}"
    # The pegaflow subcommands too (pegaflow/cli.py): one that answers, with a node that does not.
    cache = ("import sys\nfrom pegaflow.cli import main\ntry:\n    main(['cache', 'pins', '--addr', '127.0.0.1:1'])\n"
             "except SystemExit as exc:\n    assert exc.code == 1, exc.code\n"
             "print('structlog' in sys.modules, sys.modules.get('rich', 'absent'))")
    out = subprocess.run([sys.executable, "-c", cache], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "None"], f"pegaflow cache: {out.stdout} {out.stderr[-500:]}"
    # Elsewhere structlog keeps rich (a vLLM engine's connector).
    out = subprocess.run([sys.executable, "-c", "import sys, structlog; print('rich' in sys.modules)"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "True"


# The metaserver's consumer child, as a spawned child starts: from its target's module (with a
# Redis URL that cannot be parsed, it ends at connect(), after its imports).
CHILD = """
import sys
from pegaflow.meta import apply_child
try:
    apply_child.main(None, None, "not-a-redis-url", False, "c", 1000, "info", "json", 1)
except ValueError:
    pass
print("structlog" in sys.modules, "pegaflow.meta.events.consumer" in sys.modules, sys.modules.get("rich", "absent"))
"""


def test_the_metaservers_consumer_child_loads_structlog_without_rich() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "True", "None"], f"{out.stdout} {out.stderr[-500:]}"
