"""The metaserver's operator routes on ``--http-addr`` (the original's ``http_server.rs``).

- ``POST /admin/cleanup-expired-blocks``: remove every owner registration older than an
  hour (``pegaflow/meta/cleanup.py``); 200 ``{"removed_owners": N, "removed_keys": M}``
  once the pass is done; 409 ``{"error": ...}`` while another replica's cleanup runs; 500
  ``{"error": ...}`` when the pass fails (Redis); other methods 405.

With a token (``--auth-token-file``/``PEGAFLOW_AUTH_TOKEN``) it needs ``Authorization:
Bearer <token>`` (401 otherwise), as the node's admin routes; ``/metrics`` and ``/health`` stay open. The
original serves it with no authentication (0.25.1 on ``--http-addr``).

The pass runs on a worker thread, off the HTTP endpoint's loop: ``/metrics`` keeps answering.
"""

from __future__ import annotations

import asyncio

import redis
import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pegaflow.cluster.redis_conn import Client, error_text
from pegaflow.common.grpc_guard import token_matches
from pegaflow.meta.cleanup import CleanupBusy, cleanup_expired_blocks

log = structlog.get_logger("pegaflow.meta.admin")

CLEANUP_PATH = "/admin/cleanup-expired-blocks"


def routes(r: Client, token: str) -> list[Route]:
    """The routes for :class:`pegaflow.common.http.HttpEndpoint`; ``token``: the one callers
    must present ('' = open)."""

    async def cleanup(request: Request) -> Response:
        if token and not token_matches(token, request.headers.get("authorization")):
            return JSONResponse({"error": "missing or wrong token (Authorization: Bearer <token>)"},
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        try:
            res = await asyncio.to_thread(cleanup_expired_blocks, r)
        except CleanupBusy as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        except (redis.RedisError, OSError) as exc:
            log.warning("cleanup_failed", error=error_text(exc))
            return JSONResponse({"error": f"cleanup failed: {exc}"}, status_code=500)
        return JSONResponse({"removed_owners": res.removed_owners, "removed_keys": res.removed_keys})

    return [Route(CLEANUP_PATH, cleanup, methods=["POST"])]
