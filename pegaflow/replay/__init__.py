"""``pegaflow replay``: a request trace through the node's own block index, admission and ceiling,
offline (docs/replay.md)."""
