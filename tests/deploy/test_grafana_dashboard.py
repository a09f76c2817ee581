"""The operators' Grafana dashboard (deploy/grafana/tandem.json) reads only what the server exports: every
`tandem:*` series a query names is one of the metrics the code registers (listed from the source by
docs/gen_reference.py, the list docs/reference/metrics.md is made of), with a histogram's `_bucket`, `_sum`
and `_count` series, and the panels cover what an operator watches."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "tandem.json"
sys.path.insert(0, str(REPO / "docs"))
import gen_reference  # noqa: E402  (docs/ is no package: the generator is not part of the product)

METRIC = re.compile(r"tandem:[A-Za-z0-9_:]+")
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def exported_series() -> set[str]:
    """Every series name the server's /metrics can serve."""
    series = set()
    for name, kind, *_ in gen_reference.metric_rows():
        series |= {name + suffix for suffix in HISTOGRAM_SERIES} if kind == "histogram" else {name}
    return series


def targets(dashboard: dict) -> list[tuple[str, dict]]:
    """(panel title, target) of every query, rows' nested panels included."""
    out = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", ())]:
            out += [(inner["title"], target) for target in inner.get("targets", ())]
    return out


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every target."""
    return [(title, target["expr"]) for title, target in targets(dashboard)]


def unexported(dashboard: dict, series: set[str]) -> list[tuple[str, str]]:
    """(panel title, metric) of each name a query reads that the server does not export."""
    return [(title, name) for title, expr in queries(dashboard) for name in METRIC.findall(expr) if name not in series]


def test_every_query_names_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    found = queries(dashboard)
    assert len(found) >= 20
    assert all(METRIC.search(expr) for _, expr in found), [q for q in found if not METRIC.search(q[1])]
    assert unexported(dashboard, exported_series()) == []


def test_every_label_a_query_groups_or_names_its_legend_by_is_one_its_metrics_carry():
    """A `by (label)` or a `{{label}}` legend the metric lacks would merge the series or print the braces."""
    labels: dict[str, set[str]] = {}
    for name, kind, listed, *_ in gen_reference.metric_rows():
        carried = {label.strip("` ") for label in listed.split(",") if label.strip()}
        for series in ({name + suffix for suffix in HISTOGRAM_SERIES} if kind == "histogram" else {name}):
            labels[series] = carried | ({"le"} if series.endswith("_bucket") else set())
    wrong = []
    for title, target in targets(json.loads(DASHBOARD.read_text())):
        carried = set().union(*(labels.get(name, set()) for name in METRIC.findall(target["expr"])))
        used = {label.strip() for group in re.findall(r"\bby \(([^)]*)\)", target["expr"]) for label in group.split(",")}
        used |= set(re.findall(r"{{\s*(\w+)\s*}}", target.get("legendFormat", "")))
        wrong += [(title, label) for label in sorted(used - carried)]
    assert wrong == []


def test_a_query_naming_a_metric_that_is_not_exported_is_caught():
    dashboard = json.loads(DASHBOARD.read_text())
    dashboard["panels"][1]["targets"][0]["expr"] = "sum(rate(tandem:requests_admitted_total[5m]))"
    dashboard["panels"][2]["targets"][0]["expr"] = "histogram_quantile(0.9, rate(tandem:pool_kv_usage_bucket[5m]))"
    assert unexported(dashboard, exported_series()) == [
        (dashboard["panels"][1]["title"], "tandem:requests_admitted_total"),
        (dashboard["panels"][2]["title"], "tandem:pool_kv_usage_bucket"),  # a gauge has no buckets
    ]


def test_the_panels_cover_admissions_latency_kv_handoffs_migrations_and_the_autoscaler():
    read = {name for _, expr in queries(json.loads(DASHBOARD.read_text())) for name in METRIC.findall(expr)}
    for wanted in ("tandem:requests_rejected_total", "tandem:time_to_first_token_seconds_bucket",
                   "tandem:time_per_output_token_seconds_bucket", "tandem:inter_token_latency_seconds_bucket",
                   "tandem:pool_kv_usage", "tandem:kv_transfers", "tandem:kv_transfer_bytes",
                   "tandem:request_migrations_total", "tandem:autoscaler_resizes_total", "tandem:autoscaler_replicas"):
        assert wanted in read, wanted


def test_the_dashboard_reads_its_prometheus_from_a_variable():
    """Imported into any Grafana, it asks which Prometheus to read rather than naming one of ours."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert [v["name"] for v in dashboard["templating"]["list"] if v["type"] == "datasource"] == ["datasource"]
    uids = {panel["datasource"]["uid"] for panel in dashboard["panels"] if "datasource" in panel}
    assert uids == {"${datasource}"}
