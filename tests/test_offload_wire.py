"""The export process's wire (otel_verl.offload.wire): a span crosses it as its record,
whole, as its public ReadableSpan properties show it, with its payload; both ends check
the version."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import subprocess
import sys
from array import array

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags, TraceState

from otel_verl import health, payload, settings
from otel_verl.offload import wire
from otel_verl.rollout_data import PromptTail, TrajectoryData, TurnData, UnsentTokens, kept_ids, kept_prompt
from otel_verl.text_codec import TextCodec
from otel_verl.payload import Payload
from otel_verl.record import FIELDS, TUPLE_FIELDS, EventRecord, LinkRecord, SpanRecord, from_tuple, to_tuple
from otel_verl.semconv import Subject

RESOURCE = Resource.create({"service.name": "verl", "verl.role": "agent_loop_worker"})
CONFIG = wire.HostConfig(settings=settings.load({}), resource_attributes=dict(RESOURCE.attributes),
                         resource_schema_url=RESOURCE.schema_url, pid=1234)


class Capture(SpanProcessor):
    """What the offload processor gets: each start (with its attributes then) and end,
    with the span's payload as a processor reads it."""

    def __init__(self) -> None:
        self.starts, self.ends = [], []

    def on_start(self, span, parent_context=None) -> None:
        self.starts.append((span, payload.payload_of(span), dict(span.attributes)))

    def on_end(self, span) -> None:
        self.ends.append((span, payload.payload_of(span)))


def _tracer(capture: Capture, limits: SpanLimits = None):
    provider = TracerProvider(resource=RESOURCE, span_limits=limits)
    provider.add_span_processor(capture)
    return provider.get_tracer("otel_verl.test", "1.2.3", schema_url="https://opentelemetry.io/schemas/1.21.0",
                               attributes={"scope.attr": "yes"})


def _crossed(packed: tuple) -> tuple:
    """Through a frame, as the export process reads it."""
    return wire.read_frame(io.BytesIO(wire.frame(wire.Spans([packed])))).spans[0]


def _payload(packed: tuple, shared: dict = None) -> Payload:
    """The payload the export process rebuilds of a packed span (``shared``: its shared objects by id)."""
    return wire.Rebuilder(CONFIG, shared).record(packed).payload


def _public(span) -> dict:
    """Every public ReadableSpan property, in comparable form."""
    return {
        "name": span.name, "context": span.context, "parent": span.parent, "kind": span.kind,
        "start_time": span.start_time, "end_time": span.end_time, "attributes": dict(span.attributes),
        "events": [(e.name, e.timestamp, dict(e.attributes), e.dropped_attributes) for e in span.events],
        "links": [(link.context, dict(link.attributes), link.dropped_attributes) for link in span.links],
        "status": (span.status.status_code, span.status.description),
        "resource": (dict(span.resource.attributes), span.resource.schema_url),
        "scope": (span.instrumentation_scope.name, span.instrumentation_scope.version,
                  span.instrumentation_scope.schema_url, dict(span.instrumentation_scope.attributes)),
        "dropped": (span.dropped_attributes, span.dropped_events, span.dropped_links),
    }


def test_a_span_crosses_with_every_public_property_and_encodes_to_the_same_otlp():
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    capture = Capture()
    tracer = _tracer(capture, SpanLimits(max_span_attributes=3, max_events=2, max_links=1, max_event_attributes=1,
                                         max_link_attributes=1))
    remote = SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED),
                         trace_state=TraceState([("vendor", "v1"), ("other", "o2")]))
    linked = SpanContext(0xABC, 0xDEF, is_remote=True, trace_state=TraceState([("k", "v")]))
    with tracer.start_as_current_span("client call", context=trace.set_span_in_context(NonRecordingSpan(remote)),
                                      kind=SpanKind.CLIENT, attributes={"a": 1, "b": [1.5, 2.5]},
                                      links=[Link(linked), Link(linked, {"l1": 1, "l2": 2})]) as span:
        span.set_attributes({"c": "three", "d": True})  # one too many: the oldest is dropped
        span.add_event("zeroth", timestamp=500)  # dropped: two events at most
        span.add_event("first", {"e1": 1, "e2": 2}, timestamp=1_000)
        span.add_event("second", timestamp=2_000)
        span.set_status(StatusCode.ERROR, "boom")
    [(started, _, start_attributes)], [(ended, _)] = capture.starts, capture.ends
    want = _public(ended)
    assert want["dropped"] == (1, 1, 1) and want["links"][0][2] == 1 and want["events"][0][3] == 1  # all exercised
    assert want["context"].trace_state == remote.trace_state and want["parent"].is_remote

    rebuilt = wire.Rebuilder(CONFIG).record(_crossed(wire.pack(ended, None, None)))
    assert _public(rebuilt) == want
    assert encode_spans([rebuilt]).SerializeToString() == encode_spans([ended]).SerializeToString()

    start = wire.Rebuilder(CONFIG).record(_crossed(wire.pack(started, None, None, start_attributes)))
    assert start.end_time is None and dict(start.attributes) == {"a": 1, "b": (1.5, 2.5)}  # as when it started
    assert (start.name, start.context, start.parent, start.kind, start.start_time) == (
        ended.name, ended.context, ended.parent, ended.kind, ended.start_time)
    assert not start.events and start.status.status_code is StatusCode.UNSET


def test_a_span_crosses_as_its_records_tuple_form():
    """What crosses is the record's one tuple form (record.to_tuple), then what the wire
    carries apart: the scope's fields, the payload as a plain pair, the shared id; no
    resource and no type of the wire's own."""
    capture = Capture()
    remote = SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED),
                         trace_state=TraceState([("vendor", "v1")]))
    with _tracer(capture).start_as_current_span("s", context=trace.set_span_in_context(NonRecordingSpan(remote)),
                                                attributes={"k": "v", "n": (1, 2)},
                                                links=[Link(remote, {"why": "test"})]) as span:
        span.add_event("e", {"x": 1.5})
    ended = capture.ends[0][0]
    sent = wire.pack(ended, Payload(Subject.TOOL, ["t0", "t1"]), None)
    assert type(sent) is tuple and len(sent) == len(TUPLE_FIELDS) + 3
    record = dict(zip(TUPLE_FIELDS, sent))
    assert (record["name"], record["attributes"], record["kind"], record["status_code"]) == (
        "s", {"k": "v", "n": (1, 2)}, SpanKind.INTERNAL, StatusCode.UNSET)
    assert (record["trace_id"], record["parent_id"], record["parent_remote"], record["trace_state"]) == (
        0x1234, 0x5678, True, TraceState([("vendor", "v1")]))
    scope, sent_payload, shared = sent[len(TUPLE_FIELDS):]
    assert scope == ("otel_verl.test", "1.2.3", "https://opentelemetry.io/schemas/1.21.0", (("scope.attr", "yes"),))
    assert type(sent_payload) is tuple and sent_payload == (Subject.TOOL, ["t0", "t1"])  # other data goes as it is
    assert shared is None
    assert not any(isinstance(value, Resource) for value in sent)


def _full_record() -> SpanRecord:
    """A record with every field set to something other than its default."""
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    state = TraceState([("vendor", "v1"), ("other", "o2")])
    return SpanRecord(
        "chat m", 0x1234, 0x5678, TraceFlags.SAMPLED, state, 0x9ABC, True, SpanKind.CLIENT, 1_000, 2_000,
        {"a": 1, "b": (1.5, 2.5), "c": "three"},
        (EventRecord("first", 1_500, {"e": 1}, 2), EventRecord("second", 1_600, {})),
        (LinkRecord(0xABC, 0xDEF, 1, TraceState([("k", "v")]), True, {"l": 1}, 3),
         LinkRecord(0xABD, 0xDF0, 0, None, False, {})),
        StatusCode.ERROR, "boom", 4, 5, 6, RESOURCE,
        InstrumentationScope("otel_verl.test", "1.2.3", "https://opentelemetry.io/schemas/1.21.0", {"s": "yes"}),
        Payload(Subject.TOOL, ["t0", "t1"]))


def test_a_record_crosses_the_wire_equal_field_by_field():
    record = _full_record()
    assert all(getattr(record, field) not in (None, 0, (), {}) for field in FIELDS)  # every field exercised
    rebuilt = wire.Rebuilder(CONFIG).record(_crossed(wire.pack(record, record.payload, None)))
    assert type(rebuilt) is SpanRecord
    for field in FIELDS:
        assert getattr(rebuilt, field) == getattr(record, field), field
    assert type(rebuilt.payload) is Payload and type(rebuilt.events[0]) is EventRecord
    assert type(rebuilt.links[0]) is LinkRecord and rebuilt.links[0].context == record.links[0].context


def test_the_record_has_one_field_list():
    """Its slots, its constructor and its tuple form follow FIELDS; pickle takes that form."""
    assert SpanRecord.__slots__ == FIELDS + ("_context",)
    init = SpanRecord.__init__.__code__
    assert init.co_varnames[1:init.co_argcount] == FIELDS
    record = _full_record()
    assert to_tuple(record) == tuple(getattr(record, field) for field in TUPLE_FIELDS)
    again = from_tuple(to_tuple(record), record.resource, record.scope, record.payload)
    assert all(getattr(again, field) == getattr(record, field) for field in FIELDS)
    changed = record.replace(name="other", resource=None, scope=None)  # (the SDK's hold a lock: no pickle)
    assert (changed.name, changed.resource, changed.events) == ("other", None, record.events)
    pickled = pickle.loads(pickle.dumps(changed))
    assert all(getattr(pickled, field) == getattr(changed, field) for field in FIELDS)


def _trajectory() -> TrajectoryData:
    """A finished 3-turn trajectory whose turns hold their ids as the events API keeps them."""
    data = TrajectoryData(uid="u", traj_uid="0", global_step=1, n_samples=4, agent_name="tool_agent", created_at=1.0,
                          completed_at=9.0, agent_metrics={"num_turns": 3}, reward_score=0.5,
                          agent_loop_class="ToolAgentLoop", run_completed_ns=8, reward_scored=(9, 0.5),
                          codec=TextCodec(lambda ids, **kw: ",".join(map(str, ids)), lambda text, **kw: [1]))
    prompt = list(range(100, 120))
    for i in range(3):
        turn = TurnData(prompt_ids=kept_prompt(prompt, data.turns[-1] if data.turns else None), start_ts=2.0 + i,
                        prompt_token_count=len(prompt))
        data.turns.append(turn)
        turn.end_ts, turn.completion_ids, turn.finish_reason = 2.5 + i, kept_ids([200 + i] * 3), "stop"
        turn.server_meta = {"queue_time": 0.1}
        turn.observation_text, turn.observation_start_ts, turn.observation_end_ts = f"tool {i}", 2.6 + i, 2.7 + i
        prompt += [200 + i] * 3 + [300 + i, 301 + i]  # completion, then observation and template tokens
    return data


def test_the_rollout_data_keeps_the_payload_data_protocol():
    """The wire sends a trajectory and its turns as they say (PayloadData); a turn crosses
    with its trajectory's end only."""
    data = _trajectory()
    assert isinstance(data, payload.PayloadData) and isinstance(data.turns[0], payload.PayloadData)
    assert data.turns[0].sent(True) == (None, None)


def _fields(data: TrajectoryData) -> dict:
    out = dict(vars(data))
    out["turns"] = [dict(vars(turn), prompt_ids=(len(turn.prompt_ids), list(turn.prompt_ids[_first(turn):])),
                         completion_ids=list(turn.completion_ids)) for turn in data.turns]
    return out


def _first(turn: TurnData) -> int:
    return turn.prompt_ids.start if type(turn.prompt_ids) is PromptTail else 0


def test_a_trajectory_crosses_whole_at_its_end_with_its_tokenizer_by_id():
    capture, shared = Capture(), []
    tracer = _tracer(capture)
    data = _trajectory()
    span = payload.start_span(tracer, "invoke_agent tool_agent", Payload(Subject.TRAJECTORY, data))
    turn = payload.start_span(tracer, "chat m", Payload(Subject.LLM_CALL, data.turns[0]))
    payload.end_span(turn)
    payload.end_span(span)
    shared_id = lambda codec: shared.append(codec) or 7  # noqa: E731

    [(started, started_payload, attributes), (turn_started, turn_payload, _)] = capture.starts
    at_start = _crossed(wire.pack(started, started_payload, shared_id, attributes))
    subject, sent = _payload(at_start)
    assert at_start[-1] is None and subject is Subject.TRAJECTORY  # no shared id
    assert sent.turns == [] and sent.agent_metrics == {}
    assert (sent.uid, sent.traj_uid, sent.agent_name) == ("u", "0", "tool_agent")
    # a turn's data goes with its trajectory only
    assert _payload(_crossed(wire.pack(turn_started, turn_payload, shared_id, {}))) == Payload(Subject.LLM_CALL)
    assert _payload(_crossed(wire.pack(*capture.ends[0], shared_id))) == Payload(Subject.LLM_CALL)
    assert shared == []

    at_end = _crossed(wire.pack(*capture.ends[1], shared_id))
    assert shared == [data.codec] and at_end[-1] == 7
    assert _payload(at_end).data.codec is None  # the export process has no shared object 7
    sent = _payload(at_end, {7: data.codec}).data  # it hands the one it has to the data
    assert sent.codec is data.codec
    assert _fields(sent) == _fields(data)
    assert all(type(turn.completion_ids) is array for turn in sent.turns)
    later = sent.turns[1].prompt_ids  # a later turn's prompt: the ids after the previous completion
    assert type(later) is PromptTail and later.start == 23 and len(later) == 25
    with pytest.raises(UnsentTokens):
        later[0]


def test_token_ids_cross_as_one_copy():
    ids = kept_ids(range(100_000))
    assert len(wire.frame(Payload(Subject.LLM_CALL, ids))) < 4 * len(ids) + 200


def test_the_export_process_reads_a_payload_from_a_span_start_to_its_end():
    from otel_verl.offload.host import Host

    seen = []

    class Reader(SpanProcessor):
        def on_start(self, span, parent_context=None):
            seen.append(("start", span.name, payload.payload_of(span)))

        def on_end(self, span):
            seen.append(("end", span.name, payload.payload_of(span)))

    capture = Capture()
    tracer = _tracer(capture)
    open_before = payload.open_count()
    rollout = payload.start_span(tracer, "rollout", Payload(Subject.ROLLOUT, ["t0"]))
    with tracer.start_as_current_span("plain"):  # another tracer's span: no payload
        pass
    payload.end_span(rollout)
    host = Host(CONFIG, processors=[Reader()])
    rollout_start, rollout_payload, start_attributes = capture.starts[0]
    host.export(wire.pack(rollout_start, rollout_payload, None, start_attributes))
    assert payload.open_count() == open_before  # each record carries its payload: nothing kept by id
    for ended, ended_payload in capture.ends:
        host.export(wire.pack(ended, ended_payload, None))
    assert seen == [("start", "rollout", Payload(Subject.ROLLOUT, ["t0"])), ("end", "plain", None),
                    ("end", "rollout", Payload(Subject.ROLLOUT, ["t0"]))]
    assert payload.open_count() == open_before
    host.processor.shutdown()


def test_a_torn_stream_ends_without_a_message():
    data = wire.frame(wire.Flush(1, {"failures": {"x": 1}, "dropped": {}}))
    assert wire.read_frame(io.BytesIO(data)) == wire.Flush(1, {"failures": {"x": 1}, "dropped": {}})
    assert wire.read_frame(io.BytesIO(data[:-1])) is None
    assert wire.read_frame(io.BytesIO(b"")) is None


def _run_host(frames: bytes) -> "tuple[subprocess.CompletedProcess, list]":
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.run([sys.executable, "-m", "otel_verl.offload.host", str(write_end)], input=frames,
                              pass_fds=(write_end,), capture_output=True, timeout=120)
    finally:
        os.close(write_end)
    with os.fdopen(read_end, "rb") as replies:
        answers = []
        while True:
            answer = wire.read_frame(replies)
            if answer is None:
                return proc, answers
            answers.append(answer)


def test_the_export_process_refuses_another_wire_version():
    proc, answers = _run_host(wire.frame(wire.Hello(wire.VERSION + 1)) + wire.frame(wire.Config(CONFIG)))
    assert answers == [wire.Hello(wire.VERSION)]  # its own version, for the traced process to report
    assert proc.returncode != 0
    message = proc.stderr.decode()
    assert f"wire version {wire.VERSION + 1}" in message and f"wire version {wire.VERSION}" in message


def test_the_export_process_refuses_a_stream_that_does_not_start_with_hello():
    proc, answers = _run_host(wire.frame(("config", CONFIG)))
    assert answers == [wire.Hello(wire.VERSION)] and proc.returncode != 0 and b"refused" in proc.stderr


def _five_spans_offloaded(trace_dir):
    """(processor, provider, tracer) of an export process writing to ``trace_dir``, after
    five spans ended."""
    from otel_verl.offload.forwarder import OffloadSpanProcessor

    config = wire.HostConfig(settings.load({settings.TRACE_DIR: str(trace_dir)}), dict(RESOURCE.attributes),
                             RESOURCE.schema_url, os.getpid())
    offload = OffloadSpanProcessor(config)
    provider = TracerProvider(resource=RESOURCE)
    provider.add_span_processor(offload)
    tracer = provider.get_tracer("t")
    for i in range(5):
        with tracer.start_as_current_span(f"s{i}"):
            pass
    return offload, provider, tracer


def test_a_traced_process_counts_the_spans_an_export_process_of_another_version_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(wire, "VERSION", wire.VERSION + 1)  # this process only: the export process has its own
    offload, provider, tracer = _five_spans_offloaded(tmp_path)
    assert not offload.force_flush(30_000)
    with tracer.start_as_current_span("after"):
        pass
    provider.shutdown()
    counts = health.snapshot()
    assert counts["failures"] == {"offload.version": 1}
    assert counts["dropped"] == {"offload": 6}
    assert not (tmp_path / "otlp").exists() or not any((tmp_path / "otlp").iterdir())


def test_an_export_process_whose_descriptor_is_past_1024_is_waited_for(tmp_path):
    """A process with many descriptors (a Ray worker's sockets) gets its export process's
    pidfd past 1024, where select() refuses it: the shutdown still waits for the export
    process, which writes every span."""
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        offload, provider, _ = _five_spans_offloaded(tmp_path)
        assert offload.force_flush(30_000)
        pidfds = [int(fd) for fd in os.listdir("/proc/self/fd")
                  if "pidfd" in _link(f"/proc/self/fd/{fd}") and int(fd) >= 1024]
        assert pidfds, "no pidfd past 1024: the export process was not started as this test means"
        provider.shutdown()
    finally:
        for fd in held:
            os.close(fd)
    assert health.snapshot()["failures"] == {}
    written = "".join(path.read_text() for path in (tmp_path / "otlp").rglob("*.json*") if path.is_file())
    assert all(f'"s{i}"' in written for i in range(5))


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def test_every_message_crosses_a_frame_as_itself():
    messages = [wire.Hello(wire.VERSION), wire.Config(CONFIG), wire.Shared(1, pickle.dumps((len, len))),
                wire.ForgetShared(1), wire.Flush(2, {"failures": {"x": 1}, "dropped": {}}), wire.Flushed(2, True, False, {"failures": {}, "dropped": {}}),
                wire.Spans([], 3), wire.Close(3, {"failures": {}, "dropped": {"x": 1}}),
                wire.Flush(4, {"failures": {}, "dropped": {}}, 1500)]
    assert [wire.read_frame(io.BytesIO(wire.frame(m))) for m in messages] == messages


def test_an_export_process_whose_traced_process_is_gone_still_writes_what_it_was_sent(tmp_path):
    """Its reply pipe has no reader (the traced process went before the export process
    answered): writing to it costs the export process nothing, neither SIGPIPE nor an
    exception; it writes the spans it was sent, its final loss file, and exits."""
    capture = Capture()
    with _tracer(capture).start_as_current_span("last"):
        pass
    [(span, span_payload)] = capture.ends
    config = dataclasses.replace(CONFIG, settings=settings.load({settings.TRACE_DIR: str(tmp_path),
                                                                 settings.OTLP_FILE: "1"}))
    frames = b"".join(wire.frame(m) for m in (
        wire.Hello(wire.VERSION), wire.Config(config), wire.Spans([wire.pack(span, span_payload, None)], 1),
        wire.Close(1, {"failures": {}, "dropped": {}})))
    read_end, write_end = os.pipe()
    os.close(read_end)  # the traced process is gone
    try:
        proc = subprocess.run([sys.executable, "-m", "otel_verl.offload.host", str(write_end)], input=frames,
                              pass_fds=(write_end,), capture_output=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert b"Traceback" not in proc.stderr, proc.stderr.decode()[-3000:]
    [otlp] = list((tmp_path / "otlp").iterdir())
    assert b'"name":"last"' in otlp.read_bytes().replace(b" ", b"")
    [losses] = list((tmp_path / "losses").iterdir())
    assert json.loads(losses.read_text())["final"]
