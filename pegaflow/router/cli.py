"""``pegaflow router`` (alias ``pegaflow-router``, the original's name).

    pegaflow router --engine http://10.0.0.1:8000 http://10.0.0.2:8000 --metaserver-addr 10.0.0.9:50056
    pegaflow-router --host 0.0.0.0 --port 8000 --prefill http://p0:8100 --decode http://d0:8200

Options: ``pegaflow/config/options.py`` (ROUTER rows; docs/options.md).
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
from collections.abc import Sequence

import structlog

from pegaflow.common.logging import configure_logging
from pegaflow.common.security import SecurityError
from pegaflow.config.commands import RouterConfig, load
from pegaflow.config.options import ROUTER

log = structlog.get_logger("pegaflow.router")


def main(argv: Sequence[str] | None = None, prog: str = "pegaflow router") -> int:
    cfg: RouterConfig = load(ROUTER, prog, argv, description="KV-aware HTTP router in front of vLLM engines.")
    try:
        cfg.check()
    except ValueError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        return 2
    configure_logging(cfg.log_level, cfg.log_format)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request to an engine otherwise
    try:  # imported here: `pegaflow router --help` stays instant
        import uvicorn

        from pegaflow.router.app import Router
    except ImportError as exc:  # the router extra (fastapi, httpx, uvicorn) is not installed
        sys.stderr.write(f"{prog}: error: the router needs the router extra (pip install 'pegaflow[router]'): {exc}\n")
        return 2

    try:
        router = Router(cfg)
    except SecurityError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        return 2
    # Bound here, before the app starts: uvicorn binds after its startup, so a host that does not
    # resolve or a port in use came after "router_started", as uvicorn's ERROR line and exit 3.
    try:
        sock = _listen(cfg.host, cfg.port)
    except OSError as exc:
        sys.stderr.write(f"{prog}: error: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}\n")
        return 1
    server = uvicorn.Server(uvicorn.Config(router.app(), host=cfg.host, port=cfg.port, log_level="warning",
                                           access_log=False, lifespan="on", timeout_graceful_shutdown=10))
    # uvicorn shuts down gracefully on SIGINT/SIGTERM and then raises the signal again to
    # whatever handler was there before it: make that a no-op, so a stop exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    # uvicorn exits non-zero only through its own sys.exit (the app's startup failed).
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """The router's listening socket, bound as uvicorn binds it (IPv6 for a host with ':')."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def console() -> None:
    """The ``pegaflow-router`` entry point."""
    raise SystemExit(main(sys.argv[1:], prog="pegaflow-router"))
