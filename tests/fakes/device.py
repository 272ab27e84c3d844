"""The hardware edge of the GPU copy path, on the host: what a CUDA stream and the CUDA
runtime do for ``pegaflow.client.batched`` and ``pegaflow.client.cuda``, done with memmove
and recorded, so the device-agnostic code around it runs on CPU tensors with real bytes.

* ``HostDma``: a copy stream's DMAs (``copy``, ``copy2d``), pinned buffers (plain host
  memory) and event recycling, counted;
* ``HostStream``: a copy stream whose events have completed when recorded (a device that
  is always done), for tests of the bytes;
* ``FakeRuntime``: ``cudaHostRegister``/``Unregister``/``GetLastError`` as the registration
  calls them: refuses on demand, keeps CUDA's sticky per-thread last error, can block a
  registration until the test lets it go, and times nothing it is not told to.
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch


class HostDma:
    """DMAs on the host, counted by kind (``self.dma``)."""

    def __init__(self) -> None:
        self.dma: dict[str, int] = {"copy": 0, "copy2d": 0}
        self.recycled: list[Any] = []
        self.pinned_bytes = 0
        self.bound: list[str] = []  # threads that made the stream's device theirs (bind_thread)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)
        self.dma["copy"] += 1

    def copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        assert width <= dpitch and width <= spitch, "a row wider than its pitch"
        if height:
            s = np.lib.stride_tricks.as_strided(np.ctypeslib.as_array((ctypes.c_uint8 * 1).from_address(src)),
                                                (height, width), (spitch, 1))
            d = np.lib.stride_tricks.as_strided(np.ctypeslib.as_array((ctypes.c_uint8 * 1).from_address(dst)),
                                                (height, width), (dpitch, 1))
            d[...] = s
        self.dma["copy2d"] += 1

    def pinned(self, nbytes: int) -> torch.Tensor:
        self.pinned_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8)

    def recycle(self, event: Any) -> None:
        self.recycled.append(event)

    def bind_thread(self) -> None:
        self.bound.append(threading.current_thread().name)


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HostStream(HostDma):
    """An asynchronous copy stream that is always done (events complete when recorded)."""

    asynchronous = True

    def __init__(self) -> None:
        super().__init__()
        self.records = 0

    def after_compute(self) -> None:
        return None

    def issuing(self) -> AbstractContextManager[object]:
        return nullcontext()

    def record(self) -> _Done:
        self.records += 1
        return _Done()

    def compute_waits(self, event: Any) -> None:
        return None


class FakeRuntime:
    """The CUDA runtime's registration calls. ``refuse``: address -> error code returned
    for it; ``gate``: while set, registrations wait on it (a slow registration)."""

    def __init__(self, refuse: dict[int, int] | None = None) -> None:
        self.refuse = dict(refuse or {})
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.threads: set[str] = set()  # the threads that registered
        self.devices: set[int] = set()  # the devices current where they registered
        self.attempts: list[int] = []  # every registration asked for, refused or not
        self._last = threading.local()  # CUDA's last error: per runtime and host thread
        self._device = threading.local()  # the current device: per host thread, 0 on a new one
        self.gate: threading.Event | None = None
        self.refuse_unregister = 0  # the error every unregistration returns (0: none)

    def set_device(self, device: int) -> int:
        self._device.index = device
        return 0

    def host_register(self, ptr: int, nbytes: int, flags: int) -> int:
        if self.gate is not None:
            self.gate.wait(10)
        self.threads.add(threading.current_thread().name)
        self.devices.add(getattr(self._device, "index", 0))
        self.attempts.append(ptr)
        rc = self.refuse.get(ptr, 0)
        if rc:
            self._last.error = rc  # set until someone on this thread reads it
            return rc
        self.registered.append((ptr, nbytes))
        return 0

    def host_unregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        rc = self.refuse_unregister
        if rc:
            self._last.error = rc
        return rc

    def get_last_error(self) -> int:
        rc = getattr(self._last, "error", 0)
        self._last.error = 0
        return rc

    def pending_error(self) -> int:
        """The last error this thread's next kernel launch check would report."""
        return getattr(self._last, "error", 0)
