"""The CUDA-specific part of the copy path: pool memory registered (pinned) with CUDA.

A DMA between a GPU and pageable host memory is staged through a driver bounce buffer and
is synchronous; registered memory is copied by the copy engine directly, asynchronously,
at PCIe speed. The pool is one shared mapping of up to terabytes, so it is registered
lazily, in ``CHUNK``-byte pieces, the first time a copy touches a piece: an engine's start
does not depend on the pool's size, and only the parts it uses are pinned in its address
space (pinning a range pins its pages; the node owns and has already faulted them).
Copies are planned so that no single DMA spans two pieces (``batched.plan(split=CHUNK)``).
Registrations end when the pool tensor is collected or ``unregister_all`` is called (the
worker's shutdown).

Everything here runs only where ``torch.cuda.is_available()``; the planning and copies it
serves are device-agnostic (``pegaflow.client.batched``) and tested on CPU.
"""

from __future__ import annotations

import threading
import time
import weakref

import structlog
import torch
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

log = structlog.get_logger("pegaflow.cuda")

CHUNK = 1 << 30
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


class PinMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.bytes = Gauge("pegaflow_client_pinned_bytes",
                           "Pool bytes this engine process has registered with CUDA (pinned)", registry=registry)
        self.seconds = Counter("pegaflow_client_pin_seconds_total",
                               "Seconds this engine process spent registering pool memory with CUDA",
                               registry=registry)


_metrics: PinMetrics | None = None


def _pin_metrics() -> PinMetrics:
    global _metrics
    if _metrics is None:
        _metrics = PinMetrics()
    return _metrics


class Registration:
    """Which ``CHUNK`` pieces of one pool mapping are registered with CUDA."""

    def __init__(self, base: int, size: int, chunk: int = CHUNK, cudart: object = None) -> None:
        self.base, self.size, self.chunk = base, size, chunk
        self._cudart = cudart  # torch.cuda.cudart() unless given (tests: a fake at the driver edge)
        self.pinned: set[int] = set()
        self.lock = threading.Lock()
        self.failed = False

    def ensure(self, first_byte: int, nbytes: int) -> bool:
        """Register the pieces ``[first_byte, first_byte + nbytes)`` touches; False if CUDA
        refused (the copy still works, from pageable memory, slower)."""
        if self.failed or nbytes <= 0:
            return not self.failed
        lo, hi = first_byte // self.chunk, (first_byte + nbytes - 1) // self.chunk
        todo = [i for i in range(lo, hi + 1) if i not in self.pinned]
        if not todo:
            return True
        cudart = self._cudart or torch.cuda.cudart()
        with self.lock:
            for i in todo:
                if i in self.pinned:
                    continue
                n = min(self.chunk, self.size - i * self.chunk)
                t0 = time.perf_counter()
                rc = cudart.cudaHostRegister(self.base + i * self.chunk, n, _HOST_REGISTER_PORTABLE)
                took = time.perf_counter() - t0
                if int(rc) != 0:
                    self.failed = True
                    log.warning("cuda_host_register_failed", error=int(rc), offset=i * self.chunk, bytes=n)
                    return False
                self.pinned.add(i)
                m = _pin_metrics()
                m.bytes.inc(n)
                m.seconds.inc(took)
                log.debug("cuda_host_registered", offset=i * self.chunk, bytes=n, seconds=round(took, 4),
                          gib_per_s=round(n / max(took, 1e-9) / 2**30, 1))
        return True

    def close(self) -> None:
        with self.lock:
            if not self.pinned:
                return
            cudart = self._cudart or torch.cuda.cudart()
            for i in sorted(self.pinned):
                cudart.cudaHostUnregister(self.base + i * self.chunk)
                _pin_metrics().bytes.dec(min(self.chunk, self.size - i * self.chunk))
            self.pinned.clear()


_registrations: dict[int, Registration] = {}
_lock = threading.Lock()


def registration(pool: torch.Tensor) -> Registration:
    """The registration of the mapping ``pool`` views (made once; ended when ``pool`` dies)."""
    ptr = pool.data_ptr()
    reg = _registrations.get(ptr)
    if reg is None:
        with _lock:
            reg = _registrations.get(ptr)
            if reg is None:
                reg = _registrations[ptr] = Registration(ptr, pool.numel())
                weakref.finalize(pool, _end, ptr, reg)
    return reg


def _end(ptr: int, reg: Registration) -> None:
    reg.close()
    if _registrations.get(ptr) is reg:
        del _registrations[ptr]


def unregister_all() -> None:
    with _lock:
        regs = list(_registrations.items())
        _registrations.clear()
    for _, reg in regs:
        reg.close()


class CudaCopyStream:
    """``pegaflow.connector.inflight.CopyStream`` on a CUDA side stream of ``device``."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def after_compute(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def issuing(self) -> torch.cuda.StreamContext:
        return torch.cuda.stream(self.stream)

    def record(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def compute_waits(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)
