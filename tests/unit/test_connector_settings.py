"""The connector's settings table: parsing, precedence, errors, and docs/connector.md."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pegaflow.connector.link import LOGGER_NAME
from pegaflow.connector.settings import (
    KNOWN_KEYS,
    LOAD_ONLY,
    READ_WRITE,
    SAVE_ONLY,
    SETTINGS,
    cross_layer_blocks,
    load_settings,
    log_settings,
    render_markdown,
    render_original_markdown,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "connector.md"

# Every kv_connector_extra_config key and environment variable the original's connector reads in
# its release 0.25.1 (pegaflow/connector/__init__.py, common.py, worker.py of its wheel): its
# users paste their config unchanged, so each must be known here.
ORIGINAL_0_25_1_KEYS = ("pegaflow.host", "pegaflow.port", "pegaflow.mode", "pegaflow.transfer_backend",
                        "pegaflow.wait_for_full_prefix", "pegaflow.tp_shard_endpoints", "pegaflow.pd_tail_save",
                        "pegaflow.pd_tail_load")
ORIGINAL_0_25_1_ENV = ("PEGAFLOW_HOST", "PEGAFLOW_PORT", "PEGAFLOW_CROSS_LAYER_BLOCKS", "PEGAFLOW_INSTANCE_ID",
                       "PEGA_LOAD_TIMEOUT_SECONDS")


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


def test_the_originals_keys_are_read() -> None:
    """0.25.1's keys and variables: each does what it did there, where it means something here."""
    s = load_settings({"pegaflow.wait_for_full_prefix": True, "pegaflow.transfer_backend": " Kernel ",
                       "pegaflow.tp_shard_endpoints": ["http://10.0.0.7:50077"], "pegaflow.host": "10.0.0.2",
                       "pegaflow.pd_tail_save": True, "pegaflow.pd_tail_load": True},
                      {"PEGAFLOW_INSTANCE_ID": "engine-7", "PEGAFLOW_CROSS_LAYER_BLOCKS": "0", "PEGAFLOW_PORT": "6000"})
    assert s.wait_for_full_prefix and s.instance_id == "engine-7" and not s.cross_layer_blocks
    assert s.addr == "10.0.0.7:50077", "the endpoints list wins over host, port and the environment"
    assert load_settings({}, {}).instance_id is None and load_settings({}, {}).cross_layer_blocks


def test_several_tp_shard_endpoints_name_one_node_per_group_in_rank_order() -> None:
    s = load_settings({"pegaflow.tp_shard_endpoints": ["http://10.0.0.7:50077", "10.0.0.8:50078"],
                       "pegaflow.addr": "10.0.0.2:1"}, {"PEGAFLOW_HOST": "10.0.0.3"})
    assert s.nodes == ("10.0.0.7:50077", "10.0.0.8:50078") and s.addr == "10.0.0.7:50077"
    assert load_settings({"pegaflow.addr": "10.0.0.2:1"}, {}).nodes == ("10.0.0.2:1",)


@pytest.mark.parametrize("value, on", [("1", True), ("0", False), ("false", False), ("true", True), ("", True)])
def test_cross_layer_blocks_variable(value: str, on: bool) -> None:
    assert cross_layer_blocks({"PEGAFLOW_CROSS_LAYER_BLOCKS": value}) is on


@pytest.mark.parametrize("extra, message", [
    # the original's messages, word for word
    ({"pegaflow.transfer_backend": "cuda"}, "Unsupported pegaflow.transfer_backend 'cuda'; expected one of: direct, kernel"),
    ({"pegaflow.tp_shard_endpoints": "http://a:1"}, "pegaflow.tp_shard_endpoints must be a list of endpoints"),
    ({"pegaflow.tp_shard_endpoints": ["http://a:1", ""]}, "pegaflow.tp_shard_endpoints must contain non-empty strings"),
    ({"pegaflow.tp_shard_endpoints": ["http://a:1", "http://a:1"]},
     "pegaflow.tp_shard_endpoints must not contain duplicates"),
    # two spellings of one node
    ({"pegaflow.tp_shard_endpoints": ["http://a:1", "a:1"]}, "pegaflow.tp_shard_endpoints must not contain duplicates"),
    ({"pegaflow.wait_for_full_prefix": "sometimes"}, "pegaflow.wait_for_full_prefix='sometimes' is not a boolean"),
])
def test_the_originals_keys_refuse_what_it_refused(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as exc:
        load_settings(extra, {})
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_settings_without_effect_here_are_named_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        log_settings({"pegaflow.transfer_backend": "kernel", "pegaflow.pd_tail_save": True, "pegaflow.mode": "save_only"},
                     {"PEGA_LOAD_TIMEOUT_SECONDS": "300"})
    (line,) = [r.getMessage() for r in caplog.records]
    assert "no effect here" in line and "\n" not in line
    for named in ("pegaflow.transfer_backend='kernel': No effect: the worker's copies are always batched",
                  "pegaflow.pd_tail_save=True: No effect: only full blocks are stored",
                  "PEGA_LOAD_TIMEOUT_SECONDS='300'"):
        assert named in line
    assert "pegaflow.mode" not in line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        log_settings({"pegaflow.mode": "save_only", "pegaflow.wait_for_full_prefix": True}, {})
    assert not caplog.records, "nothing is said of settings that do something"


def test_every_key_and_variable_of_the_original_is_known(caplog: pytest.LogCaptureFixture) -> None:
    assert set(ORIGINAL_0_25_1_KEYS) <= KNOWN_KEYS
    assert set(ORIGINAL_0_25_1_ENV) <= {s.env for s in SETTINGS}
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        log_settings(dict.fromkeys(ORIGINAL_0_25_1_KEYS + tuple(KNOWN_KEYS), "x"), {})
    assert not caplog.records


@pytest.mark.parametrize("typo, near", [
    ("pegaflow.transfer_backnd", "pegaflow.transfer_backend"),
    ("pegaflow.wait_for_full_prefx", "pegaflow.wait_for_full_prefix"),
    ("pegaflow.hots", "pegaflow.host"),
])
def test_a_mistyped_key_is_one_warning_naming_the_nearest_known_key(
    caplog: pytest.LogCaptureFixture, typo: str, near: str
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        log_settings({typo: True, "pegaflow.mode": "save_only", "shared_storage_path": "/tmp/x"}, {})
    (record,) = caplog.records  # keys of other connectors are not ours to judge
    line = record.getMessage()
    assert record.levelno == logging.WARNING and "\n" not in line
    assert f"unknown kv_connector_extra_config key {typo!r} is ignored (did you mean {near!r}?)" in line


def test_an_unknown_key_far_from_every_known_one_points_to_the_docs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        log_settings({"pegaflow.zzzz": 1}, {})
    (record,) = caplog.records
    assert "'pegaflow.zzzz' is ignored (the known keys are in docs/connector.md)" in record.getMessage()


VLLMS_OWN = "0b6f4e2a-5b8c-4c1e-9d3a-2f1e0c9b8a7d"  # vLLM's engine_id when none is given: a random UUID


@pytest.mark.parametrize("env, engine_id, dp, role, name", [
    ({"PEGAFLOW_INSTANCE_ID": "engine-7"}, VLLMS_OWN, (1, 0), "SCHEDULER", "engine-7"),
    ({"PEGAFLOW_INSTANCE_ID": "engine-7"}, VLLMS_OWN, (1, 0), "WORKER", "engine-7"),
    ({"PEGAFLOW_INSTANCE_ID": "engine-7"}, VLLMS_OWN, (2, 1), "WORKER", "engine-7_dp1"),  # the original's suffix
    ({}, VLLMS_OWN, (1, 0), "SCHEDULER", ":scheduler"),
    ({"PEGAFLOW_INSTANCE_ID": "engine-7"}, VLLMS_OWN + "_dp1", (2, 1), "WORKER", "engine-7_dp1"),
    # The original's instance id: kv_transfer_config.engine_id, when the user gave one (vLLM
    # appends _dpN for data-parallel rank N itself).
    ({}, "decode-0", (1, 0), "WORKER", "decode-0"),
    ({"PEGAFLOW_INSTANCE_ID": "engine-7"}, "decode-0_dp1", (2, 1), "SCHEDULER", "decode-0_dp1"),
])
def test_the_instance_name(env: dict[str, str], engine_id: str, dp: tuple[int, int], role: str, name: str) -> None:
    from pegaflow.connector.connector import instance_name
    from pegaflow.connector.vllm_compat import KVConnectorRole

    vllm_config: Any = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=dp[0],
                                                                       data_parallel_rank_local=dp[1]),
                                       kv_transfer_config=SimpleNamespace(engine_id=engine_id))
    got = instance_name(load_settings({}, env), vllm_config, KVConnectorRole[role])
    assert got == name if not name.startswith(":") else got.endswith(name)


def test_docs_tables_are_current() -> None:
    doc = DOC.read_text()
    assert render_markdown() in doc, "docs/connector.md is stale: paste render_markdown()'s table"
    assert render_original_markdown() in doc, "docs/connector.md is stale: paste render_original_markdown()'s table"
    for name in ORIGINAL_0_25_1_KEYS + ORIGINAL_0_25_1_ENV:
        assert f"`{name}`" in render_original_markdown(), f"{name} is missing from the original's table"
