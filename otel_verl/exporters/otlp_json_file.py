"""Spans as OTLP-JSON lines, in the OpenTelemetry Collector file exporter's format.

The default output when no OTLP endpoint is set (``{trace_dir}/otlp/``): each export batch
of the SDK's BatchSpanProcessor becomes one ``{"resourceSpans":[...]}`` line in
``spans-{hostname}-pid{pid}.jsonl`` (then ``...-1.jsonl``, ``...-2.jsonl`` past the size
limit). The JSON is the OTLP/JSON mapping the Collector writes: lowerCamelCase keys,
lowercase hex ids, int64 values as decimal strings, enums as integers, zero values left
out. A line can be replayed with the Collector's ``otlpjsonfile`` receiver, posted to an
OTLP/HTTP endpoint as ``application/json``, parsed by protobuf's ``json_format`` after
:func:`to_protobuf_json` (plain proto3 JSON wants base64 ids), or read back here with
:func:`read_otlp_json_lines` / :func:`spans_from_files`.

:func:`resource_spans_dict` builds from the spans' public properties the objects that
the SDK's OTLP encoder followed by protobuf's ``MessageToDict`` gives
(:func:`resource_spans_via_sdk`, which the tests compare it with), at a sixth of the CPU:
the exporter runs on a thread that shares the GIL with the traced process.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind

from otel_verl import health
from otel_verl.exporters._writer import FILE_MODE, append_whole, make_dirs, output_pid

logger = logging.getLogger("otel_verl")

_OUTPUT = "otlp_json_file"
_JSON_SEPARATORS = (",", ":")  # compact, as the Collector writes


class OtlpJsonFileExporter(SpanExporter):
    """Appends one whole ``{"resourceSpans":[...]}`` line per export batch."""

    def __init__(self, directory: str, *, max_file_bytes: int = 100 * 1024 * 1024, prefix: str = "spans",
                 output: str = _OUTPUT) -> None:
        self.directory = directory
        self.prefix = prefix  # file names: {prefix}-{hostname}-pid{pid}[-{index}].jsonl
        self.output = output  # the name its failures are counted under
        self.max_file_bytes = max_file_bytes
        self._host = socket.gethostname()
        self._lock = threading.Lock()  # the BSP thread and a force_flush caller may both export
        self._fd = -1
        self._pid = 0
        self._index = 0
        self._size = 0
        self.path: Optional[str] = None

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        try:
            line = json.dumps(resource_spans_dict(spans), ensure_ascii=False, separators=_JSON_SEPARATORS) + "\n"
            data = line.encode("utf-8")
        except Exception as exc:
            health.record_failure(f"{_OUTPUT}.encode", exc)
            return SpanExportResult.FAILURE
        # the caller (LossCountingProcessor) counts the spans of a batch not written as dropped
        return SpanExportResult.SUCCESS if self.append_line(data) else SpanExportResult.FAILURE

    def append_line(self, data: bytes) -> bool:
        """Append one whole encoded line; False (the failure counted) when it was not written."""
        with self._lock:
            try:
                self._append(data)
            except Exception as exc:  # OSError mostly: disk full, no directory, ...
                health.record_failure(f"{self.output}.write", exc)
                self._close()
                return False
        return True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export is written before it returns

    def shutdown(self) -> None:
        with self._lock:
            self._close()

    # ------------------------------------------------------------------ files

    def _append(self, data: bytes) -> None:
        if self._fd < 0 or self._pid != output_pid() or self._size >= self.max_file_bytes:
            self._open_next()
        append_whole(self._fd, data)  # a torn last line would break every reader
        self._size += len(data)

    def _open_next(self) -> None:
        """Open the file to append to: the first one, the next one when the current is
        full, the same one again after a write error, a new series in a forked child."""
        pid = output_pid()
        if pid != self._pid:
            self._index = 0
        elif self._fd >= 0:  # open and full: rotate
            self._index += 1
        self._close()
        self._pid = pid
        make_dirs(self.directory)
        while True:
            suffix = f"-{self._index}" if self._index else ""
            path = os.path.join(self.directory, f"{self.prefix}-{self._host}-pid{pid}{suffix}.jsonl")
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
            size = os.fstat(fd).st_size
            # an earlier process with the same pid may have filled this one already
            if size < self.max_file_bytes:
                break
            os.close(fd)
            self._index += 1
        self._fd, self._size, self.path = fd, size, path

    def _close(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1


# --------------------------------------------------------------------------- encoding

_KIND = {  # SDK SpanKind -> OTLP Span.SpanKind number
    SpanKind.INTERNAL: 1,
    SpanKind.SERVER: 2,
    SpanKind.CLIENT: 3,
    SpanKind.PRODUCER: 4,
    SpanKind.CONSUMER: 5,
}
_FLAG_HAS_IS_REMOTE = 0x100  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_FLAG_IS_REMOTE = 0x200  # SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def resource_spans_dict(spans: Sequence[ReadableSpan]) -> Dict[str, Any]:
    """``{"resourceSpans": [...]}`` for a batch, grouped by resource then scope in order of
    first appearance, exactly as ``MessageToDict(encode_spans(spans))`` with hex ids.

    Keys are emitted in protobuf field-number order, like ``MessageToDict``."""
    groups: Dict[Any, Dict[Any, List[Dict[str, Any]]]] = {}  # resource -> scope -> span dicts
    for span in spans:
        scopes = groups.setdefault(span.resource, {})
        scopes.setdefault(span.instrumentation_scope or None, []).append(_span_dict(span))
    out = []
    for resource, scopes in groups.items():
        attributes = _attributes(resource.attributes)
        resource_spans: Dict[str, Any] = {
            "resource": {"attributes": attributes} if attributes else {},
            "scopeSpans": [_scope_spans_dict(scope, span_dicts) for scope, span_dicts in scopes.items()],
        }
        if resource.schema_url:
            resource_spans["schemaUrl"] = resource.schema_url
        out.append(resource_spans)
    return {"resourceSpans": out}


def _scope_spans_dict(scope: Any, span_dicts: List[Dict[str, Any]]) -> Dict[str, Any]:
    scope_dict: Dict[str, Any] = {}
    if scope is not None:
        if scope.name:
            scope_dict["name"] = scope.name
        if scope.version:
            scope_dict["version"] = scope.version
        attributes = _attributes(scope.attributes)
        if attributes:
            scope_dict["attributes"] = attributes
    out: Dict[str, Any] = {"scope": scope_dict, "spans": span_dicts}
    if scope is not None and scope.schema_url:
        out["schemaUrl"] = scope.schema_url
    return out


def _span_dict(span: ReadableSpan) -> Dict[str, Any]:
    ctx = span.get_span_context()
    out: Dict[str, Any] = {"traceId": f"{ctx.trace_id:032x}", "spanId": f"{ctx.span_id:016x}"}
    if ctx.trace_state:
        out["traceState"] = ",".join(f"{k}={v}" for k, v in ctx.trace_state.items())
    parent = span.parent
    if parent:
        out["parentSpanId"] = f"{parent.span_id:016x}"
    if span.name:
        out["name"] = span.name
    out["kind"] = _KIND[span.kind]
    if span.start_time:
        out["startTimeUnixNano"] = str(span.start_time)
    if span.end_time:
        out["endTimeUnixNano"] = str(span.end_time)
    attributes = _attributes(span.attributes)
    if attributes:
        out["attributes"] = attributes
    if span.dropped_attributes:
        out["droppedAttributesCount"] = span.dropped_attributes
    if span.events:
        out["events"] = [_event_dict(event) for event in span.events]
    if span.dropped_events:
        out["droppedEventsCount"] = span.dropped_events
    if span.links:
        out["links"] = [_link_dict(link) for link in span.links]
    if span.dropped_links:
        out["droppedLinksCount"] = span.dropped_links
    out["status"] = _status_dict(span.status)
    out["flags"] = _flags(parent)
    return out


def _event_dict(event: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if event.timestamp:
        out["timeUnixNano"] = str(event.timestamp)
    if event.name:
        out["name"] = event.name
    attributes = _attributes(event.attributes)
    if attributes:
        out["attributes"] = attributes
    if event.dropped_attributes:
        out["droppedAttributesCount"] = event.dropped_attributes
    return out


def _link_dict(link: Any) -> Dict[str, Any]:
    ctx = link.context
    out: Dict[str, Any] = {"traceId": f"{ctx.trace_id:032x}", "spanId": f"{ctx.span_id:016x}"}
    attributes = _attributes(link.attributes)
    if attributes:
        out["attributes"] = attributes
    if link.dropped_attributes:
        out["droppedAttributesCount"] = link.dropped_attributes
    out["flags"] = _flags(ctx)
    return out


def _status_dict(status: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if status is None:
        return out
    if status.description:
        out["message"] = status.description
    if status.status_code.value:
        out["code"] = status.status_code.value
    return out


def _flags(context: Any) -> int:
    if context is not None and context.is_remote:
        return _FLAG_HAS_IS_REMOTE | _FLAG_IS_REMOTE
    return _FLAG_HAS_IS_REMOTE


def _attributes(attributes: Any) -> List[Dict[str, Any]]:
    if not attributes:
        return []
    out = []
    for key, value in attributes.items():
        try:
            encoded = _any_value(value)
        except Exception as exc:  # the SDK encoder logs and skips such an attribute too
            health.record_failure(f"{_OUTPUT}.attribute", exc)
            continue
        out.append(_key_value(key, encoded))
    return out


def _key_value(key: str, encoded: Dict[str, Any]) -> Dict[str, Any]:
    return {"key": key, "value": encoded} if key else {"value": encoded}  # an empty key is a zero value


def _any_value(value: Any) -> Dict[str, Any]:
    # Same type order as the SDK's _encode_value (bool before int, str before Sequence).
    if value is None:
        return {}
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, str):
        if not value.isascii():
            value.encode("utf-8")  # lone surrogates: protobuf refuses them, so do we
        return {"stringValue": value}
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"int attribute out of int64 range: {value}")
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": _json_double(value)}
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode("ascii")}
    if isinstance(value, Sequence):
        values = [_any_value(v) for v in value]
        return {"arrayValue": {"values": values} if values else {}}
    if isinstance(value, Mapping):
        pairs = [_key_value(str(k), _any_value(v)) for k, v in value.items()]
        return {"kvlistValue": {"values": pairs} if pairs else {}}
    raise TypeError(f"Invalid type {type(value)} of value {value}")


def _json_double(value: float) -> Union[float, str]:
    # proto3 JSON spells the non-finite doubles as strings
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def resource_spans_via_sdk(spans: Sequence[ReadableSpan]) -> Dict[str, Any]:
    """The reference encoding: the SDK's OTLP encoder, protobuf's ``MessageToDict``, then
    base64 ids -> lowercase hex."""
    from google.protobuf import json_format
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    out = json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    _convert_ids(out, _base64_to_hex)
    return out


def _base64_to_hex(value: str) -> str:
    return base64.b64decode(value).hex()


def _hex_to_base64(value: str) -> str:
    return base64.b64encode(bytes.fromhex(value)).decode("ascii")


def _convert_ids(traces: Dict[str, Any], convert: Callable[[str], str]) -> None:
    for resource_spans in traces.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if span.get(key):
                        span[key] = convert(span[key])
                for link in span.get("links", ()):
                    for key in ("traceId", "spanId"):
                        if link.get(key):
                            link[key] = convert(link[key])


def to_protobuf_json(traces: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of a line's object with base64 ids, as protobuf's own JSON parser
    (``json_format.ParseDict(d, TracesData())``) expects them."""
    copy = json.loads(json.dumps(traces))
    _convert_ids(copy, _hex_to_base64)
    return copy


# --------------------------------------------------------------------------- reading

Paths = Union[str, "os.PathLike[str]", Iterable[Union[str, "os.PathLike[str]"]]]


def _expand(paths: Paths) -> List[str]:
    """Paths given one by one, or a directory (its ``*.jsonl`` files, by name)."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: List[str] = []
    for item in items:
        item = os.fspath(item)
        if os.path.isdir(item):
            out.extend(os.path.join(item, n) for n in sorted(os.listdir(item)) if n.endswith(".jsonl"))
        else:
            out.append(item)
    return out


def read_otlp_json_lines(
    paths: Paths, *, on_truncated: Optional[Callable[[str, str], None]] = None
) -> Iterator[Dict[str, Any]]:
    """Each line's ``{"resourceSpans": [...]}`` object, file by file.

    A file's last line may be cut short (the process died while writing): it is skipped
    and handed to ``on_truncated(path, fragment)`` (default: a logged warning). Any other
    line that is not JSON raises ``ValueError`` naming the file and line.
    """
    for path in _expand(paths):
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                try:
                    yield json.loads(raw)
                except ValueError:
                    if raw.endswith(b"\n"):
                        raise ValueError(f"{path}:{number}: not an OTLP-JSON line") from None
                    fragment = raw.decode("utf-8", "replace")
                    if on_truncated is not None:
                        on_truncated(path, fragment)
                    else:
                        logger.warning("otel_verl: %s ends with a truncated line (%d bytes), skipped", path, len(raw))


def spans_from_files(paths: Paths, *, on_truncated: Optional[Callable[[str, str], None]] = None) -> List[Dict[str, Any]]:
    """Every span in the files as a flat dict (for tests and reports): ``traceId``,
    ``spanId``, ``parentSpanId`` (``None`` for a root), ``name``, ``kind``,
    ``startTimeUnixNano`` / ``endTimeUnixNano`` (ints), ``attributes`` and ``resource``
    (plain dicts), ``scope`` (name), ``status`` (``{"code": int, "message": str}``),
    ``events`` and ``links`` (with plain attribute dicts)."""
    out = []
    for traces in read_otlp_json_lines(paths, on_truncated=on_truncated):
        for resource_spans in traces.get("resourceSpans", ()):
            resource = attributes_to_dict(resource_spans.get("resource", {}).get("attributes"))
            for scope_spans in resource_spans.get("scopeSpans", ()):
                scope = scope_spans.get("scope", {}).get("name", "")
                for span in scope_spans.get("spans", ()):
                    out.append(flat_span(span, resource, scope))
    return out


def flat_span(span: Dict[str, Any], resource: Dict[str, Any], scope: str) -> Dict[str, Any]:
    status = span.get("status", {})
    return {
        "traceId": span.get("traceId", ""),
        "spanId": span.get("spanId", ""),
        "parentSpanId": span.get("parentSpanId") or None,
        "name": span.get("name", ""),
        "kind": span.get("kind", 0),
        "startTimeUnixNano": int(span.get("startTimeUnixNano", 0)),
        "endTimeUnixNano": int(span.get("endTimeUnixNano", 0)),
        "attributes": attributes_to_dict(span.get("attributes")),
        "resource": resource,
        "scope": scope,
        "status": {"code": status.get("code", 0), "message": status.get("message", "")},
        "events": [
            {
                "name": e.get("name", ""),
                "timeUnixNano": int(e.get("timeUnixNano", 0)),
                "attributes": attributes_to_dict(e.get("attributes")),
            }
            for e in span.get("events", ())
        ],
        "links": [
            {
                "traceId": link.get("traceId", ""),
                "spanId": link.get("spanId", ""),
                "attributes": attributes_to_dict(link.get("attributes")),
            }
            for link in span.get("links", ())
        ],
    }


def attributes_to_dict(attributes: Optional[List[Dict[str, Any]]]) -> Dict[str, Any]:
    """OTLP ``[{"key": k, "value": AnyValue}]`` -> ``{k: python value}`` (arrays as lists)."""
    return {kv.get("key", ""): any_value_to_python(kv.get("value", {})) for kv in attributes or ()}


def any_value_to_python(value: Dict[str, Any]) -> Any:
    if "stringValue" in value:
        return value["stringValue"]
    if "boolValue" in value:
        return value["boolValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])  # also "NaN" / "Infinity"
    if "arrayValue" in value:
        return [any_value_to_python(v) for v in value["arrayValue"].get("values", ())]
    if "kvlistValue" in value:
        return attributes_to_dict(value["kvlistValue"].get("values"))
    if "bytesValue" in value:
        return base64.b64decode(value["bytesValue"])
    return None
