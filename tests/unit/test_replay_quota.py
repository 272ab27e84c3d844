"""`pegaflow replay --namespace-quota`: the node's quota rule on a trace with two namespaces,
per-namespace hit rates in the report, and one-line errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

from pegaflow.core.trace import encode_query
from tests.unit.test_replay_cli import pegaflow


def two_namespace_trace(tmp_path: Path, steps: int = 120) -> tuple[Path, Path]:
    """A query trace where `hot` asks for 4 documents of 4 blocks at random and `scan` asks
    for 6 new documents per hot request; and the same trace with `hot`'s requests only."""
    rng = random.Random(3)
    docs = [[rng.randbytes(16) for _ in range(4)] for _ in range(4)]
    both, alone = [], []
    for i in range(steps):
        line = encode_query(float(i), "hot", docs[rng.randrange(4)])
        both.append(line)
        alone.append(line)
        both += [encode_query(float(i), "scan", [rng.randbytes(16) for _ in range(4)]) for _ in range(6)]
    a, b = tmp_path / "both.jsonl", tmp_path / "alone.jsonl"
    a.write_text("\n".join(both) + "\n")
    b.write_text("\n".join(alone) + "\n")
    return a, b


def hit_rates(trace: Path, *flags: str) -> dict[str, float]:
    out = pegaflow("replay", str(trace), "--json", "--l1-capacity", "64blocks", "--sweep", "none", *flags)
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)["runs"][0]
    return {n: d["hit_rate"] for n, d in run["namespaces"].items()}


def test_a_guarantee_covering_the_working_set_keeps_the_hit_rate_it_has_alone(tmp_path: Path) -> None:
    both, alone = two_namespace_trace(tmp_path)
    by_itself = hit_rates(alone)["hot"]
    assert by_itself == 1 - 16 / (120 * 4)  # only the 16 first accesses miss
    assert hit_rates(both)["hot"] < by_itself - 0.3  # the scan flushes it
    with_quota = hit_rates(both, "--namespace-quota", "hot=0.25")  # 16 of 64 blocks
    assert with_quota["hot"] == by_itself and with_quota["scan"] == 0.0


def test_a_maximum_caps_the_scan_in_replay_as_on_the_node(tmp_path: Path) -> None:
    both, _ = two_namespace_trace(tmp_path)
    capped = hit_rates(both, "--namespace-quota", "scan=max:0.75")
    assert capped["hot"] == 1 - 16 / (120 * 4)


def test_the_table_shows_each_namespace_and_the_quotas(tmp_path: Path) -> None:
    both, _ = two_namespace_trace(tmp_path)
    out = pegaflow("replay", str(both), "--l1-capacity", "64blocks", "--sweep", "none",
                   "--namespace-quota", "hot=min:25%/max:0.5")
    assert out.returncode == 0, out.stderr
    assert "per namespace (prefix hit rate in blocks); quotas hot=min:0.25/max:0.5" in out.stdout
    rows = [ln.split() for ln in out.stdout.splitlines() if ln.strip().startswith(("hot ", "scan "))]
    assert [r[0] for r in rows] == ["hot", "scan"] and rows[0][1] == "480"


def test_bad_quotas_are_one_line_errors(tmp_path: Path) -> None:
    both, _ = two_namespace_trace(tmp_path, steps=2)
    for flags, says in ((["hot=0.7", "scan=0.4"], "sum to 1.1"), (["hot=2"], "outside (0, 1]")):
        out = pegaflow("replay", str(both), *[x for f in flags for x in ("--namespace-quota", f)])
        assert out.returncode == 2
        assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def mooncake_two_models(tmp_path: Path) -> Path:
    """A Mooncake trace whose lines carry a `model`: `hot` reuses 4 prefixes of 4 ids, `scan`
    never repeats; both use the same small ids, which name different blocks per model."""
    rng = random.Random(4)
    lines = []
    nxt = 1000
    for i in range(120):
        doc = rng.randrange(4)
        lines.append({"timestamp": i, "input_length": 2048, "output_length": 1, "model": "hot",
                      "hash_ids": [doc * 4 + k for k in range(4)]})
        for _ in range(6):
            lines.append({"timestamp": i, "input_length": 2048, "output_length": 1, "model": "scan",
                          "hash_ids": list(range(nxt, nxt + 4))})
            nxt += 4
    lines.append({"timestamp": 121, "input_length": 2048, "output_length": 1, "model": "scan",
                  "hash_ids": [0, 1, 2, 3]})  # hot's ids, another model: a miss
    p = tmp_path / "mc.jsonl"
    p.write_text("".join(json.dumps(d) + "\n" for d in lines))
    return p


def test_a_mooncake_field_maps_requests_to_namespaces(tmp_path: Path) -> None:
    trace = mooncake_two_models(tmp_path)
    rates = hit_rates(trace, "--namespace-field", "model", "--namespace-quota", "hot=0.25")
    assert rates["hot"] == 1 - 16 / (120 * 4) and rates["scan"] == 0.0
    assert set(hit_rates(trace)) == {"mooncake"}  # without the flag: one namespace
    out = pegaflow("replay", str(trace), "--namespace-field", "tenant", "--sweep", "none")
    assert out.returncode == 2 and "missing namespace field 'tenant'" in out.stderr
