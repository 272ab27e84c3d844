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
- **A node's own token** (safe by default on a shared host). A node with no token configured
  and every listener on loopback (``--addr``, and ``--transfer-addr`` in a cluster; the
  read-only HTTP port does not count) creates a random one and writes it to
  ``<local socket path>.token`` (:func:`token_path`), mode 0600 (0640 with
  ``--access-group``, for that group) from its creation, removed at clean exit. Clients of
  a loopback address find it there with no setting (:func:`node_token_paths`: the default
  socket paths of that address, under ``$XDG_RUNTIME_DIR`` and ``/tmp``), so the node's own
  user (and its group) gets in and any other user gets UNAUTHENTICATED. ``--no-auth`` turns
  it off; a node listening beyond loopback without a token keeps no token (and warns).
  Every channel of :func:`sync_channel`/:func:`aio_channel` without a configured token
  looks the file up, re-read when it changes (a restarted node has a new token).
- Files: the pool memfd, the local socket, SSD cache files and the query trace are 0600.

Processes of the same node (peers, the connector) read the same token from the same
places, so one secret configures a cluster.
"""

from __future__ import annotations

import grp
import os
import secrets
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import grpc

from pegaflow.common.grpc_guard import AUTH_HEADER, ENV_TOKEN, TokenError, read_token
from pegaflow.core.hosts import LOOPBACK, WILDCARD, host_of, split_host_port

if TYPE_CHECKING:
    from pegaflow.common.cq_server import CqServer

ENV_TLS_CA = "PEGAFLOW_TLS_CA"
SOCKET_NAME = "pegaflow-node-{host}-{port}.sock"  # a node's default local socket (--local-socket auto)
SHARED_DIR = "/tmp"  # where a socket shared with a group lives (per-user $XDG_RUNTIME_DIR is 0700)
TOKEN_SUFFIX = ".token"  # a node's own token: beside its local socket
TOKEN_MODE = 0o600
GROUP_TOKEN_MODE = 0o640  # --access-group: the group reads it

__all__ = ["ENV_TOKEN", "OwnToken", "Security", "SecurityError", "TokenError", "aio_channel", "default_socket_path",
           "new_token", "node_token_paths", "own_token_wanted", "sync_channel", "token_for_node", "token_for_socket",
           "token_path"]


def default_socket_path(host: str, port: int, env: Mapping[str, str] | None = None, shared: bool = False) -> str:
    """``$XDG_RUNTIME_DIR`` (per user, private) or ``/tmp`` (``shared``: always ``/tmp``, for
    ``--access-group``), named after the gRPC address so several nodes on one host (tests,
    network namespaces sharing /tmp) never collide."""
    base = SHARED_DIR if shared else ((os.environ if env is None else env).get("XDG_RUNTIME_DIR") or SHARED_DIR)
    return os.path.join(base, SOCKET_NAME.format(host=host.strip("[]") or "any", port=port))


def token_path(socket_path: str) -> str:
    """Where a node keeps its own token: ``<socket path>.token``."""
    return socket_path + TOKEN_SUFFIX


def token_for_socket(socket_path: str) -> str:
    """The token a node wrote beside its local socket ``socket_path``; '' when there is none
    or this user may not read it (the node then refuses this user)."""
    try:
        return Path(token_path(socket_path)).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def node_token_paths(addr: str, env: Mapping[str, str] | None = None) -> list[str]:
    """Where a node at ``addr`` keeps its own token, most likely first: the token files of
    its default socket paths (each loopback name of the host, under ``$XDG_RUNTIME_DIR`` and
    ``/tmp``). Empty for an address that is not loopback (such a node has no own token)."""
    try:
        host, port = split_host_port(addr)
    except ValueError:
        return []
    if host not in LOOPBACK:
        return []
    env = os.environ if env is None else env
    bases = [b for b in dict.fromkeys((env.get("XDG_RUNTIME_DIR", ""), SHARED_DIR)) if b]
    hosts = [host, *sorted(LOOPBACK - {host})]
    return [token_path(os.path.join(b, SOCKET_NAME.format(host=h, port=port))) for b in bases for h in hosts]


def token_for_node(addr: str, env: Mapping[str, str] | None = None) -> str:
    """The own token of the node at ``addr`` that this user can read; '' when none."""
    for path in node_token_paths(addr, env):
        token = token_for_socket(path[: -len(TOKEN_SUFFIX)])
        if token:
            return token
    return ""


class _NodeToken:
    """The own token of the node at one address, re-read when its file changes (a restarted
    node writes a new one); ``get`` costs a ``stat`` while the file is unchanged."""

    def __init__(self, addr: str) -> None:
        self.paths = node_token_paths(addr)
        self._state: tuple[str, tuple[int, int], str] | None = None  # path, (inode, mtime), token

    def get(self) -> str:
        st = self._state
        if st is not None:
            try:
                s = os.stat(st[0])
                if (s.st_ino, s.st_mtime_ns) == st[1]:
                    return st[2]
            except OSError:
                pass
        for path in self.paths:
            try:
                s = os.stat(path)
                token = Path(path).read_text().strip()
            except (OSError, UnicodeDecodeError):
                continue
            if token:
                self._state = (path, (s.st_ino, s.st_mtime_ns), token)
                return token
        self._state = None
        return ""

    def metadata(self) -> tuple[tuple[str, str], ...]:
        token = self.get()
        return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


def own_token_wanted(configured: str, no_auth: bool, listeners: Sequence[str]) -> bool:
    """Whether a node creates its own token: none configured, not ``--no-auth``, and every
    listener (gRPC, data port) on loopback, so that only this host's users can call it."""
    if configured or no_auth:
        return False
    hosts = [host_of(a) for a in listeners]
    return bool(hosts) and all(h in LOOPBACK and h not in WILDCARD for h in hosts)


def group_id(name: str) -> int:
    """The id of group ``name`` (``--access-group``); SecurityError when there is none."""
    try:
        return grp.getgrgid(int(name)).gr_gid if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise SecurityError(f"--access-group {name}: no such group") from None


def new_token() -> str:
    """A random token for a node's own use (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


class OwnToken:
    """A node's own random token in ``path``: created mode 0600 (``gid``: 0640 for that group)
    under a temporary name opened with O_EXCL, then renamed into place, so it is never
    readable by anyone else, even briefly; :meth:`remove` at clean exit."""

    def __init__(self, path: str, gid: int | None = None, token: str | None = None) -> None:
        self.path = path
        self.token = token or new_token()
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, TOKEN_MODE)
            try:
                if gid is not None:
                    os.fchown(fd, -1, gid)
                    os.fchmod(fd, GROUP_TOKEN_MODE)
                os.write(fd, (self.token + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise SecurityError(f"cannot write the node's token file {path}: {exc.strerror or exc}") from None
        self._inode = os.stat(path).st_ino

    def remove(self) -> None:
        """Delete the file, unless another node has replaced it meanwhile."""
        try:
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except OSError:
            pass


class SecurityOptions(Protocol):
    """The options a server's security comes from (both commands' configs have them)."""

    @property
    def auth_token_file(self) -> str: ...
    @property
    def tls_cert(self) -> str: ...
    @property
    def tls_key(self) -> str: ...


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


def _no_passphrase() -> bytes:
    raise SecurityError("is encrypted (gRPC takes no passphrase)")


def _check_pem(cert: str, key: str, ca: str) -> None:
    """The TLS files as OpenSSL reads them (Python's ssl), so a file that is not PEM, or a key
    that is not the certificate's, is named in one line at start; gRPC's C core said only
    that it could not bind the port, after three lines of its own."""
    for path, what in ((cert, "--tls-cert"), (ca, "the TLS CA file")):
        if path:
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
            except ssl.SSLError as exc:
                raise SecurityError(f"{what} {path} holds no PEM certificate ({exc.reason or exc})") from None
    if cert:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=_no_passphrase)
        except SecurityError as exc:
            raise SecurityError(f"--tls-key {key} {exc}") from None
        except ssl.SSLError as exc:
            why = "is not the private key of --tls-cert" if exc.reason == "KEY_VALUES_MISMATCH" else \
                "holds no PEM private key"
            raise SecurityError(f"--tls-key {key} {why}") from None


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
        made = cls(token, _read(cert, "--tls-cert") if cert else b"", _read(key, "--tls-key") if key else b"",
                   _read(ca, "the TLS CA file") if ca else b"")
        _check_pem(cert, key, ca)
        return made

    @classmethod
    def from_options(cls, config: SecurityOptions, tls_ca: str = "") -> Security:
        """From a command's config (``NodeConfig``, ``MetaConfig``); ``tls_ca`` for a process
        that dials others over TLS (the node: ``--tls-ca``)."""
        return cls.load(config.auth_token_file, config.tls_cert, config.tls_key, tls_ca)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((AUTH_HEADER, f"Bearer {self.token}"),) if self.token else ()

    def token_for(self, addr: str) -> str:
        """The token to present to the node at ``addr``: the configured one, else the node's
        own token when this user can read it (:func:`token_for_node`), else ''."""
        return self.token or token_for_node(addr)

    def _metadata_source(self, addr: str) -> Callable[[], tuple[tuple[str, str], ...]] | None:
        if self.token:
            md = self.metadata
            return lambda: md
        node = _NodeToken(addr)
        return node.metadata if node.paths else None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls_cert:
            return None
        return grpc.ssl_server_credentials([(self.tls_key, self.tls_cert)])

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        return grpc.ssl_channel_credentials(root_certificates=self.tls_ca) if self.tls_ca else None

    def add_port(self, server: grpc.Server | grpc.aio.Server | CqServer, addr: str) -> int:
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
    def __init__(self, d: grpc.ClientCallDetails, metadata: tuple[tuple[str, str | bytes], ...]) -> None:
        self.method, self.timeout, self.credentials = d.method, d.timeout, d.credentials
        self.wait_for_ready, self.compression = d.wait_for_ready, getattr(d, "compression", None)
        self.metadata = metadata


_Source = Callable[[], tuple[tuple[str, str], ...]]
ChannelOption = tuple[str, str | int]  # a grpc channel argument ("grpc.max_receive_message_length", 64 << 20)
# The interceptors pass requests and calls through untouched, whatever the RPC's messages.
_Req = TypeVar("_Req")
_Call = TypeVar("_Call")


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, md: _Source) -> None:
        self.md = md

    def _with(self, d: grpc.ClientCallDetails) -> _Details:
        return _Details(d, (*tuple(d.metadata or ()), *self.md()))

    def intercept_unary_unary(
        self, continuation: Callable[[grpc.ClientCallDetails, _Req], _Call], details: grpc.ClientCallDetails, request: _Req
    ) -> _Call:
        return continuation(self._with(details), request)

    def intercept_unary_stream(
        self, continuation: Callable[[grpc.ClientCallDetails, _Req], _Call], details: grpc.ClientCallDetails, request: _Req
    ) -> _Call:
        return continuation(self._with(details), request)

    def intercept_stream_unary(
        self, continuation: Callable[[grpc.ClientCallDetails, _Req], _Call], details: grpc.ClientCallDetails, requests: _Req
    ) -> _Call:
        return continuation(self._with(details), requests)

    def intercept_stream_stream(
        self, continuation: Callable[[grpc.ClientCallDetails, _Req], _Call], details: grpc.ClientCallDetails, requests: _Req
    ) -> _Call:
        return continuation(self._with(details), requests)


def _aio_with(d: grpc.aio.ClientCallDetails, md: _Source) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails(d.method, d.timeout, grpc.aio.Metadata(*tuple(d.metadata or ()), *md()),
                                      d.credentials, d.wait_for_ready)


class _AioTokenUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, md: _Source) -> None:
        self.md = md

    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, _Req], Awaitable[_Call]],
        details: grpc.aio.ClientCallDetails,
        request: _Req,
    ) -> _Call:
        return await continuation(_aio_with(details, self.md), request)


class _AioTokenStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, md: _Source) -> None:
        self.md = md

    async def intercept_unary_stream(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, _Req], Awaitable[_Call]],
        details: grpc.aio.ClientCallDetails,
        request: _Req,
    ) -> _Call:
        return await continuation(_aio_with(details, self.md), request)


def sync_channel(addr: str, sec: Security, options: Sequence[ChannelOption] = ()) -> grpc.Channel:
    """A blocking channel to ``addr`` that sends ``sec``'s token (none configured: the node's
    own token at a loopback ``addr``, see :class:`OwnToken`) and speaks TLS when it has a CA."""
    creds = sec.channel_credentials()
    ch = (grpc.secure_channel(addr, creds, options=list(options)) if creds is not None
          else grpc.insecure_channel(addr, options=list(options)))
    md = sec._metadata_source(addr)
    return grpc.intercept_channel(ch, _SyncToken(md)) if md is not None else ch


def aio_channel(addr: str, sec: Security, options: Sequence[ChannelOption] = ()) -> grpc.aio.Channel:
    """The asyncio counterpart of :func:`sync_channel` (create it on the loop that uses it)."""
    md = sec._metadata_source(addr)
    interceptors = [_AioTokenUnary(md), _AioTokenStream(md)] if md is not None else None
    creds = sec.channel_credentials()
    if creds is not None:
        return grpc.aio.secure_channel(addr, creds, options=list(options), interceptors=interceptors)
    return grpc.aio.insecure_channel(addr, options=list(options), interceptors=interceptors)
