"""OTLP export through the SDK's own exporters, a batch sent as requests of bounded size.

OTLP/gRPC receivers refuse a message over 4 MiB by default (the Collector's, Jaeger's
and Tempo's). A batch of chat spans carrying GenAI message content (up to 2 x 8192
characters a span) passes that long before the batch processor's 512 spans, and the
whole batch would be lost. :class:`RequestSplittingExporter` wraps any ``SpanExporter``
(``OTLPSpanExporter`` of the gRPC or HTTP package, unmodified) and hands it the batch in
chunks whose estimated protobuf size stays under the limit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator, List, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_verl import health

# The most a request may carry. The margin is for the resource and scope headers, which
# a batch (one process's spans) carries once per request.
MAX_REQUEST_BYTES = 4 * 1024 * 1024 - 64 * 1024

# Upper bounds of the protobuf bytes around the variable parts, from
# opentelemetry/proto/trace/v1/trace.proto: a span's ids, kind, times, flags, status and
# dropped counts; an event's time and dropped count; a link's ids and flags; an
# attribute's key and value framing; an array element's framing.
SPAN_BYTES = 128
EVENT_BYTES = 32
LINK_BYTES = 64
ATTRIBUTE_BYTES = 16
ELEMENT_BYTES = 8
NUMBER_BYTES = 10  # a varint of at most 10 bytes, a double of 8


class RequestSplittingExporter(SpanExporter):
    """Exports a batch with ``exporter`` as requests of at most ``max_request_bytes``
    (estimated), in order; a span larger than that on its own goes alone.

    The first request that fails ends the batch: against a refusing or unreachable
    endpoint every further request would wait out the exporter's timeout and retries
    again. ``failed_spans`` says how many spans of the last batch were not delivered, so
    that the loss counting (:class:`otel_verl.exporters.loss_counting.LossCountingProcessor`) counts
    those rather than the whole batch."""

    def __init__(self, exporter: SpanExporter, max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        self.exporter = exporter
        self.max_request_bytes = max_request_bytes
        self.failed_spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        delivered = 0
        for request in self.requests(spans):
            try:
                result = self.exporter.export(request)
            except Exception as exc:  # as a failed request: counted, the rest of the batch not sent
                health.record_failure("otlp.export", exc)
                break
            if result is not SpanExportResult.SUCCESS:
                break
            delivered += len(request)
        self.failed_spans = len(spans) - delivered
        return SpanExportResult.FAILURE if self.failed_spans else SpanExportResult.SUCCESS

    def requests(self, spans: Sequence[ReadableSpan]) -> Iterator[List[ReadableSpan]]:
        """``spans`` in order, cut where a request would pass ``max_request_bytes``."""
        request: List[ReadableSpan] = []
        size = 0
        for span in spans:
            span_size = encoded_size(span)
            if request and size + span_size > self.max_request_bytes:
                yield request
                request, size = [], 0
            request.append(span)
            size += span_size
        if request:
            yield request

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


def encoded_size(span: ReadableSpan) -> int:
    """An upper bound of the span's bytes in an OTLP protobuf request: its texts'
    lengths (nearly all of a large span) and a fixed allowance for everything else."""
    size = SPAN_BYTES + _text_size(span.name) + _attributes_size(span.attributes)
    trace_state = span.context.trace_state if span.context is not None else None
    if trace_state:
        size += len(trace_state.to_header())
    if span.status is not None and span.status.description:
        size += _text_size(span.status.description)
    for event in span.events:
        size += EVENT_BYTES + _text_size(event.name) + _attributes_size(event.attributes)
    for link in span.links:
        size += LINK_BYTES + _attributes_size(link.attributes)
        if link.context.trace_state:
            size += len(link.context.trace_state.to_header())
    return size


def _attributes_size(attributes: Any) -> int:
    if not attributes:
        return 0
    return sum(ATTRIBUTE_BYTES + _text_size(str(key)) + _value_size(value) for key, value in attributes.items())


def _value_size(value: Any) -> int:
    if isinstance(value, str):
        return _text_size(value)
    if isinstance(value, (bool, int, float)):
        return NUMBER_BYTES
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, Mapping):
        return _attributes_size(value)
    if isinstance(value, (list, tuple)):
        return sum(ELEMENT_BYTES + _value_size(v) for v in value)
    return NUMBER_BYTES  # a type the encoder drops


def _text_size(text: str) -> int:
    # UTF-8 bytes; an ASCII string (nearly every one) is its length, without encoding it
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
