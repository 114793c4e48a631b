"""Plots as shapes: bar charts the templates draw as inline SVG (autoescaped like everything else;
no markup is built here), so no charting library and no script is needed to see a curriculum."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WIDTH, HEIGHT, BASE = 560, 180, 150  # the SVG's size; the bars stand on y = BASE


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    label: str
    value: str
    css: str


@dataclass(frozen=True)
class BarChart:
    title: str
    bars: list[Bar]
    width: int = WIDTH
    height: int = HEIGHT
    base: int = BASE


def bar_chart(
    title: str,
    items: Sequence[tuple[str, float]],
    css: Sequence[str] = (),
    percent: bool = False,
    scale: float | None = None,
) -> BarChart:
    """Bars of `items` (label, value) scaled to the tallest, or to `scale` (a share's 1.0: a half
    is drawn half high); `css` names each bar's class."""
    top = scale or max((value for _, value in items), default=0.0) or 1.0
    slot = WIDTH / max(1, len(items))
    bars = []
    for i, (label, value) in enumerate(items):
        height = (BASE - 20) * value / top
        shown = f"{value:.0%}" if percent else f"{value:g}"
        bars.append(
            Bar(
                i * slot + slot * 0.15,
                BASE - height,
                slot * 0.7,
                height,
                label,
                shown,
                css[i] if i < len(css) else "bar",
            )
        )
    return BarChart(title, bars)


def histogram(title: str, values: Sequence[float], bins: int = 10) -> BarChart:
    """Counts of `values` in [0, 1] over `bins` equal bins (1.0 falls in the last)."""
    counts = [0] * bins
    for value in values:
        counts[min(bins - 1, max(0, int(value * bins)))] += 1
    labels = [f"{i / bins:.1f}" for i in range(bins)]
    return bar_chart(title, list(zip(labels, [float(c) for c in counts], strict=True)))


@dataclass(frozen=True)
class Column:
    """One stacked bar: its `segments` (bottom first) share x and width."""

    label: str
    x: float
    width: float
    segments: list[Bar]


@dataclass(frozen=True)
class StackedChart:
    title: str
    columns: list[Column]
    width: int = WIDTH
    height: int = HEIGHT
    base: int = BASE


def stacked_chart(title: str, columns: Sequence[tuple[str, Sequence[tuple[str, float]]]]) -> StackedChart:
    """Columns of (label, [(part, value), ...]) stacked bottom first and scaled to the tallest
    column; each segment's css class is `pool-{part}` and its label `{column}:{part}`."""
    top = max((sum(v for _, v in parts) for _, parts in columns), default=0.0) or 1.0
    slot = WIDTH / max(1, len(columns))
    drawn = []
    for i, (label, parts) in enumerate(columns):
        x, width, y = i * slot + slot * 0.15, slot * 0.7, float(BASE)
        segments = []
        for part, value in parts:
            height = (BASE - 20) * value / top
            y -= height
            segments.append(Bar(x, y, width, height, f"{label}:{part}", f"{value:g}", f"pool-{part}"))
        drawn.append(Column(label, x, width, segments))
    return StackedChart(title, drawn)
