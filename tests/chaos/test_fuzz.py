"""Fuzzing what strangers can send: both node transports, and `pegaflow replay`'s input.

* gRPC: hypothesis builds requests of every node RPC from random field values (sessions
  real and made up, namespaces, hashes of any length, ids, indices), and raw bytes for
  every method. Every answer must be a status a bad request deserves (OK,
  INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED); UNKNOWN, INTERNAL or a dead
  node fail the run. The local socket gets random frames (method, flags, lengths, payloads).
  Afterwards a victim's blocks are all there (``lost``) and intact (``wrong``), and the
  node's log holds no traceback.
* Replay: random JSON lines (and random text) of both trace formats; every run ends with
  an exit code and at most one line on stderr, never an exception. No blocks are stored,
  so nothing can be lost (``lost`` is not reported).
"""

from __future__ import annotations

import json
import socket
from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pegaflow._proto import node_pb2, node_pb2_grpc
from pegaflow.client import PegaClient
from pegaflow.common.local_wire import HELLO, REPLY_HEADER, REQUEST_HEADER
from pegaflow.common.security import Security, sync_channel, token_for_socket
from tests.chaos.common import NS, PAGE, Report, block_hash, pick, read_back, store, tracebacks_in

EXAMPLES = int(pick(150, 3000))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)


@pytest.fixture(scope="module")
def target(tmp_path_factory):  # type: ignore[no-untyped-def]
    from tests.harness.node import EVERY_SCRAPE, Node

    node = Node(tmp_path_factory.mktemp("fuzz"), "64mb", render_interval=EVERY_SCRAPE).start()
    victim = PegaClient(node.addr)
    victim.register({NS: PAGE})
    hs = [block_hash(i) for i in range(8)]
    store(victim, hs)
    fuzzer = PegaClient(node.addr)
    fuzzer.register({"fz": 4096})
    yield node, victim, fuzzer, hs
    victim.close()
    fuzzer.close()
    node.kill()


def requests(sid: int):  # type: ignore[no-untyped-def]
    sids = st.one_of(st.just(sid), U64)
    names = st.lists(st.one_of(st.just("fz"), st.just(NS), st.text(max_size=24)), max_size=6)
    hashes = st.lists(st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=40)), max_size=40)
    return st.one_of(
        st.builds(lambda s, n, h, r, le: ("Query", node_pb2.QueryRequest(session_id=s, namespaces=n, hashes=h,
                                                                          req_id=r, lease=le)),
                  sids, names, hashes, st.text(max_size=64), st.booleans()),
        st.builds(lambda s, n, h: ("Reserve", node_pb2.ReserveRequest(session_id=s, namespace=n, hashes=h)),
                  sids, st.one_of(st.just("fz"), st.text(max_size=24)), hashes),
        st.builds(lambda s, r, i, a: ("Commit", node_pb2.CommitRequest(session_id=s, reservation_id=r, indices=i,
                                                                        abort=a)),
                  sids, U64, st.lists(U32, max_size=20), st.booleans()),
        st.builds(lambda s, x: ("Release", node_pb2.ReleaseRequest(session_id=s, lease_id=x)), sids, U64),
        st.builds(lambda i, ns: ("Register", node_pb2.RegisterRequest(
            instance_id=i, namespaces=[node_pb2.NamespaceSpec(name=n, page_bytes=p) for n, p in ns])),
            st.text(max_size=40), st.lists(st.tuples(st.text(max_size=24), U64), max_size=4)),
        st.builds(lambda: ("Stats", node_pb2.StatsRequest())),
    )


def test_fuzzed_grpc_requests_get_a_deserved_status_and_break_nothing(target):  # type: ignore[no-untyped-def]
    rep = Report("gRPC fuzzing (hypothesis messages + raw bytes)", expected_failures=True)
    node, victim, fuzzer, hs = target
    codes: Counter[str] = Counter()
    bad: list[str] = []
    with sync_channel(node.addr, Security()) as ch:  # the node's own token, as its engines send it
        stub = node_pb2_grpc.PegaNodeStub(ch)
        # CacheClear is the operator's (pegaflow cache clear): dropping every block is its job,
        # so it is not fuzzed against the victim's blocks (tests/integration/test_node_admin.py).
        methods = [m.name for m in node_pb2.DESCRIPTOR.services_by_name["PegaNode"].methods
                   if m.name not in ("Session", "CacheClear")]

        def record(what: str, fn) -> None:  # type: ignore[no-untyped-def]
            try:
                fn()
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
            codes[code.name] += 1
            if code not in ALLOWED:
                bad.append(f"{what}: {code.name}")

        @SETTINGS
        @given(requests(fuzzer.session_id))
        def messages(req) -> None:  # type: ignore[no-untyped-def]
            name, msg = req
            record(name, lambda: getattr(stub, name)(msg, timeout=10))

        @SETTINGS
        @given(st.sampled_from(methods), st.binary(max_size=300))
        def raw(method: str, data: bytes) -> None:
            call = ch.unary_unary(f"/pegaflow.v1.PegaNode/{method}", request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
            record(f"raw {method}", lambda: call(data, timeout=10))

        messages()
        raw()
    f = rep.fig
    f.tried = sum(codes.values())
    f.failed = f.tried - codes["OK"]
    f.crashes = int(node.proc.poll() is not None)
    f.lost, f.wrong = read_back(victim, hs)
    f.tracebacks = tracebacks_in(node.log())
    f.notes.update(**{k.lower(): v for k, v in codes.items()}, unexpected=len(bad))
    rep.done()
    assert not bad, bad[:10]
    assert not f.bad(), f


def test_fuzzed_local_socket_frames_close_only_their_connection(target):  # type: ignore[no-untyped-def]
    rep = Report("local-socket fuzzing (random frames)", expected_failures=True)
    node, victim, fuzzer, hs = target
    seen: Counter[str] = Counter()

    @SETTINGS
    @given(st.integers(0, 255), st.integers(0, 255), st.one_of(st.binary(max_size=300),
                                                               st.builds(lambda s: s.encode(), st.text(max_size=50))),
           st.one_of(st.none(), st.integers(0, 2**32 - 1)))
    def frames(method: int, flags: int, payload: bytes, length: int | None) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(node.local_socket)
        token = token_for_socket(node.local_socket).encode()  # fuzz past the door, as an engine
        try:
            if token:
                s.sendall(REQUEST_HEADER.pack(len(token), HELLO, 0) + token)
                hn, _ok = REPLY_HEADER.unpack(s.recv(REPLY_HEADER.size, socket.MSG_WAITALL))
                s.recv(hn, socket.MSG_WAITALL) if hn else None
            n = len(payload) if length is None or length > 1 << 20 else length
            s.sendall(REQUEST_HEADER.pack(n, method, flags) + payload[:n])
            s.shutdown(socket.SHUT_WR)  # one frame (maybe truncated): the node answers or closes
            head = s.recv(REPLY_HEADER.size, socket.MSG_WAITALL)
            seen["answered" if len(head) == REPLY_HEADER.size else "closed"] += 1
        except (ConnectionError, TimeoutError, OSError) as exc:
            seen[type(exc).__name__] += 1
        finally:
            s.close()

    frames()
    f = rep.fig
    f.tried = sum(seen.values())
    f.failed = f.tried - seen["answered"]
    f.crashes = int(node.proc.poll() is not None)
    f.lost, f.wrong = read_back(victim, hs)
    f.tracebacks = tracebacks_in(node.log())
    f.notes.update(**dict(seen))
    rep.done()
    assert seen["TimeoutError"] == 0, "a frame left the node neither answering nor closing"
    assert not f.bad(), f


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                         st.text(max_size=20))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                                  st.dictionaries(st.text(max_size=8), inner, max_size=5)),
                           max_leaves=20)
TRACE_KEYS = ["timestamp", "input_length", "output_length", "hash_ids", "time", "namespace", "hashes", "page_bytes",
              "block_tokens", "tokens", "instance"]
VALID_MOONCAKE = st.builds(
    lambda t, n, ids: json.dumps({"timestamp": t, "input_length": n, "output_length": 1, "hash_ids": ids}),
    st.integers(0, 10**9), st.integers(0, 10**5), st.lists(st.integers(0, 2**20), max_size=30))
TRACE_LINES = st.one_of(
    VALID_MOONCAKE,
    VALID_MOONCAKE,  # half the lines are good ones, so good and bad mix in one file
    st.dictionaries(st.sampled_from(TRACE_KEYS), JSON_VALUES, max_size=8).map(lambda d: json.dumps(d, allow_nan=True)),
    JSON_VALUES.map(lambda v: json.dumps(v, allow_nan=True)),
    st.text(max_size=80).map(lambda t: t.replace("\n", " ")),
)


def test_garbage_traces_always_end_in_an_exit_code_and_one_line(tmp_path_factory, capsys):  # type: ignore[no-untyped-def]
    from pegaflow.replay.command import main

    rep = Report("garbage traces (hypothesis JSON lines)", expected_failures=True)
    d = tmp_path_factory.mktemp("traces")
    codes: Counter[int] = Counter()
    failures: list[str] = []

    @SETTINGS
    @given(st.lists(TRACE_LINES, min_size=1, max_size=6))
    def traces(lines: list[str]) -> None:
        p = d / "t.jsonl"
        p.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
        try:
            code = main([str(p), "--quiet", "--sweep", "none", "--json"])
        except BaseException as exc:  # noqa: BLE001 - exactly what must never happen
            failures.append(f"{type(exc).__name__}: {exc}"[:200])
            return
        err = capsys.readouterr().err.strip().splitlines()
        codes[code] += 1
        if code != 0 and len(err) != 1:
            failures.append(f"exit {code} with {len(err)} stderr lines")

    traces()
    f = rep.fig
    f.tried = sum(codes.values()) + len(failures)
    f.failed = sum(v for k, v in codes.items() if k != 0)
    f.tracebacks = len(failures)
    f.notes.update(**{f"exit_{k}": v for k, v in sorted(codes.items())})
    rep.done()
    assert not failures, failures[:5]
