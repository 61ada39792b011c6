"""The outputs layer: the declared contract, what the settings build, and a new output
that reads span starts and ends, in-process and via the export process, named only by
``OTEL_VERL_OUTPUTS``."""

from __future__ import annotations

import json
import os

import pytest

import fault_workload as w
from otel_verl import health, outputs, settings
from otel_verl.semconv import Subject

TOY = "toy_output:ToyOutput"


def _every_output(tmp_path, monkeypatch):
    for name in ("OTEL_METRICS_EXPORTER", settings.OTLP_ENDPOINT, settings.OTLP_TRACES_ENDPOINT,
                 "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(w.TESTS_DIR)
    return settings.load({settings.TRACE_DIR: str(tmp_path), settings.OUTPUTS: TOY})


def test_every_output_keeps_the_contract_and_the_subjects_are_their_declarations(tmp_path, monkeypatch):
    cfg = _every_output(tmp_path, monkeypatch)
    built = outputs.build(cfg)
    try:
        names = [type(output).__name__ for output in built]
        assert names == ["ProgressLogProcessor", "SampleCsvProcessor", "TrajectoryJsonlProcessor",
                         "BatchExportProcessor", "SpanMetricsProcessor", "ToyOutput", "LossFileProcessor"]
        for output in built:
            assert isinstance(output, outputs.Output), type(output).__name__
        assert outputs.starts_read(cfg) == frozenset().union(*(o.on_start_subjects for o in built))
        assert Subject.TOOL in outputs.starts_read(cfg)
        assert outputs.ends_read(cfg) is None  # the OTLP-JSON files read every span
    finally:
        for output in built:
            output.shutdown()
    no_toy = settings.load({settings.TRACE_DIR: str(tmp_path)})
    assert Subject.TOOL not in outputs.starts_read(no_toy)


def test_a_name_that_is_no_output_is_refused_where_typed_and_left_out_in_a_run(tmp_path, monkeypatch):
    with pytest.raises(settings.ConfigError, match="module:Class"):
        settings.load({settings.OUTPUTS: "toy_output.ToyOutput"}, strict=True)
    cfg = settings.load({settings.TRACE_DIR: str(tmp_path), settings.OTLP_FILE: "0",
                         settings.OUTPUTS: "json:JSONDecoder,no_such_module:Output"})
    before = health.snapshot()["failures"].get("outputs.import", 0)
    built = outputs.build(cfg)
    try:
        assert [type(o).__name__ for o in built] == ["ProgressLogProcessor", "SampleCsvProcessor",
                                                     "TrajectoryJsonlProcessor", "LossFileProcessor"]
        assert health.snapshot()["failures"]["outputs.import"] == before + 2
    finally:
        for output in built:
            output.shutdown()
    with pytest.raises(TypeError, match="lacks"):
        outputs.named_class("json:JSONDecoder")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("offload", ["0", "1"], ids=["in_process", "export_process"])
def test_a_new_output_gets_the_starts_and_ends_it_declares(offload, tmp_path):
    """Named in the settings only: bootstrap, the events API and the export process are
    as they are. Via the export process, its tool-span starts are sent because it reads
    them (no built-in output does)."""
    trace_dir = tmp_path / "trace"
    code = """
    import os, otel_verl, fault_workload as w
    from otel_verl import health
    assert otel_verl.configure()
    w.emit(1, w.new_uids(2), 2)
    otel_verl.shutdown()
    print("PID", os.getpid())
    w.print_result({"health": health.snapshot()})
    """
    env = {settings.TRACE_DIR: str(trace_dir), settings.OUTPUTS: TOY, settings.OFFLOAD: offload,
           settings.OTLP_FILE: "0", "OTEL_METRICS_EXPORTER": "none"}
    stdout = w.run_python(code, env).stdout
    assert w.parse_result(stdout)["health"] == {"dropped": {}, "failures": {}}
    traced_pid = int(stdout.split("PID ")[-1].split()[0])
    files = sorted(p for p in os.listdir(trace_dir) if p.startswith("toy-"))
    assert len(files) == 1
    written_by = int(files[0][len("toy-"):-len(".jsonl")])
    assert (written_by == traced_pid) == (offload == "0")
    lines = [json.loads(line) for line in (trace_dir / files[0]).read_text().splitlines()]
    starts = [line for line in lines if line["event"] == "start"]
    ends = [line for line in lines if line["event"] == "end"]
    assert len(starts) == len(ends) == 4  # 2 uids x 2 trajectories, a tool call each
    assert {line["subject"] for line in lines} == {"tool"}
    assert not any(line["ended"] for line in starts) and all(line["ended"] for line in ends)
    assert {line["name"] for line in lines} == {"execute_tool calculator"}
