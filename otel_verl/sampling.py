"""Per-sample sampling, uid-derived ids, and counting what the OTLP path drops.

- :class:`UidIdGenerator` gives the next root span the ids derived from its uid (see
  :mod:`otel_verl.ids`), so a sample's trace id is the same in every process.
- :func:`record_dropped_samples` wraps the standard ``OTEL_TRACES_SAMPLER`` so that a
  span it would drop is still recorded (``RECORD_ONLY``): legacy processors see every
  span, while BatchSpanProcessor exports only sampled ones.
- :class:`DropCountingProcessor` counts spans the SDK's batch processor loses (queue
  full, still queued when its shutdown timed out) or its exporter fails to deliver: the
  SDK only logs those once.
- :class:`IsolatingSpanProcessor` is the provider's list of processors with each one's
  exceptions counted instead of raised: the SDK's ``SynchronousMultiSpanProcessor`` calls
  them in a row without catching, so one raising processor (ours or another library's)
  would reach the traced code and keep the processors after it from seeing the span.
"""

from __future__ import annotations

import contextvars
import random
from typing import Any, Optional, Sequence, Tuple

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, SynchronousMultiSpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    StaticSampler,
    TraceIdRatioBased,
    _get_from_env_or_default,
)
from opentelemetry.trace import INVALID_SPAN_ID

from otel_verl import health
from otel_verl.lean_span import RECORD_ATTR
from otel_verl.record import record_of

_random_bits = random.getrandbits
_next_ids: contextvars.ContextVar[Optional[Tuple[int, int]]] = contextvars.ContextVar("otel_verl_next_ids", default=None)


class UidIdGenerator(RandomIdGenerator):
    """Random ids, except for the one root span announced with :meth:`next_ids`."""

    def next_ids(self, trace_id: int, span_id: int) -> None:
        _next_ids.set((trace_id, span_id))

    def generate_trace_id(self) -> int:
        ids = _next_ids.get()
        return ids[0] if ids is not None else super().generate_trace_id()

    def generate_span_id(self) -> int:
        ids = _next_ids.get()
        if ids is not None:
            _next_ids.set(None)  # the root's span id is used once; its children get random ids
            return ids[1]
        span_id = _random_bits(64)  # as RandomIdGenerator (its random module), one call less a span
        return span_id if span_id != INVALID_SPAN_ID else super().generate_span_id()

    def is_trace_id_random(self) -> bool:
        return False


_MASK_64 = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15F39CC0605CEDC835  # odd 128-bit constant (golden ratio based)


def mixed_trace_id(trace_id: int) -> int:
    """The trace id as ratio samplers should see it.

    ``TraceIdRatioBased`` compares the low 64 bits with a bound, assuming they are
    uniformly random. A uid's UUID4 bits are not: the variant bits sit at the top of the
    low half, so a 0.5 ratio would keep nothing. A multiplicative hash spreads all 128
    bits over the low half (random ids stay uniform) and is the same in every process.
    """
    return ((trace_id * _MIX) >> 64) & _MASK_64


class RecordDroppedSamples(Sampler):
    """``inner``'s decision on the mixed trace id, with DROP turned into RECORD_ONLY."""

    def __init__(self, inner: Sampler) -> None:
        self._inner = inner
        # Whether a span started under a recording local parent gets the parent's
        # sampled flag and trace state: true of every sampler OTEL_TRACES_SAMPLER names
        # (parent-based ones by their defaults for local parents, the others decide on
        # the trace id alone), so lean spans may skip asking (otel_verl.lean_span).
        self.follows_local_parent = _follows_local_parent(inner)
        # The same for a remote parent (a carrier's context): only a parent-based sampler
        # whose remote delegates are its defaults gives the parent's decision.
        self.follows_remote_parent = _follows_remote_parent(inner)

    def is_sampled(self, trace_id: int) -> bool:
        """The root decision for a trace (used where a parent must be synthesised)."""
        result = self._inner.should_sample(None, mixed_trace_id(trace_id), "verl.sample")
        return result.decision.is_sampled()

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
        result = self._inner.should_sample(parent_context, mixed_trace_id(trace_id), name, kind, attributes, links, trace_state)
        if result.decision is Decision.DROP:
            # A dropping sampler returns no attributes, and the SDK gives a span the
            # sampler's attributes: hand the caller's back so legacy outputs keep them.
            return SamplingResult(Decision.RECORD_ONLY, attributes, result.trace_state)
        return result

    def get_description(self) -> str:
        return f"RecordDroppedSamples{{{self._inner.get_description()}}}"


def _follows_local_parent(sampler: Sampler) -> bool:
    if isinstance(sampler, ParentBased):
        return (getattr(sampler, "_local_parent_sampled", None) is ALWAYS_ON
                and getattr(sampler, "_local_parent_not_sampled", None) is ALWAYS_OFF)
    return type(sampler) in (StaticSampler, TraceIdRatioBased)


def _follows_remote_parent(sampler: Sampler) -> bool:
    return (isinstance(sampler, ParentBased)
            and getattr(sampler, "_remote_parent_sampled", None) is ALWAYS_ON
            and getattr(sampler, "_remote_parent_not_sampled", None) is ALWAYS_OFF)


def record_dropped_samples(inner: Optional[Sampler] = None) -> Sampler:
    return RecordDroppedSamples(inner if inner is not None else _get_from_env_or_default())


class _CountingExporter(SpanExporter):
    def __init__(self, exporter: SpanExporter, output: str) -> None:
        self._exporter = exporter
        self._output = output
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        failed: Any = None
        try:
            result = self._exporter.export(spans)
            # an exporter that sends a batch as several requests says how many spans failed
            failed = getattr(self._exporter, "failed_spans", None)
        except Exception as exc:
            health.record_failure(f"{self._output}.export", exc)
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            failed = 0
        else:
            if type(failed) is not int or not 0 < failed <= len(spans):
                failed = len(spans)
            health.record_dropped(self._output, failed, "export failed (endpoint down, refusing or unreachable?)")
        self.exported += len(spans) - failed
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        flush = getattr(self._exporter, "force_flush", None)
        return flush(timeout_millis) if flush is not None else True


class DropCountingProcessor(SpanProcessor):
    """A BatchSpanProcessor whose losses are counted in :mod:`otel_verl.health`."""

    def __init__(self, batch_processor: Any, output: str) -> None:
        self._bsp = batch_processor
        self._output = output
        if type(batch_processor) is BatchSpanProcessor:  # whose on_start does nothing
            self.on_start_kinds = frozenset()
        self._leftover_counted = False
        inner = getattr(batch_processor, "_batch_processor", None)
        # SDK 1.45 internals (opentelemetry/sdk/_shared_internal BatchProcessor): the
        # queue is a deque whose oldest entry is discarded when full.
        self._queue = getattr(inner, "_queue", None)
        self._max = getattr(inner, "_max_queue_size", None)
        exporter = getattr(inner, "_exporter", None)
        if exporter is not None:
            self.exporter = _CountingExporter(exporter, output)
            inner._exporter = self.exporter

    def on_start(self, span, parent_context=None) -> None:
        self._bsp.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        if self._queue is not None and span.context.trace_flags.sampled and len(self._queue) == self._max:
            health.record_dropped(self._output, 1, "span queue full (OTEL_BSP_MAX_QUEUE_SIZE)")
        self._bsp.on_end(span)

    def shutdown(self) -> None:
        self._bsp.shutdown()
        # The SDK gives up after its shutdown timeout: whatever is still queued is lost.
        if self._queue is not None and not self._leftover_counted:
            self._leftover_counted = True
            health.record_dropped(self._output, len(self._queue), "not exported before the shutdown timeout")

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._bsp.force_flush(timeout_millis)


class IsolatingSpanProcessor(SynchronousMultiSpanProcessor):
    """Calls every processor in turn; a processor's exception is counted under
    ``span_processor.{Class}.{method}`` and never reaches the span's caller or the
    processors after it.

    A processor may say which spans it reads (``on_start_kinds`` / ``on_end_kinds``: the
    :class:`~otel_verl.semconv.Kind` of the span's record, ``None`` for every span); it is
    not called for the others. A rollout worker's LLM, tool and reward spans then reach
    only the processors that write something for them."""

    def __init__(self) -> None:
        super().__init__()
        self._on_start: Tuple[Tuple[Any, Any], ...] = ()
        self._on_end: Tuple[Tuple[Any, Any], ...] = ()
        self._sole_on_start: Optional[SpanProcessor] = None
        self._sole_start_kinds: Any = frozenset()
        self._sole_on_end: Optional[SpanProcessor] = None
        self._on_ending_processors: Tuple[Any, ...] = ()
        self.calls_on_ending = False

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        processors = self._span_processors
        self._on_start = _routes(processors, "on_start_kinds")
        self._on_end = _routes(processors, "on_end_kinds")
        # one processor that reads every ending span (a rollout worker's export process):
        # no record to look up per span; one that reads starting spans of the events API
        # (only): no loop over the routes
        self._sole_on_end = self._on_end[0][0] if len(self._on_end) == 1 and self._on_end[0][1] is None else None
        starts = self._on_start
        sole_start = len(starts) == 1 and starts[0][1] is not None
        self._sole_on_start, self._sole_start_kinds = starts[0] if sole_start else (None, frozenset())
        self._on_ending_processors = tuple(
            sp for sp in processors if getattr(type(sp), "_on_ending", None) is not SpanProcessor._on_ending
        )
        self.calls_on_ending = bool(self._on_ending_processors)  # read by LeanSpan.end

    def on_start(self, span, parent_context=None) -> None:
        record = getattr(span, RECORD_ATTR, None)  # (inline: twice per span of a rollout worker)
        sole = self._sole_on_start
        if sole is not None and record is not None:
            if record.kind in self._sole_start_kinds:
                try:
                    sole.on_start(span, parent_context=parent_context)
                except Exception as exc:
                    _processor_failed(sole, "on_start", exc)
            return
        kind = record.kind if record is not None else _record_kind(span)
        for sp, kinds in self._on_start:
            if kinds is None or kind in kinds:
                try:
                    sp.on_start(span, parent_context=parent_context)
                except Exception as exc:
                    _processor_failed(sp, "on_start", exc)

    def _on_ending(self, span) -> None:
        for sp in self._on_ending_processors:
            try:
                sp._on_ending(span)  # pylint: disable=protected-access
            except Exception as exc:
                _processor_failed(sp, "on_ending", exc)

    def on_end(self, span: ReadableSpan) -> None:
        sole = self._sole_on_end
        if sole is not None:
            try:
                sole.on_end(span)
            except Exception as exc:
                _processor_failed(sole, "on_end", exc)
            return
        record = getattr(span, RECORD_ATTR, None)
        kind = record.kind if record is not None else _record_kind(span)
        for sp, kinds in self._on_end:
            if kinds is None or kind in kinds:
                try:
                    sp.on_end(span)
                except Exception as exc:
                    _processor_failed(sp, "on_end", exc)

    def shutdown(self) -> None:
        for sp in self._span_processors:
            try:
                sp.shutdown()
            except Exception as exc:
                _processor_failed(sp, "shutdown", exc)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        import time

        deadline_ns = time.time_ns() + timeout_millis * 1_000_000
        flushed = True
        for sp in self._span_processors:
            left_ms = (deadline_ns - time.time_ns()) // 1_000_000
            if left_ms <= 0:
                return False
            try:
                if sp.force_flush(left_ms) is False:
                    flushed = False
            except Exception as exc:
                _processor_failed(sp, "force_flush", exc)
                flushed = False
        return flushed


def _routes(processors: Sequence[Any], attribute: str) -> Tuple[Tuple[Any, Any], ...]:
    routes = ((sp, getattr(sp, attribute, None)) for sp in processors)
    return tuple((sp, kinds) for sp, kinds in routes if kinds is None or kinds)


def _record_kind(span: Any) -> Any:
    record = record_of(span)
    return record.kind if record is not None else None


def _processor_failed(processor: Any, method: str, exc: BaseException) -> None:
    health.record_failure(f"span_processor.{type(processor).__name__}.{method}", exc)
