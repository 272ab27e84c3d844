"""The one backoff of keys out of rotation (pegaflow/common/backoff.py): peers and the
metaserver in the puller, engines in the router."""

from __future__ import annotations

from pegaflow.common.backoff import Backoff


def test_backoff_doubles_while_failing_and_clears_on_success():
    now = [0.0]
    bo = Backoff(1.0, 4.0, clock=lambda: now[0])
    assert bo.fail("p") == 1.0 and bo.skip("p")
    now[0] = 1.5
    assert not bo.skip("p")
    assert bo.fail("p") == 2.0 and bo.fail("p") == 4.0 and bo.fail("p") == 4.0
    assert bo.active() == 1
    bo.ok("p")
    assert not bo.skip("p") and bo.active() == 0


def test_a_cap_below_the_base_is_the_period():
    assert Backoff(0.5, 0.2, clock=lambda: 0.0).fail("e") == 0.2


def test_keys_back_off_independently():
    now = [0.0]
    bo = Backoff(1.0, 8.0, clock=lambda: now[0])
    bo.fail("a")
    bo.fail("a")
    assert bo.fail("b") == 1.0 and bo.fail("a") == 4.0
    now[0] = 2.0
    assert bo.skip("a") and not bo.skip("b") and bo.active() == 1
