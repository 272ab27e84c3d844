"""The one harness that starts real processes, for the tests and for the benchmarks (bench/).

- ``node.py``: ``Node``, a ``pegaflow-node`` daemon (every test and benchmark node);
- ``meta.py``: ``MetaServer``, a ``pegaflow-meta`` metaserver;
- ``redis.py``: a ``redis-server`` or a Redis Cluster (infra/redis/'s scripts);
- ``engines.py``: vLLM engines (``EngineProc`` over pipes, run as ``engine_proc.py``;
  ``ApiServer``, the OpenAI server), KV-event subscribers; ``models.py`` builds the small
  models they load, locally;
- ``router.py``: ``pegaflow router`` and stand-in engines;
- ``p2p.py``: several hosts (``netns.py``: network namespaces) with Redis, a metaserver and
  a node each; ``p2p_client.py`` is the engine-like client run on a host (in the host's
  agent process, or as a process of its own where a test kills it);
- ``ports.py``, ``dirs.py``, ``procs.py``: free ports, scratch directories, process groups
  and the environment of every child;
- ``http.py``: one HTTP client for plain requests (``httpx.get`` costs ~29 ms of CPU a call);
- ``forked.py``: the tests' fork server, from which ``Node`` and ``MetaServer`` start
  with their imports done (turned on by tests/conftest.py).

Fixtures stay in the conftest files (and tests/integration/redis_fixtures.py); they pass
their own choices (pool sizes, ``--metrics-render-interval 0``) explicitly. The benchmarks
import nothing else of tests/ (an import-linter contract in pyproject.toml): the bounded
wait of tests/waiting.py is the harness's too and reaches them from here.
"""

from tests.waiting import wait_until

__all__ = ["wait_until"]
