"""`pegaflow replay` on garbage: always one line on stderr, naming the line when a line is to
blame, exit 2 (bad input) or 1 (unreadable file); never a traceback, never a huge allocation."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pegaflow.replay.command import main

ROOT = Path(__file__).resolve().parents[2]
GOOD = '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}'


def mooncake(**over: object) -> str:
    d = {"timestamp": 1000, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}
    d.update(over)
    return json.dumps(d, allow_nan=True)


LINES: dict[str, str] = {
    "time 1e300": mooncake(timestamp=1e300),
    "time -1e18": mooncake(timestamp=-1e18),
    "time 1e16 ms": mooncake(timestamp=1e16),
    "time NaN": mooncake(timestamp=float("nan")),
    "time Infinity": mooncake(timestamp=float("inf")),
    "time -Infinity": mooncake(timestamp=float("-inf")),
    "time 1e309": mooncake().replace('"timestamp": 1000', '"timestamp": 1e309'),
    "time string": mooncake(timestamp="soon"),
    "time bool": mooncake(timestamp=True),
    "nested arrays": "[" * 200_000 + "]" * 200_000,
    "nested objects": '{"a":' * 200_000 + "1" + "}" * 200_000,
    "nested in a field": mooncake(hash_ids=[[[[1]]]]),
    "5000-digit integer": mooncake().replace('"input_length": 1024', '"input_length": ' + "9" * 5000),
    # Past a float's range, within JSON's 4,300 digits: an OverflowError in the arithmetic.
    "401-digit time": mooncake().replace('"timestamp": 1000', '"timestamp": 1' + "0" * 400),
    "401-digit done": mooncake(done=0).replace('"done": 0', '"done": 1' + "0" * 400),
    "401-digit input_length": mooncake().replace('"input_length": 1024', '"input_length": 1' + "0" * 400),
    "pegaflow 401-digit time": '{"time": 1%s, "namespace": "n", "hashes": []}' % ("0" * 400),
    "pegaflow 401-digit tokens": '{"time": 1, "namespace": "n", "hashes": [], "tokens": 1%s}' % ("0" * 400),
    "pegaflow 401-digit block_tokens": '{"time": 1, "namespace": "n", "hashes": [], "block_tokens": 1%s}' % ("0" * 400),
    "array": "[1, 2, 3]",
    "string": '"hello"',
    "null": "null",
    "number": "42",
    "BOM": "\ufeff" + GOOD,
    "NUL": GOOD[:10] + "\0" + GOOD[10:],
    "hash id float": mooncake(hash_ids=[1.0]),
    "hash id bool": mooncake(hash_ids=[True]),
    "hash id negative": mooncake(hash_ids=[-1]),
    "hash id 2**128": mooncake(hash_ids=[2**128]),
    "hash ids string": mooncake(hash_ids="1,2"),
    "input_length negative": mooncake(input_length=-5),
    "input_length float": mooncake(input_length=1.5),
    "no hash_ids": '{"timestamp": 0, "input_length": 1}',
    "pegaflow bad hex": '{"time": 1, "namespace": "n", "hashes": ["zz"]}',
    "pegaflow short hash": '{"time": 1, "namespace": "n", "hashes": ["00ff"]}',
    "pegaflow empty namespace": '{"time": 1, "namespace": "", "hashes": []}',
    "pegaflow NaN time": '{"time": NaN, "namespace": "n", "hashes": []}',
    "pegaflow page conflict": ('{"time": 1, "namespace": "n", "hashes": [], "page_bytes": 1}\n'
                               '{"time": 2, "namespace": "n", "hashes": [], "page_bytes": 2}'),
    "truncated JSON": GOOD[:-5],
    "unknown format": '{"foo": 1}',
}


def run(path: Path, capsys, *extra: str) -> tuple[int, list[str]]:  # type: ignore[no-untyped-def]
    code = main([str(path), "--quiet", "--sweep", "none", *extra])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err.strip().splitlines()


@pytest.mark.parametrize("name", list(LINES))
def test_a_garbage_line_is_one_line_with_its_number(name, tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    body = LINES[name]
    p.write_text(f"{GOOD}\n{body}\n", encoding="utf-8")
    code, err = run(p, capsys)
    assert code == 2 and len(err) == 1 and len(err[0]) < 300, (name, err)
    assert ":2:" in err[0] or ":3:" in err[0], (name, err)  # the bad line (after one good one)
    if "\n" not in body:  # --skip-bad counts it and replays the rest
        code, err = run(p, capsys, "--skip-bad")
        assert code == 0, (name, err)


def gz_of(text: str) -> bytes:
    return gzip.compress(text.encode(), mtime=0)


def _lines(n: int) -> str:
    return "".join(mooncake(timestamp=i, hash_ids=list(range(i, i + 8))) + "\n" for i in range(n))


FILES: dict[str, bytes] = {
    "truncated gz": gz_of(_lines(20000))[:20000],
    "corrupt gz": (lambda b: b[:5000] + bytes(x ^ 0x5A for x in b[5000:5200]) + b[5200:])(gz_of(_lines(20000))),
    "not gzip": b"this is not gzip at all\n" * 10,
    "gz of binary": gz_of("") + b"\x00\xff" * 100,
}


@pytest.mark.parametrize("name", list(FILES))
def test_a_damaged_gz_is_one_line(name, tmp_path, capsys):
    p = tmp_path / "t.jsonl.gz"
    p.write_bytes(FILES[name])
    code, err = run(p, capsys)
    assert code in (1, 2) and len(err) == 1, (name, err)


@pytest.mark.parametrize("data", [b"\xff\xfe\x00garbage\x80\x81\n", bytes(range(256)) * 8], ids=["latin", "all-bytes"])
def test_bytes_that_are_not_utf8_are_one_line(data, tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_bytes(GOOD.encode() + b"\n" + data)
    code, err = run(p, capsys)
    assert code == 2 and len(err) == 1 and ":2:" in err[0], err


def test_a_non_utf8_line_is_skipped_with_skip_bad(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_bytes((GOOD + "\n").encode() * 5 + b"\xff\xfe garbage\n" + (GOOD + "\n").encode() * 5)
    code, err = run(p, capsys, "--skip-bad")
    assert code == 0, err
    code = main([str(p), "--skip-bad", "--sweep", "none", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["trace"]["requests"] == 10 and report["trace"]["skipped_lines"] == 1, report


def test_page_bytes_zero_is_one_line(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_text(GOOD + "\n")
    with pytest.raises(SystemExit) as exit_:
        main([str(p), "--page-bytes", "0", "--l1-capacity", "1gb"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "--page-bytes" in err[0], err


def test_files_that_cannot_be_read_are_one_line(tmp_path, capsys):
    for path in (tmp_path / "missing.jsonl", tmp_path):
        code, err = run(path, capsys)
        assert code == 1 and len(err) == 1, err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    code, err = run(empty, capsys)
    assert code == 2 and len(err) == 1 and "no requests" in err[0]


def test_a_trace_spanning_centuries_costs_what_its_requests_cost(tmp_path, capsys):
    # Two requests 30,000 years apart with 15m windows: one slot per window would be ~1e9 slots.
    p = tmp_path / "t.jsonl"
    p.write_text(mooncake(timestamp=0) + "\n" + mooncake(timestamp=1e15) + "\n")
    assert main([str(p), "--quiet", "--sweep", "none", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["trace"]["requests"] == 2


def test_the_console_command_prints_no_traceback_either(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(LINES["nested arrays"])
    out = subprocess.run([sys.executable, "-m", "pegaflow.cli", "replay", str(p)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
