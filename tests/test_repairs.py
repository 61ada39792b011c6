"""Faults the outputs repair rather than lose to.

- Every output file follows its path, the OTLP-JSON span and metric files as the legacy
  writers do: a deleted trace dir is created again, a renamed (rotated) file is
  followed, and no line goes to an unlinked file or is lost.
- Text UTF-8 cannot carry (a lone surrogate) is repaired wherever it is written: an
  error message never costs its OTLP batch, an observation or decoded text never its
  trajectory line.
- The trajectory JSONL's texts are cut at their bound, so a 50 MB observation makes a
  line of bounded size that still holds the contract's keys.
- Smaller faults: odd headers at an LLM server call, long uids that share their head,
  paths with spaces in the demo's Hydra overrides.

Unit level, through the real events API (``make_pipeline``); only the Hydra case needs
the verl extra.
"""

from __future__ import annotations

import csv
import glob
import http.server
import json
import os
import shutil
import threading
from typing import Any, Callable, Dict, List, Set

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricExportResult
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_verl import events, health, legacy, outputs, settings
from otel_verl import semconv as sc
from otel_verl.accelerated.otlp_encoding import ProtobufEncoder, records_of
from otel_verl.legacy import progress_log, sample_csv, trajectory_jsonl
from otel_verl.exporters.otlp_json_file import OtlpJsonFileExporter, spans_from_files
from otel_verl.exporters.otlp_json_metrics import OtlpJsonMetricFileExporter
from otel_verl.legacy.sample_csv import SampleCsvProcessor
from otel_verl.legacy.trajectory_jsonl import TrajectoryJsonlProcessor
from otel_verl.semconv import Outcome
from test_trajectory_jsonl import REST_KEYS, TURN_KEYS

LONE = json.loads('"\\ud800"')  # a lone surrogate, as json.loads makes one of a model's output
FFFD = "\ufffd"


def failures() -> Dict[str, int]:
    return health.snapshot()["failures"]


def dropped() -> Dict[str, int]:
    return health.snapshot()["dropped"]


# --------------------------------------------------------------------------- files follow their paths


class SpanFiles:
    """The OTLP-JSON span files, fed batches of the events API's spans; a line is read
    back as the span ids it holds."""

    def __init__(self, trace_dir: str, make_pipeline: Callable[..., Any], **options: Any) -> None:
        self.exporter = OtlpJsonFileExporter(os.path.join(trace_dir, "otlp"), **options)
        self.pipeline = make_pipeline([])

    @property
    def path(self) -> str:
        return self.exporter.path

    def write(self, batch: int) -> Set[str]:
        self.pipeline.exporter.clear()
        with events.trajectory(f"batch-{batch}", "0", step=batch, agent_name="tool_agent"):
            with events.llm_call([1, 2, 3]) as turn:
                turn.finish([4], stop_reason="stop")
        spans = self.pipeline.spans()
        assert self.exporter.export(spans) is SpanExportResult.SUCCESS
        return {f"{span.context.span_id:016x}" for span in spans}

    @staticmethod
    def keys(line: Dict[str, Any]) -> Set[str]:
        return {span["spanId"] for rs in line["resourceSpans"] for ss in rs["scopeSpans"] for span in ss["spans"]}

    def close(self) -> None:
        self.exporter.shutdown()


class MetricFiles:
    """The OTLP-JSON metric files, fed one collection per batch; a line is read back as
    the batches its data points name."""

    def __init__(self, trace_dir: str, make_pipeline: Callable[..., Any], **options: Any) -> None:
        self.exporter = OtlpJsonMetricFileExporter(os.path.join(trace_dir, outputs.METRICS_FILES_DIR), **options)

    @property
    def path(self) -> str:
        return self.exporter.path

    def write(self, batch: int) -> Set[str]:
        reader = InMemoryMetricReader()
        provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": "verl"}))
        provider.get_meter("repairs").create_counter("repairs.batches").add(1, {"batch": str(batch)})
        data = reader.get_metrics_data()
        provider.shutdown()
        assert self.exporter.export(data) is MetricExportResult.SUCCESS
        return {str(batch)}

    @staticmethod
    def keys(line: Dict[str, Any]) -> Set[str]:
        return {attribute["value"]["stringValue"]
                for rm in line["resourceMetrics"] for sm in rm["scopeMetrics"] for metric in sm["metrics"]
                for point in metric["sum"]["dataPoints"] for attribute in point["attributes"]}

    def close(self) -> None:
        self.exporter.shutdown()


OUTPUTS = {"spans": SpanFiles, "metrics": MetricFiles}


def lines_in(data: bytes, keys: Callable[[Dict[str, Any]], Set[str]]) -> List[Set[str]]:
    return [keys(json.loads(line)) for line in data.splitlines()]


def lines_at(path: str, keys: Callable[[Dict[str, Any]], Set[str]]) -> List[Set[str]]:
    with open(path, "rb") as f:
        return lines_in(f.read(), keys)


@pytest.fixture
def output_files(tmp_path, make_pipeline):
    """``output_files(kind, **options)``: the span or metric files under ``tmp_path/trace``."""
    made: List[Any] = []

    def factory(kind: str, **options: Any) -> Any:
        files = OUTPUTS[kind](str(tmp_path / "trace"), make_pipeline, **options)
        made.append(files)
        return files

    yield factory
    for files in made:
        files.close()


@pytest.mark.parametrize("removed", ["trace dir", "output dir"])
@pytest.mark.parametrize("kind", sorted(OUTPUTS))
def test_a_deleted_directory_is_created_again_and_gets_every_later_line(kind, removed, tmp_path, output_files):
    files = output_files(kind)  # the default look-up interval: a deleted file is seen at once
    first = files.write(1)
    path = files.path
    unlinked = os.open(path, os.O_RDONLY)  # the file a cleanup job is about to delete
    try:
        shutil.rmtree(tmp_path / "trace" if removed == "trace dir" else os.path.dirname(path))  # rm -rf
        later = [files.write(2), files.write(3)]
        unlinked_data = os.pread(unlinked, 1 << 20, 0)
    finally:
        os.close(unlinked)
    assert files.path == path  # created again where it was
    assert lines_at(path, files.keys) == later  # none lost
    assert lines_in(unlinked_data, files.keys) == [first]  # none written where no reader looks
    assert dropped() == {} and not [key for key in failures() if key.endswith(".write")]


@pytest.mark.parametrize("kind", sorted(OUTPUTS))
def test_a_renamed_file_keeps_its_lines_and_later_ones_go_to_its_path(kind, output_files):
    files = output_files(kind, reopen_check_s=0.0)  # the path is looked up before every line
    first = files.write(1)
    path = files.path
    os.rename(path, path + ".1")  # logrotate
    later = [files.write(2), files.write(3)]
    assert files.path == path
    assert lines_at(path + ".1", files.keys) == [first]
    assert lines_at(path, files.keys) == later
    # the readers (report, replay) take *.jsonl: the current file, never the rotated one
    assert glob.glob(os.path.join(os.path.dirname(path), "*.jsonl")) == [path]
    assert dropped() == {}


# --------------------------------------------------------------------------- text repaired: OTLP batches


@pytest.fixture(params=[False, True], ids=["slim_spans", "sdk_spans"])
def failed_batch(make_pipeline, request):
    """One export batch in which two spans end with an error whose message holds a lone
    surrogate: an events API tool call, and a span of the user's own code (the SDK's
    span, exception event and all) among the trajectory's others."""
    pipeline = make_pipeline([], sdk_spans=request.param)
    with events.trajectory("u1", "0", step=1, agent_name="tool_agent"):
        with events.llm_call([1, 2, 3]) as turn:
            turn.finish([4], stop_reason="tool_calls")
        with pytest.raises(ValueError):
            with events.tool_call("calc"):
                raise ValueError(f"tool said {LONE}")
        with pytest.raises(ValueError):
            with pipeline.provider.get_tracer("user.agent_loop").start_as_current_span("user step"):
                raise ValueError(f"user code said {LONE}")
    spans = list(pipeline.spans())
    assert sum(not span.status.is_ok for span in spans) == 2
    return spans


def span_ids(spans: List[Any]) -> Set[int]:
    return {span.context.span_id for span in spans}


def assert_repaired_errors(messages: List[str]) -> None:
    """Both error messages are there, their surrogate written as U+FFFD."""
    assert len(messages) == 2
    assert all(FFFD in message and LONE not in message for message in messages)


def test_a_lone_surrogate_in_an_error_message_costs_no_otlp_json_batch(failed_batch, tmp_path):
    exporter = OtlpJsonFileExporter(str(tmp_path / "otlp"))
    assert exporter.export(failed_batch) is SpanExportResult.SUCCESS
    exporter.shutdown()
    written = spans_from_files(str(tmp_path / "otlp"))
    assert {int(span["spanId"], 16) for span in written} == span_ids(failed_batch)
    assert_repaired_errors([span["status"]["message"] for span in written if span["status"]["code"] == 2])
    # the user's span reached the encoder unrepaired: repaired there, and counted
    assert failures().get("otlp_json_file.lone_surrogate", 0) >= 1
    assert dropped() == {}


def request_spans(body: bytes) -> List[Any]:
    request = ExportTraceServiceRequest.FromString(body)
    return [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]


def test_a_lone_surrogate_in_an_error_message_costs_no_protobuf_batch(failed_batch):
    spans = request_spans(ProtobufEncoder().encode(records_of(failed_batch)))
    assert {int.from_bytes(span.span_id, "big") for span in spans} == span_ids(failed_batch)
    assert_repaired_errors([span.status.message for span in spans if span.status.code == 2])
    assert failures().get("otlp.lone_surrogate", 0) >= 1


@pytest.fixture
def otlp_http_receiver():
    """A local OTLP/HTTP receiver answering 200: ``(traces URL, request bodies)``."""
    bodies: List[bytes] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - http.server API
            bodies.append(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", bodies
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("accelerated", ["true", "false"])  # OTEL_VERL_ACCELERATED: its own encoder, the SDK's
def test_a_lone_surrogate_in_an_error_message_costs_no_batch_of_the_otlp_exporter(failed_batch, otlp_http_receiver,
                                                                                   monkeypatch, accelerated):
    url, bodies = otlp_http_receiver
    for name in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_HEADERS",
                 "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_COMPRESSION",
                 "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", url)
    monkeypatch.setenv("OTEL_VERL_ACCELERATED", accelerated)
    exporter = outputs.otlp_exporter(settings.load())  # what a run with an endpoint sends through
    try:
        result = exporter.export(failed_batch)
    finally:
        exporter.shutdown()
    received = [span for body in bodies for span in request_spans(body)]
    assert {int.from_bytes(span.span_id, "big") for span in received} == span_ids(failed_batch)
    assert result is SpanExportResult.SUCCESS
    assert_repaired_errors([span.status.message for span in received if span.status.code == 2])


# --------------------------------------------------------------------------- text repaired and bounded: the JSONL


def trajectory_lines(trace_dir) -> List[str]:
    paths = sorted(glob.glob(os.path.join(str(trace_dir), "trajectory", "*.jsonl")))
    out: List[str] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:  # strict: the file is UTF-8 throughout
            out.extend(f.read().splitlines())
    return out


def run_trajectory(*, decode: Any = None, observation: str = "", metrics: Any = None) -> None:
    """One training trajectory of one turn, with the texts it is given."""
    with events.trajectory("u1", "0", step=1, agent_name="tool_agent", decode=decode):
        with events.llm_call([1, 2, 3]) as turn:
            turn.finish([4, 5], stop_reason="stop")
        if observation:
            events.observation([observation])
        if metrics:
            events.agent_metrics(metrics)


def contract_line(line: str) -> Dict[str, Any]:
    """The line's objects, checked against the contract's keys (``raw_message`` decoded)."""
    top = json.loads(line)
    assert list(top) == ["prompt_uid", "sample_index", "raw_message"]
    rest = json.loads(top["raw_message"])
    assert list(rest) == REST_KEYS
    assert all(list(turn) == TURN_KEYS for turn in rest["turns"])
    return rest


def plain_decode(ids: Any, skip_special_tokens: bool = False) -> str:
    return "".join(chr(ord("a") + int(i) % 26) for i in ids)


@pytest.mark.parametrize("where", ["observation", "agent metric", "decoded text"])
def test_a_lone_surrogate_in_a_trajectory_text_is_written_repaired_and_counted(where, tmp_path, make_pipeline):
    processor = TrajectoryJsonlProcessor(str(tmp_path), discovery_path=None)
    make_pipeline([processor])
    odd = f"text {LONE} here"
    if where == "observation":
        run_trajectory(decode=plain_decode, observation=odd)
    elif where == "agent metric":
        run_trajectory(decode=plain_decode, metrics={"note": odd})
    else:
        run_trajectory(decode=lambda ids, skip_special_tokens=False: odd)
    assert processor.force_flush()
    [line] = trajectory_lines(tmp_path)
    rest = contract_line(line)
    [turn] = rest["turns"]
    found = {"observation": turn["observation_text"], "agent metric": rest["agent_metrics"].get("note"),
             "decoded text": turn["completion_text"]}[where]
    assert found == odd.replace(LONE, FFFD)
    assert failures() == {"trajectory_jsonl.lone_surrogate": 1}  # the line, once
    assert dropped() == {}
    processor.shutdown()


FIFTY_MB = 50 << 20


@pytest.mark.parametrize("where", ["observation", "decoded text"])
def test_a_50_mb_text_makes_a_bounded_line_with_the_contracts_keys(where, tmp_path, make_pipeline):
    processor = TrajectoryJsonlProcessor(str(tmp_path), discovery_path=None)  # the default bound
    assert processor.max_text_chars == settings.DEFAULT_JSONL_MAX_TEXT_CHARS == 1 << 20  # as documented
    make_pipeline([processor])
    huge = "x" * FIFTY_MB
    if where == "observation":
        run_trajectory(decode=plain_decode, observation=huge)
    else:
        run_trajectory(decode=lambda ids, skip_special_tokens=False: huge)
    assert processor.force_flush()
    [line] = trajectory_lines(tmp_path)
    rest = contract_line(line)
    [turn] = rest["turns"]
    texts = [turn["observation_text"], turn["completion_text"], rest["initial_prompt_text"]]
    cut = [text for text in texts if text and len(text) == processor.max_text_chars]
    assert cut and all(text == huge[:processor.max_text_chars] for text in cut)
    assert all(text is None or len(text) <= processor.max_text_chars for text in texts)
    assert len(line) < (len(cut) + 1) * processor.max_text_chars  # bounded by its texts, not by 50 MB
    assert failures() == {"trajectory_jsonl.text_cut": len(cut)}
    assert dropped() == {}
    processor.shutdown()


def test_the_jsonl_text_bound_is_set_by_its_variable(tmp_path, make_pipeline, monkeypatch):
    for module in (progress_log, sample_csv, trajectory_jsonl):  # the node's /tmp discovery files are not ours
        monkeypatch.setattr(module, "write_discovery_file", lambda *args: None)
    cfg = settings.load({"OTEL_VERL_ENABLED": "1", settings.TRACE_DIR: str(tmp_path),
                         settings.JSONL_MAX_TEXT_CHARS: "4096"})
    assert cfg.jsonl_max_text_chars == 4096
    processors = [make() for _, make in legacy.outputs(cfg)]  # as a rollout worker's outputs are built
    try:
        [processor] = [p for p in processors if isinstance(p, TrajectoryJsonlProcessor)]
        make_pipeline([processor])
        run_trajectory(decode=plain_decode, observation="o" * 10_000)
        assert processor.force_flush()
        [turn] = contract_line(trajectory_lines(tmp_path)[0])["turns"]
        assert turn["observation_text"] == "o" * 4096
        assert failures() == {"trajectory_jsonl.text_cut": 1}
    finally:
        for p in processors:
            p.shutdown()


# --------------------------------------------------------------------------- smaller faults


def turn_headers() -> Dict[str, str]:
    """The W3C headers a rollout worker's turn sends with its generate call."""
    with events.trajectory("u1", "0", step=1, agent_name="tool_agent"):
        with events.llm_call([1, 2, 3]) as turn:
            return turn.carrier()


ODD_HEADERS = {  # what a caller may pass -> whether the call is traced
    "int traceparent": (lambda tp: {"traceparent": 5}, False),
    "bytes traceparent": (lambda tp: {"traceparent": tp.encode()}, False),
    "None traceparent": (lambda tp: {"traceparent": None}, False),
    "non-text key": (lambda tp: {5: tp}, False),
    "bytes tracestate": (lambda tp: {"traceparent": tp, "tracestate": b"k=v"}, True),
    "headers as bytes": (lambda tp: tp.encode(), False),
    "headers as an int": (lambda tp: 5, False),
    "a bare traceparent": (lambda tp: tp, True),
}


@pytest.mark.parametrize("case", sorted(ODD_HEADERS))
def test_an_llm_server_call_with_odd_headers_never_raises_into_the_server(case, make_pipeline):
    pipeline = make_pipeline([])
    traceparent = turn_headers()["traceparent"]
    make_headers, traced = ODD_HEADERS[case]
    pipeline.exporter.clear()
    ran = False
    with events.llm_server_call(make_headers(traceparent), request_id="r1", provider="sglang") as call:
        call.record_meta({"e2e_latency": 0.5})
        ran = True
    assert ran
    server_spans = [span for span in pipeline.spans() if span.name == sc.SPAN_LLM_SERVER]
    assert len(server_spans) == (1 if traced else 0)
    for span in server_spans:  # the turn's child, as with well-formed headers
        assert f"{span.parent.span_id:016x}" == traceparent.split("-")[2]


def test_long_uids_sharing_their_first_256_characters_stay_two_samples(tmp_path, make_pipeline, monkeypatch):
    monkeypatch.delenv("DLC_JOB_ID", raising=False)
    csv_processor = SampleCsvProcessor(str(tmp_path), discovery_path=None)
    jsonl_processor = TrajectoryJsonlProcessor(str(tmp_path), discovery_path=None)
    pipeline = make_pipeline([csv_processor, jsonl_processor])
    head = "p" * 256
    uids = [head + "-first", head + "-second"]
    events.samples_created(uids, step=1, trainer="RayPPOTrainer")
    for uid in uids:
        with events.trajectory(uid, "0", step=1, agent_name="tool_agent"):
            with events.llm_call([1]) as turn:
                turn.finish([2], stop_reason="stop")
    events.samples_finished(uids, Outcome.TRAINED)
    assert csv_processor.force_flush() and jsonl_processor.force_flush()

    traces: Dict[str, Set[int]] = {}
    for span in pipeline.spans():
        traces.setdefault(span.attributes[sc.UID], set()).add(span.context.trace_id)
    assert len(traces) == 2 and all(len(ids) == 1 for ids in traces.values())  # one trace each
    assert len(set.union(*traces.values())) == 2  # and two of them
    assert all(len(uid) <= 256 for uid in traces)  # still bounded

    with open(csv_processor.path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    csv_uids = {row[2].rsplit("/", 1)[0] for row in rows}
    assert csv_uids == set(traces)  # two sets of rows, named as the traces are
    for uid in csv_uids:
        assert {"sample", "0"} <= {row[2].rsplit("/", 1)[1] for row in rows if row[2].startswith(uid + "/")}
    assert {json.loads(line)["prompt_uid"] for line in trajectory_lines(tmp_path)} == set(traces)
    csv_processor.shutdown()
    jsonl_processor.shutdown()


# --------------------------------------------------------------------------- the demo's Hydra overrides


def parsed_overrides(overrides: List[str]) -> Dict[str, Any]:
    """``key -> value`` as Hydra's own parser reads the overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return {override.key_or_group: override.value() for override in parsed}


def demo_overrides(base: str) -> List[str]:
    from otel_verl.demo.common import harness_overrides

    return harness_overrides(
        model_dir=os.path.join(base, "tiny model"),
        train_files=os.path.join(base, "data", "train.parquet"),
        val_files=os.path.join(base, "data", "val.parquet"),
        output_dir=os.path.join(base, "out"),
        steps=1, prompts=2, n=2, agent="tool", validate=False, agent_workers=1,
        tool_config_path=os.path.join(base, "tool config.yaml"),
        adv_estimator="gae",  # the critic's paths too
        agent_loop_config_path=os.path.join(base, "agent loops.yaml"),
    )


PATH_KEYS = {
    "actor_rollout_ref.model.path": "tiny model",
    "critic.model.path": "tiny model",
    "critic.model.tokenizer_path": "tiny model",
    "data.train_files": "data/train.parquet",
    "data.val_files": "data/val.parquet",
    "trainer.default_local_dir": "out/checkpoints",
    "trainer.rollout_data_dir": "out/rollout",
    "trainer.validation_data_dir": "out/validation",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": "tool config.yaml",
    "actor_rollout_ref.rollout.agent.agent_loop_config_path": "agent loops.yaml",
}


@pytest.mark.verl
@pytest.mark.parametrize("base", ["/runs/plain", "/runs/my project", "/runs/my project (copy)",
                                  "/runs/it's, [odd]=yes #2", "/runs/~backup dir"])
def test_demo_paths_with_spaces_reach_hydra_intact(base):
    # Hydra reads a bare value with spaces alone, but not with the parentheses, quotes,
    # commas or tilde a copied or user-named directory brings along: quoted, every one is
    pytest.importorskip("hydra")
    values = parsed_overrides(demo_overrides(base))
    assert {key: values[key] for key in PATH_KEYS} == {key: os.path.join(base, tail) for key, tail in PATH_KEYS.items()}


@pytest.mark.verl
def test_demo_paths_with_backslashes_reach_hydra_intact():
    pytest.importorskip("hydra")
    base = "/runs/back\\slash dir"
    values = parsed_overrides(demo_overrides(base))
    assert values["actor_rollout_ref.model.path"] == os.path.join(base, "tiny model")
