"""Shared plumbing of the events API: the runtime handed over by bootstrap, bounded text,
the open-sample registry, the validation flag and the span helpers."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Mapping, Optional

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from otel_verl import health, payload, semconv as sc
from otel_verl.ids import root_span_id_for_uid, trace_id_for_uid, well_formed
from otel_verl.payload import Payload
from otel_verl.semconv import Subject, Outcome

# --------------------------------------------------------------------------- runtime


class _Runtime:
    """What :func:`otel_verl.bootstrap.configure` hands to the events API."""

    def __init__(self, tracer: trace.Tracer, id_generator: Any, settings: Any, sampler: Any = None) -> None:
        self.tracer = tracer
        self.ids = id_generator
        self.settings = settings
        self.sampler = sampler  # decides synthesised parents (sample roots seen without a carrier)
        self.samples = _SampleRegistry(settings.max_open_samples)
        self.capture_content = bool(getattr(settings, "capture_content", False))


_runtime: Optional[_Runtime] = None


def _install(runtime: Optional[_Runtime]) -> None:
    global _runtime
    _runtime = runtime


def enabled() -> bool:
    return _runtime is not None


# --------------------------------------------------------------------------- helpers


def _now_ns() -> int:
    return time.time_ns()


def _text(value: Any) -> str:
    """Free text bound for an attribute or span name (names, labels; ids: ``id_str``)."""
    s = value if isinstance(value, str) else str(value)
    return well_formed(s if len(s) <= sc.MAX_TEXT_CHARS else s[: sc.MAX_TEXT_CHARS])


def _is_number(value: Any) -> bool:
    """An int or float (numpy's float64 too), not a bool: a server meta value worth keeping."""
    vtype = type(value)
    return vtype is float or vtype is int or (vtype is not bool and isinstance(value, (int, float)))


def _capturing_content() -> bool:
    """Message content goes on spans only when OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT opts in."""
    rt = _runtime
    return rt is not None and rt.capture_content


def _content(value: Any) -> str:
    s = value if isinstance(value, str) else str(value)
    return s if len(s) <= sc.MAX_CONTENT_CHARS else s[: sc.MAX_CONTENT_CHARS]


def _sample_root_context(uid: str) -> otel_context.Context:
    """Parent for a span of sample ``uid`` when no carrier came with it: the sample
    root's derived ids (see :func:`otel_verl.ids.root_span_id_for_uid`)."""
    trace_id = trace_id_for_uid(uid)
    sampler = getattr(_runtime, "sampler", None) if _runtime is not None else None
    sampled = sampler.is_sampled(trace_id) if hasattr(sampler, "is_sampled") else True
    parent = SpanContext(
        trace_id=trace_id,
        span_id=root_span_id_for_uid(uid),
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT),
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


def _end(span: Any, outcome: Optional[str] = None, error: Optional[BaseException] = None) -> None:
    if error is not None:
        # repaired here too: a provider of someone else's makes the SDK's spans
        span.set_status(Status(StatusCode.ERROR, well_formed(f"{type(error).__name__}: {error}"[:256])))
        span.set_attribute(sc.ERROR_TYPE, _text(type(error).__qualname__))
    if outcome is not None:
        span.set_attribute(sc.SAMPLE_OUTCOME, outcome)
    payload.end_span(span)




class _SampleEntry:
    __slots__ = ("root", "rollout", "step")

    def __init__(self, root: Any, step: int) -> None:
        self.root = root
        self.rollout: Any = None
        self.step = step


class _SampleRegistry:
    """Open sample root spans on the trainer, bounded: the oldest is ended (with an
    explanatory outcome) when the limit is reached, so nothing stays open forever."""

    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._open: "OrderedDict[str, _SampleEntry]" = OrderedDict()
        self._lock = threading.Lock()

    def add(self, uid: str, entry: _SampleEntry) -> None:
        evicted = []
        with self._lock:
            self._open[uid] = entry
            while len(self._open) > self._limit:
                evicted.append(self._open.popitem(last=False)[1])
        for old in evicted:
            _end_sample_entry(old, Outcome.OPEN_LIMIT.value)

    def get(self, uid: str) -> Optional[_SampleEntry]:
        return self._open.get(uid)

    def pop(self, uid: str) -> Optional[_SampleEntry]:
        with self._lock:
            return self._open.pop(uid, None)

    def created_before(self, step: int) -> List[str]:
        with self._lock:
            return [uid for uid, entry in self._open.items() if entry.step < step]

    def uids(self) -> List[str]:
        with self._lock:
            return list(self._open)

    def drain(self) -> List[_SampleEntry]:
        with self._lock:
            entries = list(self._open.values())
            self._open.clear()
        return entries

    def __len__(self) -> int:
        return len(self._open)


def _end_sample_entry(entry: _SampleEntry, outcome: str) -> None:
    if entry.rollout is not None and entry.rollout.is_recording():
        _end(entry.rollout, outcome)
    _end(entry.root, outcome)


_validating: contextvars.ContextVar[bool] = contextvars.ContextVar("otel_verl_validating", default=False)


@contextlib.contextmanager
def validating() -> Iterator[None]:
    """Marks a validation pass: its samples are not traced (unless switched on) and never
    reach the legacy outputs."""
    with _set(_validating, True):
        yield


def is_validating() -> bool:
    return _validating.get()



def _skip_validation(validate: Optional[bool]) -> bool:
    return _is_validation(validate) and not _runtime.settings.trace_validation


def _is_validation(validate: Optional[bool]) -> bool:
    return bool(_validating.get() if validate is None else validate)


def _with_validate(attrs: Dict[str, Any], validate: Optional[bool]) -> Dict[str, Any]:
    """Traced validation spans say so (legacy outputs skip them)."""
    if _is_validation(validate):
        attrs[sc.VALIDATE] = True
    return attrs



# --------------------------------------------------------------------------- span plumbing


def _start(
    name: str,
    subject: Subject,
    context: Optional[otel_context.Context],
    attributes: Mapping[str, Any],
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    data: Any = None,
    **more: Any,
) -> Any:
    """Start a span carrying ``Payload(subject, data)``, or return ``None`` (counted) when
    tracing is off or fails."""
    rt = _runtime
    if rt is None:
        return None
    try:
        return payload.start_span(rt.tracer, name, Payload(subject, data), context=context, kind=kind,
                                  attributes=attributes, **more)
    except Exception as exc:
        health.record_failure("events.start_span", exc)
        return None


@contextlib.contextmanager
def current_span_scope(span: Any) -> Iterator[None]:
    """Make ``span`` the current span inside the block (nothing when ``None``)."""
    if span is None:
        yield
        return
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        otel_context.detach(token)


@contextlib.contextmanager
def _set(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        try:
            var.reset(token)
        except ValueError:
            pass


class SpanScope:
    """The ``with`` block of one span: inside, the span is the current span and ``key``
    (a context key of ``opentelemetry.context.create_key``) holds this scope; on exit
    the span ends, failed when the block raised (the exception goes on untouched).
    ``span`` may be ``None``: nothing to make current or end. The block gets what
    :meth:`value` returns. Subclasses add to the exit in :meth:`_ending` (span still
    open) and :meth:`_ended`."""

    key: Optional[str] = None

    def __init__(self, span: Any) -> None:
        self.span = span
        self._token: Any = None

    def value(self) -> Any:
        return None

    def __enter__(self) -> Any:
        ctx = None
        if self.span is not None:
            ctx = trace.set_span_in_context(self.span)
        if self.key is not None:
            ctx = otel_context.set_value(self.key, self, ctx)
        if ctx is not None:
            self._token = otel_context.attach(ctx)
        return self.value()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        try:
            self._ending(exc)
        except Exception as inner:  # the span still ends
            health.record_failure("events.span_ending", inner)
        if self.span is not None:
            try:
                _end(self.span, error=exc)
            except Exception as inner:
                health.record_failure("events.end_span", inner)
        try:
            self._ended(exc)
        except Exception as inner:
            health.record_failure("events.span_ended", inner)
        if self._token is not None:
            otel_context.detach(self._token)
        return False

    def _ending(self, error: Optional[BaseException]) -> None:
        """Before the span ends."""

    def _ended(self, error: Optional[BaseException]) -> None:
        """After the span ended."""


def current(key: str) -> Any:
    """The scope the current context holds under ``key`` (``None`` if none)."""
    return otel_context.get_value(key)
