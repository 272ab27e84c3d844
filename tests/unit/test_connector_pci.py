"""The connector tells the node where each rank's GPU is (Register's ``pci_bus_id``, for the
pool's NUMA placement): read from the KV cache's device at the hardware edge (a fake device
and fake CUDA properties here), set on every client the rank's link registers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pegaflow.connector import worker
from pegaflow.connector.worker import WorkerSide, pci_bus_id
from tests.unit.connector_fakes import Engine, FakeNode, fake_link, identity, make_caches


def props(domain: int, bus: int, dev: int):  # type: ignore[no-untyped-def]
    return lambda device: SimpleNamespace(pci_domain_id=domain, pci_bus_id=bus, pci_device_id=dev)


def test_a_cuda_device_is_named_as_sysfs_names_its_pci_device() -> None:
    assert pci_bus_id(torch.device("cuda:0"), props(0, 0x3B, 0)) == "0000:3b:00.0"
    assert pci_bus_id(torch.device("cuda:1"), props(1, 0xDC, 0x1F)) == "0001:dc:1f.0"


def test_a_cpu_device_has_no_pci_address_and_no_cuda_call() -> None:
    def never(device):  # type: ignore[no-untyped-def]
        raise AssertionError("CUDA asked about a CPU device")

    assert pci_bus_id(torch.device("cpu"), never) == ""


def test_a_torch_without_pci_properties_sends_nothing() -> None:
    assert pci_bus_id(torch.device("cuda:0"), lambda d: SimpleNamespace(name="old torch")) == ""

    def no_driver(device):  # type: ignore[no-untyped-def]
        raise RuntimeError("no CUDA driver")

    assert pci_bus_id(torch.device("cuda:0"), no_driver) == ""


def test_a_cpu_engine_registers_without_a_pci_address() -> None:
    node = FakeNode()
    Engine(node, identity())
    assert node.registered_pci == ["", ""]  # the scheduler's link, then the worker's


def test_the_workers_registration_carries_its_gpus_address(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.device] = []

    def gpu(device: torch.device) -> str:  # the KV cache's device, as a GPU rank's would be read
        seen.append(device)
        return "0000:3b:00.0"

    monkeypatch.setattr(worker, "pci_bus_id", gpu)
    node = FakeNode()
    ident = identity()
    w = WorkerSide(ident, 0, lambda ns, pci: fake_link(node, ns, pci))
    w.register_kv_caches(make_caches(ident, 64), 64)
    assert seen == [torch.device("cpu")]
    assert node.registered_pci == ["0000:3b:00.0"]


def test_a_reconnected_link_registers_its_new_client_with_the_address() -> None:
    node = FakeNode()
    node.up = False
    link = fake_link(node, {"ns": 4096}, "0000:3b:00.0")
    assert not link.ready
    node.up = True
    assert link.wait_ready(10)
    assert node.registered_pci == ["0000:3b:00.0"]
    link.close()
