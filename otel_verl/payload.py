"""In-process data that rides with a span without being exported over OTLP.

Some outputs need more than a span's attributes: a trajectory's turns with their token
ids, the engine's timing of each request, the worker's tokenizer
(:mod:`otel_verl.rollout_data`). Token ids on OTLP spans would be costly (a trajectory
holds thousands), and message content a privacy leak (GenAI content capture is opt-in).
The events API starts each span with a :class:`Payload` (what the span stands for, and
that data); outputs read it with :func:`payload_of`; OTLP exporters never see it.

A span's payload is readable from the start of its ``on_start`` to the end of its
``on_end``. It rides on the span: an events-API span (``SlimSpan``) holds it and hands it
to its record (``SpanRecord.payload``), which the export process rebuilds with it. Only a
span of another provider's tracer (the SDK's own) is kept by span id while open. The
processors' ``on_start`` gets it through a context variable (a tracer calls them inside
``start_span``, before the caller holds the span). A processor that reads a payload later
(a batch writer) keeps a reference to it.

A span's payload goes to an export process with the span (:mod:`otel_verl.offload.wire`)
as it is (plain values: a batch stage's traj_uids), unless its data is a
:class:`PayloadData`, which says what of it crosses, and when.
"""

from __future__ import annotations

import contextvars
from typing import Any, Dict, NamedTuple, Optional, Protocol, Tuple, runtime_checkable

from opentelemetry.trace import Span, Tracer

from otel_verl.semconv import Subject
from otel_verl.slim_span import SlimSpan


class Payload(NamedTuple):
    """What a span stands for, and the data outputs read of it beyond its attributes: a
    :class:`PayloadData`, or plain values (a batch stage's traj_uids)."""

    subject: Subject
    data: Any = None


@runtime_checkable
class PayloadData(Protocol):
    """A payload's data that chooses what of it crosses to an export process. (It may
    also say about the memory it holds, ``approx_bytes()``, which the bounded queues it
    waits in count.)"""

    def sent(self, at_end: bool) -> Tuple[Any, Any]:
        """What crosses with the span's start (``at_end`` false) or end (``None``:
        nothing), and an object it names that crosses once for all data naming it
        (``None``: none; a tokenizer)."""

    def received(self, shared: Any) -> None:
        """The named object, given back to the copy the export process rebuilt."""


# --------------------------------------------------------------------------- span <-> payload

# (trace id, span id) of an open span that cannot hold its payload (the SDK's) -> its payload
_open: Dict[Tuple[int, int], Payload] = {}
_starting: contextvars.ContextVar[Optional[Payload]] = contextvars.ContextVar("otel_verl_starting", default=None)


def start_span(tracer: Tracer, name: str, payload: Payload, **kwargs: Any) -> Span:
    """``tracer.start_span(name, **kwargs)`` whose span carries ``payload`` until it ends
    (end it with :func:`end_span`)."""
    token = _starting.set(payload)
    try:
        span = tracer.start_span(name, **kwargs)
    finally:
        _starting.reset(token)
    if type(span) is SlimSpan:
        span.payload = payload
    elif span.is_recording():
        _open[_key(span.get_span_context())] = payload
    return span


def end_span(span: Span, end_time: Optional[int] = None) -> None:
    """End a span of :func:`start_span` (its processors read the payload in ``on_end``)."""
    try:
        span.end(end_time=end_time)
    finally:
        if _open:
            _open.pop(_key(span.get_span_context()), None)


def payload_of(span: Any) -> Optional[Payload]:
    """The payload of a span that a processor gets in ``on_start`` or ``on_end``."""
    payload = getattr(span, "payload", None)  # a SpanRecord's, a SlimSpan's
    if payload is None and _open:
        payload = _open.get(_key(span.context))
    return payload if payload is not None else _starting.get()


def open_count() -> int:
    """Open spans whose payload is kept by span id (a test checks nothing is left behind)."""
    return len(_open)


def _key(context: Any) -> Tuple[int, int]:
    return context.trace_id, context.span_id
