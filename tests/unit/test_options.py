import subprocess
import sys
from pathlib import Path

import pytest

from pegaflow.common.options import NODE, parse_options, render_markdown
from pegaflow.common.units import parse_size

ROOT = Path(__file__).resolve().parents[2]


def test_sizes_use_binary_units():
    assert parse_size("30gb") == 30 << 30
    assert parse_size("512MB") == 512 << 20
    assert parse_size("1tb") == 1 << 40
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError):
        parse_size("12zb")


def test_node_defaults_match_the_original():
    o = parse_options(NODE, "pegaflow-node", [], env={})
    assert o.addr == "127.0.0.1:50055"
    assert o.pool_size == 30 << 30
    assert o.use_hugepages is False


def test_flag_beats_environment_beats_default():
    env = {"PEGAFLOW_POOL_SIZE": "2gb", "PEGAFLOW_ADDR": "127.0.0.1:6000"}
    o = parse_options(NODE, "pegaflow-node", ["--addr", "127.0.0.1:7000"], env=env)
    assert o.pool_size == 2 << 30 and o.addr == "127.0.0.1:7000"


def test_docs_options_page_is_generated_from_the_table():
    assert (ROOT / "docs" / "options.md").read_text() == render_markdown(), (
        "docs/options.md is stale: python -m pegaflow.common.options > docs/options.md"
    )


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--pool-size", "lots"], "--pool-size"),
        (["--addr", "nowhere"], "--addr"),
        (["--no-such-flag"], "unrecognized"),
        (["--log-level", "chatty"], "--log-level"),
    ],
)
def test_bad_flags_exit_with_one_line(argv, needle):
    p = subprocess.run([sys.executable, "-m", "pegaflow.node.cli", *argv], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert "Traceback" not in p.stderr


def test_bad_environment_value_exits_with_one_line():
    p = subprocess.run(
        [sys.executable, "-m", "pegaflow.node.cli"], capture_output=True, text=True, timeout=60,
        env={"PEGAFLOW_POOL_SIZE": "huge", "PATH": "/usr/bin:/bin"},
    )
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "PEGAFLOW_POOL_SIZE" in p.stderr
