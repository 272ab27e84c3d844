"""Copies that run beside the forward: the commit-after-event protocol, device-agnostic.

On a GPU a worker issues its copies on a side stream and does not wait for them in the
step. What makes that safe is ordering, expressed with events:

* **loads**: the side stream first waits for the work already queued on the compute stream
  (the blocks it writes may still be read by an earlier step), then copies; an event is
  recorded after each layer's writes and ``wait_for_layer_load`` makes the compute stream
  wait for that layer's event (device-side: the host never blocks). Where the forward is
  replayed as one CUDA graph, the Python between layers does not run, so the compute stream
  waits for the whole load before the forward instead (``layerwise=False``). An
  asynchronous load's request is reported finished only once its event completed.
* **saves**: the side stream waits for the forward, gathers the blocks, and the compute
  stream waits for the gather (so a block vLLM frees and reuses is not overwritten before it
  was read); the DMA into the pool then runs beside the next step.
* **commit after the event**: a step is reported done (``done_through``) only when every
  copy of it and of every earlier step has completed; the scheduler commits a step's
  reservations, and releases its leases, only then. A save is therefore never visible
  before its bytes are in the pool, and a leased page is never reused while a load still
  reads it. Steps complete in order (one side stream), so one number says it all, and
  over TP ranks the engine's is the smallest rank's (``PegaWorkerReport.aggregate``).
* **memory outlives the copies**: a step keeps the pool tensor its copies use (``keep``)
  until they completed. After a node restart the worker maps the new pool while earlier
  steps may still be copying into the old one; the old mapping (and its CUDA
  registration, ended with the tensor) goes only when those copies are done.
* **events are reused**: an event the protocol no longer needs (its step done, its wait
  queued) goes back to the stream (``recycle``), so a step records into events made once.

``CopyStream`` is the hardware edge: ``Immediate`` (CPU: every copy has completed when the
call returns; the worker then copies synchronously through the native path) and
``pegaflow.client.cuda.CudaCopyStream`` (which also queues the DMAs of
``pegaflow.client.batched.DeviceCopier``). Tests drive the protocol with events they
complete by hand.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

from pegaflow.client.batched import Event


class CopyStream(Protocol):
    asynchronous: bool

    def after_compute(self) -> None:
        """Copies issued next start after the work queued on the compute stream so far."""
        ...

    def issuing(self) -> AbstractContextManager[object]:
        """While entered, torch work is queued on the copy stream."""
        ...

    def record(self) -> Event:
        """An event after the copies issued so far."""
        ...

    def compute_waits(self, event: Event) -> None:
        """Work queued on the compute stream next starts after ``event`` (device-side)."""
        ...

    def recycle(self, event: Event) -> None:
        """Nobody queries or waits for ``event`` again: it may be recorded anew."""
        ...


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE = _Done()


class Immediate:
    """CPU: a copy has completed when its call returns."""

    asynchronous = False

    def after_compute(self) -> None:
        return None

    def issuing(self) -> AbstractContextManager[object]:
        return nullcontext()

    def record(self) -> Event:
        return DONE

    def compute_waits(self, event: Event) -> None:
        return None

    def recycle(self, event: Event) -> None:
        return None


@dataclass
class _Step:
    step: int
    events: list[Event] = field(default_factory=list)
    keep: list[object] = field(default_factory=list)  # memory the copies use (the pool tensor)


class InFlight:
    """The worker's steps whose copies were issued, oldest first. ``recycle`` gets every
    event once nothing here needs it any more."""

    def __init__(self, recycle: Callable[[Event], None] | None = None) -> None:
        self._steps: deque[_Step] = deque()
        self._last_step = -1
        self._finished_loads: deque[tuple[Event, frozenset[str]]] = deque()
        self.recycle = recycle or (lambda event: None)

    def begin(self, step: int) -> list[int]:
        """Step ``step``'s metadata is being handled; returns the steps before it this worker
        never saw (their copies were never made: the scheduler must abort them)."""
        lost = list(range(self._last_step + 1, step)) if self._last_step >= 0 else []
        if step > self._last_step:
            self._last_step = step
        return lost

    def _entry(self, step: int) -> _Step:
        if not self._steps or self._steps[-1].step != step:
            self._steps.append(_Step(step))
        return self._steps[-1]

    def add(self, step: int, event: Event, keep: object = None) -> None:
        """A copy of ``step`` that completes with ``event``; ``keep`` (the memory it copies
        to or from) is held until then. ``event`` is this step's alone."""
        entry = self._entry(step)
        entry.events.append(event)
        if keep is not None:
            entry.keep.append(keep)

    def add_load(self, event: Event, req_ids: Iterable[str]) -> None:
        """Asynchronous loads whose requests are finished once ``event`` (this list's alone)
        completed."""
        self._finished_loads.append((event, frozenset(req_ids)))

    def finished_loads(self) -> set[str]:
        """Requests whose asynchronous loads completed (each reported once), in issue order."""
        out: set[str] = set()
        while self._finished_loads and self._finished_loads[0][0].query():
            event, reqs = self._finished_loads.popleft()
            out |= reqs
            self.recycle(event)
        return out

    def loading(self) -> set[str]:
        """Requests with an asynchronous load still in flight."""
        return {r for _, ids in self._finished_loads for r in ids}

    def done_through(self) -> int:
        """The newest step such that it and every step before it completed every copy."""
        while self._steps and all(e.query() for e in self._steps[0].events):
            for e in self._steps.popleft().events:  # and its memory is let go
                self.recycle(e)
        if self._steps:
            return self._steps[0].step - 1
        return self._last_step

    def drain(self) -> None:
        """Wait on the host for every copy (shutdown; a step with nothing scheduled)."""
        for st in self._steps:
            for e in st.events:
                e.synchronize()
        for e, _ in self._finished_loads:
            e.synchronize()
