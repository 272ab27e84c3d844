"""``pegaflow cache``: look inside a node's cache and act on it (docs/operations.md).

    pegaflow cache inspect --namespace NS (--tokens 1,2,3 | --tokens-file F | --hashes H ...) [--metaserver ADDR]
    pegaflow cache clear (--namespace NS | --instance ID | --all)
    pegaflow cache pin --namespace NS (--tokens ... | --hashes ...) [--name NAME]
    pegaflow cache unpin ID
    pegaflow cache pins

Each command is one authenticated RPC to the node (``CacheInspect``, ``CacheClear``,
``CachePin``, ``CacheUnpin``, ``CachePins``; pegaflow/node/admin.py) and prints one line,
or one JSON document with ``--json``. A failure is one line on stderr and exit status 1
(bad arguments: 2). Options: ``pegaflow/config/options.py`` (CACHE rows; docs/options.md).

Token ids become block hashes with the connector's own function
(``pegaflow.core.identity.block_hashes``): the chain is seeded by the namespace's root (the
namespace without its ``|shard=``/``|state=`` part) and cut into blocks of the root's
``bs=`` (``--block-size`` only for namespaces that do not say it), so the hashes are the
ones the engine's connector stored. LoRA adapters and cache salts enter the hash as they do
in the connector (``--lora-name``, ``--cache-salt``); multimodal prompts do not (their
items' hashes are vLLM's): give ``--hashes`` for those.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
import xxhash

from pegaflow._proto import meta_pb2, meta_pb2_grpc, node_pb2, node_pb2_grpc
from pegaflow.common.security import Security, SecurityError, sync_channel
from pegaflow.config.commands import CacheConfig, load
from pegaflow.config.options import CACHE
from pegaflow.core.identity import HASH_BYTES, HASH_VERSION, ExtraKeys, block_hashes

DESCRIPTION = "Inspect, clear and pin a node's cache; one line per answer."


class CacheError(Exception):
    """Input the command cannot use (one line for the operator)."""


# ---- block hashes ---------------------------------------------------------------------
def namespace_root(namespace: str) -> str:
    """The connector's namespace root (what seeds the hash chain) of one of its namespaces."""
    if not namespace.startswith(f"pf{HASH_VERSION}|"):
        raise CacheError(f"namespace {namespace!r} is not a PegaFlow connector's (pf{HASH_VERSION}|...): "
                         "its hashes cannot be computed from tokens; give --hashes")
    return namespace.split("|shard=", 1)[0].split("|state=", 1)[0]


def block_size_of(root: str, given: int) -> int:
    m = re.search(r"\|bs=(\d+)\|", root)
    if m is not None:
        bs = int(m.group(1))
        if given and given != bs:
            raise CacheError(f"--block-size {given} contradicts the namespace's bs={bs}")
        return bs
    if given <= 0:
        raise CacheError("the namespace does not say its block size: give --block-size")
    return given


def _parse_tokens(text: str) -> list[int]:
    text = text.strip()
    try:
        if text.startswith("["):
            values = json.loads(text)
        else:
            values = [int(t) for t in re.split(r"[\s,]+", text) if t]
    except ValueError as exc:
        raise CacheError(f"token ids must be integers: {exc}") from None
    if not isinstance(values, list) or any(type(v) is not int for v in values):  # 1.9, "5", 1e400: not token ids
        raise CacheError("token ids must be integers (a JSON list of integers, or integers separated by spaces or commas)")
    tokens: list[int] = values
    if any(not 0 <= t < 2**32 for t in tokens):
        raise CacheError("token ids must be in 0..2^32-1")
    return tokens


def hashes_for(cfg: CacheConfig) -> list[bytes]:
    if cfg.hashes:
        out = []
        for h in cfg.hashes:
            try:
                b = bytes.fromhex(h)
            except ValueError:
                raise CacheError(f"{h!r} is not hex") from None
            if len(b) != HASH_BYTES:
                raise CacheError(f"hash {h!r} has {len(b)} bytes, expected {HASH_BYTES}")
            out.append(b)
        return out
    if cfg.tokens_file:
        try:
            text = Path(cfg.tokens_file).read_text()
        except OSError as exc:
            raise CacheError(f"cannot read {cfg.tokens_file}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise CacheError(f"{cfg.tokens_file} is not text (UTF-8): expected token ids") from None
    else:
        text = cfg.tokens
    tokens = _parse_tokens(text)
    root = namespace_root(cfg.namespace)
    bs = block_size_of(root, cfg.block_size)
    if len(tokens) < bs:
        raise CacheError(f"{len(tokens)} tokens make no full block of {bs}: nothing is stored for them")
    if cfg.lora_path and not cfg.lora_name:  # the path enters the hash beside the adapter's name only
        raise CacheError("--lora-path needs --lora-name (the adapter's name as the engine serves it)")
    extra = ExtraKeys(lora_name=cfg.lora_name or None, lora_path=cfg.lora_path or None,
                      cache_salt=cfg.cache_salt or None)
    return block_hashes(xxhash.xxh3_128_digest(root.encode()), tokens, bs, extra)


# ---- the commands ---------------------------------------------------------------------
def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _pin_dict(p: node_pb2.PinInfo) -> dict[str, object]:
    return {"id": p.id, "namespace": p.namespace, "blocks": p.blocks, "resident": p.resident, "bytes": p.bytes}


def _inspect(stub: node_pb2_grpc.PegaNodeStub, cfg: CacheConfig, sec: Security, hashes: list[bytes]
             ) -> tuple[str, dict[str, object]]:
    r = stub.CacheInspect(node_pb2.CacheInspectRequest(namespace=cfg.namespace, hashes=hashes), timeout=cfg.timeout)
    n = len(hashes)
    l1, ssd, pinned = sum(r.dram), sum(r.ssd), sum(r.pinned)
    nowhere = sum(1 for d, s in zip(r.dram, r.ssd, strict=True) if not d and not s)
    holders: list[tuple[str, str, int, int]] = []  # node, address, leading blocks, of them only on SSD
    if cfg.metaserver:
        with sync_channel(cfg.metaserver, sec) as ch:
            m = meta_pb2_grpc.MetaServiceStub(ch).QueryPrefix(
                meta_pb2.QueryPrefixRequest(namespace=cfg.namespace, hashes=hashes), timeout=cfg.timeout)
        holders = [(x.node, x.address, x.prefix_len, x.ssd_blocks) for x in m.nodes]
    blocks = [{"index": i, "hash": h.hex(), "l1": r.dram[i], "ssd": r.ssd[i], "pinned": r.pinned[i],
               "nodes": [node for node, _, k, _ in holders if k > i]} for i, h in enumerate(hashes)]
    doc = {"node": r.node_id, "namespace": cfg.namespace, "namespace_known": r.namespace_known, "blocks_total": n,
           "l1": l1, "l1_prefix": r.dram_prefix, "ssd": ssd, "pinned": pinned, "nowhere": nowhere,
           "cluster": [{"node": a, "address": b, "prefix_blocks": k, "ssd_blocks": s} for a, b, k, s in holders]
           if cfg.metaserver else None,
           "blocks": blocks}
    if not r.namespace_known:
        line = f"node {r.node_id}: namespace unknown here; 0 of {n} blocks held"
    else:
        line = (f"node {r.node_id}: {n} blocks: {l1} in L1 (leading {r.dram_prefix}, {pinned} pinned), "
                f"{ssd} on SSD, {nowhere} on neither")
    if cfg.metaserver:
        line += "; cluster: " + (", ".join(f"{a} {k} leading" + (f" ({s} only on its SSD)" if s else "")
                                           for a, _, k, s in holders) or "no node holds block 0")
    return line, doc


def _run(cfg: CacheConfig) -> tuple[str, dict[str, object]]:
    try:
        sec = Security.load(cfg.auth_token_file, ca=cfg.tls_ca)
    except SecurityError as exc:
        raise CacheError(str(exc)) from None
    hashes = hashes_for(cfg) if cfg.subcommand in ("inspect", "pin") else []
    with sync_channel(cfg.addr, sec) as ch:
        stub = node_pb2_grpc.PegaNodeStub(ch)
        t = cfg.timeout
        if cfg.subcommand == "inspect":
            return _inspect(stub, cfg, sec, hashes)
        if cfg.subcommand == "clear":
            c = stub.CacheClear(node_pb2.CacheClearRequest(namespace=cfg.namespace, instance_id=cfg.instance,
                                                           all=cfg.all), timeout=t)
            doc = {"namespaces": list(c.namespaces), "dropped_blocks": c.dropped_blocks,
                   "busy_blocks": c.busy_blocks, "ssd_blocks": c.ssd_blocks}
            return (f"cleared {len(c.namespaces)} namespace(s): {c.dropped_blocks} blocks dropped "
                    f"({c.busy_blocks} in use, freed when released), {c.ssd_blocks} SSD records"), doc
        if cfg.subcommand == "pin":
            p = stub.CachePin(node_pb2.CachePinRequest(namespace=cfg.namespace, hashes=hashes, name=cfg.name),
                              timeout=t)
            doc = {"pin": _pin_dict(p.pin), "pinned_bytes": p.pinned_bytes, "max_pinned_bytes": p.max_pinned_bytes}
            return (f"pinned {p.pin.id}: {p.pin.blocks} blocks ({p.pin.resident} resident now, the rest when stored); "
                    f"{_size(p.pinned_bytes)} of {_size(p.max_pinned_bytes)} pinnable in use"), doc
        if cfg.subcommand == "unpin":
            u = stub.CacheUnpin(node_pb2.CacheUnpinRequest(id=cfg.id), timeout=t)
            return f"unpinned {u.pin.id}: {u.pin.blocks} blocks evictable again", {"pin": _pin_dict(u.pin)}
        ps = stub.CachePins(node_pb2.CachePinsRequest(), timeout=t)
        doc = {"pins": [_pin_dict(p) for p in ps.pins], "pinned_bytes": ps.pinned_bytes,
               "max_pinned_bytes": ps.max_pinned_bytes}
        listed = "; ".join(f"{p.id} {p.resident}/{p.blocks} resident" for p in ps.pins)
        return (f"{len(ps.pins)} pin(s), {_size(ps.pinned_bytes)} of {_size(ps.max_pinned_bytes)} pinnable"
                + (f": {listed}" if listed else "")), doc


def main(argv: Sequence[str] | None = None, prog: str = "pegaflow cache") -> int:
    cfg = load(CACHE, prog, argv, description=DESCRIPTION)
    name = f"{prog} {cfg.subcommand}"
    try:
        line, doc = _run(cfg)
    except CacheError as exc:
        sys.stderr.write(f"{name}: error: {exc}\n")
        return 2
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        detail = (exc.details() if hasattr(exc, "details") else "") or str(exc)
        detail = " ".join(str(detail).split())
        sys.stderr.write(f"{name}: error: {code.name if code else 'RPC'}: {detail}\n")
        return 1
    sys.stdout.write((json.dumps(doc) if cfg.json else line) + "\n")
    return 0
