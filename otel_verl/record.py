"""The one record of an ended span, from the events API to every output.

A :class:`SpanRecord` is flat: ids and flags as ints, attributes as a plain dict, events
and links as tuples of small named tuples, the resource and scope shared by every record
of a process, and the span's in-process :class:`~otel_verl.payload.Payload`. The end of an
events-API span (:class:`otel_verl.slim_span.SlimSpan`) makes its record, once, and hands
it to every output, and the OTLP encoders read it as it is.

Its fields are :data:`FIELDS`, written here alone: its slots, its constructor's order, its
plain-tuple form (:func:`to_tuple`, :func:`from_tuple`: what pickle and the export
process's wire carry, :mod:`otel_verl.offload.wire`) and its copies (:meth:`SpanRecord.replace`)
follow that list.

Records read like the SDK's ``ReadableSpan`` too (``context``, ``parent``, ``status``,
``instrumentation_scope``, ``get_span_context()``), for span processors written against
the SDK; :func:`from_readable` and :meth:`SpanRecord.to_readable` convert both ways where
an SDK exporter is the chosen encoder, or in tests.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, NamedTuple, Optional, Tuple

from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

_STATUS = {code: Status(code) for code in StatusCode}  # shared: most records never get a message


class EventRecord(NamedTuple):
    name: str
    timestamp: int
    attributes: Dict[str, Any]
    dropped_attributes: int = 0


class LinkRecord(NamedTuple):
    trace_id: int
    span_id: int
    trace_flags: int
    trace_state: Optional[TraceState]
    is_remote: bool
    attributes: Dict[str, Any]
    dropped_attributes: int = 0

    @property
    def context(self) -> SpanContext:
        return SpanContext(self.trace_id, self.span_id, self.is_remote, TraceFlags(self.trace_flags),
                           self.trace_state)


# The record's fields, in its constructor's order. The last three are not the span's own:
# the resource and scope every record of a process shares, and the in-process payload.
FIELDS = ("name", "trace_id", "span_id", "trace_flags", "trace_state", "parent_id", "parent_remote", "kind",
          "start_time", "end_time", "attributes", "events", "links", "status_code", "status_message",
          "dropped_attributes", "dropped_events", "dropped_links", "resource", "scope", "payload")
TUPLE_FIELDS = FIELDS[:-3]  # the plain-tuple form: the span's own fields


class SpanRecord:
    """One span, flat. ``parent_id`` is 0 for a root; ``end_time`` is ``None`` while the
    span is open (a processor's ``on_start`` sees it so)."""

    __slots__ = FIELDS + ("_context",)

    def __init__(self, name: str, trace_id: int, span_id: int, trace_flags: int = 0,
                 trace_state: Optional[TraceState] = None, parent_id: int = 0, parent_remote: bool = False,
                 kind: SpanKind = SpanKind.INTERNAL, start_time: int = 0, end_time: Optional[int] = None,
                 attributes: Optional[Dict[str, Any]] = None, events: Tuple[EventRecord, ...] = (),
                 links: Tuple[LinkRecord, ...] = (), status_code: StatusCode = StatusCode.UNSET,
                 status_message: Optional[str] = None, dropped_attributes: int = 0, dropped_events: int = 0,
                 dropped_links: int = 0, resource: Any = None, scope: Any = None, payload: Any = None) -> None:
        self.name = name
        self.trace_id = trace_id
        self.span_id = span_id
        self.trace_flags = trace_flags
        self.trace_state = trace_state
        self.parent_id = parent_id
        self.parent_remote = parent_remote
        self.kind = kind
        self.start_time = start_time
        self.end_time = end_time
        self.attributes = {} if attributes is None else attributes
        self.events = events
        self.links = links
        self.status_code = status_code
        self.status_message = status_message
        self.dropped_attributes = dropped_attributes
        self.dropped_events = dropped_events
        self.dropped_links = dropped_links
        self.resource = resource
        self.scope = scope
        self.payload = payload
        self._context: Optional[SpanContext] = None  # made when first read: several outputs read it

    @property
    def sampled(self) -> bool:
        return bool(self.trace_flags & TraceFlags.SAMPLED)

    # ------------------------------------------------------------------ as a ReadableSpan reads

    @property
    def context(self) -> SpanContext:
        if self._context is None:
            self._context = SpanContext(self.trace_id, self.span_id, False, _flags(self.trace_flags),
                                        self.trace_state)
        return self._context

    def get_span_context(self) -> SpanContext:
        return self.context

    @property
    def parent(self) -> Optional[SpanContext]:
        if not self.parent_id:
            return None
        # a span's trace state is its parent's, unless a sampler changed it (OTLP keeps none of a parent's)
        return SpanContext(self.trace_id, self.parent_id, self.parent_remote, _flags(self.trace_flags),
                           self.trace_state)

    @property
    def status(self) -> Status:
        if self.status_message is None:
            return _STATUS[self.status_code]
        return Status(self.status_code, self.status_message)

    @property
    def instrumentation_scope(self) -> Any:
        return self.scope

    def to_readable(self) -> Any:
        """The SDK's ``ReadableSpan`` of this record (an SDK exporter's input)."""
        from opentelemetry.sdk.trace import Event, ReadableSpan

        return ReadableSpan(
            name=self.name, context=self.context, parent=self.parent, resource=self.resource,
            attributes=bounded_attributes(self.attributes, self.dropped_attributes),
            events=bounded_list([Event(e.name, bounded_attributes(e.attributes, e.dropped_attributes), e.timestamp)
                                 for e in self.events], self.dropped_events),
            links=bounded_list([Link(link.context, bounded_attributes(link.attributes, link.dropped_attributes))
                                for link in self.links], self.dropped_links),
            kind=self.kind, status=self.status, start_time=self.start_time, end_time=self.end_time,
            instrumentation_scope=self.scope,
        )

    def __repr__(self) -> str:
        return f"SpanRecord({self.name!r}, trace_id={self.trace_id:032x}, span_id={self.span_id:016x})"

    def replace(self, **changes: Any) -> "SpanRecord":
        """A copy with ``changes`` (fields by name)."""
        values = dict(zip(FIELDS, _values(self)))
        values.update(changes)
        return SpanRecord(**values)

    def __reduce__(self) -> Any:  # the one tuple form, not the slots (_context is a cache)
        return from_tuple, (to_tuple(self), self.resource, self.scope, self.payload)


# A record's plain-tuple form: the values of TUPLE_FIELDS, its events, links and trace state
# as they are (a batch of such tuples pickles in C). What else a process shares (resource,
# scope) or keeps (payload) goes beside it, as the carrier chooses.
to_tuple = operator.attrgetter(*TUPLE_FIELDS)
_values = operator.attrgetter(*FIELDS)


def from_tuple(values: tuple, resource: Any = None, scope: Any = None, payload: Any = None) -> SpanRecord:
    """The record of a :func:`to_tuple` form, with its resource, scope and payload."""
    return SpanRecord(*values, resource, scope, payload)


def from_readable(span: Any, payload: Any = None) -> SpanRecord:
    """The record of an SDK ``ReadableSpan`` (or anything that reads like one)."""
    context, parent, status = span.context, span.parent, span.status
    return SpanRecord(
        span.name, context.trace_id, context.span_id, int(context.trace_flags), context.trace_state or None,
        parent.span_id if parent is not None else 0, bool(parent.is_remote) if parent is not None else False,
        span.kind, span.start_time, span.end_time, dict(span.attributes or {}),
        tuple(EventRecord(e.name, e.timestamp, dict(e.attributes or {}), _dropped(e.attributes)) for e in span.events),
        tuple(map(link_record, span.links)),
        status.status_code, status.description, span.dropped_attributes, span.dropped_events, span.dropped_links,
        span.resource, span.instrumentation_scope, payload,
    )


def link_record(link: Any) -> LinkRecord:
    """The record of an API ``Link``."""
    context = link.context
    return LinkRecord(context.trace_id, context.span_id, int(context.trace_flags), context.trace_state or None,
                      bool(context.is_remote), dict(link.attributes or {}), _dropped(link.attributes))


_FLAGS = {bits: TraceFlags(bits) for bits in range(256)}


def _flags(bits: int) -> TraceFlags:
    return _FLAGS[bits & 0xFF]


def _dropped(attributes: Any) -> int:
    return int(getattr(attributes, "dropped", 0) or 0)


def bounded_attributes(attributes: Dict[str, Any], dropped: int) -> Any:
    """Attributes as the SDK keeps them when some were dropped (its ``dropped_*``
    properties read the count off them); else the plain dict."""
    if not dropped:
        return attributes
    from opentelemetry.attributes import BoundedAttributes

    bounded = BoundedAttributes(attributes=attributes, immutable=True)
    bounded.dropped = dropped
    return bounded


def bounded_list(items: list, dropped: int) -> Any:
    """``items`` as the SDK keeps a span's events or links when some were dropped."""
    if not dropped:
        return items
    from opentelemetry.sdk.util import BoundedList

    bounded = BoundedList.from_seq(None, items)
    bounded.dropped = dropped
    return bounded
