"""How engines reach the node's service: gRPC (the servicer in :mod:`pegaflow.node.service`)
and the Unix-socket fast path (:mod:`unix_socket`)."""
