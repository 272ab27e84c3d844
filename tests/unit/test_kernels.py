"""The native copy kernels: exact on odd pieces, chosen by measuring them, forced by name;
and the copy path does not import without them."""

import pytest
import torch

from pegaflow.client import kernels, populate
from pegaflow.client.pages import load_pages, page_bytes, save_pages
from tests.unit.test_pages import cpu_layout

KERNELS = [(0, 1), (1, 1), (0, 2), (1, 2)]  # (pagecopy.c kernel, threads)


@pytest.mark.parametrize(("kernel", "threads"), KERNELS)
@pytest.mark.parametrize("to_pool", [1, 0])
@pytest.mark.parametrize("repeat", [1, 60])
def test_native_copy_of_odd_lengths_and_misaligned_addresses_is_exact(to_pool, kernel, threads, repeat):
    """The non-temporal paths align the destination, split large pieces into four streams
    and finish with a tail: every byte lands, none outside its range is touched. ``repeat``
    60: 420 pieces, ~38 MiB, so two threads share many slices (and the slice table is
    allocated, not on the stack)."""
    import numpy as np

    rng = np.random.default_rng(7)
    lengths = [4095, 4096, 4097, 5000, 65536 + 37, 262144, 300001] * repeat
    shifts = [0, 1, 17, 33, 63]
    room = sum(lengths) + 256 * len(lengths)
    pool = np.full(room, 0xEE, dtype=np.uint8)
    other = rng.integers(0, 256, room, dtype=np.uint8)
    offs, addrs, lens = [], [], []
    pos_pool, pos_other = 0, 0
    for i, n in enumerate(lengths):
        pool_off = pos_pool + shifts[i % len(shifts)]
        other_off = pos_other + shifts[(i + 2) % len(shifts)]
        offs.append(pool_off)
        addrs.append(other.ctypes.data + other_off)
        lens.append(n)
        pos_pool = pool_off + n + 128
        pos_other = other_off + n + 128
    if not to_pool:
        pool[:] = rng.integers(0, 256, pool.size, dtype=np.uint8)
    before_pool, before_other = pool.copy(), other.copy()
    offs_a, addrs_a, lens_a = (np.array(offs, dtype=np.int64), np.array(addrs, dtype=np.uint64),
                               np.array(lens, dtype=np.int64))  # alive across the call
    kernels.copy_segments(
        pool.ctypes.data, offs_a.ctypes.data, addrs_a.ctypes.data, lens_a.ctypes.data, len(lens), to_pool, kernel, threads)
    dst, dst_before, src = (pool, before_pool, before_other) if to_pool else (other, before_other, before_pool)
    expect = dst_before.copy()
    for off, addr, n in zip(offs, addrs, lens, strict=True):
        o = addr - other.ctypes.data
        if to_pool:
            expect[off:off + n] = src[o:o + n]
        else:
            expect[o:o + n] = src[off:off + n]
    assert np.array_equal(dst, expect)


@pytest.fixture
def fresh_choice(monkeypatch):
    """A process that has not chosen a kernel yet, with its own metrics registry."""
    from prometheus_client import CollectorRegistry

    monkeypatch.delenv(kernels.ENV_KERNEL, raising=False)
    kernels.reset_kernel_choice()
    reg = CollectorRegistry()
    monkeypatch.setattr(kernels, "_metrics", kernels.CopyMetrics(reg))
    yield reg
    kernels.reset_kernel_choice()


@pytest.mark.parametrize("name", [k.name for k in kernels.kernels()])
def test_every_kernel_round_trips_a_request(name, fresh_choice, monkeypatch):
    monkeypatch.setenv(kernels.ENV_KERNEL, name)
    src = cpu_layout(blocks=64, layers=4)
    pb = page_bytes(src)
    pool = torch.zeros(pb * 64, dtype=torch.uint8)
    ids = list(range(63, -1, -1))
    save_pages(src, ids, pool, [i * pb for i in range(64)])
    dst = [torch.zeros_like(s) for s in src]
    load_pages(dst, ids, pool, [i * pb for i in range(64)])
    assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
    assert kernels.copy_kernels() == {"save": name, "load": name}
    assert fresh_choice.get_sample_value("pegaflow_client_copy_kernel", {"direction": "save", "kernel": name}) == 1


def test_the_first_large_copies_measure_every_candidate_and_keep_one(fresh_choice):
    ks = kernels.candidates()
    assert ks, "the native module offers no kernel"
    # blocks of 256 KiB (4 layers x 64 KiB): one request of 8 blocks is 2 MiB >= CALIBRATE_MIN_BYTES
    buf = torch.randn(4, 16, 2, 128, 128).to(torch.float16)
    src = [buf[i] for i in range(4)]
    pb = page_bytes(src)
    n = max(1, kernels.CALIBRATE_MIN_BYTES // pb)
    pool = torch.zeros(pb * n, dtype=torch.uint8)
    copies = 0
    while kernels.copy_kernels().get("save") is None:
        assert copies < kernels.CALIBRATE_WARMUP + kernels.CALIBRATE_SAMPLES * len(ks), \
            "no kernel chosen after the warm-up and every candidate's samples"
        save_pages(src, list(range(n)), pool, [i * pb for i in range(n)])
        copies += 1
    # the warm-up, then every candidate's samples; one candidate: no measuring
    assert copies == kernels.CALIBRATE_WARMUP + kernels.CALIBRATE_SAMPLES * len(ks) if len(ks) > 1 else copies == 1
    chosen = kernels.copy_kernels()["save"]
    assert chosen in {k.name for k in ks}
    for k in ks:  # every candidate was measured and exported; exactly one is marked chosen
        gbps = fresh_choice.get_sample_value("pegaflow_client_copy_calibration_gbps",
                                             {"direction": "save", "kernel": k.name})
        assert (gbps is not None and gbps > 0) if len(ks) > 1 else gbps is None
        assert fresh_choice.get_sample_value("pegaflow_client_copy_kernel",
                                             {"direction": "save", "kernel": k.name}) == (k.name == chosen)
    assert kernels.copy_kernels().get("load") is None  # each direction chooses on its own copies


def test_choice_keeps_the_best_median_and_ignores_small_copies():
    from prometheus_client import CollectorRegistry

    a, b = kernels.Kernel("a", 0, 1), kernels.Kernel("b", 1, 1)
    c = kernels.KernelChoice("save", [a, b], kernels.CopyMetrics(CollectorRegistry()))
    assert c.pick(kernels.CALIBRATE_MIN_BYTES - 1) == (a, False)  # not timed, nothing rotates
    # the first large copy is a warm-up: the likeliest kernel, not timed
    assert [c.pick(kernels.CALIBRATE_MIN_BYTES) for _ in range(kernels.CALIBRATE_WARMUP)] == [(b, False)] * kernels.CALIBRATE_WARMUP
    order = [c.pick(kernels.CALIBRATE_MIN_BYTES) for _ in range(4)]
    assert order == [(b, True), (a, True), (b, True), (a, True)]  # likeliest first: non-temporal (code 1) first
    # a: 1.5, 1, 9 GB/s (one lucky copy); b: 2, 2, 2 -> b has the better median
    for k, gbps in ((a, 1.5), (b, 2), (a, 1), (b, 2), (a, 9)):
        c.report(k, 10**9, 1 / gbps)
    assert c.chosen is None
    c.report(b, 10**9, 1 / 2)
    assert c.chosen == b
    assert c.pick(10**9) == (b, True)  # still measured: a later copy may move the choice
    assert c.pick(kernels.CALIBRATE_MIN_BYTES - 1) == (b, False)


def _chosen(ks, first_gbps, reg=None):  # type: ignore[no-untyped-def]
    """A KernelChoice that has chosen, every candidate measured at ``first_gbps[k]``."""
    from prometheus_client import CollectorRegistry

    c = kernels.KernelChoice("save", ks, kernels.CopyMetrics(reg or CollectorRegistry()))
    for _ in range(kernels.CALIBRATE_WARMUP):
        c.pick(kernels.CALIBRATE_MIN_BYTES)
    while c.chosen is None:
        k, timed = c.pick(kernels.CALIBRATE_MIN_BYTES)
        assert timed
        c.report(k, 10**9, 1 / first_gbps[k])
    return c


def test_after_the_choice_one_copy_in_explore_every_tries_each_other_candidate_in_turn():
    a, b, c2 = kernels.Kernel("nt-2t", 1, 2), kernels.Kernel("nt", 1, 1), kernels.Kernel("memcpy-2t", 0, 2)
    c = _chosen([a, b, c2], {a: 10.0, b: 8.0, c2: 7.0})
    assert c.chosen == a
    picks = [c.pick(kernels.CALIBRATE_MIN_BYTES)[0] for _ in range(4 * kernels.EXPLORE_EVERY)]
    others = [k for k in picks if k != a]
    assert len(others) == 4 and set(others) == {b, c2}  # one in EXPLORE_EVERY, alternating
    assert all(k == a for i, k in enumerate(picks) if (i + 1) % kernels.EXPLORE_EVERY)


def test_the_choice_moves_when_another_kernel_measures_faster_on_later_copies():
    """Chosen on cold first copies (all alike), the one-thread kernel is left once the
    two-thread one, tried now and then, keeps beating it by more than SWITCH_ABOVE."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    one, two = kernels.Kernel("nt", 1, 1), kernels.Kernel("nt-2t", 1, 2)
    c = _chosen([one, two], {one: 14.3, two: 13.7}, reg)
    assert c.chosen == one
    speed = {one: 13.3, two: 19.0}
    for _ in range(kernels.CALIBRATE_SAMPLES * kernels.EXPLORE_EVERY + 1):
        k, timed = c.pick(kernels.CALIBRATE_MIN_BYTES)
        assert timed
        c.report(k, 10**9, 1 / speed[k])
        if c.chosen == two:
            break
    assert c.chosen == two
    assert reg.get_sample_value("pegaflow_client_copy_kernel_switches_total", {"direction": "save"}) == 1
    assert reg.get_sample_value("pegaflow_client_copy_kernel", {"direction": "save", "kernel": "nt-2t"}) == 1
    assert reg.get_sample_value("pegaflow_client_copy_kernel", {"direction": "save", "kernel": "nt"}) == 0


def test_the_choice_stays_when_the_others_are_not_clearly_faster():
    one, two = kernels.Kernel("nt", 1, 1), kernels.Kernel("nt-2t", 1, 2)
    c = _chosen([one, two], {one: 14.0, two: 13.0})
    speed = {one: 14.0, two: 14.0 * kernels.SWITCH_ABOVE * 0.99}  # faster, but within the margin
    for _ in range(10 * kernels.EXPLORE_EVERY):
        k, _ = c.pick(kernels.CALIBRATE_MIN_BYTES)
        c.report(k, 10**9, 1 / speed[k])
    assert c.chosen == one


def test_a_forced_kernel_is_never_explored_away(monkeypatch):
    from prometheus_client import CollectorRegistry

    one, two = kernels.Kernel("nt", 1, 1), kernels.Kernel("nt-2t", 1, 2)
    c = kernels.KernelChoice("save", [one, two], kernels.CopyMetrics(CollectorRegistry()), forced=one)
    assert [c.pick(kernels.CALIBRATE_MIN_BYTES) for _ in range(3 * kernels.EXPLORE_EVERY)] == \
        [(one, False)] * (3 * kernels.EXPLORE_EVERY)


def test_one_thread_memcpy_is_measured_only_without_a_non_temporal_kernel():
    every, measured = kernels.kernels(), kernels.candidates()
    assert every[0].name == "memcpy" and every[0].threads == 1
    if any(k.code == 1 for k in every):  # non-temporal stores
        assert set(measured) == set(every) - {every[0]}
    else:
        assert measured == every
    from prometheus_client import CollectorRegistry

    two = measured if len(measured) > 1 else every  # a process on one CPU measures nothing: use all
    c = kernels.KernelChoice("save", two, kernels.CopyMetrics(CollectorRegistry()), default=every[0])
    assert c.pick(kernels.CALIBRATE_MIN_BYTES - 1) == (every[0], False)  # small copies before a choice: glibc
    only = kernels.KernelChoice("load", measured[:1], kernels.CopyMetrics(CollectorRegistry()), default=every[0])
    assert only.chosen == measured[0]  # one candidate (a process on one CPU): nothing to measure
    assert only.pick(kernels.CALIBRATE_MIN_BYTES) == (measured[0], False)


def test_a_candidate_slow_on_its_first_copy_keeps_its_turns_and_can_win():
    """One copy says nothing on these hosts (a copy's speed moves 2x from second to second):
    the fastest kernel measured slow once, while the host was in a slow phase, is still
    measured to the end and chosen on its median."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    fast, slow, close = kernels.Kernel("nt-2t", 1, 2), kernels.Kernel("memcpy", 0, 1), kernels.Kernel("nt", 1, 1)
    c = kernels.KernelChoice("load", [slow, close, fast], kernels.CopyMetrics(reg))
    for _ in range(kernels.CALIBRATE_WARMUP):
        c.pick(kernels.CALIBRATE_MIN_BYTES)
    picks = [c.pick(kernels.CALIBRATE_MIN_BYTES)[0] for _ in range(3 * kernels.CALIBRATE_SAMPLES)]
    assert picks[:3] == [fast, close, slow] and set(picks) == {fast, close, slow}
    assert all(picks.count(k) == kernels.CALIBRATE_SAMPLES for k in (fast, close, slow))
    speeds = {fast: [2.0, 20.0, 21.0], close: [16.0, 17.0, 16.5], slow: [12.0, 12.5, 13.0]}
    for k in picks:
        c.report(k, 10**9, 1 / speeds[k].pop(0))
    assert c.chosen == fast  # median 20 against 16.5 and 12.5, despite its first copy at 2
    assert reg.get_sample_value("pegaflow_client_copy_calibration_gbps",
                                {"direction": "load", "kernel": "memcpy"}) == pytest.approx(12.5)


def test_an_unknown_forced_kernel_is_a_one_line_error(fresh_choice, monkeypatch):
    monkeypatch.setenv(kernels.ENV_KERNEL, "warp-drive")
    src = cpu_layout()
    pool = torch.zeros(page_bytes(src), dtype=torch.uint8)
    with pytest.raises(ValueError, match="PEGAFLOW_COPY_KERNEL='warp-drive': this host can run memcpy"):
        save_pages(src, [0], pool, [0])


def test_no_kernel_is_chosen_while_the_pool_mapping_is_being_populated(fresh_choice, monkeypatch):
    """The background populate thread takes the core a two-thread kernel needs: copies made
    meanwhile are not measured (a choice made then would hold for the process's life)."""
    two = kernels.kernels()[:2]
    assert len(two) == 2, "this build has no non-temporal kernel"
    monkeypatch.setattr(kernels, "candidates", lambda: two)  # something to measure, on any CPU count
    buf = torch.randn(4, 16, 2, 128, 128).to(torch.float16)
    src = [buf[i] for i in range(4)]
    pb = page_bytes(src)
    n = max(1, kernels.CALIBRATE_MIN_BYTES // pb)
    pool = torch.zeros(pb * n, dtype=torch.uint8)
    rounds = kernels.CALIBRATE_WARMUP + kernels.CALIBRATE_SAMPLES * len(kernels.candidates())
    busy = populate.Populated(0, 1)
    busy.busy = True
    populate.lazy_pools[-1] = busy  # a mapping whose background populate is at work
    try:
        for _ in range(rounds):
            save_pages(src, list(range(n)), pool, [i * pb for i in range(n)])
        assert kernels.copy_kernels().get("save") is None
    finally:
        del populate.lazy_pools[-1]
    for _ in range(rounds):
        save_pages(src, list(range(n)), pool, [i * pb for i in range(n)])
    assert kernels.copy_kernels()["save"] is not None



# Runs a process whose import system finds the copier as FAULT says, then imports the copy path.
_BROKEN_INSTALL = """
import importlib.machinery, importlib.util, sys
fault, real = sys.argv[1], importlib.util.find_spec
spec = None if fault == "missing" else importlib.machinery.ModuleSpec("x", None, origin=fault)
importlib.util.find_spec = lambda name, *a: spec if name == "pegaflow.client._pagecopy" else real(name, *a)
import pegaflow.client.pages
"""


@pytest.mark.parametrize("fault", ["missing", "not-a-library", "stale"])
def test_without_the_native_library_the_copy_path_does_not_import(fault, tmp_path):
    """No silent slow path: the import fails with one line that says how to fix it. Faults:
    nothing built, a file the loader refuses, a library without the copier's symbols."""
    import ctypes.util
    import subprocess
    import sys

    arg = fault
    if fault == "not-a-library":
        (tmp_path / "_pagecopy.so").write_bytes(b"half-written")
        arg = str(tmp_path / "_pagecopy.so")
    elif fault == "stale":
        arg = ctypes.util.find_library("c")
    p = subprocess.run([sys.executable, "-c", _BROKEN_INSTALL, arg], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: pegaflow.client._pagecopy"), p.stderr
    assert last.endswith("reinstall: pip install --no-deps --no-build-isolation -e ."), last
