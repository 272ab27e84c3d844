"""Block identity: the one namespace and block-hash function of PegaFlow.

A stored block is named by ``(namespace, hash)``:

* The **namespace** says which KV bytes are interchangeable. It is built from the model's
  identity (its name plus a hash of its config), the model and KV dtypes, the block size,
  the number of layers, the KV heads and head size of one shard, the TP size and, for
  sharded KV, the shard. Engines with equal namespaces share blocks; different namespaces
  never see each other's blocks. Replicated KV (MLA: the latent is identical on every TP
  rank) has exactly one shard, so it is stored once per model, not once per rank.
* The **block hash** is a chain over the token ids of full blocks::

      h_{-1} = H(root)            root = the namespace without its shard part
      h_i    = H(h_{i-1} || token_ids of block i || extra keys of block i)

  with ``H = xxh3_128`` (16-byte digests). The chain is seeded by the shard-independent
  root, so the TP shards of one block share one hash and one ``Query`` can ask for "every
  shard of this prefix"; the namespace still separates shards.

Everything here is a pure function of its arguments: no ``hash()``, no per-process seed,
so hashes are identical across processes, hosts and restarts whatever ``PYTHONHASHSEED``
is (vLLM's own block hashes are not, unless that variable is set). Only full blocks have
hashes; a trailing partial block is never cached.

Byte encodings are fixed and versioned by ``HASH_VERSION``: token ids are little-endian
uint32, strings are UTF-8 with a length prefix, integers little-endian. Changing any of it
must bump ``HASH_VERSION`` (it is part of every namespace), so old and new engines can
never mistake each other's blocks.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from pegaflow.core._sketch import block_keys as _native_block_keys  # pegaflow/native/sketch.c

# Part of every namespace; bump when any encoding below changes.
HASH_VERSION = 1
HASH_BYTES = 16  # every block hash in PegaFlow: xxh3_128 digests (the index, the events, the wire)

# Config keys that say where or by what a config was written, not what the model computes.
_VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "name_or_path", "transformers_version", "_commit_hash"})


@dataclass(frozen=True)
class KVIdentity:
    """Everything that decides whether two engines' KV bytes for the same tokens are equal.

    ``num_kv_heads`` is per shard (what one rank's cache holds). ``num_shards`` is how many
    distinct KV shards the TP group holds: ``tp_size`` for ordinary attention, 1 for MLA
    (replicated latent), and fewer than ``tp_size`` when KV heads are replicated across
    ranks. ``page_bytes`` is the size of one block's page in one shard (all layers, K and V).
    ``platform`` names the device kind and KV memory layout (pages hold raw cache memory,
    so a CPU page and a CUDA page of the same model are not interchangeable).
    ``state_page_bytes`` (hybrid state-space models, else 0) is the size of one state page
    in one shard: every state-space layer's state at one block boundary. State pages live
    in their own namespaces (``state_namespaces``), keyed by the hash of the block that
    ends at their boundary; the attention pages stay in ``namespaces``.
    """

    model: str
    config_hash: str
    model_dtype: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_size: int
    num_shards: int
    mla: bool
    page_bytes: int
    platform: str
    state_page_bytes: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.num_layers <= 0 or self.page_bytes <= 0 or self.state_page_bytes < 0:
            raise ValueError(f"invalid KV identity {self!r}")
        if not 1 <= self.num_shards <= self.tp_size or self.tp_size % self.num_shards:
            raise ValueError(f"num_shards={self.num_shards} must divide tp_size={self.tp_size}")

    @property
    def root(self) -> str:
        """The shard-independent part of the namespace; it seeds every hash chain."""
        kind = "mla" if self.mla else "mha"
        return (
            f"pf{HASH_VERSION}|{self.model}|cfg={self.config_hash}|dtype={self.model_dtype}"
            f"|kv={self.kv_dtype}|bs={self.block_size}|layers={self.num_layers}"
            f"|{kind}:heads={self.num_kv_heads}x{self.head_size}|page={self.page_bytes}"
            f"|tp={self.tp_size}|{self.platform}"
        )

    def namespace(self, shard: int) -> str:
        """Namespace of one KV shard. With a single shard (TP=1 or MLA) there is no suffix."""
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard {shard} out of range 0..{self.num_shards - 1}")
        if self.num_shards == 1:
            return self.root
        return f"{self.root}|shard={shard}/{self.num_shards}"

    @property
    def namespaces(self) -> list[str]:
        """Every shard's namespace, in shard order (what a hit must be present in)."""
        return [self.namespace(s) for s in range(self.num_shards)]

    @property
    def state_namespaces(self) -> list[str]:
        """Every shard's state-page namespace (hybrid state-space models; else empty)."""
        if not self.state_page_bytes:
            return []
        return [f"{ns}|state={self.state_page_bytes}" for ns in self.namespaces]

    def shard_of_rank(self, tp_rank: int) -> int:
        """The KV shard TP rank ``tp_rank`` holds (ranks holding replicas share a shard)."""
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {tp_rank} out of range 0..{self.tp_size - 1}")
        return tp_rank * self.num_shards // self.tp_size

    @property
    def seed(self) -> bytes:
        """``h_{-1}``: the hash of the root namespace."""
        return xxhash.xxh3_128_digest(self.root.encode())


def config_hash(config: Mapping[str, object]) -> str:
    """A stable 64-bit hex digest of a model config dict (e.g. ``PretrainedConfig.to_dict()``).

    Keys are sorted, nested dicts included; bookkeeping keys (name or path, transformers
    version) are dropped so the same model loaded from another folder hashes equally.
    """
    clean = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    text = json.dumps(clean, sort_keys=True, default=str, separators=(",", ":"))
    return xxhash.xxh3_64_hexdigest(text.encode())


@dataclass(frozen=True)
class MMItem:
    """A multimodal input: its content hash and the prompt positions its placeholder covers."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class ExtraKeys:
    """Per-request inputs besides token ids that change the KV of a block.

    * ``lora_name`` and ``lora_path`` enter every block (another adapter gives other KV for
      every token; the path, as vLLM's own hash takes it: one name loaded again from another
      path, or two engines with one name for other weights, are other KV);
    * ``cache_salt`` enters block 0 only, and through the chain every later block;
    * a multimodal item enters every block its placeholder overlaps, with its offset
      relative to the block start (the same image at another position is other KV).
    """

    lora_name: str | None = None
    cache_salt: str | None = None
    lora_path: str | None = None
    mm_items: tuple[MMItem, ...] = ()

    def for_block(self, start: int, end: int) -> bytes:
        """The encoded extra keys of the block covering token positions ``[start, end)``."""
        out = bytearray()
        if self.lora_name:
            out += b"L" + _str(self.lora_name)
            if self.lora_path:  # a tag of its own: no encoding from before it means the same
                out += b"P" + _str(self.lora_path)
        if self.cache_salt and start == 0:
            out += b"S" + _str(self.cache_salt)
        for item in self.mm_items:
            if item.offset < end and item.offset + item.length > start:
                out += b"M" + _str(item.identifier) + struct.pack("<q", item.offset - start)
        return bytes(out)


NO_EXTRA_KEYS = ExtraKeys()


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<I", len(b)) + b


def block_hashes(
    seed: bytes,
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    extra: ExtraKeys = NO_EXTRA_KEYS,
    *,
    prefix: Sequence[bytes] = (),
    max_blocks: int | None = None,
) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block is ignored).

    ``seed`` is ``KVIdentity.seed``. ``prefix`` may hold hashes already computed for the
    first blocks of the same tokens; they are kept and the chain continues after them, so
    a growing sequence is hashed incrementally. ``max_blocks`` caps the result length.
    """
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out = list(prefix[:n])
    if len(out) >= n:
        return out
    tokens = np.asarray(token_ids[: n * block_size], dtype="<u4")
    prev = out[-1] if out else seed
    for i in range(len(out), n):
        start = i * block_size
        h = xxhash.xxh3_128()
        h.update(prev)
        h.update(tokens[start : start + block_size].tobytes())
        keys = extra.for_block(start, start + block_size)
        if keys:
            h.update(keys)
        prev = h.digest()
        out.append(prev)
    return out


def namespace_salt(name: str) -> int:
    """64-bit salt of a namespace name, identical on every host and in every process."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def block_key(salt: int, hash_: bytes) -> int:
    """The one 64-bit integer key of a block (admission sketches, HLL ceilings): the hash's
    low 64 bits (already uniformly random) salted with its namespace's name, so equal
    hashes of different namespaces differ and keys agree across hosts (cluster unions)."""
    return int.from_bytes(hash_[:8], "little") ^ salt


def block_keys(salt: int, hashes: Iterable[bytes]) -> list[int]:
    """``[block_key(salt, h) for h in hashes]``, in C (a test holds the two equal)."""
    return _native_block_keys(salt, hashes if isinstance(hashes, list) else list(hashes))
