"""The metrics derived from the spans (otel_verl.exporters.metrics), read with an in-memory
exporter; their aggregation against the SDK's; their OTLP-JSON files; how bootstrap picks
their exporters."""

from __future__ import annotations

import glob
import json
import os
import threading

import pytest
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

from otel_verl import bootstrap, events, health, outputs, settings
from otel_verl import semconv as sc
from otel_verl.exporters import metrics as m
from otel_verl.exporters.otlp_json_metrics import OtlpJsonMetricFileExporter
from otel_verl.semconv import Stage

SAMPLE_KEYS = {sc.UID, sc.TRAJ_UID, sc.GLOBAL_STEP, sc.GEN_AI_CONVERSATION_ID, sc.LLM_REQUEST_ID}


class InMemoryExporter(MetricExporter):
    """Keeps what it is handed."""

    def __init__(self):
        super().__init__()
        self.exported = []

    def export(self, metrics_data, timeout_millis=10_000, **kwargs):
        self.exported.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis=10_000):
        return True

    def shutdown(self, timeout_millis=30_000, **kwargs):
        pass


class Reader:
    """The processor's metrics as of now: a flush, then what its exporter got."""

    def __init__(self, processor: m.SpanMetricsProcessor, exporter: InMemoryExporter) -> None:
        self.processor = processor
        self.exporter = exporter

    def get_metrics_data(self):
        assert self.processor.force_flush()
        return self.exporter.exported[-1] if self.exporter.exported else None


@pytest.fixture
def reader(make_pipeline):
    health.reset()
    exporter = InMemoryExporter()
    processor = m.SpanMetricsProcessor(lambda: [exporter])
    make_pipeline([processor])
    yield Reader(processor, exporter)
    processor.shutdown()
    health.reset()


def points(reader) -> dict:
    """metric name -> [(attributes, point)] of the reader's collection."""
    out: dict = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                out.setdefault(metric.name, []).extend((dict(p.attributes), p) for p in metric.data.data_points)
    return out


def one(found, name, **attrs):
    matching = [p for a, p in found.get(name, []) if a == attrs]
    assert len(matching) == 1, (name, attrs, [a for a, _ in found.get(name, [])])
    return matching[0]


def _trajectory(uid="u1", traj_uid="t1", server_meta=None):
    with events.trajectory(uid, traj_uid, step=3, agent_name="tool_agent", provider="sglang"):
        with events.llm_call([1, 2, 3], model="qwen", provider="sglang") as turn:
            headers = turn.carrier()
            turn.finish([4, 5], stop_reason="stop")
        with events.tool_call("calculator", call_id="c1"):
            pass
        with events.reward() as reward:
            reward.score(1.0)
    return headers


def test_trainer_steps_stages_and_sample_outcomes(reader):
    events.samples_created(["u1", "u2"], step=1, trainer="RayPPOTrainer")
    with events.step(1, trainer="RayPPOTrainer"):
        with events.step_stage(Stage.GENERATION):
            pass
        with events.step_stage(Stage.UPDATE_ACTOR):
            pass
    events.samples_finished(["u1"], sc.Outcome.TRAINED)
    events.samples_finished(["u2"], sc.Outcome.FILTERED)
    found = points(reader)

    assert one(found, m.STEP_DURATION, **{sc.LAYOUT: "colocated"}).count == 1
    for stage in ("generation", "update_actor"):
        point = one(found, m.STAGE_DURATION, **{sc.STAGE: stage, sc.LAYOUT: "colocated"})
        assert point.count == 1 and point.sum >= 0
    assert one(found, m.SAMPLES, **{sc.SAMPLE_OUTCOME: "trained"}).value == 1
    assert one(found, m.SAMPLES, **{sc.SAMPLE_OUTCOME: "filtered"}).value == 1


def test_trajectory_llm_tool_and_reward_with_genai_attributes(reader):
    _trajectory("u1", "t1")
    _trajectory("u2", "t2")
    found = points(reader)

    assert one(found, m.TRAJECTORY_DURATION, **{sc.GEN_AI_AGENT_NAME: "tool_agent"}).count == 2
    genai = {sc.GEN_AI_OPERATION_NAME: "chat", sc.GEN_AI_PROVIDER_NAME: "sglang", sc.GEN_AI_REQUEST_MODEL: "qwen"}
    assert one(found, m.LLM_OPERATION_DURATION, **genai).count == 2
    tokens_in = one(found, m.LLM_TOKEN_USAGE, **genai, **{m.GEN_AI_TOKEN_TYPE: "input"})
    tokens_out = one(found, m.LLM_TOKEN_USAGE, **genai, **{m.GEN_AI_TOKEN_TYPE: "output"})
    assert (tokens_in.count, tokens_in.sum) == (2, 6)
    assert (tokens_out.count, tokens_out.sum) == (2, 4)
    assert one(found, m.TOOL_DURATION, **{sc.GEN_AI_TOOL_NAME: "calculator"}).count == 2
    assert one(found, m.REWARD_DURATION).count == 2


def test_llm_server_queue_prefill_and_decode_from_the_engine_meta(reader):
    with events.trajectory("u1", "t1", step=1, agent_name="a"):
        with events.llm_call([1]) as turn:
            headers = turn.carrier()
    with events.llm_server_call(headers, request_id="r1", provider="sglang") as call:
        # sglang 0.5.12: arrival at 100.0, first token at 100.75 after 0.25 s in the queue
        call.record_meta({"e2e_latency": 2.0, "queue_time": 0.25, "request_received_ts": 100.0,
                          "prefill_finished_time": 100.75})
    with events.llm_server_call(headers, request_id="r2", provider="sglang") as call:
        call.record_meta({"e2e_latency": 1.0})  # no enable_metrics: the e2e latency only
    found = points(reader)
    attrs = {sc.GEN_AI_PROVIDER_NAME: "sglang"}

    request = one(found, m.SERVER_REQUEST_DURATION, **attrs)
    assert (request.count, request.sum) == (2, 3.0)
    for name, value in ((m.SERVER_QUEUE_DURATION, 0.25), (m.SERVER_PREFILL_DURATION, 0.5),
                        (m.SERVER_DECODE_DURATION, 1.25)):
        point = one(found, name, **attrs)
        assert (point.count, point.sum) == (1, pytest.approx(value)), name


@pytest.mark.parametrize("meta", [
    # sglang 0.5.12 (and 0.5.23, which adds first_token_latency)
    {"e2e_latency": 2.0, "queue_time": 0.25, "request_received_ts": 100.0, "prefill_finished_time": 100.75},
    # an older sglang: prefill_finished_ts, and prefill_launch_latency beside the time to first token
    {"e2e_latency": 1.5, "queue_time": 0.25, "request_received_ts": 100.0, "prefill_finished_ts": 100.5,
     "prefill_launch_latency": 0.125},
], ids=["sglang_0_5_12", "older_sglang"])
def test_the_server_split_of_the_metrics_is_the_reports(reader, meta):
    from otel_verl.tools.report.spans import server_split

    with events.trajectory("u1", "t1", step=1, agent_name="a"):
        with events.llm_call([1]) as turn:
            headers = turn.carrier()
    with events.llm_server_call(headers, request_id="r1", provider="sglang") as call:
        call.record_meta(meta)
    found = points(reader)
    attrs = {sc.GEN_AI_PROVIDER_NAME: "sglang"}
    split = server_split({"attributes": {sc.llm_server_meta_attribute(k): v for k, v in meta.items()}})
    for name, part in ((m.SERVER_REQUEST_DURATION, "e2e"), (m.SERVER_QUEUE_DURATION, "queue"),
                       (m.SERVER_PREFILL_DURATION, "prefill"), (m.SERVER_DECODE_DURATION, "decode")):
        assert one(found, name, **attrs).sum == pytest.approx(split[part]), name
    assert split["queue"] + split["prefill"] + split["decode"] == pytest.approx(split["e2e"])


def test_no_sample_identity_reaches_a_metric_attribute(reader):
    for i in range(5):
        _trajectory(f"u{i}", f"t{i}")
    found = points(reader)
    assert found
    for name, entries in found.items():
        for attrs, _ in entries:
            assert not SAMPLE_KEYS & set(attrs), (name, attrs)
    # five trajectories, one series
    assert len(found[m.TRAJECTORY_DURATION]) == 1


def test_an_exemplar_names_the_trace_of_its_span(reader):
    _trajectory("u7", "t7")
    point = one(points(reader), m.TRAJECTORY_DURATION, **{sc.GEN_AI_AGENT_NAME: "tool_agent"})
    from otel_verl.ids import trace_id_for_uid

    assert [e.trace_id for e in point.exemplars] == [trace_id_for_uid("u7")]


def test_losses_and_failures_are_observed_as_counters(reader):
    _trajectory()  # the provider starts with the first span
    health.record_dropped("otlp", 3, "test")
    health.record_failure("events.test", RuntimeError("boom"))
    found = points(reader)
    assert one(found, m.DROPPED, **{m.OUTPUT_ATTRIBUTE: "otlp"}).value == 3
    assert one(found, m.FAILURES, **{m.WHERE_ATTRIBUTE: "events.test"}).value == 1
    health.record_dropped("otlp", 2, "test")
    assert one(points(reader), m.DROPPED, **{m.OUTPUT_ATTRIBUTE: "otlp"}).value == 5


def _random_run(rng, rounds: int) -> None:
    """Spans of every subject the metrics read, with random values and attribute sets."""
    for i in range(rounds):
        uid = f"u{i}"
        tool = rng.choice(["calculator", "search", "python"])
        try:
            with events.trajectory(uid, f"t{i}", step=1 + i % 3, agent_name=rng.choice(["a", "tool_agent"]),
                                   provider="sglang"):
                with events.llm_call(list(range(rng.randrange(1, 300))), model=rng.choice(["qwen", "llama"]),
                                     provider="sglang") as turn:
                    headers = turn.carrier()
                    turn.finish(list(range(rng.randrange(0, 50))), stop_reason="stop")
                with events.llm_server_call(headers, request_id=f"r{i}", provider="sglang") as call:
                    e2e = rng.uniform(0.001, 30)
                    queue = rng.uniform(0, e2e / 2)
                    call.record_meta({"e2e_latency": e2e, "queue_time": queue, "request_received_ts": 100.0,
                                      "prefill_finished_time": 100.0 + queue + rng.uniform(0, e2e / 2)})
                with events.tool_call(tool, call_id=f"c{i}"):
                    if rng.random() < 0.3:
                        raise ValueError("the tool failed")
        except ValueError:
            pass
        with events.reward() as reward:
            reward.score(rng.random())
    events.samples_created([f"s{i}" for i in range(rounds)], step=1, trainer="RayPPOTrainer")
    with events.step(1, trainer="RayPPOTrainer"):
        with events.step_stage(Stage.GENERATION):
            pass
    for i in range(rounds):
        events.samples_finished([f"s{i}"], rng.choice([sc.Outcome.TRAINED, sc.Outcome.FILTERED]))


def _comparable(data) -> dict:
    """metric name -> its points as the OTLP-JSON files write them, timestamps left out;
    a counter's one exemplar (the SDK's picks one measurement at random) only counted."""
    from otel_verl.exporters.otlp_json_metrics import resource_metrics_dict

    out = {}
    [resource] = resource_metrics_dict(data)["resourceMetrics"]
    for scope in resource["scopeMetrics"]:
        for metric in scope["metrics"]:
            kind = "histogram" if "histogram" in metric else "sum"
            points = []
            for point in metric[kind]["dataPoints"]:
                point = {k: v for k, v in point.items() if not k.endswith("UnixNano")}
                exemplars = [{k: v for k, v in e.items() if k != "timeUnixNano"} for e in point.pop("exemplars", [])]
                point["exemplars"] = (sorted(exemplars, key=json.dumps) if kind == "histogram" else len(exemplars))
                points.append(point)
            out[metric["name"]] = {**{k: v for k, v in metric.items() if k != kind},
                                   kind: {**metric[kind], "dataPoints": sorted(points, key=json.dumps)}}
        out["scope"] = scope["scope"]
    out["resource"] = resource["resource"]
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_aggregation_equals_the_sdks_on_the_same_spans(make_pipeline, seed):
    """Each collection of otel_verl's aggregation holds the points the SDK's instruments
    make of the same records: cumulative across collections, each collection's exemplars
    its own."""
    import random

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    health.reset()
    rng = random.Random(seed)
    sdk_reader = InMemoryMetricReader()
    sdk_provider = MeterProvider(metric_readers=[sdk_reader])  # its own resource: compared apart
    ours = InMemoryExporter()
    processors = [m.SpanMetricsProcessor(meter_provider=sdk_provider), m.SpanMetricsProcessor(lambda: [ours])]
    pipeline = make_pipeline(processors)
    for collection in range(2):
        _random_run(rng, 40)
        health.record_dropped("otlp", collection + 1, "test")
        assert processors[1].force_flush()
        expected = _comparable(sdk_reader.get_metrics_data())
        got = _comparable(ours.exported[-1])
        # the spans' resource, where the SDK's provider has its own
        assert {"key": "verl.role", "value": {"stringValue": "trainer"}} in got.pop("resource")["attributes"]
        expected.pop("resource")
        assert got == expected
    pipeline.close()
    sdk_provider.shutdown()


def test_attribute_sets_past_the_cardinality_limit_share_one_overflow_series(reader):
    from otel_verl.accelerated.metric_aggregation import CARDINALITY_LIMIT

    with events.trajectory("u1", "t1", step=1, agent_name="a"):
        for i in range(CARDINALITY_LIMIT + 5):
            with events.tool_call(f"tool-{i}", call_id=f"c{i}"):
                pass
    found = points(reader)
    assert len(found[m.TOOL_DURATION]) == CARDINALITY_LIMIT + 1
    assert one(found, m.TOOL_DURATION, **{"otel.metric.overflow": True}).count == 5


def test_a_refused_export_is_no_failed_flush_and_the_next_collection_holds_it_all(make_pipeline):
    """As the SDK's reader: the exporter logs why it refused; the points are cumulative."""

    class Refusing(InMemoryExporter):
        refuse = True

        def export(self, metrics_data, timeout_millis=10_000, **kwargs):
            if self.refuse:
                return MetricExportResult.FAILURE
            return super().export(metrics_data, timeout_millis)

    health.reset()
    exporter = Refusing()
    processor = m.SpanMetricsProcessor(lambda: [exporter])
    make_pipeline([processor])
    _trajectory("u1", "t1")
    assert processor.force_flush() and exporter.exported == []
    exporter.refuse = False
    _trajectory("u2", "t2")
    assert processor.force_flush()
    assert one(points(Reader(processor, exporter)), m.TRAJECTORY_DURATION,
               **{sc.GEN_AI_AGENT_NAME: "tool_agent"}).count == 2
    assert health.snapshot()["failures"] == {}
    processor.shutdown()


def test_settings_only_the_sdk_has_go_through_its_meter_provider(make_pipeline, monkeypatch):
    from opentelemetry.sdk.metrics import MeterProvider

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "delta")
    exporter = InMemoryExporter()
    processor = m.SpanMetricsProcessor(lambda: [exporter])
    make_pipeline([processor])
    _trajectory()
    assert isinstance(processor.owned, MeterProvider)
    assert processor.force_flush() and exporter.exported
    processor.shutdown()


@pytest.mark.parametrize("accelerated", ["false", "true"])
def test_not_accelerated_the_metrics_go_through_the_sdks_meter_provider(tmp_path, monkeypatch, make_pipeline,
                                                                       accelerated):
    """``OTEL_VERL_ACCELERATED=false``: the SDK's instruments and aggregation, into the same
    files; by default otel_verl's own aggregation."""
    from opentelemetry.sdk.metrics import MeterProvider

    from otel_verl.accelerated.metric_aggregation import PeriodicExport

    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_METRICS_EXPORTER",
                 "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE",
                 "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION", "OTEL_METRICS_EXEMPLAR_FILTER"):
        monkeypatch.delenv(name, raising=False)
    processor = outputs.metrics_processor(_cfg({settings.TRACE_DIR: str(tmp_path),
                                                   settings.ACCELERATED: accelerated}))
    make_pipeline([processor])
    _trajectory()
    assert isinstance(processor.owned, MeterProvider if accelerated == "false" else PeriodicExport)
    processor.shutdown()
    (path,) = glob.glob(str(tmp_path / outputs.METRICS_FILES_DIR / "metrics-*.jsonl"))
    assert '"verl.trajectory.duration"' in open(path, encoding="utf-8").read()


def test_readers_that_cannot_be_built_are_one_failure_and_no_metrics(make_pipeline):
    health.reset()
    calls = []

    def broken():
        calls.append(1)
        raise OSError("no such directory")

    processor = m.SpanMetricsProcessor(broken)
    make_pipeline([processor])
    _trajectory("u1", "t1")  # must not raise
    _trajectory("u2", "t2")
    assert calls == [1] and health.snapshot()["failures"] == {"metrics.start": 1}


def test_a_process_that_ends_no_span_builds_no_exporter():
    built = []
    processor = m.SpanMetricsProcessor(lambda: built.append(1) or [])
    assert processor.force_flush()
    processor.shutdown()
    assert built == [] and processor.owned is None


class _HangingExporter(MetricExporter):
    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def export(self, metrics_data, timeout_millis=10_000, **kwargs):
        self.release.wait(30)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis=10_000):
        return True

    def shutdown(self, timeout_millis=30_000, **kwargs):
        # as the SDK's OTLP exporters wait for the export in progress: the reader's own
        # shutdown, which waits for its thread only as long as it is given, then hangs too
        self.release.wait(30)


def test_shutdown_keeps_its_deadline_with_an_exporter_that_hangs(make_pipeline):
    health.reset()
    exporter = _HangingExporter()
    processor = m.SpanMetricsProcessor(lambda: [exporter], shutdown_timeout_s=0.2)
    make_pipeline([processor])
    _trajectory()
    try:
        processor.shutdown()  # returns, the export goes on in the background
        assert health.snapshot()["failures"].get("metrics.shutdown") == 1
    finally:
        exporter.release.set()


def _dropped_in(data) -> dict:
    """The otel_verl.dropped points of one collection: output -> value."""
    return {dict(p.attributes)[m.OUTPUT_ATTRIBUTE]: p.value for resource in data.resource_metrics
            for scope in resource.scope_metrics for metric in scope.metrics if metric.name == m.DROPPED
            for p in metric.data.data_points}


def test_an_exporter_that_hangs_delays_no_other_exporters_collections(make_pipeline):
    """As an OTLP exporter waits out a collector that does not answer: the file beside it
    still gets every collection, the shutdown's last one included, within the deadline."""
    hanging, files = _HangingExporter(), InMemoryExporter()
    processor = m.SpanMetricsProcessor(lambda: [hanging, files], shutdown_timeout_s=1.0)
    make_pipeline([processor])
    _trajectory()
    try:
        assert not processor.force_flush(200)  # the hanging one did not export it in time
        assert len(files.exported) == 1
        health.record_dropped("otlp", 7, "induced by the test")
        processor.shutdown()
        assert _dropped_in(files.exported[-1]) == {"otlp": 7}
    finally:
        hanging.release.set()


def test_a_loss_is_collected_within_a_second_or_so_without_a_flush():
    """A process killed before its next collection (every 60 s by default) leaves its
    losses in its metric files all the same, as in its loss file."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from otel_verl.accelerated.metric_aggregation import Aggregation, PeriodicExport

    aggregation = Aggregation(Resource.create({}), InstrumentationScope(m.METER_NAME))
    m._Instruments(aggregation, m._sampled_span)
    exporter = InMemoryExporter()
    export = PeriodicExport(aggregation, [exporter], env={"OTEL_METRIC_EXPORT_INTERVAL": "600000"})
    try:
        health.record_dropped("otlp", 3, "induced by the test")
        for _ in range(200):  # generous: the thread looks every second
            if exporter.exported and _dropped_in(exporter.exported[-1]) == {"otlp": 3}:
                break
            threading.Event().wait(0.05)
        assert exporter.exported and _dropped_in(exporter.exported[-1]) == {"otlp": 3}
        collections = len(exporter.exported)
        threading.Event().wait(1.5)
        assert len(exporter.exported) == collections  # no change, no collection
    finally:
        export.shutdown(1000)


# --------------------------------------------------------------------------- files


def test_metric_files_hold_one_otlp_json_line_per_collection(tmp_path, make_pipeline):
    directory = str(tmp_path / "otlp")
    exporter = OtlpJsonMetricFileExporter(directory)
    processor = m.SpanMetricsProcessor(lambda: [exporter])
    make_pipeline([processor])
    _trajectory("u1", "t1")
    assert processor.force_flush()
    _trajectory("u2", "t2")
    processor.shutdown()

    files = glob.glob(os.path.join(directory, "metrics-*-pid*.jsonl"))
    assert files == [exporter.path]
    lines = [json.loads(line) for line in open(files[0], encoding="utf-8")]
    assert len(lines) == 2
    resource = lines[-1]["resourceMetrics"][0]
    assert {"key": "verl.role", "value": {"stringValue": "trainer"}} in resource["resource"]["attributes"]
    by_name = {metric["name"]: metric for scope in resource["scopeMetrics"] for metric in scope["metrics"]}
    trajectory = by_name[m.TRAJECTORY_DURATION]
    assert trajectory["unit"] == "s"
    assert trajectory["histogram"]["aggregationTemporality"] == 2  # cumulative
    point = trajectory["histogram"]["dataPoints"][0]
    assert point["count"] == "2"  # int64 as a decimal string, as the Collector writes it
    assert all(len(e["traceId"]) == 32 and int(e["traceId"], 16) for e in point.get("exemplars", []))
    assert by_name[m.LLM_TOKEN_USAGE]["unit"] == "{token}"


# --------------------------------------------------------------------------- bootstrap


def _cfg(env):
    return settings.load(env)


def test_no_endpoint_writes_the_metric_files_beside_the_spans(tmp_path, monkeypatch, make_pipeline):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_METRICS_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    cfg = _cfg({settings.TRACE_DIR: str(tmp_path)})
    assert outputs.metrics_outputs(cfg) == ["files"]
    processor = outputs.metrics_processor(cfg)
    make_pipeline([processor])
    _trajectory()
    processor.shutdown()
    (path,) = glob.glob(str(tmp_path / outputs.METRICS_FILES_DIR / "metrics-*.jsonl"))
    assert '"verl.trajectory.duration"' in open(path, encoding="utf-8").read()
    assert not glob.glob(str(tmp_path / "otlp" / "*"))  # the spans' directory holds spans only


@pytest.mark.parametrize("env, wanted", [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_VERL_OTLP_FILE": "1"}, ["files", "otlp"]),
    ({"OTEL_METRICS_EXPORTER": "console"}, ["console"]),
    ({"OTEL_METRICS_EXPORTER": "otlp,console"}, ["files", "console"]),
    ({"OTEL_VERL_OTLP_FILE": "0"}, []),
])
def test_where_the_metrics_go(tmp_path, monkeypatch, env, wanted):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_METRICS_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert outputs.metrics_outputs(_cfg({settings.TRACE_DIR: str(tmp_path), **env})) == wanted


def test_metrics_exporter_none_turns_the_metrics_off(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    assert outputs.metrics_processor(_cfg({settings.TRACE_DIR: str(tmp_path)})) is None


def test_an_unknown_metrics_exporter_is_an_error_and_no_metrics(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    assert outputs.metrics_processor(_cfg({settings.TRACE_DIR: str(tmp_path)})) is None
    assert "OTEL_METRICS_EXPORTER=prometheus: unknown exporter prometheus" in caplog.text


def test_doctor_says_where_the_metrics_go(tmp_path, monkeypatch):
    from otel_verl.tools import cli

    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_METRICS_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    checks, _ = cli._settings_checks({settings.TRACE_DIR: str(tmp_path)})
    (metrics,) = [c for c in checks if c.name == "metrics"]
    assert metrics.detail == "to: files"
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp,bogus")
    checks, _ = cli._settings_checks({settings.TRACE_DIR: str(tmp_path)})
    (metrics,) = [c for c in checks if c.name == "metrics"]
    assert metrics.state == cli.FAIL and "bogus" in metrics.detail


@pytest.mark.parametrize("env, endpoint", [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, "http://c:4317"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://m:4317"},
     "http://m:4317"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, "http://c:4318/v1/metrics"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}, "http://c:4317"),
])
def test_the_metrics_go_where_the_traces_go_unless_told_otherwise(monkeypatch, env, endpoint):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert outputs._metrics_endpoint() == endpoint


def test_output_processors_include_the_metrics_processor(tmp_path, monkeypatch):
    monkeypatch.delenv("OTEL_METRICS_EXPORTER", raising=False)
    cfg = _cfg({settings.TRACE_DIR: str(tmp_path)})
    processors = outputs.build(cfg)
    try:
        assert sum(isinstance(p, m.SpanMetricsProcessor) for p in processors) == 1
    finally:
        for processor in processors:
            processor.shutdown()
