"""Validate collector-config/*.yaml with the real binaries, and smoke-test
Python SDK -> otelcol (files + Jaeger) -> Jaeger query API -> replay.

Needs the Go binaries from scripts/build-otel-binaries.sh (see
tests/otel_binaries.py: skipped when missing, failed under CI=true).
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

if __package__:  # tests/ is a package
    from . import otel_binaries as ob
    from .otel_binaries import jaeger_server, otelcol_factory  # noqa: F401  (fixtures)
else:
    import otel_binaries as ob
    from otel_binaries import jaeger_server, otelcol_factory  # noqa: F401  (fixtures)

OTELCOL_CONFIGS = sorted(ob.CONFIG_DIR.glob("otelcol-*.yaml"))


def validation_env(tmp_path: Path) -> dict[str, str]:
    """Every variable the configs reference, set to loopback/tmp values."""
    return {
        "OTELCOL_GRPC_ENDPOINT": "127.0.0.1:4317",
        "OTELCOL_HTTP_ENDPOINT": "127.0.0.1:4318",
        "OTELCOL_FILE_DIR": str(tmp_path / "traces"),
        "OTELCOL_JAEGER_ENDPOINT": "127.0.0.1:14317",
        "OTELCOL_TEMPO_ENDPOINT": "127.0.0.1:24317",
        "OTELCOL_PROMETHEUS_ENDPOINT": "127.0.0.1:18889",
        "OTELCOL_GATEWAYS": "[127.0.0.1:34317, 127.0.0.1:34318]",
        "OTELCOL_BACKEND_ENDPOINT": "127.0.0.1:14317",
        "OTEL_VERL_REPLAY_GLOB": str(tmp_path / "traces" / "*" / "otlp" / "*.jsonl"),
    }


def run_validate(binary: str, config: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [binary, "validate", "--config", str(config)],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=120,
    )


def test_config_files_found():
    names = {p.name for p in OTELCOL_CONFIGS}
    assert {"otelcol-file.yaml", "otelcol-jaeger.yaml", "otelcol-tempo.yaml",
            "otelcol-file-jaeger.yaml", "otelcol-replay.yaml", "otelcol-compose.yaml",
            "otelcol-agent-loadbalancing.yaml", "otelcol-gateway-tailsampling.yaml",
            "otelcol-clickhouse.yaml"} <= names


# the replay reads files; the tail-sampling gateway gets traces only (each node's agent
# serves that node's metrics)
@pytest.mark.parametrize("config", [c for c in OTELCOL_CONFIGS if not any(k in c.name for k in ("replay", "gateway"))],
                         ids=lambda p: p.name)
def test_every_forwarding_config_serves_the_metrics_for_prometheus(config):
    import yaml

    doc = yaml.safe_load(config.read_text())
    assert doc["service"]["pipelines"]["metrics"] == {"receivers": ["otlp"], "processors": ["batch"],
                                                      "exporters": ["prometheus"]}
    prometheus = doc["exporters"]["prometheus"]
    # an own port per collector in tests (otel_binaries.start_otelcol), :8889 by default
    assert prometheus["endpoint"] == "${env:OTELCOL_PROMETHEUS_ENDPOINT:-0.0.0.0:8889}"
    assert "verl.*" in prometheus["resource_constant_labels"]["included"]


@pytest.mark.e2e
@pytest.mark.parametrize("config", OTELCOL_CONFIGS, ids=lambda p: p.name)
def test_otelcol_validate(config, tmp_path):
    binary = ob.require_binary("otelcol")
    res = run_validate(binary, config, validation_env(tmp_path))
    assert res.returncode == 0, f"{config.name}:\n{res.stdout}\n{res.stderr}"


@pytest.mark.e2e
@pytest.mark.parametrize("config", OTELCOL_CONFIGS, ids=lambda p: p.name)
def test_otelcol_configs_have_defaults(config, tmp_path):
    """With no env overrides at all (as in docker-compose) the configs still
    validate, except the replay glob, which has no sensible default."""
    binary = ob.require_binary("otelcol")
    env = {"OTEL_VERL_REPLAY_GLOB": str(tmp_path / "*.jsonl")} if "replay" in config.name else {}
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("OTELCOL_", "OTEL_VERL_REPLAY"))}
    res = subprocess.run([binary, "validate", "--config", str(config)],
                         env={**clean, **env}, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{config.name}:\n{res.stdout}\n{res.stderr}"


@pytest.mark.e2e
def test_otelcol_validate_rejects_bad_config(tmp_path):
    """`validate` really checks component configs (append + rotation is invalid)."""
    binary = ob.require_binary("otelcol")
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "receivers: {otlp: {protocols: {http: {endpoint: '127.0.0.1:4318'}}}}\n"
        f"exporters: {{file: {{path: '{tmp_path}/x.jsonl', append: true, rotation: {{}}}}}}\n"
        "service: {pipelines: {traces: {receivers: [otlp], exporters: [file]}}}\n"
    )
    res = run_validate(binary, bad, {})
    assert res.returncode != 0
    assert "append and rotation" in res.stdout + res.stderr


@pytest.mark.e2e
def test_jaeger_validate(tmp_path):
    binary = ob.require_binary("jaeger")
    res = run_validate(binary, ob.CONFIG_DIR / "jaeger.yaml", {})
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"


# --------------------------------------------------------------------------
# Smoke test


def send_spans(endpoint: str, resource: dict[str, str], n_children: int = 2) -> tuple[str, set[str]]:
    """Send one trace (a root + children) over OTLP/gRPC; return (trace id, span ids)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create(resource))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    tracer = provider.get_tracer("otel_verl.tests")
    ids = set()
    with tracer.start_as_current_span("smoke.step", attributes={"verl.step": 1}) as root:
        ids.add(format(root.get_span_context().span_id, "016x"))
        for i in range(n_children):
            with tracer.start_as_current_span(f"smoke.child{i}") as child:
                ids.add(format(child.get_span_context().span_id, "016x"))
        trace_id = format(root.get_span_context().trace_id, "032x")
    assert provider.force_flush(10_000)
    provider.shutdown()
    return trace_id, ids


def read_span_ids(files: list[Path]) -> dict[str, set[str]]:
    """trace id -> span ids found in file-exporter OTLP-JSON lines."""
    out: dict[str, set[str]] = {}
    for f in files:
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            for rs in json.loads(line)["resourceSpans"]:
                for ss in rs.get("scopeSpans", []):
                    for s in ss.get("spans", []):
                        out.setdefault(s["traceId"], set()).add(s["spanId"])
    return out


@pytest.mark.e2e
def test_smoke_otelcol_files_and_jaeger_then_replay(jaeger_server, otelcol_factory, tmp_path):
    trace_dir = tmp_path / "traces"
    run_id = f"smoke-{uuid.uuid4().hex[:8]}"
    col = otelcol_factory(ob.CONFIG_DIR / "otelcol-file-jaeger.yaml", {
        "OTELCOL_FILE_DIR": str(trace_dir),
        "OTELCOL_JAEGER_ENDPOINT": jaeger_server.otlp_grpc_endpoint,
    })

    trace_id, ids = send_spans(col.otlp_grpc_endpoint,
                               {"service.name": "otel-verl-smoke", "verl.run_id": run_id})
    # A resource without verl.run_id (an engine's own spans) reaches Jaeger
    # unchanged and the default file group.
    orphan_trace, orphan_ids = send_spans(col.otlp_grpc_endpoint, {"service.name": "otel-verl-smoke"}, 0)

    got = jaeger_server.wait_for_trace(trace_id, min_spans=len(ids))
    assert ob.span_ids(got) == ids
    orphan_in_jaeger = jaeger_server.wait_for_trace(orphan_trace)
    assert ob.span_ids(orphan_in_jaeger) == orphan_ids
    assert all("fileexporter.path_segment" not in s["resource"] for s in ob.flat_spans(orphan_in_jaeger))

    # Stop the collector (clean shutdown flushes and closes the files).
    assert col.process.stop() == 0, col.process.log_tail()
    files = sorted((trace_dir / run_id / "otlp").glob("*.jsonl"))
    assert [f.name for f in files] == ["traces.jsonl"], list(trace_dir.rglob("*"))
    in_files = read_span_ids(files)
    assert in_files == {trace_id: ids}
    assert sorted(p.name for p in trace_dir.iterdir()) == sorted(["_no_run_id", run_id])
    assert read_span_ids([trace_dir / "_no_run_id" / "otlp" / "traces.jsonl"]) == {orphan_trace: orphan_ids}

    # Restart with the same config: rotation mode appends, never truncates.
    col2 = otelcol_factory(ob.CONFIG_DIR / "otelcol-file-jaeger.yaml", {
        "OTELCOL_FILE_DIR": str(trace_dir),
        "OTELCOL_JAEGER_ENDPOINT": jaeger_server.otlp_grpc_endpoint,
    })
    trace2, ids2 = send_spans(col2.otlp_grpc_endpoint,
                              {"service.name": "otel-verl-smoke", "verl.run_id": run_id}, 1)
    jaeger_server.wait_for_trace(trace2, min_spans=len(ids2))
    assert col2.process.stop() == 0, col2.process.log_tail()
    assert read_span_ids(files) == {trace_id: ids, trace2: ids2}

    # Replay the run's files into a second, empty Jaeger.
    fresh = ob.start_jaeger(tmp_path / "jaeger2")
    try:
        assert fresh.get_trace(trace_id) is None
        replay = otelcol_factory(ob.CONFIG_DIR / "otelcol-replay.yaml", {
            "OTEL_VERL_REPLAY_GLOB": str(trace_dir / run_id / "otlp" / "*.jsonl"),
            "OTELCOL_JAEGER_ENDPOINT": fresh.otlp_grpc_endpoint,
        }, wait=False)
        assert ob.span_ids(fresh.wait_for_trace(trace_id, min_spans=len(ids))) == ids
        assert ob.span_ids(fresh.wait_for_trace(trace2, min_spans=len(ids2))) == ids2
        assert replay.process.stop() == 0, replay.process.log_tail()
    finally:
        fresh.process.stop()
