"""Wire format of the node's local fast path (a Unix socket beside gRPC).

Engines on the node's host (all of them: they map the node's pool) call the data-path
RPCs over this socket instead of gRPC, whose Python machinery costs ~0.6-0.9 ms per unary
call on a small machine, against a few microseconds for the protobuf (de)serialisation.
The payloads are the very same protobuf messages as the gRPC service (proto/node.proto),
so the two transports cannot drift apart; only the framing is new:

    request = u32 payload length | u8 method | u8 flags | payload (serialised *Request)
    reply   = u32 payload length | u8 status | payload (serialised *Response if status
              is 0 = OK, else the UTF-8 error message); status is the gRPC code number

All integers are little-endian. A connection to a node with a token opens with a HELLO
frame (method 0, payload = the token, UTF-8) that the node answers OK, or answers
UNAUTHENTICATED and closes; without a token HELLO is optional. Frames on one connection are
served in order, one at a time; a frame with ``NO_REPLY`` gets no reply (its errors are logged by the node). A client
sends its next frame only after reading the previous reply, so it needs no request ids.
A malformed frame (too long, unknown method, undecodable payload) closes the connection.

POOL (method 255, empty payload; after HELLO when the node has a token) asks for the pool:
the reply payload is :data:`POOL_REPLY` (the node's epoch, the pool's bytes) and carries one
file descriptor of the pool's memfd, opened read-write, as ``SCM_RIGHTS`` ancillary data on
the reply's first byte. An engine that may use the socket (mode 0600, or 0660 for the node's
``--access-group``) but cannot open ``/proc/<node pid>/fd/<fd>`` (another user) maps that
descriptor. A node that cannot send it answers UNAVAILABLE; the engine then falls back to
the ``pool_path`` of Register.
"""

from __future__ import annotations

import struct

from google.protobuf.message import Message

from pegaflow._proto import node_pb2

REQUEST_HEADER = struct.Struct("<IBB")
REPLY_HEADER = struct.Struct("<IB")

HELLO = 0  # method number of the opening frame carrying the token
POOL = 255  # method number of the request for the pool's file descriptor (SCM_RIGHTS)
POOL_REPLY = struct.Struct("<QQ")  # epoch, pool bytes

NO_REPLY = 0x01  # flags bit: the caller does not read a reply (async Commit / Release)

# Same bound as the gRPC server's message size: a 16k-hash request is ~400 KiB.
MAX_FRAME = 64 << 20

# Method number on the wire -> (name, request type, response type). Register, Session,
# Health and Stats stay gRPC-only: the session stream is the node's liveness signal.
METHODS: dict[int, tuple[str, type[Message], type[Message]]] = {
    1: ("Query", node_pb2.QueryRequest, node_pb2.QueryResponse),
    2: ("Reserve", node_pb2.ReserveRequest, node_pb2.ReserveResponse),
    3: ("Commit", node_pb2.CommitRequest, node_pb2.CommitResponse),  # also Abort (abort=True)
    4: ("Release", node_pb2.ReleaseRequest, node_pb2.ReleaseResponse),
    5: ("Reset", node_pb2.ResetRequest, node_pb2.ResetResponse),
}
METHOD_IDS: dict[str, int] = {name: mid for mid, (name, _, _) in METHODS.items()}
