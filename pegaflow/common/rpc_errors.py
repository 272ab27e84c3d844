"""How a failed call answers, and what it logs: one policy for every PegaFlow service.

The node's engine service (gRPC and the Unix socket), the node's peer service and the
metaserver all turn a failure into a status here:

- a :class:`~pegaflow.common.errors.PegaError` answers its own code
  (:func:`~pegaflow.common.errors.grpc_code`) with its message, unchanged;
- anything else is a bug: it answers ``INTERNAL`` with ``internal error: <repr>`` and is
  logged once, at error level, with its traceback (``rpc_internal_error``).

What is logged of an expected error (a stranger can send any number of them, so each is
rate-limited per method, transport and ``LOG_EVERY_S``): ``INVALID_ARGUMENT`` as
``invalid_request`` at info level (the caller's mistake, nothing wrong here); any other code
(``UNAVAILABLE`` while Redis is away, ``RESOURCE_EXHAUSTED``, ``FAILED_PRECONDITION``) as
``rpc_failed`` at warning level, with the code.

Transports use :meth:`RpcErrors.failed` (the status, logged) and send it their own way: a
``grpc.aio`` servicer through :func:`aio_rpc`, the metaserver's threaded servicer with
``context.abort``, the node's Unix socket as a status frame (:class:`RpcStatus`).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import structlog

from pegaflow.common.errors import PegaError, grpc_code
from pegaflow.common.logging import RateLimitedLog

LOG_EVERY_S = 10.0  # one line per method, transport (and code) this often, with how many were left out
GRPC = "grpc"  # the transport named in the log lines of gRPC calls

S = TypeVar("S")
Req = TypeVar("Req")
Resp = TypeVar("Resp")


class RpcStatus(Exception):
    """A call's final non-OK status, for the transport to send to the caller."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status_of(exc: BaseException) -> RpcStatus:
    """The status a call that raised ``exc`` answers (the module docstring's rules)."""
    if isinstance(exc, RpcStatus):
        return exc
    if isinstance(exc, PegaError):
        return RpcStatus(grpc_code(exc), str(exc))
    return RpcStatus(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")


class RpcErrors:
    """One service's failures: mapped by :func:`status_of` and logged on ``log`` (the
    service's own logger), rate-limited as the module docstring says."""

    def __init__(self, log: structlog.typing.FilteringBoundLogger, every: float = LOG_EVERY_S) -> None:
        self.log = log
        self._invalid = RateLimitedLog(log, "invalid_request", every, level="info")
        self._failed = RateLimitedLog(log, "rpc_failed", every, level="warning")

    def failed(self, exc: Exception, method: str, transport: str = GRPC) -> RpcStatus:
        """The status ``exc`` answers; logged (an :class:`RpcStatus` was already, and passes through)."""
        if isinstance(exc, RpcStatus):
            return exc
        st = status_of(exc)
        if not isinstance(exc, PegaError):
            self.log.error("rpc_internal_error", method=method, transport=transport, exc_info=exc)
        elif st.code is grpc.StatusCode.INVALID_ARGUMENT:
            self._invalid.note(method, transport, method=method, transport=transport, error=st.message)
        else:
            self._failed.note(method, transport, st.code.name, method=method, transport=transport,
                              code=st.code.name, error=st.message)
        return st


# A grpc.aio servicer's unary method: (self, request, context) -> response.
AioMethod = Callable[[S, Req, grpc.aio.ServicerContext[Req, Resp]], Awaitable[Resp]]


def aio_rpc(errors: RpcErrors) -> Callable[[AioMethod[S, Req, Resp]], AioMethod[S, Req, Resp]]:
    """Decorate an ``async def Method(self, request, context)`` of a ``grpc.aio`` servicer: what
    it raises answers :meth:`RpcErrors.failed`'s status (``context.abort``). Its own aborts
    pass through, and so do cancellations (``BaseException``: the caller went away)."""

    def wrap(fn: AioMethod[S, Req, Resp]) -> AioMethod[S, Req, Resp]:
        method = fn.__name__

        @functools.wraps(fn)
        async def call(self: S, request: Req, context: grpc.aio.ServicerContext[Req, Resp]) -> Resp:
            try:
                return await fn(self, request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                st = errors.failed(exc, method)
                await context.abort(st.code, st.message)
                raise  # unreachable: abort raises

        return call

    return wrap
