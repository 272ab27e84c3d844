"""One HTTP client for the tests' and benchmarks' plain requests.

``httpx.get`` builds a client per call, and with it an SSL context from certifi's CA file:
~29 ms of CPU a call, against ~0.2 ms through a client kept (a 2-core VM; a test polling
Prometheus or a router's /health made hundreds). No keep-alive: a connection to a daemon a
test has stopped is never reused for the next one on its port.
"""

from __future__ import annotations

import httpx

HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
