"""``pegaflow-node`` (alias ``pegaflow-server``): run the per-host KV-cache daemon."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from pegaflow.common.logging import configure_logging
from pegaflow.common.options import NODE, parse_options
from pegaflow.node.pool import PoolError


def main(argv: Sequence[str] | None = None) -> None:
    prog = "pegaflow-node"
    opts = parse_options(NODE, prog, argv)
    configure_logging(opts.log_level, opts.log_format)
    from pegaflow.node.daemon import Node, StartupError

    try:
        node = Node(opts)
        asyncio.run(node.run())
    except (PoolError, StartupError) as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
