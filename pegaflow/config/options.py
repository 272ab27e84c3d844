"""The one option table.

Every option of every PegaFlow command is defined exactly once, here. The table produces
the command-line flags (``--pool-size``), the environment variables (``PEGAFLOW_POOL_SIZE``)
and the reference page ``docs/options.md`` (``python -m pegaflow.config.options``; a unit
test fails when the page is stale). Precedence: flag > environment > default.

A command may have subcommands (``pegaflow cache inspect``; ``SUBCOMMANDS``): a row names the
ones that take it (``Option.subcommands``), and may be required or one of a group of which
exactly one must be given (``Option.required``, ``Option.one_of``), checked after the
environment applies (so an empty value is not given here either). A row with
``env_var=NO_ENV`` is a flag only.

Every value goes through the option's parser, whatever its source (a default written as
text too). An empty value, a flag's (``--redis-url=``) or a variable's
(``PEGAFLOW_REDIS_URL=``), counts as not given, for every option: the next source applies.
So an empty variable left by a template never turns into an empty address deep in a daemon.

Later features add their rows to ``OPTIONS``; nothing else parses options.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, NoReturn, cast

from pegaflow.config.capacity import parse_capacity, parse_route, parse_sweep
from pegaflow.core.durations import parse_windows
from pegaflow.core.hosts import META_ADDR, NODE_ADDR, split_host_port
from pegaflow.core.units import parse_size
from pegaflow.policy.quota import parse_quota
from pegaflow.policy.routing import DEFAULT_LOAD_BOUND, DEFAULT_LOAD_WINDOW_S

# Final: each name is its literal, so load() is typed per command.
NODE: Final = "node"
META: Final = "meta"
REPLAY: Final = "replay"
ROUTER: Final = "router"
STATUS: Final = "status"
CACHE: Final = "cache"

# A command's subcommands, each with the line its --help and docs/options.md show. The one
# chosen is the config's ``subcommand`` field.
SUBCOMMANDS: Final[dict[str, tuple[tuple[str, str], ...]]] = {
    CACHE: (
        ("inspect", "where each block of a prompt is: L1, SSD, which nodes"),
        ("clear", "drop a namespace's, an instance's or every block (DRAM and SSD)"),
        ("pin", "keep a prefix resident (within --max-pinned-share)"),
        ("unpin", "drop a pin (its blocks become evictable)"),
        ("pins", "list the pins"),
    ),
}
SUBCOMMAND: Final = "subcommand"
NO_ENV: Final = ""  # Option.env_var of a flag that no environment variable sets

DEFAULT_META_REDIS = "redis://127.0.0.1:6379/0"


def _host_port(text: str) -> str:
    host, _port = split_host_port(text)
    if not host:
        raise ValueError(f"invalid address {text!r} (expected HOST:PORT)")
    return text


def _optional_host_port(text: str) -> str:
    return "" if text in ("", "off", "none") else _host_port(text)


def _grpc_target(text: str) -> str:
    """``HOST:PORT``, also written as the original's URL form ``http://HOST:PORT`` (the scheme
    is dropped: these are plaintext gRPC channels); empty or 'off': none."""
    for scheme in ("http://", "grpc://"):
        if text.lower().startswith(scheme):
            text = text[len(scheme):].rstrip("/")
            break
    else:
        if "://" in text:
            raise ValueError(f"invalid address {text!r} (expected HOST:PORT or http://HOST:PORT)")
    return _optional_host_port(text)


def _node_target(text: str) -> str:
    """``_grpc_target`` where a node must be named: 'off' is no address to show."""
    target = _grpc_target(text)
    if not target:
        raise ValueError(f"invalid address {text!r} (expected HOST:PORT or http://HOST:PORT)")
    return target


@dataclass(frozen=True)
class Bounded:
    """The parser of a number with a range: every bounded option's, so each says the same
    thing when refused (``must be in [0, 1], got 2.0``, after the flag's or variable's name).
    ``lo``/``hi`` are inclusive unless ``lo_open``; ``None``: unbounded on that side."""

    kind: type[int] | type[float]
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    # The original's words for an option it has (``sample rate must be between 0.0 and 1.0``),
    # so an operator sees the same line from both builds; {range} and {v} are filled in.
    says: str = "must be {range}, got {v}"

    def __call__(self, text: str | int | float) -> int | float:
        v = self.kind(text.strip() if isinstance(text, str) else text)
        if isinstance(v, float) and not math.isfinite(v):  # nan compares false with everything; inf passes an open side
            if self.lo is not None and self.hi is not None:
                raise ValueError(self.says.format(range=self.range, v=v))
            raise ValueError(f"must be a finite number {self.range}, got {v}")
        below = self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo)
        if below or (self.hi is not None and v > self.hi):
            raise ValueError(self.says.format(range=self.range, v=v))
        return v

    @property
    def range(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"in [{self.lo:g}, {self.hi:g}]"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"<= {self.hi:g}"

    def refusal(self, v: object) -> str:
        """The message a value outside the range gets."""
        return self.says.format(range=self.range, v=v)

    def outside(self) -> str:
        """A value just outside the range (tests)."""
        if self.hi is not None:
            return str(self.kind(self.hi + 1))
        assert self.lo is not None
        return str(self.kind(self.lo if self.lo_open else self.lo - 1))


_positive_int = Bounded(int, lo=0, lo_open=True)
_non_negative_int = Bounded(int, lo=0)
_device_id = Bounded(int, lo=0)  # a CUDA device ordinal (the original's ``--devices 0,1``)
_port = Bounded(int, lo=1, hi=65535)
_hll_bucket_bits = Bounded(int, lo=4, hi=18, says="HLL bucket_bits must be in 4..=18, got {v}")  # the original's
_positive_float = Bounded(float, lo=0, lo_open=True)
_non_negative_float = Bounded(float, lo=0)
_ttl_seconds = Bounded(float, lo=0.001)  # a Redis expiry: at least 1 ms (PX 0 is refused)
_fraction = Bounded(float, lo=0, hi=1)  # a share, a rate, a cost relative to computing
_sample_rate = Bounded(float, lo=0, hi=1, says="sample rate must be between 0.0 and 1.0, got {v}")  # the original's


_percent = Bounded(int, lo=0, hi=100, says="{v} is not in 0..=100")  # the original's words
_backup_candidates = Bounded(int, lo=1, hi=65536, says="must be in 1..=65536, got {v}")  # the original's
_owner_count = Bounded(int, lo=2, says="must be at least 2, got {v}")  # the original: "must be at least 2"


def _page_align(text: str | int) -> int:
    """A page alignment: a power of two (the pool's allocator carves pages at multiples of it)."""
    v = int(_positive_int(text))
    if v & (v - 1):
        raise ValueError(f"must be a power of two, got {v}")
    return v


def _positive_size(text: str) -> int:
    """A size (kb/mb/gb/tb) greater than zero (the original's words when it is not)."""
    v = parse_size(text)
    if v <= 0:
        raise ValueError("must be greater than 0")
    return v


def _name(text: str) -> str:
    if not text.strip():
        raise ValueError("empty name")
    return text.strip()


def _node_id(text: str) -> str:
    """A node's name: no braces (it is the Redis Cluster hash tag of the node's keys,
    ``pf:ev:{<node>}``: pegaflow/cluster/keys.py)."""
    if "{" in text or "}" in text:
        raise ValueError(f"{text!r} may not contain braces (the node's Redis keys use it as a hash tag)")
    return text


def _optional_size(text: str) -> int:
    """A size (as ``--pool-size``) that must be > 0 when given; 0 is 'not set'."""
    if text.strip() in ("0", "none", "off"):
        return 0
    v = parse_size(text)
    if v <= 0:
        raise ValueError("must be greater than zero when set")
    return v


def _http_url(text: str) -> str:
    """``http://HOST:PORT`` (a trailing slash dropped); ``HOST:PORT`` means http."""
    t = text.strip().rstrip("/")
    if "://" not in t:
        t = "http://" + t
    scheme, _, rest = t.partition("://")
    if scheme not in ("http", "https") or not rest or "/" in rest:
        raise ValueError(f"{text!r} is not http://HOST:PORT")
    if ":" in rest:
        _host_port(rest)
    return t


def _bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"invalid boolean {text!r}")


def _local_socket(text: str) -> str:
    if text in ("", "off", "none"):
        return ""
    if text != "auto" and len(os.fsencode(text)) > 107:  # sun_path holds 108 bytes with the NUL
        raise ValueError(f"socket path {text!r} is longer than 107 bytes")
    return text


def _group(text: str) -> str:
    """An existing group's name (``--access-group``); empty: none."""
    import grp

    if text and not text.isdigit():
        try:
            grp.getgrnam(text)
        except KeyError:
            raise ValueError(f"no such group {text!r}") from None
    elif text:
        try:
            grp.getgrgid(int(text))
        except (KeyError, OverflowError):  # OverflowError: past a gid_t
            raise ValueError(f"no such group id {text}") from None
    return text


def _redis_url(text: str) -> str:
    from pegaflow.config.redis_url import check_seed

    return check_seed(text) if text else text


# How --redis-url's seeds are used (pegaflow/cluster/redis_conn.py connects through them).
SEEDS_HELP = ("standalone, the first that answers serves (a connection that breaks tries them "
              "again from the first); with --redis-cluster, the first that answers tells the client "
              "every shard. Seeds share their scheme, credentials and db; each failure to reach any "
              "of them is one line naming them.")


def _redis_seeds(urls: list[object]) -> list[object]:
    """Several ``--redis-url`` seeds: each once, all ``redis://`` or all ``rediss://``, differing
    only in ``HOST:PORT`` (a client holds one set of credentials, one db)."""
    from urllib.parse import urlsplit

    seeds = list(dict.fromkeys(cast("list[str]", urls)))
    if len(seeds) < 2:
        return list(seeds)
    parts = [urlsplit(u) for u in seeds]
    if parts[0].scheme not in ("redis", "rediss"):
        raise ValueError(f"several seeds must be redis:// or rediss:// URLs, got {seeds[0]!r}")
    for u, p in zip(seeds, parts, strict=True):
        if not p.hostname:
            raise ValueError(f"seed {u!r} names no host")
        same = (p.scheme, p.username, p.password, p.path.rstrip("/") or "/0", p.query)
        if same != (parts[0].scheme, parts[0].username, parts[0].password, parts[0].path.rstrip("/") or "/0",
                    parts[0].query):
            raise ValueError(f"seed {u!r} differs from {seeds[0]!r} in more than HOST:PORT (scheme, "
                             "credentials, db and options are shared)")
    return list(seeds)


# --log-level's words, most verbose first, to the level each means here (the original's
# 'trace' is our debug: there is nothing below it).
_LEVELS: Final[dict[str, str]] = {"trace": "debug", "debug": "debug", "info": "info", "warn": "warning",
                                  "warning": "warning", "error": "error", "off": "off"}
_VERBOSITY: Final[tuple[str, ...]] = ("debug", "info", "warning", "error", "off")
RUST_LOG: Final = "RUST_LOG"  # the original's variable: it overrides --log-level (_rust_log)


def _log_level(text: str) -> str:
    """A level, or the original's tracing ``EnvFilter`` directives (``warn,pegaflow_server=debug``):
    a bare level is the level; ``TARGET=LEVEL`` counts where TARGET names PegaFlow
    (``pegaflow...``, the original's crates; every line here is PegaFlow's), the most verbose
    of them and the bare level winning; other targets (the original's dependencies) are
    ignored, and with neither a bare level nor a PegaFlow target nothing is logged, as there.
    A bare word that is no level, or a directive whose level is none, is refused: the
    original reads the first as a target (and logs nothing) and replaces the second by info."""
    found: list[str] = []
    directives = [d.strip() for d in text.split(",") if d.strip()]
    for directive in directives:
        target, eq, word = directive.rpartition("=")
        level = _LEVELS.get(word.strip().lower())
        if level is None or (eq and not target.strip()):
            raise ValueError(f"invalid log level {directive!r} (choose from off, error, warn, info, debug, "
                             "trace, or TARGET=LEVEL directives)")
        if not eq:
            found.append(level)
        elif target.strip().lower().startswith("pegaflow"):
            found.append(level)
    if not found:
        return "off" if directives else "info"
    return min(found, key=_VERBOSITY.index)


def _rust_log(ns: argparse.Namespace, command: str, env: Mapping[str, str]) -> None:
    """``RUST_LOG``, when set, overrides ``--log-level`` (and ``PEGAFLOW_LOG_LEVEL``) of the
    original's two daemons, as it does theirs; one that does not parse is ignored there, and here."""
    raw = env.get(RUST_LOG, "")
    if command not in (NODE, META) or _blank(raw):
        return
    try:
        ns.log_level = _log_level(raw)
    except ValueError:
        pass


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in choices:
            raise ValueError(f"invalid choice {text!r} (choose from {', '.join(choices)})")
        return text.lower()

    parse.__name__ = "one of " + "|".join(choices)
    return parse


@dataclass(frozen=True)
class Option:
    """One option: its flag, env variable, parser, default, help, and the commands that take it."""

    name: str  # flag name without dashes, e.g. "pool-size"
    # Values are of each option's own type (int, str, a list, a Capacity): object here, and
    # typed where they are read, by the fields of the config classes (config/commands.py).
    default: object  # a value, or its text (parsed by ``parse``); a list or tuple for ``repeatable``
    help: str
    parse: Callable[[str], object] = str
    commands: tuple[str, ...] = (NODE,)
    flag: bool = False  # a switch: ``--use-hugepages`` sets True
    # A list: the flag takes one or more values and may be repeated (``--nics a b --nics c``);
    # with ``commas`` each value may also be a comma-separated list (``--nics a,b``).
    repeatable: bool = False
    commas: bool = False
    metavar: str | None = None
    aliases: tuple[str, ...] = field(default=())
    positional: bool = False  # an argument, not a flag (``pegaflow replay TRACE``); required
    env_var: str | None = None  # the variable's name when not PEGAFLOW_<FLAG> (a name taken elsewhere); NO_ENV: none
    # Accepted for the original's command lines, but it changes nothing on this build or host:
    # the reason is logged once at start when the option is given (see ``no_effect``).
    no_effect: str = ""
    subcommands: tuple[str, ...] = ()  # of a command with subcommands: those that take it (empty: all)
    short: str = ""  # a one-letter flag beside the long one (``-n``)
    required: bool = False
    one_of: str = ""  # a group's name: exactly one option of the group must be given
    # Of a list option: checks (and may normalise) the parsed list as a whole, raising
    # ValueError (``--redis-url``'s seeds must agree with each other).
    whole: Callable[[list[object]], list[object]] | None = None

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        """The option's variable ('' for a flag only)."""
        return _env_name(self.name) if self.env_var is None else self.env_var

    @property
    def envs(self) -> tuple[str, ...]:
        """The environment variables read, in order: the option's, then its aliases'. None for a
        positional argument: argparse wants it on the command line, before any variable applies."""
        if self.env_var == NO_ENV or self.positional:
            return ()
        return (self.env, *(_env_name(a) for a in self.aliases))

    @property
    def flags(self) -> tuple[str, ...]:
        """Its names on the command line: the flag, its aliases, its one-letter form."""
        return (f"--{self.name}", *(f"--{a}" for a in self.aliases), *((f"-{self.short}",) if self.short else ()))

    def parse_list(self, values: Sequence[str]) -> list[object]:
        """Parse the values of a list option (empty items of a comma list are dropped; a flag
        given with no value at all is an error)."""
        split = [p for v in values for p in (v.split(",") if self.commas else [v]) if p]
        if values and not split:
            raise ValueError("expected at least one value")
        parsed = [self.parse(p) for p in split]
        return self.whole(parsed) if self.whole is not None else parsed


def _env_name(flag: str) -> str:
    return "PEGAFLOW_" + flag.replace("-", "_").upper()


OPTIONS: list[Option] = [
    # --- node: core -------------------------------------------------------------------
    Option("addr", NODE_ADDR, "gRPC listen address (HOST:PORT) for engines.", _host_port),
    Option("pool-size", "30gb", "Size of the shared-memory L1 pool (kb/mb/gb/tb).", parse_size),
    Option(
        "use-hugepages",
        False,
        "Back the pool with huge pages (MFD_HUGETLB); needs vm.nr_hugepages reserved.",
        _bool,
        flag=True,
    ),
    Option(
        "devices",
        [],
        "CUDA devices the original initialises (--devices 0,1 or the flag repeated; unset: all); "
        "accepted for compatibility, no effect here: the node holds no GPU memory.",
        _device_id,
        repeatable=True,
        commas=True,
        metavar="ID",
        no_effect="the node never touches GPU memory: the engines' connectors copy KV pages "
        "(docs/architecture.md), so it creates no CUDA context",
    ),
    Option(
        "hint-value-size",
        0,
        "Typical size of one block's page (kb/mb/gb/tb; 0: no hint): sizes the TinyLFU admission "
        "sketch (--enable-lfu-admission) in blocks of this size instead of a 128 KiB guess.",
        _optional_size,
        metavar="SIZE",
    ),
    Option(
        "disable-numa-affinity",
        False,
        "Turn off NUMA placement of the pool. By default the pool is split into one part per NUMA "
        "node with memory that the node may use (Mems_allowed_list), each bound to its node (mbind "
        "MPOL_BIND, before the pre-fault; one node: the whole pool bound to it; a node without the "
        "free memory or huge pages for its part refuses the pool at start); an engine's pages come "
        "from its own node's part, then the "
        "nearest, when its node is known (pegaflow/node/numa.py). Off: one part, the kernel's "
        "default policy.",
        _bool,
        flag=True,
    ),
    Option(
        "pool-shards",
        1,
        "Sub-pools of the original's pinned pool, against allocator lock contention (accepted for "
        "compatibility; no effect here: one event loop allocates, so there is no lock to split, "
        "and shards would only fragment the pool; NUMA parts split it per node instead).",
        _positive_int,
        no_effect="the allocator runs on the node's event loop, one caller at a time: there is no "
        "lock to split, so shards would only fragment the pool",
    ),
    Option(
        "blockwise-alloc",
        False,
        "Allocate each block separately (accepted for compatibility; no effect: every block is "
        "already its own extent of the pool, freed and coalesced on its own).",
        _bool,
        flag=True,
        no_effect="every block is already its own extent of the pool (core/allocator.py)",
    ),
    Option(
        "http-addr",
        "127.0.0.1:9091",
        "HTTP address for Prometheus /metrics and /health ('off' disables).",
        _optional_host_port,
    ),
    Option(
        "http-addr",
        "127.0.0.1:9092",
        "HTTP address for Prometheus /metrics and /health ('off' disables): the original's port 9092, not the "
        "node's 9091, so both run on one host; loopback like the node's (0.0.0.0:9092 to serve others).",
        _optional_host_port,
        commands=(META,),
    ),
    Option(
        "log-level",
        "info",
        "Log level: off, error, warn, info, debug or trace (trace means debug here), or the "
        "original's TARGET=LEVEL directives (warn,pegaflow_server=debug: its pegaflow* targets count, "
        "others are ignored; a bare word that is no level is refused, where the original would log nothing). "
        "On pegaflow-node and pegaflow-meta, RUST_LOG overrides it, as on the original.",
        _log_level,
        commands=(NODE, META, REPLAY, ROUTER),
    ),
    Option(
        "log-format",
        "console",
        "Log format: 'json' for machines, 'console' for people.",
        _choice("json", "console"),
        commands=(NODE, META, REPLAY, ROUTER),
    ),
    Option(
        "reservation-ttl",
        120.0,
        "Seconds after which an uncommitted reservation is reported as late (metric "
        "pegaflow_node_expired_total, a log line). Its pages are never taken from a live engine; "
        "a dead engine's reservations are freed at once when its session drops.",
        _non_negative_float,
    ),
    Option(
        "lease-ttl",
        300.0,
        "Seconds after which an unreleased lease is reported as late (metric, log line); its pages "
        "stay pinned until Release or the engine's session ends.",
        _non_negative_float,
    ),
    Option(
        "max-batch",
        16384,
        "Largest number of block hashes accepted in one request.",
        _positive_int,
    ),
    Option(
        "max-namespaces",
        4096,
        "Most namespaces (model x layout x TP shard) the node keeps; a Register that would create "
        "more answers RESOURCE_EXHAUSTED. Other bounds: names and req_id at most 512 bytes, a "
        "Query's namespaces only the session's own, once each; a session that opens no Session "
        "stream within 30 s is ended.",
        _positive_int,
    ),
    Option(
        "max-pinned-share",
        0.25,
        "Largest share of the pool (0.0-1.0) that operators' pins (`pegaflow cache pin`) may ask "
        "for together; a pin past it answers RESOURCE_EXHAUSTED. Pinned blocks are never evicted.",
        _fraction,
    ),
    Option(
        "local-socket",
        "auto",
        "Unix socket (mode 0600, 0660 with --access-group) of the local fast path for "
        "Query/Reserve/Commit/Release/Reset, announced to engines at Register; 'auto': $XDG_RUNTIME_DIR "
        "(else /tmp)/pegaflow-node-HOST-PORT.sock from --addr; 'off': gRPC only.",
        _local_socket,
        metavar="PATH",
    ),
    Option(
        "query-trace",
        "",
        "Append every answered Query to this JSONL file for `pegaflow replay` (docs/replay.md).",
        str,
    ),
    Option(
        "trace-sample-rate",
        1.0,
        "Fraction (0.0-1.0) of answered Queries written to --query-trace (0.01: 1%).",
        _sample_rate,
    ),
    Option(
        "page-align",
        4096,
        "Alignment in bytes of every page in the pool, a power of two (O_DIRECT needs 4096).",
        _page_align,
    ),
    # --- node: SSD tier (pegaflow/node/tiers/ssd/, docs/ssd.md) ---------------------------------
    Option(
        "ssd-cache-path",
        [],
        "SSD cache file, or directory to hold one (existing, or ending in /; missing directories are "
        "created); several (after one flag or the flag repeated) stripe pages across disks. Unset: no SSD tier.",
        repeatable=True,
        metavar="PATH",
    ),
    Option(
        "ssd-cache-capacity",
        "512gb",
        "Total size of the SSD tier, split evenly across the paths and allocated at start-up.",
        parse_size,
    ),
    Option("ssd-queue-depth", 32, "SSD I/Os in flight at most (io_uring queue depth).", _positive_int),
    Option(
        "ssd-write-queue-size",
        "256mb",
        "Bytes of L1 pages that may wait for their SSD write; beyond it writes are skipped, never waited for.",
        parse_size,
    ),
    Option(
        "ssd-io-engine",
        "auto",
        "SSD I/O engine: io_uring via liburing, a thread pool of preadv/pwritev, or auto (io_uring if usable).",
        _choice("auto", "uring", "threads"),
    ),
    Option(
        "ssd-cache-shards",
        1,
        "Cache files per --ssd-cache-path (NAME.0, NAME.1, ...; 1: NAME itself), for parallel "
        "filesystems such as GPFS; --ssd-cache-capacity is split evenly across all of them.",
        _positive_int,
    ),
    Option(
        "ssd-write-queue-depth",
        8,
        "SSD write batches (the blocks of one commit) that may wait for a write slot "
        "(--ssd-write-inflight); a batch beyond it is not written to SSD (counted as "
        "skipped{reason=queue_full}), never waited for. --ssd-write-queue-size also bounds them in bytes.",
        _positive_int,
    ),
    Option(
        "ssd-prefetch-queue-depth",
        2,
        "SSD prefetch batches (the SSD blocks one Query promotes) that may wait for a read slot "
        "(--ssd-prefetch-inflight); beyond it a Query promotes nothing new and answers with what is "
        "already on its way (pegaflow_node_ssd_prefetch_dropped_blocks_total).",
        _positive_int,
    ),
    Option(
        "ssd-write-inflight",
        2,
        "SSD write I/Os in flight at most (one writev of adjacent blocks, up to 4 MiB); "
        "--ssd-queue-depth bounds reads and writes together.",
        _positive_int,
    ),
    Option(
        "ssd-prefetch-inflight",
        16,
        "SSD read I/Os (promotions) in flight at most (one readv of adjacent blocks, up to 4 MiB); "
        "--ssd-queue-depth bounds reads and writes together.",
        _positive_int,
    ),
    Option(
        "max-prefetch-blocks",
        800,
        "Blocks being read back from SSD at most (back-pressure): a Query finding more on SSD "
        "promotes only up to this and answers with what is on its way.",
        _positive_int,
    ),
    # --- global index: node publisher and pegaflow-meta (issue 5) --------------------------
    Option(
        "addr",
        META_ADDR,
        "gRPC listen address (HOST:PORT) of the metaserver; 0.0.0.0:50056 to serve other hosts.",
        _host_port,
        commands=(META,),
    ),
    Option(
        "redis-url",
        [],
        "Redis for the global index, e.g. redis://127.0.0.1:6379/0 (empty: single-host mode, or the "
        "metaserver's Redis when --metaserver-addr is set). Several seeds, comma-separated or the "
        "flag repeated, are tried in order whenever the node connects: " + SEEDS_HELP,
        _redis_url,
        repeatable=True,
        commas=True,
        metavar="URL",
        whole=_redis_seeds,
    ),
    Option(
        "redis-url",
        [DEFAULT_META_REDIS],
        "Redis (or a Redis Cluster) holding the global index; infra/redis/ starts one. Several "
        "seeds, comma-separated or the flag repeated, are tried in order whenever the metaserver "
        "connects: " + SEEDS_HELP,
        _redis_url,
        commands=(META,),
        repeatable=True,
        commas=True,
        metavar="URL",
        whole=_redis_seeds,
    ),
    Option(
        "redis-cluster",
        False,
        "Treat --redis-url as the seeds of a Redis Cluster: the first that answers tells the "
        "client every shard.",
        _bool,
        commands=(NODE, META),
        flag=True,
    ),
    Option("node-id", "", "Name of this node in the global index (default: the hostname); no braces.", _node_id),
    Option(
        "advertise-addr",
        "",
        "Address (HOST:PORT) peers use to reach this node, published in the index (default: --addr).",
        _optional_host_port,
    ),
    Option(
        "metaserver-addr",
        "",
        "Metaserver gRPC address, HOST:PORT or http://HOST:PORT (empty: none). The node pulls what "
        "it misses from the peers the metaserver names, and, without --redis-url, publishes its "
        "blocks to the Redis the metaserver uses.",
        _grpc_target,
        aliases=("meta-addr",),
        metavar="ADDR",
    ),
    # --- node: remote reads between nodes (pegaflow/node/tiers/remote/, issue 6) -------------
    Option(
        "transfer-addr",
        "",
        "TCP data port (HOST:PORT) peers pull pages from (default: --addr's host, any free port; "
        "the port is returned with each pin).",
        _optional_host_port,
    ),
    Option(
        "nics",
        [],
        "RDMA devices to pull and serve pages over with one-sided READ: --nics mlx5_0 mlx5_1, "
        "--nics mlx5_0,mlx5_1 or the flag repeated. Unset: the TCP data plane.",
        _name,
        repeatable=True,
        commas=True,
        metavar="DEVICE",
    ),
    Option(
        "qps-per-peer",
        2,
        "RC queue pairs per (local NIC, remote NIC) pair of an RDMA pull (--nics with "
        "--metaserver-addr): a pull's pages are dealt over them, each with up to 64 READs in "
        "flight. No effect on TCP pulls (logged once at start when set there).",
        _positive_int,
    ),
    Option(
        "pin-ttl",
        30.0,
        "Seconds a peer's pin holds pages at most for a puller (expires even if the puller dies).",
        _positive_float,
        aliases=("transfer-lock-timeout-secs",),  # the original's name
    ),
    Option(
        "peer-backoff",
        5.0,
        "Seconds a peer that failed or answered wrongly is skipped (doubles while it keeps failing).",
        _positive_float,
    ),
    Option(
        "liveness-ttl",
        10.0,
        "Seconds after its last heartbeat that a node disappears from global lookups.",
        _ttl_seconds,
    ),
    Option(
        "event-buffer",
        1_000_000,
        "Block updates the node buffers for Redis; beyond it updates drop and a snapshot re-syncs.",
        _positive_int,
    ),
    Option(
        "metaserver-queue-depth",
        4096,
        "The original's pending metaserver insert/remove commands (accepted for compatibility; "
        "no effect: --event-buffer bounds the updates buffered for the index).",
        _positive_int,
        no_effect="block updates go to Redis Streams, buffered up to --event-buffer",
    ),
    # --- node: decode backup (the original's 0.25 flags; docs/architecture.md "Decode backup") ---
    Option(
        "backup-reclaimable-percent",
        10,
        "Decode backup: share of the RAM cache, in percent, kept as reclaimable (backed-up) blocks. "
        "Once the cache is full, this node offers its oldest retained blocks for backup until the "
        "reclaimable class reaches it (the original's).",
        _percent,
        commands=(NODE, REPLAY),  # replay: the busy nodes' (docs/replay.md)
        metavar="PERCENT",
    ),
    Option(
        "backup-max-candidates",
        16384,
        "Decode backup: most candidate blocks one report (every second) offers. Bounds the offer's "
        "size in Redis (16 bytes per hash: 1 MiB at the 65536 maximum) and what the planning "
        "metaserver reads per busy node (the original's).",
        _backup_candidates,
    ),
    Option(
        "backup-pull-max-bytes",
        "256mb",
        "Decode backup: most bytes one pulled plan copies on a backup target (e.g. 256mb). Smaller "
        "plans hold the NICs for shorter bursts, leaving room for KV transfers between them (the original's).",
        _positive_size,
        metavar="SIZE",
    ),
    Option(
        "backup-max-bandwidth",
        "2gb",
        "Decode backup: copy bandwidth limit per second on a backup target (e.g. 2gb); 0 is "
        "unlimited. Backup traffic shares the target's NICs with KV transfers, so unlimited pulls "
        "add latency to them (the original's).",
        parse_size,
        metavar="SIZE",
    ),
    Option(
        "consumer-name",
        "",
        "Name of this metaserver replica in the consumer group (default: HOST-PID-RANDOM; give "
        "each replica its own).",
        str,
        commands=(META,),
    ),
    Option(
        "stream-lease-ttl",
        10.0,
        "Seconds before a dead replica's node streams are taken over by another replica.",
        _ttl_seconds,
        commands=(META,),
    ),
    Option(
        "sweep-interval",
        30.0,
        "Seconds between lifecycle sweeps, which remove the nodes silent for --ttl-minutes and "
        "the entries of restarted nodes' old incarnations (0: never). The original sweeps every "
        "600 s; a pass here costs nothing while no node died or restarted.",
        _non_negative_float,
        commands=(META,),
        aliases=("sweep-interval-secs",),  # the original's name
    ),
    Option(
        "index-census-interval",
        60.0,
        "Seconds between counts of the whole index (block keys, holders, live holders per key) "
        "in the background, served as pegaflow_meta_index_* and the original's store_entries, "
        "block_owners and block_redundancy gauges (0: never; each count SCANs every bucket, paced to a "
        "fifth of its thread's time).",
        _non_negative_float,
        commands=(META,),
    ),
    Option(
        "node-stale-secs",
        30,
        "Seconds without a heartbeat after which a node is hidden from lookups and from ListNodes' "
        "alive nodes (the original's stale filtering; Redis's clock). A node's own --liveness-ttl "
        "hides it too when shorter; neither removes anything (--ttl-minutes does). Nodes heartbeat every third "
        "of their --liveness-ttl, so keep this above that (the metaserver warns otherwise). 0: off (only the "
        "--liveness-ttl hides a node).",
        _non_negative_int,
        commands=(META,),
        metavar="SECONDS",
    ),
    Option(
        "ttl-minutes",
        120,
        "Minutes without node activity before lifecycle cleanup (not block age): a node that sent "
        "nothing for this long (no heartbeat, no event in its stream; Redis's clock) is removed, "
        "its entries swept from the index and its stream deleted. Until then a node that went "
        "silent is only hidden (--node-stale-secs, its --liveness-ttl), and it comes back with its "
        "entries when it heartbeats again. Fractions are accepted (0.5: 30 s); must cover "
        "--node-stale-secs.",
        _positive_float,
        commands=(META,),
    ),
    Option(
        "min-reclaimable-owner-count",
        3,
        "Minimum number of live owners before a newly registered block is marked reclaimable (the "
        "original's; at least 2): its holders (nodes with it in DRAM or on SSD) then keep it in their "
        "reclaimable class, evicted before any retained block, until fewer hold it. Give every "
        "replica the same. docs/architecture.md, \"Replacement classes\".",
        _owner_count,
        commands=(META, REPLAY),  # replay: the cluster model's (--nodes)
        env_var="PEGAFLOW_METASERVER_MIN_RECLAIMABLE_OWNER_COUNT",  # the original's variable
    ),
    Option(
        "enable-decode-backup",
        False,
        "Let idle pegaflow-servers (no inference instance, e.g. decode nodes) back up the oldest "
        "retained blocks of nodes with an instance (the original's; docs/architecture.md, "
        "\"Decode backup\").",
        _bool,
        commands=(META, REPLAY),  # replay: the idle nodes back up the busy ones (--idle-nodes)
        flag=True,
        env_var="PEGAFLOW_METASERVER_ENABLE_DECODE_BACKUP",  # the original's variable
    ),
    Option(
        "backup-target-delay-secs",
        180,
        "Seconds a node must report no instance before it becomes a backup target (the original's).",
        _non_negative_int,
        commands=(META,),
        metavar="SECONDS",
    ),
    Option(
        "query-max-blocks",
        16384,
        "Largest number of block hashes accepted in one lookup.",
        _positive_int,
        commands=(META,),
    ),
    Option(
        "view-max-lag-ms",
        100,
        "Lookups (QueryPrefix, RouteHint) are answered from this replica's in-memory view of the "
        "index while it holds every node event and liveness change older than this many "
        "milliseconds, else from Redis; the view is fed from the node streams (0: no view, every "
        "lookup reads Redis). docs/meta.md, \"The in-memory view\".",
        _non_negative_int,
        commands=(META,),
        metavar="MS",
    ),
    # --- access (pegaflow/common/security.py, docs/security.md) -----------------------
    Option(
        "auth-token-file",
        "",
        "File (mode 0600) holding the shared token every gRPC call, local-socket connection and "
        "peer must present; PEGAFLOW_AUTH_TOKEN may hold the token itself. Empty: no token.",
        commands=(NODE, META, STATUS, CACHE),
        metavar="PATH",
    ),
    Option(
        "tls-cert",
        "",
        "PEM certificate chain: serve gRPC over TLS (with --tls-key).",
        commands=(NODE, META),
        metavar="PATH",
    ),
    Option("tls-key", "", "PEM private key of --tls-cert.", commands=(NODE, META), metavar="PATH"),
    Option(
        "tls-ca",
        "",
        "PEM roots to verify the servers this process calls against (the metaserver, peers; the "
        "node, for pegaflow status and cache): call them over TLS (PEGAFLOW_TLS_CA for engines' "
        "connectors).",
        commands=(NODE, STATUS, CACHE),
        metavar="PATH",
    ),
    Option(
        "no-auth",
        False,
        "Without a token, accept any caller (the behaviour before own tokens): no token file. By "
        "default a node with no token whose listeners are all on loopback creates its own token in "
        "<local socket>.token (mode 0600), which its user's clients find with no setting.",
        _bool,
        flag=True,
    ),
    Option(
        "access-group",
        "",
        "Group whose members may use the node as its own user does: the local socket (mode 0660, "
        "under /tmp with --local-socket auto) and the node's own token file (0640) belong to it.",
        _group,
        metavar="GROUP",
    ),
    # --- policy: admission and the hit-rate ceiling -----------------------------------
    Option(
        "enable-lfu-admission",
        False,
        "Put TinyLFU admission in front of LRU eviction: a new block is stored only if it is "
        "requested more often than the block it would evict.",
        _bool,
        commands=(NODE, REPLAY),
        flag=True,
    ),
    Option(
        "namespace-quota",
        [],
        "A guaranteed and/or maximum share of the L1 pool for a namespace, so that one model's "
        "scan cannot flush another's working set: NAME=SHARE (guaranteed), NAME=min:SHARE, "
        "NAME=max:SHARE or NAME=min:SHARE/max:SHARE; SHARE is a decimal in (0, 1] or a percentage. "
        "NAME is a namespace or a model (every namespace of it). A namespace at or under its "
        "guarantee is never another's victim; one at its maximum evicts its own LRU block. "
        "Repeat the flag per namespace; guarantees may sum to at most 1 (docs/replay.md, "
        "\"Namespace quotas\").",
        parse_quota,
        commands=(NODE, REPLAY),
        repeatable=True,
        metavar="NAME=SHARE",
    ),
    Option(
        "ceiling-windows",
        "15m,1h,1d",
        "Rolling windows (comma-separated durations: s/m/h/d) over which the hit-rate ceiling "
        "r* = (N - U) / N is estimated and exported beside the measured hit rate. Each window's "
        "label is written in its largest exact unit, as the original's (24h and 1d: window=\"1d\").",
        parse_windows,
        commands=(NODE, META, REPLAY),
        metavar="DURATIONS",
        aliases=("metric-hll-windows",),  # the original's name
    ),
    Option(
        "metric-hll-bucket-bits",
        16,
        "HLL bucket index bits (4-18) of the hit-rate ceiling's sketches: 2^BITS registers each, "
        "relative error ~1.04/sqrt(2^BITS) (16: 0.4%; the ceiling keeps 10 sub-window sketches per "
        "window, 1 MiB for 3 windows at 16). The metaserver's must equal its nodes': sketches of "
        "other bits are left out of the cluster union, logged (ceiling_sketch_skipped) and counted "
        "in pegaflow_meta_cluster_sketches_skipped.",
        _hll_bucket_bits,
        commands=(NODE, META),
        metavar="BITS",
    ),
    Option(
        "ceiling-publish-interval",
        10.0,
        "Seconds between publications of the node's ceiling sketch to Redis (with --redis-url), "
        "from which pegaflow-meta exports the cluster's ceiling.",
        _positive_float,
    ),
    # --- metrics export ------------------------------------------------------------------
    Option(
        "metrics-otel-endpoint",
        "",
        "Also push every metric to this OTLP collector: gRPC as the original's (e.g. http://127.0.0.1:4317), "
        "HTTP for a URL with a path or on port 4318 (needs the otel extra; empty: Prometheus /metrics only).",
        str,
        commands=(NODE, META),
        metavar="URL",
    ),
    Option(
        "metrics-period-secs",
        10,
        "Seconds between OTLP exports (with --metrics-otel-endpoint).",
        _positive_int,
        commands=(NODE, META),
    ),
    Option(
        "enable-prometheus",
        True,
        "Serve the metrics on --http-addr's /metrics (on by default, as in the original; "
        "PEGAFLOW_ENABLE_PROMETHEUS=false leaves /metrics empty, /health still answers).",
        _bool,
        flag=True,
    ),
    Option(
        "metrics-render-interval",
        1.0,
        "Seconds between two renders of /metrics at least. Scrapes that come sooner wait for "
        "the next render and share it (never an older one), so the node renders at most once "
        "per interval however many scrapers there are; 0: every scrape renders.",
        _non_negative_float,
    ),
    # --- replay: offline trace analysis (pegaflow/replay/, docs/replay.md) --------------
    Option("trace", None, "Trace file (JSON lines; .gz is decompressed).", str, commands=(REPLAY,),
           positional=True, metavar="TRACE"),
    Option(
        "trace-format",
        "auto",
        "Trace format: auto (from the first line), mooncake, or pegaflow (the node's query trace).",
        _choice("auto", "mooncake", "pegaflow"),
        commands=(REPLAY,),
    ),
    Option(
        "namespace-field",
        "",
        "Mooncake traces: the top-level field whose value is each request's namespace (e.g. model), "
        "for several models in one file and --namespace-quota; empty: every request in 'mooncake'. "
        "The node's query trace carries its namespace.",
        commands=(REPLAY,),
        metavar="NAME",
    ),
    Option(
        "l1-capacity",
        "25%",
        "L1 (DRAM) capacity of the cluster: bytes (500gb), blocks (20000blocks), a percentage of "
        "the trace's distinct blocks (25%), or inf.",
        parse_capacity,
        commands=(REPLAY,),
        metavar="SIZE",
    ),
    Option(
        "ssd-capacity",
        "0",
        "SSD tier capacity (units as --l1-capacity; 0: no SSD tier). It receives L1's evictions.",
        parse_capacity,
        commands=(REPLAY,),
        metavar="SIZE",
    ),
    Option(
        "ssd-writes",
        "evictions",
        "What L1 writes to the replayed SSD tier: evictions (a victim cache) or commits (every "
        "block, as the node's write-behind does).",
        _choice("evictions", "commits"),
        commands=(REPLAY,),
    ),
    Option(
        "page-bytes",
        "64mb",
        "Bytes of one block's page, for capacities in bytes when the trace does not say "
        "(64mb: Llama-3-8B bf16, 512-token blocks).",
        _positive_size,
        commands=(REPLAY,),
    ),
    Option("block-tokens", 512, "Tokens per block of the trace (Mooncake: 512).", _positive_int, commands=(REPLAY,)),
    Option("instances", 1, "Engine instances the requests are spread over.", _positive_int, commands=(REPLAY,)),
    Option(
        "nodes",
        1,
        "PegaFlow nodes (more than 1: the cluster model, docs/replay.md): each with --l1-capacity and "
        "--ssd-capacity of its own, pulling from each other, with the replacement classes by "
        "--min-reclaimable-owner-count; the hit rate is printed with and without them.",
        _positive_int,
        commands=(REPLAY,),
    ),
    Option(
        "idle-nodes",
        0,
        "Of --nodes, how many serve no requests (no engine: decode nodes, a drained host); with "
        "--enable-decode-backup they back up the others, and the hit rate is printed with and without it.",
        _non_negative_int,
        commands=(REPLAY,),
    ),
    Option(
        "pools",
        "both",
        "shared: one pool for all instances; isolated: one per instance (capacity split evenly); "
        "both: run and compare the two.",
        _choice("shared", "isolated", "both"),
        commands=(REPLAY,),
    ),
    Option(
        "route",
        "round-robin",
        "How requests reach instances: round-robin; kv-aware (pegaflow router's own decision: the "
        "longest prefix held, by tier, among the instances whose load is within --load-bound of the "
        "mean; ties in turn); or field:NAME (a stable hash of that trace field).",
        parse_route,
        commands=(REPLAY,),
    ),
    Option(
        "compare-admission",
        False,
        "Run every scenario both with and without TinyLFU admission.",
        _bool,
        commands=(REPLAY,),
        flag=True,
    ),
    Option(
        "sweep",
        "auto",
        "L1 capacities for the hit-rate curve: auto (1/64 to all of the distinct blocks), none, "
        "or a comma-separated list of capacities.",
        parse_sweep,
        commands=(REPLAY,),
    ),
    Option("json", False, "Print the report as JSON instead of tables.", _bool, commands=(REPLAY,), flag=True),
    Option(
        "plot",
        "",
        "Write a PNG of hit rate vs L1 capacity, with the ceiling, to this file.",
        commands=(REPLAY,),
        metavar="FILE",
    ),
    Option(
        "skip-bad",
        False,
        "Count and skip malformed trace lines instead of stopping at the first one.",
        _bool,
        commands=(REPLAY,),
        flag=True,
    ),
    Option("quiet", False, "No progress bar.", _bool, commands=(REPLAY,), flag=True),
    Option(
        "jobs",
        1,
        "Replays run at once, in forked processes (0: one per CPU); results do not depend on it.",
        _non_negative_int,
        commands=(REPLAY,),
    ),
    Option(
        "prefill-us-per-token",
        50.0,
        "Replay's time model: microseconds an instance spends prefilling one prompt token its pool "
        "does not hold (requests queue per instance; docs/replay.md).",
        _non_negative_float,
        commands=(REPLAY,),
    ),
    Option(
        "decode-seconds",
        1.0,
        "Replay's time model: seconds a request stays in flight after its first token (decode; "
        "batched, so it does not hold up the next prefill).",
        _non_negative_float,
        commands=(REPLAY,),
    ),
    Option(
        "commit-at-prefill-end",
        False,
        "Replay's time model: a request's computed blocks become visible at its modelled end of "
        "prefill, so requests in flight together do not hit each other's blocks (default: at its "
        "arrival; a trace line's measured 'done' is always used; docs/replay.md).",
        _bool,
        commands=(REPLAY,),
        flag=True,
    ),

    # --- pegaflow router (pegaflow/router/) ----------------------------------------------------
    # Its variables are PEGAFLOW_ROUTER_*: PEGAFLOW_HOST and PEGAFLOW_PORT name the node for
    # the connector (the original's documented form).
    Option("host", "0.0.0.0", "HTTP listen host (the original's --host).", commands=(ROUTER,),
           env_var="PEGAFLOW_ROUTER_HOST"),
    Option("port", 8000, "HTTP listen port (the original's --port).", _port, commands=(ROUTER,),
           env_var="PEGAFLOW_ROUTER_PORT"),
    Option(
        "engine",
        (),
        "vLLM OpenAI servers (http://HOST:PORT) that each serve whole requests. Give these, or "
        "--prefill and --decode.",
        _http_url,
        commands=(ROUTER,),
        repeatable=True,
        commas=True,
        metavar="URL",
        env_var="PEGAFLOW_ROUTER_ENGINES",
    ),
    Option(
        "prefill",
        (),
        "Prefill engines (the original's flag): each request's prompt runs here first "
        "(max_tokens=1, connector mode save_only).",
        _http_url,
        commands=(ROUTER,),
        repeatable=True,
        commas=True,
        metavar="URL",
        env_var="PEGAFLOW_ROUTER_PREFILL",
    ),
    Option(
        "decode",
        (),
        "Decode engines (the original's flag): they load the prefill's blocks from PegaFlow and "
        "stream the answer (connector mode load_only).",
        _http_url,
        commands=(ROUTER,),
        repeatable=True,
        commas=True,
        metavar="URL",
        env_var="PEGAFLOW_ROUTER_DECODE",
    ),
    Option(
        "policy",
        "kv-aware",
        "round-robin; least-loaded (fewest requests in flight, vLLM's queue from /metrics); "
        "kv-aware (the longest prefix held, by tier, among the engines whose load is within "
        "--load-bound of the mean; ties in turn; docs/router.md).",
        _choice("kv-aware", "least-loaded", "round-robin"),
        commands=(ROUTER,),
        env_var="PEGAFLOW_ROUTER_POLICY",
    ),
    Option(
        "metaserver-addr",
        "",
        "Metaserver gRPC address (HOST:PORT or http://HOST:PORT) for kv-aware routing across "
        "hosts (empty: ask each engine's node directly, which must be on this host).",
        _grpc_target,
        commands=(ROUTER,),
        aliases=("meta-addr",),
        metavar="ADDR",
    ),
    Option(
        "tokenizer",
        "",
        "Tokenizer (path or Hugging Face name) the router hashes prompts with (empty: the model "
        "path the engines report in /v1/models).",
        commands=(ROUTER,),
        env_var="PEGAFLOW_ROUTER_TOKENIZER",
    ),
    Option(
        "skip-tokenizer-init",
        False,
        "Load no tokenizer (as vLLM's flag of that name, for clients that send token ids): "
        "token-id prompts are routed by their prefix, text prompts and chats by load.",
        _bool,
        commands=(ROUTER,),
        flag=True,
    ),
    Option(
        "load-bound",
        DEFAULT_LOAD_BOUND,
        "kv-aware: an engine whose load is above (1 + this) x the mean (this request counted) is not "
        "chosen for its prefix, and engines below (1 - this) x the mean are chosen first (bounded-load "
        "affinity; default measured in docs/router.md).",
        _non_negative_float,
        commands=(ROUTER, REPLAY),
    ),
    Option(
        "load-window",
        DEFAULT_LOAD_WINDOW_S,
        "kv-aware: an engine's load is the larger of its requests in flight and the requests routed "
        "to it in this many seconds (0: in flight only).",
        _non_negative_float,
        commands=(ROUTER, REPLAY),
    ),
    Option(
        "ssd-hit-cost",
        0.25,
        "kv-aware: the time of a prompt token read from a node's SSD tier, as a fraction of computing "
        "it (an L1 hit costs 0); weighs SSD-held prefixes against DRAM-held ones.",
        _fraction,
        commands=(ROUTER, REPLAY),
    ),
    Option(
        "peer-hit-cost",
        0.5,
        "kv-aware: the time of a prompt token pulled from another node, as a fraction of computing it.",
        _fraction,
        commands=(ROUTER,),
        env_var="PEGAFLOW_ROUTER_PEER_HIT_COST",
    ),
    Option(
        "hint-timeout",
        0.05,
        "Seconds to wait for the metaserver's (or a node's) prefix answer before routing by "
        "load alone.",
        _positive_float,
        commands=(ROUTER,),
        env_var="PEGAFLOW_ROUTER_HINT_TIMEOUT",
    ),
    Option(
        "health-interval",
        2.0,
        "Seconds between health checks (and /metrics scrapes) of each engine.",
        _positive_float,
        commands=(ROUTER,),
        env_var="PEGAFLOW_ROUTER_HEALTH_INTERVAL",
    ),
    Option(
        "backoff-max",
        30.0,
        "Longest wait, in seconds, between retries of an engine that stopped answering (the "
        "wait doubles from 0.5 s).",
        _positive_float,
        commands=(ROUTER,),
        env_var="PEGAFLOW_ROUTER_BACKOFF_MAX",
    ),
    Option(
        "request-timeout",
        600.0,
        "Seconds an engine may take to answer one request (streamed: between two chunks).",
        _positive_float,
        commands=(ROUTER,),
        env_var="PEGAFLOW_ROUTER_REQUEST_TIMEOUT",
    ),
    Option(
        "engine-api-key",
        "",
        "The key engines started with vLLM's --api-key take: the router's own checks of them "
        "(/v1/models, the describe probe) present it. Client requests are forwarded with the "
        "client's own Authorization header, never this key.",
        str,
        commands=(ROUTER,),
        env_var="PEGAFLOW_ROUTER_ENGINE_API_KEY",
        metavar="KEY",
    ),
    # --- status: one screen of a node or the cluster (pegaflow/ops/status.py) ---------------
    Option("addr", NODE_ADDR, "The node to show: its gRPC address (HOST:PORT).", _node_target,
           commands=(STATUS,), metavar="HOST:PORT"),
    Option(
        "metaserver",
        "",
        "Show the cluster instead: every node this metaserver (HOST:PORT or http://HOST:PORT) "
        "knows, one row each.",
        _grpc_target,
        commands=(STATUS,),
        metavar="HOST:PORT",
    ),
    Option(
        "watch",
        0.0,
        "Redraw the screen in place every SECS seconds (--watch alone: 2) until Ctrl-C; 0: print once.",
        _non_negative_float,
        commands=(STATUS,),
        metavar="SECS",
    ),
    Option("json", False, "Print one JSON object for scripts instead of the screen.", _bool, commands=(STATUS,),
           flag=True),
    Option("timeout", 3.0, "Seconds to wait for each node's (and the metaserver's) answer.", _positive_float,
           commands=(STATUS,), metavar="SECS"),
    # --- cache: look inside a node's cache and act on it (pegaflow/ops/cache.py) ------------
    # The node's address and credentials come from the environment as every client's do; the
    # other options say what one command acts on, so they are flags only: a variable left in
    # the environment must never choose what a clear drops.
    Option("addr", NODE_ADDR, "The node's gRPC address (HOST:PORT).", _host_port, commands=(CACHE,),
           metavar="HOST:PORT"),
    Option("timeout", 10.0, "Seconds to wait for the answer.", _positive_float, commands=(CACHE,), metavar="SECS",
           env_var=NO_ENV),
    Option("json", False, "Print the answer as JSON.", _bool, commands=(CACHE,), flag=True, env_var=NO_ENV),
    Option(
        "namespace",
        "",
        "The namespace (as /instances or pegaflow status list it).",
        commands=(CACHE,),
        subcommands=("inspect", "pin"),
        short="n",
        required=True,
        metavar="NS",
        env_var=NO_ENV,
    ),
    Option(
        "tokens",
        "",
        "A prompt's token ids, comma- or space-separated (or a JSON list); hashed as the connector "
        "does (the namespace's root seeds the chain, its bs= cuts the blocks).",
        commands=(CACHE,),
        subcommands=("inspect", "pin"),
        one_of="blocks",
        metavar="IDS",
        env_var=NO_ENV,
    ),
    Option(
        "tokens-file",
        "",
        "A file of token ids: a JSON list, or comma/space-separated.",
        commands=(CACHE,),
        subcommands=("inspect", "pin"),
        one_of="blocks",
        metavar="FILE",
        env_var=NO_ENV,
    ),
    Option(
        "hashes",
        [],
        "Block hashes in hex, in prefix order: for multimodal prompts (their items' identifiers "
        "come from vLLM's processor, so tokens alone do not name their blocks) and namespaces "
        "that are not a connector's.",
        commands=(CACHE,),
        subcommands=("inspect", "pin"),
        one_of="blocks",
        repeatable=True,
        commas=True,
        metavar="HEX",
        env_var=NO_ENV,
    ),
    Option(
        "block-size",
        0,
        "Tokens per block, for a namespace whose name does not carry bs= (0: the name's).",
        _non_negative_int,
        commands=(CACHE,),
        subcommands=("inspect", "pin"),
        env_var=NO_ENV,
    ),
    Option("lora-name", "", "The LoRA adapter the prompt ran with (it enters every hash).", commands=(CACHE,),
           subcommands=("inspect", "pin"), env_var=NO_ENV),
    Option("lora-path", "", "The path the engine loaded that adapter from (it enters every hash with --lora-name; "
           "the model card's root in the engine's /v1/models).", commands=(CACHE,),
           subcommands=("inspect", "pin"), env_var=NO_ENV),
    Option("cache-salt", "", "The request's cache_salt (it enters the first block's hash).", commands=(CACHE,),
           subcommands=("inspect", "pin"), env_var=NO_ENV),
    Option(
        "metaserver",
        "",
        "Also ask this metaserver (HOST:PORT or http://HOST:PORT) which nodes of the cluster hold "
        "the prefix.",
        _grpc_target,
        commands=(CACHE,),
        subcommands=("inspect",),
        metavar="HOST:PORT",
        env_var=NO_ENV,
    ),
    Option("namespace", "", "Every block of this namespace.", commands=(CACHE,), subcommands=("clear",),
           short="n", one_of="what", metavar="NS", env_var=NO_ENV),
    Option("instance", "", "Every block of the namespaces this engine instance registered (as in /instances).",
           commands=(CACHE,), subcommands=("clear",), one_of="what", metavar="ID", env_var=NO_ENV),
    Option("all", False, "Every block of every namespace.", _bool, commands=(CACHE,), subcommands=("clear",),
           flag=True, one_of="what", env_var=NO_ENV),
    Option("name", "", "The pin's id (default: pin-N).", commands=(CACHE,), subcommands=("pin",), env_var=NO_ENV),
    Option("id", "", "The pin's id (as pegaflow cache pins lists it).", commands=(CACHE,), subcommands=("unpin",),
           positional=True, metavar="ID", env_var=NO_ENV),
]


def options_for(command: str, subcommand: str | None = None) -> list[Option]:
    """The rows of ``command``; with ``subcommand``, only those that subcommand takes."""
    return [o for o in OPTIONS if command in o.commands
            and (subcommand is None or not o.subcommands or subcommand in o.subcommands)]


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line and exits 2 (no usage dump, no traceback)."""

    def error(self, message: str) -> NoReturn:
        _refuse(self.prog, message)


def _refuse(prog: str, message: str) -> NoReturn:
    sys.stderr.write(f"{prog}: error: {message}\n")
    raise SystemExit(2)


class _NotGiven:
    """What an empty flag value parses to: the flag counts as not given (module docstring)."""


NOT_GIVEN = _NotGiven()


def _blank(text: str) -> bool:
    return not text.strip()


def _wrap(opt: Option) -> Callable[[str], object]:
    def parse(text: str) -> object:
        if _blank(text):
            return NOT_GIVEN
        try:
            return opt.parse(text)
        except (ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = getattr(opt.parse, "__name__", "value")
    return parse


class _Version(argparse.Action):
    """``-V``/``--version``: ``PROG VERSION`` on stdout, exit 0 (the original's binaries
    answer ``-V`` and ``--version`` alike); the version is read only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0,
                         help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[object] | None, option_string: str | None = None) -> None:
        from pegaflow.core.version import version

        sys.stdout.write(f"{parser.prog} {version()}\n")
        parser.exit(0)


def build_parser(command: str, prog: str, description: str = "") -> argparse.ArgumentParser:
    """Flags for ``command`` (under each of its subcommands, if it has some) and ``-V``;
    defaults are filled from the environment in :func:`fill_defaults`."""
    p = _OneLineParser(prog=prog, description=description)
    p.add_argument("-V", "--version", action=_Version)
    if command not in SUBCOMMANDS:
        add_options(p, command)
        return p
    sub = p.add_subparsers(dest=SUBCOMMAND, required=True, parser_class=_OneLineParser)
    for name, summary in SUBCOMMANDS[command]:
        add_options(sub.add_parser(name, help=summary, description=summary), command, name)
    return p


def _one_of(command: str, opt: Option) -> list[Option]:
    """The options of ``opt``'s one-of group (a group lies within the subcommands that take it)."""
    sub = opt.subcommands[0] if opt.subcommands else None
    return [o for o in options_for(command, sub) if o.one_of == opt.one_of]


def _demand(command: str, opt: Option) -> str:
    """What must be given, in words (``required``; ``exactly one of --tokens, ...``)."""
    if opt.required:
        return "required"
    if opt.one_of:
        return "exactly one of " + ", ".join(o.flags[0] for o in _one_of(command, opt))
    return ""


def add_options(p: argparse.ArgumentParser, command: str, subcommand: str | None = None) -> None:
    for opt in options_for(command, subcommand):
        notes = [n for n in (_demand(command, opt), f"${opt.env}" if opt.envs else "") if n]
        if not (opt.flag or opt.positional) and opt.default not in ("", None, [], ()):
            notes.append(f"default {_shown(opt)}")
        text = opt.help + (f" ({'; '.join(notes)})" if notes else "")
        text = text.replace("%", "%%")  # argparse %-formats help ("25%" would crash --help)
        if opt.positional:
            p.add_argument(opt.dest, type=_wrap(opt), metavar=opt.metavar, help=text)
        elif opt.flag:
            p.add_argument(*opt.flags, dest=opt.dest, action="store_const", const=True, default=None, help=text)
        elif opt.repeatable:  # values are parsed (and comma-split) in fill_defaults
            p.add_argument(*opt.flags, dest=opt.dest, action="extend", nargs="+", default=None,
                           metavar=opt.metavar, help=text)
        else:
            p.add_argument(*opt.flags, dest=opt.dest, type=_wrap(opt), default=None, metavar=opt.metavar, help=text)


def fill_defaults(
    ns: argparse.Namespace, command: str, prog: str, env: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """Fill options not given as flags from ``PEGAFLOW_*`` variables, then the table's defaults;
    then check that the required options were given. Options of the subcommands not chosen
    take their defaults."""
    env = os.environ if env is None else env
    subcommand = getattr(ns, SUBCOMMAND, None)
    if subcommand is not None:
        prog = f"{prog} {subcommand}"
    opts = options_for(command, subcommand)
    given: set[str] = set()  # by flag or variable
    for opt in opts:
        value = getattr(ns, opt.dest, None)  # argparse's: a str, a list of str, True, NOT_GIVEN or None
        if opt.positional:
            if value is NOT_GIVEN:
                _refuse(prog, f"argument {opt.metavar}: empty value")
            given.add(opt.dest)
            continue
        if value is NOT_GIVEN or (opt.repeatable and value is not None and all(map(_blank, value))):
            value = None
        if value is not None:
            if opt.repeatable:
                try:
                    setattr(ns, opt.dest, opt.parse_list(value))
                except (ValueError, TypeError) as exc:
                    _refuse(prog, f"argument --{opt.name}: {exc}")
            given.add(opt.dest)
            continue
        var = next((v for v in opt.envs if v in env and not _blank(env[v])), None)
        if var is not None:
            raw = env[var]
            try:
                value = opt.parse_list(raw.split(",")) if opt.repeatable else opt.parse(raw)
            except (ValueError, TypeError) as exc:
                _refuse(prog, f"{var}={raw!r}: {exc}")
            given.add(opt.dest)
        else:
            value = default_of(opt)
        setattr(ns, opt.dest, value)
    for opt in options_for(command):
        if not hasattr(ns, opt.dest):
            setattr(ns, opt.dest, default_of(opt))
    _check_given(opts, given, prog)
    _rust_log(ns, command, env)
    return ns


def _check_given(opts: list[Option], given: set[str], prog: str) -> None:
    """Each required option given, and exactly one of each one-of group (argparse's words)."""
    for opt in opts:
        if opt.required and opt.dest not in given:
            _refuse(prog, f"the following arguments are required: {'/'.join(opt.flags)}")
    for group in dict.fromkeys(o.one_of for o in opts if o.one_of):
        members = [o for o in opts if o.one_of == group]
        named = [o for o in members if o.dest in given]
        if not named:
            _refuse(prog, f"one of the arguments {' '.join(o.flags[0] for o in members)} is required")
        if len(named) > 1:
            _refuse(prog, f"argument {'/'.join(named[1].flags)}: not allowed with argument {'/'.join(named[0].flags)}")


def default_of(opt: Option) -> object:
    """The option's default, parsed as a given value would be."""
    d = opt.default
    return list(cast("Iterable[object]", d)) if opt.repeatable else (opt.parse(d) if isinstance(d, str) and opt.parse is not str else d)


def without_effect(command: str, config: object) -> list[tuple[str, str]]:
    """``(flag, reason)`` for each option of ``command`` that ``config`` sets away from its
    default although it has no effect here (``Option.no_effect``): the daemon logs each once."""
    out = []
    for opt in options_for(command):
        if opt.no_effect:
            value = getattr(config, opt.dest)
            default = default_of(opt)
            if (list(value) if opt.repeatable else value) != default:
                out.append((f"--{opt.name}", opt.no_effect))
    return out


def _shown(opt: Option) -> str:
    """The default as the docs and --help show it (a list's items comma-separated)."""
    d = opt.default
    return ",".join(map(str, cast("Iterable[object]", d))) if opt.repeatable else str(d)


def render_markdown() -> str:
    lines = [
        "# Options",
        "",
        "Generated from `pegaflow/config/options.py` by `python -m pegaflow.config.options`;",
        "do not edit by hand. Every option is a flag and, where the environment column names one,",
        "a `PEGAFLOW_*` environment variable; a flag wins over the environment, which wins over",
        "the default. An empty value (`--redis-url=` or `PEGAFLOW_REDIS_URL=`) counts as not",
        "given: the next source applies.",
        "",
    ]
    for command, title in ((NODE, "pegaflow-node"), (META, "pegaflow-meta"), (REPLAY, "pegaflow replay"),
                           (ROUTER, "pegaflow router"), (STATUS, "pegaflow status"), (CACHE, "pegaflow cache")):
        opts = options_for(command)
        if not opts:
            continue
        lines += [f"## `{title}`", ""]
        if command in SUBCOMMANDS:
            lines += [f"- `{title} {name}`: {summary}" for name, summary in SUBCOMMANDS[command]]
            lines += ["", "An option marked with subcommands belongs to those only; the others to every one.", ""]
        lines += ["| flag | environment | default | meaning |", "|---|---|---|---|"]
        for o in opts:
            where = ", ".join(o.subcommands)
            if o.positional:
                lines.append(f"| `{o.metavar}` (argument{'; ' + where if where else ''}) | — | required | {o.help} |")
                continue
            scope = "; ".join(x for x in (where, _demand(command, o)) if x)
            flag = f"`--{o.name}`" + (f", `-{o.short}`" if o.short else "")
            flag += "".join(f" (alias `--{a}`)" for a in o.aliases)
            flag += " (one or more values)" if o.repeatable else ""
            flag += f" ({scope})" if scope else ""
            env = f"`{o.env}`" if o.envs else "—"
            default = "off" if o.flag and not o.default else f"`{_shown(o)}`" if o.default not in ("", None, [], ()) else "—"
            lines.append(f"| {flag} | {env} | {default} | {o.help} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
