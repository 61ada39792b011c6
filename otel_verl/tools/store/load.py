"""Loading OTLP-JSON span files into the store's ``otel_traces``: the engine parses them.

Python reads each file from where the last load stopped to its last whole line and hands
the lines to the engine, which parses them (JSONEachRow, typed); SQL turns each span into a
row as the Collector's ``clickhouseexporter`` does (attribute values as strings, kind and
status as words), so a store loaded from files and one the Collector wrote answer the same
queries. Where the two differ: a double is written as ClickHouse prints it (``1e+21`` is
``1e21``), and an array or map attribute's JSON keeps the order of its elements and keys.

What a line holds that is no OTLP span data is counted and named (file and line), never
fatal; a last line without its newline is a file still being written, left for the next
load. Text that is not well-formed UTF-8 is repaired in Python first (U+FFFD, counted), as
the engine's JSON parser would drop the whole string.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Sequence, Tuple

from otel_verl.tools.report.inputs import SURROGATE_MARKS, InputError, parse_line

FILES_TABLE = "otel_verl_files"  # what was loaded from each file, and where it stopped
LINES_TABLE = "otel_verl_lines"  # the lines of one load, until they are spans
CHUNK_BYTES = 64 * 1024 * 1024  # the lines handed to the engine at once

# One OTLP line, typed as the engine reads it (JSONEachRow): what no field names is skipped,
# numbers written as strings (intValue, the times) are read as numbers, an array or map
# attribute value is kept as its JSON text, a kind or status code as its text.
_VALUE = ("Tuple(stringValue Nullable(String), intValue Nullable(Int64), doubleValue Nullable(Float64), "
          "boolValue Nullable(Bool), bytesValue Nullable(String), arrayValue Nullable(String), "
          "kvlistValue Nullable(String))")
_ATTRIBUTES = f"Array(Tuple(key String, value {_VALUE}))"
_SPAN = (f"Tuple(traceId String, spanId String, parentSpanId String, traceState String, name String, kind String, "
         f"startTimeUnixNano Int64, endTimeUnixNano Int64, attributes {_ATTRIBUTES}, droppedAttributesCount UInt64, "
         f"events Array(Tuple(timeUnixNano Int64, name String, attributes {_ATTRIBUTES})), droppedEventsCount UInt64, "
         f"links Array(Tuple(traceId String, spanId String, traceState String, attributes {_ATTRIBUTES})), "
         f"droppedLinksCount UInt64, status Tuple(code String, message String))")
LINE_TYPE = (f"Array(Tuple(resource Tuple(attributes {_ATTRIBUTES}), "
             f"scopeSpans Array(Tuple(scope Tuple(name String, version String), spans Array({_SPAN})))))")
PARSE_SETTINGS = {
    "input_format_skip_unknown_fields": 1,
    "input_format_json_read_objects_as_strings": 1,
    "input_format_json_read_arrays_as_strings": 1,
    "input_format_json_read_numbers_as_strings": 1,
    "input_format_json_defaults_for_missing_elements_in_named_tuple": 1,
}

def _element(v: str) -> str:
    """An element of an array or map attribute (its OTLP JSON ``v``) as JSON."""
    return (f"multiIf(JSONHas({v}, 'stringValue'), toJSONString(JSONExtractString({v}, 'stringValue')), "
            f"JSONHas({v}, 'intValue'), toString(JSONExtractInt({v}, 'intValue')), "
            f"JSONHas({v}, 'doubleValue'), toString(JSONExtractFloat({v}, 'doubleValue')), "
            f"JSONHas({v}, 'boolValue'), if(JSONExtractBool({v}, 'boolValue'), 'true', 'false'), 'null')")


def _as_string(v: str) -> str:
    """An attribute value (the typed tuple ``v``) as the Collector's ``Value.AsString``
    writes it; an array's or a map's JSON without the engine's ``\/`` escapes."""
    array = (f"concat('[', arrayStringConcat(arrayMap(e -> {_element('e')}, "
             f"JSONExtractArrayRaw(assumeNotNull({v}.arrayValue), 'values')), ','), ']')")
    pair_value = "JSONExtractRaw(pair, 'value')"
    kvlist = (f"concat('{{', arrayStringConcat(arrayMap(pair -> concat(toJSONString(JSONExtractString(pair, 'key')), "
              f"':', {_element(pair_value)}), "
              f"JSONExtractArrayRaw(assumeNotNull({v}.kvlistValue), 'values')), ','), '}}')")
    return (f"multiIf(isNotNull({v}.stringValue), {v}.stringValue, "
            f"isNotNull({v}.intValue), toString({v}.intValue), "
            f"isNotNull({v}.doubleValue), toString({v}.doubleValue), "
            f"isNotNull({v}.boolValue), if({v}.boolValue, 'true', 'false'), "
            f"isNotNull({v}.arrayValue), replaceAll({array}, '\\\\/', '/'), "
            f"isNotNull({v}.kvlistValue), replaceAll({kvlist}, '\\\\/', '/'), "
            f"isNotNull({v}.bytesValue), {v}.bytesValue, '')")


def _attributes(array: str) -> str:
    """``Map(key, value as text)`` of an OTLP attribute list."""
    return (f"mapFromArrays(arrayMap(kv -> kv.key, {array}), "
            f"arrayMap(kv -> {_as_string('kv.value')}, {array}))")


def _word(text: str, words: str) -> str:
    """An enum written as its number (OTLP-JSON) as the Collector's word for it."""
    return (f"multiIf(match({text}, '^[0-9]+$'), {words}[least(toUInt64({text}), length({words}) - 1) + 1], "
            f"{text} = '', {words}[1], {text})")


_KINDS = "['Unspecified', 'Internal', 'Server', 'Client', 'Producer', 'Consumer']"
_STATUSES = "['Unset', 'Ok', 'Error']"

INSERT_SPANS = f"""
INSERT INTO otel_traces (Timestamp, TraceId, SpanId, ParentSpanId, TraceState, SpanName, SpanKind, ServiceName,
    ResourceAttributes, ScopeName, ScopeVersion, SpanAttributes, Duration, StatusCode, StatusMessage,
    `Events.Timestamp`, `Events.Name`, `Events.Attributes`,
    `Links.TraceId`, `Links.SpanId`, `Links.TraceState`, `Links.Attributes`)
SELECT
    fromUnixTimestamp64Nano(span.startTimeUnixNano),
    lower(span.traceId), lower(span.spanId), lower(span.parentSpanId), span.traceState, span.name,
    {_word("span.kind", _KINDS)},
    resource['service.name'], resource, scope_spans.scope.name, scope_spans.scope.version,
    {_attributes("span.attributes")},
    toUInt64(greatest(span.endTimeUnixNano - span.startTimeUnixNano, 0)),
    {_word("span.status.code", _STATUSES)}, span.status.message,
    arrayMap(e -> fromUnixTimestamp64Nano(e.timeUnixNano), span.events),
    arrayMap(e -> e.name, span.events),
    arrayMap(e -> {_attributes("e.attributes")}, span.events),
    arrayMap(l -> lower(l.traceId), span.links),
    arrayMap(l -> lower(l.spanId), span.links),
    arrayMap(l -> l.traceState, span.links),
    arrayMap(l -> {_attributes("l.attributes")}, span.links)
FROM (
    SELECT resource_spans, scope_spans, span, {_attributes("resource_spans.resource.attributes")} AS resource
    FROM {LINES_TABLE}
    ARRAY JOIN resourceSpans AS resource_spans
    ARRAY JOIN resource_spans.scopeSpans AS scope_spans
    ARRAY JOIN scope_spans.spans AS span
)
"""

# the spans, and what SDK span limits cut off (the store's table has no column for it)
COUNT_SPANS = f"""
SELECT count(), sum(span.droppedAttributesCount), sum(span.droppedEventsCount), sum(span.droppedLinksCount)
FROM {LINES_TABLE}
ARRAY JOIN resourceSpans AS resource_spans
ARRAY JOIN resource_spans.scopeSpans AS scope_spans
ARRAY JOIN scope_spans.spans AS span
"""
# the rows (in insert order) that hold no spans: JSON, but no OTLP trace data
EMPTY_ROWS = f"SELECT row FROM (SELECT rowNumberInAllBlocks() AS row, resourceSpans FROM {LINES_TABLE}) WHERE empty(resourceSpans)"

DROPPED_TABLE = "otel_verl_dropped"  # what SDK span limits cut off, per load
REJECTED_TABLE = "otel_verl_rejected"  # the lines that are no OTLP span data
BOOKKEEPING = (
    f"""CREATE TABLE IF NOT EXISTS {FILES_TABLE} (
        Path String, Device UInt64, Inode UInt64, Offset UInt64, Lines UInt64, Repaired UInt64, Version UInt64
    ) ENGINE = ReplacingMergeTree(Version) ORDER BY Path""",
    f"CREATE TABLE IF NOT EXISTS {LINES_TABLE} (resourceSpans {LINE_TYPE}) ENGINE = Memory",
    f"""CREATE TABLE IF NOT EXISTS {DROPPED_TABLE} (Attributes UInt64, Events UInt64, Links UInt64)
        ENGINE = MergeTree ORDER BY tuple()""",
    f"CREATE TABLE IF NOT EXISTS {REJECTED_TABLE} (Path String, Line UInt64, Why String) ENGINE = MergeTree ORDER BY (Path, Line)",
)


@dataclass
class Load:
    """What one load read."""

    files: int = 0
    lines: int = 0  # lines loaded now
    spans: int = 0  # spans loaded now
    bytes: int = 0  # bytes read now
    pending: List[Tuple[str, int]] = field(default_factory=list)  # (file, bytes of a last line still being written)
    rejected: int = 0  # lines read now that are no OTLP span data (the store names them)
    repaired: Dict[str, int] = field(default_factory=dict)  # path -> characters read as U+FFFD now
    reloaded: bool = False  # a file was replaced or cut: the store was rebuilt


@dataclass
class _FileState:
    path: str
    device: int = 0
    inode: int = 0
    offset: int = 0
    lines: int = 0
    repaired: int = 0


def load(client: Any, files: Sequence[str], reset: Callable[[], None]) -> Load:
    """Loads what ``files`` gained since the last load into ``otel_traces``; ``reset()``
    empties the store when a loaded file was replaced or cut (its spans cannot be told
    apart from the new ones), and everything is loaded again."""
    for statement in BOOKKEEPING:
        client.command(statement)
    states = _states(client)
    result = Load(files=len(files))
    if any(path_key(path) in states and _replaced(path, states[path_key(path)]) for path in files):
        reset()
        for statement in BOOKKEEPING:
            client.command(statement)
        states, result.reloaded = {}, True
    loader = _Loader(client, result)
    for path in files:
        state = states.get(path_key(path))
        loader.read(replace(state, path=path) if state else _FileState(path))
    loader.flush()
    return result


def path_key(path: str) -> str:
    """A file's name as the store's tables keep it: a name that is not UTF-8 (Python's
    surrogateescape) with its undecodable bytes written as ``\\udcXX``, which a String
    column takes."""
    return path.encode("utf-8", "backslashreplace").decode("utf-8")


def _states(client: Any) -> Dict[str, _FileState]:
    """Where each file's load stopped, by :func:`path_key`."""
    rows = client.query(f"SELECT Path, Device, Inode, Offset, Lines, Repaired FROM {FILES_TABLE} FINAL").result_rows
    return {row[0]: _FileState(*row) for row in rows}


def _replaced(path: str, state: _FileState) -> bool:
    """The file is no longer the one loaded up to ``state.offset``."""
    try:
        st = os.stat(path)
    except OSError:
        return True
    return (st.st_dev, st.st_ino) != (state.device, state.inode) or st.st_size < state.offset


class _Loader:
    """Hands the lines of many files to the engine and turns them into spans in few
    inserts (each insert is a part of the table: fewer, larger ones load faster)."""

    def __init__(self, client: Any, result: Load) -> None:
        self.client = client
        self.result = result
        self.origin: List[Tuple[str, int]] = []  # (path, line) of each staged row, in order
        self.staged = 0  # bytes
        self.rejected: List[Tuple[str, int, str]] = []
        self.states: List[_FileState] = []  # the files whose lines are staged
        client.command(f"TRUNCATE TABLE {LINES_TABLE}")

    def read(self, state: _FileState) -> None:
        """Stages what ``state.path`` gained since ``state.offset``."""
        path = state.path
        try:
            f = open(path, "rb")
        except OSError as exc:
            raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
        with f:
            st = os.fstat(f.fileno())
            state.device, state.inode = st.st_dev, st.st_ino
            f.seek(state.offset)
            self.states.append(state)
            carry = b""
            while True:
                try:
                    chunk = f.read(CHUNK_BYTES)
                except OSError as exc:
                    raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
                if not chunk:
                    break
                data = carry + chunk
                whole = data.rfind(b"\n") + 1
                if whole:
                    self._stage(state, data[:whole])
                carry = data[whole:]
            if carry.strip():
                if _is_json(carry):  # a whole last line without its newline
                    self._stage(state, carry)
                else:  # still being written (or cut by a crash): the next load reads it whole
                    self.result.pending.append((path, len(carry)))

    def _stage(self, state: _FileState, data: bytes) -> None:
        lines: List[Tuple[int, bytes]] = []
        number = state.lines
        for raw in data.splitlines():
            number += 1
            if not raw.strip():
                continue
            if any(mark in raw for mark in SURROGATE_MARKS) or not raw.isascii() and not _is_utf8(raw):
                raw = self._repaired(state, raw)
            lines.append((number, raw))
        try:
            _parse(self.client, b"\n".join(raw for _, raw in lines))
            self.origin += [(state.path, line) for line, _ in lines]
        except Exception:  # a line the engine cannot read (none staged): find it, one line at a time
            for line, raw in lines:
                try:
                    _parse(self.client, raw)
                    self.origin.append((state.path, line))
                except Exception as exc:  # the engine's message says where and why
                    self.rejected.append((state.path, line, _why(raw, exc)))
        state.lines = number
        state.offset += len(data)
        self.staged += len(data)
        self.result.bytes += len(data)
        if self.staged >= CHUNK_BYTES:
            self.flush()

    def _repaired(self, state: _FileState, raw: bytes) -> bytes:
        """The line with its lone surrogates and bytes that are not UTF-8 as U+FFFD."""
        try:
            obj, repaired = parse_line(raw)
        except ValueError:
            return raw  # not JSON: the engine rejects it, and it is named
        if repaired:
            self.result.repaired[state.path] = self.result.repaired.get(state.path, 0) + repaired
            state.repaired += repaired
        return json.dumps(obj, ensure_ascii=False).encode()

    def flush(self) -> None:
        """Turns the staged lines into spans, then records where each file stopped."""
        client = self.client
        empty = client.query(EMPTY_ROWS, settings={"max_threads": 1}).result_rows
        self.rejected += [(*self.origin[row], 'JSON but no OTLP spans (no "resourceSpans" list, or an empty one)') for (row,) in empty]
        spans, *dropped = client.query(COUNT_SPANS).result_rows[0]
        if spans:
            client.command(INSERT_SPANS)
            client.insert(DROPPED_TABLE, [dropped], column_names=["Attributes", "Events", "Links"])
        client.command(f"TRUNCATE TABLE {LINES_TABLE}")
        if self.rejected:
            client.insert(REJECTED_TABLE, [[path_key(path), line, why] for path, line, why in self.rejected],
                          column_names=["Path", "Line", "Why"])
        self.result.spans += spans
        self.result.lines += len(self.origin) - len(empty)
        self.result.rejected += len(self.rejected)
        if self.states:
            version = client.query(f"SELECT max(Version) + 1 FROM {FILES_TABLE}").result_rows[0][0]
            client.insert(FILES_TABLE, [[path_key(s.path), s.device, s.inode, s.offset, s.lines, s.repaired, version]
                                        for s in self.states],
                          column_names=["Path", "Device", "Inode", "Offset", "Lines", "Repaired", "Version"])
        self.origin, self.rejected, self.staged = [], [], 0
        self.states = self.states[-1:]  # the file being read goes on


def _parse(client: Any, data: bytes) -> None:
    client.raw_insert(LINES_TABLE, insert_block=data, fmt="JSONEachRow", settings=PARSE_SETTINGS)


def _why(raw: bytes, exc: Exception) -> str:
    """Why a line is no OTLP span data, in a few words."""
    try:
        json.loads(raw)
    except ValueError as error:
        return f"not JSON ({error})"
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    detail = re.sub(r"(Code: \d+\. DB::Exception: )+", "", detail)  # the driver's wrapping, twice
    return f"not OTLP span data ({detail[:200]})"


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
        return True
    except ValueError:
        return False


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
