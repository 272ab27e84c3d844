"""Errors that cross the RPC boundary, and the one place that maps them to gRPC codes.

Service code raises these; :func:`grpc_code` picks the status. Anything else that escapes
a handler is a bug and becomes INTERNAL (logged with its traceback).
"""

from __future__ import annotations

import grpc


class PegaError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(PegaError):
    """The request is malformed or refers to something the caller may not use."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(PegaError):
    """E.g. an unknown session: the node restarted and the client must register again."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(PegaError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(PegaError):
    code = grpc.StatusCode.UNAVAILABLE


def grpc_code(exc: BaseException) -> grpc.StatusCode:
    return exc.code if isinstance(exc, PegaError) else grpc.StatusCode.INTERNAL
