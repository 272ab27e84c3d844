"""PegaFlow's version: the installed distribution's (``pyproject.toml``'s ``version``), read
from its metadata, so one number is written in one place. ``pegaflow.__version__``, and
``--version``/``-V`` of every command (``pegaflow.config.options.build_parser``), print it."""

from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "pegaflow"
UNKNOWN = "0+unknown"  # run from a source tree that was never installed


def version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN
