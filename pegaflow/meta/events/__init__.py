"""Node events: schema, codec, stream names, the node-side publisher and the meta-side consumer.

Ingest only: how the index is stored lives in ``pegaflow.meta.index``.
"""

from pegaflow.meta.events.codec import MalformedEvent, decode, encode
from pegaflow.meta.events.schema import FLAG_LAST, HASH_BYTES, SCHEMA_VERSION, Event, Op
from pegaflow.meta.events.streams import GROUP, stream_key

__all__ = [
    "FLAG_LAST",
    "GROUP",
    "HASH_BYTES",
    "SCHEMA_VERSION",
    "Event",
    "MalformedEvent",
    "Op",
    "decode",
    "encode",
    "stream_key",
]
