"""The CUDA path's first-run failures a reading predicted, each proven fixed on CPU with fakes
at the hardware edge only (tests/fakes/device.py: a copy stream on the host, a CUDA runtime
that refuses, blocks and keeps CUDA's per-thread last error); the rest of the path is the
real connector, copier and layout code.

1. The pool is registered with CUDA in the background from the first copy on (not at
   ``register_kv_caches``: vLLM captures its CUDA graphs after it, and another thread's
   registration during a capture breaks it), behind the node's pre-fault, never inside a
   copy, on a thread that made the engine's device current; copies to pieces not
   registered go through the bounce slots.
2. A refused registration is cleared on the thread that made it (the next kernel there
   reports nothing), counted, and leaves copies on the bounce path; "already registered"
   counts as registered and is not undone.
3. A step keeps the pool mapping it copies to until its copies completed, across a node
   restart, and the mapping's registration ends only after them.
4. Kernel blocks smaller than vLLM's block are paged; a worker that cannot copy tells the
   scheduler, which then promises no load and plans no save.
5. The physical layout is in the namespace on vLLMs that name it only through
   ``get_kv_cache_layout()``; a worker whose layout is not the namespace's copies nothing.

(6 and 7, the operations per call and layer-wise loads: tests/unit/test_batched.py.)
"""

from __future__ import annotations

import functools
import gc
import sys
import threading
import time
import types
import weakref
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from pegaflow.client import cuda
from pegaflow.client.batched import ALL_PINNED
from pegaflow.connector.connector import PegaKVConnector, kv_layout_name
from pegaflow.connector.intents import PegaWorkerReport, PegaWorkerState
from pegaflow.connector.worker import WorkerSide
from tests.fakes.device import FakeRuntime, HostStream
from tests.unit.connector_fakes import Engine, FakeNode, fake_link, identity
from tests.unit.test_connector_layout import split_caches
from tests.unit.test_connector_sides import prompt
from tests.unit.test_inflight import ManualStream, empty_step
from tests.waiting import wait_until

CHUNK = 64 << 10  # registration pieces in these tests (1 GiB in production)


def pins_with(runtime: FakeRuntime) -> Any:
    """A worker's pool registration through the real ``PoolPins``, on a fake runtime, with
    the whole pool pre-faulted (the front holds the pool's size, never the pool)."""

    def make(pool: torch.Tensor, _front: Any) -> cuda.PoolPins:
        size = pool.numel()
        return cuda.pins_for(pool, lambda: size, runtime=runtime, chunk=CHUNK)

    return make


# -- 1 ------------------------------------------------------------------------------------------
def test_registration_starts_at_the_first_copy_in_the_background_and_a_copy_never_waits_for_it() -> None:
    runtime = FakeRuntime()
    runtime.gate = threading.Event()  # every registration blocks until the test lets it go
    node = FakeNode()
    stream = HostStream()
    eng = Engine(node, identity(), stream=lambda: stream, pins=pins_with(runtime))
    w = eng.workers[0]
    # vLLM captures its CUDA graphs between register_kv_caches and its first request.
    assert w._pins is ALL_PINNED and runtime.attempts == [], "a registration began during the engine's start"  # noqa: SLF001
    t0 = time.monotonic()
    tokens = prompt(1)
    eng.run(tokens)
    assert time.monotonic() - t0 < 5, "the step waited for the registration"
    assert runtime.registered == [], "nothing could register while the gate was shut"
    assert w.copier is not None and w.copier.bounce is not None and w.copier.bounce.used > 0, \
        "the save went through the bounce slots"
    # Committed once the bounce copy into the pool is done (a finisher thread), at a later step.
    wait_until(lambda: empty_step(eng) and node.calls["commit"] >= 1, timeout=10, what="the save is committed")
    # The bytes are the page: another engine (synchronous, CPU) loads them.
    out = Engine(node, identity()).run(tokens)
    full = (len(tokens) - 1) // 16
    assert out["external"] == full * 16
    assert out["loaded"][0] == [eng.expected(0, tokens, i) for i in range(full)]
    runtime.gate.set()
    pins = w._pins  # noqa: SLF001
    assert isinstance(pins, cuda.PoolPins) and pins.wait(10) and pins.complete
    assert runtime.threads == {"pegaflow-pool-pin"}, "registered on the engine's thread"
    assert stream.bound == ["pegaflow-bounce"], "the bounce thread did not make the engine's device its own"


def test_the_registration_thread_makes_the_engines_device_current_before_it_registers() -> None:
    base = 1 << 40
    for device, want in ((3, {3}), (None, {0})):  # without it: device 0, as CUDA gives a new thread
        runtime = FakeRuntime()
        pins = cuda.PoolPins(base, 2 * CHUNK, runtime, front=lambda: 2 * CHUNK, chunk=CHUNK,
                             metrics=cuda.PinMetrics(CollectorRegistry()), device=device).start()
        assert pins.wait(5) and runtime.devices == want
        pins.close()


def test_a_registration_refused_by_a_graph_capture_is_tried_again_not_given_up() -> None:
    base = 1 << 40
    runtime = FakeRuntime(refuse={base + CHUNK: 900})  # cudaErrorStreamCaptureUnsupported
    metrics = cuda.PinMetrics(CollectorRegistry())
    pins = cuda.PoolPins(base, 3 * CHUNK, runtime, front=lambda: 3 * CHUNK, chunk=CHUNK, metrics=metrics,
                         retry_s=0.01).start()
    wait_until(lambda: runtime.attempts.count(base + CHUNK) >= 3, timeout=5, what="piece 1 tried again")
    assert not pins.complete and pins.failed is None and pins.deferred >= 3
    del runtime.refuse[base + CHUNK]  # the capture ended
    assert pins.wait(5) and pins.complete
    assert metrics.registry.get_sample_value("pegaflow_client_pin_failures_total") == 0
    runtime.refuse_unregister = 1  # an unregistration CUDA refuses leaves no error for this thread's next kernel
    pins.close()
    assert len(runtime.unregistered) == 3 and runtime.pending_error() == 0


def test_a_registration_call_that_raises_is_counted_as_a_refusal_not_a_silent_thread_end() -> None:
    base = 1 << 40
    runtime = FakeRuntime()

    def raising(ptr: int, size: int, flags: int) -> int:
        raise OSError("libcudart: undefined symbol cudaHostRegister")

    runtime.host_register = raising  # type: ignore[method-assign]
    metrics = cuda.PinMetrics(CollectorRegistry())
    pins = cuda.PoolPins(base, 2 * CHUNK, runtime, front=lambda: 2 * CHUNK, chunk=CHUNK, metrics=metrics).start()
    assert not pins.wait(5) and pins.failed == cuda.ERROR_RAISED
    assert metrics.registry.get_sample_value("pegaflow_client_pin_failures_total") == 1
    pins.close()


def test_a_copy_stream_for_a_bare_cuda_device_binds_threads_to_the_current_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.device("cuda")`` has no index, and ``torch.cuda.set_device`` refuses it: the
    bounce thread failed every copy (tests/gpu passes one)."""
    made, bound = [], []

    class Stream:
        def __init__(self, device: torch.device) -> None:
            made.append(device)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: bound.append(d))
    s = cuda.CudaCopyStream(torch.device("cuda"), runtime=object())  # type: ignore[arg-type]
    s.bind_thread()
    assert made == bound == [torch.device("cuda", 2)]
    cuda.CudaCopyStream(torch.device("cuda", 1), runtime=object()).bind_thread()  # type: ignore[arg-type]
    assert bound[-1] == torch.device("cuda", 1)


def test_a_synchronous_copy_raises_when_a_bounce_copy_into_the_pool_failed() -> None:
    from pegaflow.client.batched import HostCompletion
    from pegaflow.client.pages import wait_completions

    ok, bad = HostCompletion(), HostCompletion()
    ok.finish()
    bad.finish(RuntimeError("bounce copy failed"))
    wait_completions([ok])
    with pytest.raises(RuntimeError, match="bounce copy failed"):
        wait_completions([ok, bad])


def test_registration_stays_behind_the_node_prefault_front() -> None:
    runtime = FakeRuntime()
    front, asked = [0], [0]

    def at() -> int:
        asked[0] += 1
        return front[0]

    base = 1 << 40
    pins = cuda.PoolPins(base, 4 * CHUNK, runtime, front=at, chunk=CHUNK,
                         metrics=cuda.PinMetrics(CollectorRegistry()), poll_s=0.001).start()
    wait_until(lambda: asked[0] >= 5, timeout=5, what="the thread asks for the front")
    assert runtime.registered == [], "registered pages the node has not pre-faulted"
    front[0] = 2 * CHUNK + 100  # piece 2 not whole yet
    wait_until(lambda: len(runtime.registered) == 2, timeout=5, what="pieces 0 and 1 registered")
    asked[0] = 0
    wait_until(lambda: asked[0] >= 5, timeout=5, what="the thread asks again")
    assert runtime.registered == [(base, CHUNK), (base + CHUNK, CHUNK)]
    front[0] = 4 * CHUNK
    assert pins.wait(5) and pins.complete and len(runtime.registered) == 4
    assert pins.registered(CHUNK - 10, 20) and not cuda.PoolPins(base, CHUNK, runtime, at, CHUNK).registered(0, 1)
    pins.close()
    assert sorted(runtime.unregistered) == [base + i * CHUNK for i in range(4)]


# -- 2 ------------------------------------------------------------------------------------------
def test_a_refused_registration_is_cleared_counted_and_stops_the_registration() -> None:
    base = 1 << 40
    runtime = FakeRuntime(refuse={base + CHUNK: 2})  # cudaErrorMemoryAllocation on piece 1
    metrics = cuda.PinMetrics(CollectorRegistry())
    pins = cuda.PoolPins(base, 3 * CHUNK, runtime, front=lambda: 3 * CHUNK, chunk=CHUNK, metrics=metrics)
    assert pins.register(0)
    assert not pins.register(1)
    assert runtime.pending_error() == 0, "CUDA's last error was left set: torch's next kernel would raise it"
    assert pins.failed == 2 and metrics.registry.get_sample_value("pegaflow_client_pin_failures_total") == 1
    assert not pins.registered(CHUNK, 10), "the refused piece goes through the bounce slots"
    # A thread started now registers nothing more after the refusal.
    again = cuda.PoolPins(base + (8 << 20), 3 * CHUNK, FakeRuntime(refuse={base + (8 << 20) + CHUNK: 2}),
                          front=lambda: 3 * CHUNK, chunk=CHUNK, metrics=metrics).start()
    again.wait(5)
    assert [p - again.base for p, _ in again.runtime.registered] == [0]  # type: ignore[attr-defined]


def test_memory_registered_by_someone_else_counts_as_registered_and_is_left_registered() -> None:
    base = 1 << 40
    runtime = FakeRuntime(refuse={base: cuda.ERROR_ALREADY_REGISTERED})
    pins = cuda.PoolPins(base, 2 * CHUNK, runtime, front=lambda: 2 * CHUNK, chunk=CHUNK,
                         metrics=cuda.PinMetrics(CollectorRegistry()))
    assert pins.register(0) and pins.register(1) and pins.complete and pins.failed is None
    assert runtime.pending_error() == 0
    pins.close()
    assert runtime.unregistered == [base + CHUNK], "unregistered memory it did not register"


# -- 3 ------------------------------------------------------------------------------------------
def test_a_pool_mapping_outlives_the_copies_that_use_it_across_a_node_restart() -> None:
    runtime = FakeRuntime()
    node = FakeNode()
    stream = ManualStream()
    eng = Engine(node, identity(), stream=lambda: stream, pins=pins_with(runtime))
    w = eng.workers[0]
    eng.run(prompt(1))  # a save into epoch 1's pool, still in flight
    old = weakref.ref(w._pool)  # noqa: SLF001
    old_pins = w._pins  # noqa: SLF001
    assert isinstance(old_pins, cuda.PoolPins) and old_pins.wait(5)
    node.restart()
    for link in (w.link, eng.sched.link):  # both sessions re-register (the fake scheduler's maps the pool too)
        link.reconnect()
        assert link.wait_ready(10.0) and link.epoch == 2
    eng.run(prompt(2))  # copies into epoch 2's pool now
    assert w._pool is not old(), "the worker attached the new pool"  # noqa: SLF001
    gc.collect()
    assert old() is not None, "epoch 1's mapping was let go while a copy into it was in flight"
    assert not runtime.unregistered, "its registration ended under a running DMA"
    stream.complete()
    empty_step(eng)
    gc.collect()
    assert old() is None, "the mapping is kept after its copies completed"
    wait_until(lambda: old_pins.base in runtime.unregistered, timeout=5, what="the old registration ended")


# -- 4 ------------------------------------------------------------------------------------------
def test_kernel_blocks_smaller_than_vllms_block_are_paged_by_the_worker() -> None:
    caches = split_caches(2)  # 2 kernel rows of 8 tokens per 16-token vLLM block
    nb = next(iter(caches.values())).shape[1] // 2
    layers = len(caches)
    t = next(iter(caches.values()))
    page = layers * 2 * 16 * t.shape[3] * t.shape[4] * t.element_size()
    ident = identity(layers=layers)
    ident = type(ident)(**{**ident.__dict__, "page_bytes": page})
    node = FakeNode(pool_bytes=1 << 22)
    w = WorkerSide(ident, 0, lambda ns, pci="": fake_link(node, ns, pci))
    w.register_kv_caches(caches, nb)
    assert w.disabled is None and w.layout is not None and w.layout.page_bytes == page
    assert w.handshake() == PegaWorkerState(rank=0, disabled="", node=node.node_id)
    # vLLM block 3's page is kernel rows 6 and 7 of every layer, K then V.
    want = torch.cat([t[kv, 6:8].reshape(-1).view(torch.uint8) for t in caches.values() for kv in (0, 1)])
    assert torch.equal(w.layout.page(3), want)


def test_a_worker_that_cannot_copy_tells_the_scheduler_before_any_request() -> None:
    node = FakeNode()
    warm = Engine(node, identity())
    tokens = prompt(3)
    warm.run(tokens)
    eng = Engine(node, identity())
    w = WorkerSide(identity(), 0, lambda ns, pci="": fake_link(node, ns, pci))
    w.register_kv_caches({"model.layers.0.attn": torch.zeros(64, 3, 7)}, 64)  # a page the scheduler does not expect
    assert w.disabled and w.layout is None
    state = w.handshake()
    assert state.disabled
    # vLLM hands every rank's handshake to the scheduler-side connector before scheduling.
    PegaKVConnector.set_xfer_handshake_metadata(SimpleNamespace(_sched=eng.sched), {0: state})  # type: ignore[arg-type]
    assert eng.sched.disabled
    queries = node.calls["query"]
    assert eng.sched.get_num_new_matched_tokens(eng.request(tokens), 0) == (0, False), "a load no rank will copy"
    assert node.calls["query"] == queries
    reserves = node.calls["reserve"]
    eng.run(prompt(4))
    assert node.calls["reserve"] == reserves, "a save no rank will copy"


def test_a_worker_that_refuses_the_model_at_construction_tells_the_scheduler() -> None:
    """A group of layers with different shapes (vLLM's ``UniformTypeKVCacheSpecs``) is refused
    by the worker; vLLM gives the scheduler a copy flattened to the first layer's spec, which
    passes, so only the worker's handshake can stop it planning saves no rank copies."""
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        UniformTypeKVCacheSpecs,
    )

    specs = {f"l{i}": FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=8, dtype=torch.float16)
             for i, heads in enumerate((8, 2))}
    group = KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs))
    config = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="PegaKVConnector", kv_role="kv_both", kv_connector_module_path="pegaflow.connector"))
    worker = PegaKVConnector(config, KVConnectorRole.WORKER,
                             KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group]))
    state = worker.get_handshake_metadata()
    assert state is not None and "UniformTypeKVCacheSpecs" in state.disabled
    eng = Engine(FakeNode(), identity())
    PegaKVConnector.set_xfer_handshake_metadata(SimpleNamespace(_sched=eng.sched), {0: state})  # type: ignore[arg-type]
    assert eng.sched.disabled


def test_pipeline_stages_refusing_the_model_leave_the_engine_serving() -> None:
    """vLLM >= 0.24 gives the scheduler side every worker's handshake keyed by (stage, rank);
    the base class raised on stage 1's, which stopped the engine where PegaFlow only meant to
    step aside (every rank refuses pipeline parallelism)."""

    refused = PegaWorkerState(rank=0, disabled="PegaFlow does not support pipeline parallelism yet")
    both = {(0, 0): refused, (1, 0): refused}
    PegaKVConnector.set_xfer_handshake_metadata_pp_aware(SimpleNamespace(_sched=None), both)  # type: ignore[arg-type]
    eng = Engine(FakeNode(), identity())
    PegaKVConnector.set_xfer_handshake_metadata_pp_aware(  # type: ignore[arg-type]
        SimpleNamespace(_sched=eng.sched), {(0, 0): PegaWorkerState(rank=0), (1, 0): refused})
    assert eng.sched.disabled and "stage 1" in eng.sched.disabled


def test_a_rank_on_another_hosts_node_disables_the_engine_with_the_setting_to_use() -> None:
    """A TP group spread over hosts, each rank mapping its own host's node, without
    ``pegaflow.tp_shard_endpoints``: the scheduler plans pages on its node that the other
    host's ranks cannot copy (every hit a load error): refused at the handshake."""
    here = FakeNode(node_id="host-a")
    eng = Engine(here, identity(tp=2))
    states = {r: w.handshake() for r, w in enumerate(eng.workers)}
    assert [s.node for s in states.values()] == ["host-a", "host-a"]
    PegaKVConnector.set_xfer_handshake_metadata(SimpleNamespace(_sched=eng.sched), states)  # type: ignore[arg-type]
    assert eng.sched.disabled is None
    states[1] = PegaWorkerState(rank=1, node="host-b")
    PegaKVConnector.set_xfer_handshake_metadata_pp_aware(  # type: ignore[arg-type]
        SimpleNamespace(_sched=eng.sched), {(0, r): st for r, st in states.items()})
    assert eng.sched.disabled is not None and "tp_shard_endpoints" in eng.sched.disabled
    unknown = Engine(FakeNode(node_id="host-a"), identity(tp=2))  # a rank whose node did not answer: not judged
    PegaKVConnector.set_xfer_handshake_metadata(  # type: ignore[arg-type]
        SimpleNamespace(_sched=unknown.sched), {0: PegaWorkerState(rank=0), 1: PegaWorkerState(rank=1, node="")})
    assert unknown.sched.disabled is None


def test_a_worker_disabled_after_start_is_seen_in_its_report() -> None:
    node = FakeNode()
    eng = Engine(node, identity())
    eng.workers[0].disable("the copier lost its device")
    report = empty_step(eng)
    assert report.disabled and eng.sched.disabled
    assert PegaWorkerReport(disabled=True).aggregate(PegaWorkerReport()).disabled


# -- 5 ------------------------------------------------------------------------------------------
def _vllm_config() -> Any:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1, rank=0),
        model_config=SimpleNamespace(model="m", revision=None, dtype=torch.float16,
                                     hf_config=SimpleNamespace(to_dict=lambda: {"a": 1})),
        cache_config=SimpleNamespace(cache_dtype="auto"),  # a vLLM < 0.29: no resolved layout
    )


def test_the_layout_a_vllm_names_only_through_get_kv_cache_layout_separates_namespaces(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from pegaflow.connector.connector import kv_identity

    layout = ["NHD"]

    @functools.lru_cache
    def get_kv_cache_layout() -> str:
        return layout[0]

    fake = types.ModuleType("vllm.v1.attention.backends.utils")
    fake.get_kv_cache_layout = get_kv_cache_layout  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.utils", fake)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    kvc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    nhd = kv_identity(_vllm_config(), kvc)
    layout[0] = "HND"
    hnd = kv_identity(_vllm_config(), kvc)
    assert nhd.platform.endswith(":NHD") and hnd.platform.endswith(":HND")
    assert set(nhd.namespaces).isdisjoint(hnd.namespaces), "NHD and HND engines would exchange pages"
    assert get_kv_cache_layout.cache_info().currsize == 0, "vLLM's own layout cache was filled by the connector"
    assert kv_layout_name(SimpleNamespace(cache_config=SimpleNamespace(kv_cache_layout="BHLNC")), None) == "BHLNC"


def _one_group() -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])


@pytest.mark.parametrize("size", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_kv_sharded_by_context_parallelism_is_refused(size: str) -> None:
    """With DCP vLLM's block spans block_size x dcp tokens interleaved over the ranks: a page
    named by block_size tokens' hash would hold other tokens (on one node as on several)."""
    from pegaflow.connector.connector import kv_identity

    cfg = _vllm_config()
    setattr(cfg.parallel_config, size, 1)
    kv_identity(cfg, _one_group())
    setattr(cfg.parallel_config, size, 2)
    with pytest.raises(ValueError, match=f"context parallelism; got .*{size}=2"):
        kv_identity(cfg, _one_group())


def test_torchrun_mode_with_tensor_parallelism_is_refused() -> None:
    """With ``external_launcher`` every rank runs its own scheduler and one worker: each would
    ask the node apart (diverging schedules hang the ranks' collectives) and commit pages of
    shards it never wrote."""
    from pegaflow.connector.connector import kv_identity

    cfg = _vllm_config()
    cfg.parallel_config.distributed_executor_backend = "external_launcher"
    kv_identity(cfg, _one_group())  # one rank: its own engine, as any
    cfg.parallel_config.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="external_launcher"):
        kv_identity(cfg, _one_group())
    cfg.parallel_config.distributed_executor_backend = "mp"
    kv_identity(cfg, _one_group())


def test_weights_quantized_as_they_load_get_their_own_namespace() -> None:
    """``--quantization fp8`` on a bf16 checkpoint leaves its config as it was, and changes
    the KV values: the two engines must not share pages."""
    from pegaflow.connector.connector import kv_identity

    plain = kv_identity(_vllm_config(), _one_group())
    cfg = _vllm_config()
    cfg.model_config.quantization = None
    assert kv_identity(cfg, _one_group()) == plain
    cfg.model_config.quantization = "fp8"
    fp8 = kv_identity(cfg, _one_group())
    assert fp8.model_dtype == f"{plain.model_dtype}+fp8" and set(fp8.namespaces).isdisjoint(plain.namespaces)


def test_a_worker_whose_layout_is_not_the_namespaces_copies_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import pegaflow.connector.connector as connector_mod

    worker = WorkerSide(identity(), 0, lambda ns, pci="": fake_link(FakeNode(), ns, pci))
    conn = SimpleNamespace(_worker=worker, identity=identity(), _vllm=_vllm_config(), _kv_cache_config=None,
                           _layer_groups={})
    monkeypatch.setattr(connector_mod, "kv_layout_name", lambda *_: "HND")  # the backend changed it
    PegaKVConnector.register_kv_caches(conn, {"model.layers.0.attn": torch.zeros(8, 2, 16, 16)})  # type: ignore[arg-type]
    assert worker.disabled and "HND" in worker.disabled and worker.layout is None


def test_cross_layer_blocks_are_asked_for_and_registered_as_one_run_per_block(monkeypatch: pytest.MonkeyPatch) -> None:
    conn = SimpleNamespace()
    assert PegaKVConnector.prefer_cross_layer_blocks.fget(conn) is True  # type: ignore[attr-defined]
    monkeypatch.setenv("PEGAFLOW_CROSS_LAYER_BLOCKS", "0")
    assert PegaKVConnector.prefer_cross_layer_blocks.fget(conn) is False  # type: ignore[attr-defined]
    seen: dict[str, Any] = {}
    conn2 = SimpleNamespace(register_kv_caches=lambda caches, layerwise=True: seen.update(caches=caches, layerwise=layerwise))
    cross = torch.zeros(8, 3, 2, 16, 2, 8)  # (blocks, layers, K/V, tokens, heads, head_dim)
    PegaKVConnector.register_cross_layers_kv_cache(conn2, cross, None)  # type: ignore[arg-type]
    assert seen == {"caches": {"cross_layers": cross}, "layerwise": False}


def test_a_cross_layer_cache_loads_the_same_pages_and_the_forward_waits_for_the_whole_load() -> None:
    """One cross-layer tensor (vLLM 0.20-0.28's ``register_cross_layers_kv_cache``) holds the
    same page bytes as per-layer tensors, in one run per block; its layers have no names
    here, so the forward waits for the whole load instead of layer by layer."""
    node = FakeNode()
    ident = identity()
    tokens = prompt(9)
    Engine(node, ident).run(tokens)  # saved by a per-layer engine
    stream = ManualStream()
    eng = Engine(node, ident, stream=lambda: stream)
    nb = next(iter(eng.caches[0].values())).shape[0]
    cross = torch.zeros(nb, ident.num_layers, ident.num_kv_heads, ident.block_size, 2 * ident.head_size,
                        dtype=torch.float16)
    eng.caches[0] = {name: cross[:, i] for i, name in enumerate(eng.caches[0])}
    w = eng.workers[0]
    w.register_kv_caches({"cross_layers": cross}, nb, layerwise=False)
    assert w.disabled is None and w.layout is not None and len(w.layout.segments) == 1
    stream.log.clear()
    out = eng.run(tokens)
    full = (len(tokens) - 1) // ident.block_size
    assert out["external"] == full * ident.block_size
    assert out["loaded"][0] == [eng.expected(0, tokens, i) for i in range(full)]
    assert not w._layer_events, "per-layer events for layers vLLM does not know by these names"  # noqa: SLF001
    waited = [e[1] for e in stream.log if e[0] == "waits"]
    assert waited, "the forward did not wait for the load"


def test_a_save_whose_bounce_copy_failed_is_aborted_not_committed() -> None:
    """A save through a bounce slot lands in the pool on the finisher's thread; if that
    fails, the step's reservations are reported failed with the step, never committed."""

    class Broken:
        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            raise RuntimeError("the device copy into the bounce slot failed")

    class BrokenStream(HostStream):
        def record(self) -> Broken:  # type: ignore[override]
            return Broken()

    runtime = FakeRuntime()
    runtime.gate = threading.Event()  # nothing gets registered: every save bounces
    node = FakeNode()
    eng = Engine(node, identity(), stream=BrokenStream, pins=pins_with(runtime))
    eng.run(prompt(12))
    wait_until(lambda: empty_step(eng) and node.calls["abort"] >= 1, timeout=10, what="the failed save is aborted")
    assert node.calls["commit"] == 0 and not node.stored
    # The original's series: that batch is a failure only, not a success too.
    stats = eng.workers[0].take_stats()
    assert stats.get("save_failure", 0) >= 1 and stats.get("save_success", 0) == 0, stats
    runtime.gate.set()


def test_the_cuda_runtime_is_the_one_torch_mapped() -> None:
    maps = "\n".join([
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6",
        "7f02-7f03 r-xp 00000000 08:01 2 /opt/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13",
        "7f04-7f05 r--p 00001000 08:01 2 /opt/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13",
        "7f06-7f07 r-xp 00000000 08:01 3 /opt/other/libcudart.so.12",
        "7f08-7f09 rw-p 00000000 00:00 0 ",
    ])
    assert cuda.find_cudart(maps, major="13").endswith("/nvidia/cu13/lib/libcudart.so.13")
    # Two runtimes in nvidia packages (a CUDA 12 torch beside a CUDA 13 wheel): torch's major.
    both = maps + "\n7f0a-7f0b r-xp 00000000 08:01 4 /opt/venv/lib/python3.12/site-packages/nvidia/cuda_runtime/lib/" \
                  "libcudart.so.12"
    assert cuda.find_cudart(both, major="12").endswith("/nvidia/cuda_runtime/lib/libcudart.so.12")
    assert cuda.find_cudart(both, major="13").endswith("/nvidia/cu13/lib/libcudart.so.13")
    with pytest.raises(OSError, match="no libcudart"):
        cuda.find_cudart("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6")


def test_a_forward_replayed_as_one_cuda_graph_waits_for_the_whole_load_in_either_model_runner() -> None:
    """vLLM's first model runner starts a FULL graph's loads inside the forward's context
    (its graph mode FULL); its second starts them before, in a stand-in context
    (``set_forward_context(None, ...)``) with no graph mode and no attention metadata.
    Either way no Python runs between the replayed layers: the whole load is waited for."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, set_forward_context

    from pegaflow.connector.connector import layer_by_layer
    from tests.unit.test_connector_names import vllm_config

    cfg = vllm_config("PegaKVConnector", "pegaflow.connector")
    attn = {"model.layers.0.self_attn.attn": object()}
    with set_forward_context(None, cfg):  # the second runner's stand-in
        assert not layer_by_layer(get_forward_context())
    with set_forward_context(attn, cfg, cudagraph_runtime_mode=CUDAGraphMode.FULL):
        assert not layer_by_layer(get_forward_context())
    for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE):  # attention runs eagerly: layer by layer
        with set_forward_context(attn, cfg, cudagraph_runtime_mode=mode):
            assert layer_by_layer(get_forward_context())


def _worker_on(caches: dict[str, torch.Tensor]) -> WorkerSide:
    from pegaflow.connector.layout import build_page_layout

    ident = identity(layers=len(caches))
    nb = next(iter(caches.values())).shape[1]
    ident = type(ident)(**{**ident.__dict__, "page_bytes": build_page_layout(caches, nb).page_bytes})
    node = FakeNode(pool_bytes=1 << 22)
    w = WorkerSide(ident, 0, lambda ns, pci="": fake_link(node, ns, pci))
    w.register_kv_caches(caches, nb)
    return w


def test_a_cuda_device_without_a_cuda_runtime_disables_the_worker_not_the_engine(monkeypatch) -> None:  # noqa: ANN001
    """The copy stream's constructor loads libcudart: on a ROCm torch (its devices are
    "cuda" too) or a torch without one on the loader's path, the OSError escaped
    register_kv_caches and the engine failed to start, instead of serving without PegaFlow."""
    from pegaflow.connector import worker as worker_module

    def no_runtime(device: torch.device) -> Any:
        raise OSError("no libcudart is loaded in this process")

    monkeypatch.setattr(worker_module, "stream_for", no_runtime)
    w = _worker_on(split_caches(1))
    assert w.disabled and "libcudart" in w.disabled and w.link is None


def test_a_kv_cache_on_a_device_without_a_copy_path_is_refused_at_registration() -> None:
    """An XPU or HPU cache ("meta" stands in) was accepted: every load and save then failed
    with a traceback each step while the scheduler kept promising hits."""
    w = _worker_on({k: v.to("meta") for k, v in split_caches(1).items()})
    assert w.disabled and "no copy path for a KV cache on meta" in w.disabled and w.link is None
