"""The spans the events API starts: the SDK's span model without its per-span costs.

An SDK span validates every attribute on the way in (``BoundedAttributes``), takes a lock
for each call and copies itself into a fresh ``ReadableSpan`` when it ends: ~60-100 µs a
span of a rollout worker (10-20 attributes), several spans per trajectory, on the agent
loop's event loop. The events API already bounds what it records (our own keys, str /
bool / int / float values and tuples of str), so :class:`LeanSpan` keeps its
attributes in a plain dict, ends once under one shared lock, and hands *itself* to the
span processors as the finished ``ReadableSpan`` (it accepts no change once ended).

Everything else is the SDK's: ids from the provider's id generator, the provider's
sampler decides (parent-based flags, trace state), the provider's resource, scope and
span processors, the ``opentelemetry.trace.Span`` API for code that finds the span in
the context. Attributes set through that public API (another library, user code) go
through the SDK's validation (``BoundedAttributes`` with the provider's limits) like on
an SDK span.

A tracer has a :class:`Starter` (:func:`starter`) only where lean spans are exactly
equivalent: not for a tracer that is not the SDK's, or span limits that cut attribute
values (``record.start_span`` then uses ``tracer.start_span``).
:func:`emit_finished` hands over a span that is already over (a batch stage reported per
uid) without the live-span part at all.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from types import MappingProxyType
from typing import Any, Dict, Mapping, Optional, Sequence

from opentelemetry import trace as trace_api
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from otel_verl import current_span

logger = logging.getLogger("otel_verl")

RECORD_ATTR = "_otel_verl_record"  # where a span carries its record (otel_verl.record; LeanSpan sets it by name)
_UNSET = Status(StatusCode.UNSET)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_RANDOM_TRACE_ID = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)  # SDK >= 1.39
_KNOWN_FLAGS = TraceFlags.SAMPLED | _RANDOM_TRACE_ID
_MAX_SPAN_ID = (1 << 64) - 1
_new_context = tuple.__new__  # a SpanContext is a tuple
_new_span = object.__new__
# Ending is the one transition two threads may race for (a sample root ended by the
# trainer thread and by the registry's bound): one lock for all spans, held for a check.
_END_LOCK = threading.Lock()
_now_ns = time.time_ns  # the span clock (tests set it)


def _new_end_lock_in_child() -> None:
    global _END_LOCK
    _END_LOCK = threading.Lock()  # another thread may have held it at fork time


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_end_lock_in_child)


class LeanSpan(trace_api.Span, ReadableSpan):
    """A recording span started by :meth:`Starter.start` (which sets ReadableSpan's
    fields itself: a constructor call costs more than they do); see the module docs."""

    # ReadableSpan's fields that every lean span starts with the same value of: class
    # attributes, shadowed by the span's own once it sets one (seven stores less a span)
    _instrumentation_info = None
    _end_time: Optional[int] = None
    _events: Sequence[Event] = ()  # a list from the first event on (most spans have none)
    _status = _UNSET
    _dropped_events = 0
    _dropped_links = 0
    _attributes_view: Optional[Mapping[str, Any]] = None

    @property
    def attributes(self) -> Mapping[str, Any]:
        # A live read-only view made once: every span processor reads it, and the SDK's
        # ReadableSpan makes a new one for each read.
        view = self._attributes_view
        if view is None:
            view = self._attributes_view = MappingProxyType(self._attributes)
        return view

    @property
    def dropped_attributes(self) -> int:
        # the SDK's asks isinstance(..., BoundedAttributes), an ABC check, per read (the
        # OTLP encoding reads it for every span); ours is a plain dict until other code
        # sets an attribute
        attrs = self._attributes
        return 0 if type(attrs) is dict else attrs.dropped

    @property
    def dropped_events(self) -> int:
        return self._dropped_events

    @property
    def dropped_links(self) -> int:
        return self._dropped_links

    # ------------------------------------------------------------------ the events API's side

    def set_trusted(self, key: str, value: Any) -> None:
        """An attribute the events API has already bounded (no validation while the
        count limit is far; at the limit the SDK's rules apply)."""
        if self._end_time is not None:
            return
        attrs = self._attributes
        if type(attrs) is dict and len(attrs) < self._limits.max_span_attributes:
            attrs[key] = value
        else:
            self._validated()[key] = value

    def set_trusted_many(self, attributes: Mapping[str, Any]) -> None:
        """:meth:`set_trusted` for several attributes at once."""
        if self._end_time is not None:
            return
        attrs = self._attributes
        if type(attrs) is dict and len(attrs) + len(attributes) <= self._limits.max_span_attributes:
            attrs.update(attributes)
        else:
            validated = self._validated()
            for key, value in attributes.items():
                validated[key] = value

    # ------------------------------------------------------------------ opentelemetry.trace.Span

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attribute(self, key: str, value: Any) -> None:
        if self._end_time is not None:
            logger.warning("Setting attribute on ended span.")
            return
        self._validated()[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self._end_time is not None:
            logger.warning("Setting attribute on ended span.")
            return
        validated = self._validated()
        for key, value in attributes.items():
            validated[key] = value

    def _validated(self) -> BoundedAttributes:
        # Code other than the events API sets an attribute: from now on every value goes
        # through the SDK's checks and limits (the events API's own are kept as they are).
        attrs = self._attributes
        if not isinstance(attrs, BoundedAttributes):
            limits = self._limits
            attrs = BoundedAttributes(limits.max_span_attributes, attrs, immutable=False,
                                      max_value_len=limits.max_span_attribute_length)
            self._attributes = attrs
            self._attributes_view = None
        return attrs

    def add_event(self, name: str, attributes: Any = None, timestamp: Optional[int] = None) -> None:
        if self._end_time is not None:
            logger.warning("Tried calling add_event on an ended span.")
            return
        limits, events = self._limits, self._events
        if type(events) is not list:
            events = self._events = list(events)
        if len(events) >= limits.max_events:  # as the SDK: the newest are kept
            self._dropped_events += 1
            if not events:
                return
            del events[0]
        attributes = BoundedAttributes(limits.max_event_attributes, attributes,
                                       max_value_len=limits.max_attribute_length, immutable=True)
        events.append(Event(name, attributes, timestamp if timestamp is not None else _now_ns()))

    def add_link(self, context: SpanContext, attributes: Any = None) -> None:
        if self._end_time is not None or not _valid_link(context, attributes):
            return
        links = tuple(self._links)
        if len(links) >= self._limits.max_links:  # as the SDK: the newest are kept
            self._dropped_links += 1
            if not links:
                return
            links = links[1:]
        attributes = BoundedAttributes(self._limits.max_link_attributes, attributes,
                                       max_value_len=self._limits.max_attribute_length, immutable=True)
        self._links = links + (Link(context, attributes),)

    def update_name(self, name: str) -> None:
        if self._end_time is None:
            self._name = name

    def set_status(self, status: Any, description: Optional[str] = None) -> None:
        if self._end_time is not None:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if self._status.status_code is StatusCode.OK or status.status_code is StatusCode.UNSET:
            return  # as the SDK: OK is final, UNSET changes nothing
        self._status = status

    def record_exception(
        self, exception: BaseException, attributes: Any = None, timestamp: Optional[int] = None, escaped: bool = False
    ) -> None:
        module, qualname = type(exception).__module__, type(exception).__qualname__
        attrs = {
            "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            attrs.update(attributes)
        self.add_event("exception", attrs, timestamp)

    def end(self, end_time: Optional[int] = None) -> None:
        with _END_LOCK:
            if self._end_time is not None:
                return
            self._end_time = end_time if end_time is not None else _now_ns()
        processor = self._processor
        # SDK >= 1.39: _on_ending before on_end, as Span.end() does (unless the processor
        # says none of its processors has one: otel_verl.sampling.IsolatingSpanProcessor)
        on_ending = getattr(processor, "_on_ending", None) if getattr(processor, "calls_on_ending", True) else None
        if on_ending is not None:
            on_ending(self)
        processor.on_end(self)  # ended: nothing changes it any more, so it is its own ReadableSpan

    def __repr__(self) -> str:
        return f'LeanSpan(name="{self._name}", context={self._context})'


class Starter:
    """Starts :class:`LeanSpan` s of one SDK tracer (see :func:`starter`): what a start
    reads of the tracer besides its enabled flag, read once."""

    def __init__(self, tracer: Any) -> None:
        self.scope = tracer._instrumentation_scope
        self.resource = tracer.resource
        self.limits = tracer._span_limits
        self.processor = tracer.span_processor
        self.sampler = sampler = tracer.sampler
        self.ids = tracer.id_generator
        self._new_span_id = tracer.id_generator.generate_span_id
        is_enabled = getattr(tracer, "_is_enabled", None)
        self._is_enabled = is_enabled if is_enabled is not None else _always
        # the sampler gives the parent's decision (see otel_verl.sampling)
        self._follows_local = bool(getattr(sampler, "follows_local_parent", False))
        self._follows_remote = bool(getattr(sampler, "follows_remote_parent", False))

    def start(
        self,
        name: str,
        record: Any,
        context: Any = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Optional[Dict[str, Any]] = None,
        links: Sequence[Link] = (),
    ) -> Any:
        """A :class:`LeanSpan` carrying ``record`` (``attributes`` is taken over, not
        copied: the caller builds it for this span), or a ``NonRecordingSpan`` where
        the tracer is off or its sampler drops the span."""
        parent_span = current_span.of(context)
        if type(parent_span) is LeanSpan:
            parent = parent_span._context
            follows = self._follows_local
        else:
            parent = parent_span.get_span_context()
            # A SpanContext is a tuple (trace_id, span_id, is_remote, trace_flags, trace_state, is_valid).
            follows = parent[2] and parent[5] and self._follows_remote
        if not self._is_enabled():
            return trace_api.NonRecordingSpan(parent)
        if attributes is None:
            attributes = {}
        if follows:
            # the sampler would give the parent's decision; a remote parent's flags may
            # carry bits the SDK would not pass on
            flags = parent[3]
            if flags & ~_KNOWN_FLAGS:
                flags = TraceFlags(flags & _KNOWN_FLAGS)
            span_id = self._new_span_id()
            # SpanContext.__new__'s checks, done here: the parent's trace id is valid, its
            # flags and trace state are the SDK's types
            span_context = _new_context(SpanContext, (parent[0], span_id, False, flags, parent[4], 0 < span_id <= _MAX_SPAN_ID))
        else:
            sampled = self._sampled(name, context, parent, kind, attributes, links)
            if type(sampled) is not tuple:
                return sampled  # a NonRecordingSpan
            parent, span_context, attributes = sampled
        dropped_links = 0
        if links:
            links = tuple(link for link in links if link and _valid_link(link.context, link.attributes))
            max_links = self.limits.max_links
            if len(links) > max_links:  # as the SDK: the last ones kept, the others counted
                dropped_links = len(links) - max_links
                links = links[dropped_links:]
        span = _new_span(LeanSpan)
        span._name = name
        span._context = span_context
        span._kind = kind
        span._instrumentation_scope = self.scope
        span._parent = parent
        span._start_time = _now_ns()
        span._attributes = attributes
        span._links = links
        span._resource = self.resource
        span._limits = self.limits
        span._processor = self.processor
        span._otel_verl_record = record  # (RECORD_ATTR)
        if dropped_links:
            span._dropped_links = dropped_links
        self.processor.on_start(span, parent_context=context)
        return span

    def _sampled(self, name: str, context: Any, parent: SpanContext, kind: SpanKind, attributes: Dict[str, Any],
                 links: Sequence[Link]) -> Any:
        """The sampler's decision, as ``tracer.start_span`` takes it: ``(parent or None,
        the span's context, its attributes)``, or a ``NonRecordingSpan``."""
        ids = self.ids
        if parent is None or not parent.is_valid:
            parent = None
            trace_id = ids.generate_trace_id()
        else:
            trace_id = parent.trace_id
        result = self.sampler.should_sample(context, trace_id, name, kind, attributes, links)
        flags = _SAMPLED if result.decision.is_sampled() else _NOT_SAMPLED
        if _RANDOM_TRACE_ID and (ids.is_trace_id_random() if parent is None else parent.trace_flags.random_trace_id):
            flags = TraceFlags(flags | _RANDOM_TRACE_ID)
        span_context = SpanContext(trace_id, ids.generate_span_id(), False, flags, result.trace_state)
        if not result.decision.is_recording():
            return trace_api.NonRecordingSpan(span_context)
        if result.attributes is not None and len(result.attributes) != len(attributes):
            attributes = dict(result.attributes)  # a sampler that added attributes
        return parent, span_context, attributes


def _always() -> bool:
    return True


_STARTER_ATTR = "_otel_verl_starter"  # where a tracer keeps its Starter


def starter(tracer: Any) -> Optional[Starter]:
    """The :class:`Starter` of ``tracer`` (one per tracer, kept on it: a cache keyed by
    tracer would keep every tracer and its provider alive through the starter's
    references), or ``None`` where its spans cannot be lean: a tracer that is not the
    SDK's, or span limits that cut attribute values (the events API bounds its own texts)."""
    made = getattr(tracer, _STARTER_ATTR, None)
    if type(made) is Starter:
        return made
    limits = getattr(tracer, "_span_limits", None)
    ok = bool(
        all(hasattr(tracer, name) for name in ("span_processor", "sampler", "id_generator", "resource",
                                                 "_instrumentation_scope"))
        and limits is not None
        and limits.max_span_attribute_length is None
        and (limits.max_span_attributes or 0) >= 64
    )
    if not ok:
        return None
    made = Starter(tracer)
    try:
        setattr(tracer, _STARTER_ATTR, made)
    except AttributeError:  # a tracer that takes no attributes: a starter per call
        pass
    return made


def supports(tracer: Any) -> bool:
    """Whether ``tracer``'s spans may be lean spans (see :func:`starter`)."""
    return starter(tracer) is not None


def _valid_link(context: Any, attributes: Any) -> bool:
    # the SDK's rule: a link needs a valid context, or attributes or a trace state
    return bool(context and (context.is_valid or attributes or context.trace_state))


def set_trusted(span: Any, key: str, value: Any) -> None:
    """``span.set_attribute`` for a value the events API bounded (any span)."""
    if type(span) is LeanSpan:
        span.set_trusted(key, value)
    else:
        span.set_attribute(key, value)


def set_trusted_many(span: Any, attributes: Mapping[str, Any]) -> None:
    """``span.set_attributes`` for values the events API bounded (any span)."""
    if type(span) is LeanSpan:
        span.set_trusted_many(attributes)
    else:
        span.set_attributes(attributes)


def emit_finished(
    tracer: Any,
    name: str,
    record: Any,
    parent: SpanContext,
    attributes: Dict[str, Any],
    links: Sequence[Link],
    start_ns: int,
    end_ns: int,
) -> bool:
    """Hand a span that is already over (start and end known: a batch stage reported per
    uid) straight to the provider's span processors: thousands of them per training
    step. Same ids, parent, sampling flag (the parent's, as ParentBased decides),
    resource and scope as a span from the tracer. ``attributes`` must already be valid
    OTel values within the limits (the events API bounds what it records). Returns False
    where the tracer is not the SDK's: the caller then starts and ends a span as usual."""
    processor = getattr(tracer, "span_processor", None)
    if processor is None or not parent.is_valid:
        return False
    context = SpanContext(parent.trace_id, tracer.id_generator.generate_span_id(), False, parent.trace_flags,
                          parent.trace_state)
    span = ReadableSpan(
        name,
        context=context,
        parent=parent,
        resource=tracer.resource,
        attributes=attributes,
        links=links,
        instrumentation_scope=getattr(tracer, "_instrumentation_scope", None),
        start_time=start_ns,
        end_time=end_ns,
    )
    setattr(span, RECORD_ATTR, record)
    processor.on_start(span, parent_context=None)
    on_ending = getattr(processor, "_on_ending", None)
    if on_ending is not None:
        on_ending(span)
    processor.on_end(span)
    return True
