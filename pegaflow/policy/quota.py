"""Per-namespace shares of the L1 pool (``--namespace-quota NAME=SPEC``).

A *quota* names a group of namespaces and gives it a guaranteed share of the pool, a
maximum share, or both. The node and ``pegaflow replay`` parse it here and hand the
resulting :class:`Quotas` to :class:`~pegaflow.core.block_index.BlockIndex`, which applies
the rule on its eviction path (one code, so a replay predicts what the node does):

- A group holding at most its **guaranteed** bytes is never the victim of another
  namespace's insert: the victim is the least recently used block among the groups
  above their guarantee, the namespaces without a quota, and the inserting group itself.
- A group at its **maximum** evicts its own least recently used block to insert one
  more, even when the pool has free pages (none evictable: the insert gets no page).
- Without any quota the index behaves exactly as before (one global LRU).

A group's bytes are the pages its namespaces hold in the index, PENDING and RESIDENT,
pinned or not. Pinned blocks are never victims, so pins can keep a group above its
maximum or hold the pool such that a guarantee cannot be met; quotas bound eviction,
they do not reserve memory.

Grammar of one flag value (the flag is repeatable; ``PEGAFLOW_NAMESPACE_QUOTA`` takes a
comma-separated list of the same values)::

    QUOTA := NAME "=" SPEC              (NAME is what precedes the last "=")
    SPEC  := SHARE                      guaranteed share (same as min:SHARE)
           | "min:" SHARE               guaranteed share
           | "max:" SHARE               maximum share
           | "min:" SHARE "/max:" SHARE both (either order)
    SHARE := a decimal in (0, 1] (0.3) or a percentage in (0, 100] (30%)

A NAME matches a namespace whose full name equals it, or, for the connector's namespaces
(``pf<v>|<model>|cfg=...|shard=i/n``), whose model field equals it: ``llama=0.3`` covers
every TP shard and state namespace of the model ``llama`` together. An exact name wins
over a model match. Errors (one line, ``ValueError``): an unknown form, a share outside
(0, 1], ``min > max``, a NAME given twice, guarantees summing to more than 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Quota:
    """One ``--namespace-quota`` value: shares of the pool, as fractions in (0, 1]."""

    name: str
    min_share: float = 0.0  # guaranteed; 0: none
    max_share: float = 1.0  # 1: no cap

    def __str__(self) -> str:
        parts = []
        if self.min_share:
            parts.append(f"min:{self.min_share:g}")
        if self.max_share < 1.0:
            parts.append(f"max:{self.max_share:g}")
        return f"{self.name}={'/'.join(parts) or 'max:1'}"


def _share(text: str, whole: str) -> float:
    t = text.strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise ValueError(f"invalid share {text!r} in {whole!r} (expected a decimal in (0, 1] or a percentage)") from None
    if not 0.0 < v <= 1.0:
        raise ValueError(f"share {text!r} in {whole!r} is outside (0, 1]")
    return v


def parse_quota(text: str) -> Quota:
    """One flag value, ``NAME=SPEC`` (module docstring); ValueError with a one-line reason."""
    name, eq, spec = text.rpartition("=")
    name = name.strip()
    if not eq or not name or not spec.strip():
        raise ValueError(f"invalid namespace quota {text!r} (expected NAME=SHARE, NAME=min:SHARE, "
                         "NAME=max:SHARE or NAME=min:SHARE/max:SHARE)")
    lo: float | None = None
    hi: float | None = None
    for term in spec.split("/"):
        kind, colon, value = term.strip().partition(":")
        if not colon:
            kind, value = "min", term
        kind = kind.strip().lower()
        if kind == "min" and lo is None:
            lo = _share(value, text)
        elif kind == "max" and hi is None:
            hi = _share(value, text)
        else:
            raise ValueError(f"invalid namespace quota {text!r} (unknown or repeated term {term.strip()!r}; "
                             "expected min:SHARE and/or max:SHARE)")
    q = Quota(name, lo or 0.0, 1.0 if hi is None else hi)
    if q.min_share > q.max_share:
        raise ValueError(f"namespace quota {text!r}: min {q.min_share:g} exceeds max {q.max_share:g}")
    return q


def model_of(namespace: str) -> str | None:
    """The model field of a connector namespace (``pf<v>|<model>|...``), else None."""
    if namespace.startswith("pf"):
        parts = namespace.split("|", 2)
        if len(parts) >= 2 and parts[1]:
            return parts[1]
    return None


class Quotas:
    """A validated set of quotas: which group a namespace is in, and each group's bytes.

    This is what ``BlockIndex(quotas=...)`` asks for (its ``Shares`` protocol); the index
    does the accounting and the victim choice, this object only answers the two
    questions below.
    """

    def __init__(self, quotas: Iterable[Quota]) -> None:
        self.quotas: list[Quota] = list(quotas)
        seen: set[str] = set()
        for q in self.quotas:
            if q.name in seen:
                raise ValueError(f"namespace quota for {q.name!r} given twice")
            seen.add(q.name)
        total = sum(q.min_share for q in self.quotas)
        if total > 1.0 + 1e-9:
            raise ValueError(f"guaranteed namespace shares sum to {total:g}, more than the whole pool")
        self._by_name = {q.name: i for i, q in enumerate(self.quotas)}

    @classmethod
    def parse(cls, values: Iterable[str]) -> Quotas:
        return cls(parse_quota(v) for v in values)

    def __bool__(self) -> bool:
        return bool(self.quotas)

    def names(self) -> list[str]:
        return [q.name for q in self.quotas]

    def group(self, namespace: str) -> int | None:
        """Index of the quota covering ``namespace`` (exact name first, then its model), or None."""
        g = self._by_name.get(namespace)
        if g is None:
            model = model_of(namespace)
            if model is not None:
                g = self._by_name.get(model)
        return g

    def limits(self, capacity: int) -> list[tuple[int, int]]:
        """Per group, (guaranteed bytes, maximum bytes) of a pool of ``capacity`` bytes."""
        return [(int(q.min_share * capacity), int(q.max_share * capacity)) for q in self.quotas]
