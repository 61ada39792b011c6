"""LLM-server events: the server side of one generate call and the engine's timing."""

from __future__ import annotations

from typing import Any, ContextManager, Dict, Mapping, Optional

from opentelemetry.trace import SpanKind

from otel_verl import carriers, current_span, health, semconv as sc
from otel_verl.lean_span import set_trusted
from otel_verl.semconv import Kind
from otel_verl.events import _core
from otel_verl.events._core import (
    _is_number,
    _text,
    _start_guarded,
    KeyedScope,
)


class ServerCall:
    """What :func:`llm_server_call` yields: collects the engine's per-request timing."""

    __slots__ = ("span", "meta", "headers")

    def __init__(self, span: Any, headers: Optional[Mapping[str, str]]) -> None:
        self.span = span
        self.headers = dict(headers or {})
        self.meta: Dict[str, float] = {}

    @health.guarded(default=None)
    def record_meta(self, meta: Mapping[str, Any]) -> None:
        """Keep the numeric keys of an engine's meta_info (names vary by version)."""
        for key, value in meta.items():
            if _is_number(value):
                self.meta[str(key)] = value
                if self.span is not None:
                    set_trusted(self.span, sc.llm_server_meta_attribute(key), value)


_SERVER_CALL_KEY = current_span.create_key("otel_verl.llm_server_call")  # (see SpanScope)


def llm_server_call(headers: Optional[Mapping[str, str]], *, request_id: str, provider: str) -> ContextManager[ServerCall]:
    """The server side of one generate call, parented to the worker's turn span."""
    rt = _core._runtime
    parent = carriers.context_from(headers) if headers else None
    if rt is None or parent is None:
        call = ServerCall(None, headers)
        return KeyedScope(None, call, _SERVER_CALL_KEY, call)
    span = _start_guarded(
        sc.SPAN_LLM_SERVER,
        Kind.LLM_SERVER,
        parent,
        {sc.LLM_REQUEST_ID: _text(request_id), sc.GEN_AI_PROVIDER_NAME: _text(provider)},
        kind=SpanKind.SERVER,
    )
    call = ServerCall(span, headers)
    return KeyedScope(span, call, _SERVER_CALL_KEY, call)


def current_server_call() -> Optional[ServerCall]:
    return current_span.value(_SERVER_CALL_KEY)
