"""otel_verl's metrics through a real collector: a traced workload in a real bootstrap
(its rollout-worker role offloads the outputs to an export process, which records the
metrics) -> OTLP -> otelcol (collector-config/otelcol-file.yaml) -> its Prometheus exporter,
scraped; and every metric and label the shipped dashboard's PromQL uses is in the scrape."""

from __future__ import annotations

import re
import time
import uuid
from collections import defaultdict

import pytest

import fault_workload as w
import grafana_dashboard as gd
import otel_binaries as ob

pytestmark = pytest.mark.e2e

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

WORKER = """
    import otel_verl
    from otel_verl import events
    import fault_workload as w

    assert otel_verl.configure(role="agent_loop_worker")  # offloads: its export process records
    for step in (1, 2):
        w.emit(step, ["u-1", "u-2"], 2, fit=step == 1)
    with events.trajectory("u-1", "t-server", step=2, agent_name="tool_agent"):
        with events.llm_call([1, 2], model="tiny-model") as turn:
            headers = turn.carrier()
    with events.llm_server_call(headers, request_id="r1", provider="sglang") as call:
        call.record_meta({"e2e_latency": 2.0, "queue_time": 0.25, "request_received_ts": 100.0,
                          "prefill_finished_time": 100.75})
    otel_verl.shutdown()
"""

TRAINER = """
    import otel_verl
    from otel_verl import events, health

    assert otel_verl.configure(role="trainer")  # its export process writes its outputs
    with events.step(7, trainer="RayPPOTrainer"):
        with events.step_stage("update_actor"):
            pass
    # a loss and a failure, for their counters to show
    health.record_dropped("e2e_induced", 1, "induced by the test")
    health.record_failure("e2e_induced", RuntimeError("induced by the test"))
    otel_verl.shutdown()
"""


def scrape(url: str) -> dict:
    """metric name -> [(labels, value)] of a Prometheus text exposition."""
    status, body = ob.http_get(url)
    assert status == 200, body[:300]
    out = defaultdict(list)
    for line in body.decode("utf-8").splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        assert match, line
        name, labels, value = match.groups()
        out[name].append((dict(_LABEL.findall(labels or "")), float(value)))
    return dict(out)


def _one(found, name, **labels):
    matching = [v for l, v in found.get(name, []) if all(l.get(k) == v for k, v in labels.items())]
    assert len(matching) == 1, (name, labels, found.get(name))
    return matching[0]


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("metrics-e2e")
    run_id = f"metrics-e2e-{uuid.uuid4().hex[:8]}"
    collector = ob.start_otelcol(ob.CONFIG_DIR / "otelcol-file.yaml", tmp_path, {"OTELCOL_FILE_DIR": str(tmp_path / "traces")})
    try:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.otlp_grpc_endpoint, "OTEL_VERL_RUN_ID": run_id}
        for code in (WORKER, TRAINER):
            w.run_python(code, env, timeout=120)
        url = f"http://{collector.env['OTELCOL_PROMETHEUS_ENDPOINT']}/metrics"
        deadline = time.monotonic() + 30
        while True:  # the collector's batch processor forwards within a second
            found = scrape(url)
            if "otel_verl_dropped_total" in found and "verl_step_duration_seconds_count" in found:
                break
            assert time.monotonic() < deadline, sorted(found)
            time.sleep(0.5)
        yield run_id, found
    finally:
        collector.process.stop()


def test_the_span_metrics_reach_prometheus_with_their_labels(scraped):
    run_id, found = scraped
    run = {"verl_run_id": run_id}
    assert _one(found, "verl_step_duration_seconds_count", verl_role="agent_loop_worker", **run) == 2
    assert _one(found, "verl_step_duration_seconds_count", verl_role="trainer", **run) == 1
    assert _one(found, "verl_stage_duration_seconds_count", verl_stage="update_actor", verl_role="trainer", **run) == 1
    assert _one(found, "verl_stage_duration_seconds_count", verl_stage="generation", verl_role="agent_loop_worker", **run) == 2
    assert _one(found, "verl_samples_total", verl_sample_outcome="trained", **run) == 4  # 2 uids x 2 steps
    assert _one(found, "verl_trajectory_duration_seconds_count", gen_ai_agent_name="tool_agent", **run) == 9
    genai = {"gen_ai_operation_name": "chat", "gen_ai_request_model": "tiny-model", **run}
    assert _one(found, "gen_ai_client_operation_duration_seconds_count", **genai) == 9
    assert _one(found, "gen_ai_client_token_usage_sum", gen_ai_token_type="input", **genai) == 8 * 3 + 2
    assert _one(found, "gen_ai_client_token_usage_sum", gen_ai_token_type="output", **genai) == 8 * 2
    assert _one(found, "verl_tool_duration_seconds_count", gen_ai_tool_name="calculator", **run) == 8
    assert _one(found, "verl_reward_duration_seconds_count", **run) == 8
    server = {"gen_ai_provider_name": "sglang", **run}
    assert _one(found, "verl_llm_server_queue_duration_seconds_sum", **server) == 0.25
    assert _one(found, "verl_llm_server_prefill_duration_seconds_sum", **server) == 0.5
    assert _one(found, "verl_llm_server_decode_duration_seconds_sum", **server) == 1.25
    assert _one(found, "verl_llm_server_request_duration_seconds_sum", **server) == 2.0
    assert _one(found, "otel_verl_dropped_total", otel_verl_output="e2e_induced", **run) == 1
    assert _one(found, "otel_verl_failures_total", otel_verl_where="e2e_induced", **run) == 1
    # the resource is the process's whose spans they are, with the services the traces name
    jobs = {(labels["verl_role"], labels["job"]) for labels, _ in found["verl_step_duration_seconds_count"]}
    assert jobs == {("agent_loop_worker", "verl/verl-rollout-worker"), ("trainer", "verl/verl-trainer")}
    assert "process_pid" not in found["verl_step_duration_seconds_count"][0][0]  # in target_info only


def test_no_sample_identity_becomes_a_label(scraped):
    _, found = scraped
    for name, series in found.items():
        for labels, _ in series:
            assert not {"verl_uid", "verl_traj_uid", "verl_global_step", "gen_ai_conversation_id"} & set(labels), name


@pytest.mark.parametrize("name", sorted(gd.dashboards_on("prometheus")))
def test_every_metric_and_label_the_dashboard_queries_is_scraped(scraped, name):
    _, found = scraped
    for expr in gd.prometheus_exprs(gd.dashboards()[name]):
        for metric, matchers, grouping in gd.selectors(expr):
            assert metric in found, (metric, expr)
            labels = set().union(*(set(l) for l, _ in found[metric]))
            assert matchers <= labels, (metric, matchers - labels, expr)
            assert grouping <= labels, (metric, grouping - labels, expr)
