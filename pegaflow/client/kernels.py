"""Which native kernel copies pages, chosen by measuring them in this process.

The kernels are those of ``pegaflow.client._pagecopy`` (``pegaflow/native/pagecopy.c``,
built by every install), loaded here through ctypes so that a copy releases the GIL. There
is no other copy path: without the library this module does not import (an ``ImportError``
that says to reinstall).

Which kernel copies is measured, not assumed: glibc memcpy, non-temporal stores,
and each of them on two threads win or lose by host (on two machines of the same kind the
winner differed). The first copies of at least ``CALIBRATE_MIN_BYTES`` in each direction
rotate through the candidates, the likeliest winners first (every candidate copies the
same bytes correctly, so this costs nothing but the slower ones' time); once each has
``CALIBRATE_SAMPLES`` copies, the one with the best median GB/s is kept for the life of
the process. The first of those copies is not a sample (``CALIBRATE_WARMUP``): it pays
what only a process's first large copy pays (measured: 8.7 GB/s for a kernel that then
ran at 20), and one such sample once dropped the best candidate. Every candidate keeps
its turns until the end for the same reason: on these hosts a copy's speed moves by 2x
from one second to the next, so no single copy says a kernel loses. Real copies are the
samples because repeating one copy to measure would not do: its second pass reads from
cache (measured: a one-thread kernel beat the two-thread one that way, and then ran the
real loads at half the speed). The choice is logged (``copy_kernel_chosen``) and exported
as ``pegaflow_client_copy_kernel`` / ``pegaflow_client_copy_calibration_gbps``;
``PEGAFLOW_COPY_KERNEL`` forces one.

A choice is not for the life of the process either. The first copies are often the
least representative: an engine's first saves write pool pages nobody touched for a while,
which on VMs of this kind are slow to touch whatever the kernel (measured: all three
candidates at 13.7-14.3 GB/s on those copies, then 13.3 GB/s for the one-thread kernel
chosen against 18-20 for the two-thread one once the pool was warm). So after the choice
every ``EXPLORE_EVERY``-th large copy uses another candidate, in turn, and the choice
moves to one whose median over its last ``CALIBRATE_SAMPLES`` copies beats the chosen
kernel's last ones by ``SWITCH_ABOVE`` (logged again; ``pegaflow_client_copy_kernel_switches_total``).
That costs at most 1 in ``EXPLORE_EVERY`` copies at a slower kernel's speed.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field

import structlog
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from pegaflow.client.populate import populating

log = structlog.get_logger("pegaflow.pages")

_LIBRARY = "pegaflow.client._pagecopy"
_REINSTALL = "pip install --no-deps --no-build-isolation -e ."


def _load() -> ctypes.CDLL:
    """The native library with its signatures set; ``ImportError`` (one line: reinstall)
    where the install did not build it or built a stale one."""
    spec = importlib.util.find_spec(_LIBRARY)
    if spec is None or not spec.origin:
        raise ImportError(f"{_LIBRARY} (the native page copier) is not installed; reinstall: {_REINSTALL}")
    try:
        lib = ctypes.CDLL(spec.origin)
        lib.pf_copy_segments.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ]
        lib.pf_copy_segments.restype = ctypes.c_int
        lib.pf_kernels.restype = ctypes.c_int
        lib.pf_nt_variant.restype = ctypes.c_int
    except (OSError, AttributeError) as exc:  # not loadable, or a stale build without a symbol
        raise ImportError(f"{_LIBRARY} (the native page copier) cannot be loaded ({exc}); "
                          f"reinstall: {_REINSTALL}") from exc
    return lib


_native = _load()
copy_segments = _native.pf_copy_segments
"""``copy_segments(pool, pool_offs, addrs, lens, n, to_pool, kernel, threads)``: copy ``n``
pieces between ``pool + pool_offs[i]`` and ``addrs[i]`` (``lens[i]`` bytes each; int64,
uint64, int64 arrays), into the pool when ``to_pool``, with ``kernel`` (``Kernel.code``) on
``threads`` threads, GIL released. The caller has bounds-checked every piece."""

CALIBRATE_MIN_BYTES = 1 << 20  # smaller copies say more about call overhead than bandwidth
CALIBRATE_SAMPLES = 3  # per candidate; the median of three survives one disturbed copy
CALIBRATE_WARMUP = 1  # first large copies per direction that are not samples (one-time costs)
EXPLORE_EVERY = 16  # after a choice, one large copy in this many tries another candidate
SWITCH_ABOVE = 1.05  # the choice moves to a candidate whose recent median beats it by this
ENV_KERNEL = "PEGAFLOW_COPY_KERNEL"

_KERNEL_MEMCPY, _KERNEL_NT = 0, 1  # pagecopy.c's PF_KERNEL_*


class CopyMetrics:
    """The engine process's copy series (on vLLM's registry: the default one)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.kernel = Gauge("pegaflow_client_copy_kernel",
                            "1 for the native copy kernel this process chose per direction "
                            "(save: KV cache -> pool), 0 for the others it measured",
                            ["direction", "kernel"], registry=registry)
        self.calibration_gbps = Gauge("pegaflow_client_copy_calibration_gbps",
                                      "Median GB/s of each copy kernel's last measured copies in this process",
                                      ["direction", "kernel"], registry=registry)
        self.switches = Counter("pegaflow_client_copy_kernel_switches",
                                "Times this process moved its choice of copy kernel after measuring another "
                                "one faster on later copies", ["direction"], registry=registry)


@dataclass(frozen=True)
class Kernel:
    """One way the native module can copy: ``code`` is pagecopy.c's kernel number."""

    name: str
    code: int
    threads: int


def kernels() -> list[Kernel]:
    """Every kernel this build and host can run (two-thread ones only with a second CPU);
    the first, glibc memcpy on one thread, copies what is too small to measure."""
    have = _native.pf_kernels()
    nt_name = {2: "nt-avx2", 1: "nt-sse2"}.get(_native.pf_nt_variant(), "nt")
    one = [Kernel("memcpy", _KERNEL_MEMCPY, 1)]
    if have & (1 << _KERNEL_NT):
        one.append(Kernel(nt_name, _KERNEL_NT, 1))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    two = [Kernel(k.name + "-2t", k.code, 2) for k in one] if cpus >= 2 else []
    return one + two


def candidates() -> list[Kernel]:
    """The kernels a process measures. One-thread memcpy is left out where a non-temporal
    kernel exists: it lost to the one-thread non-temporal kernel on every host measured
    (host B: 5.2-6.3 against 6.8-7.9 GB/s, D: 3.6-6.7 against 5.8-11.7; in a vLLM worker
    pinned to one CPU, 3.7 against 6.5; docs/benchmarks.md, "node"), and measuring it cost a short-lived engine one of its first large copies at half
    speed. It is still there to force (``PEGAFLOW_COPY_KERNEL=memcpy``) and copies what is
    too small to measure. With one candidate left, nothing is measured."""
    ks = kernels()
    if any(k.code == _KERNEL_NT for k in ks):
        return [k for k in ks if not (k.code == _KERNEL_MEMCPY and k.threads == 1)]
    return ks


def _likeliest_first(k: Kernel) -> tuple[bool, bool]:
    """Rotation order: non-temporal before memcpy, two threads before one (what won on the
    hosts measured so far, docs/benchmarks.md), so the first copies use the likely winners."""
    return (k.code != _KERNEL_NT, k.threads == 1)


@dataclass
class KernelChoice:
    """Measures the candidates (``kernels``) on one direction's first large copies (after
    ``CALIBRATE_WARMUP``), chooses the fastest, then times every large copy and tries the
    others on one in ``EXPLORE_EVERY``, moving the choice when one is faster by
    ``SWITCH_ABOVE`` (the module's docstring says why). Copies too small to measure, and
    copies made before a choice that are not measured, use ``default`` (the first of
    ``kernels`` if not given). Thread-safe: several requests may copy at once."""

    direction: str
    kernels: list[Kernel]
    metrics: CopyMetrics
    forced: Kernel | None = None
    default: Kernel | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)
    chosen: Kernel | None = None
    _live: list[Kernel] = field(default_factory=list)  # measured, in rotation order
    _warmup: int = CALIBRATE_WARMUP
    _next: int = 0
    _recent: dict[str, deque[float]] = field(default_factory=dict)  # after the choice: last GB/s per kernel
    _large: int = 0  # large copies since the choice
    _explored: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.default is None:
            self.default = self.kernels[0]
        self._live = sorted(self.kernels, key=_likeliest_first)
        if self.forced is not None:
            self._choose(self.forced, forced=True)
        elif len(self.kernels) == 1:
            self._choose(self.kernels[0], forced=False)

    def pick(self, nbytes: int) -> tuple[Kernel, bool]:
        """The kernel for a copy of ``nbytes`` and whether its time should be reported."""
        chosen = self.chosen
        if chosen is not None:
            if self.forced is not None or len(self._live) < 2 or nbytes < CALIBRATE_MIN_BYTES or populating():
                return chosen, False
            with self._lock:
                self._large += 1
                if self._large % EXPLORE_EVERY:
                    return chosen, True
                others = [k for k in self._live if k != chosen]
                self._explored += 1
                return others[self._explored % len(others)], True
        if nbytes < CALIBRATE_MIN_BYTES or populating():
            # Not while this process populates its pool mapping in the background: that
            # thread takes the second core the two-thread kernels need, and a choice made
            # then (measured: 6.5 vs 15 GB/s for them) would hold for the process's life.
            assert self.default is not None
            return self.default, False
        with self._lock:
            if self._warmup > 0:  # a warm-up copy: the likeliest kernel, not a sample
                self._warmup -= 1
                return self._live[0], False
            k = self._live[self._next % len(self._live)]
            self._next += 1
        return k, True

    def report(self, kernel: Kernel, nbytes: int, seconds: float) -> None:
        gbps = nbytes / max(seconds, 1e-9) / 1e9
        with self._lock:
            if kernel not in self._live:
                return
            if self.chosen is not None:
                self._after_choice(kernel, gbps)
                return
            self.samples.setdefault(kernel.name, []).append(gbps)
            if min(len(self.samples.get(k.name, ())) for k in self._live) < CALIBRATE_SAMPLES:
                return
            medians = {name: statistics.median(xs) for name, xs in self.samples.items()}
            for name, gbps in medians.items():
                self.metrics.calibration_gbps.labels(self.direction, name).set(gbps)
            best_kernel = max(self._live, key=lambda k: medians[k.name])
            self._choose(best_kernel, forced=False, gbps={n: round(g, 2) for n, g in medians.items()})

    def _after_choice(self, kernel: Kernel, gbps: float) -> None:
        """A copy measured after the choice (under the lock): switch if another kernel's
        recent median beats the chosen one's by ``SWITCH_ABOVE``."""
        recent = self._recent.setdefault(kernel.name, deque(maxlen=CALIBRATE_SAMPLES))
        recent.append(gbps)
        chosen = self.chosen
        assert chosen is not None
        mine = self._recent.get(chosen.name, ())
        if kernel == chosen or len(recent) < CALIBRATE_SAMPLES or len(mine) < CALIBRATE_SAMPLES:
            return
        theirs, ours = statistics.median(recent), statistics.median(mine)
        self.metrics.calibration_gbps.labels(self.direction, kernel.name).set(theirs)
        self.metrics.calibration_gbps.labels(self.direction, chosen.name).set(ours)
        if theirs > SWITCH_ABOVE * ours:
            self.metrics.switches.labels(self.direction).inc()
            log.info("copy_kernel_switched", direction=self.direction, previous=chosen.name,
                     previous_gbps=round(ours, 2), kernel=kernel.name, gbps=round(theirs, 2))
            self._choose(kernel, forced=False, gbps={chosen.name: round(ours, 2), kernel.name: round(theirs, 2)})

    def _choose(self, kernel: Kernel, forced: bool, gbps: dict[str, float] | None = None) -> None:
        self.chosen = kernel
        for k in {*self.kernels, kernel}:
            self.metrics.kernel.labels(self.direction, k.name).set(1 if k == kernel else 0)
        log.info("copy_kernel_chosen", direction=self.direction, kernel=kernel.name, forced=forced,
                 measured_gbps=gbps)


def _forced(kernels: list[Kernel]) -> Kernel | None:
    name = os.environ.get(ENV_KERNEL, "").strip()
    if not name:
        return None
    for k in kernels:
        if k.name == name or (name == "nt" and k.code == _KERNEL_NT and k.threads == 1):
            return k
    raise ValueError(f"{ENV_KERNEL}={name!r}: this host can run {', '.join(k.name for k in kernels)}")


_choices: dict[bool, KernelChoice] = {}
_choices_lock = threading.Lock()
_metrics: CopyMetrics | None = None


def kernel_choice(to_pool: bool) -> KernelChoice:
    """The process's choice for one direction (``to_pool``: save), made on first use."""
    global _metrics
    c = _choices.get(to_pool)
    if c is None:
        with _choices_lock:
            c = _choices.get(to_pool)
            if c is None:
                if _metrics is None:
                    _metrics = CopyMetrics()
                every = kernels()
                c = _choices[to_pool] = KernelChoice("save" if to_pool else "load", candidates(), _metrics,
                                                     _forced(every), every[0])
    return c


def copy_kernels() -> dict[str, str | None]:
    """The kernel chosen per direction so far (None while still calibrating or never used)."""
    return {("save" if d else "load"): (c.chosen.name if c.chosen else None) for d, c in _choices.items()}


def reset_kernel_choice() -> None:
    """Forget the choices (tests; a process that moved to other memory)."""
    with _choices_lock:
        _choices.clear()
