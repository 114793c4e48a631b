"""Targets as the benches print them: a row per target with its bound, its value and a verdict, and
the one comparison several benches make, a feature on against off judged by the run-to-run spread."""

from __future__ import annotations

import sys

from bench.common import Figures, median
from bench.tables import print_rows


def verdict(target: str, bound: str, value: str, met: bool | None, **figures: float) -> Figures:
    """A target's row; `met` None: a figure printed beside the targets, not one itself."""
    return {"target": target, "bound": bound, "value": value, "met": met, **figures}


def spread_verdicts(
    rows: list[Figures], on: str, off: str, *, target: bool = True, name: str = ""
) -> list[Figures]:
    """Per percentile: median `on` against median `off` (rows' `stack`), within the larger
    run-to-run spread (max - min of either); `target` False prints it beside the targets."""
    out = []
    for key in ("p50_ms", "p99_ms"):
        a, b = ([r[key] for r in rows if r["stack"] == s and r.get(key) is not None] for s in (on, off))
        if a and b:
            spread, diff = max(max(a) - min(a), max(b) - min(b)), median(a) - median(b)
            text = f"{median(a):.2f} - {median(b):.2f} = {diff:+.2f} ms (spread {spread:.2f})"
            met = abs(diff) < spread if target else None
            label = f"{name} {on} - {off}" if name else f"{on} - {off}"
            out.append(
                verdict(
                    f"{label}, step {key[:3]}",
                    "|diff| < spread",
                    text,
                    met,
                    on=median(a),
                    off=median(b),
                    diff=diff,
                    spread=spread,
                )
            )
    return out


def print_targets(verdicts: list[Figures]) -> None:
    print("\ntargets")
    said = {True: "PASS", False: "FAIL", None: "beside"}
    print_rows(
        ["target", "bound", "value", "verdict"],
        [[v["target"], v["bound"], v["value"], said[v["met"]]] for v in verdicts],
    )
    sys.stdout.flush()
