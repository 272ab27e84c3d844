"""The CUDA edge of the copy path: the CUDA runtime torch loaded, the copy stream, and the
pool's registration (pinning) with CUDA.

* ``Cudart``: the few runtime calls the copies need that torch does not bind
  (``cudaMemcpyAsync``/``cudaMemcpy2DAsync`` on a stream, ``cudaGetLastError``), through
  ctypes on **the same** ``libcudart`` torch loaded (``find_cudart``): CUDA's last error is
  per runtime instance and host thread, so clearing it on another copy of the runtime
  would leave torch's set.
* ``CudaCopyStream``: ``pegaflow.connector.inflight.CopyStream`` on a side stream, with its
  events taken from a free list and given back (``recycle``) rather than made per copy.
* ``PoolPins``: registers the pool mapping with CUDA in ``CHUNK`` pieces, **in a background
  thread**, front to back, only where the node has pre-faulted the pool already (a piece
  registered before the node touched it would fault its pages into this process and charge
  them to the engine's memory cgroup; ``pegaflow.client.populate`` keeps the same rule).
  Registration costs tens to hundreds of ms per GiB; done inside a step it would stall the
  forward on every TP rank, so copies never register: a piece not registered yet is copied
  through a pinned bounce slot (``batched.Bounce``). A refused registration (CUDA's error
  cleared on the registering thread, so no later kernel of it reports it) stops the
  registration, logged once and counted (``pegaflow_client_pin_failures_total``); the
  pieces it did not register keep going through the bounce slots, never through a pageable
  copy (a DMA from the GPU to pageable memory blocks the host behind the forward).
  "Already registered" (712) counts as registered (by someone else: never unregistered
  here). A stream-capture error (900-908: a CUDA graph being captured on another thread
  in CUDA's global mode, which forbids other threads' registrations) is no refusal: the
  piece is tried again a second later. The caller starts a registration only once the
  engine copies (vLLM captures its graphs after ``register_kv_caches``; a registration
  during a capture also breaks the capture, vllm-project/vllm#46933). The thread first
  makes the engine's device current (``device``): a new thread's is device 0, and its
  first call would create a CUDA context there on every rank. The registration ends with
  the pool tensor (``weakref.finalize``): the caller keeps the tensor alive while copies
  use it (``connector.inflight.InFlight`` holds it with every step's copies).

Everything here runs only where ``torch.cuda.is_available()``, except ``PoolPins`` and
``PinMetrics``, which the tests drive with a fake runtime (the hardware edge).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol, cast

import structlog
import torch
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

log = structlog.get_logger("pegaflow.cuda")

CHUNK = 1 << 30  # registration pieces: no DMA spans two (batched's ``split``)
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the addresses (unified addressing)
ERROR_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
CAPTURE_ERRORS = range(900, 909)  # cudaErrorStreamCaptureUnsupported (900) ... cudaErrorStreamCaptureWrongThread (908)
ERROR_RAISED = -1  # PoolPins.failed when a call raised instead of returning CUDA's error code
CAPTURE_RETRY_S = 1.0  # a piece refused during a stream capture is tried again this much later
FRONT_POLL_S = 0.05  # how often the registration thread looks at the node's pre-fault front


class PinMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.bytes = Gauge("pegaflow_client_pinned_bytes",
                           "Pool bytes this engine process has registered with CUDA (pinned)", registry=registry)
        self.seconds = Counter("pegaflow_client_pin_seconds_total",
                               "Seconds this engine process spent registering pool memory with CUDA",
                               registry=registry)
        self.failures = Counter("pegaflow_client_pin_failures_total",
                                "Registrations of pool memory CUDA refused (the rest of the pool is then copied "
                                "through pinned bounce buffers)", registry=registry)
        self.bounced = Counter("pegaflow_client_bounce_runs_total",
                               "Runs of pool pages copied through a pinned bounce buffer because their part of the "
                               "pool was not registered with CUDA yet", registry=registry)


_metrics: PinMetrics | None = None


def pin_metrics() -> PinMetrics:
    global _metrics
    if _metrics is None:
        _metrics = PinMetrics()
    return _metrics


class Runtime(Protocol):
    """The CUDA runtime calls the registration makes (``Cudart``; a fake in the tests)."""

    def host_register(self, ptr: int, nbytes: int, flags: int) -> int: ...

    def host_unregister(self, ptr: int) -> int: ...

    def get_last_error(self) -> int: ...

    def set_device(self, device: int) -> int: ...


def find_cudart(maps: str | None = None, major: str | None = None) -> str:
    """The path of the ``libcudart`` this process has loaded (torch's), from
    ``/proc/self/maps``; several: those of torch's CUDA major version (``major``, else
    ``torch.version.cuda``'s: each runtime instance has its own current device and last
    error), then those beside torch's or in an ``nvidia`` package."""
    text = maps if maps is not None else Path("/proc/self/maps").read_text()
    paths = sorted({line.split()[-1] for line in text.splitlines()
                    if "libcudart" in line.rsplit("/", 1)[-1] and line.split()[-1].startswith("/")})
    if not paths:
        raise OSError("no libcudart is loaded in this process (torch with CUDA initialized loads one)")
    if major is None and torch.version.cuda:
        major = torch.version.cuda.split(".")[0]
    if major is not None:
        paths = [p for p in paths if f".so.{major}" in p.rsplit("/", 1)[-1]] or paths
    preferred = [p for p in paths if "/torch/" in p or "/nvidia/" in p]
    return (preferred or paths)[0]


# A torch that links the CUDA runtime statically maps no libcudart: then one is loaded by
# name. Its calls share torch's CUDA context (its streams included), and an error one of them
# leaves is that instance's alone, so torch's next launch check never sees it either.
_SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


class Cudart:
    """ctypes calls into the CUDA runtime torch loaded (``find_cudart``), else one found by
    name. Each call releases the GIL while the runtime works."""

    def __init__(self, path: str | None = None) -> None:
        lib: ctypes.CDLL | None = None
        if path is None:
            torch.cuda.init()
            try:
                path = find_cudart()
            except OSError:
                for name in _SONAMES:
                    try:
                        lib, path = ctypes.CDLL(name), name
                        break
                    except OSError:
                        continue
                else:
                    raise
                log.warning("cudart_by_name", path=path, reason="torch maps no libcudart (linked statically)")
        self.path = path
        if lib is None:
            lib = (ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL) if path.startswith("/")
                   else ctypes.CDLL(path))
        c = ctypes
        self._register = lib.cudaHostRegister
        self._register.argtypes, self._register.restype = [c.c_void_p, c.c_size_t, c.c_uint], c.c_int
        self._unregister = lib.cudaHostUnregister
        self._unregister.argtypes, self._unregister.restype = [c.c_void_p], c.c_int
        self._last = lib.cudaGetLastError
        self._last.argtypes, self._last.restype = [], c.c_int
        self._set_device = lib.cudaSetDevice
        self._set_device.argtypes, self._set_device.restype = [c.c_int], c.c_int
        self._memcpy = lib.cudaMemcpyAsync
        self._memcpy.argtypes = [c.c_void_p, c.c_void_p, c.c_size_t, c.c_int, c.c_void_p]
        self._memcpy.restype = c.c_int
        self._memcpy2d = lib.cudaMemcpy2DAsync
        self._memcpy2d.argtypes = [c.c_void_p, c.c_size_t, c.c_void_p, c.c_size_t, c.c_size_t, c.c_size_t, c.c_int,
                                   c.c_void_p]
        self._memcpy2d.restype = c.c_int
        self._errstr = lib.cudaGetErrorString
        self._errstr.argtypes, self._errstr.restype = [c.c_int], c.c_char_p

    def host_register(self, ptr: int, nbytes: int, flags: int) -> int:
        return int(self._register(ptr, nbytes, flags))

    def host_unregister(self, ptr: int) -> int:
        return int(self._unregister(ptr))

    def get_last_error(self) -> int:
        return int(self._last())

    def set_device(self, device: int) -> int:
        return int(self._set_device(device))

    def error_string(self, rc: int) -> str:
        s = self._errstr(rc)
        return s.decode() if s else str(rc)

    def check(self, rc: int, what: str) -> None:
        if rc:
            self.get_last_error()  # a failed call leaves it set for this thread's next kernel check
            raise RuntimeError(f"{what}: CUDA error {rc} ({self.error_string(rc)})")

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check(self._memcpy(dst, src, nbytes, _MEMCPY_DEFAULT, stream), "cudaMemcpyAsync")

    def memcpy2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                       stream: int) -> None:
        self.check(self._memcpy2d(dst, dpitch, src, spitch, width, height, _MEMCPY_DEFAULT, stream),
                   "cudaMemcpy2DAsync")


_cudart: Cudart | None = None


def cudart() -> Cudart:
    global _cudart
    if _cudart is None:
        _cudart = Cudart()
    return _cudart


class CudaCopyStream:
    """``pegaflow.connector.inflight.CopyStream`` on a CUDA side stream of ``device``."""

    asynchronous = True

    def __init__(self, device: torch.device, runtime: Cudart | None = None) -> None:
        # An index always: ``bind_thread``'s set_device refuses a bare "cuda" (ValueError), and
        # a new thread's current device is 0, not necessarily this one.
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(device=self.device)
        self.runtime = runtime or cudart()
        self._free: list[torch.cuda.Event] = []

    def after_compute(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def issuing(self) -> AbstractContextManager[object]:
        return torch.cuda.stream(self.stream)

    def record(self) -> torch.cuda.Event:
        ev = self._free.pop() if self._free else torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def recycle(self, event: object) -> None:
        """``event`` will not be queried or waited for again: it may be recorded anew."""
        if isinstance(event, torch.cuda.Event):
            self._free.append(event)

    def compute_waits(self, event: object) -> None:
        """``event``: one this stream recorded (``record``), so a ``torch.cuda.Event``."""
        torch.cuda.current_stream(self.device).wait_event(cast(torch.cuda.Event, event))

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self.runtime.memcpy_async(dst, src, nbytes, self.stream.cuda_stream)

    def copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        self.runtime.memcpy2d_async(dst, dpitch, src, spitch, width, height, self.stream.cuda_stream)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def bind_thread(self) -> None:
        """Make this stream's device current on the calling thread (a new thread's is device
        0: its first CUDA call would create a context there)."""
        torch.cuda.set_device(self.device)


class PoolPins:
    """Which ``chunk`` pieces of one pool mapping ``[base, base + size)`` are registered with
    CUDA, registered by ``start()``'s thread behind ``front()`` (bytes of the pool the node
    has pre-faulted). See the module docstring for the rules."""

    def __init__(self, base: int, size: int, runtime: Runtime, front: Callable[[], int], chunk: int = CHUNK,
                 metrics: PinMetrics | None = None, poll_s: float = FRONT_POLL_S, device: int | None = None,
                 retry_s: float = CAPTURE_RETRY_S) -> None:
        self.base, self.size, self.chunk = base, size, chunk
        self.runtime = runtime
        self.device = device  # made current on the thread first (None: the tests' runtimes)
        self.retry_s = retry_s
        self.deferred = 0  # registrations a stream capture refused (tried again)
        self.front = front
        self.metrics = metrics or pin_metrics()
        self.poll_s = poll_s
        self.pieces = (size + chunk - 1) // chunk
        self.pinned: set[int] = set()  # registered here (unregistered by close)
        self.adopted: set[int] = set()  # found registered already (712): left alone
        self.failed: int | None = None  # the error CUDA refused a piece with (ERROR_RAISED: a call raised)
        self.seconds = 0.0
        self._lock = threading.Lock()  # pinned/adopted vs close; never held by a copy
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def registered(self, first: int, nbytes: int) -> bool:
        lo, hi = first // self.chunk, (first + max(nbytes, 1) - 1) // self.chunk
        return all(i in self.pinned or i in self.adopted for i in range(lo, hi + 1))

    @property
    def complete(self) -> bool:
        return len(self.pinned) + len(self.adopted) == self.pieces

    def start(self) -> PoolPins:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pegaflow-pool-pin", daemon=True)
            self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the thread has registered every piece or stopped; True if all are."""
        self._done.wait(timeout)
        return self.complete

    def _front(self) -> int:
        try:
            return int(self.front())
        except Exception:  # noqa: BLE001 - node not reachable right now: ask again later
            return 0

    def _run(self) -> None:
        try:
            if self.device is not None:
                rc = self.runtime.set_device(self.device)
                if rc:
                    self._refused(rc, 0, 0, "cudaSetDevice")
                    return
            for i in range(self.pieces):
                end = min((i + 1) * self.chunk, self.size)
                while self._front() < end:
                    if self._stop.wait(self.poll_s):
                        return
                while (done := self.register(i)) is None:  # a capture is under way: later
                    if self._stop.wait(self.retry_s):
                        return
                if not done:
                    return
        except Exception:  # noqa: BLE001 - not an error code: counted as a refusal, not a silent thread end
            self.failed = ERROR_RAISED
            self.metrics.failures.inc()
            log.exception("cuda_host_register_crashed", registered_bytes=len(self.pinned) * self.chunk,
                          effect="the rest of the pool is copied through pinned bounce buffers (slower)")
        finally:
            self._done.set()

    def register(self, i: int) -> bool | None:
        """Register piece ``i`` now (the thread's step; tests call it directly): True if it
        is, False if CUDA refused it (the registration stops), None if a stream capture
        did (try again later)."""
        n = min(self.chunk, self.size - i * self.chunk)
        t0 = time.perf_counter()
        with self._lock:
            if self._stop.is_set():
                return False
            rc = self.runtime.host_register(self.base + i * self.chunk, n, _HOST_REGISTER_PORTABLE)
            took = time.perf_counter() - t0
            if rc == ERROR_ALREADY_REGISTERED:
                self.runtime.get_last_error()
                self.adopted.add(i)
                return True
            if rc in CAPTURE_ERRORS:
                self.runtime.get_last_error()
                self.deferred += 1
                if self.deferred == 1:
                    log.warning("cuda_host_register_deferred", error=rc, offset=i * self.chunk,
                                reason="a CUDA graph is being captured", retry_s=self.retry_s)
                return None
            if rc != 0:
                self._refused(rc, i * self.chunk, n, "cudaHostRegister")
                return False
            self.pinned.add(i)
        self.seconds += took
        self.metrics.bytes.inc(n)
        self.metrics.seconds.inc(took)
        log.debug("cuda_host_registered", offset=i * self.chunk, bytes=n, seconds=round(took, 4),
                  gib_per_s=round(n / max(took, 1e-9) / 2**30, 1))
        return True

    def _refused(self, rc: int, offset: int, nbytes: int, call: str) -> None:
        self.runtime.get_last_error()  # clear it: the next kernel on this thread would report it
        self.failed = rc
        self.metrics.failures.inc()
        log.warning("cuda_host_register_failed", call=call, error=rc, offset=offset, bytes=nbytes,
                    registered_bytes=len(self.pinned) * self.chunk,
                    effect="the rest of the pool is copied through pinned bounce buffers (slower)")

    def close(self) -> None:
        """Stop registering and unregister what was registered here."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            for i in sorted(self.pinned):
                rc = self.runtime.host_unregister(self.base + i * self.chunk)
                if rc:  # cleared: this is often the engine's thread, whose next kernel would report it
                    self.runtime.get_last_error()
                    log.warning("cuda_host_unregister_failed", error=rc, offset=i * self.chunk)
                self.metrics.bytes.dec(min(self.chunk, self.size - i * self.chunk))
            self.pinned.clear()


_pins: dict[int, PoolPins] = {}
_lock = threading.Lock()


def pins_for(pool: torch.Tensor, front: Callable[[], int], runtime: Runtime | None = None,
             chunk: int = CHUNK, device: int | None = None) -> PoolPins:
    """The registration of the mapping ``pool`` views, started once (its thread registers
    behind ``front``, with ``device`` current); it ends when ``pool`` is collected."""
    ptr = pool.data_ptr()
    with _lock:
        pins = _pins.get(ptr)
        if pins is None or pins.size != pool.numel():
            pins = _pins[ptr] = PoolPins(ptr, pool.numel(), runtime or cudart(), front, chunk,
                                         device=device).start()
            weakref.finalize(pool, _end, ptr, pins)
    return pins


def registered_pins(pool: torch.Tensor) -> PoolPins | None:
    """The registration started for ``pool``'s mapping, if any."""
    p = _pins.get(pool.data_ptr())
    return p if p is not None and p.size == pool.numel() else None


def _end(ptr: int, pins: PoolPins) -> None:
    pins.close()
    with _lock:
        if _pins.get(ptr) is pins:
            del _pins[ptr]


def unregister_all() -> None:
    with _lock:
        pins = list(_pins.values())
        _pins.clear()
    for p in pins:
        p.close()
