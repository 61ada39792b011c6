"""Shared plumbing of the events API: the tracing state (one object, one slot), bounded text,
the open-span registries, the validation flag and the span helpers."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from otel_verl import forks, health, payload, semconv as sc
from otel_verl.ids import root_span_id_for_uid, trace_id_for_uid, well_formed
from otel_verl.payload import Payload
from otel_verl.semconv import Subject, Outcome

# --------------------------------------------------------------------------- state


class TracingState:
    """The run's tracing state in this process: what the events API reports to (the
    provider, its tracer and ids, otel_verl's settings, the sampler) and the spans it
    keeps open between calls (sample roots, prompt tasks, the trainer's step and stages).

    Built by :func:`otel_verl.instrumentation.tracing.use_provider` and installed in the
    process's one slot; :meth:`activated` makes another one current for a block (a
    context, so each thread and asyncio task sees its own)."""

    def __init__(self, provider: Any, tracer: trace.Tracer, id_generator: Any, settings: Any,
                 sampler: Any = None) -> None:
        self.provider = provider
        self.tracer = tracer
        self.ids = id_generator
        self.settings = settings
        self.sampler = sampler  # decides synthesised parents (sample roots seen without a carrier)
        self.capture_content = bool(getattr(settings, "capture_content", False))
        # whether the provider's processors read spans of a subject (a provider not ours: yes)
        self._reads: Optional[Callable[[Subject], bool]] = getattr(getattr(tracer, "processor", None), "reads", None)
        self._new_registries()

    def reads(self, subject: Subject) -> bool:
        """Whether an output reads spans of ``subject``."""
        return self._reads is None or self._reads(subject)

    def _new_registries(self) -> None:
        limit = self.settings.max_open_samples
        self.samples = _OpenRegistry(limit, _end_sample_entry)  # uid -> _SampleEntry (trainer)
        self.prompt_tasks = _OpenRegistry(limit, _end)  # uid -> prompt-task span (v1 rollout worker)
        self.trainer = _TrainerSpans()

    def after_fork(self) -> None:
        """In a forked child: the parent's open spans are the parent's to end, and a lock
        another thread held at fork time would never be released here."""
        self._new_registries()

    @contextlib.contextmanager
    def activated(self) -> Iterator["TracingState"]:
        """The events API reports to this state inside the block."""
        token = _active.set(self)
        try:
            yield self
        finally:
            _active.reset(token)


_installed: Optional[TracingState] = None  # the process's one slot
_install_lock = threading.Lock()
_active: contextvars.ContextVar[Optional[TracingState]] = contextvars.ContextVar("otel_verl_tracing", default=None)


def install(tracing: Optional[TracingState]) -> None:
    """Make ``tracing`` the process's state (``None``: the events API reports nowhere)."""
    global _installed
    with _install_lock:
        _installed = tracing


def install_for(provider: Any, build: Callable[[], TracingState]) -> None:
    """Make ``build()`` the process's state unless the installed one reports to
    ``provider`` already: handing over the same provider twice (two wrappers firing at
    once, a configurator and an instrumentor) keeps its open samples."""
    global _installed
    with _install_lock:
        if _installed is None or _installed.provider is not provider:
            _installed = build()


def state() -> Optional[TracingState]:
    """The state the events API reports to here: the activated one, else the installed one."""
    return _active.get() or _installed


def enabled() -> bool:
    return state() is not None


@forks.in_child
def _reset_in_child() -> None:
    global _install_lock
    _install_lock = threading.Lock()  # another thread may have held it at fork time
    if _installed is not None:
        _installed.after_fork()


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
    rt = state()
    return rt is not None and rt.capture_content


def _content(value: Any) -> str:
    s = value if isinstance(value, str) else str(value)
    return s if len(s) <= sc.MAX_CONTENT_CHARS else s[: sc.MAX_CONTENT_CHARS]


def _sample_root_context(uid: str) -> otel_context.Context:
    """Parent for a span of sample ``uid`` when no carrier came with it: the sample
    root's derived ids (see :func:`otel_verl.ids.root_span_id_for_uid`)."""
    trace_id = trace_id_for_uid(uid)
    rt = state()
    sampler = rt.sampler if rt is not None else None
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


class _OpenRegistry:
    """What the events API keeps open between calls, by key (a uid), bounded: the oldest
    is ended with an explanatory outcome when the limit is reached, so nothing stays open
    forever. ``end(value, outcome)`` ends a value."""

    def __init__(self, limit: int, end: Callable[[Any, str], None]) -> None:
        self._limit = max(1, limit)
        self._end = end
        self._open: "OrderedDict[str, Any]" = OrderedDict()
        self._lock = threading.Lock()

    def add(self, key: str, value: Any) -> None:
        evicted = []
        with self._lock:
            previous = self._open.pop(key, None)
            self._open[key] = value
            while len(self._open) > self._limit:
                evicted.append(self._open.popitem(last=False)[1])
        if previous is not None:  # opened again (a re-issued prompt): the earlier one is over
            self._end(previous, Outcome.EVICTED.value)
        for old in evicted:
            self._end(old, Outcome.OPEN_LIMIT.value)

    def get(self, key: str) -> Any:
        return self._open.get(key)

    def pop(self, key: str) -> Any:
        with self._lock:
            return self._open.pop(key, None)

    def keys(self) -> List[str]:
        with self._lock:
            return list(self._open)

    def matching(self, keep: Callable[[Any], bool]) -> List[str]:
        """The keys whose value ``keep`` accepts."""
        with self._lock:
            return [key for key, value in self._open.items() if keep(value)]

    def drain(self) -> List[Any]:
        with self._lock:
            values = list(self._open.values())
            self._open.clear()
        return values

    def __len__(self) -> int:
        return len(self._open)


class _TrainerSpans:
    """The trainer's open step span and stage spans. A step ends when the next begins
    (or explicitly); stage spans parent to the open step of the same global step."""

    def __init__(self) -> None:
        self.step: Any = None
        self.step_number: Optional[int] = None
        self.stages: List[Any] = []
        self.lock = threading.Lock()


def _end_sample_entry(entry: _SampleEntry, outcome: str) -> None:
    if entry.rollout is not None and entry.rollout.is_recording():
        _end(entry.rollout, outcome)
    _end(entry.root, outcome)


_validating: contextvars.ContextVar[bool] = contextvars.ContextVar("otel_verl_validating", default=False)


@contextlib.contextmanager
def validating() -> Iterator[None]:
    """Marks a validation pass: its samples are not traced unless switched on, and then
    say so on their spans."""
    with _set(_validating, True):
        yield


def is_validating() -> bool:
    return _validating.get()



def _skip_validation(validate: Optional[bool]) -> bool:
    return _is_validation(validate) and not state().settings.trace_validation


def _is_validation(validate: Optional[bool]) -> bool:
    return bool(_validating.get() if validate is None else validate)


def _with_validate(attrs: Dict[str, Any], validate: Optional[bool]) -> Dict[str, Any]:
    """Traced validation spans say so (outputs of training data skip them)."""
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
    skippable: bool = False,
    **more: Any,
) -> Any:
    """Start a span carrying ``Payload(subject, data)``, or return ``None`` when tracing is
    off or fails (counted), or when the span is ``skippable`` (no other span needs what it
    records) and no output reads spans of its subject."""
    rt = state()
    if rt is None:
        return None
    try:
        # (in the try: which subjects a processor reads is its own to say, rightly or not)
        if skippable and not rt.reads(subject):
            return None
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
