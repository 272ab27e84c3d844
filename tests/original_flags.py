"""Every flag of the Rust original's two daemons, transcribed once, with values valid here.

Source: novitalabs/pegaflow v0.23.12, ``pegaflow-server/src/lib.rs`` (``struct Cli``, 30 flags)
and ``pegaflow-metaserver/src/lib.rs`` (``struct Cli``, 6 flags), in their order; and the
0.25.1 release's ``pegaflow-server-py --help`` (34 flags: 0.23.12's, then four of the decode
backup) and ``pegaflow-metaserver-py --help`` (9: 0.23.12's, then three; its ``--ttl-minutes``
now counts minutes without node activity, not block age). A flag with
``()`` is a clap switch (a ``bool`` field: ``ArgAction::SetTrue``, so it takes no value, even
``--enable-prometheus`` whose default is true). The values are what a test host can give:
``{name}`` fields are filled by :func:`argv` (ports, the SSD directory). Flags that have no
effect here are set away from their defaults, so the daemons log them.

``tests/unit/test_options.py`` checks that the parser accepts each of them (both releases);
``tests/integration/test_original_flags.py`` starts both daemons with 0.25.1's complete lists
(which hold 0.23.12's).
"""

from __future__ import annotations

ORIGINAL_SERVER_FLAGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("--addr", ("127.0.0.1:{node_port}",)),
    ("--devices", ("0",)),
    ("--pool-size", ("64mb",)),
    ("--hint-value-size", ("256kb",)),
    ("--use-hugepages", ()),
    ("--enable-lfu-admission", ()),
    ("--disable-numa-affinity", ()),
    ("--http-addr", ("127.0.0.1:{node_http_port}",)),
    ("--enable-prometheus", ()),
    ("--metrics-otel-endpoint", ("http://127.0.0.1:{otel_port}",)),
    ("--metrics-period-secs", ("1",)),
    ("--log-level", ("info",)),
    ("--ssd-cache-path", ("{ssd}",)),
    ("--ssd-cache-capacity", ("64mb",)),
    ("--ssd-cache-shards", ("2",)),
    ("--ssd-write-queue-depth", ("4",)),
    ("--ssd-prefetch-queue-depth", ("4",)),
    ("--ssd-write-inflight", ("4",)),
    ("--ssd-prefetch-inflight", ("8",)),
    ("--max-prefetch-blocks", ("100",)),
    ("--trace-sample-rate", ("0.5",)),
    ("--pool-shards", ("2",)),
    ("--blockwise-alloc", ()),
    ("--nics", ("mlx5_0", "mlx5_1")),
    ("--qps-per-peer", ("4",)),
    ("--metaserver-addr", ("http://127.0.0.1:{meta_port}",)),
    ("--metaserver-queue-depth", ("1024",)),
    ("--metric-hll-windows", ("15m,1h,1d",)),
    ("--metric-hll-bucket-bits", ("14",)),
    ("--transfer-lock-timeout-secs", ("120",)),
)

ORIGINAL_SERVER_FLAGS_0251: tuple[tuple[str, tuple[str, ...]], ...] = (
    *ORIGINAL_SERVER_FLAGS,
    ("--backup-reclaimable-percent", ("20",)),
    ("--backup-max-candidates", ("4096",)),
    ("--backup-pull-max-bytes", ("64mb",)),
    ("--backup-max-bandwidth", ("1gb",)),
)

ORIGINAL_METASERVER_FLAGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("--addr", ("127.0.0.1:{meta_port}",)),
    ("--http-addr", ("127.0.0.1:{meta_http_port}",)),
    ("--log-level", ("info",)),
    ("--node-stale-secs", ("20",)),
    ("--ttl-minutes", ("60",)),
    ("--sweep-interval-secs", ("600",)),
)

ORIGINAL_METASERVER_FLAGS_0251: tuple[tuple[str, tuple[str, ...]], ...] = (
    *ORIGINAL_METASERVER_FLAGS,
    ("--min-reclaimable-owner-count", ("2",)),
    ("--enable-decode-backup", ()),
    ("--backup-target-delay-secs", ("60",)),
)

# Placeholder values for a parse-only check (no daemon starts).
PARSE_ONLY = {"node_port": "50055", "node_http_port": "9091", "otel_port": "4318", "ssd": "/mnt/nvme0",
              "meta_port": "50056", "meta_http_port": "9092"}


def argv(flags: tuple[tuple[str, tuple[str, ...]], ...], skip: tuple[str, ...] = (), **values: str) -> list[str]:
    """The command line of ``flags`` (each once, in order) with the ``{name}`` fields filled."""
    out: list[str] = []
    for flag, args in flags:
        if flag not in skip:
            out += [flag, *(a.format(**values) for a in args)]
    return out


# Every default 0.25.1's --help shows ([default: ...]), in its syntax: (command, flag) -> text.
ORIGINAL_DEFAULTS: dict[tuple[str, str], str] = {
    **{("node", f): d for f, d in (
        ("--addr", "127.0.0.1:50055"), ("--pool-size", "30gb"), ("--http-addr", "0.0.0.0:9091"),
        ("--metrics-period-secs", "10"), ("--log-level", "info"), ("--ssd-cache-capacity", "512gb"),
        ("--ssd-cache-shards", "1"), ("--ssd-write-queue-depth", "8"), ("--ssd-prefetch-queue-depth", "2"),
        ("--ssd-write-inflight", "2"), ("--ssd-prefetch-inflight", "16"), ("--max-prefetch-blocks", "800"),
        ("--trace-sample-rate", "1"), ("--pool-shards", "1"), ("--qps-per-peer", "2"),
        ("--metaserver-queue-depth", "4096"), ("--metric-hll-windows", "15m,1h,1d"),
        ("--metric-hll-bucket-bits", "16"), ("--transfer-lock-timeout-secs", "120"),
        ("--backup-reclaimable-percent", "10"), ("--backup-max-candidates", "16384"),
        ("--backup-pull-max-bytes", "256mb"), ("--backup-max-bandwidth", "2gb"))},
    **{("meta", f): d for f, d in (
        ("--addr", "127.0.0.1:50056"), ("--http-addr", "0.0.0.0:9092"), ("--log-level", "info"),
        ("--node-stale-secs", "30"), ("--ttl-minutes", "120"), ("--sweep-interval-secs", "600"),
        ("--min-reclaimable-owner-count", "3"), ("--backup-target-delay-secs", "180"))},
}
