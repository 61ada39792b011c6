"""OTLP encodings of :class:`~otel_verl.record.SpanRecord` batches, written directly.

:class:`ProtobufEncoder` writes the ``ExportTraceServiceRequest`` bytes that the SDK's
``encode_spans([r.to_readable() for r in records]).SerializeToString()`` gives, byte for
byte, at a fraction of its CPU: the SDK builds some twenty protobuf message objects a span,
this writes the wire format from the record's fields. :class:`JsonEncoder` writes the
OTLP/JSON mapping (the Collector file exporter's format, and the body of OTLP/HTTP JSON):
lowerCamelCase keys in field order, hex ids, int64 as strings, enums as integers, zero
values left out, exactly as ``MessageToDict`` of the SDK's encoding with hex ids and
``json.dumps(..., ensure_ascii=False, separators=(",", ":"))``.

Both group a batch by resource, then by scope, in order of first appearance, with the
SDK's own notion of equal resources and scopes. They cache what repeats from batch to
batch: a resource's and a scope's encoding and the encoded attribute keys (bounded).

Text that UTF-8 cannot carry (a lone surrogate) is written as U+FFFD and counted as
``failures[{output}.lone_surrogate]``. A batch holding a value the protobuf encoder does
not write the way the SDK would (an attribute of another type, an int beyond int64,
``None``, anything else unexpected) is encoded by the SDK's encoder instead (its text
repaired too), so nothing is lost or written differently; the JSON encoder leaves such
an attribute out, as the SDK's does, counted as ``failures[{output}.attribute]``.
"""

from __future__ import annotations

import base64
import functools
import math
import struct
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring as _json_string
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from opentelemetry.trace import SpanKind, StatusCode

from otel_verl import health
from otel_verl.ids import repair_text
from otel_verl.record import EventRecord, LinkRecord, SpanRecord, from_readable

# Bounds of the caches: a process has one resource and a few scopes; attribute keys are
# the semantic conventions' and a few dynamic ones (server timing keys).
MAX_CACHED_RESOURCES = 64
MAX_CACHED_SCOPES = 256
MAX_CACHED_KEYS = 4096
MAX_CACHED_NAMES = 4096  # span names: a few per kind of span
# string values cached whole, per key: those that repeat (a model, an operation) are found
# again; unique ones (uids) fill the few places once
MAX_CACHED_VALUES = 64
MAX_CACHED_VALUE_BYTES = 64
MAX_CACHED_INTS = 65536
# protobuf's tag and length of a scope's or a resource's group at most (10-byte varint)
_FRAMING_BYTES = 11
_TAG = object()  # where a key cache keeps its field's tag: equal to no attribute key

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_UINT64 = 1 << 64

_KIND_NUMBER = {  # SpanKind -> OTLP Span.SpanKind
    SpanKind.INTERNAL: 1,
    SpanKind.SERVER: 2,
    SpanKind.CLIENT: 3,
    SpanKind.PRODUCER: 4,
    SpanKind.CONSUMER: 5,
}
_FLAG_HAS_IS_REMOTE = 0x100  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_FLAG_IS_REMOTE = 0x200  # SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK


class UnsupportedValue(Exception):
    """A value this encoder does not write as the SDK's encoder would."""


def records_of(spans: Iterable[Any]) -> List[SpanRecord]:
    """``spans`` as records: records as they are, SDK ``ReadableSpan``s converted."""
    return [span if isinstance(span, SpanRecord) else from_readable(span) for span in spans]


@functools.lru_cache(maxsize=1)
def sdk_encodes_scope_details() -> bool:
    """Whether the installed SDK encoder writes a scope's attributes and schema URL
    (opentelemetry-exporter-otlp-proto-common 1.30 leaves them out, later versions write
    them), found by asking it once."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext

    probe = ReadableSpan(name="probe", context=SpanContext(1, 1, False), resource=Resource({}),
                         instrumentation_scope=InstrumentationScope("probe", None, "https://probe", {"a": 1}))
    scope_spans = encode_spans([probe]).resource_spans[0].scope_spans[0]
    return bool(scope_spans.schema_url or scope_spans.scope.attributes)


# --------------------------------------------------------------------------- protobuf

_VARINT1 = [bytes((n,)) for n in range(128)]
_FIXED64 = struct.Struct("<Q").pack
_DOUBLE = struct.Struct("<d").pack
_FLOAT_FIELD = struct.Struct("<BBBd").pack  # a KeyValue's value field holding a double
_TIMES = struct.Struct("<BQBQ").pack  # start and end time, with their tags
# (0x0a len, 0x0a n): an ArrayValue's element holding a string of n < 126 bytes
_ARRAY_STRING_HEAD = [bytes((0x0a, n + 2, 0x0a, n)) for n in range(126)]
_BOOL_VALUE = {True: b"\x12\x02\x10\x01", False: b"\x12\x02\x10\x00"}
# by the member's id: an enum member's hash is a Python-level call
_KIND_FIELD = {id(kind): bytes((0x30, number)) for kind, number in _KIND_NUMBER.items()}
_SPAN_FLAGS = (b"\x85\x01" + struct.pack("<I", _FLAG_HAS_IS_REMOTE),
               b"\x85\x01" + struct.pack("<I", _FLAG_HAS_IS_REMOTE | _FLAG_IS_REMOTE))
_LINK_FLAGS = (b"\x35" + struct.pack("<I", _FLAG_HAS_IS_REMOTE),
               b"\x35" + struct.pack("<I", _FLAG_HAS_IS_REMOTE | _FLAG_IS_REMOTE))
_STATUS_AND_FLAGS = {  # a status without a message, then the span's flags (local, remote parent)
    id(code): (status + _SPAN_FLAGS[0], status + _SPAN_FLAGS[1]) for code, status in (
        (StatusCode.UNSET, b"\x7a\x00"), (StatusCode.OK, b"\x7a\x02\x18\x01"), (StatusCode.ERROR, b"\x7a\x02\x18\x02"))
}


def _varint(n: int) -> bytes:
    if n < 128:
        return _VARINT1[n]
    out = bytearray()
    while n > 127:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _uint32(n: int) -> bytes:
    """A dropped count's varint (protobuf refuses one beyond uint32, and so the SDK)."""
    if not 0 <= n < 1 << 32:
        raise UnsupportedValue(f"count beyond uint32: {n}")
    return _varint(n)


def _field(tag: bytes, body: bytes) -> bytes:
    """A length-delimited field: tag, length, body."""
    n = len(body)
    return tag + (_VARINT1[n] if n < 128 else _varint(n)) + body


class _Group:
    """One resource's or one scope's encoding (before and after its children) within a
    batch; the spans of a scope group."""

    __slots__ = ("head", "tail", "parent", "members")

    def __init__(self, head: bytes, tail: bytes, parent: Optional["_Group"] = None) -> None:
        self.head = head
        self.tail = tail
        self.parent = parent
        self.members: Dict[Any, "_Group"] = {}  # a resource group's scope groups, by scope


class _BatchEncoder:
    """What both encodings share: grouping by resource and scope, the caches, cutting a
    batch into requests, the repaired-text count."""

    def __init__(self, output: str) -> None:
        self.output = output
        self.repaired = 0  # texts of the batch being encoded written with U+FFFD
        self._resources: Dict[int, Tuple[Any, Tuple[bytes, bytes]]] = {}  # id -> (resource, (head, tail))
        self._scopes: Dict[int, Tuple[Any, Tuple[bytes, bytes]]] = {}
        self._empty_resource: Any = None
        self._names: Dict[str, Any] = {}  # span name -> its field (protobuf)
        self._ints: Dict[int, Any] = {}  # int value -> its KeyValue value field (protobuf)

    # -- what each encoding defines

    def span(self, record: SpanRecord) -> bytes:
        raise NotImplementedError

    def resource_parts(self, resource: Any) -> Tuple[bytes, bytes]:
        raise NotImplementedError

    def scope_parts(self, scope: Any) -> Tuple[bytes, bytes]:
        raise NotImplementedError

    def assemble(self, groups: "Dict[_Group, Dict[_Group, List[bytes]]]") -> bytes:
        raise NotImplementedError

    # -- shared

    def text(self, text: str) -> bytes:
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:
            self.repaired += 1
            return repair_text(text).encode("utf-8")
        except AttributeError:  # not a str at all
            raise UnsupportedValue(f"text of type {type(text).__name__}") from None

    def key_caches(self) -> List[Dict[Any, Any]]:
        raise NotImplementedError

    def cache_sizes(self) -> Dict[str, int]:
        """How much each cache holds (the largest of each kind)."""
        caches = self.key_caches()
        entries = [entry for cache in caches for key, entry in cache.items() if key is not _TAG]
        return {
            "resources": len(self._resources),
            "scopes": len(self._scopes),
            "keys": max((len(cache) - (_TAG in cache) for cache in caches), default=0),
            "values per key": max((sum(type(k) is not int and k is not _TAG for k in entry) for entry in entries),
                                  default=0),
            "names": len(self._names),
            "ints": len(self._ints),
        }

    def count_repaired(self) -> None:
        if self.repaired:
            health.record_failures(f"{self.output}.lone_surrogate", self.repaired, "(written as U+FFFD)")
            self.repaired = 0

    def _cached(self, cache: Dict[int, Tuple[Any, Tuple[bytes, bytes]]], obj: Any, encode: Any,
                bound: int) -> Tuple[bytes, bytes]:
        entry = cache.get(id(obj))
        if entry is not None and entry[0] is obj:
            return entry[1]
        parts = encode(obj)
        if len(cache) >= bound:
            cache.clear()
        cache[id(obj)] = (obj, parts)  # holding the object keeps its id from being reused
        return parts

    def scope_group(self, resource: Any, scope: Any, batch: Dict[Any, Any]) -> _Group:
        """The batch's group of spans of ``resource`` and ``scope``: one for all equal
        resources, and in it one for all equal scopes, as the SDK groups them."""
        if resource is None:  # as ReadableSpan: an empty resource with the SDK's defaults
            if self._empty_resource is None:
                from opentelemetry.sdk.resources import Resource

                self._empty_resource = Resource.create({})
            resource = self._empty_resource
        scope = scope or None
        found = batch.get((id(resource), id(scope)))
        if found is not None:
            return found
        group = batch.get(id(resource))
        if group is None:
            group = batch.get(resource)  # by Resource.__eq__, once per resource object and batch
            if group is None:
                head, tail = self._cached(self._resources, resource, self.resource_parts, MAX_CACHED_RESOURCES)
                group = batch[resource] = _Group(head, tail)
            batch[id(resource)] = group
        scope_group = group.members.get(scope)
        if scope_group is None:
            head, tail = self._cached(self._scopes, scope, self.scope_parts, MAX_CACHED_SCOPES)
            scope_group = group.members[scope] = _Group(head, tail, group)
        batch[(id(resource), id(scope))] = scope_group
        return scope_group

    def groups_of(self, records: Sequence[SpanRecord]) -> List[_Group]:
        """Each record's group in a request of ``records``."""
        groups: List[_Group] = []
        append = groups.append
        batch: Dict[Any, Any] = {}  # the objects are the records': alive while their ids are keys
        last_resource = last_scope = last_group = None
        for record in records:
            resource, scope = record.resource, record.scope
            if last_group is None or resource is not last_resource or scope is not last_scope:
                last_group = self.scope_group(resource, scope, batch)
                last_resource, last_scope = resource, scope
            append(last_group)
        return groups

    def encode_spans(self, records: Sequence[SpanRecord]) -> Tuple[List[bytes], List[_Group]]:
        """Each record's encoded span, and its group in one request of them all."""
        span = self.span
        return [span(record) for record in records], self.groups_of(records)

    def requests(self, records: Sequence[SpanRecord], max_request_bytes: int = 0) -> Iterator[Tuple[bytes, int]]:
        """``(request, spans in it)`` for ``records`` in order, each request at most
        ``max_request_bytes`` (0: one request), but for a span larger than that alone."""
        try:
            spans, groups = self.encode_spans(records)
        finally:
            self.count_repaired()
        if not max_request_bytes:
            yield self.assemble(_grouped(spans, groups)), len(spans)
            return
        start, size, seen = 0, 0, set()
        for i, (group, span) in enumerate(zip(groups, spans)):
            added = len(span)
            if group not in seen:  # equal resources (scopes) encode to the same size
                added += _group_bytes(group) + (_group_bytes(group.parent) if group.parent not in seen else 0)
            if i > start and size + added > max_request_bytes:
                # a request groups its spans under its first resource and scope of equal ones
                yield self.assemble(_grouped(spans[start:i], self.groups_of(records[start:i]))), i - start
                start, size, seen = i, 0, set()
                added = len(span) + _group_bytes(group) + _group_bytes(group.parent)
            seen.add(group)
            seen.add(group.parent)
            size += added
        if start < len(spans):
            rest = groups[start:] if start == 0 else self.groups_of(records[start:])
            yield self.assemble(_grouped(spans[start:], rest)), len(spans) - start

    def encode(self, records: Sequence[SpanRecord]) -> bytes:
        """The whole batch as one request."""
        for request, _ in self.requests(records):
            return request
        raise AssertionError("unreachable")


def _group_bytes(group: _Group) -> int:
    return len(group.head) + len(group.tail) + _FRAMING_BYTES


def _grouped(spans: List[bytes], groups: List[_Group]) -> Dict[_Group, Dict[_Group, List[bytes]]]:
    """Resource group -> scope group -> spans, each in order of first appearance."""
    distinct = dict.fromkeys(groups)
    if len(distinct) == 1:  # the usual batch: one process's spans of one scope
        return {groups[0].parent: {groups[0]: spans}}
    by_group: Dict[_Group, List[bytes]] = {group: [] for group in distinct}
    for group, span in zip(groups, spans):
        by_group[group].append(span)
    out: Dict[_Group, Dict[_Group, List[bytes]]] = {}
    for group, members in by_group.items():
        out.setdefault(group.parent, {})[group] = members
    return out


class ProtobufEncoder(_BatchEncoder):
    """``ExportTraceServiceRequest`` bytes, as the installed SDK's encoder writes them."""

    def __init__(self, output: str = "otlp") -> None:
        super().__init__(output)
        self.encodes_scope_details = sdk_encodes_scope_details()
        # attribute key entries by the field their KeyValues go in (its tag under _TAG)
        self._span_keys: Dict[Any, Any] = {_TAG: b"\x4a"}
        self._event_keys: Dict[Any, Any] = {_TAG: b"\x1a"}
        self._link_keys: Dict[Any, Any] = {_TAG: b"\x22"}
        self._resource_keys: Dict[Any, Any] = {_TAG: b"\x0a"}
        self._scope_keys: Dict[Any, Any] = {_TAG: b"\x1a"}
        self.sdk_batches = 0  # batches the SDK's encoder wrote (values this one does not write)

    def key_caches(self) -> List[Dict[Any, Any]]:
        return [self._span_keys, self._event_keys, self._link_keys, self._resource_keys, self._scope_keys]

    # -- requests, or the SDK's encoding of what this one does not write

    def requests(self, records: Sequence[SpanRecord], max_request_bytes: int = 0) -> Iterator[Tuple[bytes, int]]:
        try:
            return iter(list(super().requests(records, max_request_bytes)))
        except Exception:  # UnsupportedValue mostly; the SDK writes it (or fails as it would)
            pass
        self.sdk_batches += 1  # outside the handler: the SDK's own logs then show no chained error
        return sdk_requests([well_formed_record(record) for record in records], max_request_bytes)

    def assemble(self, groups: Dict[_Group, Dict[_Group, List[bytes]]]) -> bytes:
        return b"".join(_field(b"\x0a", resource.head
                               + b"".join(_field(b"\x12", scope.head + b"".join(spans) + scope.tail)
                                          for scope, spans in scopes.items())
                               + resource.tail)
                        for resource, scopes in groups.items())

    # -- resource and scope

    def resource_parts(self, resource: Any) -> Tuple[bytes, bytes]:
        head = _field(b"\x0a", self.attributes(resource.attributes, self._resource_keys))
        schema_url = resource.schema_url
        return head, _field(b"\x1a", self.text(schema_url)) if schema_url else b""

    def scope_parts(self, scope: Any) -> Tuple[bytes, bytes]:
        if scope is None:
            return b"\x0a\x00", b""
        body = b""
        if scope.name:
            body += _field(b"\x0a", self.text(scope.name))
        if scope.version:
            body += _field(b"\x12", self.text(scope.version))
        tail = b""
        if self.encodes_scope_details:
            attributes = getattr(scope, "attributes", None)
            if attributes:
                body += self.attributes(attributes, self._scope_keys)
            if scope.schema_url:
                tail = _field(b"\x1a", self.text(scope.schema_url))
        return _field(b"\x0a", body), tail

    # -- span

    def span(self, r: SpanRecord) -> bytes:
        parts: List[bytes] = [b"\x0a\x10", r.trace_id.to_bytes(16, "big"), b"\x12\x08", r.span_id.to_bytes(8, "big")]
        append = parts.append
        trace_state = r.trace_state
        if trace_state:
            append(_field(b"\x1a", self.text(",".join(f"{k}={v}" for k, v in trace_state.items()))))
        if r.parent_id:
            append(b"\x22\x08")
            append(r.parent_id.to_bytes(8, "big"))
        name = r.name
        if name:
            name_field = self._names.get(name)
            if name_field is None:
                name_field = self.name_field(name)
            append(name_field)
        append(_KIND_FIELD[id(r.kind)])
        start, end = r.start_time, r.end_time
        if start and end:
            append(_TIMES(0x39, start, 0x41, end))
        else:
            if start:
                append(b"\x39" + _FIXED64(start))
            if end:
                append(b"\x41" + _FIXED64(end))
        if r.attributes:
            append(self.attributes(r.attributes, self._span_keys))
        if r.dropped_attributes:
            append(b"\x50" + _uint32(r.dropped_attributes))
        for event in r.events:
            append(_field(b"\x5a", self.event(event)))
        if r.dropped_events:
            append(b"\x60" + _uint32(r.dropped_events))
        for link in r.links:
            append(_field(b"\x6a", self.link(link)))
        if r.dropped_links:
            append(b"\x70" + _uint32(r.dropped_links))
        code, message = r.status_code, r.status_message
        remote = 1 if r.parent_id and r.parent_remote else 0
        if message and code is StatusCode.ERROR and isinstance(message, str):  # as Status keeps a description
            append(_field(b"\x7a", _field(b"\x12", self.text(message)) + b"\x18\x02"))
            append(_SPAN_FLAGS[remote])
        else:
            append(_STATUS_AND_FLAGS[id(code)][remote])
        body = b"".join(parts)
        n = len(body)  # framed as a field of ScopeSpans
        return (b"\x12" + _VARINT1[n] if n < 128 else b"\x12" + _varint(n)) + body

    def name_field(self, name: str) -> bytes:
        repaired = self.repaired
        field = _field(b"\x2a", self.text(name))
        if len(self._names) < MAX_CACHED_NAMES and self.repaired == repaired:  # a repaired name counts each time
            self._names[name] = field
        return field

    def event(self, event: Any) -> bytes:
        body = b"\x09" + _FIXED64(event.timestamp) if event.timestamp else b""
        if event.name:
            body += _field(b"\x12", self.text(event.name))
        if event.attributes:
            body += self.attributes(event.attributes, self._event_keys)
        if event.dropped_attributes:
            body += b"\x20" + _uint32(event.dropped_attributes)
        return body

    def link(self, link: Any) -> bytes:
        # the SDK's encoder leaves a link's trace state out
        body = b"\x0a\x10" + link.trace_id.to_bytes(16, "big") + b"\x12\x08" + link.span_id.to_bytes(8, "big")
        if link.attributes:
            body += self.attributes(link.attributes, self._link_keys)
        if link.dropped_attributes:
            body += b"\x28" + _uint32(link.dropped_attributes)
        return body + _LINK_FLAGS[1 if link.is_remote else 0]

    # -- attributes
    #
    # ``keys`` (one cache per field the KeyValues go in) maps an attribute key to its
    # entry, a dict of what was encoded for it before: under a str value, that value's
    # whole KeyValue field (for values that repeat: a model name, an operation); under
    # n >= 0, the field's head up to the bytes of a string value of n bytes; under -L, the
    # head before a value field of L bytes; under _TAG, (the field's tag, its key field).
    # Tuples of strings (finish reasons) are cached whole as strings are.

    def key_entry(self, key: Any, keys: Dict[Any, Dict[Any, Any]]) -> Dict[Any, Any]:
        if type(key) is not str:
            raise UnsupportedValue(f"attribute key of type {type(key).__name__}")
        repaired = self.repaired
        entry: Dict[Any, Any] = {_TAG: (keys[_TAG], _field(b"\x0a", self.text(key)) if key else b"")}
        if len(keys) < MAX_CACHED_KEYS and self.repaired == repaired:  # a repaired key counts each time
            keys[key] = entry
        return entry

    def attributes(self, attributes: Mapping[str, Any], keys: Dict[Any, Dict[Any, Any]]) -> bytes:
        """Each attribute as a KeyValue field of the message ``keys`` is for."""
        parts: List[bytes] = []
        append = parts.append
        for key, value in attributes.items():
            entry = keys.get(key)  # only str keys are cached
            if entry is None:
                entry = self.key_entry(key, keys)
            kind = type(value)
            if kind is str:
                field = entry.get(value)
                if field is not None:
                    append(field)
                    continue
                try:
                    encoded = value.encode("utf-8")
                except UnicodeEncodeError:
                    append(_string_head(entry, len(encoded := self.text(value))))
                    append(encoded)
                    continue
                n = len(encoded)
                head = entry.get(n)
                if head is None:
                    head = _string_head(entry, n)
                if n < MAX_CACHED_VALUE_BYTES and len(entry) < MAX_CACHED_VALUES:
                    entry[value] = head + encoded
                append(head)
                append(encoded)
                continue
            if kind is int:
                value_field = self._ints.get(value)
                if value_field is None:
                    value_field = self.int_field(value)
            elif kind is float:
                value_field = _FLOAT_FIELD(0x12, 9, 0x21, value)
            elif kind is bool:
                value_field = _BOOL_VALUE[value]
            elif kind is tuple:
                value_field = _cached_value(entry, value)
                if value_field is not None:
                    append(value_field)
                    continue
                repaired = self.repaired
                value_field = _field(b"\x12", self.array(value))
                if len(value_field) < MAX_CACHED_VALUE_BYTES and len(entry) < MAX_CACHED_VALUES:
                    field = _head(entry, len(value_field)) + value_field
                    # (1,) == (True,): only strings are cached; a repaired one counts each time
                    if self.repaired == repaired and all(type(v) is str for v in value):
                        entry[value] = field
                    append(field)
                    continue
            elif kind is list:
                value_field = _field(b"\x12", self.array(value))
            else:
                value_field = _field(b"\x12", self.any_value(value))
            head = entry.get(-len(value_field))
            if head is None:
                head = _head(entry, len(value_field))
            append(head)
            append(value_field)
        return b"".join(parts)

    def int_field(self, value: int) -> bytes:
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise UnsupportedValue("int beyond int64")
        field = _field(b"\x12", b"\x18" + _varint(value % _UINT64))
        if len(self._ints) < MAX_CACHED_INTS:
            self._ints[value] = field
        return field

    def array(self, values: Sequence[Any]) -> bytes:
        """An AnyValue holding an ArrayValue."""
        parts: List[bytes] = []
        append = parts.append
        for value in values:
            if type(value) is str:
                encoded = self.text(value)
                n = len(encoded)
                if n < 126:
                    append(_ARRAY_STRING_HEAD[n])
                else:
                    length = _varint(n)
                    append(b"\x0a" + _varint(1 + len(length) + n) + b"\x0a" + length)
                append(encoded)
            else:
                append(_field(b"\x0a", self.any_value(value)))
        return _field(b"\x2a", b"".join(parts))

    def any_value(self, value: Any) -> bytes:
        """An AnyValue's body, in the SDK encoder's order of type checks."""
        if value is None:  # the SDK's encoders differ: 1.30 skips the attribute, later ones write {}
            raise UnsupportedValue("None")
        if isinstance(value, bool):
            return b"\x10\x01" if value else b"\x10\x00"
        if isinstance(value, str):
            return _field(b"\x0a", self.text(str.__str__(value)))
        if isinstance(value, int):
            if not _INT64_MIN <= value <= _INT64_MAX:
                raise UnsupportedValue("int beyond int64")
            return b"\x18" + _varint(int(value) % _UINT64)
        if isinstance(value, float):
            return b"\x21" + _DOUBLE(value)
        if isinstance(value, bytes):
            return _field(b"\x3a", bytes(value))
        if isinstance(value, Sequence):
            return self.array(value)
        if isinstance(value, Mapping):
            pairs = []
            for k, v in value.items():
                k = str(k)
                pairs.append(_field(b"\x0a", (_field(b"\x0a", self.text(k)) if k else b"")
                                    + _field(b"\x12", self.any_value(v))))
            return _field(b"\x32", b"".join(pairs))
        raise UnsupportedValue(f"attribute value of type {type(value).__name__}")


def _cached_value(entry: Dict[Any, Any], value: tuple) -> Any:
    try:
        return entry.get(value)
    except TypeError:  # a tuple holding a list or a dict: never cached
        return None


def _string_head(entry: Dict[Any, Any], n: int) -> bytes:
    """A KeyValue field's bytes before its string value of ``n`` bytes (cached for short
    strings)."""
    tag, key_field = entry[_TAG]
    value_length = _varint(n)
    any_value_length = 1 + len(value_length) + n
    value_field_head = b"\x12" + _varint(any_value_length) + b"\x0a" + value_length
    head = tag + _varint(len(key_field) + len(value_field_head) + n) + key_field + value_field_head
    if n < 126:
        entry[n] = head
    return head


def _head(entry: Dict[Any, Any], value_field_length: int) -> bytes:
    """A KeyValue field's bytes before a value field of ``value_field_length`` bytes."""
    tag, key_field = entry[_TAG]
    head = tag + _varint(len(key_field) + value_field_length) + key_field
    if value_field_length < 128:
        entry[-value_field_length] = head
    return head


def well_formed_record(record: SpanRecord) -> SpanRecord:
    """``record``, or a copy with its texts repaired where one has a lone surrogate (the
    SDK's encoder would fail the batch on its name, leave out such an attribute)."""
    if _well_formed(record.name) and _well_formed(record.status_message) and _well_formed(record.attributes) \
            and all(_well_formed(e.name) and _well_formed(e.attributes) for e in record.events) \
            and all(_well_formed(link.attributes) for link in record.links) \
            and _well_formed_resource(record.resource) and _well_formed_scope(record.scope):
        return record
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    resource, scope = record.resource, record.scope
    if not _well_formed_resource(resource):
        resource = Resource(_repaired(dict(resource.attributes)), _repaired(resource.schema_url))
    if not _well_formed_scope(scope):
        scope = InstrumentationScope(_repaired(scope.name), _repaired(scope.version), _repaired(scope.schema_url),
                                     _repaired(dict(getattr(scope, "attributes", None) or {})))
    return record.replace(
        name=_repaired(record.name), attributes=_repaired(record.attributes),
        events=tuple(EventRecord(_repaired(e.name), e.timestamp, _repaired(e.attributes), e.dropped_attributes)
                     for e in record.events),
        links=tuple(LinkRecord(link.trace_id, link.span_id, link.trace_flags, link.trace_state, link.is_remote,
                               _repaired(link.attributes), link.dropped_attributes) for link in record.links),
        status_message=_repaired(record.status_message), resource=resource, scope=scope)


def _well_formed(value: Any) -> bool:
    if isinstance(value, str):
        if value.isascii():
            return True
        try:
            value.encode("utf-8")
            return True
        except UnicodeEncodeError:
            return False
    if isinstance(value, Mapping):
        return all(_well_formed(k) and _well_formed(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_well_formed(v) for v in value)
    return True


def _well_formed_resource(resource: Any) -> bool:
    return resource is None or (_well_formed(resource.attributes) and _well_formed(resource.schema_url))


def _well_formed_scope(scope: Any) -> bool:
    return scope is None or all(_well_formed(getattr(scope, name, None))
                                for name in ("name", "version", "schema_url", "attributes"))


def _repaired(value: Any) -> Any:
    if isinstance(value, str):
        return value if _well_formed(value) else repair_text(value)
    if isinstance(value, Mapping):
        return {_repaired(k): _repaired(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_repaired(v) for v in value)
    if isinstance(value, list):
        return [_repaired(v) for v in value]
    return value


def sdk_requests(records: Sequence[SpanRecord], max_request_bytes: int = 0) -> Iterator[Tuple[bytes, int]]:
    """The SDK encoder's requests of ``records`` in order, cut under ``max_request_bytes``
    (0: one request) by an upper bound of each span's size."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    for chunk in request_chunks(records, max_request_bytes):
        yield encode_spans([record.to_readable() for record in chunk]).SerializeToString(), len(chunk)


def request_chunks(records: Sequence[SpanRecord], max_request_bytes: int) -> List[List[Any]]:
    """``records`` in order, cut where a request would pass ``max_request_bytes`` by
    :func:`size_bound` (0: one request); a record larger than that on its own goes alone."""
    if not max_request_bytes:
        return [list(records)] if records else []
    chunks: List[List[Any]] = []
    chunk: List[Any] = []
    size = 0
    for record in records:
        span_size = size_bound(record)
        if chunk and size + span_size > max_request_bytes:
            chunks.append(chunk)
            chunk, size = [], 0
        chunk.append(record)
        size += span_size
    if chunk:
        chunks.append(chunk)
    return chunks


# Upper bounds of the protobuf bytes around the variable parts of a span, from
# opentelemetry/proto/trace/v1/trace.proto: a span's ids, kind, times, flags, status,
# dropped counts and framing; an event's time and dropped count; a link's ids and flags;
# an attribute's key and value framing; an array element's framing.
_SPAN_BYTES = 128
_EVENT_BYTES = 32
_LINK_BYTES = 64
_ATTRIBUTE_BYTES = 16
_ELEMENT_BYTES = 8
_NUMBER_BYTES = 10  # a varint of at most 10 bytes, a double of 8


def size_bound(record: SpanRecord) -> int:
    """An upper bound of the record's bytes in an OTLP protobuf request: its texts'
    lengths (nearly all of a large span) and a fixed allowance for everything else."""
    size = _SPAN_BYTES + _text_size(record.name) + _attributes_size(record.attributes)
    if record.trace_state:
        size += len(record.trace_state.to_header())
    if record.status_message:
        size += _text_size(record.status_message)
    for event in record.events:
        size += _EVENT_BYTES + _text_size(event.name) + _attributes_size(event.attributes)
    for link in record.links:
        size += _LINK_BYTES + _attributes_size(link.attributes)
    return size


def _attributes_size(attributes: Any) -> int:
    if not attributes:
        return 0
    return sum(_ATTRIBUTE_BYTES + _text_size(str(key)) + _value_size(value) for key, value in attributes.items())


def _value_size(value: Any) -> int:
    if isinstance(value, str):
        return _text_size(value)
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, Mapping):
        return _attributes_size(value)
    if isinstance(value, (list, tuple)):
        return sum(_ELEMENT_BYTES + _value_size(v) for v in value)
    return _NUMBER_BYTES  # a number, or a type the encoder leaves out


def _text_size(text: Any) -> int:
    if not isinstance(text, str):
        return 0
    if text.isascii():  # nearly every one: its length, without encoding it
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return len(repair_text(text).encode("utf-8"))


# --------------------------------------------------------------------------- JSON

_JSON_KIND = {id(kind): f',"kind":{number}' for kind, number in _KIND_NUMBER.items()}
_JSON_STATUS_WITHOUT_MESSAGE = {
    id(StatusCode.UNSET): ',"status":{}',
    id(StatusCode.OK): ',"status":{"code":1}',
    id(StatusCode.ERROR): ',"status":{"code":2}',
}
_JSON_SPAN_FLAGS = (f',"flags":{_FLAG_HAS_IS_REMOTE}}}', f',"flags":{_FLAG_HAS_IS_REMOTE | _FLAG_IS_REMOTE}}}')
_JSON_BOOL = {True: '{"boolValue":true}', False: '{"boolValue":false}'}


class JsonEncoder(_BatchEncoder):
    """OTLP/JSON ``{"resourceSpans":[...]}`` as UTF-8 bytes, in the Collector file
    exporter's (and OTLP/HTTP JSON's) mapping."""

    def __init__(self, output: str = "otlp") -> None:
        super().__init__(output)
        self._keys: Dict[str, Dict[Any, str]] = {}

    def key_caches(self) -> List[Dict[Any, Any]]:
        return [self._keys]

    def string(self, text: str) -> str:
        """``text`` as a JSON string, well-formed for UTF-8."""
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                self.repaired += 1
                text = repair_text(text)
        return _json_string(text)

    def assemble(self, groups: Dict[_Group, Dict[_Group, List[bytes]]]) -> bytes:
        out = []
        for resource, scopes in groups.items():
            scope_spans = [scope.head + b",".join(spans) + scope.tail for scope, spans in scopes.items()]
            out.append(resource.head + b",".join(scope_spans) + resource.tail)
        return b'{"resourceSpans":[' + b",".join(out) + b"]}"

    def resource_parts(self, resource: Any) -> Tuple[bytes, bytes]:
        attributes = self.attributes(resource.attributes)
        head = '{"resource":{"attributes":[' + attributes + ']},"scopeSpans":[' if attributes else \
            '{"resource":{},"scopeSpans":['
        tail = "]"
        if resource.schema_url:
            tail += ',"schemaUrl":' + self.string(resource.schema_url)
        return head.encode("utf-8"), (tail + "}").encode("utf-8")

    def scope_parts(self, scope: Any) -> Tuple[bytes, bytes]:
        fields = []
        tail = "]"
        if scope is not None:
            if scope.name:
                fields.append('"name":' + self.string(scope.name))
            if scope.version:
                fields.append('"version":' + self.string(scope.version))
            attributes = self.attributes(getattr(scope, "attributes", None))
            if attributes:
                fields.append('"attributes":[' + attributes + "]")
            if scope.schema_url:
                tail += ',"schemaUrl":' + self.string(scope.schema_url)
        head = '{"scope":{' + ",".join(fields) + '},"spans":['
        return head.encode("utf-8"), (tail + "}").encode("utf-8")

    def span(self, r: SpanRecord) -> bytes:
        parts = ['{"traceId":"%032x","spanId":"%016x"' % (r.trace_id, r.span_id)]
        trace_state = r.trace_state
        if trace_state:
            parts.append(',"traceState":' + self.string(",".join(f"{k}={v}" for k, v in trace_state.items())))
        if r.parent_id:
            parts.append(',"parentSpanId":"%016x"' % r.parent_id)
        if r.name:
            parts.append(',"name":' + self.string(r.name))
        parts.append(_JSON_KIND[id(r.kind)])
        if r.start_time:
            parts.append(',"startTimeUnixNano":"%d"' % r.start_time)
        if r.end_time:
            parts.append(',"endTimeUnixNano":"%d"' % r.end_time)
        if r.attributes:
            attributes = self.attributes(r.attributes)
            if attributes:
                parts += (',"attributes":[', attributes, "]")
        if r.dropped_attributes:
            parts.append(',"droppedAttributesCount":%d' % r.dropped_attributes)
        if r.events:
            parts += (',"events":[', ",".join(self.event(event) for event in r.events), "]")
        if r.dropped_events:
            parts.append(',"droppedEventsCount":%d' % r.dropped_events)
        if r.links:
            parts += (',"links":[', ",".join(self.link(link) for link in r.links), "]")
        if r.dropped_links:
            parts.append(',"droppedLinksCount":%d' % r.dropped_links)
        code, message = r.status_code, r.status_message
        if message and code is StatusCode.ERROR and isinstance(message, str):
            parts.append(',"status":{"message":' + self.string(message) + ',"code":2}')
        else:
            parts.append(_JSON_STATUS_WITHOUT_MESSAGE[id(code)])
        parts.append(_JSON_SPAN_FLAGS[1 if r.parent_id and r.parent_remote else 0])
        return "".join(parts).encode("utf-8")

    def event(self, event: Any) -> str:
        fields = []
        if event.timestamp:
            fields.append('"timeUnixNano":"%d"' % event.timestamp)
        if event.name:
            fields.append('"name":' + self.string(event.name))
        attributes = self.attributes(event.attributes)
        if attributes:
            fields.append('"attributes":[' + attributes + "]")
        if event.dropped_attributes:
            fields.append('"droppedAttributesCount":%d' % event.dropped_attributes)
        return "{" + ",".join(fields) + "}"

    def link(self, link: Any) -> str:
        out = '{"traceId":"%032x","spanId":"%016x"' % (link.trace_id, link.span_id)
        attributes = self.attributes(link.attributes)
        if attributes:
            out += ',"attributes":[' + attributes + "]"
        if link.dropped_attributes:
            out += ',"droppedAttributesCount":%d' % link.dropped_attributes
        return out + (',"flags":%d}' % (_FLAG_HAS_IS_REMOTE | _FLAG_IS_REMOTE if link.is_remote else _FLAG_HAS_IS_REMOTE))

    def key_entry(self, key: Any) -> Dict[Any, str]:
        """A key's cache entry: under _TAG ``{"key":...,"value":`` (``{"value":`` for an
        empty key, a zero value), under a str value its whole KeyValue (for values that
        repeat)."""
        if type(key) is not str:
            raise UnsupportedValue(f"attribute key of type {type(key).__name__}")
        repaired = self.repaired
        entry = {_TAG: '{"key":' + self.string(key) + ',"value":' if key else '{"value":'}
        if len(self._keys) < MAX_CACHED_KEYS and self.repaired == repaired:  # a repaired key counts each time
            self._keys[key] = entry
        return entry

    def attributes(self, attributes: Optional[Mapping[str, Any]]) -> str:
        """The KeyValues of ``attributes``, comma-separated; one that cannot be encoded is
        left out, as the SDK's encoder does, and counted."""
        if not attributes:
            return ""
        keys = self._keys
        parts: List[str] = []
        append = parts.append
        for key, value in attributes.items():
            kind = type(value)
            try:
                entry = keys.get(key)  # only str keys are cached
                if entry is None:
                    entry = self.key_entry(key)
                if kind is str:
                    pair = entry.get(value)
                    if pair is None:
                        repaired = self.repaired
                        pair = entry[_TAG] + '{"stringValue":' + self.string(value) + "}}"
                        if len(value) < MAX_CACHED_VALUE_BYTES and len(entry) < MAX_CACHED_VALUES \
                                and self.repaired == repaired:
                            entry[value] = pair
                    append(pair)
                elif kind is int and _INT64_MIN <= value <= _INT64_MAX:
                    append(entry[_TAG] + '{"intValue":"%d"}}' % value)
                elif kind is float:
                    append(entry[_TAG] + '{"doubleValue":' + _json_double(value) + "}}")
                elif kind is bool:
                    append(entry[_TAG] + _JSON_BOOL[value] + "}")
                elif kind is tuple:
                    pair = _cached_value(entry, value)
                    if pair is None:
                        repaired = self.repaired
                        pair = entry[_TAG] + self.any_value(value) + "}"
                        # (1,) == (True,): only strings are cached; a repaired one counts each time
                        if len(pair) < 2 * MAX_CACHED_VALUE_BYTES and len(entry) < MAX_CACHED_VALUES \
                                and self.repaired == repaired and all(type(v) is str for v in value):
                            entry[value] = pair
                    append(pair)
                else:
                    append(entry[_TAG] + self.any_value(value) + "}")
            except Exception as exc:  # UnsupportedValue mostly
                health.record_failure(f"{self.output}.attribute", exc)
        return ",".join(parts)

    def any_value(self, value: Any) -> str:
        if value is None:
            return "{}"
        if isinstance(value, bool):
            return _JSON_BOOL[bool(value)]
        if isinstance(value, str):
            return '{"stringValue":' + self.string(value) + "}"
        if isinstance(value, int):
            if not _INT64_MIN <= value <= _INT64_MAX:
                raise UnsupportedValue(f"int attribute out of int64 range: {value}")
            return '{"intValue":"' + str(value) + '"}'
        if isinstance(value, float):
            return '{"doubleValue":' + _json_double(value) + "}"
        if isinstance(value, bytes):
            return '{"bytesValue":"' + base64.b64encode(value).decode("ascii") + '"}'
        if isinstance(value, Sequence):
            values = ",".join(self.any_value(v) for v in value)
            return '{"arrayValue":{"values":[' + values + "]}}" if values else '{"arrayValue":{}}'
        if isinstance(value, Mapping):
            pairs = []
            for k, v in value.items():
                k = str(k)
                head = '{"key":' + self.string(k) + ',"value":' if k else '{"value":'
                pairs.append(head + self.any_value(v) + "}")
            return '{"kvlistValue":{"values":[' + ",".join(pairs) + "]}}" if pairs else '{"kvlistValue":{}}'
        raise UnsupportedValue(f"Invalid type {type(value)} of value {value}")


def _json_double(value: float) -> str:
    # proto3 JSON spells the non-finite doubles as strings
    if math.isfinite(value):
        return float.__repr__(value)
    if math.isnan(value):
        return '"NaN"'
    return '"Infinity"' if value > 0 else '"-Infinity"'


# --------------------------------------------------------------------------- one-off use


def encode_request(records: Sequence[SpanRecord], encoder: Optional[ProtobufEncoder] = None) -> bytes:
    """The ``ExportTraceServiceRequest`` bytes of ``records`` (an exporter keeps one
    ``ProtobufEncoder`` for its caches; without one, a new one is made)."""
    return (encoder or ProtobufEncoder()).encode(records)


def encode_json(records: Sequence[SpanRecord], encoder: Optional[JsonEncoder] = None) -> bytes:
    """The OTLP/JSON ``{"resourceSpans":[...]}`` bytes of ``records``."""
    return (encoder or JsonEncoder()).encode(records)
