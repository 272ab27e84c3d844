"""Helpers several benchmarks share."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU time of the whole machine so far, from /proc/stat (every CPU; busy:
    all but idle and iowait): the busy fraction of a window is the ratio of the differences."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return float(sum(v) - v[3] - v[4]), float(sum(v))


@dataclass(frozen=True)
class BestCopy:
    """The fastest this machine copies a buffer, warm: the limit a page copy is held to."""

    one_thread_gbps: float
    two_threads_gbps: float

    @property
    def gbps(self) -> float:
        return max(self.one_thread_gbps, self.two_threads_gbps)

    @property
    def winner(self) -> str:
        return "2 threads" if self.two_threads_gbps > self.one_thread_gbps else "1 thread"

    def better(self, other: BestCopy) -> BestCopy:
        """Each way's better figure of two measurements (e.g. before and after a benchmark)."""
        return BestCopy(max(self.one_thread_gbps, other.one_thread_gbps),
                        max(self.two_threads_gbps, other.two_threads_gbps))

    def describe(self) -> str:
        return (f"{self.gbps:.2f} GB/s, {self.winner} (1 thread {self.one_thread_gbps:.2f}, "
                f"2 threads {self.two_threads_gbps:.2f})")


def best_copy(nbytes: int, rounds: int) -> BestCopy:
    """The best of ``rounds`` copies of ``nbytes`` with numpy (``np.copyto``, glibc memcpy
    underneath; nothing of PegaFlow's own copy code) on one thread, and on two threads that
    each copy one half (numpy releases the GIL while it copies), interleaved so both see the
    same phase of the host. The buffers are written and copied once before the timed
    rounds, so the copies run on warm memory, as a benchmark's steady state does.
    (Two threads taking small slices from a shared cursor ran at about one thread's speed
    here: every slice waits for the GIL.)"""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    half = nbytes // 2
    with ThreadPoolExecutor(1) as helper:

        def one() -> None:
            np.copyto(dst, src)

        def two() -> None:
            f = helper.submit(np.copyto, dst[half:], src[half:])
            np.copyto(dst[:half], src[:half])
            f.result()

        best = {one: 0.0, two: 0.0}
        for rnd in range(rounds + 1):  # round 0: warm-up, not timed
            for copy in best:
                t = time.perf_counter()
                copy()
                gbps = nbytes / (time.perf_counter() - t) / 1e9
                if rnd:
                    best[copy] = max(best[copy], gbps)
    return BestCopy(best[one], best[two])


_ECHO = """
import socket, sys
s = socket.socket(fileno=int(sys.argv[1]))
reply = b"r" * int(sys.argv[2])
while True:
    got = s.recv(1 << 16)
    if not got:
        break
    s.sendall(reply)
"""


def socket_round_trip(seconds: float, same_cpu: bool, request: int = 1100, reply: int = 600,
                      gap: float = 0.002, min_samples: int = 20) -> dict[str, float]:
    """Round trips of a ``request``-byte message answered with ``reply`` bytes between two
    bare processes over a Unix socket pair, one every ``gap`` seconds for ``seconds``: the
    least a local RPC costs on this host, nothing of PegaFlow's in it. The two ends are
    pinned to one CPU (``same_cpu``: a wake-up is a switch on a running CPU) or to two
    (each message wakes the other, idle CPU; on a machine with one CPU, both on it). On VMs
    of this kind the second is the slow one (measured on one host: p50 130-148 us and p99
    490-540 against 12 us and 190). It goes on past ``seconds`` until it has ``min_samples``
    (a slow host still gives percentiles). Returns p50/p99/p999 in microseconds and the count."""
    cpus = sorted(os.sched_getaffinity(0))
    mine, theirs = cpus[0], cpus[0] if same_cpu or len(cpus) < 2 else cpus[1]
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = subprocess.Popen([sys.executable, "-c", _ECHO, str(b.fileno()), str(reply)], pass_fds=[b.fileno()])
    b.close()
    a.settimeout(10.0)  # an echo process that hangs fails the measurement instead of holding it
    lat: list[float] = []
    try:
        os.sched_setaffinity(child.pid, {theirs})
        os.sched_setaffinity(0, {mine})
        msg = b"q" * request
        end = time.monotonic() + seconds
        first = True
        while time.monotonic() < end or len(lat) < min_samples:
            t = time.perf_counter()
            a.sendall(msg)
            got = 0
            while got < reply:
                n = len(a.recv(1 << 16))
                if not n:
                    raise RuntimeError("the echo process closed its socket")
                got += n
            if not first:  # the first one starts the child's interpreter loop
                lat.append(time.perf_counter() - t)
            first = False
            time.sleep(gap)
    finally:
        os.sched_setaffinity(0, cpus)
        a.close()
        child.wait(timeout=10)
    us = np.array(lat) * 1e6
    return {"n": len(lat), "p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "p999_us": float(np.percentile(us, 99.9))}


def scrape(port: int) -> dict[str, float]:
    """A Prometheus /metrics page as {"name|label=value|...": value} (labels sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return out


class Streamed:
    """Time to first token and cached prompt tokens of one OpenAI streamed completion, fed
    its server-sent-event lines as they arrive (``stream_options.include_usage`` for the
    cached tokens). Started when constructed: make it just before sending the request."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.cached = 0

    def feed(self, line: str) -> None:
        line = line.strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            return
        chunk = json.loads(line[5:])
        if self.first is None and chunk.get("choices"):
            self.first = time.perf_counter() - self.t0
        details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
        self.cached = int(details.get("cached_tokens") or self.cached)

    def ttft_s(self, who: str) -> float:
        if self.first is None:
            raise RuntimeError(f"{who}: no token streamed")
        return self.first


RESAMPLES = 2000  # bootstrap resamples behind p99_ratio_interval


def p99_ratio_interval(a_us: list[float], b_us: list[float], *, paired: bool = False, resamples: int = RESAMPLES,
                       seed: int = 0) -> tuple[float, float]:
    """The 5th and 95th percentiles of p99(a) / p99(b) over bootstrap resamples of the calls:
    how far the ratio moves with the calls that happened to land in the tail, within one run.
    ``paired``: ``a_us[i]`` and ``b_us[i]`` were made in the same round (calls interleaved on
    one client), so a resample takes both calls of a round, and a slow moment of the host
    stays on both sides."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(a_us), np.asarray(b_us)
    if paired:
        if len(a) != len(b):
            raise ValueError(f"paired calls need as many of each: {len(a)} and {len(b)}")
        idx = rng.integers(0, len(a), (resamples, len(a)))
        a_p, b_p = np.percentile(a[idx], 99, axis=1), np.percentile(b[idx], 99, axis=1)
    else:
        a_p = np.percentile(rng.choice(a, (resamples, len(a))), 99, axis=1)
        b_p = np.percentile(rng.choice(b, (resamples, len(b))), 99, axis=1)
    lo, hi = np.percentile(a_p / b_p, [5, 95])
    return float(lo), float(hi)
