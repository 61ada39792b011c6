"""A batch span processor whose losses are counted in :mod:`otel_verl.health`.

The SDK's ``BatchSpanProcessor`` logs a full queue, a failed export or spans left at its
shutdown timeout, but keeps no count. :class:`LossCountingProcessor` counts them from
the outside: every sampled span handed to the batch processor, and every span its
exporter (wrapped in :class:`CountingExporter`) delivered or failed to deliver. After a
flush, whatever was handed in before it and neither delivered nor failed was dropped
from a full queue; after shutdown, whatever is left was never sent.
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from otel_verl import health
from otel_verl.settings import DEFAULT_SHUTDOWN_TIMEOUT_S


class CountingExporter(SpanExporter):
    """``exporter`` with the spans it delivered and failed to deliver counted. An exporter
    that sends a batch as several requests may say how many spans failed
    (``failed_spans``, as :class:`otel_verl.exporters.otlp.RequestSplittingExporter`)."""

    def __init__(self, exporter: SpanExporter, output: str) -> None:
        self.exporter = exporter
        self.output = output
        self.exported = 0
        self.failed = 0
        self.closed = False  # after shutdown: late exports were counted as lost already
        self.lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        failed: Any = None
        try:
            result = self.exporter.export(spans)
            failed = getattr(self.exporter, "failed_spans", None)
        except Exception as exc:
            health.record_failure(f"{self.output}.export", exc)
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            failed = 0
        elif type(failed) is not int or not 0 < failed <= len(spans):
            failed = len(spans)
        with self.lock:
            if self.closed:
                return result
            self.exported += len(spans) - failed
            self.failed += failed
        if failed:
            health.record_dropped(self.output, failed, "export failed (endpoint down, refusing or unreachable?)")
        return result

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        flush = getattr(self.exporter, "force_flush", None)
        return flush(timeout_millis) if flush is not None else True


class LossCountingProcessor(SpanProcessor):
    """A ``BatchSpanProcessor`` (``batch_options``: its constructor's arguments) exporting
    to ``exporter``, with every lost span counted under ``output``. Shutdown waits for the
    batch processor at most ``shutdown_timeout_s`` and at most the ``timeout_millis`` it is
    given; the spans not exported by then are counted as lost."""

    on_start_subjects: frozenset = frozenset()  # a batch processor reads ended spans only

    def __init__(self, exporter: SpanExporter, output: str, *,
                 shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S, **batch_options: Any) -> None:
        self.output = output
        self.exporter = CountingExporter(exporter, output)
        self.batch = BatchSpanProcessor(self.exporter, **batch_options)
        self.shutdown_timeout_s = shutdown_timeout_s
        self.handed = 0  # sampled spans handed to the batch processor
        self.missing = 0  # of them, counted as lost here (queue full, left at shutdown)

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if span.context.trace_flags.sampled:  # the batch processor drops the others itself
            with self.exporter.lock:  # spans end on several threads: no increment lost
                self.handed += 1
        self.batch.on_end(span)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        handed = self.handed
        flushed = self.batch.force_flush(timeout_millis)
        if flushed:
            self._count_missing(handed, "span queue full (OTEL_BSP_MAX_QUEUE_SIZE)")
        return flushed

    def shutdown(self, timeout_millis: Optional[int] = None) -> None:
        timeout_s = self.shutdown_timeout_s
        if timeout_millis is not None:
            timeout_s = min(timeout_s, timeout_millis / 1000)
        # The SDK waits up to 30 s per batch processor, and then for the batch in flight;
        # what is not exported by our deadline is counted as lost.
        closing = threading.Thread(target=self.batch.shutdown, name="otel-verl-batch-shutdown", daemon=True)
        closing.start()
        closing.join(timeout_s)
        with self.exporter.lock:
            self.exporter.closed = True
        self._count_missing(self.handed, "not exported (queue full, or still queued at the shutdown timeout)")

    def _count_missing(self, handed: int, why: str) -> None:
        with self.exporter.lock:
            missing = handed - self.exporter.exported - self.exporter.failed - self.missing
            if missing > 0:
                self.missing += missing
        if missing > 0:
            health.record_dropped(self.output, missing, why)
