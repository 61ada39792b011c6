"""Tail sampling across nodes: collector-config/otelcol-agent-loadbalancing.yaml in
front of two otelcol-gateway-tailsampling.yaml gateways, real otelcol processes on
loopback.

Spans shaped like a uid's trace come from three "processes" (a TracerProvider each,
with the trainer's, a rollout worker's and an LLM server's resource) through the agent.
The gateways (file exporter instead of the backend) must keep every trace with an
error, a slow trajectory or an extreme reward whole, on one gateway, keep the step
trace, and the configured share of the ordinary ones; the trainer's late spans (sample
stages, the verl.sample root's end), sent after the decision and after newer traces
pushed the decided ones out of the gateways' memory, follow it (decision cache).

Needs the otelcol binary from scripts/build-otel-binaries.sh (see tests/otel_binaries.py).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from otel_verl import semconv as sc

if __package__:
    from . import otel_binaries as ob
else:
    import otel_binaries as ob

pytestmark = pytest.mark.e2e

AGENT_CONFIG = ob.CONFIG_DIR / "otelcol-agent-loadbalancing.yaml"
GATEWAY_CONFIG = ob.CONFIG_DIR / "otelcol-gateway-tailsampling.yaml"

SLOW_MS = 1000  # OTELCOL_TAIL_SLOW_TRAJECTORY_MS
REWARD_LOW, REWARD_HIGH = -0.9, 0.9
MS = 1_000_000  # ns


@dataclass
class UidTrace:
    kind: str  # "error", "slow", "low", "high", "ordinary"
    trace_id: str = ""
    early: set[str] = field(default_factory=set)  # span ids sent before the decision
    late: set[str] = field(default_factory=set)  # span ids sent after it


class Processes:
    """Three TracerProviders standing for the trainer, a rollout worker and an LLM
    server (own resources), exporting over OTLP/gRPC to the agent."""

    def __init__(self, endpoint: str):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.providers = {}
        for role in (sc.Role.TRAINER, sc.Role.AGENT_LOOP_WORKER, sc.Role.LLM_SERVER):
            provider = TracerProvider(resource=Resource.create({
                "service.name": sc.ROLE_SERVICE_NAMES[role], sc.SERVICE_NAMESPACE: sc.SERVICE_NAMESPACE_VERL,
                sc.RUN_ID: "tail-sampling-test",
            }))
            provider.add_span_processor(BatchSpanProcessor(
                OTLPSpanExporter(endpoint=endpoint, insecure=True), max_queue_size=16384))
            self.providers[role] = provider
        self.tracers = {role: p.get_tracer("otel_verl.tests") for role, p in self.providers.items()}

    def flush(self) -> None:
        for p in self.providers.values():
            assert p.force_flush(30_000)

    def shutdown(self) -> None:
        for p in self.providers.values():
            p.shutdown()


def span_id(span) -> str:
    return format(span.get_span_context().span_id, "016x")


def send_rollout(procs: Processes, t: UidTrace, index: int, t0: int):
    """The rollout part of a uid's trace; returns the open verl.sample root span."""
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    trainer = procs.tracers[sc.Role.TRAINER]
    worker = procs.tracers[sc.Role.AGENT_LOOP_WORKER]
    server = procs.tracers[sc.Role.LLM_SERVER]
    uid = f"uid-{index}"
    traj_ms = 2 * SLOW_MS if t.kind == "slow" else 100
    score = {"low": -1.0, "high": 1.0}.get(t.kind, round(random.uniform(-0.5, 0.5), 3))

    root = trainer.start_span(sc.SPAN_SAMPLE, start_time=t0, attributes={sc.UID: uid})
    t.trace_id = format(root.get_span_context().trace_id, "032x")
    t.late.add(span_id(root))  # ends (and is exported) after the training stages
    rollout = trainer.start_span(sc.SPAN_ROLLOUT, context=trace.set_span_in_context(root),
                                 start_time=t0 + MS, attributes={sc.UID: uid})
    traj = worker.start_span(
        sc.agent_span_name("tool_agent"), context=trace.set_span_in_context(rollout),
        start_time=t0 + 2 * MS,
        attributes={sc.UID: uid, "gen_ai.operation.name": "invoke_agent", sc.REWARD_SCORE: score})
    chat = worker.start_span("chat test-model", context=trace.set_span_in_context(traj),
                             start_time=t0 + 3 * MS, attributes={"gen_ai.operation.name": "chat"})
    gen = server.start_span(sc.SPAN_LLM_SERVER, context=trace.set_span_in_context(chat),
                            start_time=t0 + 4 * MS)
    if t.kind == "error":  # the error is on the LLM server's span only
        gen.set_status(Status(StatusCode.ERROR, "engine failed"))
    reward = worker.start_span(sc.SPAN_REWARD, context=trace.set_span_in_context(traj),
                               start_time=t0 + (traj_ms - 10) * MS, attributes={sc.REWARD_SCORE: score})
    for span, end_ms in ((gen, 50), (chat, 60), (reward, traj_ms - 5), (traj, traj_ms), (rollout, traj_ms + 1)):
        span.end(end_time=t0 + end_ms * MS)
        t.early.add(span_id(span))
    return root


def send_training(procs: Processes, t: UidTrace, root, t0: int) -> None:
    """The trainer's late part: a sample stage span, then the end of verl.sample."""
    from opentelemetry import trace

    stage = procs.tracers[sc.Role.TRAINER].start_span(
        sc.sample_stage_span_name("update_actor"), context=trace.set_span_in_context(root),
        start_time=t0 + 5000 * MS)
    stage.end(end_time=t0 + 6000 * MS)
    t.late.add(span_id(stage))
    root.end(end_time=t0 + 6001 * MS)


def send_step_trace(procs: Processes, t0: int) -> tuple[str, set[str]]:
    from opentelemetry import trace

    tracer = procs.tracers[sc.Role.TRAINER]
    step = tracer.start_span(sc.SPAN_STEP, start_time=t0)
    stage = tracer.start_span(sc.step_stage_span_name("gen"), context=trace.set_span_in_context(step),
                              start_time=t0 + MS)
    stage.end(end_time=t0 + 100 * MS)
    step.end(end_time=t0 + 200 * MS)
    return format(step.get_span_context().trace_id, "032x"), {span_id(step), span_id(stage)}


def read_gateway(path: Path) -> dict[str, dict[str, dict]]:
    """trace id -> span id -> flat span, from a file exporter's OTLP-JSON lines."""
    out: dict[str, dict[str, dict]] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        if line.strip():
            for s in ob.flat_spans(json.loads(line)):
                out.setdefault(s["traceId"], {})[s["spanId"]] = s
    return out


def start_collector(args: list[str], log: Path, env: dict[str, str], grpc: int) -> ob.ManagedProcess:
    proc = ob.ManagedProcess([ob.require_binary("otelcol"), *args], log, env).start()
    try:
        ob.wait_for_port("127.0.0.1", grpc, timeout=30, proc=proc)
    except BaseException:
        proc.stop()
        raise
    return proc


@pytest.mark.parametrize("percent", [0, 50])
def test_agent_routes_by_trace_id_and_gateways_keep_interesting_traces(tmp_path, percent):
    ob.require_binary("otelcol")
    random.seed(percent)
    processes: list[ob.ManagedProcess] = []
    procs = None
    try:
        gateways = []
        for i in range(2):
            grpc, http = ob.free_ports(2)
            out = tmp_path / f"gateway{i}.jsonl"
            env = {
                "OTELCOL_GRPC_ENDPOINT": f"127.0.0.1:{grpc}", "OTELCOL_HTTP_ENDPOINT": f"127.0.0.1:{http}",
                "OTELCOL_TAIL_DECISION_WAIT": "2s",
                # room for this gateway's ~120 uid traces; the fillers below push them out
                "OTELCOL_TAIL_NUM_TRACES": "200",
                "OTELCOL_TAIL_SLOW_TRAJECTORY_MS": str(SLOW_MS),
                "OTELCOL_TAIL_REWARD_LOW": str(REWARD_LOW), "OTELCOL_TAIL_REWARD_HIGH": str(REWARD_HIGH),
                "OTELCOL_TAIL_SAMPLE_PERCENT": str(percent),
            }
            # the shipped gateway, its backend exporter swapped for a file
            args = ["--config", str(GATEWAY_CONFIG),
                    "--config", f"yaml:exporters::file::path: {out}",
                    "--set", "service::pipelines::traces::exporters=[file]"]
            processes.append(start_collector(args, tmp_path / f"gateway{i}.log", env, grpc))
            gateways.append((grpc, out))
        grpc, http = ob.free_ports(2)
        agent_env = {
            "OTELCOL_GRPC_ENDPOINT": f"127.0.0.1:{grpc}", "OTELCOL_HTTP_ENDPOINT": f"127.0.0.1:{http}",
            "OTELCOL_GATEWAYS": "[" + ", ".join(f"127.0.0.1:{g}" for g, _ in gateways) + "]",
        }
        processes.append(start_collector(["--config", str(AGENT_CONFIG)], tmp_path / "agent.log", agent_env, grpc))

        procs = Processes(f"http://127.0.0.1:{grpc}")
        kinds = ["error"] * 10 + ["slow"] * 10 + ["low"] * 10 + ["high"] * 10 + ["ordinary"] * 200
        random.shuffle(kinds)
        traces = [UidTrace(k) for k in kinds]
        t0 = time.time_ns()
        roots = [send_rollout(procs, t, i, t0) for i, t in enumerate(traces)]
        step_trace, step_spans = send_step_trace(procs, t0)
        procs.flush()

        # Wait for the decisions: every interesting trace's rollout spans written.
        interesting = [t for t in traces if t.kind != "ordinary"]
        deadline = time.monotonic() + 60
        while True:
            for p in processes:
                p.check_alive()
            written = {}
            for _, out in gateways:
                written.update(read_gateway(out))
            if all(t.early <= set(written.get(t.trace_id, {})) for t in interesting):
                break
            assert time.monotonic() < deadline, "interesting traces not written by the gateways in 60s"
            time.sleep(0.5)
        time.sleep(1)  # the probabilistic share is decided in the same tick

        # Newer traces push the decided ones out of the gateways' trace memory
        # (num_traces), as a busy run does: from here on only the decision cache
        # remembers the decisions.
        for i in range(400):
            procs.tracers[sc.Role.TRAINER].start_span("filler", start_time=t0).end(end_time=t0 + MS)
        procs.flush()
        time.sleep(3)  # decision_wait + a tick

        # The trainer's late spans arrive after the decision: they follow it.
        for t, root in zip(traces, roots):
            send_training(procs, t, root, t0)
        procs.flush()
        time.sleep(3)  # the agent's batch (1s) and the gateways' batch (1s)
        for p in reversed(processes):  # the agent first: it flushes to the gateways
            assert p.stop() == 0, p.log_tail()
    finally:
        if procs is not None:
            procs.shutdown()
        for p in processes:
            p.stop()

    per_gateway = [read_gateway(out) for _, out in gateways]
    # Load balancing by trace id: no trace is split across gateways, both got some.
    assert not set(per_gateway[0]) & set(per_gateway[1])
    assert all(per_gateway), [len(g) for g in per_gateway]
    kept = {tid: spans for g in per_gateway for tid, spans in g.items()}

    for t in interesting:
        spans = kept.get(t.trace_id)
        assert spans is not None, f"{t.kind} trace {t.trace_id} dropped"
        # whole: the rollout spans from three processes and the trainer's late spans
        assert set(spans) == t.early | t.late, t.kind
        assert {s["resource"]["service.name"] for s in spans.values()} == {
            "verl-trainer", "verl-rollout-worker", "verl-llm-server"}
    assert set(kept[step_trace]) == step_spans

    ordinary = [t for t in traces if t.kind == "ordinary"]
    kept_ordinary = [t for t in ordinary if t.trace_id in kept]
    for t in kept_ordinary:
        assert set(kept[t.trace_id]) == t.early | t.late
    if percent == 0:
        assert kept_ordinary == []
        assert set(kept) == {t.trace_id for t in interesting} | {step_trace}
    else:  # binomial(200, 0.5): 60..140 is more than 5 standard deviations wide
        assert 60 <= len(kept_ordinary) <= 140, len(kept_ordinary)
