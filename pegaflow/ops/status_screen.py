"""The screens of ``pegaflow status``: a node's or the cluster's figures as lines of at most
80 columns (docs/status.md).

Pure functions of a snapshot (the dicts :mod:`pegaflow.ops.status` builds from the nodes'
Stats answers, the same objects ``--json`` prints, typed below), so they are tested without
a node. Every line is cut to ``width``; names too long for their column lose their middle.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Literal, TypedDict, final

from pegaflow.core.tiers import MISS, OUTCOMES, Tier

WIDTH = 80
MAX_ROWS = 4  # engines and namespaces listed on a screen; the rest are counted
NONE = "-"  # a ratio of nothing (no request in the window)
# What the screens call each outcome (pegaflow.core.tiers): line and column labels.
LABEL: dict[str, str] = {Tier.L1: "L1", Tier.SSD: "SSD", Tier.REMOTE: "remote", MISS: "miss"}



# ---- the snapshot: what ``--json`` prints, the node's Stats fields by their JSON names ---
class Pool(TypedDict):
    capacity_bytes: int
    used_bytes: int
    prefaulted_bytes: int
    resident_bytes: int
    resident_blocks: int
    evictions: int


class Window(TypedDict):
    """One window of the hit rate beside its ceiling (a node's, or the metaserver's union)."""

    window: str
    requested_blocks: int
    hit_blocks: int
    distinct_blocks: float
    hit_ratio: float
    ceiling_ratio: float


class Ssd(TypedDict):
    capacity_bytes: int
    used_bytes: int
    blocks: int
    write_bytes: int
    read_bytes: int
    write_bytes_per_second: float
    read_bytes_per_second: float
    write_queue_blocks: int
    promoted_blocks: int
    skipped_writes: dict[str, int]  # blocks never written, by reason (in --json; the screen has no room)


class Peers(TypedDict):
    pulls: dict[str, int]  # by outcome ("ok", or why not)
    pull_bytes: int
    served_bytes: int
    active_pins: int
    backed_off_peers: int
    lookups: dict[str, int]  # by outcome


class Engine(TypedDict):
    instance_id: str
    sessions: int
    namespaces: list[str]
    leases: int
    reservations: int


class Namespace(TypedDict):
    name: str
    page_bytes: int
    blocks: int
    bytes: int


@final  # no other keys: ``"metaserver" in snapshot`` tells a cluster's from a node's (Snapshot)
class NodeSnapshot(TypedDict):
    addr: str
    reachable: Literal[True]
    node_id: str
    epoch: int
    uptime_seconds: float
    pool: Pool
    windows: list[Window]
    requests: dict[str, int]  # each request's blocks once, by outcome (pegaflow.core.tiers.OUTCOMES)
    answers: dict[str, int]  # every READY answer's blocks, by outcome
    save_bytes: int
    load_bytes: int
    ssd: Ssd | None  # None: no SSD tier
    peers: Peers | None  # None: not in a cluster
    sessions: int
    leases: int
    reservations: int
    engines: list[Engine]
    namespaces: list[Namespace]


@final
class Unreachable(TypedDict):
    addr: str
    reachable: Literal[False]
    error: str  # why, in a phrase


NodeStatus = NodeSnapshot | Unreachable


class NodeEntry(TypedDict):
    """A node as the metaserver lists it, with its status."""

    node: str
    address: str
    epoch: int
    alive: bool
    status: NodeStatus


class Ceiling(TypedDict):
    """The metaserver's union of the nodes' ceiling sketches."""

    nodes_merged: int
    nodes_skipped: int
    windows: list[Window]


class Totals(TypedDict):
    """Sums over the reachable nodes (``pegaflow.ops.status.totals``)."""

    nodes: int
    reachable: int
    capacity_bytes: int
    used_bytes: int
    window: str  # the shortest window, whose requests and hits are summed ("" when none)
    requested_blocks: int
    hit_blocks: int
    requests: dict[str, int]
    ssd: Ssd | None
    peers: Peers | None
    engines: int
    sessions: int
    namespaces: list[Namespace]


@final
class ClusterSnapshot(TypedDict):
    metaserver: str
    reachable: Literal[True]
    error: str
    nodes: list[NodeEntry]
    totals: Totals
    ceiling: Ceiling | None  # None: the metaserver cannot say


@final
class MetaserverUnreachable(TypedDict):
    metaserver: str
    reachable: Literal[False]
    error: str


ClusterStatus = ClusterSnapshot | MetaserverUnreachable
# Either screen's. Spelled flat: mypy narrows ``"metaserver" in snapshot`` (the final
# TypedDicts above) on a flat union, not on a union of the two aliases.
Snapshot = NodeSnapshot | Unreachable | ClusterSnapshot | MetaserverUnreachable


# ---- numbers --------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    """Binary units, three significant figures: ``0 B``, ``512 B``, ``1.5 KiB``, ``30.0 GiB``, ``120 GiB``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.0f} {unit}" if abs(n) >= 99.95 else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_short_bytes(n: float) -> str:
    """``fmt_bytes`` without the space and the ``iB`` (``1.5G``): for table columns."""
    text = fmt_bytes(n)
    return text.replace(" B", "B").replace(" ", "").replace("iB", "")


def fmt_rate(bytes_per_second: float) -> str:
    return fmt_bytes(bytes_per_second) + "/s"


def fmt_count(n: float) -> str:
    """Exact with thousands separators below 100,000; then ``123.5k``, ``1.2M``, ``3.4G``."""
    n = int(n)
    if abs(n) < 100_000:
        return f"{n:,}"
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            v = n / div
            return f"{v:.0f}{unit}" if abs(v) >= 999.95 else f"{v:.1f}{unit}"
    raise AssertionError("unreachable")


def fmt_pct(ratio: float | None, digits: int = 1) -> str:
    return NONE if ratio is None else f"{100 * ratio:.{digits}f}%"


def share(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def fmt_duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def clip(text: str, n: int) -> str:
    """``text`` in at most ``n`` columns: the middle gives way (``Qwen/Qw..-tp1``)."""
    if len(text) <= n:
        return text
    if n <= 2:
        return text[:n]
    head = (n - 2 + 1) // 2
    return text[:head] + ".." + text[len(text) - (n - 2 - head):]


def fit(lines: Sequence[str], width: int = WIDTH) -> list[str]:
    """Every line cut to ``width`` columns (trailing blanks dropped)."""
    return [(ln if len(ln) <= width else ln[: width - 3] + "...").rstrip() for ln in lines]


def _with_clock(head: str, clock: str, width: int) -> str:
    """``head`` left, the time right; ``head`` is cut first."""
    room = width - len(clock) - 1
    return (head if len(head) <= room else head[: room - 3] + "...").ljust(room) + " " + clock


def _ratio_of_window(w: Window) -> tuple[float | None, float | None]:
    n = w.get("requested_blocks", 0)
    if not n:
        return None, None
    return w.get("hit_ratio", 0.0), w.get("ceiling_ratio", 0.0)


# ---- one node -------------------------------------------------------------------------
def unreachable_line(what: str, addr: str, error: str) -> str:
    return f"{what} {addr} unreachable: {error}"


def node_lines(s: NodeStatus, now: float | None = None, width: int = WIDTH) -> list[str]:
    """The node screen of snapshot ``s`` (see :func:`pegaflow.ops.status.node_snapshot`)."""
    if not s["reachable"]:
        return fit([unreachable_line("node", s["addr"], s["error"])], width)
    clock = time.strftime("%H:%M:%S", time.localtime(now if now is not None else time.time()))
    tail = f" at {s['addr']}  up {fmt_duration(s['uptime_seconds'])}"
    room = width - len(clock) - 1 - len("node ") - len(tail)
    lines = [_with_clock(f"node {clip(s['node_id'], max(8, room))}{tail}", clock, width)]
    p = s["pool"]
    used = share(p["used_bytes"], p["capacity_bytes"])
    prefault = share(p["prefaulted_bytes"], p["capacity_bytes"])
    lines.append(f"pool      {fmt_bytes(p['used_bytes'])} of {fmt_bytes(p['capacity_bytes'])} used "
                 f"({fmt_pct(used)})  {fmt_count(p['resident_blocks'])} blocks  "
                 f"pre-fault {fmt_pct(prefault, 0)}")
    lines.append(f"traffic   saved {fmt_bytes(s['save_bytes'])}  loaded {fmt_bytes(s['load_bytes'])}  "
                 f"evicted {fmt_count(p['evictions'])} blocks")
    lines.append("")
    lines += window_lines(s["windows"])
    if not s["windows"]:
        lines.append(f"{'':<10}no window (the node keeps no request accounting)")
    lines.append(tier_line("blocks", s["requests"]))
    lines.append("")
    lines.append(ssd_line(s["ssd"]))
    lines.append(peers_line(s["peers"]))
    lines += engine_lines(s)
    lines += namespace_lines(s["namespaces"])
    return fit(lines, width)


def window_lines(windows: Sequence[Window]) -> list[str]:
    """Per window: blocks requested, the hit rate, the ceiling and the hit rate's share of it."""
    out = [f"{'hit rate':<10}{'window':<8}{'requested':>11}{'hit rate':>11}{'ceiling':>10}{'of ceiling':>12}"]
    for w in windows:
        hit, ceil = _ratio_of_window(w)
        of = share(hit, ceil) if hit is not None and ceil else None
        out.append(f"{'':<10}{w['window']:<8}{fmt_count(w['requested_blocks']):>11}{fmt_pct(hit):>11}"
                   f"{fmt_pct(ceil):>10}{fmt_pct(of, 0):>12}")
    return out


def tier_line(label: str, t: Mapping[str, int]) -> str:
    """Blocks of requests by where they were found, with their shares."""
    total = sum(t.get(k, 0) for k in OUTCOMES)
    parts = [f"{LABEL[k]} {fmt_count(t.get(k, 0))} {fmt_pct(share(t.get(k, 0), total))}" for k in OUTCOMES]
    return f"{label:<10}" + "  ".join(parts)


def ssd_line(ssd: Ssd | None) -> str:
    if not ssd:
        return f"{'SSD':<10}off (no --ssd-cache-path)"
    return (f"{'SSD':<10}{fmt_bytes(ssd['used_bytes'])} of {fmt_bytes(ssd['capacity_bytes'])} "
            f"({fmt_pct(share(ssd['used_bytes'], ssd['capacity_bytes']))})  {fmt_count(ssd['blocks'])} blocks  "
            f"w {fmt_rate(ssd['write_bytes_per_second'])}  r {fmt_rate(ssd['read_bytes_per_second'])}")


def peers_line(peers: Peers | None) -> str:
    if peers is None:
        return f"{'peers':<10}none (not in a cluster: no --metaserver-addr or --redis-url)"
    pulls = peers.get("pulls", {})
    ok = pulls.get("ok", 0)
    failed = sum(v for k, v in pulls.items() if k != "ok")
    return (f"{'peers':<10}pulls {fmt_count(ok)} ok {fmt_count(failed)} failed  "
            f"pulled {fmt_bytes(peers['pull_bytes'])}  served {fmt_bytes(peers['served_bytes'])}  "
            f"backed off {peers['backed_off_peers']}")


def _plural(n: int, word: str) -> str:
    return f"{fmt_count(n)} {word}{'' if n == 1 else 's'}"


def engine_lines(s: NodeSnapshot) -> list[str]:
    engines = s["engines"]
    out = [f"{'engines':<10}{_plural(len(engines), 'engine')}  {_plural(s['sessions'], 'session')}  "
           f"{_plural(s['leases'], 'lease')}  {_plural(s['reservations'], 'reservation')}"]
    if engines:
        out.append(f"  {'instance':<34}{'sessions':>9}{'leases':>8}  namespaces")
        for e in engines[:MAX_ROWS]:
            out.append(f"  {clip(e['instance_id'], 34):<34}{e['sessions']:>9}{e['leases']:>8}  "
                       + _first_and_count(e["namespaces"], WIDTH - 55))
        if len(engines) > MAX_ROWS:
            out.append(f"  ... and {len(engines) - MAX_ROWS} more")
    return out


def _first_and_count(names: Sequence[str], n: int) -> str:
    """The first name and how many others (``llama-tp0 +3``) in ``n`` columns."""
    if not names:
        return NONE
    more = f" +{len(names) - 1}" if len(names) > 1 else ""
    return clip(names[0], n - len(more)) + more


def namespace_lines(namespaces: Sequence[Namespace]) -> list[str]:
    total = sum(n["bytes"] for n in namespaces)
    out = [f"{'namespaces':<11}{len(namespaces)} holding {fmt_bytes(total)}"]
    if namespaces:
        out.append(f"  {'name':<40}{'page':>10}{'blocks':>12}{'bytes':>12}")
        for n in sorted(namespaces, key=lambda n: (-n["bytes"], n["name"]))[:MAX_ROWS]:
            out.append(f"  {clip(n['name'], 40):<40}{fmt_bytes(n['page_bytes']):>10}"
                       f"{fmt_count(n['blocks']):>12}{fmt_bytes(n['bytes']):>12}")
        if len(namespaces) > MAX_ROWS:
            out.append(f"  ... and {len(namespaces) - MAX_ROWS} more")
    return out


# ---- the cluster ----------------------------------------------------------------------
_ROW = "{:<14} {:>11} {:>4} {:>6} {:>6} {:>7} {:>7} {:>6} {:>7}"


def cluster_lines(c: ClusterStatus, now: float | None = None, width: int = WIDTH) -> list[str]:
    """The cluster screen of ``c`` (see :func:`pegaflow.ops.status.cluster_status`)."""
    if not c["reachable"]:
        return fit([unreachable_line("metaserver", c["metaserver"], c["error"])], width)
    clock = time.strftime("%H:%M:%S", time.localtime(now if now is not None else time.time()))
    nodes = c["nodes"]
    up = sum(1 for n in nodes if n["status"]["reachable"])
    head = f"cluster of metaserver {c['metaserver']}: {_plural(len(nodes), 'node')}, {up} reachable"
    lines = [_with_clock(head, clock, width)]
    t = c["totals"]
    window = t["window"] or NONE
    lines.append("")
    if not nodes:
        lines.append("no node has registered with this metaserver (nodes join with --metaserver-addr)")
    tiers = ", ".join(LABEL[k] for k in Tier)
    lines.append(clip(f"hit and ceil(ing): the last {window}; {tiers}: blocks found there", width))
    lines.append(_ROW.format("node", "pool", "used", "hit", "ceil", *(LABEL[k] for k in Tier), "engines"))
    for n in nodes:
        s = n["status"]
        name = clip(n["node"], 14)
        if not s["reachable"]:
            why = "no heartbeat (not alive)" if not n["alive"] else f"unreachable: {s['error']}"
            lines.append(f"{name:<14} {clip(n['address'], 21):<21} {why}")
            continue
        p = s["pool"]
        hit, ceil = _ratio_of_window(s["windows"][0]) if s["windows"] else (None, None)
        r = s["requests"]
        lines.append(_ROW.format(
            name, f"{fmt_short_bytes(p['used_bytes'])}/{fmt_short_bytes(p['capacity_bytes'])}",
            fmt_pct(share(p["used_bytes"], p["capacity_bytes"]), 0), fmt_pct(hit), fmt_pct(ceil),
            *(fmt_count(r[k]) for k in Tier), fmt_count(len(s["engines"])),
        ))
    ceiling = c.get("ceiling")
    union = next((w for w in ceiling["windows"] if w["window"] == t["window"]), None) if ceiling else None
    lines.append(_ROW.format(
        "total", f"{fmt_short_bytes(t['used_bytes'])}/{fmt_short_bytes(t['capacity_bytes'])}",
        fmt_pct(share(t["used_bytes"], t["capacity_bytes"]), 0), fmt_pct(share(t["hit_blocks"], t["requested_blocks"])),
        fmt_pct(_ratio_of_window(union)[1]) if union else NONE, *(fmt_count(t["requests"][k]) for k in Tier),
        fmt_count(t["engines"]),
    ))
    lines.append("")
    if ceiling:
        lines += window_lines(ceiling["windows"])
        lines.append(f"{'':<10}(the metaserver's union of the sketches of {_plural(ceiling['nodes_merged'], 'node')})")
    else:
        lines.append(f"{'hit rate':<10}no cluster ceiling: the metaserver has no node's ceiling sketch")
    lines.append("")
    lines.append(tier_line("blocks", t["requests"]))
    lines.append(ssd_line(t["ssd"]) if t["ssd"] else f"{'SSD':<10}none on any reachable node")
    lines.append(peers_line(t["peers"]) if t["peers"] else f"{'peers':<10}no reachable node pulls from peers")
    lines.append(f"{'engines':<10}{_plural(t['engines'], 'engine')}  {_plural(t['sessions'], 'session')}")
    lines += namespace_lines(t["namespaces"])
    return fit(lines, width)
