"""bench/dataplane.py --parts: which background parts an "on" window switches on."""

from __future__ import annotations

import argparse

import pytest

from bench.dataplane import PARTS, parse_parts, quiet


def test_parts_are_checked_and_none_is_an_a_a_run():
    assert parse_parts("ssd,scrape") == ["ssd", "scrape"]
    assert parse_parts(",".join(PARTS)) == list(PARTS)
    assert parse_parts("none") == []  # both modes off: nothing may be required of the "on" windows
    for bad in ("", "ssd,disk", "none,ssd"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_parts(bad)


def test_an_a_a_run_never_counts_as_quiet_but_a_part_that_did_nothing_does():
    idle = {"background": {"ssd_written_bytes": 0, "l1_evicted_blocks": 0, "events_published_blocks": 0,
                           "sketches_published": 0, "scrapes": 0, "stats_calls": 0}}
    assert quiet(idle, parse_parts("none")) == []
    assert quiet(idle, parse_parts("ssd")) != []
