"""Metrics derived from the spans: a span processor recording them at span ends.

Data flows one way: the spans are the record, and these metrics are aggregates of them, so
they come from the span ends in the process that writes the other outputs (the export
process where a rollout worker offloads them). What is recorded, with which attributes, is
the "Metrics" section of ``docs/SPANS.md``. Attributes are the few low-cardinality ones a
dashboard groups by (stage, agent, model, tool, outcome); never a uid, traj_uid or step.

Their aggregation (:mod:`otel_verl.accelerated.metric_aggregation`) is built on the first span
end, with that span's resource (in an export process, the served process's), so the metrics
and the traces name the same service. It also observes otel_verl's own loss and failure
counters (:mod:`otel_verl.health`) at every collection, so a loss shows in the backend
while the run goes on; an export process adds those its traced process sent with its
latest flush.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from opentelemetry import metrics as metrics_api
from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import StatusCode

from otel_verl import health, semconv as sc, server_timing
from otel_verl.accelerated.metric_aggregation import Aggregation, PeriodicExport, sampled_span, unsupported
from otel_verl.deadline import Call, Deadline
from otel_verl.payload import payload_of
from otel_verl.semconv import Subject

METER_NAME = sc.INSTRUMENTATION_NAME

# --------------------------------------------------------------------------- names
STEP_DURATION = "verl.step.duration"
STAGE_DURATION = "verl.stage.duration"
TRAJECTORY_DURATION = "verl.trajectory.duration"
SAMPLES = "verl.samples"
LLM_OPERATION_DURATION = "gen_ai.client.operation.duration"  # GenAI metric conventions
LLM_TOKEN_USAGE = "gen_ai.client.token.usage"
SERVER_REQUEST_DURATION = "verl.llm.server.request.duration"
SERVER_QUEUE_DURATION = "verl.llm.server.queue.duration"
SERVER_PREFILL_DURATION = "verl.llm.server.prefill.duration"
SERVER_DECODE_DURATION = "verl.llm.server.decode.duration"
TOOL_DURATION = "verl.tool.duration"
REWARD_DURATION = "verl.reward.duration"
DROPPED = "otel_verl.dropped"
FAILURES = "otel_verl.failures"

GEN_AI_TOKEN_TYPE = "gen_ai.token.type"
OUTPUT_ATTRIBUTE = "otel_verl.output"  # on DROPPED: the output that lost items
WHERE_ATTRIBUTE = "otel_verl.where"  # on FAILURES: the place that failed

# Bucket boundaries the GenAI metric conventions advise.
GEN_AI_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
GEN_AI_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
# Trainer stages and steps last from milliseconds (adv) to an hour (a long generation).
STEP_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)
# Trajectories: a single turn takes a second, a multi-turn tool run many minutes.
TRAJECTORY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 240, 480, 900, 1800)

_PREFIX = sc.LLM_SERVER_META_PREFIX

ExportersFactory = Callable[[], List[Any]]


class SpanMetricsProcessor(SpanProcessor):
    """Records the metrics of ``docs/SPANS.md`` ("Metrics") at span ends into an
    :class:`~otel_verl.accelerated.metric_aggregation.Aggregation` exported to the metric
    exporters ``make_exporters`` builds (on the first span end: exporters that open files
    or connections are not built for a process that ends no span), through the SDK's
    ``MeterProvider`` where the environment asks what only it does or ``accelerated`` is
    false (``OTEL_VERL_ACCELERATED=false``), or into the user's ``meter_provider``
    (``VerlInstrumentor().instrument(meter_provider=...)``), which stays theirs to flush and
    shut down."""

    on_start_subjects: frozenset = frozenset()  # reads ends only
    finish_order = 1  # after the span outputs: the last collection has their losses
    writes_files = False  # (its file exporter writes at each collection, on a thread of its own)
    on_end_subjects = frozenset({
        Subject.STEP, Subject.STEP_STAGE, Subject.SAMPLE, Subject.TRAJECTORY, Subject.LLM_CALL,
        Subject.LLM_SERVER, Subject.TOOL, Subject.REWARD,
    })

    def __init__(self, make_exporters: Optional[ExportersFactory] = None, *, meter_provider: Any = None,
                 shutdown_timeout_s: float = 10.0, accelerated: bool = True) -> None:
        self.make_exporters = make_exporters
        self.shutdown_timeout_s = shutdown_timeout_s
        self.accelerated = accelerated
        self.users_provider = meter_provider
        # what this processor built and owns: a PeriodicExport, or the SDK's MeterProvider
        self.owned: Any = None
        self._instruments: Optional[_Instruments] = None
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ span ends

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        found = payload_of(span)
        if found is None:
            return
        record = _RECORDERS.get(found.subject)
        if record is None:
            return
        instruments = self._instruments or self._start(span)
        if instruments is not None:
            record(instruments, span, instruments.exemplar_of(span))

    def _start(self, span: ReadableSpan) -> Optional["_Instruments"]:
        with self._lock:
            if self._instruments is None and not self._closed:
                try:
                    self._instruments = _Instruments(*self._meter(span.resource))
                except Exception as exc:  # counted once; no metrics here rather than a failure per span
                    health.record_failure("metrics.start", exc)
                    self._closed = True
            return self._instruments

    def _meter(self, resource: Any) -> Tuple[Any, Callable[[ReadableSpan], Any]]:
        """The meter to record into, and what its records take as their exemplar's context."""
        if self.users_provider is not None:
            return self.users_provider.get_meter(METER_NAME), _exemplar_context
        exporters = self.make_exporters()
        # not the global provider: the span's resource, and flushed with the other outputs
        if not self.accelerated or unsupported():
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            self.owned = MeterProvider(metric_readers=[PeriodicExportingMetricReader(e) for e in exporters],
                                       resource=resource, shutdown_on_exit=False)
            return self.owned.get_meter(METER_NAME), _exemplar_context
        aggregation = Aggregation(resource, InstrumentationScope(METER_NAME))
        self.owned = PeriodicExport(aggregation, exporters)
        return aggregation, _sampled_span

    # ------------------------------------------------------------------ flush, shutdown

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        owned = self.owned
        if owned is None:
            return True
        return self._bounded(owned.force_flush, timeout_millis, "force_flush") is not False

    def checkpoint(self) -> Callable[[Optional[float]], bool]:
        return lambda timeout_s=None: True  # a flush of the export process waits for files only

    def pending(self) -> Dict[str, int]:
        return {}  # points, not items: a collection exports the whole of them

    def shutdown(self) -> None:
        """Exports the last collection and stops the exporters within ``shutdown_timeout_s``;
        a late exporter goes on in the background. (No ``timeout_millis``: the provider's
        IsolatingSpanProcessor then runs it beside the span outputs, within their common
        deadline, instead of before the OTLP spans, whose share a collector that does not
        answer would take.)"""
        with self._lock:
            self._closed = True
            owned, self.owned, self._instruments = self.owned, None, None
        if owned is not None:
            self._bounded(owned.shutdown, int(self.shutdown_timeout_s * 1000), "shutdown")

    def _bounded(self, method: Callable[..., Any], timeout_millis: int, name: str) -> Any:
        # the SDK's exporters may retry past the timeout they are given
        deadline = Deadline(timeout_millis / 1000)
        try:
            return Call(method, timeout_millis).result(deadline)
        except Exception as exc:  # Late included: the call goes on in the background
            health.record_failure(f"metrics.{name}", exc)
        return False


def _sampled_span(span: ReadableSpan) -> Any:
    return sampled_span(span.context)


def _exemplar_context(span: ReadableSpan) -> Any:
    """The span's own context, so that an exemplar names its trace (the processor runs
    where the span ended, often outside it, or in another process)."""
    return trace_api.set_span_in_context(trace_api.NonRecordingSpan(span.context))


# Each histogram: the _Instruments attribute it is, its name, unit, description and buckets.
_HISTOGRAMS = (
    ("step", STEP_DURATION, "s", "Duration of a training step", STEP_BUCKETS),
    ("stage", STAGE_DURATION, "s", "Duration of a training-step stage", STEP_BUCKETS),
    ("trajectory", TRAJECTORY_DURATION, "s", "Duration of one trajectory (agent run)", TRAJECTORY_BUCKETS),
    ("llm_duration", LLM_OPERATION_DURATION, "s", "GenAI operation duration", GEN_AI_DURATION_BUCKETS),
    ("llm_tokens", LLM_TOKEN_USAGE, "{token}", "Number of input and output tokens used", GEN_AI_TOKEN_BUCKETS),
    ("server_request", SERVER_REQUEST_DURATION, "s", "LLM server request duration (e2e latency)",
     GEN_AI_DURATION_BUCKETS),
    ("server_queue", SERVER_QUEUE_DURATION, "s", "LLM server queueing time of a request", GEN_AI_DURATION_BUCKETS),
    ("server_prefill", SERVER_PREFILL_DURATION, "s", "LLM server prefill time of a request",
     GEN_AI_DURATION_BUCKETS),
    ("server_decode", SERVER_DECODE_DURATION, "s", "LLM server decode time of a request", GEN_AI_DURATION_BUCKETS),
    ("tool", TOOL_DURATION, "s", "Duration of a tool execution", GEN_AI_DURATION_BUCKETS),
    ("reward", REWARD_DURATION, "s", "Duration of one trajectory's reward computation", GEN_AI_DURATION_BUCKETS),
)


class _Instruments:
    step: Any
    stage: Any
    trajectory: Any
    llm_duration: Any
    llm_tokens: Any
    server_request: Any
    server_queue: Any
    server_prefill: Any
    server_decode: Any
    tool: Any
    reward: Any

    def __init__(self, meter: metrics_api.Meter, exemplar_of: Callable[[ReadableSpan], Any]) -> None:
        self.exemplar_of = exemplar_of  # a span -> its records' context
        for attribute, name, unit, description, buckets in _HISTOGRAMS:
            setattr(self, attribute, meter.create_histogram(name, unit=unit, description=description,
                                                            explicit_bucket_boundaries_advisory=list(buckets)))
        self.samples = meter.create_counter(SAMPLES, unit="{sample}", description="Samples ended, by outcome")
        meter.create_observable_counter(DROPPED, [_observe_dropped], unit="{item}",
                                        description="Items otel_verl could not write, by output")
        meter.create_observable_counter(FAILURES, [_observe_failures], unit="{failure}",
                                        description="Exceptions otel_verl swallowed, by place")


def _observe_dropped(options: Any) -> Iterable[metrics_api.Observation]:
    counts = health.totals()["dropped"]
    return [metrics_api.Observation(n, {OUTPUT_ATTRIBUTE: name}) for name, n in counts.items()]


def _observe_failures(options: Any) -> Iterable[metrics_api.Observation]:
    counts = health.totals()["failures"]
    return [metrics_api.Observation(n, {WHERE_ATTRIBUTE: name}) for name, n in counts.items()]


# --------------------------------------------------------------------------- recorders


def _seconds(span: ReadableSpan) -> Optional[float]:
    if span.start_time is None or span.end_time is None:
        return None
    return max(0, span.end_time - span.start_time) / 1e9


def _pick(span: ReadableSpan, *keys: str) -> Dict[str, Any]:
    attrs = span.attributes or {}
    out = {key: attrs[key] for key in keys if key in attrs}
    status = span.status
    if status is not None and status.status_code is StatusCode.ERROR:
        out[sc.ERROR_TYPE] = attrs.get(sc.ERROR_TYPE) or "_OTHER"  # as the GenAI conventions say
    return out


def _record_step(m: _Instruments, span: ReadableSpan, ctx: Any) -> None:
    m.step.record(_seconds(span) or 0.0, _pick(span, sc.LAYOUT), context=ctx)


def _record_stage(m: _Instruments, span: ReadableSpan, ctx: Any) -> None:
    m.stage.record(_seconds(span) or 0.0, _pick(span, sc.STAGE, sc.LAYOUT), context=ctx)


def _record_sample(m: _Instruments, span: ReadableSpan, ctx: Any) -> None:
    m.samples.add(1, _pick(span, sc.SAMPLE_OUTCOME), context=ctx)


def _record_trajectory(m: _Instruments, span: ReadableSpan, ctx: Any) -> None:
    m.trajectory.record(_seconds(span) or 0.0, _pick(span, sc.GEN_AI_AGENT_NAME, sc.VALIDATE), context=ctx)


_GEN_AI_KEYS = (sc.GEN_AI_OPERATION_NAME, sc.GEN_AI_PROVIDER_NAME, sc.GEN_AI_REQUEST_MODEL)


def _record_llm_call(m: _Instruments, span: ReadableSpan, ctx: Any) -> None:
    attrs = _pick(span, *_GEN_AI_KEYS)
    m.llm_duration.record(_seconds(span) or 0.0, attrs, context=ctx)
    span_attrs = span.attributes or {}
    usage = {"input": span_attrs.get(sc.GEN_AI_USAGE_INPUT_TOKENS), "output": span_attrs.get(sc.GEN_AI_USAGE_OUTPUT_TOKENS)}
    attrs.pop(sc.ERROR_TYPE, None)  # the conventions give token usage no error.type
    for token_type, count in usage.items():
        count = server_timing.number(count)
        if count is not None and count >= 0:
            m.llm_tokens.record(count, {**attrs, GEN_AI_TOKEN_TYPE: token_type}, context=ctx)


def _record_llm_server(m: _Instruments, span: ReadableSpan, ctx: Any) -> None:
    attrs = _pick(span, sc.GEN_AI_PROVIDER_NAME)
    timing = server_timing.split(_ServerMeta(span.attributes or {}))  # the report's split too
    if timing is None:
        return
    for histogram, value in ((m.server_request, timing.e2e), (m.server_queue, timing.queue),
                             (m.server_prefill, timing.prefill), (m.server_decode, timing.decode)):
        if value is not None and value >= 0:
            histogram.record(value, attrs, context=ctx)


class _ServerMeta:
    """The engine's meta under its own key names, as a span's attributes hold it (what
    :func:`server_timing.split` reads: which keys mean what is its knowledge)."""

    __slots__ = ("attributes",)

    def __init__(self, attributes: Any) -> None:
        self.attributes = attributes

    def get(self, key: str, default: Any = None) -> Any:
        return self.attributes.get(_PREFIX + key, default)


def _record_tool(m: _Instruments, span: ReadableSpan, ctx: Any) -> None:
    m.tool.record(_seconds(span) or 0.0, _pick(span, sc.GEN_AI_TOOL_NAME), context=ctx)


def _record_reward(m: _Instruments, span: ReadableSpan, ctx: Any) -> None:
    m.reward.record(_seconds(span) or 0.0, _pick(span), context=ctx)


_RECORDERS: Dict[Subject, Callable[[_Instruments, ReadableSpan, Any], None]] = {
    Subject.STEP: _record_step,
    Subject.STEP_STAGE: _record_stage,
    Subject.SAMPLE: _record_sample,
    Subject.TRAJECTORY: _record_trajectory,
    Subject.LLM_CALL: _record_llm_call,
    Subject.LLM_SERVER: _record_llm_server,
    Subject.TOOL: _record_tool,
    Subject.REWARD: _record_reward,
}
