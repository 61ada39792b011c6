"""The export process (otel_verl.offload): the outputs it writes for a traced process are
the ones that process would have written itself; losses and failures on either side are
counted in the traced process."""

from __future__ import annotations

import glob
import json
import os

import pytest

import fault_workload
from otel_verl import bootstrap, events, health, settings
from otel_verl.offload.forwarder import OffloadSpanProcessor
from otel_verl.record import TrajectoryData, TurnData

UIDS = [f"u{i}" for i in range(6)]


class Pipelines:
    """One provider feeding the in-process outputs (``here``) and an export process
    (``there``) with the same spans."""

    def __init__(self, here: str, there: str, offload_there: bool = True) -> None:
        from opentelemetry.sdk.trace import TracerProvider

        from otel_verl.sampling import IsolatingSpanProcessor, UidIdGenerator, record_dropped_samples

        cfg_here = settings.load({settings.TRACE_DIR: here})
        cfg_there = settings.load({settings.TRACE_DIR: there, settings.OFFLOAD: "1"})
        ids, sampler = UidIdGenerator(), record_dropped_samples()
        self.provider = TracerProvider(resource=bootstrap._resource("agent_loop_worker"), sampler=sampler,
                                       id_generator=ids, active_span_processor=IsolatingSpanProcessor())
        for processor in bootstrap.output_processors(cfg_here):
            self.provider.add_span_processor(processor)
        self.offload = bootstrap._offload(cfg_there, self.provider.resource)
        assert isinstance(self.offload, OffloadSpanProcessor)
        self.provider.add_span_processor(self.offload)
        events._install(events._Runtime(self.provider.get_tracer("otel_verl"), ids, cfg_here, sampler))

    def close(self) -> None:
        self.provider.shutdown()
        events._install(None)
        bootstrap._legacy.clear()


@pytest.fixture
def pipelines(tmp_path, monkeypatch):
    monkeypatch.setattr(health, "_failures", health.Counter())
    monkeypatch.setattr(health, "_dropped", health.Counter())
    made = []

    def make(**kwargs):
        made.append(Pipelines(str(tmp_path / "here"), str(tmp_path / "there"), **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _files(root: str) -> dict:
    """Relative path -> bytes; a trajectory file's name without the time it was started."""
    out = {}
    for path in glob.glob(os.path.join(root, "**", "*"), recursive=True):
        if os.path.isfile(path):
            name = os.path.relpath(path, root)
            if name.startswith("trajectory/"):
                name = "_".join(name.split("_")[:2])
            with open(path, "rb") as f:
                out[name] = f.read()
    return out


def _otlp_spans(blob: bytes) -> list:
    spans = []
    for line in blob.splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                spans += [(json.dumps(rs["resource"], sort_keys=True), json.dumps(s, sort_keys=True)) for s in ss["spans"]]
    return sorted(spans)


@pytest.mark.verl
def test_the_export_process_writes_what_the_process_would_have(pipelines, tmp_path):
    from transformers import AutoTokenizer

    from otel_verl.demo.tiny_model import ensure_tiny_model
    from otel_verl.instrumentation._tokenizer import text_decoder, text_encoder

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    p = pipelines()
    for step in (1, 2):
        fault_workload.emit(step, UIDS, 4, fit=step == 1, decode=text_decoder(tokenizer), encode=text_encoder(tokenizer),
                            observation="tool says 42", prompt_ids=list(range(30, 60)), completion_ids=[70, 71, 72])
    p.provider.force_flush()
    here, there = _files(str(tmp_path / "here")), _files(str(tmp_path / "there"))
    assert sorted(here) == sorted(there)
    assert any(name.startswith("trajectory/") for name in here) and any(name.startswith("sample/") for name in here)
    for name, blob in here.items():
        if name.startswith("otlp/"):
            assert _otlp_spans(blob) == _otlp_spans(there[name]), name
        else:
            assert blob == there[name], name
    jsonl = [json.loads(line) for name, blob in there.items() if name.startswith("trajectory/") for line in blob.splitlines()]
    assert len(jsonl) == 2 * len(UIDS) * 4
    assert json.loads(jsonl[0]["raw_message"])["turns"][0]["completion_text"]  # decoded in the export process
    assert health.snapshot() == {"failures": {}, "dropped": {}}


def test_decode_functions_made_per_trajectory_reach_the_export_process(pipelines, tmp_path):
    """An agent loop may hand over a closure rather than a tokenizer's method, a new one
    per trajectory: each goes over by value (its texts are in the JSONL), and neither side
    keeps more than a few of them."""
    from otel_verl.offload import forwarder

    p = pipelines()
    count = 3 * forwarder._MAX_CODECS
    for i in range(count):
        with events.trajectory(f"u{i}", "0", step=1, agent_name="a", decode=lambda ids, i=i, **kw: f"text of {i}"):
            with events.llm_call([1, 2, 3], model="m") as turn:
                turn.finish([4, 5], stop_reason="stop")
    assert p.provider.force_flush()
    texts = {}
    for name, blob in _files(str(tmp_path / "there")).items():
        if name.startswith("trajectory/"):
            for line in blob.splitlines():
                row = json.loads(line)
                texts[row["prompt_uid"]] = json.loads(row["raw_message"])["turns"][0]["completion_text"]
    assert texts == {f"u{i}": f"text of {i}" for i in range(count)}
    assert len(p.offload._codecs) <= forwarder._MAX_CODECS
    assert health.snapshot() == {"failures": {}, "dropped": {}}


def test_spans_after_the_export_process_died_are_counted_not_raised(pipelines):
    p = pipelines()
    fault_workload.emit(1, UIDS[:2], 2)
    assert p.provider.force_flush()
    p.offload._process.kill()
    p.offload._process.wait()
    fault_workload.emit(2, UIDS[:2], 2, fit=False)  # must not raise
    assert not p.offload.force_flush(5000)
    dropped = health.snapshot()["dropped"]
    assert dropped.get("offload", 0) > 0, dropped


def test_spans_beyond_max_pending_are_counted(pipelines):
    p = pipelines()
    assert p.provider.force_flush()
    p.offload._max_entries = 0  # the export process never keeps up
    fault_workload.emit(1, UIDS[:1], 2)
    p.offload._max_entries = 2 << 16
    dropped = health.snapshot()["dropped"]
    # every span of the step: the sample roots, its stages, each trajectory's spans
    assert dropped.get("offload", 0) >= 2 * 4, dropped


def test_the_sender_sends_what_was_pending_when_it_woke():
    """Spans the agent loop ends while a batch is taken wait for the next full batch or
    wake-up: drained until empty, the sender wrote a frame every few spans."""
    from collections import deque

    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext

    from otel_verl.offload import forwarder, wire

    def ended(i: int) -> ReadableSpan:
        return ReadableSpan(f"s{i}", context=SpanContext(1, i + 1, False), attributes={}, start_time=i, end_time=i + 1)

    sender = object.__new__(OffloadSpanProcessor)  # no export process: only its sending rule
    sender._pending, sender._alive, sender._max_batch = deque(), True, 2
    sender._snapshots = wire.Snapshotter(lambda decode, encode: 0)
    frames = []

    def encode(batch, flushes):
        frames.append([snapshot[1] for snapshot in batch])
        sender._pending.extend((forwarder._ENDED, ended(100 + len(frames))))  # meanwhile, on the event loop

    sender._encode = encode
    for i in range(5):
        sender._pending.extend((forwarder._ENDED, ended(i)))
    sender._take_pending()
    assert frames == [["s0", "s1"], ["s2", "s3"], ["s4"]]
    assert [sender._pending[i]._name for i in range(1, len(sender._pending), 2)] == ["s101", "s102", "s103"]


def test_the_span_that_fills_a_batch_has_it_pickled_on_its_thread_without_waiting():
    """The event loop's span that fills a batch has it made into frames there (the
    sender thread only writes them); it never waits: with the sender taking a batch, or
    frames left unwritten by a slow export process, the spans stay pending for the sender."""
    import io
    import threading
    from collections import deque

    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext

    from otel_verl.offload import forwarder, wire

    def ended(i: int) -> ReadableSpan:
        return ReadableSpan(f"s{i}", context=SpanContext(1, i + 1, False), attributes={}, start_time=i, end_time=i + 1)

    sender = object.__new__(OffloadSpanProcessor)  # no export process, no sender thread
    sender._pending, sender._outbox, sender._alive = deque(), deque(), True
    sender._batch_lock, sender._wake = threading.Lock(), threading.Event()
    sender._max_batch, sender._batch_entries, sender._max_entries = 2, 4, 1000
    sender._snapshots, sender._unsent_codecs, sender._forgotten_codecs = wire.Snapshotter(lambda d, e: 0), [], []

    sender.on_end(ended(0))
    assert not sender._outbox and not sender._wake.is_set()
    sender.on_end(ended(1))  # fills the batch
    assert not sender._pending and sender._wake.is_set()
    [(data, spans)] = sender._outbox
    kind, batch = wire.read_frame(io.BytesIO(data))
    assert (kind, [snapshot[1] for snapshot in batch], spans) == ("spans", ["s0", "s1"], 2)

    sender._wake.clear()
    with sender._batch_lock:  # the sender thread is taking a batch
        sender.on_end(ended(2))
        sender.on_end(ended(3))
    assert len(sender._pending) == 4 and len(sender._outbox) == 1 and sender._wake.is_set()
    sender._outbox.extend([(b"", 0)] * forwarder._MAX_UNWRITTEN_FRAMES)  # the export process is slow
    sender.on_end(ended(4))
    assert len(sender._pending) == 6


def _multi_turn(prompt_shapes: str) -> "tuple[TrajectoryData, list]":
    """A finished 4-turn trajectory whose prompts are built the ways agent loops build
    them, and each turn's whole prompt at the call."""
    from otel_verl.record import kept_ids, kept_prompt

    data = TrajectoryData(uid="u", traj_uid="0", global_step=1, n_samples=4, agent_name="tool_agent", created_at=1.0,
                          completed_at=9.0, decode=lambda ids, **kw: ",".join(map(str, ids)),
                          encode=lambda text, **kw: list(range(len(text.split()))))
    shared = list(range(100, 120))  # ToolAgentLoop: one list, extended in place after each turn
    prompt = list(range(100, 120))
    wholes = []
    for i in range(4):
        completion, observation = [200 + i] * 3, f"tool output {i}"
        if prompt_shapes == "extended in place":
            ids, count = shared, len(shared)
        elif prompt_shapes == "new list each turn":
            ids, count = list(prompt), len(prompt)
        elif prompt_shapes == "history rewritten":  # a custom loop that drops its oldest turn
            ids = list(prompt[3 * i:]) + [7] * i
            count = len(ids)
        elif prompt_shapes == "kept at the call":  # as the events API records them
            ids, count = kept_prompt(prompt, data.turns[-1] if data.turns else None), len(prompt)
            completion = kept_ids(completion)
        else:  # tuples: no prefix check, sent whole
            ids, count = tuple(prompt), None
        wholes.append(list(ids[:count] if count is not None else ids) if prompt_shapes != "kept at the call" else list(prompt))
        data.turns.append(TurnData(prompt_ids=ids, start_ts=2.0 + i, prompt_token_count=count, end_ts=2.5 + i,
                                   completion_ids=completion, finish_reason="stop", observation_text=observation,
                                   observation_start_ts=2.5 + i, observation_end_ts=2.6 + i))
        for extended in (shared, prompt):
            extended += list(completion) + [300 + i, 301 + i]  # completion, then observation and template tokens
    return data, wholes


@pytest.mark.parametrize("prompt_shapes",
                         ["extended in place", "new list each turn", "history rewritten", "tuples", "kept at the call"])
def test_multi_turn_prompts_cross_to_the_export_process_as_the_jsonl_reads_them(prompt_shapes):
    """Turn 0's prompt goes whole, a later turn's from the end of the previous completion
    on (what the JSONL reads of it): the export process's JSONL line is the line the
    process would have written, and a read of an unsent id raises instead of inventing one."""
    import pickle

    from otel_verl.exporters.trajectory_jsonl import trajectory_line
    from otel_verl.offload import wire
    from otel_verl.record import UnsentTokens

    data, wholes = _multi_turn(prompt_shapes)
    codecs = {}

    def codec_id(decode, encode):
        codecs[0] = (decode, encode)
        return 0

    snapshot = wire.Snapshotter(codec_id)._trajectory(data)
    rebuilder = wire.Rebuilder(wire.HostConfig(settings=None, resource_attributes={}, resource_schema_url="", pid=1))
    rebuilder.codecs = codecs
    rebuilt = rebuilder._data(wire._TRAJECTORY, pickle.loads(pickle.dumps(snapshot)))
    assert trajectory_line(rebuilt) == trajectory_line(data)
    sent = sum(len(wire._unpacked_ids(turn[0][1])) for turn in snapshot[2])
    if prompt_shapes != "history rewritten":
        assert sent == 20 + 3 * 2  # the first prompt, then each turn's observation and template tokens
    else:
        assert sent == 20  # each later prompt ends where the previous completion would: nothing read
    previous_end = 0  # where the previous turn's completion ended: prompt count + 3 completion ids
    for turn, whole in zip(rebuilt.turns, wholes):
        start = min(previous_end, len(whole))
        assert len(turn.prompt_ids) == len(whole)
        assert list(turn.prompt_ids[start:]) == whole[start:]
        if start:
            with pytest.raises(UnsentTokens):
                turn.prompt_ids[start - 1]
            with pytest.raises(IndexError):
                turn.prompt_ids[-len(whole) - 1]
            with pytest.raises(UnsentTokens):
                list(turn.prompt_ids)
        previous_end = len(whole) + 3


def _sdk_spans(processor):
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider()
    provider.add_span_processor(processor)
    return provider.get_tracer("test", "1.0")


@pytest.mark.parametrize("max_open", [16, 0])
def test_an_end_after_its_start_goes_as_what_changed_and_rebuilds_whole(max_open):
    """A span whose start went over ends as ``END_OF`` its serial (no name, ids, parent,
    kind, start or scope again), and a child's start names that parent by its serial;
    the export process rebuilds the same spans. Beyond ``max_open`` started spans the end
    goes whole and a parent as its ids."""
    import pickle

    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.trace import SpanKind, StatusCode

    from otel_verl.offload import wire

    snapshots = wire.Snapshotter(lambda decode, encode: 0, max_open=max_open)
    sent, ended = [], []

    class Capture(SpanProcessor):
        def on_start(self, span, parent_context=None):
            sent.append(snapshots.start(span))

        def on_end(self, span):
            sent.append(snapshots.end(span))
            ended.append(span)

    tracer = _sdk_spans(Capture())
    with tracer.start_as_current_span("parent"):
        with tracer.start_as_current_span("child", kind=SpanKind.CLIENT, attributes={"a": 1}) as child:
            child.set_attribute("b", "two")
            child.set_status(StatusCode.ERROR, "boom")
    assert [s[0] for s in sent] == ([wire.START] * 2 + [wire.END_OF] * 2 if max_open else
                                    [wire.START] * 2 + [wire.END] * 2)
    assert sent[1][3] == (sent[0][9] if max_open else wire._context(ended[1].context))  # the child's parent
    # the child's own context: its span id where its parent is named by serial
    assert sent[1][2] == (ended[0].context.span_id if max_open else wire._context(ended[0].context))
    rebuild = wire.Rebuilder(wire.HostConfig(settings=None, resource_attributes={}, resource_schema_url="", pid=1))
    rebuilt = [rebuild.span(s) for s in pickle.loads(pickle.dumps(sent))]
    assert [what for what, _ in rebuilt] == [wire.START, wire.START, wire.END, wire.END]
    assert rebuilt[1][1].parent == ended[1].context  # the child's start, rebuilt
    for (_, got), want in zip(rebuilt[2:], ended):
        assert (got.name, got.context, got.parent, got.kind, got.start_time, got.end_time) == (
            want.name, want.context, want.parent, want.kind, want.start_time, want.end_time)
        assert dict(got.attributes) == dict(want.attributes)
        assert got.status.status_code == want.status.status_code
        assert got.instrumentation_scope == want.instrumentation_scope
    assert rebuilt[2][1].attributes == {"a": 1, "b": "two"}
    assert rebuild._open == {} and snapshots._open == {}  # nothing held once every span ended


def test_token_ids_cross_as_packed_bytes_or_as_they_are():
    import numpy as np

    from otel_verl.offload import wire

    for ids in ([1, 2, 151_000], np.array([3, 4], dtype=np.int64), []):
        packed = wire._packed_ids(ids)
        assert type(packed) is bytes and wire._unpacked_ids(packed) == [int(i) for i in ids]
    for odd in ([-1, 2], [1 << 40], [1.5]):  # no unsigned 32-bit ints: sent as a list
        assert wire._unpacked_ids(wire._packed_ids(odd)) == odd


def test_the_export_process_gets_only_the_starts_its_outputs_read(pipelines, tmp_path):
    """Starts go to the export process for the kinds an output writes rows for at a start
    (bootstrap.output_start_kinds); a tool or reward span goes once, whole, at its end,
    and the outputs are still the ones the process writes itself."""
    from otel_verl.exporters.progress_log import ProgressLogProcessor
    from otel_verl.exporters.sample_csv import SampleCsvProcessor
    from otel_verl.semconv import Kind

    kinds = bootstrap.output_start_kinds()
    assert kinds == ProgressLogProcessor.on_start_kinds | SampleCsvProcessor.on_start_kinds
    assert Kind.TRAJECTORY in kinds and Kind.LLM_CALL in kinds
    assert Kind.TOOL not in kinds and Kind.REWARD not in kinds
    p = pipelines()
    assert p.offload.on_start_kinds == kinds
    sent = []
    snapshots = p.offload._snapshots
    start, end = snapshots.start, snapshots.end
    snapshots.start = lambda span: sent.append(("start", span.name)) or start(span)
    snapshots.end = lambda span: sent.append(("end", span.name)) or end(span)
    with events.trajectory("u1", "0", step=1, agent_name="tool_agent"):
        with events.tool_call("calculator"):
            pass
        with events.reward() as reward:
            reward.score(1.0)
    assert p.provider.force_flush()
    assert ("end", "execute_tool calculator") in sent and ("start", "execute_tool calculator") not in sent
    assert ("end", "verl.reward") in sent and ("start", "verl.reward") not in sent
    assert ("start", "invoke_agent tool_agent") in sent
    here, there = _files(str(tmp_path / "here")), _files(str(tmp_path / "there"))
    assert {k: v for k, v in there.items() if k.startswith("sample/")} == {
        k: v for k, v in here.items() if k.startswith("sample/")}


def test_a_turn_and_a_trajectory_started_fast_equal_their_dataclass_made_twins():
    """TurnData.started / TrajectoryData.started skip the generated __init__: every field
    the constructor would set is there (a new field with a default factory would not be)."""
    from otel_verl.record import NO_SERVER_META

    turn = TurnData.started([1, 2], 5.0, 2)
    assert turn == TurnData(prompt_ids=[1, 2], start_ts=5.0, prompt_token_count=2, server_meta=NO_SERVER_META)
    traj = TrajectoryData.started("u", "0", 3, 8, "agent", 7.0, "v0", None, None)
    assert traj == TrajectoryData(uid="u", traj_uid="0", global_step=3, n_samples=8, agent_name="agent", created_at=7.0)
    assert traj.turns == [] and traj.turns is not TrajectoryData.started("u", "1", 3, 8, "a", 7.0, "v0", None, None).turns
