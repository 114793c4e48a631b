"""The Grafana dashboard (k8s/grafana/codegym-dashboard.json) asks only for metrics our servers export.

Every metric name in a panel's PromQL must be a series some server puts on its /metrics: a real
sandbox worker, a runtime over it and an OpenEnv gateway over the runtime are started and scraped
once, and their `# TYPE` lines say which families exist and so which series names they expose.
"""

from __future__ import annotations

import copy
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from codegym.library.store import Library
from tests.helpers.servers import CodegymServer
from tests.test_metrics import metrics_address

DASHBOARD = Path(__file__).resolve().parents[1] / "k8s" / "grafana" / "codegym-dashboard.json"

# PromQL string literals (label values, `__name__="..."` aside) are not metric names.
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
NAME_MATCHER = re.compile(r'__name__\s*=\s*"([^"]*)"')
IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")

# The series names a family of each type puts in the text exposition format.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, and those inside collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panels(panel)


def metric_names(expr: str) -> set[str]:
    """The codegym metric names a PromQL expression reads."""
    names = {m for m in NAME_MATCHER.findall(expr) if m.startswith("codegym_")}
    bare = STRING.sub('""', expr)
    return names | {m for m in IDENTIFIER.findall(bare) if m.startswith("codegym_")}


def dashboard_metrics(dashboard: dict[str, Any]) -> dict[str, list[str]]:
    """Metric name -> titles of the panels whose targets use it."""
    used: dict[str, list[str]] = {}
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            for name in metric_names(target.get("expr", "")):
                used.setdefault(name, []).append(panel.get("title", f"panel {panel.get('id')}"))
    return used


def exported_series(text: str) -> set[str]:
    """Series names a /metrics text exposes, from its `# TYPE name type` lines: a counter family is
    typed as `x_total` (or `x`) and exposes `x_total`; a histogram `x` exposes `x_bucket`, `x_sum`,
    `x_count`; a gauge `x` exposes `x`."""
    names: set[str] = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 4 or parts[:2] != ["#", "TYPE"]:
            continue
        family, kind = parts[2], parts[3]
        if kind == "counter":
            family = family.removesuffix("_total")
        names.update(family + suffix for suffix in SUFFIXES.get(kind, ("",)))
    return names


def missing_metrics(dashboard: dict[str, Any], exported: set[str]) -> dict[str, list[str]]:
    """Names the dashboard reads that no scraped server exports, with the panels that read them."""
    return {name: titles for name, titles in dashboard_metrics(dashboard).items() if name not in exported}


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def scrape_text(address: str) -> str:
    return urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()


def test_dashboard_panels_are_well_formed() -> None:
    dashboard = load_dashboard()
    ids = [panel.get("id") for panel in panels(dashboard)]
    assert None not in ids, "a panel has no id"
    assert len(ids) == len(set(ids)), (
        f"duplicate panel ids: {sorted(i for i in set(ids) if ids.count(i) > 1)}"
    )
    for panel in panels(dashboard):
        assert panel.get("title"), f"panel {panel['id']} has no title"
        if panel.get("type") == "row":
            continue
        targets = panel.get("targets") or []
        assert targets, f"panel {panel['title']!r} has no target"
        assert all(t.get("expr", "").strip() for t in targets), f"panel {panel['title']!r}: empty expr"
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"datasource", "job", "pod"}


@pytest.mark.jail
def test_every_dashboard_metric_is_exported(tmp_path: Path) -> None:
    library = tmp_path / "library.db"
    with Library(library):
        pass  # an empty library: the runtime need serve nothing to export its metrics
    metrics = ["--metrics-port", "0"]
    started: list[CodegymServer] = []
    try:
        worker = CodegymServer(["serve", "sandbox", "--port", "0", "--jails", "1", *metrics])
        started.append(worker)
        runtime = CodegymServer(
            [
                "serve",
                "runtime",
                "--port",
                "0",
                "--library",
                str(library),
                "--sandbox",
                worker.address,
                *metrics,
            ]
        )
        started.append(runtime)
        gateway = CodegymServer(["serve", "openenv", "--runtime", runtime.address, "--port", "0", *metrics])
        started.append(gateway)
        texts = {server.name: scrape_text(metrics_address(server)) for server in started}
    finally:
        codes = {server.name: server.stop() for server in reversed(started)}
    assert all(code == 0 for code in codes.values()), codes

    exported = set().union(*(exported_series(text) for text in texts.values()))
    for name, text in texts.items():
        assert "# TYPE codegym_" in text, f"{name} exports no codegym metric:\n{text[:2000]}"
    dashboard = load_dashboard()
    assert len(dashboard_metrics(dashboard)) >= 20  # the extraction found the panels' names
    missing = missing_metrics(dashboard, exported)
    assert not missing, "the dashboard reads metrics no server exports:\n" + "\n".join(
        f"  {name} (in {', '.join(sorted(set(titles)))})" for name, titles in sorted(missing.items())
    )


def test_check_reports_a_metric_that_does_not_exist() -> None:
    """The check itself, without servers: this process's registry holds the same definitions the
    servers export (codegym/server/metrics.py, services/openenv/metrics.py)."""
    import codegym.server.metrics  # noqa: F401  (registers the workers' and runtime's figures)
    import services.openenv.metrics  # noqa: F401  (registers the gateway's figures)

    exported = exported_series(generate_latest().decode())
    dashboard = load_dashboard()
    assert missing_metrics(dashboard, exported) == {}

    doctored = copy.deepcopy(dashboard)
    panel = next(p for p in panels(doctored) if p.get("targets"))
    panel["targets"] += [
        {"refId": "X", "expr": 'sum(rate(codegym_bogus_steps_total{job=~"$job"}[1m]))'},
        # a histogram's family name is no series; a label value naming a metric is no read of it
        {"refId": "Y", "expr": 'codegym_rpc_seconds{method="codegym_not_a_metric"}'},
        {"refId": "Z", "expr": '{__name__="codegym_runtime_sessions_closed"}'},
    ]
    missing = missing_metrics(doctored, exported)
    assert set(missing) == {
        "codegym_bogus_steps_total",
        "codegym_rpc_seconds",
        "codegym_runtime_sessions_closed",
    }
    assert missing["codegym_bogus_steps_total"] == [panel["title"]]
    assert "codegym_runtime_steps_total" in exported and "codegym_rpc_seconds_bucket" in exported
