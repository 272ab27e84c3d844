"""Where a block missing from the pool can come from: the node's SSD (:mod:`ssd`) and a peer
node's pool (:mod:`remote`)."""
