"""Load sent from a process of its own: one thread and one connection per node, as that many
nodes would (bench/meta.py's ingest, ours and the original's).

    python bench/sender.py KIND PLAN      (bench/meta.py runs it through :class:`Sender`)

A *kind* is how a node's items go out; each is a class with ``items`` (per node, the list of
``(item, pairs)`` it sends in order, built beforehand so the rate is the receiver's) and
``connect(k)`` (node ``k``'s send function: item -> reply), plus ``check_first`` (every reply
of the first pass, checked after the timing) and ``check_later`` (a later pass's reply):

- ``original``: requests to the Rust original's metaserver, serialized beforehand
  (bench/original_meta.py ``OriginalCalls``);
- ``streams``: our nodes' events, encoded beforehand, ``XADD``-ed to each node's stream in
  pipelines, as ``pegaflow/node/publishing.py`` sends them (bench/meta.py ``StreamEntries``).

The child prints ``ready`` once connected, then waits for ``once`` or ``loop`` on stdin:
``once`` sends every node's items once; ``loop`` sends them again and again until ``stop``
(so a load lasts as long as the lookups measured under it), printing ``first-pass`` once every
node sent all its items once. Its last line is JSON: ``pairs`` ((block, node) updates sent),
``seconds`` (from the first send to the last reply), ``t0`` (``time.monotonic()`` of the first
send: one clock for every process of this host, so the parent can time what a receiver made of
the load), ``calls`` and ``passes`` (the least number of times any node sent all its items).
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parents[1]

# kind -> "module:class" (imported in the child only)
KINDS = {"original": "bench.original_meta:OriginalCalls", "streams": "bench.meta:StreamEntries"}


class Kind(Protocol):
    items: list[list[tuple[Any, int]]]

    def connect(self, k: int) -> Callable[[Any], Any]: ...

    def check_first(self, replies: list[list[Any]]) -> None: ...

    def check_later(self, item: Any, reply: Any) -> None: ...


class Sender:
    """``payload`` sent by a child process of ``kind``, as fast as the receiver answers, or at
    most ``rate`` pairs / s in all (each node its share: an open-loop load, for a receiver that
    answers before it ingests). Constructed, the child has read it,
    connected one connection per node, and waits. ``go(loop=False)`` sends every node's items
    once; ``go(loop=True)`` again and again until ``stop()``; ``first_pass`` is set once every
    item was sent once. ``result()``: the child's JSON (the module's docstring)."""

    def __init__(self, kind: str, payload: dict[str, Any], scratch: Path, rate: float = 0.0) -> None:
        path = scratch / f"sender-{kind}-{uuid.uuid4().hex[:8]}.pickle"
        path.write_bytes(pickle.dumps({"rate": rate, "payload": payload}, protocol=pickle.HIGHEST_PROTOCOL))
        self.kind = kind
        self.proc = subprocess.Popen([sys.executable, __file__, kind, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert self.proc.stdout is not None and self.proc.stdin is not None
        line = self.proc.stdout.readline().strip()  # the child exits (EOF) if it cannot get ready
        path.unlink()
        if line != "ready":
            self.proc.wait(30)
            raise SystemExit(f"{kind} sender: the child did not get ready (exit {self.proc.returncode})")
        self.first_pass = threading.Event()
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, name=f"{kind}-sender-out", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip() == "first-pass":
                self.first_pass.set()
            else:
                self._lines.append(line)

    def _say(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def go(self, loop: bool = False) -> None:
        self._say("loop" if loop else "once")

    def stop(self) -> None:
        self._say("stop")

    def running(self) -> bool:
        return self.proc.poll() is None

    def result(self, timeout: float = 600) -> dict[str, Any]:
        self.proc.wait(timeout)
        self._reader.join(timeout)
        out = "".join(self._lines).strip()
        if self.proc.returncode != 0 or not out:
            raise SystemExit(f"{self.kind} sender failed (exit {self.proc.returncode}): {out[-300:]}")
        res: dict[str, Any] = json.loads(out.splitlines()[-1])
        return res


def main(kind: str, plan_path: str) -> None:
    """The child of :class:`Sender`: stdin says ``once`` or ``loop`` (then ``stop``)."""
    module, cls = KINDS[kind].split(":")
    data = pickle.loads(Path(plan_path).read_bytes())
    target: Kind = getattr(importlib.import_module(module), cls)(data["payload"])
    sends = [target.connect(k) for k in range(len(target.items))]
    share = data["rate"] / len(sends)  # pairs / s of each node; 0: unthrottled
    t0 = p0 = 0.0
    first: list[list[Any]] = [[] for _ in sends]  # replies of the first pass, checked after timing
    pairs = [0] * len(sends)
    calls = [0] * len(sends)
    passes = [0] * len(sends)
    errors: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()
    done_first = [0]

    def pace(k: int) -> None:
        if share:
            ahead = p0 + pairs[k] / share - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)

    def send(k: int) -> None:
        try:
            for item, n in target.items[k]:
                first[k].append(sends[k](item))
                pairs[k] += n
                calls[k] += 1
                pace(k)
            passes[k] = 1
            with lock:
                done_first[0] += 1
                if done_first[0] == len(sends):
                    print("first-pass", flush=True)
            while not stop.is_set():
                for item, n in target.items[k]:
                    if stop.is_set():
                        return
                    target.check_later(item, sends[k](item))
                    pairs[k] += n
                    calls[k] += 1
                    pace(k)
                passes[k] += 1
        except Exception as e:  # reported below
            errors.append(repr(e))
            stop.set()

    threads = [threading.Thread(target=send, args=(k,)) for k in range(len(sends))]
    print("ready", flush=True)
    mode = sys.stdin.readline().strip()
    if mode not in ("once", "loop"):
        return
    if mode == "once":
        stop.set()
    else:
        threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    t0, p0 = time.monotonic(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - p0
    if errors:
        raise SystemExit(f"{kind} sender: {errors[0]}")
    target.check_first(first)
    print(json.dumps({"pairs": sum(pairs), "seconds": dt, "t0": t0, "calls": sum(calls), "passes": min(passes)}),
          flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in KINDS:
        raise SystemExit(f"usage: python {sys.argv[0]} {{{','.join(KINDS)}}} PLAN (bench/meta.py runs it)")
    main(sys.argv[1], sys.argv[2])
