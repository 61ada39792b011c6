"""``otel-verl report`` on files written here (the demo-based report tests are in test_cli)."""

from __future__ import annotations

import glob
import json

from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from otel_verl import events, health, outputs
from otel_verl.exporters import metrics as m
from otel_verl.exporters.otlp_json_file import OtlpJsonFileExporter
from otel_verl.exporters.otlp_json_metrics import OtlpJsonMetricFileExporter
from store_checks import report_of
from otel_verl.tools.report.inputs import read_counters
from otlp_runs import straggler_run


def _traced_process(make_pipeline, trace_dir, instance: str, losses) -> None:
    """One process of a run writing spans and metric files into ``trace_dir``, where the
    configurator puts them; ``losses()`` counts its losses between two collections of its
    metrics."""
    metrics = m.SpanMetricsProcessor(lambda: [OtlpJsonMetricFileExporter(str(trace_dir / outputs.METRICS_FILES_DIR))])
    spans = SimpleSpanProcessor(OtlpJsonFileExporter(str(trace_dir / "otlp")))
    pipeline = make_pipeline([metrics, spans], resource={"service.instance.id": instance})
    health.reset()
    with events.trajectory(f"uid-{instance}", "0", step=1, agent_name="a"):
        pass
    assert metrics.force_flush()  # a first collection, before the losses
    losses()
    pipeline.close()  # the last collection


def test_the_report_sums_each_processes_last_loss_counters(make_pipeline, tmp_path):
    trace_dir = tmp_path / "trace"

    def first():
        health.record_dropped("otlp", 3, "test")
        health.record_failure("events.trajectory", RuntimeError("x"))
        health.record_dropped("otlp", 2, "test")

    _traced_process(make_pipeline, trace_dir, "process-a", first)
    _traced_process(make_pipeline, trace_dir, "process-b", lambda: health.record_dropped("otlp", 1, "test"))
    files = sorted(glob.glob(str(trace_dir / outputs.METRICS_FILES_DIR / "*.jsonl")))
    with open(files[0], "a", encoding="utf-8") as f:  # a torn last line: a process killed mid-write
        f.write(json.dumps({"resourceMetrics": []})[:10])

    counters, processes = read_counters(files, (m.DROPPED, m.FAILURES))
    assert processes == 2
    assert counters == {m.DROPPED: {("otlp",): 6}, m.FAILURES: {("events.trajectory",): 1}}
    losses = report_of([str(trace_dir)])["losses"]
    assert losses["recorded"] == {"dropped": {"otlp": 6}, "failures": {"events.trajectory": 1}}
    assert losses["note"] == "dropped otlp=6; failures events.trajectory=1 (the metric files of 2 processes)"


def test_without_metric_files_the_report_says_none_recorded(make_pipeline, tmp_path):
    make_pipeline([SimpleSpanProcessor(OtlpJsonFileExporter(str(tmp_path / "otlp")))])
    with events.trajectory("uid", "0", step=1, agent_name="a"):
        pass
    losses = report_of([str(tmp_path)])["losses"]
    assert losses["recorded"] is None and losses["note"].startswith("none recorded: no loss or metric files")


def test_a_trajectory_still_running_at_the_end_is_no_lost_span(make_pipeline, tmp_path, monkeypatch):
    """Its start row is written, its span and its end lines are not: the report says it
    never finished, where fewer spans than end lines would mean spans lost."""
    from otel_verl import settings

    pipeline = make_pipeline(outputs.build(settings.load({settings.TRACE_DIR: str(tmp_path)})))
    with events.trajectory("uid-1", "0", step=1, agent_name="tool_agent"):
        pass
    running = events.trajectory("uid-1", "1", step=1, agent_name="tool_agent")
    running.__enter__()
    try:
        assert pipeline.provider.force_flush()
        checks = report_of([str(tmp_path)])["losses"]["consistency"]
    finally:
        running.__exit__(None, None, None)
    assert [(c["legacy"], c["trajectory_spans"], c["verdict"]) for c in checks] == [
        (1, 1, "consistent"), (1, 1, "consistent"),
        (2, 1, "1 started and never finished: running when the run ended, or their process died")]


def _collector_run_dir(trace_dir) -> str:
    """What a run with an OTLP endpoint leaves in its trace dir: the legacy files (here a
    progress log of two finished trajectories) and a loss file; no spans, no metric files."""
    from otel_verl.exporters.loss_file import LossFileProcessor

    LossFileProcessor(str(trace_dir), {"verl.role": "trainer", "verl.run_id": "run-7"}).shutdown()
    (trace_dir / "progress").mkdir()
    (trace_dir / "progress" / "progress.log").write_text(
        "Task u1/0 is completed, reward 1.0\nTask u1/1 is completed, reward 0.0\n", encoding="utf-8")
    return str(trace_dir)


def test_a_trace_dir_whose_spans_went_to_a_collector_says_where_they_are(tmp_path):
    from click.testing import CliRunner

    from otel_verl.tools.cli import main

    trace_dir = _collector_run_dir(tmp_path)
    report = report_of([trace_dir])
    assert report["no_spans"]["reason"] == "collector" and report["runs"] == ["run-7"]
    assert "`otel-verl report --clickhouse URL --run run-7`" in report["no_spans"]["line"]
    # no verdict on spans that are elsewhere: the legacy lines are not "spans lost"
    assert report["losses"]["consistency"] == []
    result = CliRunner().invoke(main, ["report", trace_dir])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert text.startswith(f"no spans in {trace_dir}: the run sent them over OTLP to a collector")
    assert "Loss counters: dropped none; failures none" in text
    for empty in ("Steps (s)", "Rollout latency", "Slowest trajectories", "Critical path", "Samples:",
                  "Legacy files vs spans", "spans lost", "SDK span-limit drops"):
        assert empty not in text, empty


def test_a_trace_dir_with_metric_files_and_no_span_files_says_they_are_missing(tmp_path):
    trace_dir = _collector_run_dir(tmp_path)
    (tmp_path / outputs.METRICS_FILES_DIR).mkdir()
    (tmp_path / outputs.METRICS_FILES_DIR / "metrics.jsonl").write_text('{"resourceMetrics": []}\n', encoding="utf-8")
    report = report_of([trace_dir])
    assert report["no_spans"]["reason"] == "span files missing"
    assert "no otlp/ span files" in report["no_spans"]["line"] and report["losses"]["consistency"] == []
    spans = straggler_run().write(str(tmp_path / "with-spans"))
    assert report_of([spans])["no_spans"] is None


def test_a_trace_dir_whose_spans_went_to_a_collector_still_reports_its_losses(tmp_path):
    """With an endpoint set a trace dir holds the legacy files and the loss files, no spans:
    the report still shows what each process lost (OTLP's losses above all)."""
    from otel_verl.exporters.loss_file import LossFileProcessor
    from otel_verl.tools.report import InputError

    health.record_dropped("otlp", 7, "the collector refused")
    LossFileProcessor(str(tmp_path), {"verl.role": "trainer"}).shutdown()
    report = report_of([str(tmp_path)])
    assert report["inputs"]["spans"] == 0
    assert report["losses"]["recorded"] == {"dropped": {"otlp": 7}, "failures": {}}
    empty = tmp_path / "empty"
    empty.mkdir()
    try:
        report_of([str(empty)])
    except InputError as exc:
        assert "no OTLP-JSON files" in str(exc)
    else:
        raise AssertionError("a directory with nothing to read is an error")
