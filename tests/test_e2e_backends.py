"""End to end with real backends on loopback ports.

1. The traced CPU demo (real verl on a local Ray cluster) exports OTLP/gRPC to the otelcol
   running the shipped ``collector-config/otelcol-file-jaeger.yaml``, which writes per-run
   files and forwards to Jaeger v2 (``collector-config/jaeger.yaml``, memory storage). The
   trace of a uid fetched from Jaeger's API v3 is the sample tree across processes; Jaeger
   lists a service per role; the searches by service, operation and ``verl.uid`` find
   the trace; Jaeger, the collector's files
   and the demo's embedded OTLP-JSON files hold the same spans.
2. Replaying the embedded files into a fresh Jaeger (``otelcol-replay.yaml``, and
   ``otel_verl.tools.replay`` over OTLP/HTTP) gives the same trees.
3. Two Ray nodes (``ray start`` head + a second raylet, each with its own
   ``VERL_TRACE_DIR``): one sample's spans land in one trace with parents across nodes,
   and each node writes its own legacy files.
4. ``benchmarks/bench_collector_load.py`` at CI size: no span lost.

The Go binaries come from scripts/build-otel-binaries.sh (tests/otel_binaries.py: the
tests fail under CI=true when they are missing, and are skipped elsewhere).
"""

from __future__ import annotations

import collections
import csv
import glob
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

if __package__:  # tests/ is a package
    from . import otel_binaries as ob
    from .otel_binaries import otelcol_factory  # noqa: F401  (fixture)
else:
    import otel_binaries as ob
    from otel_binaries import otelcol_factory  # noqa: F401  (fixture)

from otel_verl.exporters.otlp_json_file import spans_from_files
from otel_verl.ids import trace_id_for_uid

from demo_checks import descendants

pytestmark = pytest.mark.timeout(900)

REPO = ob.REPO_ROOT
PYTHON = sys.executable
STEPS, PROMPTS, N = 1, 2, 2  # the smallest demo with more than one uid and trajectory
# per trajectory (tool agent): invoke_agent, 2 x (chat + verl.llm_server.generate),
# execute_tool, verl.reward + its reward actor's verl.reward_worker.compute_score (the
# agent run is no span)
SPANS_PER_TRAJECTORY = 8
SAMPLE_STAGES = {"reward", "old_log_prob", "ref_log_prob", "adv", "update_actor"}
SPANS_PER_UID = 2 + N * SPANS_PER_TRAJECTORY + len(SAMPLE_STAGES)  # + verl.sample, verl.rollout
CSV_HEADERS = ["job_id", "cat", "sample_id", "sample_status", "timestamp", "content"]


def _child_env(**extra: str) -> dict:
    """This environment without tracing/Ray-address variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("OTEL_") and k not in ("VERL_TRACE_DIR", "RAY_ADDRESS")}
    env.update({"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"})
    env.update(extra)
    return env


def _tree(spans) -> dict:
    """(traceId, spanId) -> parentSpanId."""
    return {(s["traceId"], s["spanId"]): s["parentSpanId"] for s in spans}


def _shape(spans) -> dict:
    """What must survive every hop, per span: tree position, name, kind, attributes, process."""
    return {
        (s["traceId"], s["spanId"]): (
            s["parentSpanId"], s["name"], s["kind"], s["startTimeUnixNano"], s["endTimeUnixNano"],
            json.dumps(s["attributes"], sort_keys=True),
            s["resource"].get("verl.role"), s["resource"].get("process.pid"), s["resource"].get("verl.run_id"),
            s["resource"].get("service.name"), s["resource"].get("service.instance.id"),
        )
        for s in spans
    }


JAEGER_WARNINGS = "@jaeger@warnings"


def _from_jaeger(otlp_json) -> list:
    """Flat spans of a Jaeger answer, undoing Jaeger's one change at ingestion: a span
    whose end is not after its start (the instant ``verl.fit``) gets end = start + 1 ns
    and a ``@jaeger@warnings`` attribute ("Negative duration detected ..."). The
    clock-skew adjuster's "parent ... is not in the trace" warning (left on a span for
    good when a query saw it before its parent, see ``JaegerServer.get_trace``) changes
    nothing else and is dropped too; any other warning fails."""
    spans = ob.flat_spans(otlp_json)
    for s in spans:
        warnings = s["attributes"].pop(JAEGER_WARNINGS, None) or []
        other = [w for w in warnings if not w.endswith("is not in the trace; skipping clock skew adjustment")]
        if other:
            assert all(w.startswith("Negative duration detected") for w in other), warnings
            assert s["endTimeUnixNano"] == s["startTimeUnixNano"] + 1, s
            s["endTimeUnixNano"] = s["startTimeUnixNano"]
            s["jaeger_warned"] = True
    return spans


def _children(spans, parent, prefix=""):
    return [s for s in spans if s["parentSpanId"] == parent["spanId"] and s["name"].startswith(prefix)]


# --------------------------------------------------------------------------- 1. demo -> otelcol -> Jaeger + files


@dataclass
class DemoThroughCollector:
    jaeger: ob.JaegerServer
    run_id: str
    trace_dir: Path
    collector_dir: Path
    collector_exit: int | None
    collector_log: str
    summary: dict
    embedded: list  # spans of {trace_dir}/otlp/*.jsonl
    jaeger_traces: dict  # trace id -> OTLP-JSON answer of /api/v3/traces/{id}

    @property
    def sample_uids(self) -> list:
        return sorted(s["attributes"]["verl.uid"] for s in self.embedded if s["name"] == "verl.sample")


DEMO_CODE = """
import json, sys
from otel_verl.demo.traced import run_demo
summary = run_demo(sys.argv[1], steps=int(sys.argv[3]), prompts=int(sys.argv[4]), n=int(sys.argv[5]),
                   agent="tool", validate=False)
with open(sys.argv[2], "w") as f:
    json.dump(summary, f, default=str)
"""


def run_demo_subprocess(trace_dir: Path, env: dict, timeout: float = 800) -> dict:
    """``otel_verl.demo.traced.run_demo`` in a fresh interpreter (its own Ray cluster and
    tracing set-up, nothing left in the pytest process); returns its summary."""
    out = trace_dir.parent / f"{trace_dir.name}-summary.json"
    log = trace_dir.parent / f"{trace_dir.name}-demo.log"
    with open(log, "wb") as f:
        proc = subprocess.run([PYTHON, "-c", DEMO_CODE, str(trace_dir), str(out), str(STEPS), str(PROMPTS), str(N)],
                              env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"demo exited {proc.returncode}:\n{log.read_text(errors='replace')[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def demo_through_collector(tmp_path_factory):
    """One demo run exporting to otelcol (files + Jaeger). Waits until Jaeger has every
    span the demo wrote to its embedded files, then stops the collector (a clean stop
    flushes and closes its files); Jaeger stays up for the queries."""
    ob.require_binary("jaeger")
    ob.require_binary("otelcol")
    work = tmp_path_factory.mktemp("e2e-demo")
    with ExitStack() as stack:
        jaeger = ob.start_jaeger(work / "jaeger")
        stack.callback(jaeger.process.stop)
        collector_dir = work / "collector"
        col = ob.start_otelcol(ob.CONFIG_DIR / "otelcol-file-jaeger.yaml", work, {
            "OTELCOL_FILE_DIR": str(collector_dir),
            "OTELCOL_JAEGER_ENDPOINT": jaeger.otlp_grpc_endpoint,
        })
        stack.callback(col.process.stop)
        run_id = f"e2e-{uuid.uuid4().hex[:12]}"
        trace_dir = work / "trace"
        summary = run_demo_subprocess(trace_dir, _child_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=col.otlp_grpc_endpoint,
            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
            OTEL_VERL_OTLP_FILE="1",  # with an endpoint set, the embedded files are opt-in
            OTEL_VERL_RUN_ID=run_id,
        ))
        embedded = spans_from_files(summary["outputs"]["otlp_json"])
        assert embedded, "the demo wrote no embedded OTLP-JSON spans"
        per_trace = collections.Counter(s["traceId"] for s in embedded)
        for tid, count in per_trace.items():  # raw: see JaegerServer.get_trace
            jaeger.wait_for_trace(tid, min_spans=count, timeout=90, raw=True)
        jaeger_traces = {tid: jaeger.get_trace(tid) for tid in per_trace}
        collector_exit = col.process.stop(timeout=60)
        yield DemoThroughCollector(jaeger, run_id, trace_dir, collector_dir, collector_exit,
                                   col.process.log_tail(), summary, embedded, jaeger_traces)


@pytest.mark.verl
@pytest.mark.e2e
def test_demo_spans_in_jaeger_are_the_embedded_spans(demo_through_collector):
    d = demo_through_collector
    assert d.summary["steps_run"] == STEPS and d.summary["run_id"] == d.run_id
    in_jaeger = [s for trace in d.jaeger_traces.values() for s in _from_jaeger(trace)]
    assert len(in_jaeger) == len(d.embedded)  # no duplicates, nothing missing
    assert _shape(in_jaeger) == _shape(d.embedded)
    # Jaeger flags zero-duration spans; otel_verl has none (the instant verl.fit lasts 1 µs)
    assert [s["name"] for s in in_jaeger if s.get("jaeger_warned")] == []
    # one trace per uid, one per step, one for verl.fit
    assert len(d.jaeger_traces) == STEPS * PROMPTS + STEPS + 1
    assert len(d.sample_uids) == STEPS * PROMPTS
    per_trace = collections.Counter(s["traceId"] for s in in_jaeger)
    assert all(per_trace["%032x" % trace_id_for_uid(uid)] == SPANS_PER_UID for uid in d.sample_uids)
    # a service per role in one namespace, an instance per process
    assert {(s["resource"]["verl.role"], s["resource"]["service.name"]) for s in in_jaeger} == {
        ("trainer", "verl-trainer"), ("agent_loop_worker", "verl-rollout-worker"), ("llm_server", "verl-llm-server"),
        ("reward_worker", "verl-reward-worker")}
    assert {s["resource"]["service.namespace"] for s in in_jaeger} == {"verl"}
    instances = {(s["resource"]["process.pid"], s["resource"]["service.instance.id"]) for s in in_jaeger}
    assert len(instances) == len({pid for pid, _ in instances}) == len({iid for _, iid in instances}) >= 3
    assert {s["resource"]["verl.run_id"] for s in in_jaeger} == {d.run_id}


@pytest.mark.verl
@pytest.mark.e2e
def test_jaeger_trace_of_a_uid_is_the_sample_tree_across_processes(demo_through_collector):
    d = demo_through_collector
    uid = d.sample_uids[0]
    trace_id = "%032x" % trace_id_for_uid(uid)
    spans = _from_jaeger(d.jaeger.get_trace(trace_id))  # GET /api/v3/traces/{traceIdHex}
    assert len(spans) == SPANS_PER_UID
    assert {s["traceId"] for s in spans} == {trace_id}
    [root] = [s for s in spans if s["parentSpanId"] is None]
    assert root["name"] == "verl.sample" and root["attributes"]["verl.uid"] == uid
    assert root["resource"]["verl.role"] == "trainer"
    assert root["attributes"]["verl.sample.outcome"] == "trained"
    trainer_pid = root["resource"]["process.pid"]

    [rollout] = _children(spans, root, "verl.rollout")
    assert rollout["resource"]["process.pid"] == trainer_pid
    trajectories = _children(spans, rollout, "invoke_agent")
    assert sorted(t["attributes"]["verl.traj_uid"] for t in trajectories) == [str(i) for i in range(N)]
    server_pids = set()
    for traj in trajectories:
        # made in an AgentLoopWorker process, parented by the carrier the trainer sent
        assert traj["resource"]["verl.role"] == "agent_loop_worker"
        assert traj["resource"]["process.pid"] != trainer_pid
        assert traj["attributes"]["gen_ai.operation.name"] == "invoke_agent"
        assert traj["attributes"]["gen_ai.conversation.id"] == f"{uid}/{traj['attributes']['verl.traj_uid']}"
        subtree = descendants(spans, traj)
        assert len(subtree) + 1 == SPANS_PER_TRAJECTORY
        assert {s["resource"]["verl.role"] for s in subtree} == {"agent_loop_worker", "llm_server", "reward_worker"}
        run = traj  # the agent run is no span: its turns and tools are the trajectory's children
        chats = _children(spans, run, "chat ")
        assert len(chats) == 2
        for chat in chats:
            attrs = chat["attributes"]
            assert chat["kind"] == 3  # CLIENT
            assert chat["resource"]["process.pid"] == traj["resource"]["process.pid"]
            assert attrs["gen_ai.operation.name"] == "chat"
            assert attrs["gen_ai.provider.name"] == "sglang"
            assert attrs["gen_ai.request.model"] and chat["name"] == f"chat {attrs['gen_ai.request.model']}"
            assert attrs["gen_ai.usage.input_tokens"] > 0 and attrs["gen_ai.usage.output_tokens"] > 0
            assert attrs["gen_ai.response.finish_reasons"] == ["stop"]
            [server] = _children(spans, chat, "verl.llm_server.generate")  # parent by carrier in sampling_params
            assert server["kind"] == 2  # SERVER
            assert server["resource"]["verl.role"] == "llm_server"
            assert server["attributes"]["gen_ai.provider.name"] == "sglang"
            server_pids.add(server["resource"]["process.pid"])
        [tool] = _children(spans, run, "execute_tool")
        assert tool["attributes"]["gen_ai.tool.name"] == "calculator"
        [reward] = _children(spans, traj, "verl.reward")
        assert "verl.reward.score" in reward["attributes"]
        [scoring] = _children(spans, reward, "verl.reward_worker.compute_score")  # parent by carrier in the reward data
        assert scoring["resource"]["verl.role"] == "reward_worker" and scoring["kind"] == 2  # SERVER
    assert server_pids and trainer_pid not in server_pids
    stages = _children(spans, root, "verl.sample_stage")
    assert {s["attributes"]["verl.stage"] for s in stages} == SAMPLE_STAGES
    assert all(s["resource"]["verl.role"] == "trainer" for s in stages)
    # four kinds of process took part, each with its resource
    assert {s["resource"]["verl.role"] for s in spans} == {"trainer", "agent_loop_worker", "llm_server", "reward_worker"}


@pytest.mark.verl
@pytest.mark.e2e
def test_every_scored_trajectory_has_its_reward_as_a_genai_evaluation_result(demo_through_collector):
    d = demo_through_collector
    in_jaeger = [s for trace in d.jaeger_traces.values() for s in _from_jaeger(trace)]
    for where, spans in (("embedded files", d.embedded), ("jaeger", in_jaeger)):
        scored = [s for s in spans if s["name"].startswith("invoke_agent") and "verl.reward.score" in s["attributes"]]
        assert len(scored) == STEPS * PROMPTS * N, where  # the demo scores every trajectory
        for traj in scored:
            [result] = [e for e in traj["events"] if e["name"] == "gen_ai.evaluation.result"]
            assert result["attributes"]["gen_ai.evaluation.name"] == "verl.reward", where
            assert result["attributes"]["gen_ai.evaluation.score.value"] == traj["attributes"]["verl.reward.score"]
            assert traj["startTimeUnixNano"] <= result["timeUnixNano"] <= traj["endTimeUnixNano"]


@pytest.mark.verl
@pytest.mark.e2e
def test_jaeger_finds_traces_by_service_operation_and_uid(demo_through_collector):
    d = demo_through_collector
    uids = d.sample_uids
    sample_traces = {"%032x" % trace_id_for_uid(u) for u in uids}
    all_traces = {s["traceId"] for s in d.embedded}
    step_traces = {s["traceId"] for s in d.embedded if s["name"] == "verl.step"}

    # HTTP API v3: service, operation (query.service_name / query.operation_name); the
    # trainer has a span in every trace
    assert ob.trace_ids(d.jaeger.find_traces("verl-trainer")) == all_traces
    assert ob.trace_ids(d.jaeger.find_traces("verl-trainer", operation="verl.sample")) == sample_traces
    assert ob.trace_ids(d.jaeger.find_traces("verl-trainer", operation="verl.step")) == step_traces
    assert ob.trace_ids(d.jaeger.find_traces("no-such-service")) == set()

    # attribute filters: gRPC API v3 (TraceQueryParameters.attributes) ...
    for uid in uids:
        found = d.jaeger.find_traces_grpc("verl-trainer", attributes={"verl.uid": uid})
        assert ob.trace_ids(found) == {"%032x" % trace_id_for_uid(uid)}
        assert len(ob.flat_spans(found)) == SPANS_PER_UID  # whole traces come back
        assert ob.trace_ids(d.jaeger.find_traces_grpc("verl-trainer", operation="verl.sample",
                                                      attributes={"verl.uid": uid, "verl.global_step": "1"})) \
            == {"%032x" % trace_id_for_uid(uid)}
    # ... which match resource attributes too, on a span of the service searched: every
    # sample trace has an LLM server span, and no trainer span says it is one
    assert ob.trace_ids(d.jaeger.find_traces_grpc("verl-llm-server", attributes={"verl.role": "llm_server"})) \
        == sample_traces
    assert ob.trace_ids(d.jaeger.find_traces_grpc("verl-trainer", attributes={"verl.role": "llm_server"})) == set()
    assert ob.trace_ids(d.jaeger.find_traces_grpc("verl-trainer", attributes={"verl.uid": "no-such-uid"})) == set()
    # ... and the legacy HTTP API's tags filter
    assert d.jaeger.find_trace_ids_by_tags("verl-trainer", {"verl.uid": uids[0]}) \
        == {"%032x" % trace_id_for_uid(uids[0])}


@pytest.mark.verl
@pytest.mark.e2e
def test_jaeger_lists_a_service_per_role(demo_through_collector):
    """What a Jaeger (or Tempo, Grafana) user picks from: a service per kind of process,
    the LLM server's spans under their own."""
    d = demo_through_collector
    sample_traces = {"%032x" % trace_id_for_uid(u) for u in d.sample_uids}
    assert sorted(d.jaeger.services()) == ["verl-llm-server", "verl-reward-worker", "verl-rollout-worker", "verl-trainer"]
    assert d.jaeger.operations("verl-reward-worker") == [{"name": "verl.reward_worker.compute_score", "spanKind": "server"}]
    assert d.jaeger.operations("verl-llm-server") == [{"name": "verl.llm_server.generate", "spanKind": "server"}]
    rollout_operations = {op["name"] for op in d.jaeger.operations("verl-rollout-worker")}
    assert {"verl.llm_server.generate", "verl.sample", "verl.step"}.isdisjoint(rollout_operations)
    assert any(name.startswith("invoke_agent") for name in rollout_operations)
    trainer_operations = {op["name"] for op in d.jaeger.operations("verl-trainer")}
    assert {"verl.fit", "verl.step", "verl.sample", "verl.rollout"} <= trainer_operations
    assert not any(name.startswith(("invoke_agent", "chat", "verl.llm_server")) for name in trainer_operations)
    # searching the LLM server finds the sample traces (each holds its LLM calls), not the
    # step or fit traces; its spans in them are the server side of the generate calls
    found = d.jaeger.find_traces("verl-llm-server")
    assert ob.trace_ids(found) == sample_traces
    server_spans = [s for s in ob.flat_spans(found) if s["resource"]["service.name"] == "verl-llm-server"]
    assert len(server_spans) == len(sample_traces) * N * 2  # two turns per trajectory
    assert {(s["name"], s["kind"], s["resource"]["verl.role"]) for s in server_spans} == {
        ("verl.llm_server.generate", 2, "llm_server")}
    assert {s["spanId"] for s in d.embedded if s["resource"]["verl.role"] == "llm_server"} \
        == {s["spanId"] for s in server_spans}


@pytest.mark.verl
@pytest.mark.e2e
def test_jaeger_2_13_http_api_v3_ignores_attribute_filters(demo_through_collector):
    """Pinned behaviour of Jaeger v2.13: its HTTP API v3 has no attribute filter (the
    gateway passes an empty attribute map), so the parameter spellings one might try
    return every trace of the service. If this fails, Jaeger's HTTP v3 API learnt
    attribute filters: prefer it and update tests/otel_binaries.py's notes."""
    d = demo_through_collector
    uid = d.sample_uids[0]
    everything = ob.trace_ids(d.jaeger.find_traces("verl-trainer"))
    for extra in ({"query.attributes": json.dumps({"verl.uid": uid})},
                  {"query.attributes.verl.uid": uid},
                  {"query.attributes": f"verl.uid={uid}"}):
        assert ob.trace_ids(d.jaeger.find_traces("verl-trainer", extra=extra)) == everything, extra
    # query.num_traces is required in practice (search depth 0 is rejected)
    status, body = ob.http_get(f"{d.jaeger.query_url}/api/v3/traces?query.service_name=verl-trainer"
                               "&query.start_time_min=2000-01-01T00:00:00Z&query.start_time_max=2100-01-01T00:00:00Z")
    assert status == 500 and b"search depth" in body


@pytest.mark.verl
@pytest.mark.e2e
def test_collector_files_hold_the_same_spans_as_jaeger_and_the_embedded_files(demo_through_collector):
    d = demo_through_collector
    assert d.collector_exit == 0, d.collector_log
    # group_by verl.run_id: one file set per run, <dir>/<run id>/otlp/traces.jsonl
    files = sorted(p.relative_to(d.collector_dir).as_posix() for p in d.collector_dir.rglob("*") if p.is_file())
    assert files == [f"{d.run_id}/otlp/traces.jsonl"]
    in_files = spans_from_files([str(d.collector_dir / files[0])])
    assert len(in_files) == len(d.embedded)
    assert _shape(in_files) == _shape(d.embedded)
    in_jaeger = [s for trace in d.jaeger_traces.values() for s in ob.flat_spans(trace)]
    assert _tree(in_files) == _tree(in_jaeger)
    # links (sample stage -> step stage) survive the collector too
    links = {s["spanId"]: [(link["traceId"], link["spanId"]) for link in s["links"]] for s in in_files}
    assert links == {s["spanId"]: [(link["traceId"], link["spanId"]) for link in s["links"]] for s in d.embedded}
    assert any(links.values())


# --------------------------------------------------------------------------- 2. replay


@pytest.mark.verl
@pytest.mark.e2e
def test_replay_with_otelcol_into_a_fresh_jaeger_gives_the_same_trees(demo_through_collector, otelcol_factory, tmp_path):
    d = demo_through_collector
    fresh = ob.start_jaeger(tmp_path / "jaeger-replay")
    try:
        per_trace = collections.Counter(s["traceId"] for s in d.embedded)
        assert all(fresh.get_trace(tid) is None for tid in per_trace)
        replay = otelcol_factory(ob.CONFIG_DIR / "otelcol-replay.yaml", {
            "OTEL_VERL_REPLAY_GLOB": str(d.trace_dir / "otlp" / "*.jsonl"),
            "OTELCOL_JAEGER_ENDPOINT": fresh.otlp_grpc_endpoint,
        }, wait=False)
        replayed = [s for tid, count in per_trace.items()
                    for s in _from_jaeger(fresh.wait_for_trace(tid, min_spans=count, timeout=90, raw=True))]
        assert replay.process.stop() == 0, replay.process.log_tail()
        assert len(replayed) == len(d.embedded)
        # The otlp_json_file receiver (file consumer) tags every span with the name of the
        # file it read it from, unless the config sets `include_file_name: false`.
        source = {s["spanId"]: os.path.basename(path)
                  for path in d.summary["outputs"]["otlp_json"] for s in spans_from_files([path])}
        for span in replayed:
            assert span["attributes"].pop("log.file.name", source[span["spanId"]]) == source[span["spanId"]]
        assert _shape(replayed) == _shape(d.embedded)
        original = [s for trace in d.jaeger_traces.values() for s in ob.flat_spans(trace)]
        assert _tree(replayed) == _tree(original)
    finally:
        fresh.process.stop()


@pytest.mark.verl
@pytest.mark.e2e
def test_replay_with_otel_verl_replay_into_a_fresh_jaeger_gives_the_same_trees(demo_through_collector, tmp_path):
    """The same through otel_verl's Python replay (OTLP/JSON POSTs to Jaeger's OTLP/HTTP)."""
    replay_mod = pytest.importorskip("otel_verl.tools.replay")
    d = demo_through_collector
    fresh = ob.start_jaeger(tmp_path / "jaeger-replay-py")
    try:
        result = replay_mod.replay([str(d.trace_dir)], fresh.otlp_http_endpoint, progress=False)
        assert result.ok and result.spans_sent == len(d.embedded), result
        per_trace = collections.Counter(s["traceId"] for s in d.embedded)
        replayed = [s for tid, count in per_trace.items()
                    for s in _from_jaeger(fresh.wait_for_trace(tid, min_spans=count, timeout=60, raw=True))]
        assert len(replayed) == len(d.embedded)
        assert _shape(replayed) == _shape(d.embedded)
    finally:
        fresh.process.stop()


# --------------------------------------------------------------------------- 3. two Ray nodes

TWO_NODE_DRIVER = r'''
import json, os, sys, time, uuid
import ray
from otel_verl import activation

address, out_path = sys.argv[1], sys.argv[2]
runtime_env = activation.runtime_env()
runtime_env["env_vars"].pop("VERL_TRACE_DIR", None)  # each node keeps the dir its raylet has
ray.init(address=address, runtime_env=runtime_env, log_to_driver=False)
deadline = time.time() + 90
while not any(n["Alive"] and "node2" in n["Resources"] for n in ray.nodes()):
    assert time.time() < deadline, f"node 2 did not join: {ray.nodes()}"
    time.sleep(0.5)


def where():
    return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
            "trace_dir": os.environ.get("VERL_TRACE_DIR")}


@ray.remote(num_cpus=0, resources={"node1": 0.01})
class LLMServer:
    def generate(self, headers, request_id):
        from otel_verl import bootstrap, events
        bootstrap.ensure("llm_server")
        with events.llm_server_call(headers, request_id=request_id, provider="sglang") as call:
            call.record_meta({"e2e_latency": 0.01})
        return call.meta

    def close(self):
        from otel_verl import bootstrap
        bootstrap.shutdown()
        return where()


@ray.remote(num_cpus=0, resources={"node2": 0.01})
class AgentLoopWorker:
    def run(self, uid, carriers, server):
        from otel_verl import bootstrap, events
        bootstrap.ensure("agent_loop_worker")
        for i, carrier in enumerate(carriers):
            with events.trajectory(uid, carrier.row["traj_uid"], step=1, agent_name="single_turn_agent",
                                   parent=carrier, worker_index=carrier.row["worker"]):
                with events.agent_run("SingleTurnAgentLoop"):
                    with events.llm_call([1, 2, 3], model="tiny", provider="sglang", request_id=f"r{i}") as turn:
                        meta = ray.get(server.generate.remote(turn.carrier(), f"r{i}"))
                        turn.finish([4, 5], stop_reason="stop", server_meta=meta)
                with events.reward() as reward:
                    reward.score(1.0)
        bootstrap.shutdown()  # flush this node's files
        return where()


@ray.remote(num_cpus=0, resources={"node1": 0.01})
class Trainer:
    def run(self, uid, worker, server):
        import time
        from otel_verl import bootstrap, events
        from otel_verl.semconv import Outcome, Stage
        bootstrap.ensure("trainer")
        trainer = "RayPPOTrainer"
        events.step_begin(1, trainer=trainer, epoch=0, consumed_batches=0)
        events.samples_created([uid], step=1, trainer=trainer)
        with events.step_stage(Stage.GENERATION, step=1, trainer=trainer):
            carriers = events.rollout_dispatched([uid, uid], ["0", "1"], [0, 0], step=1, trainer=trainer)
            worker_at = ray.get(worker.run.remote(uid, carriers, server))
            events.rollout_returned([uid])
        with events.step_stage(Stage.OLD_LOG_PROB, step=1, trainer=trainer):
            start = time.time_ns()
            events.sample_stage_done(Stage.OLD_LOG_PROB, [uid, uid], ["0", "1"], step=1, start_ns=start,
                                     trainer=trainer)
        events.samples_finished([uid], Outcome.TRAINED)
        events.step_end()
        bootstrap.shutdown()
        return {"trainer": where(), "worker": worker_at}


uid = str(uuid.uuid4())
server = LLMServer.remote()
worker = AgentLoopWorker.remote()
result = ray.get(Trainer.remote().run.remote(uid, worker, server), timeout=180)
result["server"] = ray.get(server.close.remote(), timeout=60)
result["uid"] = uid
with open(out_path, "w") as f:
    json.dump(result, f)
ray.shutdown()
'''


class TwoNodeRayCluster:
    """``ray start --head`` and a second ``ray start --address=...`` (each ``--block``, in
    its own session, with its own temp dir and ports), stopped by killing exactly the
    processes they started. Not ``ray stop``: that kills every Ray process on the
    machine, other clusters included."""

    def __init__(self, base: Path, env: dict, node_env: tuple) -> None:
        self.base = base
        self.procs: list = []
        self.env = env
        self.node_env = node_env
        self.address = ""

    def _start(self, name: str, args: list, env: dict) -> subprocess.Popen:
        log = open(self.base / f"{name}.log", "wb")
        proc = subprocess.Popen([os.path.join(os.path.dirname(PYTHON), "ray"), "start", "--block", *args],
                                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        (gcs, client, *ports) = ob.free_ports(14)
        common = ["--num-cpus=1", "--disable-usage-stats", "--object-store-memory=100000000",
                  "--min-worker-port=0", "--max-worker-port=0"]

        def node_ports(p):
            return [f"--node-manager-port={p[0]}", f"--object-manager-port={p[1]}",
                    f"--dashboard-agent-listen-port={p[2]}", f"--dashboard-agent-grpc-port={p[3]}",
                    f"--metrics-export-port={p[4]}", f"--runtime-env-agent-port={p[5]}"]

        head = self._start("head", [
            "--head", f"--port={gcs}", f"--ray-client-server-port={client}", "--include-dashboard=false",
            f"--temp-dir={self.base / 'ray1'}", "--resources=" + json.dumps({"node1": 1}), *node_ports(ports[:6]), *common,
        ], {**self.env, **self.node_env[0]})
        self._wait_gcs(head, gcs)
        self.address = f"{self._gcs_host()}:{gcs}"
        self._start("node2", [
            f"--address={self.address}", f"--temp-dir={self.base / 'ray2'}",
            "--resources=" + json.dumps({"node2": 1}), *node_ports(ports[6:12]), *common,
        ], {**self.env, **self.node_env[1]})

    def _gcs_host(self) -> str:
        # Ray replaces a loopback node address with the host's own address and binds there
        import ray._private.services as services

        return services.get_node_ip_address()

    def _wait_gcs(self, head: subprocess.Popen, port: int, timeout: float = 90) -> None:
        import socket

        deadline = time.monotonic() + timeout
        host = self._gcs_host()
        while True:
            if head.poll() is not None:
                raise RuntimeError(f"ray head exited {head.returncode}:\n{self.log('head')}")
            try:
                with socket.create_connection((host, port), timeout=1.0):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ray head GCS {host}:{port} not up after {timeout}s\n{self.log('head')}")
                time.sleep(0.2)

    def log(self, name: str) -> str:
        try:
            return (self.base / f"{name}.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGKILL every process the two ``ray start`` commands started (found as their
        descendants, and by this cluster's own temp dir on their command lines), then
        the commands themselves. Everything traced was flushed before."""
        import psutil

        victims = {}
        for proc in self.procs:
            try:
                parent = psutil.Process(proc.pid)
                victims[parent.pid] = parent
                for child in parent.children(recursive=True):
                    victims[child.pid] = child
            except psutil.Error:
                pass
        marker = str(self.base)
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(marker in part for part in (p.info["cmdline"] or ())):
                    victims[p.pid] = p
            except psutil.Error:
                pass
        victims.pop(os.getpid(), None)
        for p in victims.values():
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        psutil.wait_procs(list(victims.values()), timeout=15)
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


def _csv_rows(trace_dir: Path) -> list:
    rows = []
    for path in sorted(glob.glob(str(trace_dir / "sample" / "*.csv"))):
        with open(path, newline="") as f:
            for row in csv.reader(f):
                rec = dict(zip(CSV_HEADERS, row))
                rec["fields"] = dict(part.split("=", 1) for part in rec["content"].split("|"))
                rec["file"] = os.path.basename(path)
                rows.append(rec)
    return rows


@pytest.mark.verl
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_two_ray_nodes_one_trace_and_node_local_legacy_files():
    # short paths: Ray's unix sockets live under the temp dir (108-byte limit)
    base = Path(tempfile.mkdtemp(prefix="otv2n", dir="/tmp"))
    dirs = (base / "node1-trace", base / "node2-trace")
    run_id = f"two-nodes-{uuid.uuid4().hex[:8]}"
    env = _child_env(OTEL_VERL_ENABLED="1", OTEL_VERL_RUN_ID=run_id)
    cluster = TwoNodeRayCluster(base, env, ({"VERL_TRACE_DIR": str(dirs[0])}, {"VERL_TRACE_DIR": str(dirs[1])}))
    try:
        cluster.start()
        out = base / "result.json"
        driver = subprocess.run([PYTHON, "-c", TWO_NODE_DRIVER, cluster.address, str(out)],
                                env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
        assert driver.returncode == 0, (f"driver exited {driver.returncode}:\n{driver.stderr[-5000:]}\n"
                                        f"--- head\n{cluster.log('head')}\n--- node2\n{cluster.log('node2')}")
        result = json.loads(out.read_text())
    finally:
        cluster.stop()
    try:
        _check_two_nodes(result, dirs, run_id)
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def _check_two_nodes(result: dict, dirs: tuple, run_id: str) -> None:
    uid = result["uid"]
    trainer, worker, server = result["trainer"], result["worker"], result["server"]
    node1, node2 = trainer["node"], worker["node"]
    assert node1 != node2 and server["node"] == node1
    # every process kept its raylet's VERL_TRACE_DIR (not forwarded by the runtime env)
    assert (trainer["trace_dir"], server["trace_dir"], worker["trace_dir"]) == (str(dirs[0]), str(dirs[0]), str(dirs[1]))

    spans1 = spans_from_files(sorted(glob.glob(str(dirs[0] / "otlp" / "*.jsonl"))))
    spans2 = spans_from_files(sorted(glob.glob(str(dirs[1] / "otlp" / "*.jsonl"))))
    assert {s["resource"]["ray.node_id"] for s in spans1} == {node1}
    assert {s["resource"]["ray.node_id"] for s in spans2} == {node2}
    assert {s["resource"]["verl.run_id"] for s in spans1 + spans2} == {run_id}
    mine = [s for s in spans1 + spans2 if s["attributes"].get("verl.uid") == uid or s["name"] == "verl.llm_server.generate"]
    assert {s["traceId"] for s in mine} == {"%032x" % trace_id_for_uid(uid)}  # one trace across both nodes
    by_id = {s["spanId"]: s for s in mine}

    [root] = [s for s in mine if s["name"] == "verl.sample"]
    [rollout] = _children(mine, root, "verl.rollout")
    assert root["resource"]["ray.node_id"] == rollout["resource"]["ray.node_id"] == node1
    trajectories = _children(mine, rollout, "invoke_agent")  # node 2 -> parent on node 1
    assert sorted(t["attributes"]["verl.traj_uid"] for t in trajectories) == ["0", "1"]
    for traj in trajectories:
        assert traj["resource"]["ray.node_id"] == node2 and traj["resource"]["verl.role"] == "agent_loop_worker"
        [chat] = _children(mine, traj, "chat ")
        [srv] = _children(mine, chat, "verl.llm_server.generate")  # node 1 -> parent on node 2
        assert srv["resource"]["ray.node_id"] == node1 and srv["resource"]["verl.role"] == "llm_server"
        [reward] = _children(mine, traj, "verl.reward")
        assert len(descendants(mine, traj)) == 3  # chat, its server span, reward (the agent run is no span)
    [stage] = _children(mine, root, "verl.sample_stage old_log_prob")
    assert stage["resource"]["ray.node_id"] == node1
    assert all(s["parentSpanId"] is None or s["parentSpanId"] in by_id for s in mine)

    # legacy files: each node has its own, with its own processes' rows
    rows1, rows2 = _csv_rows(dirs[0]), _csv_rows(dirs[1])
    assert {r["file"] for r in rows1} == {f"{os.uname().nodename}-pid{trainer['pid']}.csv"}
    assert {r["file"] for r in rows2} == {f"{os.uname().nodename}-pid{worker['pid']}.csv"}
    details1 = collections.Counter(r["fields"]["detail"].split("=")[0] for r in rows1 if r["sample_id"].startswith(uid))
    details2 = collections.Counter(r["fields"]["detail"].split("=")[0] for r in rows2 if r["sample_id"].startswith(uid))
    assert details1 == {"uid_generated": 1, "traj_uid_generated_by_repeat": 2, "dispatched_to_agent_loop_worker": 2,
                        "old_log_prob_computed": 2}
    assert details2 == {"agent_task_started": 2, "sending_generate_request": 2, "received_generate_response": 2,
                        "agent_run_completed": 2, "reward_score_computed_score": 2}
    assert not glob.glob(str(dirs[0] / "trajectory" / "*.jsonl"))
    trajectory_lines = [json.loads(line) for path in glob.glob(str(dirs[1] / "trajectory" / "*.jsonl"))
                        for line in open(path, encoding="utf-8")]
    assert sorted((t["prompt_uid"], t["sample_index"]) for t in trajectory_lines) == [(uid, 0), (uid, 1)]
    progress1 = "".join(open(p, encoding="utf-8").read() for p in glob.glob(str(dirs[0] / "progress" / "*.log")))
    progress2 = "".join(open(p, encoding="utf-8").read() for p in glob.glob(str(dirs[1] / "progress" / "*.log")))
    assert "Step 1 rollout started" in progress1 and "Task " not in progress1
    assert f"Task {uid}/0 is completed" in progress2 and "Step 1" not in progress2


# --------------------------------------------------------------------------- 4. collector load benchmark (CI size)


def _load_benchmark():
    path = REPO / "benchmarks" / "bench_collector_load.py"
    spec = importlib.util.spec_from_file_location("bench_collector_load", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_collector_load_benchmark_quick_loses_no_span(tmp_path):
    ob.require_binary("otelcol")
    bench = _load_benchmark()
    report = bench.run(64, 16, baseline=False, workdir=str(tmp_path))
    run = report["run"]
    assert run["spans"] == report["expected_spans"] == bench.expected_spans(64, 16)
    assert run["bsp_max_queue_size"] == 1 << 20  # bounded in bytes, not at the SDK's 2048 spans
    assert run["dropped"] == {} and run["failures"] == {}
    assert run["in_collector_file"] == run["spans"]
    assert report["ok"], bench.describe(report)


BSP_PROBE = """
import json
from otel_verl import bootstrap
from otel_verl.accelerated.batch import BatchExportProcessor
assert bootstrap.configure(role="trainer")
out = {p.output: [p.max_queue_bytes, p.max_queue_spans, p.max_batch]
       for p in bootstrap.span_processors() if isinstance(p, BatchExportProcessor)}
bootstrap.shutdown()
print(json.dumps(out))
"""


@pytest.mark.parametrize("env, expected", [
    ({}, [64 << 20, 1 << 20, 512]),  # bounded in bytes: a 1024 x 16 step's bursts fit
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "4096"}, [64 << 20, 4096, 512]),  # the user's setting wins
    ({"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "20000"}, [64 << 20, 1 << 20, 20000]),
    ({"OTEL_VERL_MAX_QUEUE_MB": "8"}, [8 << 20, 1 << 20, 512]),
])
def test_otel_verl_default_span_queue(env, expected, tmp_path):
    # the trainer's outputs in its own process (OTEL_VERL_OFFLOAD=0), where the probe sees them
    probe_env = _child_env(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_VERL_OTLP_FILE="1",
                           VERL_TRACE_DIR=str(tmp_path), OTEL_VERL_OFFLOAD="0", **env)
    out = subprocess.run([PYTHON, "-c", BSP_PROBE], env=probe_env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["otlp"] == expected
    assert got["otlp_json_file"][0] == expected[0]  # the files' batches: the same bound in bytes


CONTENT_PROBE = """
import json
from otel_verl import bootstrap, events, health
assert bootstrap.configure(role="agent_loop_worker")
text = "w\\u00f6rd " * 1700  # message content past the 8192-character bound
for i in range(600):
    with events.trajectory(f"u{i}", "0", step=1, agent_name="a", decode=lambda ids, **kw: text):
        with events.llm_call(list(range(2000)), model="m") as turn:
            turn.finish(list(range(500)), stop_reason="stop")
assert bootstrap.flush(60)
print(json.dumps(health.snapshot()))
bootstrap.shutdown()
"""


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_spans_with_message_content_reach_a_grpc_collector_whole(otelcol_factory, tmp_path):
    """GenAI content capture makes a 512-span batch larger than the 4 MiB a gRPC receiver
    takes by default: it goes out as several requests, and the real Collector gets every span."""
    collector_dir = tmp_path / "collector"
    col = otelcol_factory(ob.CONFIG_DIR / "otelcol-file.yaml", {"OTELCOL_FILE_DIR": str(collector_dir)})
    env = _child_env(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{col.grpc_port}",
                     OTEL_EXPORTER_OTLP_PROTOCOL="grpc", OTEL_VERL_RUN_ID="content-run",
                     OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT="true")
    out = subprocess.run([PYTHON, "-c", CONTENT_PROBE], env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"failures": {}, "dropped": {}}
    path = collector_dir / "content-run" / "otlp" / "traces.jsonl"
    deadline = time.time() + 30
    spans: list = []
    while time.time() < deadline:  # the collector's batch processor writes within a second
        if path.exists():
            spans = [s for line in path.read_text().splitlines() if line for s in ob.flat_spans(json.loads(line))]
            if len(spans) >= 1200:
                break
        time.sleep(0.5)
    chats = [s for s in spans if s["name"] == "chat m"]
    assert len(spans) == 1200 and len(chats) == 600
    assert all(len(s["attributes"]["gen_ai.input.messages"]) > 8192 for s in chats)
