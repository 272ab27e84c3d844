"""The CUDA data path, bytes identical: KV caches on the GPU saved into a real node's pool
and loaded back (``save_pages``/``load_pages`` -> ``pegaflow.client.batched`` with the pool
registered with CUDA) for every layout the connector knows.

Skipped, with the reason printed, where CUDA is absent (tests/gpu/conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from pegaflow.client import PegaClient, load_pages, save_pages
from pegaflow.client.cuda import registration
from pegaflow.connector.layout import build_page_layout
from tests.unit.test_connector_layout import LAYOUTS, NB


def _on_cuda(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to("cuda") for k, v in caches.items()}  # .to keeps a permuted (HND) tensor's strides


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_save_then_load_through_the_node_restores_every_byte(kind: str, node) -> None:  # noqa: ANN001
    make, _, _ = LAYOUTS[kind]
    src = _on_cuda(make())
    layout = build_page_layout(src)
    client = PegaClient(node.addr)
    try:
        client.register({f"gpu-{kind}": layout.page_bytes})
        rng = np.random.default_rng(1)
        blocks = [int(b) for b in rng.permutation(NB)[:8]]
        hashes = [xxhash.xxh3_128_digest(f"{kind}:{i}".encode()) for i in range(len(blocks))]
        res = client.reserve(f"gpu-{kind}", hashes)
        assert all(o >= 0 for o in res.offsets)
        moved = save_pages(layout.segments, blocks, client.pool, res.offsets)
        assert moved == len(blocks) * layout.page_bytes
        assert client.commit(res.reservation_id) == len(blocks)
        assert registration(client.pool).pinned, "the pool pages a copy touched are registered with CUDA"

        q = client.query([f"gpu-{kind}"], hashes)
        assert q.hit_blocks == len(blocks)
        dst_caches = _on_cuda({k: torch.zeros_like(v) for k, v in make().items()})
        dst = build_page_layout(dst_caches)
        targets = [int(b) for b in rng.permutation(NB)[:8]]
        load_pages(dst.segments, targets, client.pool, q.offsets[f"gpu-{kind}"])
        client.release(q.lease_id)
        for b_src, b_dst in zip(blocks, targets, strict=True):
            assert torch.equal(layout.page(b_src), dst.page(b_dst)), f"block {b_src} -> {b_dst}"
    finally:
        client.close()


def test_groups_load_only_the_blocks_a_window_holds(node) -> None:  # noqa: ANN001
    ka = torch.randint(0, 255, (NB, 4096), dtype=torch.uint8, device="cuda")
    kb = torch.randint(0, 255, (NB, 4096), dtype=torch.uint8, device="cuda")
    groups = [0, 1]
    client = PegaClient(node.addr)
    try:
        client.register({"gpu-groups": 8192})
        hashes = [xxhash.xxh3_128_digest(f"g:{i}".encode()) for i in range(2)]
        res = client.reserve("gpu-groups", hashes)
        save_pages([ka, kb], [(1, 2), (3, 4)], client.pool, res.offsets, groups)
        client.commit(res.reservation_id)
        out = [torch.full_like(ka, 7), torch.full_like(kb, 7)]
        load_pages(out, [(5, -1), (6, 9)], client.pool, res.offsets, groups)
        assert torch.equal(out[0][5], ka[1]) and torch.equal(out[0][6], ka[3]) and torch.equal(out[1][9], kb[4])
        assert bool((out[1][:9] == 7).all())
    finally:
        client.close()
