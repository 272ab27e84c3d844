"""The one error policy of every service (pegaflow/common/rpc_errors.py): each PegaError answers
its own code and message, anything else INTERNAL and one error line with its traceback;
expected errors are logged rate-limited; a grpc.aio method answers through context.abort."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import structlog
from structlog.testing import capture_logs

from pegaflow.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    PegaError,
    ResourceExhausted,
    Unavailable,
)
from pegaflow.common.rpc_errors import RpcErrors, RpcStatus, aio_rpc, status_of


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (InvalidArgument("hash 1 has 5 bytes, expected 16"), grpc.StatusCode.INVALID_ARGUMENT),
        (FailedPrecondition("unknown session 7: register again"), grpc.StatusCode.FAILED_PRECONDITION),
        (ResourceExhausted("over --max-namespaces 2"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (Unavailable("redis: Connection refused"), grpc.StatusCode.UNAVAILABLE),
        (PegaError("a PegaError of no subclass"), grpc.StatusCode.INTERNAL),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else v.name,
)
def test_each_pega_error_answers_its_code_and_its_message(exc: PegaError, code: grpc.StatusCode) -> None:
    st = status_of(exc)
    assert (st.code, st.message) == (code, str(exc))


def test_an_unexpected_error_answers_internal_and_is_logged_once_with_its_traceback() -> None:
    with capture_logs() as logs:
        errors = RpcErrors(structlog.get_logger("test"))
        try:
            raise RuntimeError("boom")
        except RuntimeError as exc:
            st = errors.failed(exc, "Query", "local")
    assert (st.code, st.message) == (grpc.StatusCode.INTERNAL, "internal error: RuntimeError('boom')")
    assert len(logs) == 1, logs
    line = logs[0]
    assert (line["event"], line["log_level"], line["method"], line["transport"]) == (
        "rpc_internal_error", "error", "Query", "local")
    assert isinstance(line["exc_info"], RuntimeError)


def test_invalid_requests_are_logged_at_info_once_per_method_and_transport() -> None:
    with capture_logs() as logs:
        errors = RpcErrors(structlog.get_logger("test"), every=3600)
        for _ in range(5):
            st = errors.failed(InvalidArgument("namespace is empty"), "QueryPrefix")
        errors.failed(InvalidArgument("namespace is empty"), "QueryPrefix", "local")
        errors.failed(InvalidArgument("namespace is empty"), "RouteHint")
    assert (st.code, st.message) == (grpc.StatusCode.INVALID_ARGUMENT, "namespace is empty")
    assert [(x["event"], x["log_level"], x["method"], x["transport"]) for x in logs] == [
        ("invalid_request", "info", "QueryPrefix", "grpc"),
        ("invalid_request", "info", "QueryPrefix", "local"),
        ("invalid_request", "info", "RouteHint", "grpc"),
    ]
    assert logs[0]["error"] == "namespace is empty"


def test_other_expected_errors_are_warnings_with_their_code_once_per_method_and_code() -> None:
    with capture_logs() as logs:
        errors = RpcErrors(structlog.get_logger("test"), every=3600)
        for _ in range(3):
            errors.failed(Unavailable("redis: down"), "QueryPrefix")
        errors.failed(ResourceExhausted("full"), "QueryPrefix")
    assert [(x["event"], x["log_level"], x["code"], x["error"]) for x in logs] == [
        ("rpc_failed", "warning", "UNAVAILABLE", "redis: down"),
        ("rpc_failed", "warning", "RESOURCE_EXHAUSTED", "full"),
    ]
    assert "exc_info" not in logs[0]


def test_a_status_already_decided_passes_through_unlogged() -> None:
    st = RpcStatus(grpc.StatusCode.FAILED_PRECONDITION, "gone")
    with capture_logs() as logs:
        assert RpcErrors(structlog.get_logger("test")).failed(st, "Query") is st
        assert status_of(st) is st
    assert logs == []


class Aborted(Exception):
    pass


class AioContext:
    """What a grpc.aio servicer method sees of its context: abort raises."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise Aborted(f"{code.name}: {details}")


errors = RpcErrors(structlog.get_logger("test.aio"))


class Servicer:
    def __init__(self, fail: BaseException | None) -> None:
        self.fail = fail

    @aio_rpc(errors)
    async def Pin(self, request: str, context: grpc.aio.ServicerContext) -> str:  # noqa: N802
        if self.fail is not None:
            raise self.fail
        return request.upper()


def call(servicer: Servicer) -> tuple[str | None, tuple[grpc.StatusCode, str] | None]:
    ctx = AioContext()

    async def go() -> str | None:
        try:
            return await servicer.Pin("ok", ctx)  # type: ignore[arg-type]
        except Aborted:
            return None

    return asyncio.run(go()), ctx.aborted


def test_an_aio_method_answers_ok_untouched() -> None:
    assert call(Servicer(None)) == ("OK", None)


@pytest.mark.parametrize(
    ("fail", "status"),
    [
        (InvalidArgument("hash 1 has 5 bytes"), (grpc.StatusCode.INVALID_ARGUMENT, "hash 1 has 5 bytes")),
        (FailedPrecondition("this node runs without --nics (no RDMA)"),
         (grpc.StatusCode.FAILED_PRECONDITION, "this node runs without --nics (no RDMA)")),
        (KeyError("x"), (grpc.StatusCode.INTERNAL, "internal error: KeyError('x')")),
    ],
    ids=["invalid", "precondition", "bug"],
)
def test_an_aio_method_that_raises_answers_its_status_through_abort(
    fail: Exception, status: tuple[grpc.StatusCode, str]
) -> None:
    assert call(Servicer(fail)) == (None, status)


def test_an_aio_method_lets_cancellation_and_its_own_abort_through() -> None:
    with pytest.raises(asyncio.CancelledError):
        call(Servicer(asyncio.CancelledError()))
    own = grpc.aio.AbortError()
    with pytest.raises(grpc.aio.AbortError) as err:
        call(Servicer(own))
    assert err.value is own
