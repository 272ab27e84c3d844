"""What ``pegaflow replay`` prints: readable tables, JSON, and the hit-rate curve as a PNG.

The three outputs are views of one :class:`Report`; the JSON carries every number in the
tables (and every window, where the table summarises long traces).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from pegaflow.config.capacity import KV_AWARE, Capacity
from pegaflow.core.trace import Trace
from pegaflow.core.units import format_size
from pegaflow.replay.model import ISOLATED, SHARED
from pegaflow.replay.run import RunResult
from pegaflow.replay.windows import CeilingReport, WindowRow

if TYPE_CHECKING:  # matplotlib is imported by plot() only (pegaflow[plot])
    from matplotlib.typing import ColorType

# Per window length, the table lists at most this many windows (the JSON has all).
MAX_WINDOW_ROWS = 12


class Comparison(TypedDict):
    """Shared vs isolated pools for one admission setting and route (JSON: ``shared_vs_isolated``)."""

    admission: str
    route: str
    instances: int
    shared_hit_rate: float
    isolated_hit_rate: float
    shared_token_hit_rate: float
    isolated_token_hit_rate: float
    gain: float  # shared - isolated hit rate


class Curve(TypedDict):
    """One scenario over the sweep capacities, in order (JSON: ``sweep``)."""

    label: str
    l1: list[str]
    l1_capacity_blocks: list[int]
    hit_rate: list[float]
    token_hit_rate: list[float]


class Timing(TypedDict):
    """JSON: ``timing``."""

    seconds: float  # the whole analysis
    replay_seconds: float
    block_accesses: int
    block_accesses_per_second: float


@dataclass
class Report:
    """Everything one ``pegaflow replay`` invocation found."""

    path: str
    trace: Trace
    ceiling: CeilingReport
    runs: list[RunResult]  # the scenarios at the configured capacity
    sweep: list[RunResult] = field(default_factory=list)  # the same scenarios at each sweep capacity
    page_bytes: int = 0  # of the mooncake namespace / the default, for byte labels
    seconds: float = 0.0  # wall time of the whole analysis

    def comparisons(self) -> list[Comparison]:
        """Shared vs isolated, per admission setting, where both were run."""
        out: list[Comparison] = []
        for shared in self.runs:
            if shared.scenario.pools != SHARED:
                continue
            for iso in self.runs:
                sc = iso.scenario
                if sc.pools == ISOLATED and sc.tinylfu == shared.scenario.tinylfu and sc.route == shared.scenario.route:
                    out.append(
                        {
                            "admission": sc.admission,
                            "route": sc.route,
                            "instances": sc.instances,
                            "shared_hit_rate": shared.hit_rate,
                            "isolated_hit_rate": iso.hit_rate,
                            "shared_token_hit_rate": shared.token_hit_rate,
                            "isolated_token_hit_rate": iso.token_hit_rate,
                            "gain": shared.hit_rate - iso.hit_rate,
                        }
                    )
        return out

    def curves(self) -> list[Curve]:
        """One hit-rate curve per scenario, over the sweep capacities in the order given."""
        by_label: dict[str, list[RunResult]] = {}
        for r in self.sweep:
            by_label.setdefault(r.scenario.label, []).append(r)
        out: list[Curve] = []
        for label, rs in by_label.items():
            out.append(
                {
                    "label": label,
                    "l1": [str(r.scenario.l1) for r in rs],
                    "l1_capacity_blocks": [r.l1_capacity_blocks for r in rs],
                    "hit_rate": [r.hit_rate for r in rs],
                    "token_hit_rate": [r.token_hit_rate for r in rs],
                }
            )
        return out

    def timing(self) -> Timing:
        accesses = sum(r.blocks for r in (*self.runs, *self.sweep))
        replay_s = sum(r.seconds for r in (*self.runs, *self.sweep))
        return {
            "seconds": self.seconds,
            "replay_seconds": replay_s,
            "block_accesses": accesses,
            "block_accesses_per_second": accesses / replay_s if replay_s else 0.0,
        }

    def to_dict(self) -> dict[str, object]:
        t = self.trace
        return {
            "trace": {
                "path": self.path,
                "format": t.format,
                "requests": len(t.requests),
                "blocks": t.blocks,
                "unique_blocks": t.unique,
                "tokens": t.tokens,
                "span_seconds": t.span,
                "skipped_lines": t.skipped,
                "first_bad_line": t.first_bad or None,
                "namespaces": t.namespaces,
            },
            "ceiling": self.ceiling.to_dict(),
            "runs": [r.to_dict() for r in self.runs],
            "shared_vs_isolated": self.comparisons(),
            "sweep": self.curves(),
            "timing": self.timing(),
        }

    def to_json(self) -> str:
        """Strict JSON: a number that is not one (an HLL read that never happened) is null."""
        return json.dumps(_finite(self.to_dict()), indent=2, allow_nan=False)


def _finite(o: object) -> object:
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_finite(v) for v in o]
    return o


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.2f}%"


def _dur(s: float) -> str:
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


def _table(header: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ") -> list[str]:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for k, r in enumerate(cells):
        parts = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append(indent + "  ".join(parts).rstrip())
        if k == 0:
            lines.append(indent + "  ".join("-" * w for w in widths))
    return lines


def _capacity_label(r: RunResult, page_bytes: int, unique: int) -> str:
    blocks = r.l1_capacity_blocks
    share = f"{100 * blocks / unique:.1f}% of U" if unique else ""
    cap: Capacity = r.scenario.l1
    size = format_size(int(cap.value)) if cap.unit == "bytes" else _bytes(blocks * page_bytes)
    return f"{blocks:,} blocks ({size}, {share})"


def _bytes(n: int) -> str:
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult:
            return f"{n / mult:.3g} {unit}"
    return f"{n} B"


def _short(name: str, width: int = 40) -> str:
    """A namespace for a table cell: connector namespaces are long; the JSON has them whole."""
    return name if len(name) <= width else name[: width - 3] + "..."


def render_table(rep: Report) -> str:
    """The human-readable report (what ``pegaflow replay`` prints without ``--json``)."""
    t = rep.trace
    c = rep.ceiling
    out = [
        f"trace {rep.path}: {t.format}, {len(t.requests):,} requests over {_dur(t.span)}"
        + (f", {t.skipped} bad lines skipped (first: {t.first_bad})" if t.skipped else ""),
        f"  block accesses N {t.blocks:,}   distinct blocks U {t.unique:,}   prompt tokens {t.tokens:,}",
        "",
        "ceiling r* = (N - U) / N (no cache can hit more)",
        f"  exact {_pct(c.ceiling)}   HLL estimate {_pct(c.ceiling_hll)} (lg_k {c.hll_lg_k})",
    ]
    if c.windows:
        out += [
            "",
            "per-window ceilings (tumbling windows from the first request; hit rate of the first scenario)",
        ]
        rows: list[Sequence[object]] = []
        by_window: dict[str, list[WindowRow]] = {}
        for w in c.windows:
            by_window.setdefault(w.window, []).append(w)
        for label, ws in by_window.items():
            shown = ws if len(ws) <= MAX_WINDOW_ROWS else ws[: MAX_WINDOW_ROWS - 1]
            for w in shown:
                rows.append(
                    (
                        label,
                        w.index,
                        _dur(w.start),
                        f"{w.blocks:,}",
                        f"{w.unique:,}",
                        _pct(w.ceiling),
                        _pct(w.ceiling_hll),
                        _pct(w.hit_rate),
                    )
                )
            if len(shown) < len(ws):
                rows.append((label, f"... {len(ws) - len(shown)} more (see --json)", "", "", "", "", "", ""))
        out += _table(("window", "#", "start", "N", "U", "r* exact", "r* HLL", "hit rate"), rows)
    if rep.runs:
        sc = rep.runs[0].scenario
        routes = list(dict.fromkeys(r.scenario.route for r in rep.runs))
        out += [
            "",
            f"scenarios at L1 {sc.l1}"
            + (f", SSD {sc.ssd} (written on L1 {sc.ssd_writes})" if not sc.ssd.is_zero else ", no SSD tier")
            + (f", route {', '.join(routes)}" if sc.instances > 1 else ""),
        ]
        rows = []
        for r in rep.runs:
            rows.append(
                (
                    r.scenario.label,
                    f"{r.l1_capacity_blocks:,}",
                    _pct(r.hit_rate),
                    _pct(r.token_hit_rate),
                    f"{r.l1_hit_blocks:,}",
                    f"{r.ssd_hit_blocks:,}",
                    _pct(r.ssd_hit_tokens / r.tokens if r.tokens else 0),
                    f"{r.evictions:,}",
                    f"{r.admission_rejections:,}",
                    f"{r.imbalance:.2f}x",
                    f"{r.delay_mean:.2f}s / {r.delay_p99:.2f}s",
                )
            )
        out += _table(
            (
                "scenario",
                "L1 blocks",
                "hit (blocks)",
                "hit (tokens)",
                "L1 hits",
                "SSD hits",
                "SSD tokens",
                "evictions",
                "rejected",
                "imbalance",
                "queue mean / p99",
            ),
            rows,
        )
        out.append(
            f"  imbalance: max/mean requests per instance per minute (request-weighted mean); queue: "
            f"waiting for the instance's prefill ({sc.time.prefill_us_per_token:g} us per prompt token not held, "
            f"decode {sc.time.decode_s:g}s" + (f"; kv-aware load bound {sc.time.load_bound:g}, window "
                                                 f"{sc.time.load_window:g}s" if KV_AWARE in routes else "")
            + ("; computed blocks visible at the end of prefill" if sc.time.commit_at_prefill_end else "")
            + ")"
        )
    names = sorted({n for r in rep.runs for n in r.namespaces})
    if len(names) > 1:
        sc = rep.runs[0].scenario
        out += ["", "per namespace (prefix hit rate in blocks)"
                + (f"; quotas {' '.join(map(str, sc.quotas))}" if sc.quotas else "")]
        out += _table(
            ("namespace", "accesses", *[r.scenario.label for r in rep.runs]),
            [
                (_short(n), f"{rep.runs[0].namespaces.get(n, (0, 0))[0]:,}",
                 *[_pct(r.namespace_hit_rate(n)) for r in rep.runs])
                for n in names
            ],
        )
    comps = rep.comparisons()
    if comps:
        out += ["", "shared vs isolated pools (same total capacity)"]
        out += _table(
            ("admission", "route", "instances", "shared", "isolated", "gain"),
            [
                (
                    d["admission"],
                    d["route"],
                    d["instances"],
                    _pct(d["shared_hit_rate"]),
                    _pct(d["isolated_hit_rate"]),
                    f"{100 * d['gain']:+.2f} pp",
                )
                for d in comps
            ],
        )
    curves = rep.curves()
    if curves:
        out += ["", "capacity sweep (L1; prefix hit rate in blocks)"]
        first = [r for r in rep.sweep if r.scenario.label == curves[0]["label"]]
        rows = []
        for k, r in enumerate(first):
            row: list[object] = [_capacity_label(r, rep.page_bytes, t.unique)]
            row += [_pct(cv["hit_rate"][k]) for cv in curves]
            rows.append(row)
        rows.append(["ceiling r*", *[_pct(c.ceiling)] * len(curves)])
        out += _table(("L1 capacity", *[str(cv["label"]) for cv in curves]), rows)
    d = rep.timing()
    out += [
        "",
        f"replayed {d['block_accesses']:,} block accesses in {d['replay_seconds']:.2f}s "
        f"({d['block_accesses_per_second'] / 1e6:.2f}M/s); total {rep.seconds:.2f}s",
    ]
    return "\n".join(out) + "\n"


def plot(rep: Report, path: str | Path) -> None:
    """Hit rate (blocks, solid; tokens, dotted) vs L1 capacity, with the ceiling line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    curves = rep.curves()
    colors: dict[str, ColorType] = {}
    for cv in curves:
        xs_cv = cv["l1_capacity_blocks"]
        (line,) = ax.plot(xs_cv, [100 * x for x in cv["hit_rate"]], marker="o", label=str(cv["label"]))
        colors[str(cv["label"])] = line.get_color()
        ax.plot(
            xs_cv, [100 * x for x in cv["token_hit_rate"]], linestyle=":", color=line.get_color(), alpha=0.7
        )
    for r in rep.runs:
        ax.scatter(
            [max(r.l1_capacity_blocks, 1)],
            [100 * r.hit_rate],
            marker="*",
            s=140,
            zorder=5,
            color=colors.get(r.scenario.label),
            edgecolors="black",
            linewidths=0.5,
        )
    ax.axhline(
        100 * rep.ceiling.ceiling,
        color="red",
        linestyle="--",
        label=f"ceiling r* = (N-U)/N = {100 * rep.ceiling.ceiling:.1f}%",
    )
    xs = [x for cv in curves for x in cv["l1_capacity_blocks"] if x > 0]
    xs += [r.l1_capacity_blocks for r in rep.runs if r.l1_capacity_blocks > 0]
    if xs and max(xs) / max(min(xs), 1) > 20:
        ax.set_xscale("log")
    ax.set_xlabel(f"L1 capacity (blocks; U = {rep.trace.unique:,} distinct blocks)")
    ax.set_ylabel("prefix hit rate (%)  — solid: blocks, dotted: tokens")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ssd = rep.runs[0].scenario.ssd if rep.runs else None
    tier = f"; SSD {ssd} in every point" if ssd is not None and not ssd.is_zero else ""
    ax.set_title(f"pegaflow replay: {Path(rep.path).name}  (stars: configured capacity{tier})", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
