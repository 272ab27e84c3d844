"""Block identity: namespaces and chained block hashes (pegaflow/core/identity.py)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import xxhash

from pegaflow.connector.placement import Placement
from pegaflow.core.identity import (
    HASH_BYTES,
    ExtraKeys,
    KVIdentity,
    MMItem,
    block_hashes,
    config_hash,
)

BS = 16


def ident(**kw: object) -> KVIdentity:
    base: dict[str, object] = dict(
        model="tiny-llama",
        config_hash=config_hash({"hidden_size": 256, "num_hidden_layers": 4}),
        model_dtype="float16",
        kv_dtype="float16",
        block_size=BS,
        num_layers=4,
        num_kv_heads=2,
        head_size=64,
        tp_size=1,
        num_shards=1,
        mla=False,
        page_bytes=4 * 2 * BS * 2 * 64 * 2,
        platform="cpu",
    )
    base.update(kw)
    return KVIdentity(**base)  # type: ignore[arg-type]


TOKENS = list(range(1000, 1000 + 5 * BS + 3))


def test_only_full_blocks_get_hashes_of_16_bytes() -> None:
    hs = block_hashes(ident().seed, TOKENS, BS)
    assert len(hs) == 5
    assert all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in hs)
    assert len(set(hs)) == 5


def test_chain_follows_the_documented_formula() -> None:
    seed = ident().seed
    assert seed == xxhash.xxh3_128_digest(ident().root.encode())
    import numpy as np

    prev = seed
    for i, h in enumerate(block_hashes(seed, TOKENS, BS)):
        blk = np.asarray(TOKENS[i * BS : (i + 1) * BS], dtype="<u4").tobytes()
        prev = xxhash.xxh3_128_digest(prev + blk)
        assert h == prev


def test_hash_is_a_prefix_property() -> None:
    seed = ident().seed
    full = block_hashes(seed, TOKENS, BS)
    other = TOKENS[: 3 * BS] + [7] * (2 * BS)
    h2 = block_hashes(seed, other, BS)
    assert h2[:3] == full[:3]
    assert h2[3] != full[3] and h2[4] != full[4]
    # a change in block 0 changes every later hash (chaining)
    changed = [TOKENS[0] + 1] + TOKENS[1:]
    assert all(a != b for a, b in zip(block_hashes(seed, changed, BS), full, strict=True))


def test_incremental_hashing_equals_one_shot() -> None:
    seed = ident().seed
    first = block_hashes(seed, TOKENS[: 2 * BS + 5], BS)
    assert block_hashes(seed, TOKENS, BS, prefix=first) == block_hashes(seed, TOKENS, BS)
    assert block_hashes(seed, TOKENS, BS, max_blocks=2) == first


def test_extra_keys_change_the_hash() -> None:
    seed = ident().seed
    plain = block_hashes(seed, TOKENS, BS)
    lora = block_hashes(seed, TOKENS, BS, ExtraKeys(lora_name="adapter-a"))
    lora_b = block_hashes(seed, TOKENS, BS, ExtraKeys(lora_name="adapter-b"))
    salt = block_hashes(seed, TOKENS, BS, ExtraKeys(cache_salt="tenant-1"))
    assert all(a != b for a, b in zip(plain, lora, strict=True))
    assert all(a != b for a, b in zip(lora, lora_b, strict=True))
    assert all(a != b for a, b in zip(plain, salt, strict=True))  # salt in block 0 reaches all via the chain
    # The adapter's path too, as vLLM hashes it: one name loaded again from elsewhere is other KV.
    at_x = block_hashes(seed, TOKENS, BS, ExtraKeys(lora_name="adapter-a", lora_path="/adapters/x"))
    at_y = block_hashes(seed, TOKENS, BS, ExtraKeys(lora_name="adapter-a", lora_path="/adapters/y"))
    assert all(a != b for a, b in zip(at_x, at_y, strict=True)) and all(a != b for a, b in zip(at_x, lora, strict=True))


def test_multimodal_item_changes_only_blocks_from_its_position_on() -> None:
    seed = ident().seed
    plain = block_hashes(seed, TOKENS, BS)
    img = MMItem("img-hash-1", offset=2 * BS + 3, length=BS)  # covers blocks 2 and 3
    mm = block_hashes(seed, TOKENS, BS, ExtraKeys(mm_items=(img,)))
    assert mm[:2] == plain[:2]
    assert all(a != b for a, b in zip(mm[2:], plain[2:], strict=True))
    other_img = block_hashes(seed, TOKENS, BS, ExtraKeys(mm_items=(dataclasses.replace(img, identifier="img-2"),)))
    assert other_img[:2] == plain[:2] and other_img[2] != mm[2]
    moved = block_hashes(seed, TOKENS, BS, ExtraKeys(mm_items=(dataclasses.replace(img, offset=2 * BS + 4),)))
    assert moved[2] != mm[2]


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "other-model"),
        ("config_hash", config_hash({"hidden_size": 512})),
        ("model_dtype", "float32"),
        ("kv_dtype", "fp8"),
        ("block_size", 32),
        ("num_layers", 6),
        ("num_kv_heads", 4),
        ("head_size", 128),
        ("page_bytes", 1234),
        ("platform", "cuda:NHD"),
    ],
)
def test_every_identity_field_changes_namespace_and_hashes(field: str, value: object) -> None:
    a, b = ident(), ident(**{field: value})
    assert a.namespace(0) != b.namespace(0)
    assert block_hashes(a.seed, TOKENS, BS)[0] != block_hashes(b.seed, TOKENS, BS)[0]


def test_tp_shards_have_distinct_namespaces_but_share_hashes() -> None:
    tp = ident(tp_size=2, num_shards=2, num_kv_heads=1)
    assert tp.namespaces == [tp.namespace(0), tp.namespace(1)]
    assert tp.namespace(0) != tp.namespace(1)
    assert tp.namespace(0) != ident().namespace(0)
    assert [tp.shard_of_rank(r) for r in range(2)] == [0, 1]
    assert Placement.of(tp).writes(0) and Placement.of(tp).writes(1)
    with pytest.raises(ValueError):
        tp.namespace(2)


def test_mla_is_one_shard_saved_by_one_rank_and_loaded_by_all() -> None:
    mla = ident(mla=True, tp_size=2, num_shards=1, num_kv_heads=1, head_size=576)
    assert mla.namespaces == [mla.namespace(0)]
    assert "shard" not in mla.namespace(0)
    assert [mla.shard_of_rank(r) for r in range(2)] == [0, 0]
    assert [Placement.of(mla).writes(r) for r in range(2)] == [True, False]
    # the same model at TP=1 is a different namespace (tp is part of the layout)
    assert mla.namespace(0) != ident(mla=True, num_kv_heads=1, head_size=576).namespace(0)


def test_replicated_kv_heads_map_ranks_onto_fewer_shards() -> None:
    rep = ident(tp_size=4, num_shards=2)
    assert [rep.shard_of_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [Placement.of(rep).writes(r) for r in range(4)] == [True, False, True, False]
    with pytest.raises(ValueError):
        ident(tp_size=4, num_shards=3)


def test_config_hash_ignores_bookkeeping_and_key_order() -> None:
    a = {"hidden_size": 256, "rope": {"theta": 1e4, "type": "x"}, "_name_or_path": "/tmp/a", "transformers_version": "5"}
    b = {"rope": {"type": "x", "theta": 1e4}, "hidden_size": 256, "_name_or_path": "/other/b"}
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash({**a, "hidden_size": 257})


_SNIPPET = """
from pegaflow.core.identity import KVIdentity, block_hashes, ExtraKeys
i = KVIdentity(model="m", config_hash="c", model_dtype="float16", kv_dtype="float16", block_size=4,
               num_layers=2, num_kv_heads=2, head_size=8, tp_size=1, num_shards=1, mla=False,
               page_bytes=512, platform="cpu")
print(b"".join(block_hashes(i.seed, list(range(40)), 4, ExtraKeys(lora_name="l", cache_salt="s"))).hex())
"""


def test_hashes_are_identical_across_processes_with_different_pythonhashseed() -> None:
    outs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", _SNIPPET], env=env, capture_output=True, text=True, check=True)
        outs.add(out.stdout.strip())
    assert len(outs) == 1 and len(next(iter(outs))) == 10 * 32

