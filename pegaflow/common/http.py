"""A minimal asyncio HTTP endpoint for ``/metrics`` (Prometheus) and ``/health``.

Loopback by default; no framework, because two read-only routes do not need one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = structlog.get_logger("pegaflow.http")


class MetricsServer:
    def __init__(self, addr: str, registry: CollectorRegistry, health: Callable[[], dict]) -> None:
        host, _, port = addr.rpartition(":")
        self.host, self.port = host, int(port)
        self.registry = registry
        self.health = health
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("http_listening", addr=f"{self.host}:{self.port}")

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            parts = line.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) >= 2 else ""
            if path == "/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.registry)
            elif path == "/health":
                h = self.health()
                status = "200 OK" if h.get("ok") else "503 Service Unavailable"
                ctype, body = "application/json", json.dumps(h).encode()
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"not found\n"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                f"Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
