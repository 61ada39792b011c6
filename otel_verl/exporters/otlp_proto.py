"""OTLP protobuf encoding of spans, written straight to wire bytes; the OTLP exporters
otel_verl builds use it.

The SDK's encoder (``opentelemetry.exporter.otlp.proto.common``) builds a protobuf
message object per span, per attribute and per value, then serialises them: ~100 µs per
span of a rollout worker (15-20 attributes) on the BatchSpanProcessor's thread, which
shares the GIL with the agent loop. :func:`encode_spans_bytes` writes the same
``ExportTraceServiceRequest`` bytes directly (field numbers of
``opentelemetry/proto/trace/v1/trace.proto``), with an attribute's encoding cached by
(key, type, value): the ids, names and step numbers repeat from span to span. The tests
parse its output with the official messages and compare with the SDK's encoding.

Anything it does not know how to encode (a value type the SDK would reject too, a
mapping value) falls back to the SDK encoder for that batch: never less than the SDK.

The exporters send a batch as requests of at most :data:`MAX_REQUEST_BYTES` (see
:func:`encode_requests`): OTLP/gRPC receivers refuse larger messages by default.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Dict, List, Tuple

from opentelemetry.trace import SpanKind, StatusCode

LeanSpan = None  # (interim: the module is being replaced by the SDK exporters)

logger = logging.getLogger("otel_verl")

_pack_double = struct.Struct("<d").pack
_pack_fixed64 = struct.Struct("<Q").pack
_pack_fixed32 = struct.Struct("<I").pack

_CONTEXT_HAS_IS_REMOTE = 0x100  # SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_CONTEXT_IS_REMOTE = 0x200  # SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK


class _Unsupported(Exception):
    """A value this encoder leaves to the SDK's."""


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,)) if n >= 0 else _varint(n + (1 << 64))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes((i,)) for i in range(0x80)]


def _len(n: int) -> bytes:
    return _SMALL[n] if n < 0x80 else _varint(n)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field: ``tag`` is the field's key byte (number << 3 | 2)."""
    n = len(payload)
    return bytes((tag,)) + (_SMALL[n] if n < 0x80 else _varint(n)) + payload


def _string(tag: int, text: str) -> bytes:
    return _field(tag, text.encode("utf-8"))


def _any_value(value: Any) -> bytes:
    """An ``AnyValue`` message's content (without its own key and length)."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _string(0x0A, value)
    if isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 63):
            raise _Unsupported("int64 overflow")  # the SDK drops the attribute (and logs)
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _pack_double(value)
    if isinstance(value, bytes):
        return _field(0x3A, value)
    if isinstance(value, Sequence):
        return _field(0x2A, b"".join([_field(0x0A, _any_value(v)) for v in value]))
    raise _Unsupported(type(value).__name__)


# Encoded ``KeyValue`` fields by (key, value type, value), one cache per field tag: the
# ids, names, step numbers and finish reasons repeat from span to span.
_kv_caches: Dict[int, Dict[Tuple[str, type, Any], bytes]] = {}
_KV_CACHE_LIMIT = 8192
_CACHED_TYPES = frozenset((str, int, float, bool))


def _key_value(key: str, value: Any) -> bytes:
    """One ``KeyValue`` message's content."""
    return _string(0x0A, key) + _field(0x12, _any_value(value))


def _attributes(tag: int, attributes: Any) -> bytes:
    """The repeated ``KeyValue`` field ``tag`` for every attribute."""
    if not attributes:
        return b""
    # the SDK's BoundedAttributes behind a ReadableSpan's read-only view: iterating its
    # plain dict skips a Mapping-protocol call per key
    attributes = getattr(attributes, "_dict", attributes)
    cache = _kv_caches.get(tag)
    if cache is None:
        cache = _kv_caches[tag] = {}
    parts: List[bytes] = []
    for key, value in attributes.items():
        vtype = type(value)
        if vtype in _CACHED_TYPES or (vtype is tuple and len(value) == 1 and type(value[0]) is str):
            # (a one-string tuple: True == 1 would make (True,) and (1,) one key)
            ck = (key, vtype, value)
            enc = cache.get(ck)
            if enc is None:
                enc = _field(tag, _key_value(key, value))
                if len(cache) >= _KV_CACHE_LIMIT:
                    cache.clear()
                cache[ck] = enc
            parts.append(enc)
        elif isinstance(value, Mapping):
            raise _Unsupported("mapping")
        else:
            parts.append(_field(tag, _key_value(key, value)))
    return b"".join(parts)


_resource_cache: Dict[int, Tuple[Any, bytes]] = {}


def _resource(resource: Any) -> bytes:
    """A ``Resource`` message's content, cached per resource object (one per process)."""
    hit = _resource_cache.get(id(resource))
    if hit is not None and hit[0] is resource:
        return hit[1]
    enc = _attributes(0x0A, resource.attributes)
    if len(_resource_cache) > 64:
        _resource_cache.clear()
    _resource_cache[id(resource)] = (resource, enc)
    return enc


def _scope(scope: Any) -> bytes:
    if scope is None:
        return b""
    out = b""
    if scope.name:
        out += _string(0x0A, scope.name)
    if scope.version:
        out += _string(0x12, scope.version)
    return out + _attributes(0x1A, getattr(scope, "attributes", None))


def _trace_state(trace_state: Any) -> str:
    if not trace_state:
        return ""
    return ",".join(f"{k}={v}" for k, v in trace_state.items())


def _flags(parent: Any) -> int:
    return _CONTEXT_HAS_IS_REMOTE | _CONTEXT_IS_REMOTE if parent is not None and parent.is_remote else _CONTEXT_HAS_IS_REMOTE


_KIND = {kind: b"\x30" + _SMALL[kind.value + 1] for kind in SpanKind}  # INTERNAL (0) -> SPAN_KIND_INTERNAL (1)
_STATUS_CODE = {code: code.value for code in StatusCode}
_EMPTY_STATUS = b"\x7a\x00"  # an UNSET status without description: an empty Status message
_LOCAL_PARENT_FLAGS = b"\x85\x01" + _pack_fixed32(_CONTEXT_HAS_IS_REMOTE)
_REMOTE_PARENT_FLAGS = b"\x85\x01" + _pack_fixed32(_CONTEXT_HAS_IS_REMOTE | _CONTEXT_IS_REMOTE)


def _span(span: Any) -> bytes:
    """A ``Span`` message's content."""
    if type(span) is LeanSpan:
        # the events API's spans (nearly all of them): their fields, without a property
        # call for each
        ctx, parent, name, kind = span._context, span._parent, span._name, span._kind
        start, end, status = span._start_time, span._end_time, span._status
        attributes, events, links = span._attributes, span._events, span._links
        dropped_attributes = 0 if type(attributes) is dict else attributes.dropped
        dropped_events, dropped_links = span._dropped_events, span._dropped_links
    else:
        ctx, parent, name, kind = span.get_span_context(), span.parent, span.name, span.kind
        start, end, status = span.start_time, span.end_time, span.status
        attributes, events, links = getattr(span, "_attributes", None) or span.attributes, span.events, span.links
        dropped_attributes, dropped_events, dropped_links = (
            span.dropped_attributes, span.dropped_events, span.dropped_links)
    parts = [
        b"\x0a\x10" + ctx.trace_id.to_bytes(16, "big"),
        b"\x12\x08" + ctx.span_id.to_bytes(8, "big"),
    ]
    state = _trace_state(ctx.trace_state)
    if state:
        parts.append(_string(0x1A, state))
    if parent is not None:
        parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
    parts.append(_string(0x2A, name))
    parts.append(_KIND[kind])
    if start:
        parts.append(b"\x39" + _pack_fixed64(start))
    if end:
        parts.append(b"\x41" + _pack_fixed64(end))
    parts.append(_attributes(0x4A, attributes))
    if dropped_attributes:
        parts.append(b"\x50" + _varint(dropped_attributes))
    for event in events or ():
        body = b"\x09" + _pack_fixed64(event.timestamp) if event.timestamp else b""
        if event.name:
            body += _string(0x12, event.name)
        body += _attributes(0x1A, event.attributes)
        if event.dropped_attributes:
            body += b"\x20" + _varint(event.dropped_attributes)
        parts.append(_field(0x5A, body))
    if dropped_events:
        parts.append(b"\x60" + _varint(dropped_events))
    for link in links or ():
        lctx = link.context
        body = b"\x0a\x10" + lctx.trace_id.to_bytes(16, "big") + b"\x12\x08" + lctx.span_id.to_bytes(8, "big")
        body += _attributes(0x22, link.attributes)
        if link.dropped_attributes:
            body += b"\x28" + _varint(link.dropped_attributes)
        body += b"\x35" + _pack_fixed32(_flags(lctx))
        parts.append(_field(0x6A, body))
    if dropped_links:
        parts.append(b"\x70" + _varint(dropped_links))
    if status is None or status.status_code is StatusCode.UNSET and not status.description:
        parts.append(_EMPTY_STATUS)
    else:
        body = _string(0x12, status.description) if status.description else b""
        code = _STATUS_CODE[status.status_code]
        if code:
            body += b"\x18" + _SMALL[code]
        parts.append(_field(0x7A, body))
    parts.append(_REMOTE_PARENT_FLAGS if parent is not None and parent.is_remote else _LOCAL_PARENT_FLAGS)
    return b"".join(parts)


def encode_spans_bytes(spans: Sequence[Any]) -> bytes:
    """``encode_spans(spans).SerializeToString()`` of the SDK, written directly."""
    try:
        return _encode(spans)
    except Exception as exc:  # an attribute value this encoder does not know: the SDK's
        return _sdk_encoding(spans, exc)


def _sdk_encoding(spans: Sequence[Any], exc: BaseException) -> bytes:
    if not isinstance(exc, _Unsupported):
        logger.debug("otel_verl: fast OTLP encoding failed (%s); using the SDK's", exc)
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return encode_spans(spans).SerializePartialToString()


# The largest export request the exporters send. OTLP/gRPC servers refuse bigger
# messages by default: the Collector's, Jaeger's and Tempo's receivers take at most
# 4 MiB. One batch of chat spans with GenAI message content (up to 2 x 8192 characters
# a span) passes that long before the batch processor's 512 spans: it is split.
MAX_REQUEST_BYTES = 4 * 1024 * 1024 - 64 * 1024


def encode_requests(spans: Sequence[Any], max_bytes: int = MAX_REQUEST_BYTES) -> List[Tuple[Sequence[Any], bytes]]:
    """``spans`` as ``ExportTraceServiceRequest`` bytes of at most ``max_bytes`` each
    (in order; a span larger than that on its own gets a request of its own):
    ``[(the request's spans, its bytes), ...]``."""
    try:  # a resource or scope value is encoded only while splitting: guard all of it
        return _split(spans, _entries(spans), max_bytes)
    except Exception as exc:
        return _sdk_requests(list(spans), max_bytes, exc)


def _split(spans: Sequence[Any], entries: List[Tuple[Any, Any, bytes]], max_bytes: int) -> List[Tuple[Sequence[Any], bytes]]:
    requests: List[Tuple[Sequence[Any], bytes]] = []
    start = size = 0
    headers: set = set()  # (resource, scope) groups the current request already pays for
    for i, (resource, scope, data) in enumerate(entries):
        group = (id(resource), id(scope))
        cost = len(data) + (0 if group in headers else _group_overhead(resource, scope))
        if i > start and size + cost > max_bytes:
            requests.append((spans[start:i], _assemble(entries[start:i])))
            start, size, headers = i, 0, set()
            cost = len(data) + _group_overhead(resource, scope)
        headers.add(group)
        size += cost
    if start < len(entries) or not requests:
        requests.append((spans[start:], _assemble(entries[start:])))
    return requests


def _group_overhead(resource: Any, scope: Any) -> int:
    # the ResourceSpans / ScopeSpans headers around a group's spans (lengths and keys:
    # at most 10 bytes each; the schema URLs)
    return (len(_resource(resource)) + len(_scope(scope)) + 40
            + len(getattr(resource, "schema_url", "") or "") + len(getattr(scope, "schema_url", "") or ""))


def _sdk_requests(spans: List[Any], max_bytes: int, exc: BaseException) -> List[Tuple[Sequence[Any], bytes]]:
    """The SDK's encoding (values this encoder leaves to it), halved until each fits."""
    data = _sdk_encoding(spans, exc)
    if len(data) <= max_bytes or len(spans) <= 1:
        return [(spans, data)]
    half = len(spans) // 2
    return _sdk_requests(spans[:half], max_bytes, exc) + _sdk_requests(spans[half:], max_bytes, exc)


def _encode(spans: Sequence[Any]) -> bytes:
    return _assemble(_entries(spans))


def _entries(spans: Sequence[Any]) -> List[Tuple[Any, Any, bytes]]:
    """(resource, scope, the span's encoded ``spans`` field) for every span."""
    out: List[Tuple[Any, Any, bytes]] = []
    for span in spans:
        if type(span) is LeanSpan:
            resource, scope = span._resource, span._instrumentation_scope or None
        else:
            resource, scope = span.resource, span.instrumentation_scope or None
        out.append((resource, scope, _field(0x12, _span(span))))
    return out


def _assemble(entries: Sequence[Tuple[Any, Any, bytes]]) -> bytes:
    # Resource -> scope -> spans, in first-seen order (as the SDK groups them).
    groups: Dict[int, Tuple[Any, Dict[int, Tuple[Any, List[bytes]]]]] = {}
    for resource, scope, data in entries:
        by_scope = groups.get(id(resource))
        if by_scope is None:
            by_scope = groups[id(resource)] = (resource, {})
        entry = by_scope[1].get(id(scope))
        if entry is None:
            entry = by_scope[1][id(scope)] = (scope, [])
        entry[1].append(data)
    out: List[bytes] = []
    for resource, scopes in groups.values():
        body = [_field(0x0A, _resource(resource))]
        for scope, encoded in scopes.values():
            scope_body = _field(0x0A, _scope(scope)) + b"".join(encoded)
            schema = scope.schema_url if scope is not None else None
            if schema:
                scope_body += _string(0x1A, schema)
            body.append(_field(0x12, scope_body))
        if resource.schema_url:
            body.append(_string(0x1A, resource.schema_url))
        out.append(_field(0x0A, b"".join(body)))
    return b"".join(out)


# --------------------------------------------------------------------------- exporters


class _Encoded:
    """Stands for the SDK's request message where the HTTP exporter serialises it."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializePartialToString(self) -> bytes:  # noqa: N802 (protobuf's name)
        return self.data

    SerializeToString = SerializePartialToString


class _Request(list):
    """The spans of one export request, with their encoding (see :func:`encode_requests`)."""

    def __init__(self, spans: Sequence[Any], data: bytes) -> None:
        super().__init__(spans)
        self.data = data


class _SizeBoundExport:
    """``export`` for the SDK exporters below (first among their bases, so ``super()`` is
    the SDK's): a batch goes out as requests of at most ``max_request_bytes``, in order,
    until one fails. The rest of the batch is not sent: a refusing or unreachable
    endpoint would make every further request wait out the exporter's timeout and
    retries again. ``failed_spans``: how many spans of the last batch were not delivered
    (read by the drop counting, which would otherwise count the whole batch)."""

    max_request_bytes = MAX_REQUEST_BYTES
    failed_spans = 0

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        delivered = 0
        for request_spans, data in encode_requests(spans, self.max_request_bytes):
            if super().export(_Request(request_spans, data)) is not SpanExportResult.SUCCESS:
                break
            delivered += len(request_spans)
        self.failed_spans = len(spans) - delivered
        return SpanExportResult.FAILURE if self.failed_spans else SpanExportResult.SUCCESS


_sdk_http_encode: Any = None


def _http_encode_spans(spans: Any) -> Any:
    if isinstance(spans, _Request):
        return _Encoded(spans.data)
    return _sdk_http_encode(spans)


def http_span_exporter(max_request_bytes: int = MAX_REQUEST_BYTES, **kwargs: Any) -> Any:
    """The SDK's OTLP/HTTP span exporter, encoding with :func:`encode_requests`."""
    global _sdk_http_encode
    from opentelemetry.exporter.otlp.proto.http import trace_exporter as module

    # The SDK's export() looks ``encode_spans`` up in its module: our requests (only) are
    # already encoded; any other caller in the process gets the SDK's encoder unchanged.
    if _sdk_http_encode is None:
        _sdk_http_encode = module.encode_spans
        module.encode_spans = _http_encode_spans

    class HttpSpanExporter(_SizeBoundExport, module.OTLPSpanExporter):
        pass

    exporter = HttpSpanExporter(**kwargs)
    exporter.max_request_bytes = max_request_bytes
    return exporter


def grpc_span_exporter(max_request_bytes: int = MAX_REQUEST_BYTES, **kwargs: Any) -> Any:
    """The SDK's OTLP/gRPC span exporter, encoding with :func:`encode_requests`."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    class GrpcSpanExporter(_SizeBoundExport, OTLPSpanExporter):
        def _translate_data(self, data: Sequence[Any]) -> Any:
            # parsing the bytes back is C (upb) work: a few µs per span
            encoded = data.data if isinstance(data, _Request) else encode_spans_bytes(data)
            return ExportTraceServiceRequest.FromString(encoded)

    exporter = GrpcSpanExporter(**kwargs)
    exporter.max_request_bytes = max_request_bytes
    return exporter
