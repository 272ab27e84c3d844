"""Operator tools: commands that look inside running nodes and metaservers over their gRPC
contracts (``pegaflow status``). They run on the operator's side, never in a daemon."""
