"""``pegaflow``: the umbrella command; each subcommand lives in its own module.

The table below is the only thing to edit when a subcommand is added: its module must
have ``main(argv, prog) -> int``. Modules are imported only when their subcommand runs,
so ``pegaflow --help`` stays instant.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

from pegaflow.common.startup import structlog_without_rich

# name -> (module with main(argv, prog), one-line summary)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "replay": ("pegaflow.replay.command", "offline trace analysis on the node's own cache code"),
    "router": ("pegaflow.router.cli", "KV-aware HTTP router and prefill/decode disaggregation in front of vLLM"),
    "status": ("pegaflow.ops.status", "one screen of a node or the cluster: pool, hit rate and ceiling, tiers"),
    "cache": ("pegaflow.ops.cache", "inspect, clear and pin a node's cache (one line per answer)"),
}


def _usage() -> str:
    lines = ["usage: pegaflow <command> [options]", "", "commands:"]
    width = max(map(len, SUBCOMMANDS))
    lines += [f"  {name.ljust(width)}  {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    lines += ["", "pegaflow <command> --help shows a command's options; pegaflow -V its version."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        (sys.stdout if args else sys.stderr).write(_usage())
        raise SystemExit(0 if args else 2)
    if args[0] in ("-V", "--version"):
        from pegaflow.core.version import version

        sys.stdout.write(f"pegaflow {version()}\n")
        raise SystemExit(0)
    name, rest = args[0], args[1:]
    entry = SUBCOMMANDS.get(name)
    if entry is None:
        sys.stderr.write(
            f"pegaflow: error: unknown command {name!r} (choose from {', '.join(SUBCOMMANDS)})\n"
        )
        raise SystemExit(2)
    # Every subcommand prints plain lines (or JSON), and starts ~0.14 s of CPU sooner without
    # rich (``pegaflow cache pins`` to a closed port: 0.58 -> 0.48 s, 2-core VM); transformers, the
    # router's tokenizer library, imports and tokenizes without it.
    structlog_without_rich()
    module = importlib.import_module(entry[0])
    try:
        code = module.main(rest, prog=f"pegaflow {name}")
        sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stderr.write(f"pegaflow {name}: interrupted\n")
        raise SystemExit(130) from None
    except BrokenPipeError:
        # The reader went away (``| head``): no traceback, and no second error at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None
    raise SystemExit(code)


if __name__ == "__main__":
    main()
