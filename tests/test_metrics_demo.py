"""The metrics of the traced CPU demo (real verl v0 trainer, agent loops, reward and sglang
server code on a real Ray cluster): every process that writes outputs writes its metric
files too (a rollout worker's export process, with the worker's resource), and their
counts match the run."""

from __future__ import annotations

import glob
import json
import os
from collections import defaultdict

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.e2e, pytest.mark.timeout(900)]

STEPS, PROMPTS, N = 2, 4, 2  # the shared demo the report tests read too: one run for all


def _last_points(paths) -> dict:
    """(role, metric name) -> [(attributes, point)] of each file's last line (cumulative: a
    process's totals), summed over the processes by the caller."""
    out = defaultdict(list)
    for path in paths:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        assert lines, path
        for resource in json.loads(lines[-1])["resourceMetrics"]:
            attrs = {a["key"]: a["value"].get("stringValue") for a in resource["resource"]["attributes"]}
            for scope in resource["scopeMetrics"]:
                for metric in scope["metrics"]:
                    kind = metric.get("histogram") or metric.get("sum")
                    for point in kind["dataPoints"]:
                        labels = {a["key"]: next(iter(a["value"].values())) for a in point.get("attributes", [])}
                        out[(attrs["verl.role"], metric["name"])].append((labels, point))
    return out


def _count(points, key) -> int:
    return sum(int(p.get("count", p.get("asInt", 0))) for _, p in points.get(key, []))


@pytest.fixture(scope="module")
def metrics(shared_demo):
    trace_dir, _ = shared_demo(STEPS, PROMPTS, N)
    paths = sorted(glob.glob(os.path.join(str(trace_dir), "otlp-metrics", "metrics-*.jsonl")))
    assert paths, os.listdir(str(trace_dir))
    return _last_points(paths)


def test_the_trainer_records_its_steps_stages_and_samples(metrics):
    assert _count(metrics, ("trainer", "verl.step.duration")) == STEPS
    stages = {labels["verl.stage"] for labels, _ in metrics[("trainer", "verl.stage.duration")]}
    assert {"generation", "update_actor"} <= stages
    assert _count(metrics, ("trainer", "verl.samples")) >= PROMPTS * (STEPS - 1)


def test_the_rollout_workers_export_processes_record_trajectories_and_llm_calls(metrics):
    trajectories = _count(metrics, ("agent_loop_worker", "verl.trajectory.duration"))
    assert trajectories == STEPS * PROMPTS * N
    assert _count(metrics, ("agent_loop_worker", "gen_ai.client.operation.duration")) >= trajectories
    token_types = {labels["gen_ai.token.type"] for labels, _ in metrics[("agent_loop_worker", "gen_ai.client.token.usage")]}
    assert token_types == {"input", "output"}


def test_the_llm_servers_record_their_requests(metrics):
    requests = _count(metrics, ("llm_server", "verl.llm.server.request.duration"))
    assert requests >= STEPS * PROMPTS * N
