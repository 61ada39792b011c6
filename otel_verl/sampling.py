"""Per-sample sampling, uid-derived ids, and the provider's list of span processors.

- :class:`UidIdGenerator` gives the next root span the ids derived from its uid (see
  :mod:`otel_verl.ids`), so a sample's trace id is the same in every process.
- :func:`record_dropped_samples` wraps the standard ``OTEL_TRACES_SAMPLER`` so that a
  span it would drop is still recorded (``RECORD_ONLY``): legacy processors see every
  span, while the OTLP outputs export only sampled ones.
- :class:`IsolatingSpanProcessor` is the provider's list of processors with each one's
  exceptions counted instead of raised: the SDK's ``SynchronousMultiSpanProcessor`` calls
  them in a row without catching, so one raising processor (ours or another library's)
  would reach the traced code and keep the processors after it from seeing the span.
  Its flush and shutdown give the processors one deadline and wait for none past it.
"""

from __future__ import annotations

import contextvars
import inspect
from typing import Any, Dict, Optional, Tuple

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

from otel_verl import health
from otel_verl.deadline import Call, Deadline, Late
from otel_verl.payload import payload_of
from otel_verl.settings import DEFAULT_SHUTDOWN_TIMEOUT_S

# Of a flush's or shutdown's deadline, what each later finish order (the metrics, the
# loss file) keeps: at most this many seconds, at most this share of what is left.
LATER_FINISH_RESERVE_S = 1.0
LATER_FINISH_SHARE = 0.1

_next_ids: contextvars.ContextVar[Optional[Tuple[int, int]]] = contextvars.ContextVar("otel_verl_next_ids", default=None)


class UidIdGenerator(RandomIdGenerator):
    """Random ids, except for the one root span announced with :meth:`next_ids`."""

    def next_ids(self, trace_id: int, span_id: int) -> None:
        _next_ids.set((trace_id, span_id))

    def generate_trace_id(self) -> int:
        ids = _next_ids.get()
        return ids[0] if ids is not None else super().generate_trace_id()

    def generate_span_id(self) -> int:
        ids = _next_ids.get()
        if ids is not None:
            _next_ids.set(None)  # the root's span id is used once; its children get random ids
            return ids[1]
        return super().generate_span_id()

    def is_trace_id_random(self) -> bool:
        return False


_MASK_64 = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15F39CC0605CEDC835  # odd 128-bit constant (golden ratio based)


def mixed_trace_id(trace_id: int) -> int:
    """The trace id as ratio samplers should see it.

    ``TraceIdRatioBased`` compares the low 64 bits with a bound, assuming they are
    uniformly random. A uid's UUID4 bits are not: the variant bits sit at the top of the
    low half, so a 0.5 ratio would keep nothing. A multiplicative hash spreads all 128
    bits over the low half (random ids stay uniform) and is the same in every process.
    """
    return ((trace_id * _MIX) >> 64) & _MASK_64


class RecordDroppedSamples(Sampler):
    """``inner``'s decision on the mixed trace id, with DROP turned into RECORD_ONLY."""

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner

    def is_sampled(self, trace_id: int) -> bool:
        """The root decision for a trace (used where a parent must be synthesised)."""
        result = self.inner.should_sample(None, mixed_trace_id(trace_id), "verl.sample")
        return result.decision.is_sampled()

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
        result = self.inner.should_sample(parent_context, mixed_trace_id(trace_id), name, kind, attributes, links, trace_state)
        if result.decision is Decision.DROP:
            # A dropping sampler returns no attributes, and the SDK gives a span the
            # sampler's attributes: hand the caller's back so legacy outputs keep them.
            return SamplingResult(Decision.RECORD_ONLY, attributes, result.trace_state)
        return result

    def get_description(self) -> str:
        return f"RecordDroppedSamples{{{self.inner.get_description()}}}"


def record_dropped_samples(inner: Optional[Sampler] = None) -> Sampler:
    return RecordDroppedSamples(inner if inner is not None else sampler_from_env())


def sampler_from_env() -> Sampler:
    """The sampler ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` name, read by the
    SDK itself: a provider built without a sampler takes that one (public ``sampler``)."""
    return TracerProvider(shutdown_on_exit=False).sampler


class IsolatingSpanProcessor(SpanProcessor):
    """Calls every processor in turn; a processor's exception is counted under
    ``span_processor.{Class}.{method}`` and never reaches the span's caller or the
    processors after it (the SDK's multi-processors call them without catching).

    A processor may say which spans it reads (``on_start_subjects`` / ``on_end_subjects``: the
    :class:`~otel_verl.semconv.Subject` of the span's payload, ``None`` for every span); it is
    not called for the others. A rollout worker's LLM, tool and reward spans then reach
    only the processors that write something for them."""

    def __init__(self, timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s  # a flush or shutdown given no timeout
        self.processors: Tuple[SpanProcessor, ...] = ()
        self._starts: Dict[Any, Tuple[SpanProcessor, ...]] = {}  # payload subject -> who reads its starts
        self._ends: Dict[Any, Tuple[SpanProcessor, ...]] = {}
        self._read: Dict[Any, bool] = {}  # payload subject -> whether anyone reads its spans

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        self.processors += (span_processor,)
        self._starts.clear()
        self._ends.clear()
        self._read.clear()

    def reads(self, subject: Any) -> bool:
        """Whether a processor reads the start or the end of spans of ``subject``."""
        read = self._read.get(subject)
        if read is None:
            read = self._read[subject] = bool(_readers(self.processors, "on_start_subjects", subject)
                                              or _readers(self.processors, "on_end_subjects", subject))
        return read

    def on_start(self, span, parent_context=None) -> None:
        for sp in self._readers(span, self._starts, "on_start_subjects"):
            try:
                sp.on_start(span, parent_context=parent_context)
            except Exception as exc:
                _processor_failed(sp, "on_start", exc)

    def on_end(self, span: ReadableSpan) -> None:
        for sp in self._readers(span, self._ends, "on_end_subjects"):
            try:
                sp.on_end(span)
            except Exception as exc:
                _processor_failed(sp, "on_end", exc)

    def _readers(self, span: Any, known: Dict[Any, Tuple[SpanProcessor, ...]], says: str) -> Tuple[SpanProcessor, ...]:
        """The processors that read ``span`` (by its subject; ``says``: the attribute in which
        a processor names the subjects it reads), worked out once a subject."""
        subject = _subject_of(span)
        readers = known.get(subject)
        if readers is None:
            readers = known[subject] = _readers(self.processors, says, subject)
        return readers

    def shutdown(self, timeout_millis: Optional[int] = None) -> None:
        """Shuts every processor down within one deadline (``timeout_millis``, else
        :attr:`timeout_s`), in the order of :func:`finish_order`. Within an order, a
        processor whose ``shutdown`` takes ``timeout_millis`` is called in turn with what is
        left, and keeps it, counting what it could not export; the others run meanwhile,
        each on a thread of its own, and are waited for until the deadline only: one that
        is late is counted as failed."""
        for processors, deadline in self._in_order(timeout_millis):
            self._shut_down(processors, deadline)

    def _in_order(self, timeout_millis: Optional[int]):
        """The processors by :func:`finish_order`, each order with its share of one
        deadline: each later order keeps a share for itself."""
        deadline = self._deadline(timeout_millis)
        orders = sorted({finish_order(sp) for sp in self.processors})
        for i, order in enumerate(orders):
            later = len(orders) - 1 - i
            reserve = later * min(LATER_FINISH_RESERVE_S, deadline.left_s() * LATER_FINISH_SHARE)
            yield [sp for sp in self.processors if finish_order(sp) == order], Deadline(deadline.left_s() - reserve)

    @staticmethod
    def _shut_down(processors: list, deadline: Deadline) -> None:
        others = [(sp, Call(sp.shutdown)) for sp in processors if not _takes_timeout(sp.shutdown)]
        for sp in processors:
            if _takes_timeout(sp.shutdown):
                try:
                    sp.shutdown(timeout_millis=deadline.left_ms())
                except Exception as exc:
                    _processor_failed(sp, "shutdown", exc)
        for sp, call in others:
            try:
                call.result(deadline)
            except Exception as exc:
                _processor_failed(sp, "shutdown", exc)

    def force_flush(self, timeout_millis: Optional[int] = None) -> bool:
        """Flushes the processors in the order of :func:`finish_order` within one deadline
        (``timeout_millis``, else :attr:`timeout_s`), those of one order at once, each on a
        thread of its own, waiting for none past its order's share: the SDK's batch
        processor exports its whole queue whatever the timeout."""
        flushed = True
        for processors, deadline in self._in_order(timeout_millis):
            calls = [(sp, Call(sp.force_flush, deadline.left_ms())) for sp in processors]
            for sp, call in calls:
                try:
                    flushed = call.result(deadline) is not False and flushed
                except Late:
                    flushed = False
                except Exception as exc:
                    _processor_failed(sp, "force_flush", exc)
                    flushed = False
        return flushed

    def _deadline(self, timeout_millis: Optional[int]) -> Deadline:
        return Deadline(self.timeout_s if timeout_millis is None else timeout_millis / 1000)


def finish_order(processor: Any) -> int:
    """When a processor finishes in a flush or a shutdown: its ``finish_order`` (default
    0), lowest first. The metrics (1) and the loss file (2) come last, so that they see
    what the outputs before them wrote and counted."""
    return getattr(processor, "finish_order", 0)


def _takes_timeout(method: Any) -> bool:
    try:
        return "timeout_millis" in inspect.signature(method).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


def _readers(processors: Tuple[SpanProcessor, ...], attribute: str, subject: Any) -> Tuple[SpanProcessor, ...]:
    """The processors that read spans of ``subject`` (``None``: spans without a payload)."""
    return tuple(sp for sp in processors if getattr(sp, attribute, None) is None or subject in getattr(sp, attribute))


def _subject_of(span: Any) -> Any:
    found = payload_of(span)
    return found.subject if found is not None else None


def _processor_failed(processor: Any, method: str, exc: BaseException) -> None:
    health.record_failure(f"span_processor.{type(processor).__name__}.{method}", exc)
