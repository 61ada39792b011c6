"""LLM-server events: the server side of one generate call and the engine's timing."""

from __future__ import annotations

from typing import Any, ContextManager, Dict, Mapping, Optional

from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind

from otel_verl import carriers, health, semconv as sc, server_timing
from otel_verl.semconv import Subject
from otel_verl.events import _core
from otel_verl.events._core import SpanScope, _is_number, _start, _text


_SERVER_CALL_KEY = otel_context.create_key("otel_verl.llm_server_call")


class ServerCall(SpanScope):
    """The ``with`` block of :func:`llm_server_call`, and what it yields: collects the
    engine's per-request timing."""

    key = _SERVER_CALL_KEY

    def __init__(self, span: Any, headers: Optional[Mapping[str, str]], provider: str = "") -> None:
        super().__init__(span)
        self.headers = dict(headers or {})
        self.provider = provider
        self.meta: Dict[str, float] = {}

    def value(self) -> "ServerCall":
        return self

    @health.guarded(default=None)
    def record_meta(self, meta: Mapping[str, Any]) -> None:
        """Keep the numeric keys of an engine's meta_info (names vary by version)."""
        for key, value in meta.items():
            if _is_number(value):
                self.meta[str(key)] = value
                if self.span is not None:
                    self.span.set_attribute(sc.llm_server_meta_attribute(key), value)

    def _ending(self, error: Optional[BaseException]) -> None:
        # Said once per process (a health note), not per request: every request of a server
        # without its metrics lacks the timing alike.
        if error is None and self.provider == "sglang" and server_timing.timing_missing(self.meta):
            health.record_note(server_timing.TIMING_MISSING, server_timing.TIMING_MISSING_MESSAGE)


def llm_server_call(headers: Optional[Mapping[str, str]], *, request_id: str, provider: str) -> ContextManager[ServerCall]:
    """The server side of one generate call, parented to the worker's turn span."""
    try:
        headers = _text_headers(headers)
        parent = carriers.context_from(headers) if headers else None
        if parent is None:
            return ServerCall(None, headers, provider)
        span = _start(
            sc.SPAN_LLM_SERVER,
            Subject.LLM_SERVER,
            parent,
            {sc.LLM_REQUEST_ID: _text(request_id), sc.GEN_AI_PROVIDER_NAME: _text(provider)},
            kind=SpanKind.SERVER,
            skippable=True,  # the engine's timing goes back to the worker's turn without it
        )
        return ServerCall(span, headers, provider)
    except Exception as exc:  # never into the server's request: it runs untraced
        health.record_failure("events.llm_server_call", exc)
        return ServerCall(None, None, provider)


def _text_headers(headers: Any) -> Dict[str, str]:
    """The text headers of what the caller passed (a dict, or a bare traceparent): only
    text carries a context, and the engine is handed these again (sglang's
    ``external_trace_header``)."""
    if isinstance(headers, str):
        return {"traceparent": headers}
    if not isinstance(headers, Mapping):
        return {}
    return {key: value for key, value in headers.items() if type(key) is str and isinstance(value, str)}


def current_server_call() -> Optional[ServerCall]:
    return _core.current(_SERVER_CALL_KEY)
