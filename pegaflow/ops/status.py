"""``pegaflow status``: one screen of a node (``--addr``) or of the cluster (``--metaserver``).

The figures come from each node's ``Stats`` RPC (proto/node.proto), which reads what the
node computes for its Prometheus metrics: the pool, the hit rate beside its ceiling per
window (pegaflow/node/accounting.py), blocks by tier, the SSD tier, peers and pulls,
engines, sessions and namespaces. For the cluster, the metaserver's ``ListNodes`` names the
nodes and their addresses; every node is asked at once, and one that does not answer is a
row saying so. Calls carry the token and TLS roots every client uses
(``pegaflow.common.security``).

``--json`` prints the snapshot these functions build (one object); ``--watch SECS`` redraws
the screen in place until Ctrl-C. Exit status: 0 shown; 1 the node (or metaserver) did not
answer (printed once, or on the watched screen until it does); 2 bad flags.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Sequence
from typing import TextIO

import grpc

from pegaflow._proto import meta_pb2, meta_pb2_grpc, node_pb2, node_pb2_grpc
from pegaflow.common.security import Security, SecurityError, sync_channel
from pegaflow.config.commands import StatusConfig, load
from pegaflow.config.options import STATUS
from pegaflow.core.tiers import OUTCOMES
from pegaflow.ops.status_screen import (
    WIDTH,
    Ceiling,
    ClusterStatus,
    Namespace,
    NodeEntry,
    NodeSnapshot,
    NodeStatus,
    Peers,
    Snapshot,
    Ssd,
    Totals,
    Unreachable,
    cluster_lines,
    node_lines,
)

DESCRIPTION = (
    "Show a node (--addr) or, with --metaserver, every node of the cluster: pool, hit rate "
    "beside its ceiling, blocks by tier, SSD, peers, engines and namespaces."
)
DEFAULT_WATCH_SECONDS = 2.0
CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen: the next frame replaces this one


# ---- snapshots: the JSON objects, built from the RPC answers --------------------------
def _tiers(t: node_pb2.TierBlocks) -> dict[str, int]:
    return {k: getattr(t, k) for k in OUTCOMES}


def node_snapshot(addr: str, r: node_pb2.StatsResponse) -> NodeSnapshot:
    """A node's Stats answer as the plain dict ``--json`` prints and the screens read."""
    return {
        "addr": addr,
        "reachable": True,
        "node_id": r.node_id,
        "epoch": r.epoch,
        "uptime_seconds": round(r.uptime_seconds, 3),
        "pool": {
            "capacity_bytes": r.pool_bytes,
            "used_bytes": r.used_bytes,
            "prefaulted_bytes": r.pool_prefaulted_bytes,
            "resident_bytes": r.resident_bytes,
            "resident_blocks": r.resident_blocks,
            "evictions": r.evictions,
        },
        "windows": [
            {"window": w.window, "requested_blocks": w.requested_blocks, "hit_blocks": w.hit_blocks,
             "distinct_blocks": round(w.distinct_blocks, 1), "hit_ratio": w.hit_ratio,
             "ceiling_ratio": w.ceiling_ratio}
            for w in r.windows
        ],
        # Each request's blocks once, by where they were found (pegaflow_node_request_blocks_total).
        "requests": _tiers(r.request_blocks),
        # Every READY answer's blocks (pegaflow_node_hit_blocks_total / _miss_blocks_total).
        "answers": _tiers(r.hit_blocks),
        "save_bytes": r.save_bytes,
        "load_bytes": r.load_bytes,
        "ssd": {
            "capacity_bytes": r.ssd.capacity_bytes, "used_bytes": r.ssd.used_bytes, "blocks": r.ssd.blocks,
            "write_bytes": r.ssd.write_bytes, "read_bytes": r.ssd.read_bytes,
            "write_bytes_per_second": r.ssd.write_bytes_per_second,
            "read_bytes_per_second": r.ssd.read_bytes_per_second,
            "write_queue_blocks": r.ssd.write_queue_blocks, "promoted_blocks": r.ssd.promoted_blocks,
            "skipped_writes": dict(sorted(r.ssd.skipped_writes.items())),
        } if r.HasField("ssd") else None,
        "peers": {
            "pulls": dict(sorted(r.peers.pulls.items())), "pull_bytes": r.peers.pull_bytes,
            "served_bytes": r.peers.served_bytes, "active_pins": r.peers.active_pins,
            "backed_off_peers": r.peers.backed_off_peers, "lookups": dict(sorted(r.peers.lookups.items())),
        } if r.HasField("peers") else None,
        "sessions": r.sessions,
        "leases": r.active_leases,
        "reservations": r.active_reservations,
        "engines": [
            {"instance_id": e.instance_id, "sessions": e.sessions, "namespaces": list(e.namespaces),
             "leases": e.leases, "reservations": e.reservations}
            for e in r.engines
        ],
        "namespaces": [
            {"name": n.name, "page_bytes": n.page_bytes, "blocks": n.blocks, "bytes": n.bytes}
            for n in r.namespaces
        ],
    }


def unreachable(addr: str, error: str) -> Unreachable:
    return {"addr": addr, "reachable": False, "error": error}


def describe_error(exc: grpc.RpcError) -> str:
    """One short phrase for a failed call."""
    code = exc.code() if hasattr(exc, "code") else None
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return "token refused (set --auth-token-file)"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "no answer in time (--timeout)"
    if code == grpc.StatusCode.UNAVAILABLE:
        return "not answering (refused or no route)"
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code is not None else 'error'}: {detail}"


def _channel(addr: str, sec: Security) -> grpc.Channel:
    return sync_channel(addr, sec, [("grpc.enable_retries", 0), ("grpc.use_local_subchannel_pool", 1)])


def node_status(addr: str, sec: Security, timeout: float) -> NodeStatus:
    """One node's snapshot, or an unreachable one."""
    with _channel(addr, sec) as ch:
        try:
            r = node_pb2_grpc.PegaNodeStub(ch).Stats(node_pb2.StatsRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            return unreachable(addr, describe_error(exc))
    return node_snapshot(addr, r)


def cluster_status(metaserver: str, sec: Security, timeout: float) -> ClusterStatus:
    """Every node the metaserver knows, each asked for its Stats concurrently."""
    with _channel(metaserver, sec) as ch:
        stub = meta_pb2_grpc.MetaServiceStub(ch)
        try:
            listed = stub.ListNodes(meta_pb2.ListNodesRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            return {"metaserver": metaserver, "reachable": False, "error": describe_error(exc)}
        ceiling = cluster_ceiling(stub, timeout)
    entries = sorted(listed.nodes, key=lambda n: n.node)
    channels = [_channel(n.address, sec) for n in entries]
    try:
        calls = [node_pb2_grpc.PegaNodeStub(ch).Stats.future(node_pb2.StatsRequest(), timeout=timeout)
                 if n.alive else None for n, ch in zip(entries, channels, strict=True)]
        nodes: list[NodeEntry] = []
        for n, call in zip(entries, calls, strict=True):
            status: NodeStatus
            if call is None:
                status = unreachable(n.address, "no heartbeat (not alive)")
            else:
                try:
                    status = node_snapshot(n.address, call.result())
                except grpc.RpcError as exc:
                    status = unreachable(n.address, describe_error(exc))
            nodes.append({"node": n.node, "address": n.address, "epoch": n.epoch, "alive": n.alive,
                          "status": status})
    finally:
        for ch in channels:
            ch.close()
    return {"metaserver": metaserver, "reachable": True, "error": "", "nodes": nodes, "totals": totals(nodes),
            "ceiling": ceiling}


def cluster_ceiling(stub: meta_pb2_grpc.MetaServiceStub, timeout: float) -> Ceiling | None:
    """The metaserver's union of the nodes' ceiling sketches; None when it cannot say (Redis
    unreadable, or a metaserver without the RPC)."""
    try:
        r = stub.ClusterCeiling(meta_pb2.ClusterCeilingRequest(), timeout=timeout)
    except grpc.RpcError:
        return None
    if not r.available:
        return None
    return {
        "nodes_merged": r.nodes_merged,
        "nodes_skipped": r.nodes_skipped,
        "windows": [
            {"window": w.window, "requested_blocks": w.requested_blocks, "hit_blocks": w.hit_blocks,
             "distinct_blocks": round(w.distinct_blocks, 1), "hit_ratio": w.hit_ratio,
             "ceiling_ratio": w.ceiling_ratio}
            for w in r.windows
        ],
    }


def totals(nodes: Sequence[NodeEntry]) -> Totals:
    """Sums over the reachable nodes. Hit rates add up (sum of hits over sum of requests in
    the shortest window); ceilings do not (blocks repeat across nodes): the cluster's comes
    from the metaserver (:func:`cluster_ceiling`)."""
    up = [s for s in (n["status"] for n in nodes) if s["reachable"]]
    window = next((s["windows"][0]["window"] for s in up if s["windows"]), "")
    first = [s["windows"][0] for s in up if s["windows"] and s["windows"][0]["window"] == window]
    ssd = [s["ssd"] for s in up if s["ssd"]]
    peers = [s["peers"] for s in up if s["peers"] is not None]
    namespaces: dict[str, Namespace] = {}
    for s in up:
        for ns in s["namespaces"]:
            agg = namespaces.setdefault(ns["name"], {"name": ns["name"], "page_bytes": ns["page_bytes"],
                                                     "blocks": 0, "bytes": 0})
            agg["blocks"] += ns["blocks"]
            agg["bytes"] += ns["bytes"]
    return {
        "nodes": len(nodes),
        "reachable": len(up),
        "capacity_bytes": sum(s["pool"]["capacity_bytes"] for s in up),
        "used_bytes": sum(s["pool"]["used_bytes"] for s in up),
        "window": window,
        "requested_blocks": sum(w["requested_blocks"] for w in first),
        "hit_blocks": sum(w["hit_blocks"] for w in first),
        "requests": {t: sum(s["requests"][t] for s in up) for t in OUTCOMES},
        "ssd": _ssd_totals(ssd) if ssd else None,
        "peers": _peer_totals(peers) if peers else None,
        "engines": sum(len(s["engines"]) for s in up),
        "sessions": sum(s["sessions"] for s in up),
        "namespaces": sorted(namespaces.values(), key=lambda n: n["name"]),
    }


def _add_maps(maps: Sequence[dict[str, int]]) -> dict[str, int]:
    """Counts by key, summed over nodes, keys sorted."""
    out: dict[str, int] = {}
    for m in maps:
        for k, v in m.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


def _ssd_totals(ssd: Sequence[Ssd]) -> Ssd:
    return {
        "capacity_bytes": sum(d["capacity_bytes"] for d in ssd),
        "used_bytes": sum(d["used_bytes"] for d in ssd),
        "blocks": sum(d["blocks"] for d in ssd),
        "write_bytes": sum(d["write_bytes"] for d in ssd),
        "read_bytes": sum(d["read_bytes"] for d in ssd),
        "write_bytes_per_second": sum(d["write_bytes_per_second"] for d in ssd),
        "read_bytes_per_second": sum(d["read_bytes_per_second"] for d in ssd),
        "write_queue_blocks": sum(d["write_queue_blocks"] for d in ssd),
        "promoted_blocks": sum(d["promoted_blocks"] for d in ssd),
        "skipped_writes": _add_maps([d["skipped_writes"] for d in ssd]),
    }


def _peer_totals(peers: Sequence[Peers]) -> Peers:
    return {
        "pulls": _add_maps([p["pulls"] for p in peers]),
        "lookups": _add_maps([p["lookups"] for p in peers]),
        "pull_bytes": sum(p["pull_bytes"] for p in peers),
        "served_bytes": sum(p["served_bytes"] for p in peers),
        "active_pins": sum(p["active_pins"] for p in peers),
        "backed_off_peers": sum(p["backed_off_peers"] for p in peers),
    }


# ---- the command ----------------------------------------------------------------------
def _watch_argv(argv: Sequence[str]) -> list[str]:
    """``--watch`` without a value means every DEFAULT_WATCH_SECONDS (the table's options
    all take a value)."""
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--watch" and (i + 1 == len(out) or out[i + 1].startswith("-")):
            out[i] = f"--watch={DEFAULT_WATCH_SECONDS:g}"
    return out


def snapshot(cfg: StatusConfig, sec: Security) -> Snapshot:
    if cfg.metaserver:
        return cluster_status(cfg.metaserver, sec, cfg.timeout)
    return node_status(cfg.addr, sec, cfg.timeout)


def screen(snap: Snapshot, width: int = WIDTH) -> list[str]:
    return cluster_lines(snap, width=width) if "metaserver" in snap else node_lines(snap, width=width)


def _size(out: TextIO) -> tuple[int, int]:
    """Columns (at most 80) and rows of the terminal ``out`` is; 80 x 24 when it is none."""
    if not out.isatty():
        return WIDTH, 24
    cols, rows = shutil.get_terminal_size((WIDTH, 24))
    return max(20, min(WIDTH, cols)), max(5, rows)


def frame(lines: list[str], rows: int, footer: str) -> list[str]:
    """A --watch frame: ``lines`` and ``footer`` in ``rows`` rows (no scrolling: a long list
    is cut, saying how much)."""
    if len(lines) + 1 > rows:
        keep = rows - 2
        lines = [*lines[:keep], f"... {len(lines) - keep} more lines: a taller terminal shows them"]
    return [*lines, footer]


def run(cfg: StatusConfig, sec: Security, out: TextIO = sys.stdout) -> int:
    if cfg.json:
        if cfg.watch:  # one object per refresh, one per line
            while True:
                snap = snapshot(cfg, sec)
                out.write(json.dumps(snap, sort_keys=True) + "\n")
                out.flush()
                time.sleep(cfg.watch)
        snap = snapshot(cfg, sec)
        out.write(json.dumps(snap, indent=2, sort_keys=True) + "\n")
        return 0 if snap["reachable"] else 1
    if not cfg.watch:
        snap = snapshot(cfg, sec)
        out.write("\n".join(screen(snap, _size(out)[0])) + "\n")
        return 0 if snap["reachable"] else 1
    while True:
        snap = snapshot(cfg, sec)
        width, rows = _size(out)
        lines = frame(screen(snap, width), rows, f"every {cfg.watch:g}s, Ctrl-C quits")
        out.write(CLEAR + "\n".join(lines))  # no newline after the last row: the screen never scrolls
        out.flush()
        time.sleep(cfg.watch)


def main(argv: Sequence[str], prog: str = "pegaflow status") -> int:
    cfg: StatusConfig = load(STATUS, prog, _watch_argv(argv), description=DESCRIPTION)
    try:
        sec = Security.load(cfg.auth_token_file, ca=cfg.tls_ca)
    except SecurityError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        return 2
    try:
        return run(cfg, sec)
    except KeyboardInterrupt:  # --watch ends here: a clean exit, the last frame stays
        sys.stdout.write("\n")
        return 0
