"""What goes between a traced process and its export process.

Both ends run the same otel_verl from the same Python environment. A frame is a 4-byte
big-endian length and a pickle of one message; every message is a NamedTuple below.

Traced process -> export process (its stdin):

- :class:`Hello` first, then :class:`Config`;
- :class:`Shared`: an object that payloads name (a trajectory's tokenizer), once, before
  the first span that names it; :class:`ForgetShared` once no later span will;
- :class:`Spans`: span snapshots, in the order the spans started and ended, with how many
  span ends the traced process had queued so far;
- :class:`Flush`: answered with :class:`Flushed` once every file output has written (or
  counted) everything sent before it; OTLP is not waited for (what it cannot send is its
  own loss, counted in the export process). That answer acknowledges those spans: the
  traced process sends a Flush at least every second while spans flow, and counts as lost
  what an export process died without acknowledging. A Flush also carries the traced
  process's own loss and failure counters, which the export process reports;
- :class:`Close`: the traced process sent everything, with its final counters. An end of
  the input without it means the traced process died: the span ends it had queued and
  not sent (the last :class:`Spans` says how many it had queued) are counted lost by the
  export process, which goes on to finish its outputs.

Export process -> traced process (the reply pipe): :class:`Hello` first, then a
:class:`Flushed` per :class:`Flush`, in order, and one with ``seq`` :data:`FINAL` at exit.

Each end checks the other's :class:`Hello`: on a different :data:`VERSION` the export
process exits without reading further, and the traced process counts every span it
could not send as lost.

A :class:`SpanSnapshot` holds what a span processor can read of a span through the public
``ReadableSpan`` properties, and the span's :class:`~otel_verl.payload.Payload`. A start
(``end_time`` None) is the span as it started: its name, ids, kind, start time, links,
scope and the attributes it had then. The resource is the traced process's, sent once in
:class:`Config`.

A payload goes as its data says (``sent``, see :mod:`otel_verl.payload`), else as it is;
what that data names to be sent once (a tokenizer does not pickle cheaply) goes as a
:class:`Shared` id, and the export process hands the object back to the rebuilt data
(``received``). The wire knows no payload type.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import struct
from typing import Any, BinaryIO, Callable, Dict, List, NamedTuple, Optional, Tuple

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceState
from opentelemetry.trace.span import DEFAULT_TRACE_STATE

from otel_verl.payload import Payload
from otel_verl.record import EventRecord, LinkRecord, SpanRecord

VERSION = 4  # of this wire format: a change to any message below needs a new one
FINAL = -1  # the seq of the Flushed sent at exit
UNSENDABLE = -1  # the id of a shared object that could not be pickled
OFFLOAD_OUTPUT = "offload"  # the health counters' name for spans the export process never got
PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
_HEADER = struct.Struct(">I")


# --------------------------------------------------------------------------- messages


@dataclasses.dataclass(frozen=True)
class HostConfig:
    """What the export process needs to write the outputs of the process it serves."""

    settings: Any  # otel_verl.settings.Settings
    resource_attributes: Dict[str, Any]
    resource_schema_url: str
    pid: int  # the served process: files are named after it


class Hello(NamedTuple):
    """Each end's first message: the wire version it speaks."""

    version: int


class Config(NamedTuple):
    config: HostConfig


class Shared(NamedTuple):
    """An object that payloads name by ``shared_id``, pickled by :func:`dumps_shared`."""

    shared_id: int
    pickled: bytes


class ForgetShared(NamedTuple):
    shared_id: int


class Flush(NamedTuple):
    """Asks for a :class:`Flushed`; carries the traced process's own health counters
    (without those the export process sent it), for the export process's outputs. With
    ``timeout_ms`` it is the traced process's ``force_flush``: every output is flushed too,
    OTLP and the metrics included, within that time."""

    seq: int
    counts: Dict[str, Dict[str, int]]
    timeout_ms: Optional[int] = None


class Close(NamedTuple):
    """The traced process's last message: ``queued`` span ends in all, its final counters,
    and the time its outputs may take to finish (``timeout_ms``; none: the export process's
    own share of the deadline)."""

    queued: int
    counts: Dict[str, Dict[str, int]]
    timeout_ms: Optional[int] = None


class Flushed(NamedTuple):
    """The answer to :class:`Flush` ``seq``, with the export process's health counters.
    ``written``: the files hold (or counted) every span sent before it, which acknowledges
    them; ``flushed``: so do the other outputs (a Flush with a timeout, in time)."""

    seq: int
    written: bool
    flushed: bool
    counts: Dict[str, Dict[str, int]]


class ContextSnapshot(NamedTuple):
    trace_id: int
    span_id: int
    is_remote: bool
    trace_flags: int
    trace_state: Tuple[Tuple[str, str], ...]


class EventSnapshot(NamedTuple):
    name: str
    timestamp: int
    attributes: Dict[str, Any]
    dropped_attributes: int


class LinkSnapshot(NamedTuple):
    context: ContextSnapshot
    attributes: Dict[str, Any]
    dropped_attributes: int


class ScopeSnapshot(NamedTuple):
    name: str
    version: Optional[str]
    schema_url: str
    attributes: Tuple[Tuple[str, Any], ...]


class SpanSnapshot(NamedTuple):
    name: str
    context: ContextSnapshot
    parent: Optional[ContextSnapshot]
    kind: SpanKind
    start_time: int
    end_time: Optional[int]  # None: the span's start
    attributes: Dict[str, Any]
    events: Tuple[EventSnapshot, ...]
    links: Tuple[LinkSnapshot, ...]
    status_code: StatusCode
    status_description: Optional[str]
    scope: Optional[ScopeSnapshot]
    dropped_attributes: int
    dropped_events: int
    dropped_links: int
    payload: Optional[Payload]
    shared: Optional[int]  # what its payload names (see Shared)


class Spans(NamedTuple):
    spans: List[SpanSnapshot]
    queued: int = 0  # span ends the traced process had queued when it sent these

    def __reduce__(self) -> Any:
        # pickle reduces every NamedTuple through a Python call (several per span, most
        # of a rollout worker's sending); plain tuples pickle in C, so a batch goes as them
        return _spans_from_tuples, ([_as_tuples(snapshot) for snapshot in self.spans], self.queued)


def _as_tuples(s: SpanSnapshot) -> tuple:
    return (s.name, tuple(s.context), tuple(s.parent) if s.parent is not None else None, s.kind, s.start_time,
            s.end_time, s.attributes, tuple(tuple(event) for event in s.events),
            tuple((tuple(link.context), link.attributes, link.dropped_attributes) for link in s.links),
            s.status_code, s.status_description, tuple(s.scope) if s.scope is not None else None,
            s.dropped_attributes, s.dropped_events, s.dropped_links,
            tuple(s.payload) if s.payload is not None else None, s.shared)


def _spans_from_tuples(spans: List[tuple], queued: int) -> Spans:
    return Spans([_snapshot_from_tuples(*fields) for fields in spans], queued)


def _snapshot_from_tuples(name: str, context: tuple, parent: Optional[tuple], kind: SpanKind, start_time: int,
                          end_time: Optional[int], attributes: Dict[str, Any], events: tuple, links: tuple,
                          status_code: StatusCode, status_description: Optional[str], scope: Optional[tuple],
                          dropped_attributes: int, dropped_events: int, dropped_links: int,
                          payload: Optional[tuple], shared: Optional[int]) -> SpanSnapshot:
    return SpanSnapshot(
        name, ContextSnapshot(*context), ContextSnapshot(*parent) if parent is not None else None, kind, start_time,
        end_time, attributes, tuple(EventSnapshot(*event) for event in events),
        tuple(LinkSnapshot(ContextSnapshot(*link[0]), link[1], link[2]) for link in links),
        status_code, status_description, ScopeSnapshot(*scope) if scope is not None else None,
        dropped_attributes, dropped_events, dropped_links, Payload(*payload) if payload is not None else None, shared)


# --------------------------------------------------------------------------- frames


def frame(message: Any) -> bytes:
    """One message as the bytes of its frame (header and pickle)."""
    body = pickle.dumps(message, PICKLE_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def write_frame(out: BinaryIO, message: Any) -> None:
    out.write(frame(message))
    out.flush()


def read_frame(source: BinaryIO) -> Any:
    """The next message, or ``None`` at the end of the stream."""
    body = read_body(source)
    return None if body is None else pickle.loads(body)


def read_body(source: BinaryIO) -> Optional[bytes]:
    """The next frame's pickle, or ``None`` at the end of the stream (a torn frame too)."""
    header = _read_exactly(source, _HEADER.size)
    if header is None:
        return None
    return _read_exactly(source, _HEADER.unpack(header)[0])


def _read_exactly(source: BinaryIO, size: int) -> Optional[bytes]:
    chunks, left = [], size
    while left:
        chunk = source.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def dumps_shared(shared: Any) -> bytes:
    """A shared object pickled with cloudpickle, which takes what an agent loop may hand
    over besides a tokenizer's bound methods: a lambda, a closure, a function of the
    job's ``__main__`` (the export process has none of those by name)."""
    try:
        import cloudpickle
    except ImportError:  # plain pickle takes a tokenizer's bound methods
        return pickle.dumps(shared, PICKLE_PROTOCOL)
    return cloudpickle.dumps(shared, PICKLE_PROTOCOL)


# --------------------------------------------------------------------------- snapshots (traced process)


def snapshot(span: ReadableSpan, payload: Optional[Payload], shared_id: Callable[[Any], int],
             start_attributes: Optional[Dict[str, Any]] = None) -> SpanSnapshot:
    """``span`` as a snapshot: its end, or with ``start_attributes`` (its attributes when
    it started) its start. ``shared_id`` names what the payload's data sends once."""
    started = start_attributes is not None
    data, shared = _sent_data(payload, started, shared_id)
    scope = span.instrumentation_scope
    if started:
        attributes, events, status = start_attributes, (), Status(StatusCode.UNSET)
        end_time, dropped_events = None, 0
    else:
        attributes, status, end_time = copied(span.attributes), span.status, span.end_time
        events = tuple(EventSnapshot(e.name, e.timestamp, copied(e.attributes), e.dropped_attributes)
                       for e in span.events)
        dropped_events = span.dropped_events
    return SpanSnapshot(
        name=span.name,
        context=_context(span.context),
        parent=_context(span.parent) if span.parent is not None else None,
        kind=span.kind,
        start_time=span.start_time,
        end_time=end_time,
        attributes=attributes,
        events=events,
        links=tuple(LinkSnapshot(_context(link.context), copied(link.attributes), link.dropped_attributes)
                    for link in span.links),
        status_code=status.status_code,
        status_description=status.description,
        scope=_scope(scope) if scope is not None else None,
        dropped_attributes=span.dropped_attributes,
        dropped_events=dropped_events,
        dropped_links=span.dropped_links,
        payload=data,
        shared=shared,
    )


def copied(attributes: Any) -> Dict[str, Any]:
    """Span, event or link attributes as a dict of their own. The SDK's read-only view
    copies its dict in one call (``dict(view)`` reads it key by key, in Python)."""
    if not attributes:
        return {}
    try:
        return attributes.copy()
    except AttributeError:  # a mapping without copy()
        return dict(attributes)


def _sent_data(payload: Optional[Payload], started: bool,
               shared_id: Callable[[Any], int]) -> Tuple[Optional[Payload], Optional[int]]:
    if payload is None:
        return None, None
    subject, data = payload
    sent = getattr(data, "sent", None)
    if sent is None:
        return payload, None
    data, shared = sent(not started)
    return Payload(subject, data), shared_id(shared) if shared is not None else None


def _context(context: SpanContext) -> ContextSnapshot:
    state = context.trace_state
    return ContextSnapshot(context.trace_id, context.span_id, context.is_remote, int(context.trace_flags),
                           () if state is DEFAULT_TRACE_STATE or not state else tuple(state.items()))


@functools.lru_cache(maxsize=64)  # spans share a handful of scopes
def _scope(scope: InstrumentationScope) -> ScopeSnapshot:
    attributes = scope.attributes
    return ScopeSnapshot(scope.name, scope.version, scope.schema_url or "",
                         tuple(attributes.items()) if attributes else ())


# --------------------------------------------------------------------------- spans again (export process)


class Rebuilder:
    """Snapshots back into :class:`~otel_verl.record.SpanRecord` objects (what the served
    process's outputs get), with the served process's resource."""

    def __init__(self, config: HostConfig) -> None:
        self.resource = Resource(config.resource_attributes, config.resource_schema_url)
        self._scopes: Dict[ScopeSnapshot, InstrumentationScope] = {}

    def span(self, snapshot: SpanSnapshot) -> SpanRecord:
        context, parent = snapshot.context, snapshot.parent
        return SpanRecord(
            snapshot.name, context.trace_id, context.span_id, context.trace_flags, _trace_state(context),
            parent.span_id if parent is not None else 0, parent is not None and parent.is_remote, snapshot.kind,
            snapshot.start_time, snapshot.end_time, snapshot.attributes,
            tuple(EventRecord(e.name, e.timestamp, e.attributes, e.dropped_attributes) for e in snapshot.events),
            tuple(LinkRecord(link.context.trace_id, link.context.span_id, link.context.trace_flags,
                             _trace_state(link.context), link.context.is_remote, link.attributes,
                             link.dropped_attributes) for link in snapshot.links),
            snapshot.status_code, snapshot.status_description, snapshot.dropped_attributes, snapshot.dropped_events,
            snapshot.dropped_links, self.resource,
            self._scope(snapshot.scope) if snapshot.scope is not None else None, snapshot.payload,
        )

    def _scope(self, scope: ScopeSnapshot) -> InstrumentationScope:
        made = self._scopes.get(scope)
        if made is None:
            made = self._scopes[scope] = InstrumentationScope(scope.name, scope.version, scope.schema_url,
                                                              dict(scope.attributes) or None)
        return made


def _trace_state(context: ContextSnapshot) -> Optional[TraceState]:
    return TraceState(list(context.trace_state)) if context.trace_state else None


