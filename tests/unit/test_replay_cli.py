"""`pegaflow replay` as users run it: a real subprocess, its output, exit codes and errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SLICE = Path(__file__).parents[1] / "data" / "mooncake_slice.jsonl"
EXE = shutil.which("pegaflow")


def pegaflow(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [EXE] if EXE else [sys.executable, "-m", "pegaflow.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120, env=env)


def small_trace(tmp_path: Path) -> Path:
    p = tmp_path / "t.jsonl"
    reqs = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [5]]
    p.write_text(
        "".join(
            json.dumps(
                {"timestamp": 1000 * i, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}
            )
            + "\n"
            for i, ids in enumerate(reqs)
        )
    )
    return p


def test_json_report_has_hit_rates_ceiling_comparison_and_sweep(tmp_path):
    out = pegaflow(
        "replay",
        str(small_trace(tmp_path)),
        "--json",
        "--l1-capacity",
        "3blocks",
        "--instances",
        "2",
        "--sweep",
        "1blocks,3blocks,inf",
        "--ceiling-windows",
        "2s",
        "--compare-admission",
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["trace"]["blocks"] == 10 and d["trace"]["unique_blocks"] == 5
    assert d["ceiling"]["ceiling"] == 0.5
    labels = [r["label"] for r in d["runs"]]
    assert labels == ["shared x2, lru", "shared x2, tinylfu", "isolated x2, lru", "isolated x2, tinylfu"]
    shared_lru = d["runs"][0]
    assert shared_lru["hit_blocks"] == 4 and shared_lru["hit_rate"] == 0.4
    assert shared_lru["l1_hit_blocks"] + shared_lru["ssd_hit_blocks"] == 4
    assert [c["admission"] for c in d["shared_vs_isolated"]] == ["lru", "tinylfu"]
    curve = d["sweep"][0]
    assert curve["l1"] == ["1blocks", "3blocks", "inf"]
    assert curve["hit_rate"][-1] == 0.5  # unbounded: the ceiling
    assert [w["window"] for w in d["ceiling"]["windows"]] == ["2s", "2s"]


def test_table_and_plot(tmp_path):
    png = tmp_path / "curve.png"
    out = pegaflow("replay", str(SLICE), "--instances", "2", "--plot", str(png), "--sweep", "10%,100%")
    assert out.returncode == 0, out.stderr
    for needle in (
        "ceiling r* = (N - U) / N",
        "per-window ceilings",
        "shared vs isolated",
        "capacity sweep",
        "shared x2, lru",
        "isolated x2, lru",
    ):
        assert needle in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stderr == ""  # no progress bar when stderr is not a terminal


def test_malformed_line_is_one_line_with_its_number_and_exit_2(tmp_path):
    p = small_trace(tmp_path)
    text = p.read_text().splitlines()
    text.insert(2, '{"timestamp": 5, "hash_ids": [1, 2]')
    p.write_text("\n".join(text) + "\n")
    out = pegaflow("replay", str(p))
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert f"{p}:3: not valid JSON" in out.stderr
    ok = pegaflow("replay", str(p), "--skip-bad", "--json", "--sweep", "none")
    assert ok.returncode == 0, ok.stderr
    d = json.loads(ok.stdout)
    assert d["trace"]["skipped_lines"] == 1 and d["trace"]["requests"] == 4


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--l1-capacity", "lots"], "--l1-capacity"),
        (["--pools", "some"], "--pools"),
        (["--route", "by-magic"], "--route"),
        (["--instances", "0"], "--instances"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_flags_are_one_line(tmp_path, args, needle):
    out = pegaflow("replay", str(small_trace(tmp_path)), *args)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and needle in out.stderr


def test_help_lists_the_options_and_exits_0():
    out = pegaflow("replay", "--help")
    assert out.returncode == 0, out.stderr
    assert "--l1-capacity" in out.stdout and "25%" in out.stdout and "--ceiling-windows" in out.stdout
    out = pegaflow("--help")
    assert out.returncode == 0 and "replay" in out.stdout


def test_a_trace_without_blocks_or_requests(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}\n')
    out = pegaflow("replay", str(p), "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["trace"]["blocks"] == 0 and d["ceiling"]["ceiling"] == 0.0 and d["sweep"] == []
    p.write_text("\n")
    out = pegaflow("replay", str(p))
    assert out.returncode == 2 and out.stderr.strip().endswith("no requests")


def test_missing_file_and_unknown_command(tmp_path):
    out = pegaflow("replay", str(tmp_path / "nope.jsonl"))
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "cannot read trace" in out.stderr
    out = pegaflow("frobnicate")
    assert out.returncode == 2 and "unknown command 'frobnicate'" in out.stderr


def test_node_query_trace_with_namespaces_and_routing_by_instance(tmp_path):
    from pegaflow.core.trace import encode_query

    h = [i.to_bytes(16, "little") for i in range(4)]
    p = tmp_path / "q.jsonl"
    # Engine e2 asks for [0, 1] twice, e1 asks for [0, 1] once in another namespace.
    p.write_text(
        "\n".join(
            [
                encode_query(0.0, "m1", h[:2], page_bytes=4096, instance="e2"),
                encode_query(1.0, "m2", h[:2], page_bytes=4096, instance="e1"),
                encode_query(2.0, "m1", h[:2], page_bytes=4096, instance="e2"),
            ]
        )
        + "\n"
    )
    out = pegaflow(
        "replay",
        str(p),
        "--json",
        "--instances",
        "2",
        "--route",
        "field:instance",
        "--pools",
        "isolated",
        "--l1-capacity",
        "inf",
        "--sweep",
        "none",
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["trace"]["format"] == "pegaflow"
    assert d["trace"]["namespaces"] == {"m1": 4096, "m2": 4096}
    assert d["trace"]["unique_blocks"] == 4  # equal hashes, different namespaces
    (run,) = d["runs"]
    assert run["label"] == "isolated x2 field:instance, lru" and run["hit_blocks"] == 2
    # Precondition of the numbers above: the two engines hash to different pools.
    from pegaflow.replay.model import route_hash

    assert route_hash("e2") % 2 != route_hash("e1") % 2


def _run_on_a_terminal(args: list[str]) -> tuple[int, str]:
    """Run pegaflow with stderr on a pseudo-terminal (120 columns); returns (rc, stderr)."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    cmd = [EXE] if EXE else [sys.executable, "-m", "pegaflow.cli"]
    proc = subprocess.Popen([*cmd, *args], stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=120), b"".join(chunks).decode(errors="replace")


def test_progress_bar_on_a_terminal_unless_quiet():
    args = ["replay", str(SLICE), "--sweep", "1%,2%,5%,10%,25%,50%,100%"]
    rc, err = _run_on_a_terminal(args)
    assert rc == 0 and "req/s" in err and "%|" in err
    rc, err = _run_on_a_terminal([*args, "--quiet"])
    assert rc == 0 and err.strip() == ""


def test_parallel_jobs_give_the_same_report():
    args = ["replay", str(SLICE), "--json", "--instances", "2", "--sweep", "5%,50%", "--quiet"]
    one, two = pegaflow(*args), pegaflow(*args, "--jobs", "2")
    assert one.returncode == two.returncode == 0, one.stderr + two.stderr

    def numbers(out: str) -> tuple:
        d = json.loads(out)
        runs = [{k: v for k, v in r.items() if "second" not in k} for r in d["runs"]]
        return runs, d["sweep"], d["ceiling"], d["shared_vs_isolated"]

    assert numbers(one.stdout) == numbers(two.stdout)


def test_plot_without_matplotlib_names_the_extra_before_replaying(tmp_path, monkeypatch, capsys):
    import importlib.util

    from pegaflow.replay import command

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(command, "read_trace", lambda *a, **k: pytest.fail("replayed before checking --plot"))
    png = tmp_path / "c.png"
    assert command.main([str(SLICE), "--plot", str(png)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pegaflow[plot]" in err[0] and "matplotlib" in err[0]
    assert not png.exists()


def test_routes_side_by_side_report_load_per_route(tmp_path):
    """--route round-robin,kv-aware runs each route; every run carries its imbalance and delays."""
    import json as _json

    # Two-turn conversations behind one shared prefix: the second turn extends the first.
    turns = [[1, 2, 100 + k // 2] + ([5000 + k // 2] if k % 2 else []) for k in range(400)]
    lines = [_json.dumps({"timestamp": 100 * k, "input_length": 512 * len(ids), "output_length": 1,
                          "hash_ids": ids}) for k, ids in enumerate(turns)]
    path = tmp_path / "hot.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = subprocess.run(
        [sys.executable, "-m", "pegaflow.cli", "replay", str(path), "--instances", "4", "--pools", "isolated",
         "--route", "round-robin,kv-aware", "--sweep", "none", "--l1-capacity", "inf", "--json", "--quiet"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    runs = {r["scenario"]["route"]: r for r in _json.loads(out.stdout)["runs"]}
    assert set(runs) == {"round-robin", "kv-aware"}
    assert runs["round-robin"]["imbalance"] == 1.0
    assert 1.0 <= runs["kv-aware"]["imbalance"] <= 1.25 + 0.05
    assert runs["kv-aware"]["hit_blocks"] > runs["round-robin"]["hit_blocks"]
    for r in runs.values():
        assert r["delay_p99_s"] >= r["delay_mean_s"] >= 0.0
    bad = subprocess.run([sys.executable, "-m", "pegaflow.cli", "replay", str(path), "--route", "kv-aware,field:a,field:b"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "field" in bad.stderr
