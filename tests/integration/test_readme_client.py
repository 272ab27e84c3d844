"""The README's client example ("The client library") runs as written against a real node.

Twice, as a user who runs it again would: the second time every block is stored already, so
Reserve hands out no page (offsets -1, no reservation) and the example must neither copy to
offset -1 nor commit reservation 0. Both times the pages it loads back equal the blocks saved.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import xxhash

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
README_ADDR = '"127.0.0.1:50055"'


def readme_example() -> str:
    section = README.read_text().split("\n## The client library", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m is not None, "README's client library section has no python block"
    return m.group(1)


def test_the_readme_client_example_saves_and_loads_and_runs_again(node):  # type: ignore[no-untyped-def]
    example = readme_example()
    assert README_ADDR in example
    code = example.replace(README_ADDR, repr(node.addr))
    torch.manual_seed(0)
    kv_layers = [torch.randn(8, 2, 16, 8) for _ in range(3)]  # (blocks, K/V, tokens, head dim) per layer
    block_ids, other_block_ids = [1, 3, 5, 7], [0, 2, 4, 6]
    block_hashes = [xxhash.xxh3_128_digest(f"readme:{i}".encode()) for i in range(len(block_ids))]
    saved = [[layer[b].clone() for b in block_ids] for layer in kv_layers]

    for run in range(2):
        for layer in kv_layers:
            layer[other_block_ids] = 0.0  # what the load must fill in again
        names: dict[str, object] = {"kv_layers": kv_layers, "block_ids": block_ids,
                                    "other_block_ids": other_block_ids, "block_hashes": block_hashes}
        try:
            exec(compile(code, f"README.md (run {run + 1})", "exec"), names)  # noqa: S102
        finally:
            client = names.get("c")
            if client is not None:
                client.close()  # type: ignore[attr-defined]
        q, r = names["q"], names["r"]
        assert q.hit_blocks == len(block_ids), run  # type: ignore[attr-defined]
        if run == 1:  # stored already: nothing reserved, nothing copied or committed
            assert names["new"] == [] and r.reservation_id == 0, r  # type: ignore[attr-defined]
        for layer, want in zip(kv_layers, saved, strict=True):
            for b, page in zip(other_block_ids, want, strict=True):
                assert torch.equal(layer[b], page), (run, b)
