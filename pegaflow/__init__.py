"""PegaFlow: an external KV-cache service for vLLM."""

from __future__ import annotations


def __getattr__(name: str) -> str:
    # Read on first use, so importing pegaflow (every command, every engine) pays nothing for it.
    if name == "__version__":
        from pegaflow.core.version import version

        return version()
    raise AttributeError(f"module 'pegaflow' has no attribute {name!r}")
