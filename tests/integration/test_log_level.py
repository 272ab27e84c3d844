"""--log-level takes the original's words and directives (tracing's EnvFilter syntax), ``off``
included, and RUST_LOG overrides it on the two daemons, as on the original (its release
0.25.1: ``--log-level off`` started silent; ``RUST_LOG=warn`` with ``--log-level debug``
logged warnings only). ``off`` used to exit 2 (invalid choice)."""

from __future__ import annotations

import json

import pytest

from pegaflow.config.commands import load
from pegaflow.config.options import META, NODE, REPLAY

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("text, level", [
    ("off", "off"), ("OFF", "off"), ("trace", "debug"), ("warn", "warning"), ("Error", "error"),
    ("warn,pegaflow_server=debug", "debug"),  # a PegaFlow target counts; the most verbose wins
    ("pegaflow_metaserver=info", "info"),
    ("error,h2=trace,tokio=debug", "error"),  # the original's dependencies: ignored
    ("tokio=debug", "off"),  # the original logs nothing of its own then
    ("pegaflow_core[span]=debug", "debug"),
])
def test_the_originals_levels_and_directives_are_read(text: str, level: str) -> None:
    assert load(NODE, "n", ["--log-level", text], env={}).log_level == level


@pytest.mark.parametrize("text", ["chatty", "info=nope", "=info"])
def test_what_is_neither_is_refused(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        load(NODE, "n", ["--log-level", text], env={})
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--log-level" in lines[0], lines


def test_rust_log_overrides_the_flag_and_variable_on_the_daemons() -> None:
    env = {"RUST_LOG": "warn", "PEGAFLOW_LOG_LEVEL": "error"}
    assert load(NODE, "n", ["--log-level", "debug"], env=env).log_level == "warning"
    assert load(META, "m", [], env=env).log_level == "warning"
    # one that does not parse is ignored, as the original ignores it
    assert load(NODE, "n", ["--log-level", "debug"], env={"RUST_LOG": "info=nope"}).log_level == "debug"
    # PegaFlow's own tools, which the original does not have, follow their flag
    assert load(REPLAY, "r", ["t.jsonl", "--log-level", "debug"], env=env).log_level == "debug"


def test_a_node_with_log_level_off_logs_nothing_and_rust_log_turns_it_back_on(node_factory) -> None:
    quiet = node_factory(extra=["--log-level", "off"])
    quiet.stop()
    assert quiet.log() == ""
    loud = node_factory(extra=["--log-level", "off"], env={"RUST_LOG": "info"})
    loud.stop()
    events = [json.loads(line)["event"] for line in loud.log().splitlines() if line.startswith("{")]
    assert {"node_started", "node_stopped"} <= set(events), loud.log()
