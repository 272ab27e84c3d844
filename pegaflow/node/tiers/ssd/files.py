"""The SSD tier's cache files at start-up: validate the configured paths, then open or
create one file per path (``--ssd-cache-shards`` N > 1: N files per path, ``NAME.0`` ..
``NAME.N-1``, for parallel filesystems), laid out as :mod:`records` says.

Contracts:
- Everything is validated before anything is written (:func:`check_paths`), so a bad path
  or capacity fails with :class:`SsdError` (one line for the operator) and leaves every
  file as it was. The only write it makes is a probe file, created and removed at once.
- A path's missing directories are created (as the original does), a path ending in ``/``
  is a directory (created if missing) that holds the file; a start that fails removes the
  files and directories it created (a cache file is allocated in full: hundreds of GB).
- Foreign or newer files are never overwritten: :func:`open_files` raises :class:`SsdError`.
- One node per cache file (``flock``): a second one would overwrite the first one's log.
- An existing PegaFlow file of another capacity or layout is re-formatted, with a warning:
  it is our own cache, and its contents are disposable.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog

from pegaflow.node.tiers.ssd.records import (
    BLOCK,
    FORMAT_VERSION,
    aligned_buffer,
    pack_superblock,
    segment_start,
    unpack_superblock,
)
from pegaflow.node.tiers.ssd.store import CacheFile, Segment

log = structlog.get_logger("pegaflow.ssd")

CACHE_FILE_NAME = "pegaflow-ssd.cache"  # used when a --ssd-cache-path is a directory
MAX_SEGMENT = 64 << 20  # large enough for any KV page we expect; small enough to reclaim fast
MIN_SEGMENTS = 8  # per file: keeps FIFO reclaim granular on small caches


class SsdError(Exception):
    """The SSD tier cannot start as configured (one line for the operator)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What :func:`check_paths` found usable: one file of ``file_bytes`` per path and shard."""

    paths: list[str]  # the cache files themselves (a directory's resolved to its file)
    existed: list[bool]  # per path: the file was there at validation
    file_bytes: int
    dirs: list[str] = field(default_factory=list)  # missing directories to create, parents first


def open_files(paths: Iterable[str], capacity: int, shards: int = 1) -> list[CacheFile]:
    """Open or create the cache files, validating everything before touching anything.

    Raises SsdError (one line) for: an unusable path, a foreign or newer file, a capacity
    the filesystem cannot hold, or a capacity too small for the layout.
    """
    return create_files(check_paths(paths, capacity, shards))


# ---- validation (writes nothing) ------------------------------------------------------
def check_paths(paths: Iterable[str], capacity: int, shards: int = 1) -> Plan:
    """Validate every path and the free space for ``capacity``; raises SsdError."""
    paths = list(paths)
    if not paths:
        raise SsdError("no --ssd-cache-path given")
    # The size of each file first: a huge --ssd-cache-shards leaves each file nothing, and the
    # paths of two million shards took most of a minute and half a GB to build and resolve.
    files = len(paths) * shards
    per_file = capacity // files // BLOCK * BLOCK
    if per_file < min_file_bytes():
        raise SsdError(f"--ssd-cache-capacity of {capacity} bytes split into {files} cache files "
                       f"(--ssd-cache-path x --ssd-cache-shards) leaves {per_file} bytes each; "
                       f"a file needs >= {min_file_bytes()}")
    resolved = [f for p in paths for f in _shard_paths(_cache_file_path(p), shards)]
    if len({os.path.realpath(p) for p in resolved}) != len(resolved):
        raise SsdError("the same --ssd-cache-path is given twice")
    existed: list[bool] = []
    dirs: list[str] = []
    need_by_dev: dict[int, int] = {}  # bytes still to allocate, per filesystem
    where: dict[int, str] = {}  # the nearest existing directory of the first path on each filesystem
    for p in resolved:
        exists, dev, have, missing = _check_path(p)
        existed.append(exists)
        dirs += [d for d in missing if d not in dirs]
        need_by_dev[dev] = need_by_dev.get(dev, 0) + max(0, per_file - have)
        where.setdefault(dev, _existing_ancestor(_parent(p)))
    for dev, need in need_by_dev.items():
        vfs = os.statvfs(where[dev])
        free = vfs.f_bavail * vfs.f_frsize
        if need > free:
            raise SsdError(f"--ssd-cache-capacity needs {need >> 20} MiB more on the filesystem of {where[dev]} "
                           f"but only {free >> 20} MiB are free")
    return Plan(resolved, existed, per_file, dirs)


def _cache_file_path(path: str) -> str:
    """The cache file of a path: itself, or the file in it when it is a directory (one that
    exists, or a path ending in ``/``)."""
    return os.path.join(path, CACHE_FILE_NAME) if os.path.isdir(path) or path.endswith(os.sep) else path


def _existing_ancestor(d: str) -> str:
    """``d`` or its nearest ancestor that exists."""
    while not os.path.exists(d):
        d = os.path.dirname(d)
    return d


def _missing_dirs(d: str) -> list[str]:
    """The directories from ``d`` up that do not exist yet, outermost first."""
    out: list[str] = []
    while not os.path.exists(d):
        out.append(d)
        d = os.path.dirname(d)
    return out[::-1]


def _shard_paths(path: str, shards: int) -> list[str]:
    """The cache files of one path: itself, or ``path.0`` .. ``path.N-1`` for N shards."""
    return [path] if shards == 1 else [f"{path}.{i}" for i in range(shards)]


def _parent(p: str) -> str:
    return os.path.dirname(os.path.abspath(p)) or "."


def min_file_bytes() -> int:
    """The smallest cache file the layout takes: a superblock and MIN_SEGMENTS of 2 blocks."""
    return BLOCK + MIN_SEGMENTS * 2 * BLOCK


def _geometry(file_bytes: int) -> tuple[int, int]:
    """(segment bytes, segment count) for a file of ``file_bytes``."""
    data = file_bytes - BLOCK
    seg = min(MAX_SEGMENT, data // MIN_SEGMENTS) // BLOCK * BLOCK
    if seg < 2 * BLOCK:
        raise SsdError(f"SSD cache file of {file_bytes} bytes is too small (need >= {min_file_bytes()})")
    return seg, data // seg


def _check_path(p: str) -> tuple[bool, int, int, list[str]]:
    """(exists, filesystem device, bytes already allocated, directories to create) of one
    cache file path."""
    missing = _missing_dirs(_parent(p))
    parent = _existing_ancestor(_parent(p))
    if not os.path.isdir(parent):
        raise SsdError(f"--ssd-cache-path {p}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SsdError(f"--ssd-cache-path {p}: directory {parent} is not writable")
    if not os.path.exists(p):
        _probe_dir(p, parent)
        return False, os.stat(parent).st_dev, 0, missing
    st = os.stat(p)
    if not stat.S_ISREG(st.st_mode):
        raise SsdError(f"--ssd-cache-path {p} is not a regular file")
    if not os.access(p, os.R_OK | os.W_OK):
        raise SsdError(f"--ssd-cache-path {p} is not readable and writable")
    if st.st_size:
        try:
            fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            raise SsdError(f"--ssd-cache-path {p}: cannot open with O_DIRECT: {exc.strerror}") from None
        try:
            _check_existing(p, fd)
        finally:
            os.close(fd)
    return True, st.st_dev, st.st_blocks * 512, []


def _probe_dir(p: str, parent: str) -> None:
    """Create and remove a probe file: catches read-only mounts, /proc-like filesystems,
    permissions (access() says yes to root) and filesystems without O_DIRECT (tmpfs)."""
    probe = os.path.join(parent, f".pegaflow-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as exc:
        why = "does not support O_DIRECT" if exc.errno == 22 else f"is not writable ({exc.strerror})"
        raise SsdError(f"--ssd-cache-path {p}: directory {parent} {why}") from None
    os.close(fd)
    os.unlink(probe)


def _check_existing(path: str, fd: int) -> tuple[int, int]:
    """Validate an existing non-empty file; returns its (file_bytes, segment_bytes).

    Raises SsdError for a foreign or newer file (never overwritten)."""
    buf = aligned_buffer(BLOCK)
    sb = unpack_superblock(bytes(buf[:os.preadv(fd, [buf], 0)]))
    if sb is None:
        raise SsdError(f"{path} exists and is not a PegaFlow SSD cache file (refusing to overwrite it)")
    if sb.version > FORMAT_VERSION:
        raise SsdError(f"{path} has SSD cache format {sb.version}, newer than this PegaFlow's {FORMAT_VERSION} "
                       "(refusing to overwrite it)")
    if sb.version != FORMAT_VERSION or not sb.intact:
        raise SsdError(f"{path} has a corrupt or unknown PegaFlow SSD superblock (move it away to start over)")
    return sb.file_bytes, sb.segment_bytes


# ---- creation -------------------------------------------------------------------------
def create_files(plan: Plan) -> list[CacheFile]:
    """Create ``plan``'s missing directories, then open, lock and (re-)format its files;
    raises SsdError.

    On failure every file opened so far is closed again, and every file and directory this
    call created is removed.
    """
    files: list[CacheFile] = []
    made: list[str] = []
    try:
        for d in plan.dirs:
            try:
                os.mkdir(d, 0o755)
            except FileExistsError:
                continue  # made meanwhile by someone else: theirs
            except OSError as exc:
                raise SsdError(f"--ssd-cache-path: cannot create directory {d}: {exc.strerror}") from None
            made.append(d)
        for i, (p, existed) in enumerate(zip(plan.paths, plan.existed, strict=True)):
            f = _open_file(i, p, existed, plan.file_bytes)
            f.created = not existed
            f.made_dirs = tuple(d for d in made if p.startswith(d + os.sep))
            files.append(f)
    except BaseException:
        for f in files:
            os.close(f.fd)
        discard_created(files, made)
        raise
    return files


def discard_created(files: Iterable[CacheFile], dirs: Iterable[str] = ()) -> None:
    """Remove the cache files a start created and the directories it made for them (and
    ``dirs``): what a start that failed leaves (each file is allocated in full). Files that
    were there before are kept; a directory something else was put in is kept."""
    files = list(files)
    for f in files:
        if f.created:  # created, locked and formatted by this start: ours to remove
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f.path)
    for d in sorted({*dirs, *(d for f in files for d in f.made_dirs)}, key=len, reverse=True):
        with contextlib.suppress(OSError):  # not empty: something else was put in it meanwhile
            os.rmdir(d)


def _open_file(i: int, p: str, existed: bool, file_bytes: int) -> CacheFile:
    """Open and lock the ``i``-th cache file; format it unless it holds this layout already."""
    seg_bytes, nseg = _geometry(file_bytes)
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SsdError(f"--ssd-cache-path {p}: cannot open: {exc.strerror}") from None
    created = False
    try:
        try:  # one node per cache file: a second one would overwrite the first one's log
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SsdError(f"--ssd-cache-path {p} is in use by another process") from None
        size = os.fstat(fd).st_size
        geo = _check_existing(p, fd) if size else None
        if geo != (file_bytes, seg_bytes):
            if geo is not None:
                log.warning("ssd_cache_reformat", path=p, old_bytes=geo[0], new_bytes=file_bytes,
                            reason="capacity or layout changed")
            # Removed on failure only from here: a file that appeared since validation and
            # turned out locked or foreign is another process's.
            created = not existed
            _format(fd, p, file_bytes, seg_bytes, nseg, size)
    except BaseException:
        os.close(fd)
        if created:
            os.unlink(p)
        raise
    return CacheFile(p, fd, file_bytes, seg_bytes,
                     [Segment(i, k, segment_start(k, seg_bytes)) for k in range(nseg)])


def _format(fd: int, p: str, file_bytes: int, seg_bytes: int, nseg: int, size: int) -> None:
    """Allocate the file in full (cut to ``file_bytes`` if it was ``size`` > that), void
    every segment, then write and sync the superblock."""
    try:
        os.posix_fallocate(fd, 0, file_bytes)
    except OSError as exc:
        raise SsdError(f"--ssd-cache-path {p}: cannot allocate {file_bytes >> 20} MiB: "
                       f"{exc.strerror}") from None
    if size > file_bytes:
        os.ftruncate(fd, file_bytes)
    # A re-formatted file must not resurrect records: zero the first block of every segment.
    buf = aligned_buffer(BLOCK)
    for k in range(nseg):
        os.pwritev(fd, [buf], segment_start(k, seg_bytes))
    pack_superblock(buf, file_bytes, seg_bytes, time.time_ns())
    os.pwritev(fd, [buf], 0)
    os.fsync(fd)
