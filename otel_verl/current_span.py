"""The current span, read and made current through OpenTelemetry's runtime context.

With the API's default runtime context (``contextvars_context``, unless
``OTEL_PYTHON_CONTEXT`` names another) the context lives in one ``ContextVar``; the events
API reads and sets it there directly, as ``trace.get_current_span`` and
``context.attach(trace.set_span_in_context(span))`` would, without their layers of calls
(several spans start per LLM turn in a rollout worker). Any other runtime context goes
through the API. Which one it is is decided once, at import, as the API itself loads its
runtime context once (``opentelemetry.context._RUNTIME_CONTEXT``).
"""

from __future__ import annotations

from typing import Any, Optional

from opentelemetry import context as otel_context
from opentelemetry import trace

try:  # API internals: an API release without them takes the API's path
    from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
    from opentelemetry.trace.propagation import _SPAN_KEY
except ImportError:  # pragma: no cover
    ContextVarsRuntimeContext = _SPAN_KEY = None


def _context_var() -> Optional[Any]:
    runtime = getattr(otel_context, "_RUNTIME_CONTEXT", None)
    if ContextVarsRuntimeContext is not None and type(runtime) is ContextVarsRuntimeContext:
        return getattr(runtime, "_current_context", None)
    return None


_VAR = _context_var()
_INVALID = trace.INVALID_SPAN
_Context = otel_context.Context
_set_item = dict.__setitem__
_span_types: set = set()  # the Span classes seen current (a handful)


def get() -> Any:
    """``trace.get_current_span()``."""
    return of(None)


def of(context: Any) -> Any:
    """``trace.get_current_span(context)``: the span in ``context`` (the current one for ``None``)."""
    if _VAR is None:
        return trace.get_current_span(context)
    span = (_VAR.get() if context is None else context).get(_SPAN_KEY)
    if type(span) in _span_types:  # (an ABC's isinstance is a Python call)
        return span
    return _span_or_invalid(span)


def _span_or_invalid(span: Any) -> Any:
    if span is None:
        return _INVALID
    if isinstance(span, trace.Span):
        _span_types.add(type(span))
        return span
    return _INVALID


def make_current(span: Any, key: Optional[str] = None, value: Any = None) -> Any:
    """``context.attach(trace.set_span_in_context(span))``, with ``key`` set to ``value``
    in the same context (``context.set_value``; ``span`` may be ``None``: the current one
    stays): the token for :func:`restore`. One context and one token for both: the
    events API keeps its own state (the trajectory, the turn) under keys of its own in
    the OpenTelemetry context, where it follows the span into tasks and copied contexts."""
    if _VAR is None:
        context = trace.set_span_in_context(span) if span is not None else otel_context.get_current()
        if key is not None:
            context = otel_context.set_value(key, value, context)
        return otel_context.attach(context)
    # the new Context made once (not a dict, then the Context copied from it): it is set
    # through dict's own __setitem__, which Context refuses to its users
    context = _Context(_VAR.get())
    if span is not None:
        _set_item(context, _SPAN_KEY, span)
    if key is not None:
        _set_item(context, key, value)
    return _VAR.set(context)


def value(key: str) -> Any:
    """``context.get_value(key)`` of the current context."""
    if _VAR is None:
        return otel_context.get_value(key)
    return _VAR.get().get(key)


def create_key(name: str) -> str:
    """A context key of our own (``context.create_key``)."""
    return otel_context.create_key(name)


def restore(token: Any) -> None:
    """``context.detach(token)``; raises where the token belongs to another context."""
    if _VAR is None:
        otel_context.detach(token)
    else:
        _VAR.reset(token)
