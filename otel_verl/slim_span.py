"""A span type of otel_verl's own, for the events API when otel_verl built the TracerProvider.

A rollout worker starts a span per LLM turn, tool call and trajectory on its event loop,
with a thousand or more trajectories in flight. The SDK's span holds about twelve objects
the cyclic GC tracks (locks, bounded attribute and event containers) and cleans every
attribute through abstract-base checks; with that many spans open, full collections over
the whole worker heap come several times a step (see docs/PERFORMANCE.md). A
:class:`SlimSpan` keeps its attributes in one dict and allocates nothing else it need not.

It is a whole implementation of the API's :class:`opentelemetry.trace.Span`. Span
processors get the :class:`SlimSpan` itself in ``on_start`` (it reads like a
``ReadableSpan``) and, in ``on_end``, its :class:`~otel_verl.record.SpanRecord`, which
reads like one too and which the OTLP encoder and the other outputs take as it is.
The tracer is only used with a provider otel_verl configured: it needs the provider's
span processor, which the provider does not hand out. A provider someone else built gets
the SDK's own spans (see :func:`otel_verl.instrumentation.tracing.use_provider`).
"""

from __future__ import annotations

import contextlib
import operator
import traceback
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Optional, Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import SpanLimits
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from otel_verl import health
from otel_verl.clock import anchored_ns, offset_ns
from otel_verl.ids import well_formed
from otel_verl.record import EventRecord, SpanRecord, link_record
from otel_verl.semconv import INSTRUMENTATION_NAME
from otel_verl.version import __version__

# W3C Trace Context level 2: the trace id is random (the SDK sets it from 1.39 on)
_RANDOM = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)
# shared: a TraceFlags per span would be one more object for the GC
_FLAGS = {bits: TraceFlags(bits) for bits in (0, TraceFlags.SAMPLED, _RANDOM, TraceFlags.SAMPLED | _RANDOM)}
_UNSET = Status(StatusCode.UNSET)
_NUMBERS = frozenset((bool, int, float))
_SCALARS = (str, bool, int, float)


class SlimTracer(trace.Tracer):
    """Starts :class:`SlimSpan` s with a provider's resource, sampler and id generator,
    and hands them to ``span_processor`` (the provider's active span processor)."""

    def __init__(self, provider: Any, span_processor: Any, limits: Optional[SpanLimits] = None) -> None:
        self.resource = provider.resource
        self.sampler = provider.sampler
        self.ids = provider.id_generator
        self.processor = span_processor
        self.scope = InstrumentationScope(INSTRUMENTATION_NAME, __version__)
        self.limits = limits if limits is not None else SpanLimits()  # OTEL_SPAN_*_LIMIT as the SDK reads them

    def start_span(
        self,
        name: str,
        context: Any = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Any = None,
        links: Optional[Sequence[Link]] = None,
        start_time: Optional[int] = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        parent = trace.get_current_span(context).get_span_context()
        if parent.is_valid:
            trace_id, random = parent.trace_id, parent.trace_flags & _RANDOM
        else:
            parent, trace_id = None, self.ids.generate_trace_id()
            random = _RANDOM if _RANDOM and self.ids.is_trace_id_random() else 0
        links = tuple(links) if links else ()
        sampled = self.sampler.should_sample(context, trace_id, name, kind, attributes, links)
        decision = sampled.decision
        flags = _FLAGS[(TraceFlags.SAMPLED if decision.is_sampled() else 0) | random]
        span_context = SpanContext(trace_id, self.ids.generate_span_id(), False, flags, sampled.trace_state)
        if not decision.is_recording():
            return trace.NonRecordingSpan(span_context)
        offset = offset_ns()
        span = SlimSpan(self, name, span_context, parent, kind, links, start_time or anchored_ns(offset),
                        record_exception, set_status_on_exception, offset)
        if sampled.attributes:
            span.set_attributes(sampled.attributes)
        self.processor.on_start(span, parent_context=context)
        return span

    @contextlib.contextmanager
    def start_as_current_span(
        self,
        name: str,
        context: Any = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Any = None,
        links: Optional[Sequence[Link]] = None,
        start_time: Optional[int] = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[trace.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time, record_exception,
                               set_status_on_exception)
        with trace.use_span(span, end_on_exit=end_on_exit, record_exception=record_exception,
                            set_status_on_exception=set_status_on_exception) as current:
            yield current


def _otlp_value(value: Any, max_length: Optional[int]) -> Any:
    """``value`` as an OTLP attribute can carry it: subclasses of str, bool, int, float as
    they are, sequences of those as a tuple, ``None`` for nothing, anything else as its
    text (as the SDK does)."""
    if isinstance(value, str):
        return well_formed(value if max_length is None or len(value) <= max_length else value[:max_length])
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        # the common case (a stage's traj_uids) without a call per item; an ASCII text
        # holds no lone surrogate (see well_formed)
        if all(type(item) is str and item.isascii() and (max_length is None or len(item) <= max_length)
               for item in value):
            return tuple(value)
        items = tuple(_otlp_value(item, max_length) for item in value)
        return items if None not in items else None
    return None if value is None else str(value)


def _reads(field: str) -> property:
    """A read-only property of the field ``field``, as ``ReadableSpan`` has them."""
    return property(operator.attrgetter(field))


class SlimSpan(trace.Span):
    """A recording span of :class:`SlimTracer`. Attribute values are kept as OTLP can carry
    them: strings (cut at the span limit), bools, ints, floats, and sequences of those.
    It takes no lock: the events API changes and ends each span from one place at a time.
    Its end and events are timed from its start by the monotonic clock (``otel_verl.clock``):
    a jump of the system clock while it is open changes no duration."""

    __slots__ = ("_tracer", "_name", "_context", "_parent", "_kind", "_attributes", "_events", "_links",
                 "_status", "_start_time", "_end_time", "_record_exception", "_set_status_on_exception", "payload",
                 "_clock_offset")

    def __init__(self, tracer: SlimTracer, name: str, context: SpanContext, parent: Optional[SpanContext],
                 kind: SpanKind, links: Sequence[Link], start_time: int, record_exception: bool = True,
                 set_status_on_exception: bool = True, clock_offset: Optional[int] = None) -> None:
        self._tracer = tracer
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._attributes: dict = {}
        self._events: Any = ()
        max_links = tracer.limits.max_links
        if max_links is not None and len(links) > max_links:
            health.record_dropped("span_links", len(links) - max_links, "OTEL_SPAN_LINK_COUNT_LIMIT")
            links = links[:max_links]
        self._links = links
        self._status = _UNSET
        self._start_time = start_time
        self._end_time: Optional[int] = None
        self._record_exception = record_exception
        self._set_status_on_exception = set_status_on_exception
        # epoch ns = monotonic ns + this, from the span's start on
        self._clock_offset = clock_offset if clock_offset is not None else offset_ns()
        self.payload: Any = None  # set by otel_verl.payload.start_span; the record carries it

    # ------------------------------------------------------------------ the API's Span

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attribute(self, key: str, value: Any) -> None:
        self._set(((key, value),))

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self._set(attributes.items())

    def _set(self, items: Any) -> None:
        # One loop for all of a span's attributes: a method call per attribute would cost
        # more than storing it.
        if self._end_time is not None:
            return
        attributes, limits = self._attributes, self._tracer.limits
        max_count, max_length = limits.max_span_attributes, limits.max_span_attribute_length
        for key, value in items:
            if type(value) is str:
                if max_length is not None and len(value) > max_length:
                    value = value[:max_length]
                if not value.isascii():  # (constant time) a lone surrogate would fail its batch
                    value = well_formed(value)
            elif type(value) not in _NUMBERS:
                value = _otlp_value(value, max_length)
                if value is None:
                    continue
            if max_count is not None and len(attributes) >= max_count and key not in attributes:
                health.record_dropped("span_attributes", 1, "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT")
                continue
            attributes[key] = value

    def add_event(self, name: str, attributes: Any = None, timestamp: Optional[int] = None) -> None:
        if self._end_time is not None:
            return
        limit = self._tracer.limits.max_events
        if limit is not None and len(self._events) >= limit:
            health.record_dropped("span_events", 1, "OTEL_SPAN_EVENT_COUNT_LIMIT")
            return
        if attributes:
            attributes = {key: well_formed(value) if type(value) is str and not value.isascii() else value
                          for key, value in attributes.items()}
        event = EventRecord(name, timestamp or anchored_ns(self._clock_offset), attributes or {})
        self._events = (*self._events, event)

    def add_link(self, context: SpanContext, attributes: Any = None) -> None:
        if self._end_time is not None or not context.is_valid:
            return
        limit = self._tracer.limits.max_links
        if limit is not None and len(self._links) >= limit:
            health.record_dropped("span_links", 1, "OTEL_SPAN_LINK_COUNT_LIMIT")
            return
        self._links = (*self._links, Link(context, attributes))

    def update_name(self, name: str) -> None:
        if self._end_time is None:
            self._name = name

    def set_status(self, status: Any, description: Optional[str] = None) -> None:
        if self._end_time is not None or self._status.status_code is StatusCode.OK:
            return  # OK is final, as the specification says
        if not isinstance(status, Status):
            status = Status(status, description)
        if status.description and not status.description.isascii():
            status = Status(status.status_code, well_formed(status.description))
        if status.status_code is not StatusCode.UNSET:
            self._status = status

    def record_exception(self, exception: BaseException, attributes: Any = None, timestamp: Optional[int] = None,
                         escaped: bool = False) -> None:
        event = {
            "exception.type": type(exception).__name__,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(type(exception), exception,
                                                                      exception.__traceback__)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            event.update(attributes)
        self.add_event("exception", event, timestamp)

    def end(self, end_time: Optional[int] = None) -> None:
        if self._end_time is not None:
            return
        self._end_time = end_time or anchored_ns(self._clock_offset)
        tracer, context, parent, status = self._tracer, self._context, self._parent, self._status
        # the span's one record: what every output reads, as it is (otel_verl.record)
        tracer.processor.on_end(SpanRecord(
            self._name, context.trace_id, context.span_id, context.trace_flags, context.trace_state or None,
            parent.span_id if parent is not None else 0, parent is not None and parent.is_remote, self._kind,
            self._start_time, self._end_time, self._attributes, self._events,
            tuple(map(link_record, self._links)) if self._links else (), status.status_code, status.description,
            resource=tracer.resource, scope=tracer.scope, payload=self.payload,
        ))

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None and self.is_recording():
            if self._record_exception:
                self.record_exception(exc, escaped=True)
            if self._set_status_on_exception:
                self.set_status(Status(StatusCode.ERROR, f"{exc_type.__name__}: {exc}"))
        super().__exit__(exc_type, exc, tb)

    # ------------------------------------------------------------------ read like a ReadableSpan (on_start)

    name = _reads("_name")
    context = _reads("_context")
    parent = _reads("_parent")
    kind = _reads("_kind")
    events = _reads("_events")
    links = _reads("_links")
    status = _reads("_status")
    start_time = _reads("_start_time")
    end_time = _reads("_end_time")

    @property
    def attributes(self) -> Mapping[str, Any]:
        return MappingProxyType(self._attributes)

    # What a limit dropped is counted in otel_verl's health counters, not on the span.
    dropped_attributes = dropped_events = dropped_links = 0

    @property
    def resource(self) -> Any:
        return self._tracer.resource

    @property
    def instrumentation_scope(self) -> Any:
        return self._tracer.scope
