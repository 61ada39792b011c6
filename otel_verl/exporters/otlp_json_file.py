"""Spans as OTLP-JSON lines, in the OpenTelemetry Collector file exporter's format.

The default output when no OTLP endpoint is set (``{trace_dir}/otlp/``): each batch of its
batch processor (:mod:`otel_verl.accelerated.batch`) becomes one ``{"resourceSpans":[...]}``
line in ``spans-{hostname}-pid{pid}.jsonl`` (then ``...-1.jsonl``, ``...-2.jsonl`` past the size
limit). The JSON is the OTLP/JSON mapping the Collector writes: lowerCamelCase keys,
lowercase hex ids, int64 values as decimal strings, enums as integers, zero values left
out. A line can be replayed with the Collector's ``otlpjsonfile`` receiver, posted to an
OTLP/HTTP endpoint as ``application/json``, parsed by protobuf's ``json_format`` after
:func:`to_protobuf_json` (plain proto3 JSON wants base64 ids), or read back here with
:func:`read_otlp_json_lines` / :func:`spans_from_files`.

The line is written by :class:`otel_verl.accelerated.otlp_encoding.JsonEncoder`, the encoder
of OTLP/HTTP JSON too: the objects that the SDK's OTLP encoder followed by protobuf's
``MessageToDict`` gives (:func:`resource_spans_via_sdk`, which the tests compare it with),
at a fraction of the CPU: the exporter runs on a thread that shares the GIL with the
traced process. :func:`resource_spans_dict` is the same as objects.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import threading
from collections.abc import Sequence
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_verl import health
from otel_verl.accelerated.otlp_encoding import JsonEncoder, records_of
from otel_verl.exporters._writer import FILE_MODE, REOPEN_CHECK_S, OpenFile, append_whole, make_dirs, output_pid

logger = logging.getLogger("otel_verl")

_OUTPUT = "otlp_json_file"


class OtlpJsonFileExporter(SpanExporter):
    """Appends one whole ``{"resourceSpans":[...]}`` line per export batch.

    Its file follows its path as the legacy files' do (``_writer.BackgroundWriter``): a
    file deleted meanwhile (a cleanup job removing the trace dir) is created again,
    directory included, before the next line; one renamed or replaced (logrotate) within
    about ``reopen_check_s``, the lines of that interval going to the renamed file."""

    def __init__(self, directory: str, *, max_file_bytes: int = 100 * 1024 * 1024, prefix: str = "spans",
                 output: str = _OUTPUT, reopen_check_s: float = REOPEN_CHECK_S) -> None:
        self.encoder = JsonEncoder(_OUTPUT)
        self._encoding = threading.Lock()  # the encoder's caches and counts are for one batch at a time
        self.directory = directory
        self.prefix = prefix  # file names: {prefix}-{hostname}-pid{pid}[-{index}].jsonl
        self.output = output  # the name its failures are counted under
        self.max_file_bytes = max_file_bytes
        self._host = socket.gethostname()
        self._lock = threading.Lock()  # the BSP thread and a force_flush caller may both export
        self._file: Optional[OpenFile] = None
        self._pid = 0
        self._index = 0
        self._size = 0
        self.path: Optional[str] = None
        self.reopen_check_s = reopen_check_s

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        """Write the batch (span records, or SDK ``ReadableSpan``s) as one line."""
        if not spans:
            return SpanExportResult.SUCCESS
        try:
            records = records_of(spans)
            with self._encoding:
                data = self.encoder.encode(records) + b"\n"
        except Exception as exc:
            health.record_failure(f"{_OUTPUT}.encode", exc)
            return SpanExportResult.FAILURE
        # the caller (BatchExportProcessor) counts the spans of a batch not written as dropped
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
        file = self._file
        if file is not None and self._pid == output_pid() and not file.still_at(self.path, self.reopen_check_s):
            self._close()  # opened again at its path below, with the same name
        if self._file is None or self._pid != output_pid() or self._size >= self.max_file_bytes:
            self._open_next()
        append_whole(self._file.fd, data)  # a torn last line would break every reader
        self._size += len(data)

    def _open_next(self) -> None:
        """Open the file to append to: the first one, the next one when the current is
        full, the same one again after a write error or once it left its path, a new
        series in a forked child."""
        pid = output_pid()
        if pid != self._pid:
            self._index = 0
        elif self._file is not None:  # open and full: rotate
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
        self._file, self._size, self.path = OpenFile(fd), size, path

    def _close(self) -> None:
        if self._file is not None:
            try:
                os.close(self._file.fd)
            except OSError:
                pass
            self._file = None


# --------------------------------------------------------------------------- encoding

def resource_spans_dict(spans: Sequence[Any]) -> Dict[str, Any]:
    """``{"resourceSpans": [...]}`` for a batch (records or ``ReadableSpan``s), as the
    file's line holds it: exactly ``MessageToDict(encode_spans(spans))`` with hex ids, keys
    in protobuf field-number order."""
    return json.loads(JsonEncoder(_OUTPUT).encode(records_of(spans)))


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
