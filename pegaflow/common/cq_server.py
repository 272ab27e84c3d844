"""A unary gRPC server whose fast calls are answered on the thread that polls grpc core.

Why (issue #55, measured with ``bench/grpc_floor.py``): ``grpc.server`` hands every call to a
thread of its pool, and that thread then waits for grpc's polling thread to deliver the
request body: two thread wake-ups per unary call. On a 2-core host its cheapest call took
475 / 839 µs p50 / p99 cold and 354 µs of server CPU, against the Rust original's 311 / 588 and
184; one thread that asks for the body and answers where it lands took 317 / 557 and 126.
So this server polls grpc core's completion queue on one thread and runs the handlers of
``inline`` methods there, between polls; any other method runs on ``pool`` (a handler that
may wait on Redis for long must not hold up the others), which sends its answer itself.

It takes what ``grpc.server`` takes (generated ``add_*Servicer_to_server``, interceptors such
as ``pegaflow.common.grpc_guard.SyncGuard``, ``add_insecure_port`` / ``add_secure_port``,
``stop(grace).wait()``), for **unary-unary methods only**: a streaming method answers
UNIMPLEMENTED. A handler gets a :class:`Context` (``abort``, ``set_code`` / ``set_details``,
``invocation_metadata``, ``peer``, ``time_remaining``, ``is_active``).

It is written on ``grpc._cython.cygrpc``, the layer ``grpc.server`` itself is written on: not
a public API, so ``supported()`` checks that what is used is there (the grpcio version is
pinned; a newer one that changed it makes the caller fall back to ``grpc.server``, and the
tests fail).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from typing import Any

import grpc
import structlog

from pegaflow.common.priority import name_thread

log = structlog.get_logger("pegaflow.grpc")

try:  # grpc's own implementation layer (module docstring)
    from grpc._cython import cygrpc  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - every grpcio wheel has it
    cygrpc = None

_NO_FLAGS = 0
_NEW = "new-call"  # the tag of a call asked for (one outstanding at a time)
_SHUTDOWN = "shutdown"

Handler = Any  # grpc.RpcMethodHandler (types-grpcio's is generic, grpc's is not)
_Resolve = Callable[[grpc.HandlerCallDetails], "Handler | None"]  # a call's method and metadata -> its handler


def supported() -> bool:
    """The parts of ``cygrpc`` this server uses are there."""
    if cygrpc is None:
        return False
    need = {
        "Server": ("add_http2_port", "request_call", "shutdown", "cancel_all_calls", "destroy", "start",
                   "register_completion_queue"),
        "CompletionQueue": ("poll", "shutdown"),
        "RequestCallEvent": ("call", "call_details", "invocation_metadata", "success", "tag"),
    }
    names = ("ReceiveMessageOperation", "SendInitialMetadataOperation", "SendMessageOperation",
             "SendStatusFromServerOperation", "ReceiveCloseOnServerOperation", "StatusCode", "CompletionType")
    return all(hasattr(cygrpc, n) for n in names) and all(
        hasattr(getattr(cygrpc, cls, None), a) for cls, attrs in need.items() for a in attrs)


class _Aborted(Exception):
    """Raised by :meth:`Context.abort`: the status is on the context."""


class _Details(grpc.HandlerCallDetails):
    def __init__(self, method: str, metadata: tuple[tuple[str, str | bytes], ...]) -> None:
        self.method = method
        self.invocation_metadata = metadata


class Context:
    """What a handler gets: the servicer context's unary subset."""

    def __init__(self, event: Any) -> None:
        self._event = event
        self.code = grpc.StatusCode.OK
        self.details = ""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _Aborted(details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def invocation_metadata(self) -> Sequence[tuple[str, str | bytes]]:
        return tuple(self._event.invocation_metadata)

    def peer(self) -> str:
        return str(self._event.call.peer().decode())

    def time_remaining(self) -> float:
        return max(float(self._event.call_details.deadline) - time.time(), 0.0)

    def is_active(self) -> bool:
        return True


class _Done:
    """``stop()``'s answer: ``wait()`` until the server stopped."""

    def __init__(self, event: threading.Event) -> None:
        self._event = event

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


class CqServer:
    """The module's server. ``inline``: full method names (``/pkg.Service/Method``) answered on
    the polling thread; ``pool`` runs the others (created with ``workers`` threads if not given)."""

    def __init__(self, inline: Iterable[str] = (), pool: futures.Executor | None = None, workers: int = 2,
                 interceptors: Sequence[grpc.ServerInterceptor] = (),
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        if not supported():
            raise RuntimeError("grpc._cython.cygrpc lacks what CqServer uses (a grpcio other than the pinned one?)")
        self.inline = frozenset(inline)
        self._pool = pool or futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pf-grpc")
        self._own_pool = pool is None
        self._interceptors = list(interceptors)
        self._registered: dict[str, Handler] = {}
        self._generic: list[grpc.GenericRpcHandler] = []
        self._resolve: _Resolve = self._lookup  # behind the interceptors at start()
        self._cq = cygrpc.CompletionQueue()
        self._server = cygrpc.Server(tuple(options), False)
        self._server.register_completion_queue(self._cq)
        self._lock = threading.Lock()
        self._pending = 0  # batches started and not completed (the new-call request included)
        self._stopping = False
        self._closed = False  # the server destroyed: no batch may start
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    # --- grpc.Server's surface -----------------------------------------------------------------

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Handler]) -> None:
        for name, h in handlers.items():
            self._registered[f"/{service}/{name}"] = h

    def add_insecure_port(self, address: str) -> int:
        return int(self._server.add_http2_port(address.encode()))

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        return int(self._server.add_http2_port(address.encode(), credentials._credentials))  # type: ignore[attr-defined]

    def start(self) -> None:
        self._resolve = self._chain()  # handlers are added before the start, as with grpc.server
        self._server.start()
        self._ask()
        self._thread = threading.Thread(target=self._serve, name="pf-grpc-cq", daemon=True)
        self._thread.start()

    def stop(self, grace: float | None) -> _Done:
        """Stop taking calls; calls still running after ``grace`` seconds are cancelled."""
        if self._thread is None:  # never started: nothing to drain (destroying it aborts; as grpc.server, left to GC)
            self._stopped.set()
            return _Done(self._stopped)
        with self._lock:
            if not self._stopping:
                self._stopping = True
                self._pending += 1
                self._server.shutdown(self._cq, _SHUTDOWN)
        if grace is None:
            self._server.cancel_all_calls()
        else:
            def cancel_after_grace() -> None:
                if not self._stopped.wait(grace):
                    with self._lock:  # not once the polling thread destroyed the server
                        if not self._closed:
                            self._server.cancel_all_calls()
            threading.Thread(target=cancel_after_grace, name="pf-grpc-grace", daemon=True).start()
        return _Done(self._stopped)

    # --- the polling thread -------------------------------------------------------------------

    def _ask(self) -> None:
        with self._lock:
            self._pending += 1
            self._server.request_call(self._cq, self._cq, _NEW)

    def _batch(self, call: Any, ops: tuple[Any, ...], tag: object) -> None:
        with self._lock:
            if self._closed:  # a pool call that outlived stop(): its call was cancelled, the queue is gone
                return
            self._pending += 1  # the queue is not shut down while a batch is pending
        call.start_server_batch(ops, tag)

    def _serve(self) -> None:
        name_thread()
        shut = False
        while True:
            ev = self._cq.poll()
            if ev.completion_type != cygrpc.CompletionType.operation_complete:
                continue  # poll has no deadline: no timeout; the queue is never shut down (below)
            with self._lock:
                self._pending -= 1
            tag = ev.tag
            try:
                if tag == _NEW:
                    if ev.success:
                        self._ask()
                        self._begin(ev)
                elif tag == _SHUTDOWN:
                    shut = True
                elif isinstance(tag, tuple) and tag[0] == "body":
                    self._body(tag[1], tag[2], tag[3], ev)
            except Exception:  # a bug here must not stop the server answering
                log.exception("grpc_server_event_failed")
            ev = None
            with self._lock:
                if shut and self._pending == 0 and not self._closed:
                    self._closed = True
                    self._server.destroy()
            # Destroyed, the server has closed its listener and let its clients close their
            # connections. The queue is left to its garbage collection, as grpc.server leaves its
            # own: shutting it down here closed the connections from this side, whose TIME_WAIT
            # then held the port for a minute.
            if self._closed:
                break
        if self._own_pool:
            self._pool.shutdown(wait=False)
        self._stopped.set()

    def _lookup(self, d: grpc.HandlerCallDetails) -> Handler | None:
        h = self._registered.get(d.method)
        if h is None:
            for g in self._generic:
                h = g.service(d)
                if h is not None:
                    break
        return h

    def _chain(self) -> _Resolve:
        """The handler lookup behind the interceptors, the first one outermost (as grpc.server)."""
        resolve: _Resolve = self._lookup
        for icpt in reversed(self._interceptors):
            resolve = (lambda nxt, i: (lambda d: i.intercept_service(nxt, d)))(resolve, icpt)
        return resolve

    def _begin(self, ev: Any) -> None:
        method = ev.call_details.method
        method = method.decode() if isinstance(method, bytes) else method
        handler = self._resolve(_Details(method, tuple(ev.invocation_metadata)))
        if handler is None or not handler.unary_unary:
            what = "unknown method" if handler is None else "streaming methods are not served here"
            self._status(ev.call, grpc.StatusCode.UNIMPLEMENTED, f"{what}: {method}")
            return
        self._batch(ev.call, (cygrpc.ReceiveMessageOperation(_NO_FLAGS),), ("body", ev, handler, method in self.inline))

    def _body(self, call_ev: Any, handler: Handler, inline: bool, ev: Any) -> None:
        raw = ev.batch_operations[0].message() if ev.success else None
        if raw is None:  # the client went away, or sent no message
            self._status(call_ev.call, grpc.StatusCode.UNIMPLEMENTED, "a unary call needs one request message")
            return
        if inline:
            self._run(call_ev, handler, raw)
        else:
            self._pool.submit(self._run, call_ev, handler, raw)

    def _run(self, call_ev: Any, handler: Handler, raw: bytes) -> None:
        ctx = Context(call_ev)
        try:
            request = handler.request_deserializer(raw) if handler.request_deserializer else raw
            response = handler.unary_unary(request, ctx)
        except _Aborted:
            self._status(call_ev.call, ctx.code, ctx.details)
            return
        except Exception as exc:  # noqa: BLE001 - as grpc.server: UNKNOWN, logged
            log.exception("grpc_handler_failed", method=call_ev.call_details.method)
            self._status(call_ev.call, grpc.StatusCode.UNKNOWN, f"Exception calling application: {exc}")
            return
        if ctx.code != grpc.StatusCode.OK:
            self._status(call_ev.call, ctx.code, ctx.details)
            return
        body = handler.response_serializer(response) if handler.response_serializer else response
        self._send(call_ev.call, (cygrpc.SendMessageOperation(body, _NO_FLAGS),), grpc.StatusCode.OK, "")

    def _status(self, call: Any, code: grpc.StatusCode, details: str) -> None:
        self._send(call, (), code, details)

    def _send(self, call: Any, ops: tuple[Any, ...], code: grpc.StatusCode, details: str) -> None:
        self._batch(call, (cygrpc.SendInitialMetadataOperation(None, _NO_FLAGS), *ops,
                           cygrpc.SendStatusFromServerOperation(None, _STATUS[code], details.encode(), _NO_FLAGS),
                           cygrpc.ReceiveCloseOnServerOperation(_NO_FLAGS)), ("sent",))


# grpc.StatusCode -> cygrpc.StatusCode (the enum grpc.server maps with)
_STATUS: dict[grpc.StatusCode, Any] = (
    {c: getattr(cygrpc.StatusCode, c.name.lower()) for c in grpc.StatusCode} if cygrpc is not None else {})

