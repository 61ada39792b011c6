"""OTLP-JSON files: the Collector file exporter's line format, read back and re-parsed."""

from __future__ import annotations

import json
import math
import os
import re
import socket
from importlib.metadata import version
from typing import Any, List

import pytest
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.trace.v1.trace_pb2 import TracesData
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState
from opentelemetry.trace import set_span_in_context

from otel_verl import events, health
from otel_verl.accelerated.batch import BatchExportProcessor
from otel_verl.exporters.otlp_json_file import (
    OtlpJsonFileExporter,
    read_otlp_json_lines,
    resource_spans_dict,
    resource_spans_via_sdk,
    spans_from_files,
    to_protobuf_json,
)

ATTRS = {
    "s": "text é 世界",
    "i": 42,
    "neg": -7,
    "big": 2**62,
    "d": 0.25,
    "b": True,
    "f": False,
    "zero": 0,
    "empty": "",
    "strs": ("a", "b"),
    "ints": (1, 2, 3),
    "doubles": (0.5, 1.5),
    "bools": (True, False),
}


def make_spans() -> List[Any]:
    """A varied batch: nesting, every attribute type, links, events, error status, a
    remote parent with trace state, SERVER/CLIENT kinds, two scopes, two resources and a
    span over its attribute limit."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(
        resource=Resource.create({"service.name": "verl", "verl.role": "trainer", "verl.run_id": "r1"}),
        span_limits=SpanLimits(max_span_attributes=20, max_events=2, max_links=2,
                               max_event_attributes=1, max_link_attributes=1),
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("otel_verl", "0.1.0")
    with tracer.start_as_current_span("verl.step", attributes=ATTRS) as root:
        with tracer.start_as_current_span("chat qwen", kind=SpanKind.CLIENT) as child:
            child.add_event("retry", {"attempt": 2, "why": "abort"})
        link_ctx = root.get_span_context()
        with tracer.start_as_current_span("verl.sample_stage adv", links=[Link(link_ctx, {"k": "v"})]):
            pass
        try:
            with tracer.start_as_current_span("execute_tool calc"):
                raise ValueError("boom")
        except ValueError:
            pass
    remote = SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(1),
                         trace_state=TraceState([("vendor", "x")]))
    tracer.start_span("verl.llm_server.generate", context=set_span_in_context(NonRecordingSpan(remote)),
                      kind=SpanKind.SERVER).end()
    provider.get_tracer("other.scope").start_span("plain").end()
    over = tracer.start_span("too many attributes", attributes={f"a{i}": i for i in range(25)})
    over.set_status(Status(StatusCode.OK))
    over.end()
    odd = tracer.start_span("odd values", attributes={"nan": math.nan, "inf": math.inf, "ninf": -math.inf,
                                                      "empty_list": (), "huge": 2**70})
    odd.end()
    crowded = tracer.start_span("over its limits", links=[Link(link_ctx, {"a": 1, "b": 2})] * 3)
    for i in range(3):
        crowded.add_event(f"e{i}", {"a": i, "b": i})
    crowded.end()
    other = TracerProvider(resource=Resource.create({"service.name": "verl", "verl.role": "llm_server"},
                                                    schema_url="https://opentelemetry.io/schemas/1.21.0"))
    other.add_span_processor(SimpleSpanProcessor(exporter))
    other.get_tracer("otel_verl").start_span("verl.llm_server.generate").end()
    scoped = other.get_tracer("scoped", "1.0", schema_url="https://opentelemetry.io/schemas/1.21.0",
                              attributes={"scope.attr": "x"})
    scoped.start_span("in a scope with attributes").end()
    return list(exporter.get_finished_spans()) + [_raw_span(provider)]


def _raw_span(provider) -> ReadableSpan:
    """A span whose attributes never went through the SDK's cleaning (maps, bytes, an
    unencodable object): both encoders must treat them alike."""
    ctx = SpanContext(0xABC, 0xDEF, is_remote=False)
    return ReadableSpan(
        name="raw", context=ctx, parent=None, resource=provider.resource, kind=SpanKind.PRODUCER,
        attributes={"map": {"a": 1, "b": ("x",), 3: None}, "empty_map": {}, "raw": b"\x00\xff", "obj": object()},
        start_time=1, end_time=2,
    )


SDK_ENCODES_SCOPES = tuple(int(part) for part in version("opentelemetry-sdk").split(".")[:2]) >= (1, 31)
needs_scope_encoding = pytest.mark.skipif(
    not SDK_ENCODES_SCOPES, reason="SDKs before 1.31 leave scope attributes and schema URLs out of their encoding")


@needs_scope_encoding
def test_direct_encoding_equals_the_sdk_encoder_with_message_to_dict():
    spans = make_spans()
    direct = resource_spans_dict(spans)
    reference = resource_spans_via_sdk(spans)
    assert direct == reference
    # same key order too, so the bytes of a line are the same either way
    assert json.dumps(direct) == json.dumps(reference)
    assert len(direct["resourceSpans"]) == 2
    # scopes: otel_verl, other.scope, and none at all (the raw span) as an empty object
    assert [ss["scope"].get("name") for ss in direct["resourceSpans"][0]["scopeSpans"]] == ["otel_verl", "other.scope", None]
    assert direct["resourceSpans"][1]["schemaUrl"] and direct["resourceSpans"][1]["scopeSpans"][1]["schemaUrl"]
    crowded = next(sp for rs in direct["resourceSpans"] for ss in rs["scopeSpans"] for sp in ss["spans"]
                   if sp["name"] == "over its limits")
    assert crowded["droppedEventsCount"] == 1 and crowded["droppedLinksCount"] == 1
    assert crowded["events"][0]["droppedAttributesCount"] == 1


@needs_scope_encoding
def test_lines_parse_back_into_protobuf_traces_data_after_hex_to_base64():
    spans = make_spans()
    line = json.dumps(resource_spans_dict(spans), separators=(",", ":"))
    parsed = json_format.ParseDict(to_protobuf_json(json.loads(line)), TracesData())
    # the same bytes as the SDK's own OTLP protobuf request (same field layout)
    assert parsed.SerializeToString() == encode_spans(spans).SerializeToString()


def _pipeline_with_exporter(make_pipeline, directory, **kwargs):
    exporter = OtlpJsonFileExporter(str(directory), **kwargs)
    bsp = BatchSpanProcessor(exporter, schedule_delay_millis=60_000)
    return exporter, bsp, make_pipeline([bsp])


def _sample_trajectory(uid="3f1b2c3d-0000-4000-8000-000000000001", traj="0"):
    with events.trajectory(uid, traj, step=2, agent_name="tool_agent"):
        with events.agent_run("ToolAgentLoop"):
            with events.llm_call([1, 2, 3], model="qwen", temperature=0.5) as turn:
                turn.finish([4, 5], stop_reason="stop", server_meta={"e2e_latency": 0.5})
            with events.tool_call("calc"):
                pass
        with events.reward() as reward:
            reward.score(1.0)


def test_events_spans_round_trip_through_the_file(tmp_path, make_pipeline):
    exporter, bsp, pipeline = _pipeline_with_exporter(make_pipeline, tmp_path)
    _sample_trajectory()
    tracer = pipeline.provider.get_tracer("otel_verl")
    tracer.start_span("typed", attributes=ATTRS).end()
    assert bsp.force_flush()

    [name] = os.listdir(tmp_path)
    assert name == f"spans-{socket.gethostname()}-pid{os.getpid()}.jsonl"
    raw = open(tmp_path / name, encoding="utf-8").read()
    assert raw.endswith("\n") and len(raw.splitlines()) == 1  # one export batch, one line
    assert raw.startswith('{"resourceSpans":[{"resource":{"attributes":[')

    in_memory = {s.context.span_id: s for s in pipeline.spans()}
    flat = spans_from_files(tmp_path)
    assert len(flat) == len(in_memory) == 5
    for span in flat:
        mem = in_memory[int(span["spanId"], 16)]
        assert span["traceId"] == f"{mem.context.trace_id:032x}"
        assert span["parentSpanId"] == (f"{mem.parent.span_id:016x}" if mem.parent else None)
        assert span["name"] == mem.name
        assert (span["startTimeUnixNano"], span["endTimeUnixNano"]) == (mem.start_time, mem.end_time)
        expected = {k: list(v) if isinstance(v, tuple) else v for k, v in mem.attributes.items()}
        assert span["attributes"] == expected
        assert span["resource"]["service.name"] == "verl"
        assert span["resource"]["verl.role"] == "trainer"
        assert span["resource"]["verl.run_id"] == "test-run"
    typed = next(s for s in flat if s["name"] == "typed")
    assert typed["attributes"]["strs"] == ["a", "b"] and typed["attributes"]["doubles"] == [0.5, 1.5]
    assert typed["attributes"]["b"] is True and typed["attributes"]["zero"] == 0
    chat = next(s for s in flat if s["name"] == "chat qwen")
    assert chat["kind"] == 3  # CLIENT, as an integer


def test_the_collector_json_conventions_hold_on_the_raw_line(tmp_path, make_pipeline):
    exporter, bsp, pipeline = _pipeline_with_exporter(make_pipeline, tmp_path)
    tracer = pipeline.provider.get_tracer("otel_verl")
    tracer.start_span("typed", attributes={"i": 5, "d": 1.5}).end()
    try:
        with tracer.start_as_current_span("failing"):
            raise KeyError("x")
    except KeyError:
        pass
    bsp.force_flush()
    raw = next(iter(os.scandir(tmp_path))).path
    line = open(raw, encoding="utf-8").read()
    compact = json.dumps(json.loads(line), separators=(",", ":"), ensure_ascii=False) + "\n"
    assert line == compact  # compact separators, UTF-8
    span_objs = [s for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    for s in span_objs:
        assert re.fullmatch(r"[0-9a-f]{32}", s["traceId"]) and re.fullmatch(r"[0-9a-f]{16}", s["spanId"])
        assert "parentSpanId" not in s  # roots: zero values are omitted
        assert isinstance(s["startTimeUnixNano"], str) and s["startTimeUnixNano"].isdigit()
        assert s["kind"] == 1 and "droppedAttributesCount" not in s
    typed, failing = sorted(span_objs, key=lambda s: s["name"] != "typed")
    assert {"key": "i", "value": {"intValue": "5"}} in typed["attributes"]
    assert {"key": "d", "value": {"doubleValue": 1.5}} in typed["attributes"]
    assert typed["status"] == {}
    assert failing["status"]["code"] == 2 and "KeyError" in failing["status"]["message"]


def test_rotation_past_the_size_limit_keeps_whole_lines(tmp_path):
    spans = make_spans()
    exporter = OtlpJsonFileExporter(str(tmp_path), max_file_bytes=4000)
    for i in range(0, len(spans) * 4, 2):
        assert exporter.export([spans[i % len(spans)], spans[(i + 1) % len(spans)]]) is SpanExportResult.SUCCESS
    exporter.shutdown()
    base = f"spans-{socket.gethostname()}-pid{os.getpid()}"
    names = sorted(os.listdir(tmp_path), key=lambda n: (len(n), n))
    assert names[0] == base + ".jsonl" and len(names) > 2
    assert names[1:] == [f"{base}-{k}.jsonl" for k in range(1, len(names))]
    total = 0
    for name in names[:-1]:
        data = open(tmp_path / name, "rb").read()
        assert data.endswith(b"\n") and len(data) >= 4000
    for name in names:
        total += len(spans_from_files(tmp_path / name))
    assert total == len(spans) * 4


def test_a_truncated_last_line_is_skipped_and_reported(tmp_path):
    spans = make_spans()
    exporter = OtlpJsonFileExporter(str(tmp_path))
    exporter.export(spans[:3])
    exporter.export(spans[3:6])
    exporter.shutdown()
    path = exporter.path
    with open(path, "ab") as f:  # a crash in the middle of a write
        f.write(b'{"resourceSpans":[{"resource":{"attri')
    truncated = []
    lines = list(read_otlp_json_lines([path], on_truncated=lambda p, frag: truncated.append((p, frag))))
    assert len(lines) == 2
    assert truncated == [(path, '{"resourceSpans":[{"resource":{"attri')]
    assert len(spans_from_files(path, on_truncated=lambda p, f: None)) == 6


def test_a_corrupt_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "spans-x-pid1.jsonl"
    path.write_text('{"resourceSpans":[]}\nnot json\n{"resourceSpans":[]}\n')
    with pytest.raises(ValueError, match=r"spans-x-pid1\.jsonl:2"):
        list(read_otlp_json_lines(path))


def test_an_unwritable_directory_fails_the_export_without_raising(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    exporter = OtlpJsonFileExporter(str(blocker / "otlp"))
    assert exporter.export(make_spans()[:2]) is SpanExportResult.FAILURE
    assert health.snapshot()["failures"].get("otlp_json_file.write") == 1
    exporter.shutdown()


def test_failed_batches_are_counted_as_dropped_by_the_bootstrap_wrapper(tmp_path, make_pipeline):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    processor = BatchExportProcessor(OtlpJsonFileExporter(str(blocker)), "otlp_json_file")
    make_pipeline([processor])
    _sample_trajectory()
    processor.force_flush()
    assert health.snapshot()["dropped"].get("otlp_json_file") == 4


def test_a_write_that_fails_half_way_leaves_only_whole_lines(tmp_path, monkeypatch):
    import errno

    from otel_verl.exporters import otlp_json_file as module

    spans = make_spans()
    exporter = OtlpJsonFileExporter(str(tmp_path))
    assert exporter.export(spans[:2]) is SpanExportResult.SUCCESS
    real_write = os.write

    calls = []

    def disk_full_half_way(fd, data):  # the kernel takes half, then the disk is full
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(module.os, "write", disk_full_half_way)
    assert exporter.export(spans[2:4]) is SpanExportResult.FAILURE
    monkeypatch.setattr(module.os, "write", real_write)
    assert exporter.export(spans[4:6]) is SpanExportResult.SUCCESS  # same file, reopened
    exporter.shutdown()
    data = open(exporter.path, "rb").read()
    assert data.endswith(b"\n") and len(data.splitlines()) == 2
    assert [s["name"] for s in spans_from_files(exporter.path)] == [s.name for s in spans[:2] + spans[4:6]]


def test_a_full_file_left_by_an_earlier_process_with_our_pid_is_skipped(tmp_path):
    base = f"spans-{socket.gethostname()}-pid{os.getpid()}"
    (tmp_path / f"{base}.jsonl").write_bytes(b"x" * 5000 + b"\n")
    exporter = OtlpJsonFileExporter(str(tmp_path), max_file_bytes=4000)
    assert exporter.export(make_spans()[:1]) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert exporter.path == str(tmp_path / f"{base}-1.jsonl")
