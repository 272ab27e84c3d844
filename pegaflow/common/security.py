"""Who may talk to PegaFlow: the shared token, TLS, and the gRPC channels and ports that use them.

Threat model and the rules (docs/security.md has the operator's view):

- Everything an engine or a peer can do goes through one of four doors: the node's gRPC
  port, the node's local Unix socket, the node's TCP data port, the metaserver's gRPC port.
- **Token.** With a shared token configured (``--auth-token-file``, or the
  ``PEGAFLOW_AUTH_TOKEN`` environment variable), every gRPC call to a node or a metaserver
  must carry it (``pegaflow.common.grpc_guard``: constant-time compare, UNAUTHENTICATED
  otherwise; only the standard health service stays open for probes), and a local-socket
  connection must present it in its first frame. The data port serves only pins, whose
  ids are random 63-bit capabilities handed out by the (token-protected) ``PinForTransfer``.
- **TLS** (``--tls-cert``/``--tls-key`` on a server, ``--tls-ca``/``PEGAFLOW_TLS_CA`` on a
  client) encrypts and authenticates gRPC between hosts with grpc's own credentials. The
  token still decides who may call; TLS keeps it (and the pages' metadata) off the wire.
  Pages on the TCP data port travel in clear: run it on a trusted network.
- Files: the pool memfd, the local socket, SSD cache files and the query trace are 0600.

Processes of the same node (peers, the connector) read the same token from the same
places, so one secret configures a cluster.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from pegaflow.common.grpc_guard import AUTH_HEADER, ENV_TOKEN, TokenError, read_token
from pegaflow.core.hosts import LOOPBACK, host_of

ENV_TLS_CA = "PEGAFLOW_TLS_CA"

__all__ = ["ENV_TOKEN", "Security", "SecurityError", "TokenError", "aio_channel", "sync_channel"]


class SecurityOptions(Protocol):
    """The options a server's security comes from (both commands' configs have them)."""

    auth_token_file: str
    tls_cert: str
    tls_key: str


class SecurityError(ValueError):
    """A token or TLS file cannot be used (one line for the operator)."""


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if not data.strip():
        raise SecurityError(f"{what} {path} is empty")
    return data


@dataclass(frozen=True)
class Security:
    """A process's credentials: the token it requires and sends, and its TLS material."""

    token: str = ""
    tls_cert: bytes = b""  # PEM chain this server presents
    tls_key: bytes = b""
    tls_ca: bytes = b""  # PEM roots this client verifies servers against

    @classmethod
    def load(cls, token_file: str = "", cert: str = "", key: str = "", ca: str = "",
             env: Mapping[str, str] | None = None) -> Security:
        """From option values and the environment (``PEGAFLOW_AUTH_TOKEN[_FILE]``, ``PEGAFLOW_TLS_CA``)."""
        env = dict(os.environ) if env is None else dict(env)
        try:
            token = read_token(token_file, env)
        except TokenError as exc:
            raise SecurityError(str(exc)) from None
        if bool(cert) != bool(key):
            raise SecurityError("--tls-cert and --tls-key go together")
        ca = ca or env.get(ENV_TLS_CA, "")
        return cls(token, _read(cert, "--tls-cert") if cert else b"", _read(key, "--tls-key") if key else b"",
                   _read(ca, "the TLS CA file") if ca else b"")

    @classmethod
    def from_options(cls, config: SecurityOptions, tls_ca: str = "") -> Security:
        """From a command's config (``NodeConfig``, ``MetaConfig``); ``tls_ca`` for a process
        that dials others over TLS (the node: ``--tls-ca``)."""
        return cls.load(config.auth_token_file, config.tls_cert, config.tls_key, tls_ca)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((AUTH_HEADER, f"Bearer {self.token}"),) if self.token else ()

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls_cert:
            return None
        return grpc.ssl_server_credentials([(self.tls_key, self.tls_cert)])

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        return grpc.ssl_channel_credentials(root_certificates=self.tls_ca) if self.tls_ca else None

    def add_port(self, server: Any, addr: str) -> int:
        """Bind ``addr`` on a grpc (or grpc.aio) server, with TLS when this process has a certificate."""
        creds = self.server_credentials()
        return server.add_secure_port(addr, creds) if creds is not None else server.add_insecure_port(addr)

    def exposure_warning(self, addr: str) -> str:
        """A warning for a port on a non-loopback address that anyone on the network may call."""
        if host_of(addr) in LOOPBACK or self.token:
            return ""
        return (f"{addr} is reachable from other hosts and no token is set: anyone who can reach it "
                "may read and write this cache (set --auth-token-file; docs/security.md)")


class _Details(grpc.ClientCallDetails):
    def __init__(self, d: Any, metadata: Sequence[tuple[str, str]]) -> None:
        self.method, self.timeout, self.credentials = d.method, d.timeout, d.credentials
        self.wait_for_ready, self.compression = d.wait_for_ready, getattr(d, "compression", None)
        self.metadata = metadata


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, md: tuple[tuple[str, str], ...]) -> None:
        self.md = md

    def _with(self, d: Any) -> _Details:
        return _Details(d, (*tuple(d.metadata or ()), *self.md))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with(details), request)


def _aio_with(d: Any, md: tuple[tuple[str, str], ...]) -> Any:
    return grpc.aio.ClientCallDetails(d.method, d.timeout, grpc.aio.Metadata(*tuple(d.metadata or ()), *md),
                                      d.credentials, d.wait_for_ready)


class _AioTokenUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, md: tuple[tuple[str, str], ...]) -> None:
        self.md = md

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_aio_with(details, self.md), request)


class _AioTokenStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, md: tuple[tuple[str, str], ...]) -> None:
        self.md = md

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_aio_with(details, self.md), request)


def sync_channel(addr: str, sec: Security, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A blocking channel to ``addr`` that sends ``sec``'s token and speaks TLS when it has a CA."""
    creds = sec.channel_credentials()
    ch = (grpc.secure_channel(addr, creds, options=list(options)) if creds is not None
          else grpc.insecure_channel(addr, options=list(options)))
    return grpc.intercept_channel(ch, _SyncToken(sec.metadata)) if sec.token else ch


def aio_channel(addr: str, sec: Security, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """The asyncio counterpart of :func:`sync_channel` (create it on the loop that uses it)."""
    interceptors = [_AioTokenUnary(sec.metadata), _AioTokenStream(sec.metadata)] if sec.token else None
    creds = sec.channel_credentials()
    if creds is not None:
        return grpc.aio.secure_channel(addr, creds, options=list(options), interceptors=interceptors)
    return grpc.aio.insecure_channel(addr, options=list(options), interceptors=interceptors)
