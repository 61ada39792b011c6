"""The shipped Grafana dashboards' queries, run by a real Prometheus on a real run's metrics.

The traced CPU demo (real verl on a local Ray cluster) exports its metrics over OTLP to
otelcol running the shipped ``collector-config/otelcol-file.yaml``; Prometheus (Debian's
2.42, scripts/setup-prometheus.sh) scrapes the collector's prometheus exporter with the
shipped ``collector-config/prometheus.yaml`` job. Then every PromQL query of every
dashboard, with its variables substituted as Grafana substitutes them (the run variable
both as "All" and as the demo's run picked from its list; ``$__interval``,
``$__rate_interval``, ``$__range`` for the run's short time range), goes through
Prometheus' HTTP API: ``/api/v1/query``, and ``/api/v1/query_range`` where Grafana asks for
a range. Each must return series carrying the labels its legend names; one that returns
nothing fails, naming its panel. The template variables' ``label_values`` queries must list
the demo's run. TraceQL targets (Tempo) need a Tempo and are reported as skipped.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass

import pytest

import fault_workload as w
import grafana_dashboard as gd
import otel_binaries as ob
import prometheus_server as ps
from demo_process import run_in_child

# Prometheus scrapes every second and otel_verl exports every second, where a deployment
# would use 15 s (collector-config/prometheus.yaml) and 60 s: a two-step demo is over in
# a minute. The datasource's timeInterval, which Grafana's intervals are computed from,
# is the scrape interval, as in the shipped provisioning.
SCRAPE_INTERVAL_S = 1
SCRAPE_INTERVAL = f"{SCRAPE_INTERVAL_S}s"
METRIC_EXPORT_INTERVAL_MS = "1000"
DASHBOARD_WIDTH_PX = 1920  # a panel's data points default to its width in pixels
STEPS, PROMPTS, N = 2, 2, 2

# A demo loses nothing, so otel_verl's loss panels would have nothing to show: a process
# of the same run counts a loss and a failure, which reach Prometheus as every
# otel_verl process's counters do. (A process's metrics start with its first span that
# makes one: here a step of its own.)
HEALTH_LOSS = f"""
    import otel_verl
    from otel_verl import events, health

    assert otel_verl.configure(role="trainer")
    with events.step({STEPS + 1}, trainer="RayPPOTrainer"):
        pass
    health.record_dropped("dashboard_induced", 1, "induced by the test")
    health.record_failure("dashboard_induced", RuntimeError("induced by the test"))
    otel_verl.shutdown()
"""


@dataclass
class DemoInPrometheus:
    prometheus: ps.PrometheusServer
    run_id: str
    start: float  # the dashboard's time range: the run's
    end: float


@pytest.fixture(scope="module")
def demo_in_prometheus(tmp_path_factory):
    ob.require_binary("otelcol")
    ps.require_prometheus()
    work = tmp_path_factory.mktemp("dashboard-prometheus")
    collector = ob.start_otelcol(ob.CONFIG_DIR / "otelcol-file.yaml", work, {"OTELCOL_FILE_DIR": str(work / "traces")})
    try:
        prometheus = ps.start_prometheus(
            work / "prometheus", ps.scrape_config([collector.env["OTELCOL_PROMETHEUS_ENDPOINT"]], SCRAPE_INTERVAL))
        try:
            run_id = f"dashboard-{uuid.uuid4().hex[:12]}"
            env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.otlp_grpc_endpoint, "OTEL_VERL_RUN_ID": run_id,
                   "OTEL_METRIC_EXPORT_INTERVAL": METRIC_EXPORT_INTERVAL_MS}
            start = time.time()
            run_in_child("demo", {"trace_dir": str(work / "trace"), "steps": STEPS, "prompts": PROMPTS, "n": N,
                                  "agent": "tool", "validate": False}, str(work / "demo"), env)
            w.run_python(HEALTH_LOSS, env, timeout=120)
            # the last export passes the collector's batch processor (1 s), then a scrape
            scraped_by = time.time() + 1 + 2 * SCRAPE_INTERVAL_S
            while prometheus.last_scrape(time.time()) < scraped_by:
                assert time.time() < scraped_by + 30, f"no scrape since the run ended\n{prometheus.process.log_tail()}"
                time.sleep(0.5)
            yield DemoInPrometheus(prometheus, run_id, start, time.time())
        finally:
            prometheus.process.stop()
    finally:
        collector.process.stop()


# the dashboards on Prometheus (tests/test_dashboard_clickhouse.py runs the ClickHouse one's SQL)
PROMETHEUS_DASHBOARDS = sorted(gd.dashboards_on("prometheus"))


def _targets():
    """(dashboard name, panel, target) of every panel target of those dashboards."""
    for name in PROMETHEUS_DASHBOARDS:
        dashboard = gd.dashboards()[name]
        for panel in gd.all_panels(dashboard):
            for target in panel.get("targets", []):
                yield name, panel, target


def _variables(dashboard: dict) -> dict:
    return {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}


def _selections(dashboard: dict, run_id: str) -> dict:
    """The variables' values for a selection: "all" (each variable at All), "run" (the
    run variable at the demo's run, the others at All) and "other run" (a run that did
    not happen: every query must come back empty, or it ignores the run variable)."""
    out = {}
    for selection, run in (("all", None), ("run", run_id), ("other run", f"not-{run_id}")):
        out[selection] = {name: [run] if run and name == "run" else ["$__all"] if v.get("includeAll") else []
                          for name, v in _variables(dashboard).items()}
    return out


def _source_type(panel: dict, target: dict) -> str:
    return (target.get("datasource") or panel.get("datasource") or {}).get("type", "")


TARGETS = [pytest.param(name, panel, target, selection,
                        id=f"{name}:{panel['title']}:{target['refId']}:{selection}")
           for name, panel, target in _targets()
           for selection in (("all", "run", "other run") if _source_type(panel, target) == "prometheus" else ("-",))]


@pytest.mark.verl
@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name, panel, target, selection", TARGETS)
def test_every_dashboard_query_returns_series_in_prometheus(request, name, panel, target, selection):
    source = _source_type(panel, target)
    if source == "tempo":
        pytest.skip(f"panel {panel['title']!r}: a TraceQL query (Tempo), not run here: no Tempo in the tests")
    assert source == "prometheus" and "expr" in target, f"panel {panel['title']!r}: a {source!r} query, unchecked"
    d = request.getfixturevalue("demo_in_prometheus")
    dashboard = gd.dashboards()[name]
    query = gd.prometheus_request(panel, target, _variables(dashboard), _selections(dashboard, d.run_id)[selection],
                                    d.start, d.end, SCRAPE_INTERVAL, DASHBOARD_WIDTH_PX)
    assert not re.search(r"\$\{?\w|\[\[", query.expr), f"panel {panel['title']!r}: a variable left in {query.expr}"
    # instant: what a stat or table panel (or an instant target) shows at the range's end
    results = [("instant", d.prometheus.query(query.expr, query.at))]
    if query.range or panel["type"] == "timeseries":
        results.append(("range", d.prometheus.query_range(query.expr, query.start, query.end, query.step_s)))
    legend = gd.legend_labels(target.get("legendFormat"))
    for kind, series in results:
        if selection == "other run":
            assert not series, f"panel {panel['title']!r}: {kind} query ignores the run variable: {query.expr}"
            continue
        assert series, f"panel {panel['title']!r} ({target['refId']}): {kind} query returned no series: {query.expr}"
        for one in series:
            missing = legend - set(one["metric"])
            assert not missing, f"panel {panel['title']!r}: legend labels {missing} not on {one['metric']}"


@pytest.mark.verl
@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", PROMETHEUS_DASHBOARDS)
def test_the_template_variables_list_the_demo_run(demo_in_prometheus, name):
    d = demo_in_prometheus
    dashboard = gd.dashboards()[name]
    queried = [v for v in _variables(dashboard).values() if v.get("type") == "query"]
    assert queried, "no query variable: the panels could not pick a run"
    for variable in queried:
        assert variable["datasource"]["type"] == "prometheus", variable["name"]
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        label, match = gd.label_values_query(query)
        values = d.prometheus.label_values(label, match, d.start, d.end)
        assert values, f"variable {variable['name']!r}: {query} lists nothing"
        if variable["name"] == "run":
            assert d.run_id in values, (query, values)


def test_grafana_intervals_and_variables_as_grafana_computes_them():
    dashboard = gd.dashboards()["verl-overview.json"]
    (panel,) = [p for p in gd.all_panels(dashboard) if p["title"].startswith("Stage duration")]
    (target,) = panel["targets"]
    variables = _variables(dashboard)
    # the shipped default: the last 6 hours, a 15 s scrape interval, a half-width panel
    six_hours = gd.prometheus_request(panel, target, variables, {"run": ["$__all"]}, 0, 6 * 3600, "15s", 1920)
    assert six_hours.step_s == 20  # 6 h / 960 points = 22.5 s, rounded
    assert "[1m0s]" in six_hours.expr and 'verl_run_id=~".*"' in six_hours.expr  # max(20 s + 15 s, 4 x 15 s)
    short = gd.prometheus_request(panel, target, variables, {"run": ["a.b", "c"]}, 1000.5, 1150.5, "1s", 1920)
    assert short.step_s == 1 and "[4s]" in short.expr and (short.start, short.end, short.at) == (1000, 1150, 1150.5)
    assert 'verl_run_id=~"(a\\\\.b|c)"' in short.expr  # Grafana's regex escape, inside a PromQL string
    assert gd.interpolate("x[$__range] ${run} [[run]]", variables, {"run": ["r1"]}, {"__range": "150s"}) == "x[150s] r1 r1"
    assert gd.label_values_query("label_values(target_info, verl_run_id)") == ("verl_run_id", "target_info")
