"""Finding and reading what ``otel-verl report`` / ``replay`` are pointed at.

A path is a trace dir (``{trace_dir}/otlp/*.jsonl`` plus the legacy ``sample/*.csv``,
``progress/*.log`` and ``trajectory/*.jsonl`` next to it), a directory of OTLP-JSON files
(the Collector file exporter's ``*.jsonl`` / ``*.json``), or such a file. Anything else is
an :class:`InputError` with a one-line message; the command line shows it without a
traceback. What cannot be read as a file (a FIFO, a socket, a device, a directory named
like a file) is skipped and listed in :attr:`Inputs.skipped`; text that is not well-formed
UTF-8 (a lone surrogate, or bytes that are not UTF-8) is read as U+FFFD and counted in
:attr:`Lines.repaired`.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, NamedTuple, Sequence, Tuple

from otel_verl.exporters.otlp_json_file import attributes_to_dict
from otel_verl.ids import repair_text

OTLP_SUFFIXES = (".jsonl", ".json")
METRICS_DIR = "otlp-metrics"  # beside otlp/ in a trace dir (outputs.METRICS_FILES_DIR)
LOSSES_DIR = "losses"  # each process's final loss counters (exporters.loss_file.DIRECTORY)


class InputError(ValueError):
    """A path given on the command line holds no readable trace data."""


@dataclass
class Inputs:
    otlp_files: List[str] = field(default_factory=list)
    # legacy files of trace dirs among the paths (for consistency checks)
    sample_csv: List[str] = field(default_factory=list)
    progress_logs: List[str] = field(default_factory=list)
    trajectory_jsonl: List[str] = field(default_factory=list)
    # the OTLP-JSON metric files of trace dirs among the paths (otel_verl's loss counters)
    metric_files: List[str] = field(default_factory=list)
    # each process's loss and failure counters, kept current beside its outputs
    loss_files: List[str] = field(default_factory=list)
    # what the paths hold that is no file to read: (path, what it is)
    skipped: List[Tuple[str, str]] = field(default_factory=list)

    @property
    def has_legacy(self) -> bool:
        return bool(self.sample_csv or self.progress_logs or self.trajectory_jsonl)


def _not_a_file(path: str) -> str:
    """What ``path`` is when it is not a regular file (``""`` for one): opening a FIFO or
    a device would block or never end."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return "a broken link" if os.path.islink(path) else f"unreadable ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return ""
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "not a regular file"


def _files_in(directory: str, suffixes: Tuple[str, ...], out: Inputs, hidden: bool = True) -> List[str]:
    """The regular files of ``directory`` whose names end with one of ``suffixes``;
    anything else so named goes to ``out.skipped``."""
    if not os.path.isdir(directory):
        return []
    try:
        names = os.listdir(directory)
    except OSError as exc:
        raise InputError(f"{directory}: cannot read ({exc.strerror or exc})") from None
    files = []
    for name in sorted(names):
        if not name.endswith(suffixes) or (not hidden and name.startswith(".")):
            continue
        path = os.path.join(directory, name)
        what = _not_a_file(path)
        if what:
            out.skipped.append((path, what))
        else:
            files.append(path)
    return files


# what makes a directory a trace dir: its span files, its legacy files or its counters
TRACE_DIR_PARTS = ("otlp", "sample", "progress", "trajectory", METRICS_DIR, LOSSES_DIR)


def resolve(paths: Sequence[str]) -> Inputs:
    """The OTLP-JSON files (and legacy files) the paths stand for; :class:`InputError`
    when a path is missing or holds nothing to read."""
    if not paths:
        raise InputError("no path given")
    out = Inputs()
    for path in paths:
        if not os.path.exists(path):
            raise InputError(f"{path}: no such file or directory")
        what = _not_a_file(path)
        if not what:
            out.otlp_files.append(path)
            continue
        if what != "a directory":
            raise InputError(f"{path}: {what}, not a file or directory")
        if any(os.path.isdir(os.path.join(path, part)) for part in TRACE_DIR_PARTS):
            # a trace dir (otel_verl's, or a collector run dir); the spans may have gone to a
            # collector only, leaving the legacy files and the counters here
            files = _files_in(os.path.join(path, "otlp"), OTLP_SUFFIXES, out)
            out.sample_csv += _files_in(os.path.join(path, "sample"), (".csv",), out, hidden=False)
            out.progress_logs += _files_in(os.path.join(path, "progress"), (".log",), out, hidden=False)
            out.trajectory_jsonl += _files_in(os.path.join(path, "trajectory"), (".jsonl",), out, hidden=False)
            out.metric_files += _files_in(os.path.join(path, METRICS_DIR), (".jsonl",), out, hidden=False)
            out.loss_files += _files_in(os.path.join(path, LOSSES_DIR), (".json",), out, hidden=False)
            found = files or out.sample_csv or out.progress_logs or out.loss_files or out.metric_files
        else:
            files = found = _files_in(path, OTLP_SUFFIXES, out)
        if not found:
            raise InputError(f"{path}: no OTLP-JSON files (expected {os.path.join(path, 'otlp', '*.jsonl')} or *.jsonl / *.json in it)")
        out.otlp_files += files
    return out


@dataclass
class Truncated:
    path: str
    size: int  # bytes of the cut-off fragment


@dataclass
class Lines:
    """What reading OTLP-JSON files found: truncated last lines are skipped, not errors;
    text that is not well-formed UTF-8 is repaired (U+FFFD), not an error."""

    truncated: List[Truncated] = field(default_factory=list)
    lines: int = 0
    repaired: Dict[str, int] = field(default_factory=dict)  # path -> characters read as U+FFFD in it


_SIGNALS = {"resourceSpans": "trace", "resourceMetrics": "metric"}  # an OTLP line's list -> its data
# what a line holding a lone surrogate has: its JSON escape, or (json.loads decodes bytes
# with "surrogatepass") its UTF-8-like bytes, which start with 0xED
SURROGATE_MARKS = (b"\\ud", b"\\uD", b"\xed")


class _Repair:
    """Makes parsed JSON well-formed text: each lone surrogate of its strings (and keys)
    becomes U+FFFD, counted in :attr:`characters`."""

    def __init__(self) -> None:
        self.characters = 0

    def value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.text(k): self.value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v) for v in value]
        return value

    def text(self, text: str) -> str:
        if text.isascii():
            return text
        try:
            text.encode("utf-8")
            return text
        except UnicodeEncodeError:
            repaired = repair_text(text)
            self.characters += repaired.count("\ufffd") - text.count("\ufffd")
            return repaired


def parse_line(raw: bytes) -> Tuple[Any, int]:
    """``(the JSON value of raw, characters repaired)``: bytes that are not UTF-8 and lone
    surrogates are read as U+FFFD, as a decoder shows what it cannot read. ValueError
    when it is no JSON."""
    repaired = 0
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError:
        text = raw.decode("utf-8", "replace")
        obj = json.loads(text)  # ValueError when it is no JSON either
        repaired = text.count("\ufffd") - raw.count("\ufffd".encode())  # the bytes read as U+FFFD
    if any(mark in raw for mark in SURROGATE_MARKS):
        repair = _Repair()
        obj = repair.value(obj)
        repaired += repair.characters
    return obj, repaired


def iter_lines(files: Sequence[str], lines: Lines, data: str = "resourceSpans") -> Iterator[Tuple[str, int, Dict[str, Any]]]:
    """``(path, line number, {data: [...]})`` for every whole line: ``data`` is
    ``"resourceSpans"`` for trace files, ``"resourceMetrics"`` for metric files.

    A last line without its newline that does not parse is a file still being written
    (or cut by a crash): recorded in ``lines.truncated`` and skipped. Text that is not
    well-formed UTF-8 is repaired (:func:`parse_line`), counted in ``lines.repaired``. Any
    other line that is not JSON, or JSON that is not OTLP data of that signal, and a file
    that cannot be read, are an :class:`InputError`."""
    for path in files:
        try:
            f = open(path, "rb")
        except OSError as exc:
            raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
        with f:
            number = 0
            while True:
                try:
                    raw = f.readline()
                except OSError as exc:
                    raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
                if not raw:
                    break
                number += 1
                if not raw.strip():
                    continue
                try:
                    obj, repaired = parse_line(raw)
                except ValueError as exc:
                    if not raw.endswith(b"\n"):
                        lines.truncated.append(Truncated(path, len(raw)))
                        continue
                    raise InputError(f"{path}:{number}: not an OTLP-JSON line (is this a trace file? "
                                     f"{_json_error(exc)})") from None
                if not isinstance(obj, dict) or not isinstance(obj.get(data), list):
                    raise InputError(f"{path}:{number}: JSON but not OTLP {_SIGNALS[data]} data (no \"{data}\" list)")
                if repaired:
                    lines.repaired[path] = lines.repaired.get(path, 0) + repaired
                lines.lines += 1
                yield path, number, obj


def _json_error(exc: ValueError) -> str:
    """Where the JSON parser stopped, in a few words."""
    if isinstance(exc, json.JSONDecodeError):
        if exc.pos >= len(exc.doc.rstrip()):
            return "its JSON is cut short"
        return f"{exc.msg} at character {exc.pos + 1}"
    return type(exc).__name__


def count_spans(obj: Dict[str, Any]) -> int:
    return sum(
        len(scope_spans.get("spans") or ())
        for resource_spans in obj.get("resourceSpans") or ()
        for scope_spans in resource_spans.get("scopeSpans") or ()
    )


class LossFiles(NamedTuple):
    """The loss files of a run, summed."""

    counts: Dict[str, Dict[str, int]]  # {"dropped": {...}, "failures": {...}, "unsent": {...}}
    processes: int
    not_shut_down: int  # processes whose file is not final: killed (or still running)
    holding: int  # of them, those whose outputs still held something at their last write


def read_loss_files(files: Sequence[str]) -> LossFiles:
    """The loss files of a run, summed. ``unsent``: what the outputs of the processes that
    did not shut down still held at their last write (a process killed then lost them,
    uncounted). A file being replaced while it is read (one is written to a temporary name
    and renamed) counts as unreadable."""
    totals: Dict[str, Dict[str, int]] = {"dropped": {}, "failures": {}, "unsent": {}}
    not_shut_down = holding = 0
    for path in files:
        try:
            with open(path, "rb") as f:
                obj, _ = parse_line(f.read())  # names with a lone surrogate shown with U+FFFD
            counts = {"dropped": dict(obj.get("dropped") or {}), "failures": dict(obj.get("failures") or {}),
                      "unsent": {} if obj.get("final") else dict(obj.get("pending") or {})}
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            raise InputError(f"{path}: not a loss file ({type(exc).__name__}: {exc})") from None
        not_shut_down += not obj.get("final")
        holding += any(int(n) for n in counts["unsent"].values())
        for kind, named in counts.items():
            for name, n in named.items():
                totals[kind][name] = totals[kind].get(name, 0) + int(n)
    return LossFiles(totals, len(files), not_shut_down, holding)


def read_counters(files: Sequence[str], names: Sequence[str]) -> Tuple[Dict[str, Dict[Tuple[str, ...], int]], int]:
    """The latest value of each cumulative counter ``names`` in OTLP-JSON metric files,
    summed over the processes that wrote them: ``({name: {attribute values: value}},
    number of processes)``. A process is its resource (``service.instance.id`` tells two
    processes of one service apart); each line holds a whole collection, so the newest
    point of a process is its total. A torn last line is skipped, as for spans."""
    latest: Dict[Tuple[str, str, Tuple[str, ...]], Tuple[int, int]] = {}  # -> (time, value)
    processes = set()
    for path, number, obj in iter_lines(files, Lines(), "resourceMetrics"):
        try:
            for resource_metrics in obj["resourceMetrics"]:
                process = json.dumps((resource_metrics.get("resource") or {}).get("attributes"), sort_keys=True)
                processes.add(process)
                for name, labels, time_ns, value in _sum_points(resource_metrics, names):
                    key = (process, name, labels)
                    if key not in latest or time_ns >= latest[key][0]:
                        latest[key] = (time_ns, value)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{path}:{number}: malformed OTLP-JSON metrics ({type(exc).__name__}: {exc})") from None
    totals: Dict[str, Dict[Tuple[str, ...], int]] = {name: {} for name in names}
    for (_, name, labels), (_, value) in latest.items():
        totals[name][labels] = totals[name].get(labels, 0) + value
    return totals, len(processes)


def _sum_points(resource_metrics: Dict[str, Any], names: Sequence[str]) -> Iterator[Tuple[str, Tuple[str, ...], int, int]]:
    """``(metric name, attribute values, time, value)`` of each integer sum point of ``names``."""
    for scope_metrics in resource_metrics.get("scopeMetrics") or ():
        for metric in scope_metrics.get("metrics") or ():
            if metric.get("name") in names:
                for point in (metric.get("sum") or {}).get("dataPoints") or ():
                    labels = tuple(str(v) for v in attributes_to_dict(point.get("attributes")).values())
                    yield metric["name"], labels, int(point.get("timeUnixNano", 0)), int(point.get("asInt", 0))
