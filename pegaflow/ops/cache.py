"""``pegaflow cache``: look inside a node's cache and act on it (docs/operations.md).

    pegaflow cache inspect --namespace NS (--tokens 1,2,3 | --tokens-file F | --hashes H ...) [--metaserver ADDR]
    pegaflow cache clear (--namespace NS | --instance ID | --all)
    pegaflow cache pin --namespace NS (--tokens ... | --hashes ...) [--name NAME]
    pegaflow cache unpin ID
    pegaflow cache pins

Each command is one authenticated RPC to the node (``CacheInspect``, ``CacheClear``,
``CachePin``, ``CacheUnpin``, ``CachePins``; pegaflow/node/admin.py) and prints one line,
or one JSON document with ``--json``. A failure is one line on stderr and exit status 1
(bad arguments: 2).

Token ids become block hashes with the connector's own function
(``pegaflow.core.identity.block_hashes``): the chain is seeded by the namespace's root (the
namespace without its ``|shard=``/``|state=`` part) and cut into blocks of the root's
``bs=`` (``--block-size`` only for namespaces that do not say it), so the hashes are the
ones the engine's connector stored. LoRA adapters and cache salts enter the hash as they do
in the connector (``--lora-name``, ``--cache-salt``); multimodal prompts do not (their
items' hashes are vLLM's): give ``--hashes`` for those.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import grpc
import xxhash

from pegaflow._proto import meta_pb2, meta_pb2_grpc, node_pb2, node_pb2_grpc
from pegaflow.common.security import Security, SecurityError, sync_channel
from pegaflow.core.hosts import NODE_ADDR as DEFAULT_ADDR
from pegaflow.core.identity import HASH_BYTES, HASH_VERSION, ExtraKeys, block_hashes


class CacheError(Exception):
    """Input the command cannot use (one line for the operator)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + error
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser(prog: str) -> argparse.ArgumentParser:
    # The parents are _Parsers too: add_parser takes parents of the subparsers' own class.
    common = _Parser(add_help=False)
    common.add_argument("--addr", default=os.environ.get("PEGAFLOW_ADDR") or DEFAULT_ADDR,
                        help=f"the node's gRPC address (default $PEGAFLOW_ADDR, else {DEFAULT_ADDR})")
    common.add_argument("--auth-token-file", default="",
                        help="the node's token (else PEGAFLOW_AUTH_TOKEN[_FILE], or the node's own token file)")
    common.add_argument("--tls-ca", default="", help="PEM roots to verify the node's TLS certificate")
    common.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer (default 10)")
    common.add_argument("--json", action="store_true", help="print the answer as JSON")

    blocks = _Parser(add_help=False)
    blocks.add_argument("--namespace", "-n", required=True, help="the namespace (as /instances or status list it)")
    src = blocks.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="a prompt's token ids, comma- or space-separated; hashed as the connector "
                     "does (the namespace's root seeds the chain, its bs= cuts the blocks)")
    src.add_argument("--tokens-file", help="a file of token ids: a JSON list, or comma/space-separated")
    src.add_argument("--hashes", nargs="+", metavar="HEX",
                     help=f"block hashes ({HASH_BYTES * 2} hex digits each), in prefix order: for multimodal "
                     "prompts (their items' identifiers come from vLLM's processor, so tokens alone do not "
                     "name their blocks) and namespaces that are not a connector's")
    blocks.add_argument("--block-size", type=int, default=0,
                        help="tokens per block, for a namespace whose name does not carry bs=")
    blocks.add_argument("--lora-name", default="", help="the LoRA adapter the prompt ran with (it enters every hash)")
    blocks.add_argument("--cache-salt", default="", help="the request's cache_salt (it enters the first block's hash)")

    p = _Parser(prog=prog, description="Inspect, clear and pin a node's cache; one line per answer.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    i = sub.add_parser("inspect", parents=[common, blocks], help="where each block of a prompt is: L1, SSD, which nodes")
    i.add_argument("--metaserver", default="", help="also ask this metaserver which nodes of the cluster hold the prefix")
    c = sub.add_parser("clear", parents=[common], help="drop a namespace's, an instance's or every block (DRAM and SSD)")
    what = c.add_mutually_exclusive_group(required=True)
    what.add_argument("--namespace", "-n", help="every block of this namespace")
    what.add_argument("--instance", help="every block of the namespaces this engine instance registered")
    what.add_argument("--all", action="store_true", help="every block of every namespace")
    pin = sub.add_parser("pin", parents=[common, blocks], help="keep a prefix resident (within --max-pinned-share)")
    pin.add_argument("--name", default="", help="the pin's id (default: pin-N)")
    u = sub.add_parser("unpin", parents=[common], help="drop a pin (its blocks become evictable)")
    u.add_argument("id", help="the pin's id (pegaflow cache pins)")
    sub.add_parser("pins", parents=[common], help="list the pins")
    return p


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
        tokens = [int(v) for v in values]
    except (ValueError, TypeError) as exc:
        raise CacheError(f"token ids must be integers: {exc}") from None
    if any(not 0 <= t < 2**32 for t in tokens):
        raise CacheError("token ids must be in 0..2^32-1")
    return tokens


def hashes_for(args: argparse.Namespace) -> list[bytes]:
    if args.hashes:
        out = []
        for h in (x for v in args.hashes for x in v.split(",") if x):
            try:
                b = bytes.fromhex(h)
            except ValueError:
                raise CacheError(f"{h!r} is not hex") from None
            if len(b) != HASH_BYTES:
                raise CacheError(f"hash {h!r} has {len(b)} bytes, expected {HASH_BYTES}")
            out.append(b)
        return out
    if args.tokens_file:
        try:
            text = Path(args.tokens_file).read_text()
        except OSError as exc:
            raise CacheError(f"cannot read {args.tokens_file}: {exc.strerror or exc}") from None
    else:
        text = args.tokens
    tokens = _parse_tokens(text)
    root = namespace_root(args.namespace)
    bs = block_size_of(root, args.block_size)
    if len(tokens) < bs:
        raise CacheError(f"{len(tokens)} tokens make no full block of {bs}: nothing is stored for them")
    extra = ExtraKeys(lora_name=args.lora_name or None, cache_salt=args.cache_salt or None)
    return block_hashes(xxhash.xxh3_128_digest(root.encode()), tokens, bs, extra)


# ---- the commands ---------------------------------------------------------------------
def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _pin_dict(p: Any) -> dict[str, Any]:
    return {"id": p.id, "namespace": p.namespace, "blocks": p.blocks, "resident": p.resident, "bytes": p.bytes}


def _inspect(stub: Any, args: argparse.Namespace, sec: Security, hashes: list[bytes]) -> tuple[str, dict]:
    r = stub.CacheInspect(node_pb2.CacheInspectRequest(namespace=args.namespace, hashes=hashes), timeout=args.timeout)
    n = len(hashes)
    l1, ssd, pinned = sum(r.dram), sum(r.ssd), sum(r.pinned)
    nowhere = sum(1 for d, s in zip(r.dram, r.ssd, strict=True) if not d and not s)
    holders: list[tuple[str, str, int, int]] = []  # node, address, leading blocks, of them only on SSD
    if args.metaserver:
        with sync_channel(args.metaserver, sec) as ch:
            m = meta_pb2_grpc.MetaServiceStub(ch).QueryPrefix(
                meta_pb2.QueryPrefixRequest(namespace=args.namespace, hashes=hashes), timeout=args.timeout)
        holders = [(x.node, x.address, x.prefix_len, x.ssd_blocks) for x in m.nodes]
    blocks = [{"index": i, "hash": h.hex(), "l1": r.dram[i], "ssd": r.ssd[i], "pinned": r.pinned[i],
               "nodes": [node for node, _, k, _ in holders if k > i]} for i, h in enumerate(hashes)]
    doc = {"node": r.node_id, "namespace": args.namespace, "namespace_known": r.namespace_known, "blocks_total": n,
           "l1": l1, "l1_prefix": r.dram_prefix, "ssd": ssd, "pinned": pinned, "nowhere": nowhere,
           "cluster": [{"node": a, "address": b, "prefix_blocks": k, "ssd_blocks": s} for a, b, k, s in holders]
           if args.metaserver else None,
           "blocks": blocks}
    if not r.namespace_known:
        line = f"node {r.node_id}: namespace unknown here; 0 of {n} blocks held"
    else:
        line = (f"node {r.node_id}: {n} blocks: {l1} in L1 (leading {r.dram_prefix}, {pinned} pinned), "
                f"{ssd} on SSD, {nowhere} on neither")
    if args.metaserver:
        line += "; cluster: " + (", ".join(f"{a} {k} leading" + (f" ({s} only on its SSD)" if s else "")
                                           for a, _, k, s in holders) or "no node holds block 0")
    return line, doc


def _run(args: argparse.Namespace) -> tuple[str, Any]:
    try:
        sec = Security.load(args.auth_token_file, ca=args.tls_ca)
    except SecurityError as exc:
        raise CacheError(str(exc)) from None
    hashes = hashes_for(args) if args.command in ("inspect", "pin") else []
    with sync_channel(args.addr, sec) as ch:
        stub = node_pb2_grpc.PegaNodeStub(ch)
        t = args.timeout
        if args.command == "inspect":
            return _inspect(stub, args, sec, hashes)
        if args.command == "clear":
            c = stub.CacheClear(node_pb2.CacheClearRequest(namespace=args.namespace or "",
                                                           instance_id=args.instance or "", all=args.all), timeout=t)
            doc = {"namespaces": list(c.namespaces), "dropped_blocks": c.dropped_blocks,
                   "busy_blocks": c.busy_blocks, "ssd_blocks": c.ssd_blocks}
            return (f"cleared {len(c.namespaces)} namespace(s): {c.dropped_blocks} blocks dropped "
                    f"({c.busy_blocks} in use, freed when released), {c.ssd_blocks} SSD records"), doc
        if args.command == "pin":
            p = stub.CachePin(node_pb2.CachePinRequest(namespace=args.namespace, hashes=hashes, name=args.name),
                              timeout=t)
            doc = {"pin": _pin_dict(p.pin), "pinned_bytes": p.pinned_bytes, "max_pinned_bytes": p.max_pinned_bytes}
            return (f"pinned {p.pin.id}: {p.pin.blocks} blocks ({p.pin.resident} resident now, the rest when stored); "
                    f"{_size(p.pinned_bytes)} of {_size(p.max_pinned_bytes)} pinnable in use"), doc
        if args.command == "unpin":
            u = stub.CacheUnpin(node_pb2.CacheUnpinRequest(id=args.id), timeout=t)
            return f"unpinned {u.pin.id}: {u.pin.blocks} blocks evictable again", {"pin": _pin_dict(u.pin)}
        ps = stub.CachePins(node_pb2.CachePinsRequest(), timeout=t)
        doc = {"pins": [_pin_dict(p) for p in ps.pins], "pinned_bytes": ps.pinned_bytes,
               "max_pinned_bytes": ps.max_pinned_bytes}
        listed = "; ".join(f"{p.id} {p.resident}/{p.blocks} resident" for p in ps.pins)
        return (f"{len(ps.pins)} pin(s), {_size(ps.pinned_bytes)} of {_size(ps.max_pinned_bytes)} pinnable"
                + (f": {listed}" if listed else "")), doc


def main(argv: Sequence[str] | None = None, prog: str = "pegaflow cache") -> int:
    args = _parser(prog).parse_args(argv)
    name = f"{prog} {args.command}"
    try:
        line, doc = _run(args)
    except CacheError as exc:
        sys.stderr.write(f"{name}: error: {exc}\n")
        return 2
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        detail = (exc.details() if hasattr(exc, "details") else "") or str(exc)
        detail = " ".join(str(detail).split())
        sys.stderr.write(f"{name}: error: {code.name if code else 'RPC'}: {detail}\n")
        return 1
    sys.stdout.write((json.dumps(doc) if args.json else line) + "\n")
    return 0
