"""Request traces for ``pegaflow replay``: reading, format detection, validation.

Two JSON-lines formats, one request per line (both documented in ``docs/replay.md``):

- ``mooncake``: ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
  "hash_ids": [int, ...]}`` plus optional ``done`` (ms). One id per ``block_tokens`` (512) tokens of the prompt;
  ids name a whole prefix (equal ids mean equal prefixes), as in the Mooncake traces.
  Every request is in one namespace, ``mooncake``, unless ``namespace_field`` names a
  top-level field whose value is the request's namespace (``--namespace-field model``:
  several models' requests in one file); ids then name prefixes within a namespace.
- ``pegaflow``: the node's own query trace, ``{"time": seconds, "namespace": str,
  "hashes": [32 hex digits, ...]}`` plus optional ``page_bytes``, ``block_tokens``,
  ``tokens``, ``instance``, ``saved`` and ``done`` (seconds). :func:`encode_query` writes it; it
  is the one definition.
- ``done`` (either format, in the unit of the line's time): when the request finished, as
  measured (``bench/router.py`` writes it). Replay makes the blocks the request computed
  visible from then on instead of from its modelled completion; it must not be before the
  request's time.
- ``prefix_hint`` (either format, boolean, default true): false when the live router had no
  prefix answer in time for the request and chose its engine by load alone (its
  ``x-pegaflow-prefix-hint: none``). Replay's kv-aware routing then sees no prefix for it,
  as the router did.

Contracts:

- A line that is not a JSON object of the format, or has a field of the wrong type or
  range, raises :class:`TraceError` carrying its 1-based line number, unless the reader
  is told to skip bad lines (then ``Trace.skipped`` counts them). Blank lines are ignored.
- ``Request.hashes`` are the 16-byte block hashes the node's ``BlockIndex`` is keyed by
  (Mooncake ids become their 16-byte little-endian encoding); ``Request.ids`` are dense
  ints, equal iff (namespace, hash) are equal, numbered in order of first appearance. So
  ``Trace.unique`` is U and ``Trace.blocks`` is N of the ceiling (N - U) / N.
- Times are seconds (Mooncake milliseconds are divided by 1000). Requests keep file order.
"""

from __future__ import annotations

import gzip
import json
import math
import reprlib
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import filterfalse
from operator import methodcaller
from typing import Any, Literal, overload

from pegaflow.core.identity import HASH_BYTES

MOONCAKE = "mooncake"
PEGAFLOW = "pegaflow"
FORMATS = (MOONCAKE, PEGAFLOW)

MOONCAKE_NAMESPACE = "mooncake"
_ID_LIMIT = 1 << (8 * HASH_BYTES)
_TO_HASH = methodcaller("to_bytes", HASH_BYTES, "little")
# Mooncake's published traces hash every 512 prompt tokens into one id.
MOONCAKE_BLOCK_TOKENS = 512
# Latest request time accepted, in seconds (epoch seconds of the year 33658; Mooncake's
# relative milliseconds up to 1e15): past it a time is garbage, not a trace.
MAX_SECONDS = 1e12
MAX_COUNT = 2**53  # token and block counts: exact as floats (the replay's times are computed from them)

JsonValue = Any  # a value json.loads returned, before validation: each field is checked where it is read
Line = dict[str, JsonValue]  # one trace line, a JSON object


class TraceError(ValueError):
    """A malformed trace line; ``line`` is 1-based (0 when no line is to blame)."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}" if line else message)
        self.line = line
        self.message = message


@dataclass(slots=True)
class Request:
    """One query: the block hashes of a prompt, in order, and what is needed to score it."""

    time: float  # seconds
    namespace: str
    hashes: list[bytes]
    ids: list[int]  # dense ids of (namespace, hash), parallel to hashes
    tokens: int  # prompt tokens; a hit of h blocks saves min(h * block_tokens, tokens)
    block_tokens: int
    route: str | None  # value of the routing field, if one was asked for
    line: int
    # Blocks the engine stored after this request beyond the queried ones (the block with
    # the last prompt token, blocks of generated tokens): committed, never counted as accesses.
    saved: list[bytes] = field(default_factory=list)
    # When the request finished (seconds, measured; the line's ``done``), or None: replay
    # then makes its computed blocks visible at its modelled completion.
    done: float | None = None
    # False: the live router chose its engine without a prefix answer (the line's ``prefix_hint``).
    hinted: bool = True


@dataclass
class Trace:
    """A whole trace in memory: requests plus the counts the ceiling needs."""

    format: str
    requests: list[Request]
    unique: int  # U: distinct (namespace, hash) requested
    skipped: int = 0  # bad lines skipped (only with skip_bad)
    first_bad: str = ""  # the first skipped line's error, for the report
    namespaces: dict[str, int | None] = field(default_factory=dict)  # name -> page_bytes
    storable: int = -1  # distinct blocks requested or saved (an unbounded cache's size); -1: unique

    def __post_init__(self) -> None:
        if self.storable < 0:
            self.storable = self.unique

    @property
    def blocks(self) -> int:
        """N: block accesses (every hash of every request)."""
        return sum(len(r.hashes) for r in self.requests)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def ceiling(self) -> float:
        """Exact r* = (N - U) / N; 0.0 for an empty trace."""
        n = self.blocks
        return (n - self.unique) / n if n else 0.0

    @property
    def span(self) -> float:
        """Seconds from the first to the last request time."""
        if not self.requests:
            return 0.0
        ts = [r.time for r in self.requests]
        return max(ts) - min(ts)


def encode_query(
    time: float,
    namespace: str,
    hashes: Sequence[bytes],
    *,
    page_bytes: int | None = None,
    block_tokens: int | None = None,
    tokens: int | None = None,
    instance: str | None = None,
    saved: Sequence[bytes] = (),
    done: float | None = None,
) -> str:
    """One line (without newline) of the ``pegaflow`` query trace; :func:`read_trace` reads it."""
    d: dict[str, object] = {"time": time, "namespace": namespace, "hashes": [h.hex() for h in hashes]}
    if saved:
        d["saved"] = [h.hex() for h in saved]
    for k, v in (
        ("page_bytes", page_bytes),
        ("block_tokens", block_tokens),
        ("tokens", tokens),
        ("instance", instance),
        ("done", done),
    ):
        if v is not None:
            d[k] = v
    return json.dumps(d, separators=(",", ":"))


def detect_format(obj: object) -> str | None:
    """The format a parsed line belongs to, or None if it looks like neither."""
    if isinstance(obj, dict):
        if "hash_ids" in obj:
            return MOONCAKE
        if "hashes" in obj and "namespace" in obj:
            return PEGAFLOW
    return None


def _time(d: Line, key: str, line: int, scale: float = 1.0) -> float:
    """A request time in seconds (``scale``: seconds per unit): finite, in [0, MAX_SECONDS]."""
    v = d.get(key)
    if v is None:
        raise TraceError(line, f"missing field {key!r}")
    if type(v) not in (int, float):
        raise TraceError(line, f"field {key!r} must be a number, got {type(v).__name__}")
    try:
        t = v * scale
    except OverflowError:  # an integer of hundreds of digits (JSON takes up to 4,300)
        t = math.inf
    if not 0.0 <= t <= MAX_SECONDS:  # also false for NaN; JSON's 1e309 is inf
        raise TraceError(line, f"field {key!r} = {reprlib.repr(v)} is not a time in [0, {MAX_SECONDS / scale:g}]")
    return float(t)


def _done(d: Line, t: float, line: int, scale: float = 1.0) -> float | None:
    """The optional ``done`` time (seconds): a time, not before the request's ``t``."""
    if d.get("done") is None:
        return None
    done = _time(d, "done", line, scale)
    if done < t:
        raise TraceError(line, f"field 'done' = {d['done']!r} is before the request's time")
    return done


def _hinted(d: Line, line: int) -> bool:
    """The optional ``prefix_hint`` flag (default true)."""
    v = d.get("prefix_hint", True)
    if not isinstance(v, bool):
        raise TraceError(line, f"field 'prefix_hint' must be true or false, got {v!r}")
    return v


@overload
def _count(
    d: Line, key: str, line: int, *, required: Literal[True] = True, positive: bool = False
) -> int: ...
@overload
def _count(
    d: Line, key: str, line: int, *, required: bool, positive: bool = False
) -> int | None: ...
def _count(
    d: Line, key: str, line: int, *, required: bool = True, positive: bool = False
) -> int | None:
    v = d.get(key)
    if v is None:
        if required:
            raise TraceError(line, f"missing field {key!r}")
        return None
    if type(v) is not int or v < 0 or (positive and v == 0) or v > MAX_COUNT:
        raise TraceError(
            line, f"field {key!r} must be a {'positive' if positive else 'non-negative'} integer up to 2^53, "
            f"got {reprlib.repr(v)}"
        )
    return v


def _route(d: Line, route_field: str | None, line: int, what: str = "routing") -> str | None:
    if route_field is None:
        return None
    if route_field not in d:
        raise TraceError(line, f"missing {what} field {route_field!r}")
    v = d[route_field]
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True)


class _Reader:
    """Turns parsed lines into Requests; keeps the dense-id and hash tables."""

    def __init__(self, block_tokens: int, route_field: str | None, namespace_field: str | None = None) -> None:
        self.block_tokens = block_tokens
        self.route_field = route_field
        self.namespace_field = namespace_field
        self.ids: dict[int | tuple[str, int | bytes], int] = {}  # mooncake: raw int id; pegaflow: (namespace, hash)
        self.hashes: list[bytes] = []  # dense id -> 16-byte hash
        self.saved: set[tuple[str, bytes]] = set()  # pegaflow: (namespace, hash) of every saved block
        self.namespaces: dict[str, int | None] = {}

    def mooncake(self, d: Line, line: int) -> Request:
        ts = _time(d, "timestamp", line, scale=1e-3)
        done = _done(d, ts, line, scale=1e-3)
        hinted = _hinted(d, line)
        n_in = _count(d, "input_length", line)
        _count(d, "output_length", line, required=False)
        raw = d.get("hash_ids")
        if not isinstance(raw, list):
            raise TraceError(line, "field 'hash_ids' must be a list of integers")
        # Validate everything before adding anything (a skipped line leaves no trace), with
        # passes that run in C: set(map(type)) rejects 1.0 and True, min/max the range.
        if set(map(type, raw)) - {int} or (raw and (min(raw) < 0 or max(raw) >= _ID_LIMIT)):
            bad = next(x for x in raw if type(x) is not int or not 0 <= x < _ID_LIMIT)
            raise TraceError(line, f"hash id {bad!r} is not an integer in [0, 2**128)")
        route = _route(d, self.route_field, line)
        ns = MOONCAKE_NAMESPACE
        if self.namespace_field is not None:
            ns = _route(d, self.namespace_field, line, "namespace") or ""
            if not ns:
                raise TraceError(line, f"namespace field {self.namespace_field!r} is empty")
            raw = [(ns, x) for x in raw]  # an id names a prefix within its namespace
        table = self.ids
        new = list(dict.fromkeys(filterfalse(table.__contains__, raw)))
        if new:
            n0 = len(self.hashes)
            table.update(zip(new, range(n0, n0 + len(new)), strict=True))
            self.hashes.extend(map(_TO_HASH, new) if self.namespace_field is None else (_TO_HASH(x) for _, x in new))
        ids = list(map(table.__getitem__, raw))
        self.namespaces.setdefault(ns, None)
        return Request(
            time=ts,
            namespace=ns,
            hashes=list(map(self.hashes.__getitem__, ids)),
            ids=ids,
            tokens=n_in,
            block_tokens=self.block_tokens,
            route=route,
            line=line,
            done=done,
            hinted=hinted,
        )

    def pegaflow(self, d: Line, line: int) -> Request:
        t = _time(d, "time", line)
        done = _done(d, t, line)
        hinted = _hinted(d, line)
        ns = d.get("namespace")
        if not isinstance(ns, str) or not ns:
            raise TraceError(line, "field 'namespace' must be a non-empty string")
        raw = d.get("hashes")
        if not isinstance(raw, list):
            raise TraceError(line, "field 'hashes' must be a list of hex strings")
        page = _count(d, "page_bytes", line, required=False, positive=True)
        bt = _count(d, "block_tokens", line, required=False, positive=True) or self.block_tokens
        known = self.namespaces.get(ns)
        if page is not None and known is not None and known != page:
            raise TraceError(line, f"namespace {ns!r} had page_bytes={known}, this line says {page}")
        tokens = _count(d, "tokens", line, required=False)
        route = _route(d, self.route_field, line)
        raw_hashes = _hex_hashes(raw, line)
        raw_saved = d.get("saved")
        if raw_saved is not None and not isinstance(raw_saved, list):
            raise TraceError(line, "field 'saved' must be a list of hex strings")
        saved = _hex_hashes(raw_saved or (), line)
        # Valid: only now touch the tables, so a skipped line leaves no trace.
        self.saved.update((ns, h) for h in saved)
        if page is not None:
            self.namespaces[ns] = page
        else:
            self.namespaces.setdefault(ns, None)
        hashes: list[bytes] = []
        ids: list[int] = []
        table = self.ids
        for h in raw_hashes:
            key = (ns, h)
            i = table.get(key)
            if i is None:
                i = table[key] = len(self.hashes)
                self.hashes.append(h)
            hashes.append(self.hashes[i])
            ids.append(i)
        return Request(
            time=t,
            namespace=ns,
            hashes=hashes,
            ids=ids,
            tokens=len(hashes) * bt if tokens is None else tokens,
            block_tokens=bt,
            route=route,
            line=line,
            saved=saved,
            done=done,
            hinted=hinted,
        )


def _hex_hashes(raw: Iterable[JsonValue], line: int) -> list[bytes]:
    out: list[bytes] = []
    for x in raw:
        try:
            h = bytes.fromhex(x)
        except (TypeError, ValueError):
            raise TraceError(line, f"hash {x!r} is not a hex string") from None
        if len(h) != HASH_BYTES:
            raise TraceError(line, f"hash {x!r} has {len(h)} bytes, expected {HASH_BYTES}")
        out.append(h)
    return out


def read_trace(
    lines: Iterable[str | bytes],
    fmt: str = "auto",
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    route_field: str | None = None,
    skip_bad: bool = False,
    namespace_field: str | None = None,
) -> Trace:
    """Read every request of a trace; see the module docstring for the contracts.

    ``fmt`` is ``auto`` (decided by the first line that parses as a JSON object of a known
    format), ``mooncake`` or ``pegaflow``. ``route_field`` names a top-level field whose
    value every request must carry (used for routing); ``namespace_field`` one whose value is
    a Mooncake request's namespace (default: every request in ``mooncake``). Raises
    :class:`TraceError`.
    """
    if fmt not in ("auto", *FORMATS):
        raise TraceError(0, f"unknown trace format {fmt!r} (choose from auto, {', '.join(FORMATS)})")
    reader = _Reader(block_tokens, route_field, namespace_field)
    requests: list[Request] = []
    skipped = 0
    first_bad = ""
    parse = None if fmt == "auto" else getattr(reader, fmt)
    loads = json.loads
    for lineno, line in _numbered(lines):
        if not line.strip():
            continue
        try:
            if isinstance(line, bytes):  # decoded line by line: --skip-bad skips one that is not UTF-8
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise TraceError(lineno, f"not UTF-8 text ({exc.reason})") from None
            else:
                text = line
            try:
                d = loads(text)
            except json.JSONDecodeError as exc:
                raise TraceError(lineno, f"not valid JSON ({exc.msg} at column {exc.pos + 1})") from None
            except (ValueError, RecursionError) as exc:  # e.g. nesting too deep, integers too long
                raise TraceError(lineno, f"not a usable JSON line ({type(exc).__name__}: {exc})") from None
            if not isinstance(d, dict):
                raise TraceError(lineno, f"expected a JSON object, got {type(d).__name__}")
            if parse is None:
                found = detect_format(d)
                if found is None:
                    raise TraceError(
                        lineno,
                        "cannot tell the trace format (no 'hash_ids' for mooncake, no 'namespace' and "
                        "'hashes' for pegaflow); pass --trace-format",
                    )
                fmt = found
                parse = getattr(reader, found)
            requests.append(parse(d, lineno))
        except TraceError as exc:
            if not skip_bad:
                raise
            skipped += 1
            first_bad = first_bad or str(exc)
    return Trace(
        format=fmt if fmt != "auto" else MOONCAKE,
        requests=requests,
        unique=len(reader.hashes),
        storable=len(reader.hashes) + sum(1 for key in reader.saved if key not in reader.ids),
        skipped=skipped,
        first_bad=first_bad,
        namespaces=reader.namespaces,
    )


def _numbered(lines: Iterable[str | bytes]) -> Iterator[tuple[int, str | bytes]]:
    """``enumerate(lines, 1)``; a file that cannot be read past some line (a truncated or
    corrupt ``.gz``) raises :class:`TraceError` naming that line."""
    it = iter(lines)
    lineno = 0
    while True:
        try:
            text = next(it)
        except StopIteration:
            return
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise TraceError(lineno + 1, f"cannot decompress the trace here ({exc or type(exc).__name__}): "
                                         "the file is truncated or corrupt") from None
        lineno += 1
        yield lineno, text
