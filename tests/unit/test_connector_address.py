"""Where the connector finds its node: the original's environment variables and config keys."""

from __future__ import annotations

import pytest

from pegaflow.connector.link import node_address


@pytest.mark.parametrize(
    "env, extra, want",
    [
        ({}, {}, "127.0.0.1:50055"),
        ({"PEGAFLOW_HOST": "http://127.0.0.1"}, {}, "127.0.0.1:50055"),  # the original's default form
        ({"PEGAFLOW_HOST": "http://10.0.0.7", "PEGAFLOW_PORT": "6000"}, {}, "10.0.0.7:6000"),
        ({"PEGAFLOW_HOST": "10.0.0.7"}, {}, "10.0.0.7:50055"),
        ({"PEGAFLOW_HOST": "http://10.0.0.7:6001"}, {}, "10.0.0.7:6001"),
        ({"PEGAFLOW_HOST": "http://10.0.0.7:6001", "PEGAFLOW_PORT": "6002"}, {}, "10.0.0.7:6002"),
        ({"PEGAFLOW_HOST": "http://[::1]"}, {}, "[::1]:50055"),
        ({}, {"pegaflow.host": "http://10.0.0.8", "pegaflow.port": 50070}, "10.0.0.8:50070"),
        ({}, {"pegaflow.host": "http://10.0.0.8"}, "10.0.0.8:50055"),
        # The original's precedence: the environment first, then the config keys.
        ({"PEGAFLOW_HOST": "http://10.0.0.1"}, {"pegaflow.host": "http://10.0.0.8", "pegaflow.port": 1}, "10.0.0.1:1"),
        ({"PEGAFLOW_PORT": "7"}, {"pegaflow.host": "10.0.0.8", "pegaflow.port": 1}, "10.0.0.8:7"),
        # pegaflow.addr (ours) names the whole address and wins.
        ({"PEGAFLOW_HOST": "10.0.0.1"}, {"pegaflow.addr": "10.0.0.9:1234"}, "10.0.0.9:1234"),
    ],
)
def test_node_address(env, extra, want):
    assert node_address(env, extra) == want


@pytest.mark.parametrize(
    "env, extra",
    [
        ({"PEGAFLOW_PORT": "fifty"}, {}),
        ({"PEGAFLOW_PORT": "70000"}, {}),
        ({"PEGAFLOW_HOST": "http://"}, {}),
        ({}, {"pegaflow.addr": "10.0.0.9"}),
    ],
)
def test_an_address_that_cannot_be_read_is_a_clear_error(env, extra):
    with pytest.raises(ValueError, match="PegaFlow|pegaflow.addr"):
        node_address(env, extra)
