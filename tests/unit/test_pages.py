"""Batched page copies: native path and torch fallback, CPU and CUDA-shaped layouts."""

import pytest
import torch

from pegaflow.client import pages
from pegaflow.client.pages import load_pages, page_bytes, save_pages


def cpu_layout(blocks=16, layers=3):
    buf = torch.randn(layers, blocks, 2, 16, 64).to(torch.float16)
    return [buf[i] for i in range(layers)]


def cuda_shaped_layout(blocks=16, layers=3):
    # vLLM FlashAttention: per layer (2, num_blocks, block_size, kv_heads, head_dim); K and V segments.
    kv = [torch.randn(2, blocks, 16, 2, 64).to(torch.float16) for _ in range(layers)]
    return [t[i] for t in kv for i in range(2)]


@pytest.mark.parametrize("make", [cpu_layout, cuda_shaped_layout])
@pytest.mark.parametrize("native", [True, False])
def test_round_trip_through_pool_pages(make, native, monkeypatch):
    if not native:
        monkeypatch.setattr(pages, "_native", None)
    elif pages._native is None:
        pytest.fail("native page copier was not built by the install")
    src = make()
    pb = page_bytes(src)
    pool = torch.zeros(pb * 40 + 4096 * 40, dtype=torch.uint8)
    offsets = [i * (pb + 4096) + 64 for i in (7, 2, 30, 11)]
    save_pages(src, [3, 0, 15, 9], pool, offsets)
    # page layout: concatenation of the segments of one block
    first = torch.cat([s[3].reshape(-1).view(torch.uint8) for s in src])
    assert torch.equal(pool[offsets[0]:offsets[0] + pb], first)
    dst = [torch.zeros_like(s) for s in src]
    load_pages(dst, [1, 2, 4, 5], pool, offsets)
    for s, d in zip(src, dst, strict=True):
        for a, b in zip([3, 0, 15, 9], [1, 2, 4, 5], strict=True):
            assert torch.equal(s[a], d[b])
        assert not d[0].any()


def test_out_of_range_offsets_and_blocks_are_refused():
    src = cpu_layout()
    pool = torch.zeros(page_bytes(src) * 2, dtype=torch.uint8)
    with pytest.raises(IndexError):
        save_pages(src, [0], pool, [page_bytes(src) * 2 - 10])
    with pytest.raises(IndexError):
        save_pages(src, [99], pool, [0])
    with pytest.raises(ValueError):
        save_pages(src, [0, 1], pool, [0])


KERNELS = [(0, 1), (1, 1), (0, 2), (1, 2)]  # (pagecopy.c kernel, threads)


@pytest.mark.parametrize(("kernel", "threads"), KERNELS)
@pytest.mark.parametrize("to_pool", [1, 0])
@pytest.mark.parametrize("repeat", [1, 60])
def test_native_copy_of_odd_lengths_and_misaligned_addresses_is_exact(to_pool, kernel, threads, repeat):
    """The non-temporal paths align the destination, split large pieces into four streams
    and finish with a tail: every byte lands, none outside its range is touched. ``repeat``
    60: 420 pieces, ~38 MiB, so two threads share many slices (and the slice table is
    allocated, not on the stack)."""
    if pages._native is None:
        pytest.fail("native page copier was not built by the install")
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
    pages._native.pf_copy_segments(
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


@pytest.mark.parametrize("offset", [2**63 - 1, 2**63 - 4096, 2**64 - 1, 2**63, -(2**63)])
@pytest.mark.parametrize("copy", [save_pages, load_pages])
def test_offsets_near_the_int64_limit_are_refused_not_copied(offset, copy):
    # offset + page_bytes overflowed the bounds check and the native copy wrote out of bounds.
    src = cpu_layout()
    pool = torch.zeros(page_bytes(src) * 4, dtype=torch.uint8)
    with pytest.raises(IndexError):
        copy(src, [0], pool, [offset])
    assert int(pool.sum()) == 0


@pytest.fixture
def fresh_choice(monkeypatch):
    """A process that has not chosen a kernel yet, with its own metrics registry."""
    from prometheus_client import CollectorRegistry

    monkeypatch.delenv(pages.ENV_KERNEL, raising=False)
    pages.reset_kernel_choice()
    reg = CollectorRegistry()
    monkeypatch.setattr(pages, "_metrics", pages.CopyMetrics(reg))
    yield reg
    pages.reset_kernel_choice()


@pytest.mark.parametrize("name", [k.name for k in pages.kernels()])
def test_every_kernel_round_trips_a_request(name, fresh_choice, monkeypatch):
    monkeypatch.setenv(pages.ENV_KERNEL, name)
    src = cpu_layout(blocks=64, layers=4)
    pb = page_bytes(src)
    pool = torch.zeros(pb * 64, dtype=torch.uint8)
    ids = list(range(63, -1, -1))
    save_pages(src, ids, pool, [i * pb for i in range(64)])
    dst = [torch.zeros_like(s) for s in src]
    load_pages(dst, ids, pool, [i * pb for i in range(64)])
    assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
    assert pages.copy_kernels() == {"save": name, "load": name}
    assert fresh_choice.get_sample_value("pegaflow_client_copy_kernel", {"direction": "save", "kernel": name}) == 1


def test_the_first_large_copies_measure_every_candidate_and_keep_one(fresh_choice):
    ks = pages.candidates()
    assert ks, "the native module offers no kernel"
    # blocks of 256 KiB (4 layers x 64 KiB): one request of 8 blocks is 2 MiB >= CALIBRATE_MIN_BYTES
    buf = torch.randn(4, 16, 2, 128, 128).to(torch.float16)
    src = [buf[i] for i in range(4)]
    pb = page_bytes(src)
    n = max(1, pages.CALIBRATE_MIN_BYTES // pb)
    pool = torch.zeros(pb * n, dtype=torch.uint8)
    copies = 0
    while pages.copy_kernels().get("save") is None:
        assert copies < pages.CALIBRATE_WARMUP + pages.CALIBRATE_SAMPLES * len(ks), \
            "no kernel chosen after the warm-up and every candidate's samples"
        save_pages(src, list(range(n)), pool, [i * pb for i in range(n)])
        copies += 1
    # the warm-up, then every candidate's samples; one candidate: no measuring
    assert copies == pages.CALIBRATE_WARMUP + pages.CALIBRATE_SAMPLES * len(ks) if len(ks) > 1 else copies == 1
    chosen = pages.copy_kernels()["save"]
    assert chosen in {k.name for k in ks}
    for k in ks:  # every candidate was measured and exported; exactly one is marked chosen
        gbps = fresh_choice.get_sample_value("pegaflow_client_copy_calibration_gbps",
                                             {"direction": "save", "kernel": k.name})
        assert (gbps is not None and gbps > 0) if len(ks) > 1 else gbps is None
        assert fresh_choice.get_sample_value("pegaflow_client_copy_kernel",
                                             {"direction": "save", "kernel": k.name}) == (k.name == chosen)
    assert pages.copy_kernels().get("load") is None  # each direction chooses on its own copies


def test_choice_keeps_the_best_median_and_ignores_small_copies():
    from prometheus_client import CollectorRegistry

    a, b = pages.Kernel("a", 0, 1), pages.Kernel("b", 1, 1)
    c = pages.KernelChoice("save", [a, b], pages.CopyMetrics(CollectorRegistry()))
    assert c.pick(pages.CALIBRATE_MIN_BYTES - 1) == (a, False)  # not timed, nothing rotates
    # the first large copy is a warm-up: the likeliest kernel, not timed
    assert [c.pick(pages.CALIBRATE_MIN_BYTES) for _ in range(pages.CALIBRATE_WARMUP)] == [(b, False)] * pages.CALIBRATE_WARMUP
    order = [c.pick(pages.CALIBRATE_MIN_BYTES) for _ in range(4)]
    assert order == [(b, True), (a, True), (b, True), (a, True)]  # likeliest first: non-temporal (code 1) first
    # a: 1.5, 1, 9 GB/s (one lucky copy); b: 2, 2, 2 -> b has the better median
    for k, gbps in ((a, 1.5), (b, 2), (a, 1), (b, 2), (a, 9)):
        c.report(k, 10**9, 1 / gbps)
    assert c.chosen is None
    c.report(b, 10**9, 1 / 2)
    assert c.chosen == b
    assert c.pick(10**9) == (b, True)  # still measured: a later copy may move the choice
    assert c.pick(pages.CALIBRATE_MIN_BYTES - 1) == (b, False)


def _chosen(kernels, first_gbps, reg=None):  # type: ignore[no-untyped-def]
    """A KernelChoice that has chosen, every candidate measured at ``first_gbps[k]``."""
    from prometheus_client import CollectorRegistry

    c = pages.KernelChoice("save", kernels, pages.CopyMetrics(reg or CollectorRegistry()))
    for _ in range(pages.CALIBRATE_WARMUP):
        c.pick(pages.CALIBRATE_MIN_BYTES)
    while c.chosen is None:
        k, timed = c.pick(pages.CALIBRATE_MIN_BYTES)
        assert timed
        c.report(k, 10**9, 1 / first_gbps[k])
    return c


def test_after_the_choice_one_copy_in_explore_every_tries_each_other_candidate_in_turn():
    a, b, c2 = pages.Kernel("nt-2t", 1, 2), pages.Kernel("nt", 1, 1), pages.Kernel("memcpy-2t", 0, 2)
    c = _chosen([a, b, c2], {a: 10.0, b: 8.0, c2: 7.0})
    assert c.chosen == a
    picks = [c.pick(pages.CALIBRATE_MIN_BYTES)[0] for _ in range(4 * pages.EXPLORE_EVERY)]
    others = [k for k in picks if k != a]
    assert len(others) == 4 and set(others) == {b, c2}  # one in EXPLORE_EVERY, alternating
    assert all(k == a for i, k in enumerate(picks) if (i + 1) % pages.EXPLORE_EVERY)


def test_the_choice_moves_when_another_kernel_measures_faster_on_later_copies():
    """Chosen on cold first copies (all alike), the one-thread kernel is left once the
    two-thread one, tried now and then, keeps beating it by more than SWITCH_ABOVE."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    one, two = pages.Kernel("nt", 1, 1), pages.Kernel("nt-2t", 1, 2)
    c = _chosen([one, two], {one: 14.3, two: 13.7}, reg)
    assert c.chosen == one
    speed = {one: 13.3, two: 19.0}
    for _ in range(pages.CALIBRATE_SAMPLES * pages.EXPLORE_EVERY + 1):
        k, timed = c.pick(pages.CALIBRATE_MIN_BYTES)
        assert timed
        c.report(k, 10**9, 1 / speed[k])
        if c.chosen == two:
            break
    assert c.chosen == two
    assert reg.get_sample_value("pegaflow_client_copy_kernel_switches_total", {"direction": "save"}) == 1
    assert reg.get_sample_value("pegaflow_client_copy_kernel", {"direction": "save", "kernel": "nt-2t"}) == 1
    assert reg.get_sample_value("pegaflow_client_copy_kernel", {"direction": "save", "kernel": "nt"}) == 0


def test_the_choice_stays_when_the_others_are_not_clearly_faster():
    one, two = pages.Kernel("nt", 1, 1), pages.Kernel("nt-2t", 1, 2)
    c = _chosen([one, two], {one: 14.0, two: 13.0})
    speed = {one: 14.0, two: 14.0 * pages.SWITCH_ABOVE * 0.99}  # faster, but within the margin
    for _ in range(10 * pages.EXPLORE_EVERY):
        k, _ = c.pick(pages.CALIBRATE_MIN_BYTES)
        c.report(k, 10**9, 1 / speed[k])
    assert c.chosen == one


def test_a_forced_kernel_is_never_explored_away(monkeypatch):
    from prometheus_client import CollectorRegistry

    one, two = pages.Kernel("nt", 1, 1), pages.Kernel("nt-2t", 1, 2)
    c = pages.KernelChoice("save", [one, two], pages.CopyMetrics(CollectorRegistry()), forced=one)
    assert [c.pick(pages.CALIBRATE_MIN_BYTES) for _ in range(3 * pages.EXPLORE_EVERY)] == \
        [(one, False)] * (3 * pages.EXPLORE_EVERY)


def test_one_thread_memcpy_is_measured_only_without_a_non_temporal_kernel():
    every, measured = pages.kernels(), pages.candidates()
    assert every[0].name == "memcpy" and every[0].threads == 1
    if any(k.code == 1 for k in every):  # non-temporal stores
        assert set(measured) == set(every) - {every[0]}
    else:
        assert measured == every
    from prometheus_client import CollectorRegistry

    two = measured if len(measured) > 1 else every  # a process on one CPU measures nothing: use all
    c = pages.KernelChoice("save", two, pages.CopyMetrics(CollectorRegistry()), default=every[0])
    assert c.pick(pages.CALIBRATE_MIN_BYTES - 1) == (every[0], False)  # small copies before a choice: glibc
    only = pages.KernelChoice("load", measured[:1], pages.CopyMetrics(CollectorRegistry()), default=every[0])
    assert only.chosen == measured[0]  # one candidate (a process on one CPU): nothing to measure
    assert only.pick(pages.CALIBRATE_MIN_BYTES) == (measured[0], False)


def test_a_candidate_slow_on_its_first_copy_keeps_its_turns_and_can_win():
    """One copy says nothing on these hosts (a copy's speed moves 2x from second to second):
    the fastest kernel measured slow once, while the host was in a slow phase, is still
    measured to the end and chosen on its median."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    fast, slow, close = pages.Kernel("nt-2t", 1, 2), pages.Kernel("memcpy", 0, 1), pages.Kernel("nt", 1, 1)
    c = pages.KernelChoice("load", [slow, close, fast], pages.CopyMetrics(reg))
    for _ in range(pages.CALIBRATE_WARMUP):
        c.pick(pages.CALIBRATE_MIN_BYTES)
    picks = [c.pick(pages.CALIBRATE_MIN_BYTES)[0] for _ in range(3 * pages.CALIBRATE_SAMPLES)]
    assert picks[:3] == [fast, close, slow] and set(picks) == {fast, close, slow}
    assert all(picks.count(k) == pages.CALIBRATE_SAMPLES for k in (fast, close, slow))
    speeds = {fast: [2.0, 20.0, 21.0], close: [16.0, 17.0, 16.5], slow: [12.0, 12.5, 13.0]}
    for k in picks:
        c.report(k, 10**9, 1 / speeds[k].pop(0))
    assert c.chosen == fast  # median 20 against 16.5 and 12.5, despite its first copy at 2
    assert reg.get_sample_value("pegaflow_client_copy_calibration_gbps",
                                {"direction": "load", "kernel": "memcpy"}) == pytest.approx(12.5)


def test_an_unknown_forced_kernel_is_a_one_line_error(fresh_choice, monkeypatch):
    monkeypatch.setenv(pages.ENV_KERNEL, "warp-drive")
    src = cpu_layout()
    pool = torch.zeros(page_bytes(src), dtype=torch.uint8)
    with pytest.raises(ValueError, match="PEGAFLOW_COPY_KERNEL='warp-drive': this host can run memcpy"):
        save_pages(src, [0], pool, [0])


def _memfd_pool(nbytes: int):  # type: ignore[no-untyped-def]
    import mmap
    import os

    fd = os.memfd_create("pf-test-pool")
    os.ftruncate(fd, nbytes)
    return fd, mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)


def _wait(cond, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_a_lazily_mapped_pool_is_populated_in_the_background_only_where_the_node_allocated():
    """The engine's mapping gets its page tables in the background, but only for chunks
    the node has already faulted in: a page the engine faulted first would be charged to
    the engine's memory cgroup."""
    import mmap
    import os

    chunk = 1 << pages.POPULATE_CHUNK_SHIFT
    fd, node_view = _memfd_pool(8 * chunk)
    try:
        node_view[: 3 * chunk] = b"\x01" * (3 * chunk)  # the node pre-faulted the first 3 chunks
        engine = mmap.mmap(fd, 8 * chunk, flags=mmap.MAP_SHARED)
        t = torch.frombuffer(engine, dtype=torch.uint8)
        pages.map_lazily(t)
        p = pages._lazy[t.data_ptr()]
        assert _wait(lambda: p.done[:3].all()), "allocated chunks were not populated in the background"
        allocated = os.fstat(fd).st_blocks * 512
        assert not p.done[3:].any() and allocated == 3 * chunk, (p.done, allocated)
        node_view[3 * chunk:] = b"\x02" * (5 * chunk)  # the pre-fault goes on
        assert _wait(lambda: p.left == 0)
        assert bytes(engine[5 * chunk: 5 * chunk + 4]) == b"\x02" * 4
        p.stop.set()
        t = None  # type: ignore[assignment]  # releases the buffer export so the mapping can close
        engine.close()
    finally:
        node_view.close()
        os.close(fd)


def test_no_kernel_is_chosen_while_the_pool_mapping_is_being_populated(fresh_choice, monkeypatch):
    """The background populate thread takes the core a two-thread kernel needs: copies made
    meanwhile are not measured (a choice made then would hold for the process's life)."""
    two = pages.kernels()[:2]
    assert len(two) == 2, "this build has no non-temporal kernel"
    monkeypatch.setattr(pages, "candidates", lambda: two)  # something to measure, on any CPU count
    buf = torch.randn(4, 16, 2, 128, 128).to(torch.float16)
    src = [buf[i] for i in range(4)]
    pb = page_bytes(src)
    n = max(1, pages.CALIBRATE_MIN_BYTES // pb)
    pool = torch.zeros(pb * n, dtype=torch.uint8)
    rounds = pages.CALIBRATE_WARMUP + pages.CALIBRATE_SAMPLES * len(pages.candidates())
    busy = pages._Populated(0, 1)
    busy.busy = True
    pages._lazy[-1] = busy  # a mapping whose background populate is at work
    try:
        for _ in range(rounds):
            save_pages(src, list(range(n)), pool, [i * pb for i in range(n)])
        assert pages.copy_kernels().get("save") is None
    finally:
        del pages._lazy[-1]
    for _ in range(rounds):
        save_pages(src, list(range(n)), pool, [i * pb for i in range(n)])
    assert pages.copy_kernels()["save"] is not None


def test_a_copy_populates_the_units_it_touches_not_their_chunks(monkeypatch):
    """Before the background thread gets there, a copy populates what it touches, by
    units: a page's unit, not its 2 MiB chunk (that cost a warm engine's first load)."""
    import numpy as np

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(pages, "madvise", lambda addr, n, advice: calls.append((addr, n)) or 0)
    chunk, unit = 1 << pages.POPULATE_CHUNK_SHIFT, 1 << pages.POPULATE_UNIT_SHIFT
    base = 1 << 40  # never touched: madvise is recorded, not run
    p = pages._Populated(base, 4 * chunk)
    # a half-unit piece in chunk 1, and a piece over three units across chunks 2 and 3
    offs = np.array([chunk + 3 * unit, 3 * chunk - unit], dtype=np.int64)
    lens = np.array([unit // 2, 3 * unit], dtype=np.int64)
    p.ensure(offs, lens)
    assert calls == [(base + chunk + 3 * unit, unit), (base + 3 * chunk - unit, 3 * unit)]
    assert set(np.flatnonzero(p.units)) == {chunk // unit + 3, *range(3 * chunk // unit - 1, 3 * chunk // unit + 2)}
    assert not p.done.any()  # whole chunks are the background thread's
    p.ensure(offs, lens)  # populated already: nothing more
    p.done[0] = True
    p.ensure(np.array([unit], dtype=np.int64), np.array([unit], dtype=np.int64))  # a chunk the thread did
    assert len(calls) == 2
