"""What the OpenTelemetry SDK costs per single-turn trajectory, and the metrics with and without it.

    python benchmarks/bench_sdk_costs.py            # 1024 trajectories, best of 5
    python benchmarks/bench_sdk_costs.py --quick    # 64, once: only checks that it works

The spans and metric records are the real ones: 1024 single-turn trajectories (the
trajectory, its LLM call with the server's span under it, its reward) go through
otel_verl's events API into an SDK TracerProvider (otel_verl's spans, as its own provider
starts them), and the span ends through otel_verl's
metrics processor. Then, per trajectory:

- the SDK's OTLP protobuf encoding of its spans (``encode_spans`` and the serialization,
  by batches of 512 as the BatchSpanProcessor hands them over): what the SDK's OTLP
  exporter spends before sending;
- the SDK's metric records of its span ends (``Histogram.record`` with the records'
  attributes and exemplar context): how many the run made, times the CPU of one;
- otel_verl's metrics processor, all its span ends' work (``on_end``), recording into its
  own aggregation (the default) and into an SDK ``MeterProvider`` (a user's, or settings
  only the SDK has), in turns, best of the rounds.

The SDK's costs belong to its version: run it in each venv to compare
(``.venv-lowest/bin/python benchmarks/bench_sdk_costs.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from opentelemetry import trace  # noqa: E402
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.sdk.version import __version__ as SDK_VERSION  # noqa: E402

from otel_verl import carriers, events, settings  # noqa: E402
from otel_verl.exporters.metrics import SpanMetricsProcessor  # noqa: E402
from otel_verl.instrumentation import tracing  # noqa: E402
from otel_verl.sampling import IsolatingSpanProcessor  # noqa: E402
from otel_verl.slim_span import SlimTracer  # noqa: E402

BATCH = 512  # the BatchSpanProcessor's default export batch
# sglang's meta_info with its metrics on (the keys the server span keeps)
SERVER_META = {"prompt_tokens": 128, "completion_tokens": 256, "cached_tokens": 0, "e2e_latency": 0.5,
               "queue_time": 0.02, "prefill_launch_latency": 0.01, "request_received_ts": 1.7e9,
               "prefill_finished_ts": 1.7e9 + 0.03}


class Timed:
    """A span processor's span ends, their CPU summed (``process_time`` around each)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.on_start_subjects = getattr(inner, "on_start_subjects", None)
        self.on_end_subjects = getattr(inner, "on_end_subjects", None)
        self.cpu_s = 0.0

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: Any) -> None:
        start = time.process_time()
        self.inner.on_end(span)
        self.cpu_s += time.process_time() - start

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.inner.shutdown()


class Nothing:
    """Reads the metrics processor's span ends and does nothing: what timing them costs."""

    on_start_subjects = SpanMetricsProcessor.on_start_subjects
    on_end_subjects = SpanMetricsProcessor.on_end_subjects

    def on_end(self, span: Any) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def run_trajectories(n: int, metrics: Any) -> List[Any]:
    """n single-turn trajectories through the events API, their ends through ``metrics``:
    their spans, as the SDK ended them."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(active_span_processor=(active := IsolatingSpanProcessor()))
    provider.add_span_processor(metrics)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # the spans otel_verl's own provider starts (bootstrap)
    if not tracing.use_provider(provider, settings.load({"OTEL_VERL_ENABLED": "1"}), SlimTracer(provider, active)):
        raise RuntimeError("the events API did not take the provider")
    for i in range(n):
        uid = f"6f1c3a0e-1111-2222-3333-{i:012x}"
        with events.trajectory(uid, f"{uid}_{i % 16}", step=1, agent_name="single_turn_agent", provider="sglang",
                               worker_index=0):
            with events.agent_run("SingleTurnAgentLoop"):
                with events.llm_call(list(range(128)), model="Qwen2.5-7B-Instruct", provider="sglang",
                                     request_id=f"req-{i}", max_tokens=256, temperature=1.0, top_p=1.0) as turn:
                    headers = turn.carrier()
                    with events.llm_server_call(headers, request_id=f"req-{i}", provider="sglang") as server:
                        server.record_meta(SERVER_META)
                    turn.finish(list(range(256)), stop_reason="stop", server_meta=dict(SERVER_META))
            with events.reward() as reward:
                reward.score(1.0)
    spans = list(exporter.get_finished_spans())
    provider.shutdown()
    tracing.stop()
    return spans


def metrics_cpu_us(n: int, rounds: int) -> Tuple[float, float, Any]:
    """otel_verl's metrics processor per trajectory (µs, less what timing its span ends
    costs): its own aggregation, the SDK's instruments; and the SDK's metrics of a run."""
    best = {"own": float("inf"), "sdk": float("inf"), "timing": float("inf")}
    for _ in range(rounds):
        reader = InMemoryMetricReader()
        for name, inner in (("own", SpanMetricsProcessor(lambda: [])), ("timing", Nothing()),
                            ("sdk", SpanMetricsProcessor(meter_provider=MeterProvider(metric_readers=[reader])))):
            timed = Timed(inner)
            run_trajectories(n, timed)
            best[name] = min(best[name], timed.cpu_s)
        metrics_data = reader.get_metrics_data()
    return ((best["own"] - best["timing"]) / n * 1e6, (best["sdk"] - best["timing"]) / n * 1e6, metrics_data)


def best_cpu_s(work: Callable[[], Any], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        work()
        best = min(best, time.process_time() - start)
    return best


def records_made(metrics_data: Any) -> int:
    """How many values the run recorded (histogram counts; counter increments)."""
    total = 0
    for resource_metrics in metrics_data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for point in metric.data.data_points:
                    total += getattr(point, "count", None) or int(getattr(point, "value", 0))
    return total


def one_record_us(rounds: int, n: int = 20000) -> float:
    """One histogram record with a GenAI record's attributes and an exemplar context."""
    meter = MeterProvider(metric_readers=[InMemoryMetricReader()]).get_meter("bench")
    histogram = meter.create_histogram("bench.duration", unit="s", explicit_bucket_boundaries_advisory=[0.01, 0.1, 1])
    attributes = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "sglang",
                  "gen_ai.request.model": "Qwen2.5-7B-Instruct"}
    context = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(1, 1, False, trace.TraceFlags(1))))

    def work() -> None:
        for _ in range(n):
            histogram.record(0.5, attributes, context=context)

    return best_cpu_s(work, rounds) / n * 1e6


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 trajectories, once: checks that it works")
    args = parser.parse_args(argv)
    n, rounds = (64, 1) if args.quick else (1024, 5)
    own_us, sdk_us, metrics_data = metrics_cpu_us(n, rounds)
    spans = run_trajectories(n, SpanMetricsProcessor(lambda: []))
    names = sorted({span.name for span in spans})
    attributes = sum(len(span.attributes) for span in spans) / n
    encode_us = best_cpu_s(lambda: [encode_spans(spans[i:i + BATCH]).SerializeToString()
                                    for i in range(0, len(spans), BATCH)], rounds) / n * 1e6
    records = records_made(metrics_data) / n
    record_us = one_record_us(rounds)
    print(f"opentelemetry-sdk {SDK_VERSION}, {n} single-turn trajectories, best of {rounds}")
    print(f"spans per trajectory: {len(spans) / n:.0f} ({', '.join(names)}), {attributes:.0f} attributes")
    print(f"OTLP protobuf encoding: {encode_us:.0f} us per trajectory")
    print(f"metric records: {records:.0f} per trajectory x {record_us:.1f} us = {records * record_us:.0f} us")
    print(f"the SDK's share per trajectory: {encode_us + records * record_us:.0f} us")
    print(f"otel_verl's metrics processor: {own_us:.1f} us per trajectory with its own aggregation, "
          f"{sdk_us:.1f} us into the SDK's instruments")
    return 0


if __name__ == "__main__":
    sys.exit(main())
