"""The gate in front of every PegaFlow gRPC service: the shared token, and undecodable requests.

One server interceptor (``grpc.aio`` for the node, plain ``grpc`` for the metaserver) does,
for every call, before any servicer code runs:

1. **Token.** When the process has a token (``--auth-token-file`` / ``PEGAFLOW_AUTH_TOKEN``, or
   a node's own token, ``pegaflow.common.security.OwnToken``),
   a call must carry ``authorization: Bearer <token>`` metadata; anything else answers
   UNAUTHENTICATED. The comparison is constant-time (``hmac.compare_digest``). Health
   checks stay open (``OPEN_SERVICES``) so that probes need no secret.
2. **Decoding.** grpc deserializes a request outside the servicer, and a request whose
   bytes are not the message answered UNKNOWN with a multi-line traceback in the log per
   call. Here the deserializer is wrapped: undecodable bytes answer INVALID_ARGUMENT, and
   one structured log line per method and minute says how many were refused.

Clients send the token with every call through the channels of ``pegaflow.common.security``.
"""

from __future__ import annotations

import hmac
import inspect
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import structlog

from pegaflow.common.logging import RateLimitedLog

log = structlog.get_logger("pegaflow.grpc")

# Quoted: types-grpcio's RpcMethodHandler is generic, grpc's is not (not subscriptable at run time).
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # any RPC's handler: the gate wraps every method, whatever its messages
Behavior = Callable[[object, object], Any]  # a servicer method: a response, an awaitable or an iterator, by kind

AUTH_HEADER = "authorization"
ENV_TOKEN = "PEGAFLOW_AUTH_TOKEN"
ENV_TOKEN_FILE = "PEGAFLOW_AUTH_TOKEN_FILE"
# Answer without a token: liveness probes (the standard health service and the node's own
# Health, which tells only its id and epoch).
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/pegaflow.v1.PegaNode/Health")
LOG_EVERY_S = 60.0  # refused requests are logged once per method and this many seconds


class TokenError(Exception):
    """The token file cannot be used (one line for the operator)."""


def read_token(path: str = "", env: dict[str, str] | None = None) -> str:
    """The shared token: from ``path`` (or ``PEGAFLOW_AUTH_TOKEN_FILE``), else ``PEGAFLOW_AUTH_TOKEN``;
    '' when none is set. A file must not be readable by others (like an SSH key)."""
    env = dict(os.environ) if env is None else env
    path = path or env.get(ENV_TOKEN_FILE, "")
    if path:
        p = Path(path)
        try:
            mode = p.stat().st_mode
            text = p.read_text().strip()
        except OSError as exc:
            raise TokenError(f"cannot read the token file {path}: {exc.strerror or exc}") from None
        if mode & 0o077:
            raise TokenError(f"the token file {path} is readable by others (chmod 600 {path})")
        if not text:
            raise TokenError(f"the token file {path} is empty")
        return text
    return env.get(ENV_TOKEN, "").strip()


def token_matches(token: str, presented: str | bytes | None) -> bool:
    if presented is None:
        return False
    want = ("Bearer " + token).encode()
    got = presented.encode() if isinstance(presented, str) else presented
    return hmac.compare_digest(want, got)


class _Undecodable:
    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class _Refusals:
    """Refused requests, logged once per method, reason and minute (``RateLimitedLog``)."""

    def __init__(self) -> None:
        self._log = RateLimitedLog(log, "grpc_request_refused", LOG_EVERY_S)

    def note(self, method: str, reason: str, detail: str) -> None:
        self._log.note(method, reason, method=method, reason=reason, detail=detail)


def _safe(deserialize: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> object:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - any failure to parse is the caller's bad bytes
            return _Undecodable(f"undecodable request ({type(exc).__name__}: {exc})")

    return parse


def _metadata_value(details: grpc.HandlerCallDetails, key: str) -> str | bytes | None:
    for k, v in details.invocation_metadata or ():
        if k == key:
            return v
    return None


class _Gate:
    def __init__(self, token: str) -> None:
        self.token = token
        self.refusals = _Refusals()
        # method -> (the servicer's handler, its decoding wrapper): built once per method,
        # not per call (the closures and the namedtuple copy were ~30 us of a ~0.5 ms call).
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}

    def decoding(self, handler: Handler, method: str, aio: bool) -> Handler:
        hit = self._wrapped.get(method)
        if hit is not None and hit[0] is handler:
            return hit[1]
        wrapped = _decoding(handler, method, self.refusals, aio)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def allowed(self, details: grpc.HandlerCallDetails) -> bool:
        if not self.token or details.method.startswith(OPEN_SERVICES):
            return True
        return token_matches(self.token, _metadata_value(details, AUTH_HEADER))


UNAUTHENTICATED_MSG = "a valid token is required"


class AsyncGuard(grpc.aio.ServerInterceptor):
    """For ``grpc.aio.server(interceptors=[AsyncGuard(token)])`` (the node). ``message``: what
    a refused caller reads (the node names its own token's file there)."""

    def __init__(self, token: str = "", message: str = UNAUTHENTICATED_MSG) -> None:
        self.gate = _Gate(token)
        self.message = message

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        gate = self.gate
        if not gate.allowed(details):
            gate.refusals.note(method, "unauthenticated", "missing or wrong token")
            return _rejecting(handler, grpc.StatusCode.UNAUTHENTICATED, self.message, aio=True)
        return gate.decoding(handler, method, aio=True)


class SyncGuard(grpc.ServerInterceptor):
    """For ``grpc.server(executor, interceptors=[SyncGuard(token)])`` (the metaserver)."""

    def __init__(self, token: str = "") -> None:
        self.gate = _Gate(token)

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Handler | None], details: grpc.HandlerCallDetails
    ) -> Handler | None:
        handler = continuation(details)
        if handler is None:
            return None
        if not self.gate.allowed(details):
            self.gate.refusals.note(details.method, "unauthenticated", "missing or wrong token")
            return _rejecting(handler, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MSG, aio=False)
        return self.gate.decoding(handler, details.method, aio=False)


def _kind(handler: Handler) -> str:
    if handler.unary_unary:
        return "unary_unary"
    if handler.unary_stream:
        return "unary_stream"
    if handler.stream_unary:
        return "stream_unary"
    return "stream_stream"


def _rejecting(handler: Handler, code: grpc.StatusCode, message: str, aio: bool) -> Handler:
    """A handler of the same shape that answers ``code`` without touching the request."""
    kind = _kind(handler)
    streams = kind.endswith("_stream")
    behavior: Callable[..., object]
    if aio:
        async def aio_unary(request: object, context: grpc.aio.ServicerContext[object, object]) -> None:
            await context.abort(code, message)

        async def aio_stream(request: object, context: grpc.aio.ServicerContext[object, object]) -> AsyncIterator[None]:
            await context.abort(code, message)
            yield  # pragma: no cover - abort raises

        behavior = aio_stream if streams else aio_unary
    else:
        def sync_unary(request: object, context: grpc.ServicerContext) -> None:
            context.abort(code, message)

        def sync_stream(request: object, context: grpc.ServicerContext) -> Iterator[None]:
            context.abort(code, message)
            yield  # pragma: no cover - abort raises

        behavior = sync_stream if streams else sync_unary
    return _replaced(handler, **{kind: behavior, "request_deserializer": _safe(handler.request_deserializer)})


def _decoding(handler: Handler, method: str, refusals: _Refusals, aio: bool) -> Handler:
    """``handler`` with a deserializer that cannot raise, answering INVALID_ARGUMENT instead."""
    kind = _kind(handler)
    if kind.startswith("stream_"):  # no PegaFlow RPC streams requests; leave such handlers alone
        return handler
    inner: Behavior = getattr(handler, kind)
    bad = grpc.StatusCode.INVALID_ARGUMENT
    behavior: Callable[..., object]
    if aio:
        if kind == "unary_unary":
            async def aio_unary(request: object, context: grpc.aio.ServicerContext[object, object]) -> object:
                if isinstance(request, _Undecodable):
                    refusals.note(method, "undecodable", request.error)
                    await context.abort(bad, request.error)
                res = inner(request, context)
                return await res if inspect.isawaitable(res) else res

            behavior = aio_unary
        else:
            async def aio_stream(request: object, context: grpc.aio.ServicerContext[object, object]) -> AsyncIterator[object]:
                if isinstance(request, _Undecodable):
                    refusals.note(method, "undecodable", request.error)
                    await context.abort(bad, request.error)
                items = inner(request, context)
                if hasattr(items, "__aiter__"):
                    async for item in items:
                        yield item
                else:
                    for item in items:
                        yield item

            behavior = aio_stream
    else:
        if kind == "unary_unary":
            def sync_unary(request: object, context: grpc.ServicerContext) -> object:
                if isinstance(request, _Undecodable):
                    refusals.note(method, "undecodable", request.error)
                    context.abort(bad, request.error)
                return inner(request, context)

            behavior = sync_unary
        else:
            def sync_stream(request: object, context: grpc.ServicerContext) -> Iterator[object]:
                if isinstance(request, _Undecodable):
                    refusals.note(method, "undecodable", request.error)
                    context.abort(bad, request.error)
                yield from inner(request, context)

            behavior = sync_stream
    return _replaced(handler, **{kind: behavior, "request_deserializer": _safe(handler.request_deserializer)})


def _replaced(handler: Handler, **fields: object) -> Handler:
    """``handler`` with ``fields`` replaced."""
    # grpc builds handlers as namedtuples (grpc._utilities.RpcMethodHandler); types-grpcio declares an ABC.
    replaced: Handler = handler._replace(**fields)  # type: ignore[attr-defined]  # the namedtuple's _replace
    return replaced
