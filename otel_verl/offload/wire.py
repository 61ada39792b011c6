"""What goes between a traced process and its export process.

Both ends run the same otel_verl from the same Python environment. A frame is a 4-byte
big-endian length and a pickle of one message; every message is a NamedTuple below.

Traced process -> export process (its stdin):

- :class:`Hello` first, then :class:`Config`;
- :class:`Shared`: an object that payloads name (a trajectory's tokenizer), once, before
  the first span that names it; :class:`ForgetShared` once no later span will;
- :class:`Spans`: span starts and ends, in the order they came, each a record packed
  (:func:`pack`), with how many span ends the traced process had queued so far;
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

Export process -> traced process (the reply pipe): :class:`Detached` first (from the
process that started it, see :mod:`otel_verl.offload.host`), :class:`Hello`, then a
:class:`Flushed` per :class:`Flush`, in order, and one with ``seq`` :data:`FINAL` at exit.

Beside the pipes, a :class:`SharedCount` says how many span ends the traced process had
queued so far, kept current with every end: the export process reads it when the traced
process died, to count the ends queued after its last message.

Each end checks the other's :class:`Hello`: on a different :data:`VERSION` the export
process exits without reading further, and the traced process counts every span it
could not send as lost.

A span crosses as its :class:`~otel_verl.record.SpanRecord` (what every output reads) in
the record's plain-tuple form (:func:`~otel_verl.record.to_tuple`), followed by what the
wire carries apart: its scope's fields (the same tuple for every span of a scope, which a
batch pickles once), its :class:`~otel_verl.payload.Payload` and the :class:`Shared` id
that payload names. The export process rebuilds the record (:class:`Rebuilder`). A start
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
import mmap
import os
import pickle
import struct
import tempfile
from typing import Any, BinaryIO, Callable, Dict, List, NamedTuple, Optional, Tuple

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from otel_verl.payload import Payload
from otel_verl.record import TUPLE_FIELDS, SpanRecord, from_readable, from_tuple, link_record, to_tuple

VERSION = 6  # of this wire format: a change to any message below needs a new one
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


class Detached(NamedTuple):
    """The first answer, from the process that started the export process and went:
    the export process's pid (it is no child of the traced process)."""

    pid: int


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


class Spans(NamedTuple):
    spans: List[tuple]  # records, each as pack() made it
    queued: int = 0  # span ends the traced process had queued when it sent these


class SharedCount:
    """One count in memory both processes map (a ``memfd``, else an unlinked file):
    the traced process sets it, the export process reads it, also after the traced
    process died. ``fd`` goes to the export process (``pass_fds``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map = mmap.mmap(fd, 8)
        self.cell = memoryview(self._map).cast("Q")  # cell[0]: the count, set in one store

    @classmethod
    def create(cls) -> "SharedCount":
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("otel-verl-queued-ends", os.MFD_CLOEXEC)
        else:
            fd, path = tempfile.mkstemp(prefix="otel-verl-queued-ends-")
            os.unlink(path)
        try:
            os.ftruncate(fd, 8)
            return cls(fd)
        except BaseException:
            os.close(fd)
            raise

    @property
    def value(self) -> int:
        return self.cell[0]


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


# --------------------------------------------------------------------------- spans out (traced process)

_OWN = len(TUPLE_FIELDS)  # a packed span: the record's tuple form, then scope, payload, shared id
_END_TIME = TUPLE_FIELDS.index("end_time")


def pack(span: Any, payload: Optional[Payload], shared_id: Callable[[Any], int],
         start_attributes: Optional[Dict[str, Any]] = None) -> tuple:
    """``span`` as it crosses: its end (a :class:`~otel_verl.record.SpanRecord`, or the
    SDK's ``ReadableSpan`` of another tracer), or with ``start_attributes`` (its
    attributes when it started) its start. ``shared_id`` names what the payload's data
    sends once."""
    if start_attributes is not None:
        span = _started(span, start_attributes)
    elif type(span) is not SpanRecord:
        span = from_readable(span)
    scope = span.scope
    sent, shared = _sent_data(payload, span.end_time is None, shared_id)
    return to_tuple(span) + (_scope(scope) if scope is not None else None, sent, shared)


def ends(spans: List[tuple]) -> int:
    """How many of the packed ``spans`` are ends (the others are starts)."""
    return sum(span[_END_TIME] is not None for span in spans)


def _started(span: Any, attributes: Dict[str, Any]) -> SpanRecord:
    """The record of a span as it started (a live span: its name, ids, kind, start, links
    and scope; ``attributes`` as they were then)."""
    context, parent = span.context, span.parent
    return SpanRecord(
        span.name, context.trace_id, context.span_id, int(context.trace_flags), context.trace_state or None,
        parent.span_id if parent is not None else 0, parent is not None and parent.is_remote, span.kind,
        span.start_time, None, attributes, (), tuple(map(link_record, span.links)) if span.links else (),
        dropped_attributes=span.dropped_attributes, dropped_links=span.dropped_links,
        scope=span.instrumentation_scope,
    )


def copied(attributes: Any) -> Dict[str, Any]:
    """Span attributes as a dict of their own (a start's, which the live span changes
    later). The SDK's read-only view copies its dict in one call (``dict(view)`` reads it
    key by key, in Python)."""
    if not attributes:
        return {}
    try:
        return attributes.copy()
    except AttributeError:  # a mapping without copy()
        return dict(attributes)


def _sent_data(payload: Optional[Payload], started: bool,
               shared_id: Callable[[Any], int]) -> Tuple[Optional[tuple], Optional[int]]:
    if payload is None:
        return None, None
    subject, data = payload
    sent = getattr(data, "sent", None)
    if sent is None:
        return (subject, data), None
    data, shared = sent(not started)
    return (subject, data), shared_id(shared) if shared is not None else None


_scopes: Dict[int, Tuple[Any, tuple]] = {}  # id(scope) -> (scope, its fields): a process has a handful
MAX_SCOPES = 64


def _scope(scope: InstrumentationScope) -> tuple:
    known = _scopes.get(id(scope))
    if known is None or known[0] is not scope:
        if len(_scopes) >= MAX_SCOPES:  # a library that makes a tracer per call
            _scopes.clear()
        attributes = scope.attributes
        fields = (scope.name, scope.version, scope.schema_url or "", tuple(attributes.items()) if attributes else ())
        known = _scopes[id(scope)] = (scope, fields)  # the scope kept: its id is not reused
    return known[1]


# --------------------------------------------------------------------------- spans again (export process)


class Rebuilder:
    """Packed spans back into :class:`~otel_verl.record.SpanRecord` objects (what the
    served process's outputs get), with the served process's resource, and the shared
    objects their payloads name handed to the payloads' data (``shared``: by id, see
    :class:`Shared`)."""

    def __init__(self, config: HostConfig, shared: Optional[Dict[int, Any]] = None) -> None:
        self.resource = Resource(config.resource_attributes, config.resource_schema_url)
        self.shared: Dict[int, Any] = {} if shared is None else shared
        self._scopes: Dict[tuple, InstrumentationScope] = {}

    def record(self, packed: tuple) -> SpanRecord:
        scope, payload, shared = packed[_OWN:]
        if payload is not None:
            payload = _new_payload(Payload, payload)
            if shared is not None:  # e.g. a trajectory's tokenizer
                payload.data.received(self.shared.get(shared))
        return from_tuple(packed[:_OWN], self.resource, self._scope(scope) if scope is not None else None, payload)

    def _scope(self, scope: tuple) -> InstrumentationScope:
        made = self._scopes.get(scope)
        if made is None:
            name, version, schema_url, attributes = scope
            made = self._scopes[scope] = InstrumentationScope(name, version, schema_url, dict(attributes) or None)
        return made


_new_payload = tuple.__new__  # a Payload without its NamedTuple's Python __new__
