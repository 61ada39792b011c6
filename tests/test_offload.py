"""The export process (otel_verl.offload): the outputs it writes for a traced process are
the ones that process would have written itself; losses and failures on either side are
counted in the traced process."""

from __future__ import annotations

import glob
import io
import json
import logging
import operator
import os
import signal
import threading
import time
from collections import Counter

import pytest

import fault_workload
from otel_verl import bootstrap, events, health, outputs, settings
from otel_verl.instrumentation import tracing
from otel_verl.offload.forwarder import OffloadSpanProcessor
from otel_verl.rollout_data import TrajectoryData, TurnData

UIDS = [f"u{i}" for i in range(6)]


class Pipelines:
    """One provider feeding the in-process outputs (``here``) and an export process
    (``there``) with the same spans."""

    def __init__(self, here: str, there: str, offload_there: bool = True) -> None:
        from opentelemetry.sdk.trace import TracerProvider

        from otel_verl.sampling import IsolatingSpanProcessor, UidIdGenerator, record_dropped_samples

        cfg_here = settings.load({settings.TRACE_DIR: here})
        cfg_there = self.cfg_there = settings.load({settings.TRACE_DIR: there, settings.OFFLOAD: "1"})
        ids, sampler = UidIdGenerator(), record_dropped_samples()
        self.provider = TracerProvider(resource=bootstrap._resource("agent_loop_worker"), sampler=sampler,
                                       id_generator=ids, active_span_processor=IsolatingSpanProcessor())
        for processor in outputs.build(cfg_here):
            self.provider.add_span_processor(processor)
        self.offload = bootstrap._offload(cfg_there, self.provider.resource)
        assert isinstance(self.offload, OffloadSpanProcessor)
        self.provider.add_span_processor(self.offload)
        assert tracing.use_provider(self.provider, cfg_here)
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.provider.shutdown()
        tracing.stop()


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


def _counters(blob: bytes) -> dict:
    return {key: value for key, value in json.loads(blob).items() if key in ("dropped", "failures", "notes")}


def _metric_names(blob: bytes) -> set:
    return {metric["name"] for line in blob.splitlines() for rm in json.loads(line)["resourceMetrics"]
            for sm in rm["scopeMetrics"] for metric in sm["metrics"]}


@pytest.mark.verl
def test_the_export_process_writes_what_the_process_would_have(pipelines, tmp_path):
    from transformers import AutoTokenizer

    from otel_verl.demo.tiny_model import ensure_tiny_model
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    p = pipelines()
    for step in (1, 2):
        fault_workload.emit(step, UIDS, 4, fit=step == 1, tokenizer=tokenizer,
                            observation="tool says 42", prompt_ids=list(range(30, 60)), completion_ids=[70, 71, 72])
    p.provider.force_flush()
    here, there = _files(str(tmp_path / "here")), _files(str(tmp_path / "there"))
    assert sorted(here) == sorted(there), (set(here) ^ set(there))
    assert any(name.startswith("trajectory/") for name in here) and any(name.startswith("sample/") for name in here)
    assert any(name.startswith("otlp-metrics/") for name in here)
    for name, blob in here.items():
        if name.startswith("otlp-metrics/"):  # the span durations differ: their names do not
            assert _metric_names(blob) == _metric_names(there[name]), name
        elif name.startswith("otlp/"):
            assert _otlp_spans(blob) == _otlp_spans(there[name]), name
        elif name.startswith("losses/"):  # written at other moments: the same counters
            assert _counters(blob) == _counters(there[name]) == {"dropped": {}, "failures": {}, "notes": {}}, name
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
    count = 3 * forwarder.MAX_SHARED
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
    assert len(p.offload._shared) <= forwarder.MAX_SHARED
    assert health.snapshot() == {"failures": {}, "dropped": {}}


class _DecodeThatDoesNotUnpickle:
    """A tokenizer's decode that pickles but fails to unpickle: the export process counts
    an ``offload.shared`` failure of its own."""

    def __call__(self, ids, **kwargs):
        return "text"

    def __reduce__(self):
        return operator.truediv, (1, 0)


def test_the_export_process_metrics_report_this_process_losses_once(pipelines, tmp_path):
    """A rollout worker's own losses (a wrapper's failure, spans it could not hand over)
    reach the backend through its export process's metrics; a failure of the export
    process, which this process counts too, is reported once."""
    from otel_verl.exporters import metrics as m

    p = pipelines()
    health.record_failure("events.test", RuntimeError("a wrapper failed"))
    health.record_dropped("offload", 2, "test")
    with events.trajectory("u0", "0", step=1, agent_name="a", decode=_DecodeThatDoesNotUnpickle()):
        with events.llm_call([1, 2, 3], model="m") as turn:
            turn.finish([4, 5], stop_reason="stop")
    assert p.provider.force_flush()
    _wait_until(lambda: health.snapshot()["failures"].get("offload.shared"))  # relayed here
    assert p.provider.force_flush()  # a Flush after the relay: sent without it
    p.close()  # the export process collects its metrics a last time and exits

    points = {}
    for path in glob.glob(str(tmp_path / "there" / "otlp-metrics" / "*.jsonl")):
        with open(path) as f:
            for line in f:
                for rm in json.loads(line)["resourceMetrics"]:
                    for sm in rm["scopeMetrics"]:
                        for metric in sm["metrics"]:
                            for point in metric.get("sum", {}).get("dataPoints", []):
                                label = {a["key"]: a["value"]["stringValue"] for a in point["attributes"]}
                                points[(metric["name"], *label.values())] = int(point["asInt"])  # the latest
    assert points[(m.FAILURES, "events.test")] == 1
    assert points[(m.FAILURES, "offload.shared")] == 1
    assert points[(m.DROPPED, "offload")] == 2


def _outputs(root) -> dict:
    """Output -> what it holds, in any order: OTLP spans, JSONL, CSV or progress lines (an
    export process started in another's place, or this process, may start files of its own);
    the metric and loss files left out."""
    out: dict = {}
    for path in glob.glob(os.path.join(str(root), "**", "*"), recursive=True):
        if os.path.isfile(path):
            kind = os.path.relpath(path, str(root)).split(os.sep)[0]
            if kind in ("otlp-metrics", "losses"):  # aggregates, not one line per span
                continue
            with open(path, "rb") as f:
                blob = f.read()
            out.setdefault(kind, Counter()).update(_otlp_spans(blob) if kind == "otlp" else blob.splitlines())
    return out


def _wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _shrink_pipe(stdin) -> None:
    """A pipe of one page: a batch written to an export process that stopped reading is left
    half written."""
    import fcntl

    if hasattr(fcntl, "F_SETPIPE_SZ"):  # Linux
        fcntl.fcntl(stdin.fileno(), fcntl.F_SETPIPE_SZ, 4096)


def _serving(offload) -> bool:
    """A new export process has answered."""
    return offload._child.hello.is_set() and offload._child.speaks_our_version


def test_a_killed_export_process_is_replaced_and_every_span_is_accounted_for(pipelines, tmp_path):
    """SIGKILL with spans in the export process's pipe and a batch half written: its death
    is noticed at once, the spans it had not acknowledged are counted (ends only), the
    queued ones go to the export process started in its place, which writes every later span."""
    p = pipelines()
    fault_workload.emit(1, UIDS, 4)
    assert p.provider.force_flush()  # written and acknowledged
    killed = p.offload._child
    os.kill(killed.process.pid, signal.SIGSTOP)  # it reads nothing more, writes nothing more
    _shrink_pipe(killed.process.stdin)
    try:
        for step in (2, 3):
            fault_workload.emit(step, UIDS, 4, fit=False)
        _wait_until(lambda: killed.ends_sent > killed.ends_acknowledged)
    finally:
        os.kill(killed.process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    _wait_until(lambda: health.snapshot()["dropped"].get("offload"))
    assert time.monotonic() - killed_at < 2.0  # noticed within about a second
    _wait_until(lambda: p.offload._child is not killed and _serving(p.offload))
    assert p.provider.force_flush()
    here_before, there_before = _outputs(tmp_path / "here"), _outputs(tmp_path / "there")

    fault_workload.emit(4, UIDS, 4, fit=False)
    assert p.provider.force_flush()
    here, there = _outputs(tmp_path / "here"), _outputs(tmp_path / "there")
    assert sorted(here) == sorted(there) == ["otlp", "progress", "sample", "trajectory"]
    for kind in here:  # every span after the restart, in every output
        assert there[kind] - there_before[kind] == here[kind] - here_before[kind], kind
        assert not there[kind] - here[kind], kind  # nothing written that was not accepted, nothing twice
    lost = health.snapshot()["dropped"]["offload"]
    spans = sum(fault_workload.expected(len(UIDS), 4, fit=step == 1)["spans"] for step in (1, 2, 3, 4))
    assert sum(here["otlp"].values()) == spans
    assert sum(there["otlp"].values()) + lost == spans  # OTLP writes every span
    lost_trajectories = sum(n for (_, span), n in (here["otlp"] - there["otlp"]).items()
                            if json.loads(span)["name"] == "invoke_agent tool_agent")
    assert sum(there["trajectory"].values()) + lost_trajectories == sum(here["trajectory"].values())
    assert health.snapshot()["failures"] == {}
    [loss_file] = glob.glob(str(tmp_path / "there" / "losses" / "*.json"))
    with open(loss_file) as f:
        assert json.load(f)["dropped"] == {"offload": lost}  # the export process in its place says it too


def test_an_export_process_that_keeps_dying_gives_way_to_outputs_written_here(pipelines, tmp_path, caplog):
    """Past the restarts allowed a minute, the outputs are written in this process, as without
    offloading, which the log says once."""
    caplog.set_level(logging.WARNING, logger="otel_verl")
    p = pipelines()
    assert p.offload.in_process_outputs is not None  # bootstrap hands them over
    p.offload.max_restarts_per_minute = 1
    fault_workload.emit(1, UIDS, 4)
    assert p.provider.force_flush()
    killed = p.offload._child
    killed.process.kill()
    _wait_until(lambda: p.offload._child is not killed and _serving(p.offload))
    p.offload._child.process.kill()  # one death too many
    _wait_until(lambda: p.offload._in_process is not None)
    fault_workload.emit(2, UIDS, 4, fit=False)
    assert p.provider.force_flush()
    assert _outputs(tmp_path / "there") == _outputs(tmp_path / "here")
    assert health.snapshot() == {"failures": {}, "dropped": {}}  # each died with everything acknowledged
    said = [r.getMessage() for r in caplog.records if "writes its outputs itself" in r.getMessage()]
    assert len(said) == 1, said


def test_an_export_process_that_cannot_start_gives_way_to_outputs_written_here(pipelines, tmp_path, monkeypatch):
    def no_process(self):
        raise OSError("no process to be had")

    monkeypatch.setattr(OffloadSpanProcessor, "_spawn", no_process)
    p = pipelines()
    assert p.offload._in_process is not None and p.offload._child is None
    fault_workload.emit(1, UIDS, 4)
    assert p.provider.force_flush()
    assert _outputs(tmp_path / "there") == _outputs(tmp_path / "here")
    assert health.snapshot() == {"failures": {"offload.start": 1}, "dropped": {}}


def test_with_no_outputs_to_fall_back_on_later_spans_are_counted_not_raised(pipelines):
    p = pipelines()
    p.offload.max_restarts_per_minute = 0
    p.offload.in_process_outputs = None
    fault_workload.emit(1, UIDS[:2], 2)
    assert p.provider.force_flush()
    p.offload._child.process.kill()
    _wait_until(lambda: not p.offload._accepting)
    fault_workload.emit(2, UIDS[:2], 2, fit=False)  # must not raise
    assert not p.offload.force_flush(5000)
    # each span once, at its end (its start is no span)
    assert health.snapshot()["dropped"] == {"offload": fault_workload.expected(2, 2, fit=False)["spans"]}


def test_flush_and_shutdown_keep_their_time_bounds_when_the_export_process_hangs(pipelines):
    from otel_verl.offload import forwarder

    p = pipelines()
    fault_workload.emit(1, UIDS[:2], 2)
    assert p.provider.force_flush()
    hung = p.offload._child.process
    os.kill(hung.pid, signal.SIGSTOP)
    _shrink_pipe(hung.stdin)
    try:
        for step in (2, 3):
            fault_workload.emit(step, UIDS, 4, fit=False)
        started = time.monotonic()
        assert not p.offload.force_flush(500)
        assert time.monotonic() - started < 1.5
        p.offload.shutdown_timeout_s = 2.0
        closing = threading.Thread(target=p.offload.shutdown, daemon=True)
        started = time.monotonic()
        closing.start()
        closing.join(30)
        assert not closing.is_alive()
        assert time.monotonic() - started < 2.0 + 4 * forwarder.GRACE_S
        assert hung.poll() is not None  # stopped, it could only go killed by the shutdown
    finally:
        hung.kill()
    # every span of steps 2 and 3, each once
    assert health.snapshot()["dropped"] == {"offload": 2 * fault_workload.expected(len(UIDS), 4, fit=False)["spans"]}


def test_a_lost_span_is_counted_once_at_its_end(pipelines, monkeypatch):
    """An export process of another wire version writes nothing: each span is counted
    lost once (its start, sent or not, is no span)."""
    from otel_verl.offload import wire

    monkeypatch.setattr(wire, "VERSION", wire.VERSION + 1)  # this process only: the export process has its own
    p = pipelines()
    p.offload.in_process_outputs = None  # nothing to fall back on: every span is lost
    fault_workload.emit(1, UIDS[:2], 2)
    assert not p.offload.force_flush(30_000)
    fault_workload.emit(2, UIDS[:2], 2, fit=False)
    p.offload.shutdown()
    spans = fault_workload.expected(2, 2)["spans"] + fault_workload.expected(2, 2, fit=False)["spans"]
    assert health.snapshot() == {"failures": {"offload.version": 1}, "dropped": {"offload": spans}}


def test_spans_beyond_the_queue_bound_are_counted(pipelines):
    p = pipelines()
    assert p.provider.force_flush()
    p.offload.max_pending_bytes = 0  # the export process never keeps up
    fault_workload.emit(1, UIDS[:1], 2)
    p.offload.max_pending_bytes = 1 << 25
    dropped = health.snapshot()["dropped"]
    # every span of the step: the sample roots, its stages, each trajectory's spans
    assert dropped.get("offload", 0) >= 2 * 4, dropped


def test_the_sender_takes_what_was_queued_when_it_woke():
    """Spans the agent loop ends while the sender writes wait for its next wake-up:
    taking them too, the sender would write a frame every few spans."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext

    from otel_verl.offload import forwarder, wire

    def ended(i: int) -> ReadableSpan:
        return ReadableSpan(f"s{i}", context=SpanContext(1, i + 1, False), attributes={}, start_time=i, end_time=i + 1)

    config = wire.HostConfig(settings.load({}), {}, "", os.getpid())
    sender = OffloadSpanProcessor(config, max_batch=2, batch_interval_s=3600)  # wakes only when told
    frames, rebuilder = [], wire.Rebuilder(config)

    def send_batch(batch, flush, queued):
        frames.append([rebuilder.record(packed).name for packed in batch])
        sender._pending.append((forwarder.ENDED, ended(100 + len(frames)), None, None, 0))  # meanwhile, on the event loop

    sender._send_batch = send_batch
    sender._pending.extend((forwarder.ENDED, ended(i), None, None, 0) for i in range(5))
    sender._send_pending()
    assert frames == [["s0", "s1"], ["s2", "s3"], ["s4"]]
    assert [entry[1].name for entry in sender._pending] == ["s101", "s102", "s103"]
    sender._pending.clear()
    sender.shutdown()


def _multi_turn(prompt_shapes: str) -> "tuple[TrajectoryData, list]":
    """A finished 4-turn trajectory whose prompts are built the ways agent loops build
    them, and each turn's whole prompt at the call."""
    from otel_verl.rollout_data import kept_ids, kept_prompt
    from otel_verl.text_codec import TextCodec

    data = TrajectoryData(uid="u", traj_uid="0", global_step=1, n_samples=4, agent_name="tool_agent", created_at=1.0,
                          completed_at=9.0, codec=TextCodec(lambda ids, **kw: ",".join(map(str, ids)),
                                                            lambda text, **kw: list(range(len(text.split())))))
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
        elif prompt_shapes == "kept at the call":  # as the events API keeps them
            ids, count = kept_prompt(prompt, data.turns[-1] if data.turns else None), len(prompt)
            completion = kept_ids(completion)
        else:  # tuples, no count
            ids, count = tuple(prompt), None
        wholes.append(list(prompt))
        data.turns.append(TurnData(prompt_ids=ids, start_ts=2.0 + i, prompt_token_count=count, end_ts=2.5 + i,
                                   completion_ids=completion, finish_reason="stop", observation_text=observation,
                                   observation_start_ts=2.5 + i, observation_end_ts=2.6 + i))
        for extended in (shared, prompt):
            extended += list(completion) + [300 + i, 301 + i]  # completion, then observation and template tokens
    return data, wholes


@pytest.mark.parametrize("prompt_shapes",
                         ["extended in place", "new list each turn", "history rewritten", "tuples", "kept at the call"])
def test_multi_turn_prompts_cross_to_the_export_process_as_the_jsonl_reads_them(prompt_shapes):
    """The export process's JSONL line of a multi-turn trajectory is the line the process
    would have written, whatever the agent loop's prompts are; of ids kept at the call
    (the events API), a read of an id that was not kept raises instead of inventing one."""
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
    from opentelemetry.trace import SpanContext

    from otel_verl.legacy.trajectory_jsonl import trajectory_line
    from otel_verl.offload import wire
    from otel_verl.offload.host import Host
    from otel_verl.rollout_data import UnsentTokens
    from otel_verl.payload import Payload, payload_of
    from otel_verl.semconv import Subject

    data, wholes = _multi_turn(prompt_shapes)
    span = ReadableSpan("invoke_agent tool_agent", context=SpanContext(1, 2, False), start_time=1, end_time=9)
    shared = []
    sent = wire.frame(wire.pack(span, Payload(Subject.TRAJECTORY, data), lambda codec: shared.append(codec) or 0))
    rebuilt = []

    class Reader(SpanProcessor):
        def on_end(self, span):
            rebuilt.append(payload_of(span).data)

    host = Host(wire.HostConfig(settings.load({}), {}, "", 1), processors=[Reader()])
    host.shared[0] = shared[0]
    host.export(wire.read_frame(io.BytesIO(sent)))
    [got] = rebuilt
    assert trajectory_line(got) == trajectory_line(data)
    if prompt_shapes == "kept at the call":
        previous_end = 0  # where the previous turn's completion ended: prompt count + 3 completion ids
        for turn, whole in zip(got.turns, wholes):
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


def test_spans_of_any_tracer_reach_the_export_process_whole(tmp_path):
    """Plain SDK spans (no payload, another tracer's) are exported by the export process
    as the process itself exports them: the OTLP-JSON files are the same spans."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Link, SpanKind, StatusCode

    from otel_verl.offload import wire

    resource = Resource.create({"service.name": "verl", "verl.role": "agent_loop_worker"})
    provider = TracerProvider(resource=resource)
    for processor in outputs.build(settings.load({settings.TRACE_DIR: str(tmp_path / "here")})):
        provider.add_span_processor(processor)
    there = settings.load({settings.TRACE_DIR: str(tmp_path / "there"), settings.OFFLOAD: "1"})
    offload = OffloadSpanProcessor(wire.HostConfig(there, dict(resource.attributes), resource.schema_url, os.getpid()))
    provider.add_span_processor(offload)
    tracer = provider.get_tracer("some.library", "0.1", attributes={"scope.key": "v"})
    for i in range(700):  # more than a batch
        with tracer.start_as_current_span(f"op {i % 3}", kind=SpanKind.SERVER, attributes={"i": i}) as parent:
            with tracer.start_as_current_span("child", links=[Link(parent.get_span_context(), {"why": "test"})]) as child:
                child.add_event("event", {"n": i})
                if i % 7 == 0:
                    child.set_status(StatusCode.ERROR, "failed")
    assert provider.force_flush()
    provider.shutdown()
    here, there = _files(str(tmp_path / "here")), _files(str(tmp_path / "there"))
    assert sorted(here) == sorted(there) and any(name.startswith("otlp/") for name in here)
    for name, blob in here.items():
        if name.startswith("otlp/"):
            spans = _otlp_spans(blob)
            assert len(spans) == 1400 and spans == _otlp_spans(there[name]), name
    assert health.snapshot() == {"failures": {}, "dropped": {}}


@pytest.mark.parametrize("env", [
    {settings.OTLP_FILE: "0"},  # the legacy files alone
    {settings.OTLP_FILE: "0", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://127.0.0.1:9"},  # and metrics
    {},  # and the OTLP-JSON files
    {settings.OTLP_FILE: "0", settings.OTLP_ENDPOINT: "http://127.0.0.1:9"},  # and OTLP
], ids=["legacy", "metrics", "otlp_files", "otlp"])
def test_the_export_process_is_sent_every_span_end_its_outputs_read(env, tmp_path, monkeypatch):
    """outputs.ends_read, the span ends a traced process sends (and the spans
    it makes at all), covers what each output of the export process reads."""
    for name in ("OTEL_METRICS_EXPORTER", settings.OTLP_ENDPOINT, settings.OTLP_TRACES_ENDPOINT,
                 "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = settings.load({settings.TRACE_DIR: str(tmp_path), **env})
    sent = outputs.ends_read(cfg)
    processors = outputs.build(cfg)
    try:
        read = [getattr(processor, "on_end_subjects", None) for processor in processors]
        if None in read:
            assert sent is None
        else:
            assert sent is not None and sent >= frozenset().union(*read)
    finally:
        for processor in processors:
            processor.shutdown()
    if env == {settings.OTLP_FILE: "0"}:  # nothing reads a server's or a reward's span then
        from otel_verl.semconv import Subject

        assert not sent & {Subject.LLM_SERVER, Subject.REWARD, Subject.REWARD_WORKER}


def test_the_export_process_gets_only_the_starts_its_outputs_read(pipelines, tmp_path, monkeypatch):
    """Starts go to the export process for the kinds an output writes rows for at a start
    (outputs.starts_read); a tool or reward span goes once, whole, at its end,
    and the outputs are still the ones the process writes itself."""
    from otel_verl.legacy.progress_log import ProgressLogProcessor
    from otel_verl.legacy.sample_csv import SampleCsvProcessor
    from otel_verl.semconv import Subject

    kinds = outputs.starts_read(settings.load({settings.TRACE_DIR: str(tmp_path)}))
    assert kinds == ProgressLogProcessor.on_start_subjects | SampleCsvProcessor.on_start_subjects
    assert Subject.TRAJECTORY in kinds and Subject.LLM_CALL in kinds
    assert Subject.TOOL not in kinds and Subject.REWARD not in kinds
    from otel_verl.offload import wire

    p = pipelines()
    assert p.offload.on_start_subjects == kinds
    sent = []
    pack = wire.pack

    def spy(span, payload, shared_id, start_attributes=None):
        sent.append(("start" if start_attributes is not None else "end", span.name))
        return pack(span, payload, shared_id, start_attributes)

    monkeypatch.setattr(wire, "pack", spy)
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


# --------------------------------------------------------------------------- outliving the traced process


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_the_export_process_is_no_child_of_the_traced_process_and_in_a_session_of_its_own(pipelines):
    """Ray's workers SIGKILL their children as they exit (ray.kill and a job's end
    included), and the raylet their process group: neither reaches the export process."""
    p = pipelines()
    assert p.provider.force_flush()  # it answered
    pid = p.offload._child.process.pid
    assert _parent_of(pid) != os.getpid()
    assert os.getsid(pid) != os.getsid(0) and os.getpgid(pid) != os.getpgid(0)


# The traced process: a step flushed (its export process runs), maybe a forked child that
# holds the export process's input open (as a multiprocessing worker may), then a second
# step and SIGKILL at once, before the sender takes the step's spans (every 50 ms).
_KILLED_RIGHT_AFTER = """
    import os, signal, sys, time
    import otel_verl, fault_workload as w
    from otel_verl import bootstrap

    assert otel_verl.configure(role="agent_loop_worker")
    w.emit(1, [f"a{i}" for i in range(3)], 4)
    assert bootstrap.flush(30)
    if sys.argv[1] == "fork":
        child = os.fork()
        if child == 0:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # (not the test's pipe)
            time.sleep(120)
            os._exit(0)
        print("CHILD", child, flush=True)
    w.emit(2, [f"b{i}" for i in range(3)], 4, fit=False)
    os.kill(os.getpid(), signal.SIGKILL)
"""
KILLED_SHUTDOWN_S = 3


def _export_processes_writing(trace) -> list:
    """The export processes whose served process traces into ``trace`` (their environment)."""
    found, marker = [], f"VERL_TRACE_DIR={trace}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"otel_verl.offload.host" not in f.read():
                        continue
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def _run_killed_right_after(tmp_path, mode: str) -> "tuple[int, float]":
    """Runs the traced process to its SIGKILL; its pid, and the seconds its export
    processes took to exit after it."""
    import subprocess
    import sys
    import textwrap

    trace = tmp_path / "trace"
    env = fault_workload.clean_env({"VERL_TRACE_DIR": str(trace), "OTEL_VERL_OFFLOAD": "1", "OTEL_VERL_OTLP_FILE": "1",
                                    "OTEL_VERL_SHUTDOWN_TIMEOUT_S": str(KILLED_SHUTDOWN_S)})
    stderr = tmp_path / "stderr"
    with open(stderr, "wb") as err:  # a file: the export process writes there too, and may outlive this test
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_KILLED_RIGHT_AFTER), mode], env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    child = None
    try:
        for line in proc.stdout:
            if line.startswith("CHILD "):
                child = int(line.split()[1])
                break
        proc.wait(120)
        died = time.monotonic()
        assert proc.returncode == -signal.SIGKILL, stderr.read_text()[-3000:]
        while _export_processes_writing(trace) and time.monotonic() - died < KILLED_SHUTDOWN_S + 20:
            time.sleep(0.05)
        took = time.monotonic() - died
        assert not _export_processes_writing(trace), "the export process did not exit"
        if child is not None:
            assert _parent_of(child) and os.path.exists(f"/proc/{child}")  # it held the pipe all along
        return proc.pid, took
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass
        for pid in _export_processes_writing(trace):
            os.kill(pid, signal.SIGKILL)


def _written_and_counted(trace, pid: int) -> "tuple[dict, dict]":
    """What the files hold (``fault_workload.file_lines``) and what the final loss file of
    process ``pid`` counts."""
    losses = []
    for path in glob.glob(os.path.join(str(trace), "losses", "*.json")):
        with open(path) as f:
            losses.append(json.load(f))
    [mine] = [loss for loss in losses if loss["pid"] == pid]
    assert mine["final"], mine
    return fault_workload.file_lines(str(trace)), mine["dropped"]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_traced_process_killed_right_after_its_last_spans_has_them_counted_by_its_export_process(tmp_path):
    """SIGKILL before the spans of its last step were sent: the export process, which
    outlives it, writes what it got and counts the span ends the traced process had
    queued (read from memory both map), finishes its outputs and exits."""
    pid, _ = _run_killed_right_after(tmp_path, "plain")
    lines, dropped = _written_and_counted(tmp_path / "trace", pid)
    produced = fault_workload.expected(3, 4)["spans"] + fault_workload.expected(3, 4, fit=False)["spans"]
    written = len(fault_workload.otlp_spans(lines["otlp"]))
    assert written >= fault_workload.expected(3, 4)["spans"]  # the flushed step, whole
    assert written + dropped.get("offload", 0) == produced, dropped


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_an_export_process_exits_once_its_traced_process_died_though_a_forked_child_holds_its_input(tmp_path):
    pid, took = _run_killed_right_after(tmp_path, "fork")
    assert took < KILLED_SHUTDOWN_S + 10  # not when the child exits (120 s)
    lines, dropped = _written_and_counted(tmp_path / "trace", pid)
    produced = fault_workload.expected(3, 4)["spans"] + fault_workload.expected(3, 4, fit=False)["spans"]
    assert len(fault_workload.otlp_spans(lines["otlp"])) + dropped.get("offload", 0) == produced, dropped
