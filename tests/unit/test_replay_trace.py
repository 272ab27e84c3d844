"""Trace reading: both formats, auto-detection, and bad lines with their line numbers."""

from __future__ import annotations

import json

import pytest

from pegaflow.core.trace import MOONCAKE, PEGAFLOW, TraceError, encode_query, read_trace

GOOD = json.dumps({"timestamp": 1500, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]})


def test_mooncake_ids_become_16_byte_hashes_and_dense_ids():
    t = read_trace([GOOD, GOOD.replace("[7, 8]", "[7, 9]")])
    assert t.format == MOONCAKE
    r0, r1 = t.requests
    assert r0.time == 1.5 and r0.tokens == 600 and r0.block_tokens == 512
    assert r0.hashes == [(7).to_bytes(16, "little"), (8).to_bytes(16, "little")]
    assert (r0.ids, r1.ids) == ([0, 1], [0, 2])
    assert (t.blocks, t.unique) == (4, 3)
    assert t.ceiling == 0.25


def test_node_query_trace_round_trips_and_namespaces_separate_equal_hashes():
    h = [bytes([i]) * 16 for i in range(3)]
    lines = [
        encode_query(10.0, "m1", h[:2], page_bytes=4096, tokens=30, instance="e0"),
        encode_query(11.5, "m2", h[:2], block_tokens=16),
        encode_query(12.0, "m1", h[:3]),
    ]
    t = read_trace(lines, route_field="instance", skip_bad=True)
    assert t.format == PEGAFLOW
    assert t.skipped == 2  # the two lines without "instance"
    t = read_trace(lines)
    assert [r.hashes for r in t.requests] == [h[:2], h[:2], h[:3]]
    assert [r.ids for r in t.requests] == [[0, 1], [2, 3], [0, 1, 4]]
    assert t.namespaces == {"m1": 4096, "m2": None}
    assert [r.tokens for r in t.requests] == [30, 32, 3 * 512]
    assert t.requests[0].time == 10.0


def test_prefix_hint_is_read_from_both_formats_and_defaults_to_true():
    blind = json.dumps({"timestamp": 1500, "input_length": 600, "hash_ids": [7], "prefix_hint": False})
    assert [r.hinted for r in read_trace([GOOD, blind]).requests] == [True, False]
    q = json.loads(encode_query(1.0, "m", [b"\x01" * 16]))
    lines = [json.dumps(q), json.dumps({**q, "prefix_hint": False}), json.dumps({**q, "prefix_hint": True})]
    assert [r.hinted for r in read_trace(lines).requests] == [True, False, True]


@pytest.mark.parametrize(
    "bad, needle",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 1, "input_length": 5, "hash_ids": "x"}', "hash_ids"),
        ('{"timestamp": 1, "input_length": 5, "hash_ids": [1.5]}', "hash id 1.5"),
        ('{"timestamp": 1, "input_length": 5, "hash_ids": [-1]}', "hash id -1"),
        ('{"timestamp": 1, "input_length": 5, "hash_ids": [true]}', "hash id True"),
        ('{"timestamp": "x", "input_length": 5, "hash_ids": [1]}', "'timestamp' must be a number"),
        ('{"input_length": 5, "hash_ids": [1]}', "missing field 'timestamp'"),
        ('{"timestamp": 1, "input_length": -5, "hash_ids": [1]}', "'input_length' must be a non-negative"),
        ('{"timestamp": 1, "input_length": 5, "hash_ids": [1], "prefix_hint": 0}', "'prefix_hint' must be true or"),
    ],
)
def test_a_malformed_mooncake_line_is_reported_with_its_line_number(bad, needle):
    with pytest.raises(TraceError) as exc:
        read_trace([GOOD, "", bad, GOOD])
    assert exc.value.line == 3
    assert needle in str(exc.value)
    assert str(exc.value).startswith("line 3: ")


@pytest.mark.parametrize(
    "bad, needle",
    [
        ('{"time": 1, "namespace": "m", "hashes": ["zz"]}', "not a hex string"),
        ('{"time": 1, "namespace": "m", "hashes": ["00ff"]}', "has 2 bytes, expected 16"),
        ('{"time": 1, "namespace": "", "hashes": []}', "'namespace' must be a non-empty string"),
        ('{"time": 1, "namespace": "m", "hashes": [], "page_bytes": 0}', "'page_bytes' must be a positive"),
        ('{"time": 1, "namespace": "m", "hashes": [], "prefix_hint": "no"}', "'prefix_hint' must be true or"),
    ],
)
def test_a_malformed_query_trace_line_is_reported(bad, needle):
    first = encode_query(0.0, "m", [b"\x01" * 16], page_bytes=4096)
    with pytest.raises(TraceError) as exc:
        read_trace([first, bad])
    assert exc.value.line == 2 and needle in exc.value.message


def test_skip_bad_counts_lines_and_leaves_no_trace_of_them():
    # The bad line's valid ids (5) must not count as distinct blocks.
    bad = json.dumps({"timestamp": 1, "input_length": 5, "hash_ids": [5, "x"]})
    t = read_trace([GOOD, bad, "nope", GOOD], skip_bad=True)
    assert t.skipped == 2 and len(t.requests) == 2
    assert t.unique == 2
    assert t.first_bad.startswith("line 2: ")


def test_auto_detection_needs_a_known_shape_and_formats_can_be_forced():
    with pytest.raises(TraceError, match="cannot tell the trace format"):
        read_trace(['{"foo": 1}'])
    with pytest.raises(TraceError, match="line 1: missing field 'time'"):
        read_trace([GOOD], "pegaflow")


def test_routing_field_must_be_present():
    with pytest.raises(TraceError, match="missing routing field 'user'"):
        read_trace([GOOD], route_field="user")
    t = read_trace([GOOD.replace("{", '{"user": 3, ', 1)], route_field="user")
    assert t.requests[0].route == "3"
