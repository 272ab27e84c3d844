"""The connector's settings table: parsing, precedence, errors, and docs/connector.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from pegaflow.connector.settings import LOAD_ONLY, READ_WRITE, SAVE_ONLY, load_settings, render_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "connector.md"


def test_defaults() -> None:
    s = load_settings({}, {})
    assert (s.addr, s.mode, s.save_decode_blocks, s.model_id) == ("127.0.0.1:50055", READ_WRITE, True, None)
    assert s.loads and s.saves


def test_extra_config_keys_and_env_precedence() -> None:
    extra = {"pegaflow.host": "10.0.0.2", "pegaflow.port": 6000, "pegaflow.mode": "save_only",
             "pegaflow.save_decode_blocks": False, "pegaflow.model_id": "llama-8b"}
    s = load_settings(extra, {})
    assert (s.addr, s.mode, s.save_decode_blocks, s.model_id) == ("10.0.0.2:6000", SAVE_ONLY, False, "llama-8b")
    assert not s.loads and s.saves
    s = load_settings(extra, {"PEGAFLOW_MODE": "load_only", "PEGAFLOW_SAVE_DECODE_BLOCKS": "true",
                              "PEGAFLOW_HOST": "http://10.0.0.3"})
    assert (s.addr, s.mode, s.save_decode_blocks) == ("10.0.0.3:6000", LOAD_ONLY, True)
    assert s.loads and not s.saves


@pytest.mark.parametrize("extra, message", [
    ({"pegaflow.mode": "write_only"}, "pegaflow.mode='write_only' is not one of read_write, save_only, load_only"),
    ({"pegaflow.save_decode_blocks": "maybe"}, "pegaflow.save_decode_blocks='maybe' is not a boolean"),
    ({"pegaflow.port": "http"}, "invalid PegaFlow port"),
])
def test_bad_values_give_a_one_line_reason(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as exc:
        load_settings(extra, {})
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_docs_table_is_current() -> None:
    assert render_markdown() in DOC.read_text(), "docs/connector.md is stale: paste render_markdown()'s table"
