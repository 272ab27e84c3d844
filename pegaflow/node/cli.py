"""``pegaflow-node`` (alias ``pegaflow-server``): run the per-host KV-cache daemon."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pegaflow.common.startup import structlog_without_rich
from pegaflow.config.commands import load
from pegaflow.config.options import NODE


def main(argv: Sequence[str] | None = None) -> None:
    prog = "pegaflow-node"
    config = load(NODE, prog, argv)
    structlog_without_rich()
    # The daemon's imports only once the flags parsed: --help and a bad flag answer in about
    # half the time (structlog, numpy, grpc are not loaded for them).
    import asyncio

    from pegaflow.common.logging import configure_logging
    from pegaflow.node.daemon import Node, StartupError
    from pegaflow.node.pool import PoolError

    configure_logging(config.log_level, config.log_format)

    try:
        node = Node(config)
        asyncio.run(node.run())
    except (PoolError, StartupError) as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
