"""A batch span processor of otel_verl's own: bounded in bytes, every loss counted when it happens.

The SDK's ``BatchSpanProcessor`` bounds its queue in spans (a span with message content
may hold 64 KiB, a full queue of a collector that is down then hundreds of MB), logs what
it drops without counting it, and exports its whole queue in ``force_flush`` whatever
the timeout. :class:`BatchExportProcessor` queues the ended sampled spans up to
``max_queue_bytes`` (estimated by :func:`span_bytes`) and ``max_queue_spans``, counts a
span it refuses at once (``dropped[{output}]``), exports batches of at most
``max_batch`` from a thread of its own at most ``schedule_delay_s`` after the first span
of a batch was queued, counts the spans of a batch its exporter did not deliver (the
exporter may say how many: ``failed_spans``), and keeps the deadlines it is given. What
is still queued at the shutdown deadline is counted too.

The standard ``OTEL_BSP_SCHEDULE_DELAY``, ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` and
``OTEL_BSP_MAX_QUEUE_SIZE`` are read by :func:`options_from_env`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Optional, Sequence, Tuple

from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_verl import forks, health
from otel_verl.deadline import Call, Deadline, Late
from otel_verl.settings import DEFAULT_MAX_QUEUE_MB

logger = logging.getLogger("otel_verl")

# Memory a queued span holds beyond its texts: the record, its attribute dict and entries.
SPAN_OVERHEAD_BYTES = 512
ATTRIBUTE_BYTES = 96
EVENT_BYTES = 256


def span_bytes(span: Any) -> int:
    """The memory a queued span holds, estimated from its attribute and event counts and
    the length of its texts (a content-capturing chat span is nearly all text)."""
    size = SPAN_OVERHEAD_BYTES + _attributes_bytes(span.attributes)
    for event in span.events:
        size += EVENT_BYTES + _attributes_bytes(event.attributes)
    return size


def _attributes_bytes(attributes: Any) -> int:
    if not attributes:
        return 0
    size = ATTRIBUTE_BYTES * len(attributes)
    for value in attributes.values():
        if type(value) is str:
            size += len(value)
        elif isinstance(value, (tuple, list)):
            size += sum(len(item) if type(item) is str else 8 for item in value)
    return size


def options_from_env(env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """The ``OTEL_BSP_*`` variables a batch processor honours, as keyword arguments (bad
    values are left out with one warning: the processor's defaults apply)."""
    env = os.environ if env is None else env
    out: Dict[str, Any] = {}
    for variable, key, scale in (("OTEL_BSP_SCHEDULE_DELAY", "schedule_delay_s", 1e-3),
                                 ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "max_batch", 1),
                                 ("OTEL_BSP_MAX_QUEUE_SIZE", "max_queue_spans", 1)):
        raw = (env.get(variable) or "").strip()
        if not raw:
            continue
        try:
            value = int(raw)
            if value <= 0 and key != "schedule_delay_s":
                raise ValueError(raw)
        except ValueError:
            logger.warning("otel_verl: %s=%r is not a positive integer; using the default", variable, raw)
            continue
        out[key] = max(0.0, value * scale) if scale != 1 else value
    return out


class BatchExportProcessor(SpanProcessor):
    """Exports sampled ended spans to ``exporter`` in batches; see the module docs.
    ``output`` names its losses and failures in :mod:`otel_verl.health`."""

    on_start_subjects: frozenset = frozenset()  # reads ended spans only
    on_end_subjects = None  # every span's
    finish_order = 0
    writes_files = False  # (the OTLP-JSON files' says True)

    def __init__(self, exporter: SpanExporter, output: str, *, max_queue_bytes: int = DEFAULT_MAX_QUEUE_MB << 20,
                 max_queue_spans: int = 1 << 20, max_batch: int = 512, schedule_delay_s: float = 5.0,
                 shutdown_timeout_s: float = 10.0, size: Callable[[Any], int] = span_bytes,
                 writes_files: bool = False) -> None:
        self.exporter = exporter
        self.writes_files = writes_files  # a flush of the export process waits for it (offload.host)
        self.output = output
        self.max_queue_bytes = max_queue_bytes
        self.max_queue_spans = max_queue_spans
        self.max_batch = max(1, min(max_batch, max_queue_spans))
        self.schedule_delay_s = schedule_delay_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.size = size
        self._start_empty()
        forks.in_child(self._after_fork_in_child)

    def _start_empty(self) -> None:
        self._cond = threading.Condition()
        self._queue: Deque[Tuple[Any, int]] = deque()
        self._queued_bytes = 0
        self._first_queued_at = 0.0  # time.monotonic() when the oldest queued span came
        self._wanted = 0  # spans handed in before a flush or checkpoint that waits for them
        self.handed = 0  # sampled spans handed in
        self.done = 0  # of them exported, or counted as dropped
        self.exported = 0
        self.dropped = 0
        self._closed = False
        self._counted_all = False  # the shutdown counted every span not exported by then
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ span processor

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: Any) -> None:
        if not span.context.trace_flags.sampled:  # recorded for the legacy files only
            return
        try:
            size = self.size(span)
        except Exception as exc:
            health.record_failure(f"{self.output}.size", exc)
            size = SPAN_OVERHEAD_BYTES
        with self._cond:
            self.handed += 1
            if self._closed:
                why = "after the output was shut down"
            elif len(self._queue) >= self.max_queue_spans or self._queued_bytes + size > self.max_queue_bytes:
                why = "span queue full (endpoint too slow or down?)"
            else:
                if not self._queue:
                    self._first_queued_at = time.monotonic()
                self._queue.append((span, size))
                self._queued_bytes += size
                if self._thread is None:
                    self._start_thread()
                if len(self._queue) == 1 or len(self._queue) >= self.max_batch:
                    self._cond.notify()
                return
            self._count_dropped_locked(1)
        health.record_dropped(self.output, 1, why)

    def pending(self) -> Dict[str, int]:
        """Spans handed in and neither exported nor counted yet (queued, or in an export)."""
        with self._cond:
            return {self.output: self.handed - self.done}

    def checkpoint(self) -> Callable[[Optional[float]], bool]:
        """Everything handed in so far, exported or counted: returns a wait for that
        (``wait(timeout_s)`` -> whether it happened in time), asking for it now."""
        with self._cond:
            mark = self.handed
            self._wanted = max(self._wanted, mark)
            self._cond.notify_all()

        def wait(timeout_s: Optional[float] = None) -> bool:
            with self._cond:
                return self._cond.wait_for(lambda: self.done >= mark, timeout_s)

        return wait

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.checkpoint()(timeout_millis / 1000.0)

    def shutdown(self, timeout_millis: Optional[int] = None) -> None:
        """Exports what is queued within ``timeout_millis`` (and ``shutdown_timeout_s``);
        counts what was not, and every span handed in later."""
        timeout_s = self.shutdown_timeout_s
        if timeout_millis is not None:
            timeout_s = min(timeout_s, timeout_millis / 1000.0)
        deadline = Deadline(timeout_s)
        wait = self.checkpoint()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        wait(deadline.left_s())
        with self._cond:
            late = self.handed - self.done  # queued, or in an export that did not return in time
            self._counted_all = True
            self._queue.clear()
            self._queued_bytes = 0
            self._count_dropped_locked(late)
        health.record_dropped(self.output, late, "not exported by the shutdown deadline")
        try:
            Call(self.exporter.shutdown).result(deadline)
        except Late:
            pass
        except Exception as exc:
            health.record_failure(f"{self.output}.shutdown", exc)
        forks.forget(self._after_fork_in_child)

    # ------------------------------------------------------------------ export thread

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"otel-verl-{self.output}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                batch = self._next_batch()
                if batch is None:
                    return
            self._export(batch)

    def _next_batch(self) -> Optional[list]:
        # with self._cond held: waits until a batch is due, then takes it
        while True:
            if self._closed and not self._queue:
                return None
            if self._queue:
                due = self._first_queued_at + self.schedule_delay_s - time.monotonic()
                if len(self._queue) >= self.max_batch or self._wanted > self.done or self._closed or due <= 0:
                    break
                self._cond.wait(due)
            else:
                self._cond.wait()
        batch = []
        while self._queue and len(batch) < self.max_batch:
            span, size = self._queue.popleft()
            self._queued_bytes -= size
            batch.append(span)
        self._first_queued_at = time.monotonic()
        return batch

    def _export(self, batch: Sequence[Any]) -> None:
        failed = len(batch)
        try:
            result = self.exporter.export(batch)
            if result is SpanExportResult.SUCCESS:
                failed = 0
            else:
                said = getattr(self.exporter, "failed_spans", None)
                if type(said) is int and 0 < said <= len(batch):
                    failed = said
        except Exception as exc:
            health.record_failure(f"{self.output}.export", exc)
        with self._cond:
            late = self._counted_all  # the shutdown counted this batch as lost already
            if not late:
                self.exported += len(batch) - failed
                self.done += len(batch) - failed
                self._count_dropped_locked(failed)
            self._cond.notify_all()
        if failed and not late:
            health.record_dropped(self.output, failed, "export failed (endpoint down, refusing or unreachable?)")

    def _count_dropped_locked(self, count: int) -> None:
        self.dropped += count
        self.done += count

    def _after_fork_in_child(self) -> None:
        self._start_empty()  # the parent's queue is the parent's to export

