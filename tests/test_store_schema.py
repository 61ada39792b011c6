"""The span store's schema (``otel_verl/tools/store/schema.sql``) is the table the
Collector's clickhouseexporter writes: its columns against the exporter's own DDL and
INSERT (read from the Go module cache that the otelcol build fills), executed in chDB;
and the Collector config that inserts into it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import List, Tuple

import pytest
import yaml

from otel_verl.tools.store.store import sql_file, statements

if __package__:  # tests/ is a package
    from . import otel_binaries as ob
else:
    import otel_binaries as ob

EXPORTER_MODULE = "github.com/open-telemetry/opentelemetry-collector-contrib/exporter/clickhouseexporter"
CLICKHOUSE_CONFIG = ob.CONFIG_DIR / "otelcol-clickhouse.yaml"


def exporter_version() -> str:
    """The clickhouseexporter version scripts/otelcol pins."""
    go_mod = (ob.REPO_ROOT / "scripts" / "otelcol" / "go.mod").read_text()
    match = re.search(rf"^\s*{re.escape(EXPORTER_MODULE)} (v\S+)", go_mod, re.M)
    assert match, f"scripts/otelcol/go.mod does not require {EXPORTER_MODULE}"
    return match.group(1)


def exporter_templates() -> Path:
    """``internal/sqltemplates`` of the pinned exporter in the Go module cache, which the
    otelcol build fills (skipped without Go or that module; failed under CI)."""
    ob.require_binary("otelcol")  # under CI this builds it, and so downloads the module
    go = shutil.which("go")
    reason = "Go is not installed"
    if go:
        cache = subprocess.run([go, "env", "GOMODCACHE"], capture_output=True, text=True, timeout=60).stdout.strip()
        # the module cache escapes capitals in paths as "!" and the lowercase letter
        module = re.sub(r"[A-Z]", lambda m: "!" + m.group().lower(), EXPORTER_MODULE)
        templates = Path(cache) / f"{module}@{exporter_version()}" / "internal" / "sqltemplates"
        if (templates / "traces_table.sql").is_file():
            return templates
        reason = f"{templates} is missing (build otelcol: scripts/build-otel-binaries.sh otelcol)"
    if ob.in_ci():
        pytest.fail(f"the clickhouseexporter's SQL templates: {reason}", pytrace=False)
    pytest.skip(f"the clickhouseexporter's SQL templates: {reason}")


def render_create_table(template: str, table: str) -> str:
    """The exporter's CREATE TABLE for ``table`` as its defaults render it
    (renderCreateTracesTableSQL: database, table, no cluster, MergeTree(), no TTL)."""
    for placeholder, value in (("%q.%q", table), ("%s", ""), ("%s", "MergeTree()"), ("%s", "")):
        assert placeholder in template, f"the exporter's DDL template changed: no {placeholder} left"
        template = template.replace(placeholder, value, 1)
    return template


def insert_columns(template: str) -> List[str]:
    """The column list of the exporter's INSERT (traces_insert.sql)."""
    match = re.search(r"INSERT INTO %q\.%q \((.*?)\) VALUES", template, re.S)
    assert match, "the exporter's INSERT template changed"
    return [c.strip() for c in match.group(1).split(",")]


@pytest.fixture()
def client(tmp_path):
    clickhouse_connect = pytest.importorskip("clickhouse_connect")
    pytest.importorskip("chdb")
    client = clickhouse_connect.get_client(interface="chdb", path=str(tmp_path / "store"))
    yield client
    client.close()


def create_schema(client) -> None:
    for statement in statements(sql_file("schema.sql")):
        client.command(statement)


def columns(client, table: str, *, materialized: bool) -> List[Tuple[str, str]]:
    """``(name, type)`` of the table's columns in their order, materialized or not."""
    kind = "= 'MATERIALIZED'" if materialized else "!= 'MATERIALIZED'"
    return client.query(
        f"SELECT name, type FROM system.columns WHERE database = currentDatabase() AND table = %(table)s "
        f"AND default_kind {kind} ORDER BY position", parameters={"table": table}).result_rows


@pytest.mark.e2e
def test_the_schema_has_the_exporters_columns_in_its_order_before_its_own(client):
    """Both DDLs executed on the same engine: the exporter's table's columns, names and
    types as ClickHouse reads them, are schema.sql's first columns, in the same order;
    only otel_verl's materialized columns follow."""
    template = (exporter_templates() / "traces_table.sql").read_text()
    client.command(render_create_table(template, '"exporter_traces"'))
    create_schema(client)
    exporter = columns(client, "exporter_traces", materialized=False)
    assert exporter and not columns(client, "exporter_traces", materialized=True)
    ours = columns(client, "otel_traces", materialized=False)
    assert ours == exporter
    all_ours = client.query("SELECT name FROM system.columns WHERE database = currentDatabase() "
                            "AND table = 'otel_traces' ORDER BY position").result_rows
    assert [name for (name,) in all_ours][:len(exporter)] == [name for name, _ in exporter]


@pytest.mark.e2e
def test_the_exporters_insert_lands_in_the_schema_and_fills_our_columns(client):
    """The exporter inserts exactly the table's columns that are not materialized, by
    name; such a row, sent as its INSERT names the columns, fills otel_verl's columns."""
    names = insert_columns((exporter_templates() / "traces_insert.sql").read_text())
    create_schema(client)
    assert names == [name for name, _ in columns(client, "otel_traces", materialized=False)]

    values = {
        "Timestamp": "'2026-01-02 03:04:05.123456789'",
        "TraceId": "'" + "ab" * 16 + "'", "SpanId": "'" + "cd" * 8 + "'", "ParentSpanId": "''",
        "TraceState": "''", "SpanName": "'verl.sample'", "SpanKind": "'Internal'",
        "ServiceName": "'verl-trainer'",
        "ResourceAttributes": "map('verl.run_id', 'run-1', 'verl.role', 'trainer')",
        "ScopeName": "'otel_verl'", "ScopeVersion": "''",
        "SpanAttributes": "map('verl.global_step', '3', 'verl.uid', 'u-7', 'verl.staleness', '2', "
                          "'verl.reward.score', '0.5', 'verl.sample.outcome', 'trained')",
        "Duration": "1500000000", "StatusCode": "'Ok'", "StatusMessage": "''",
        "Events.Timestamp": "['2026-01-02 03:04:06']", "Events.Name": "['gen_ai.evaluation.result']",
        "Events.Attributes": "[map('gen_ai.evaluation.score.value', '0.5')]",
        "Links.TraceId": "[]", "Links.SpanId": "[]", "Links.TraceState": "[]", "Links.Attributes": "[]",
    }
    client.command(f"INSERT INTO otel_traces ({', '.join(names)}) VALUES ({', '.join(values[n] for n in names)})")
    [row] = client.query("SELECT RunId, Role, Step, Uid, Staleness, Reward, Outcome, `Events.Name` "
                         "FROM otel_traces").result_rows
    assert row == ("run-1", "trainer", 3, "u-7", 2, 0.5, "trained", ["gen_ai.evaluation.result"])


def test_the_collector_config_inserts_into_the_table_the_schema_creates(client):
    """otelcol-clickhouse.yaml leaves the schema to schema.sql and writes its table."""
    exporter = yaml.safe_load(CLICKHOUSE_CONFIG.read_text())["exporters"]["clickhouse"]
    assert exporter["create_schema"] is False
    create_schema(client)
    tables = {name for (name,) in client.query("SHOW TABLES").result_rows}
    assert exporter["traces_table_name"] in tables


def test_docker_compose_creates_the_schema_before_its_collector_inserts():
    """The compose profile's server runs schema.sql from this checkout at its start and
    is healthy once the table exists; its collector runs otelcol-clickhouse.yaml against
    it, with its credentials, after that."""
    services = yaml.safe_load((ob.REPO_ROOT / "docker-compose.yml").read_text())["services"]
    server, collector = services["clickhouse"], services["otelcol-clickhouse"]
    assert re.fullmatch(r"clickhouse/clickhouse-server:\d+\.\d+\.\d+\.\d+", server["image"])  # an exact version
    mounts = dict(volume.split(":")[:2] for volume in server["volumes"])
    init = {host for host, container in mounts.items() if container.startswith("/docker-entrypoint-initdb.d/")}
    assert {(ob.REPO_ROOT / host).resolve() for host in init} == {(ob.REPO_ROOT / "otel_verl/tools/store/schema.sql")}
    assert "EXISTS TABLE otel_traces" in " ".join(server["healthcheck"]["test"])

    assert collector["depends_on"]["clickhouse"]["condition"] == "service_healthy"
    config = {container: host for host, container in (v.split(":")[:2] for v in collector["volumes"])}
    assert (ob.REPO_ROOT / config["/etc/otelcol/config.yaml"]).resolve() == CLICKHOUSE_CONFIG
    env = collector["environment"]
    assert env["CLICKHOUSE_ENDPOINT"] == "tcp://clickhouse:9000"  # the server's native port, inside compose
    assert (env["CLICKHOUSE_USERNAME"], env["CLICKHOUSE_PASSWORD"]) == (
        server["environment"]["CLICKHOUSE_USER"], server["environment"]["CLICKHOUSE_PASSWORD"])
    exporter = yaml.safe_load(CLICKHOUSE_CONFIG.read_text())["exporters"]["clickhouse"]
    read = {key: re.fullmatch(r"\$\{env:(\w+):-.*\}", exporter[key]).group(1)
            for key in ("endpoint", "database", "username", "password")}
    assert set(read.values()) == set(env)  # the config reads what compose sets, and only that
