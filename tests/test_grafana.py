"""The Grafana dashboard and provisioning docker-compose.yml ships, checked against Grafana's
dashboard JSON model as far as that goes without a Grafana binary."""

from __future__ import annotations

import re

import pytest
import yaml

import grafana_dashboard as gd

COMPOSE = gd.REPO_ROOT / "docker-compose.yml"
PANEL_TYPES = {"timeseries", "table", "row", "stat", "bargauge", "barchart", "text", "heatmap"}


def _datasources() -> dict:
    doc = yaml.safe_load((gd.PROVISIONING_DIR / "datasources" / "datasources.yaml").read_text())
    return {d["uid"]: d for d in doc["datasources"]}


def _grafana_service() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]


def _mounts(service: dict) -> dict:
    """container path -> host path (relative to the repo) of the service's bind mounts."""
    out = {}
    for volume in service.get("volumes", []):
        host, container = volume.split(":")[:2]
        out[container] = (gd.REPO_ROOT / host).resolve()
    return out


def test_a_dashboard_is_shipped():
    assert "verl-overview.json" in gd.dashboards()


@pytest.mark.parametrize("name", sorted(gd.dashboards()))
def test_dashboard_json_model(name):
    dashboard = gd.dashboards()[name]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and len(dashboard["uid"]) <= 40 and re.fullmatch(r"[A-Za-z0-9_-]+", dashboard["uid"])
    assert dashboard["title"]
    panels = list(gd.all_panels(dashboard))
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids)), ids
    for panel in panels:
        assert panel["type"] in PANEL_TYPES, panel["type"]
        grid = panel["gridPos"]
        assert {"x", "y", "w", "h"} <= set(grid) and all(isinstance(grid[k], int) for k in "xywh")
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, (panel["title"], grid)
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


@pytest.mark.parametrize("name", sorted(gd.dashboards()))
def test_panels_do_not_overlap(name):
    taken = set()
    for panel in gd.all_panels(gd.dashboards()[name]):
        g = panel["gridPos"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, panel["title"]
        taken |= cells


@pytest.mark.parametrize("name", sorted(gd.dashboards()))
def test_every_datasource_is_a_provisioned_one_with_queries_of_its_kind(name):
    provisioned = _datasources()
    dashboard = gd.dashboards()[name]
    used = [v["datasource"] for v in dashboard["templating"]["list"] if "datasource" in v]
    for panel in gd.all_panels(dashboard):
        if panel["type"] == "row":
            continue
        used.append(panel["datasource"])
        for target in panel["targets"]:
            source = target.get("datasource", panel["datasource"])
            used.append(source)
            if source["type"] == "prometheus":
                assert target["expr"].strip(), panel["title"]
            elif source["type"] == "tempo":
                assert target["queryType"] == "traceql" and target["query"].startswith("{"), panel["title"]
            elif source["type"] == "grafana-clickhouse-datasource":  # tests/test_dashboard_clickhouse.py runs it
                assert target["editorType"] == "sql" and target["rawSql"].lstrip().startswith(("SELECT", "WITH"))
    for source in used:
        assert source["uid"] in provisioned, source
        assert provisioned[source["uid"]]["type"] == source["type"], source


@pytest.mark.parametrize("name", sorted(gd.dashboards()))
def test_every_promql_query_selects_its_metrics_with_braces(name):
    """What tests/test_metrics_e2e.py checks against a real scrape must be readable here."""
    for expr in gd.prometheus_exprs(gd.dashboards()[name]):
        assert gd.selectors(expr), expr
        assert not gd.unbraced_names(expr), (expr, gd.unbraced_names(expr))
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr


def test_the_selector_parser_reads_names_matchers_and_groupings():
    expr = ('histogram_quantile(0.99, sum by (le, gen_ai_request_model) '
            '(rate(gen_ai_client_operation_duration_seconds_bucket{verl_run_id=~"$run", x!="a}"}[$__rate_interval])))')
    assert gd.selectors(expr) == [("gen_ai_client_operation_duration_seconds_bucket", {"verl_run_id", "x"},
                                   {"gen_ai_request_model"})]
    assert gd.selectors("label_values(target_info, verl_run_id)") == [("target_info", {"verl_run_id"}, set())]
    assert gd.unbraced_names("sum(rate(bare_metric[5m]))") == {"bare_metric"}


def test_provisioning_points_at_the_mounted_dashboards():
    service = _grafana_service()
    mounts = _mounts(service)
    provisioning = mounts["/etc/grafana/provisioning"]
    assert provisioning == gd.PROVISIONING_DIR.resolve()
    doc = yaml.safe_load((gd.PROVISIONING_DIR / "dashboards" / "dashboards.yaml").read_text())
    assert doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    assert mounts[path] == gd.DASHBOARDS_DIR.resolve()
    assert "prometheus" in service["depends_on"]


def test_the_prometheus_datasource_is_a_compose_service_scraping_the_collector():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    url = _datasources()["prometheus"]["url"]
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()
    assert host in services and any(p.endswith(f":{port}") for p in services[host]["ports"])
    config = _mounts(services["prometheus"])["/etc/prometheus/prometheus.yml"]
    targets = [t for job in yaml.safe_load(config.read_text())["scrape_configs"]
               for sc in job["static_configs"] for t in sc["targets"]]
    collector = yaml.safe_load((gd.REPO_ROOT / "collector-config" / "otelcol-compose.yaml").read_text())
    endpoint = collector["exporters"]["prometheus"]["endpoint"]
    assert f"otelcol:{endpoint.rsplit(':', 1)[-1].rstrip('}')}" in targets
    assert "prometheus" in collector["service"]["pipelines"]["metrics"]["exporters"]


def test_tempo_runs_its_metrics_generator_into_prometheus():
    tempo = yaml.safe_load((gd.REPO_ROOT / "collector-config" / "tempo.yaml").read_text())
    generator = tempo["metrics_generator"]
    assert {"service_graphs", "span_metrics", "local_blocks"} <= set(generator["processor"])
    assert tempo["overrides"]["defaults"]["metrics_generator"]["processors"] == [
        "service-graphs", "span-metrics", "local-blocks"]
    (write,) = generator["storage"]["remote_write"]
    assert write["url"].startswith(_datasources()["prometheus"]["url"])
    command = yaml.safe_load(COMPOSE.read_text())["services"]["prometheus"]["command"]
    assert "--web.enable-remote-write-receiver" in command


def test_the_clickhouse_datasource_reads_the_server_compose_runs():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    env = _grafana_service()["environment"]
    source = _datasources()["clickhouse"]
    preinstalled = [p.split("@")[0] for p in env["GF_PLUGINS_PREINSTALL_SYNC"].split(",")]
    assert source["type"] in preinstalled
    # Grafana expands $NAME and ${NAME} in provisioning files from its environment
    used = set(re.findall(r"\$\{?(\w+)\}?", yaml.safe_dump(source)))
    assert used and used <= set(env), used - set(env)
    expanded = yaml.safe_load(re.sub(r"\$\{?(\w+)\}?", lambda m: str(env[m[1]]), yaml.safe_dump(source)))
    server = services[expanded["jsonData"]["host"]]
    assert server["image"].startswith("clickhouse/clickhouse-server:")
    assert any(p.endswith(f":{expanded['jsonData']['port']}") for p in server["ports"])
    assert expanded["jsonData"]["protocol"] == "http" and expanded["jsonData"]["port"] == 8123
    assert (expanded["jsonData"]["username"], expanded["secureJsonData"]["password"]) == (
        server["environment"]["CLICKHOUSE_USER"], server["environment"]["CLICKHOUSE_PASSWORD"])
