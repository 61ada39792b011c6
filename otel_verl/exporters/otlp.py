"""OTLP export through the SDK's own exporters (``OTEL_VERL_ACCELERATED=false``), a batch
sent as requests of bounded size.

OTLP/gRPC receivers refuse a message over 4 MiB by default (the Collector's, Jaeger's
and Tempo's). A batch of chat spans carrying GenAI message content (up to 2 x 8192
characters a span) passes that long before the batch processor's 512 spans, and the
whole batch would be lost. :class:`RequestSplittingExporter` wraps any ``SpanExporter``
(``OTLPSpanExporter`` of the gRPC or HTTP package, unmodified) and hands it the batch in
chunks whose size stays under the limit (the bound of
:func:`otel_verl.accelerated.otlp_encoding.size_bound`, which otel_verl's own exporter cuts
its requests by too), with text the SDK's encoder would fail the whole request on (a
lone surrogate) repaired first.

:func:`sdk_exporter_arguments` says what the SDK's exporter is given beyond the
variables it reads itself.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Sequence

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_verl import health
from otel_verl.accelerated.otlp_encoding import records_of, request_chunks, well_formed_record
from otel_verl.accelerated.otlp_exporter import MAX_REQUEST_BYTES, OtlpSettings


def sdk_exporter_arguments(protocol: str, environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The SDK's ``OTLPSpanExporter``'s arguments: none, unless the endpoint carries
    credentials (``http://user:pass@host``); then the endpoint without them and the headers
    with them, as otel_verl's exporter sends (an explicit ``authorization`` header wins).
    Left to itself the SDK's HTTP exporter lets the URL's credentials replace that header,
    and its gRPC exporter cannot connect to such a URL (and logs it, password and all)."""
    settings = OtlpSettings(os.environ if environ is None else environ, protocol=protocol)
    if settings.username is None:
        return {}
    return {"endpoint": settings.endpoint, "headers": settings.request_headers()}


class RequestSplittingExporter(SpanExporter):
    """Exports a batch with ``exporter`` as requests of at most ``max_request_bytes``, in
    order; a span larger than that on its own goes alone.

    The first request that fails ends the batch: against a refusing or unreachable
    endpoint every further request would wait out the exporter's timeout and retries
    again. ``failed_spans`` says how many spans of the last batch were not delivered, so
    that the batch processor (:class:`otel_verl.accelerated.batch.BatchExportProcessor`)
    counts those rather than the whole batch."""

    def __init__(self, exporter: SpanExporter, max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        self.exporter = exporter
        self.max_request_bytes = max_request_bytes
        self.failed_spans = 0

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        delivered = 0
        try:
            records = [well_formed_record(record) for record in records_of(spans)]
            requests = request_chunks(records, self.max_request_bytes)
        except Exception as exc:  # a span we cannot read: the batch counts as not delivered
            health.record_failure("otlp.export", exc)
            requests = []
        for request in requests:
            try:
                result = self.exporter.export([record.to_readable() for record in request])
            except Exception as exc:  # as a failed request: counted, the rest of the batch not sent
                health.record_failure("otlp.export", exc)
                break
            if result is not SpanExportResult.SUCCESS:
                break
            delivered += len(request)
        self.failed_spans = len(spans) - delivered
        return SpanExportResult.FAILURE if self.failed_spans else SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)
