"""The connector names the original's vLLM plugin (0.25.1) registers, created as vLLM creates them.

Every name is created through vLLM's own ``KVConnectorFactory.create_connector`` with a
``VllmConfig`` (no model, no engine): by name once the plugin registered it, with
``kv_connector_module_path: "pegaflow.connector"``, and with the module path the original's
users wrote (``pegaflow.pd_connector``, ``pegaflow.nixl_connector``).
"""

from __future__ import annotations

from typing import Any

import pytest

from pegaflow.connector import plugin

vllm_config_mod = pytest.importorskip("vllm.config")
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402

# The names the original's vllm_plugin.register() registers in its release 0.25.1, with the
# module each came from there (written out: the test does not read the original).
ORIGINAL_0_25_1_NAMES = {
    "PegaKVConnector": "pegaflow.connector",
    "NoopKVConnector": "pegaflow.connector",
    "PdConnector": "pegaflow.pd_connector",
    "PdDecodeConnector": "pegaflow.pd_connector",
    "PdPrefillConnector": "pegaflow.pd_connector",
    "NixlConnector": "pegaflow.nixl_connector",
    "NixlPullConnector": "pegaflow.nixl_connector",
    "NixlPushConnector": "pegaflow.nixl_connector",
    "PegaNixlConnector": "pegaflow.nixl_connector",
    "PegaNixlPullConnector": "pegaflow.nixl_connector",
}
REFUSED = [n for n in ORIGINAL_0_25_1_NAMES if n not in ("PegaKVConnector", "NoopKVConnector")]


def registered_module(name: str) -> str:
    """The module vLLM's factory loads connector ``name`` from (its loader's closure holds it)."""
    cells = [c.cell_contents for c in KVConnectorFactory._registry[name].__closure__ or ()]
    return next(c for c in cells if isinstance(c, str) and "." in c)


def vllms_own(name: str) -> bool:
    """A name this vLLM registers itself (NIXL's, in some releases): it stays vLLM's, as the
    original's plugin could not replace it either."""
    return not registered_module(name).startswith("pegaflow.")


def vllm_config(name: str, module_path: str | None = None) -> Any:
    kv = vllm_config_mod.KVTransferConfig(kv_connector=name, kv_role="kv_both", kv_connector_module_path=module_path)
    return vllm_config_mod.VllmConfig(kv_transfer_config=kv)


def create(config: Any, role: KVConnectorRole = KVConnectorRole.SCHEDULER) -> Any:
    return KVConnectorFactory.create_connector(config, role, None)  # type: ignore[arg-type]


def ways(name: str) -> list[str | None]:
    """The module paths a config may name ``name`` with (None: by name, through the plugin)."""
    paths: list[str | None] = ["pegaflow.connector", ORIGINAL_0_25_1_NAMES[name]]
    if not vllms_own(name):
        paths.append(None)
    return list(dict.fromkeys(paths))


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    plugin.register()
    plugin.register()  # vLLM may load a plugin twice in one process


def test_the_plugin_registers_every_name_of_the_original() -> None:
    assert set(ORIGINAL_0_25_1_NAMES) <= set(KVConnectorFactory._registry)
    assert set(plugin.SERVED_NAMES + plugin.REFUSED_NAMES) == set(ORIGINAL_0_25_1_NAMES)
    for name in ORIGINAL_0_25_1_NAMES:
        assert registered_module(name) == "pegaflow.connector" or name.startswith("Nixl"), name
    from pegaflow.connector.connector import PegaKVConnector

    assert KVConnectorFactory.get_connector_class_by_name("PegaKVConnector") is PegaKVConnector


def cases() -> list[tuple[str, str | None]]:
    plugin.register()  # collected before the fixture runs
    return [(n, p) for n in REFUSED for p in ways(n)]


@pytest.mark.parametrize("name, path", cases())
def test_the_originals_other_connectors_refuse_to_start_saying_what_to_use(name: str, path: str | None) -> None:
    config = vllm_config(name, path)  # vLLM's config checks resolve the class: no error yet
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError) as exc:
            create(config, role)
        message = str(exc.value)
        assert message.startswith(f"{name} is the original PegaFlow's ") and "\n" not in message
        assert "PegaKVConnector" in message and "pegaflow router" in message and "docs/router.md" in message


@pytest.mark.parametrize("name", [n for n in REFUSED if n.startswith("Nixl")])
def test_a_nixl_name_vllm_registers_stays_vllms_own(name: str) -> None:
    if not vllms_own(name):
        pytest.skip(f"this vLLM has no {name} of its own")
    cls = KVConnectorFactory.get_connector_class(vllm_config_mod.KVTransferConfig(kv_connector=name,
                                                                                  kv_role="kv_both"))
    assert cls.__module__.startswith("vllm."), cls.__module__


@pytest.mark.parametrize("path", ["pegaflow.connector", None])
def test_noop_connector_loads_and_saves_nothing(path: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    config = vllm_config("NoopKVConnector", path)
    sched = create(config)
    assert type(sched).__name__ == "NoopKVConnector"
    assert sched.get_num_new_matched_tokens(object(), 0) == (0, False)
    sched.update_state_after_alloc(object(), object(), 0)
    meta = sched.build_connector_meta(object())
    assert not meta.loads and not meta.saves
    assert sched.request_finished_all_groups(object(), ([1, 2],)) == (False, None)
    worker = create(config, KVConnectorRole.WORKER)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(object())
    worker.wait_for_layer_load("layer.0")
    worker.save_kv_layer("layer.0", object(), object())
    worker.wait_for_save()
    assert worker.prefer_cross_layer_blocks is True  # as PegaKVConnector (the original's default)
    monkeypatch.setenv("PEGAFLOW_CROSS_LAYER_BLOCKS", "0")
    assert worker.prefer_cross_layer_blocks is False
