"""The report's sections as SQL on the store (``otel_verl/tools/store/report.py``) equal
the reference report's (tests/reference_report.py) on the same spans; ``--steps`` selects steps; a store of several
runs asks which."""

from __future__ import annotations

import json
import os

import pytest

from otel_verl.tools.report import InputError
from reference_report import build
from otel_verl.tools.report.inputs import resolve
from otel_verl.tools.store import report as store_report
from store_checks import rounded
from otlp_runs import async_run, straggler_run

pytest.importorskip("clickhouse_connect")


def same_sections(sql, memory):
    for key in ("stage_order", "steps", "stage_overlap", "rollout_latency", "trajectories", "slowest_trajectories",
                "tail", "samples", "losses", "timeline", "shape", "runs", "trainer"):
        assert rounded(sql[key]) == rounded(memory[key]), key


@pytest.fixture()
def stores(opened_store):
    return lambda path: opened_store(path)[0]


@pytest.mark.parametrize("make", [straggler_run, lambda: straggler_run(extra_step=True, lineage=False), async_run],
                         ids=["sync", "three-steps", "async"])
def test_the_sql_sections_equal_the_reference_report(tmp_path, stores, make):
    trace_dir = make().write(str(tmp_path / "run"))
    store = stores(trace_dir)
    same_sections(store_report.build(store, timeline=True, inputs=resolve([trace_dir])), build([trace_dir]))


def test_steps_select_the_steps_and_their_trajectories(tmp_path, stores):
    trace_dir = straggler_run(extra_step=True).write(str(tmp_path / "run"))
    memory = build([trace_dir])
    sql = store_report.build(stores(trace_dir), steps=(2, 3))
    assert [r["step"] for r in sql["steps"]] == [2, 3]
    assert rounded(sql["steps"]) == rounded([r for r in memory["steps"] if r["step"] in (2, 3)])
    assert rounded(sql["rollout_latency"]) == rounded([r for r in memory["rollout_latency"] if r["step"] in (2, 3)])
    assert {k: sql["samples"][k] for k in ("roots", "outcomes")} == {"roots": 4, "outcomes": {"trained": 4}}  # u3/u4 of steps 2 and 3, not u1, u2


def test_a_store_of_two_runs_asks_which(tmp_path, stores):
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    async_run().write(str(tmp_path / "other"))
    import shutil
    shutil.copy(str(tmp_path / "other" / "otlp" / "spans.jsonl"), str(tmp_path / "run" / "otlp" / "other.jsonl"))
    store = stores(trace_dir)
    with pytest.raises(InputError, match=r"holds 2 runs \(async-run, sync-run\): pick one with --run ID"):
        store_report.build(store)
    assert store_report.build(store, run_id="async-run")["shape"]["trainer"] == "PPOTrainerV1"
    with pytest.raises(InputError, match="no run 'nope'"):
        store_report.build(store, run_id="nope")


@pytest.mark.parametrize("text, expected", [("3", (3, 3)), ("2-5", (2, 5))])
def test_steps_parse(text, expected):
    assert store_report.parse_steps(text) == expected


@pytest.mark.parametrize("text", ["x", "5-2", "1-", "-1"])
def test_steps_that_are_no_range_are_refused(text):
    with pytest.raises(ValueError, match="--steps"):
        store_report.parse_steps(text)


def otel_verl(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "otel_verl.tools.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_report_steps_prints_those_steps(tmp_path):
    trace_dir = straggler_run(extra_step=True).write(str(tmp_path / "run"))
    text = otel_verl("report", trace_dir, "--steps", "2-3")
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[0].endswith(" line(s); run sync-run; trainer RayPPOTrainer; steps 2-3")
    rows = [line.split()[0] for line in text.stdout.splitlines()[1:] if line[:1].isdigit()]
    assert rows[:4] == ["2", "3", "2", "3"]  # the steps table, then rollout latency
    assert "u3-2/1        2   1.500" in text.stdout  # the slowest trajectories of those steps
    assert "Critical path per step" in text.stdout and "Legacy files vs spans" in text.stdout
    data = json.loads(otel_verl("report", trace_dir, "--steps", "3", "--json").stdout)
    assert [r["step"] for r in data["steps"]] == [3] and data["selected_steps"] == [3, 3]


@pytest.mark.parametrize("args, needle", [
    (("--steps", "3-1"), "Invalid value for --steps: expected A <= B"),
    (("--compare", "--run", "sync-run"), "--compare takes two runs, A and B (got 1 path(s))"),
    (("--run", "nope"), "no run 'nope' in the store (it holds sync-run)"),
])
def test_report_from_the_store_refuses_what_it_cannot_do_in_one_line(tmp_path, args, needle):
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    proc = otel_verl("report", trace_dir, *args)
    assert proc.returncode in (1, 2) and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_report_steps_png_draws_those_steps(tmp_path):
    pytest.importorskip("matplotlib")

    trace_dir = straggler_run(extra_step=True).write(str(tmp_path / "run"))
    png = str(tmp_path / "steps.png")
    proc = otel_verl("report", trace_dir, "--steps", "2-3", "--png", png, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [r["step"] for r in data["png"]["rows"]] == [2, 3] and os.path.getsize(png) > 0
    assert [r["step"] for r in data["timeline"]] == [2, 3]


def test_compare_from_the_store_equals_the_reference_comparison(tmp_path):
    from otel_verl.tools.report import compare

    a = straggler_run(extra_step=True).write(str(tmp_path / "a"))
    b = straggler_run(scale=2.0, run_id="slow").write(str(tmp_path / "b"))
    memory = json.loads(json.dumps(compare.compare(build([a]), build([b]))))
    for selected in ((), ("--steps", "0-99")):
        sql = otel_verl("report", "--compare", a, b, "--json", *selected)
        assert sql.returncode == 0, sql.stderr
        assert rounded(json.loads(sql.stdout)) == rounded(memory)
    narrow = json.loads(otel_verl("report", "--compare", a, b, "--json", "--steps", "2").stdout)
    assert [r["step"] for r in narrow["steps"]] == [2] and narrow["steps"][0]["ratio"] == pytest.approx(2.0)


def test_two_runs_of_one_store_compare(tmp_path, stores):
    import shutil

    from otel_verl.tools.report import compare

    trace_dir = straggler_run().write(str(tmp_path / "run"))
    straggler_run(scale=3.0, run_id="slow").write(str(tmp_path / "other"))
    shutil.copy(str(tmp_path / "other" / "otlp" / "spans.jsonl"), str(tmp_path / "run" / "otlp" / "other.jsonl"))
    store = stores(trace_dir)
    inputs = {"paths": [trace_dir], "truncated_files": [], "repaired_files": [], "skipped_files": []}
    sides = [{**store_report.build(store, run_id=run), "inputs": inputs} for run in ("sync-run", "slow")]
    result = compare.compare(*sides)
    assert [(r["step"], r["ratio"]) for r in rounded(result["steps"])] == [(1, 3.0), (2, 3.0)]
    assert (result["a"]["runs"], result["b"]["runs"]) == (["sync-run"], ["slow"])
    store.close()
    proc = otel_verl("report", trace_dir, "--compare", "--run", "sync-run", "--run", "slow", "--json")
    assert proc.returncode == 0, proc.stderr
    cli = json.loads(proc.stdout)
    assert [(r["step"], r["ratio"]) for r in rounded(cli["steps"])] == [(1, 3.0), (2, 3.0)]
    assert (cli["a"]["runs"], cli["b"]["runs"]) == (["sync-run"], ["slow"])


# --------------------------------------------------------------------------- --perfetto of some steps


def test_text_reads_back_as_the_value_it_reads_as():
    from otel_verl.tools.store.spans import value

    assert [value(t) for t in ("3", "-2", "0.5", "true", "false", "u1", "007", "", "[\"0\",\"x\"]", "[1,2]", "1e3")] == [
        3, -2, 0.5, True, False, "u1", "007", "", [0, "x"], [1, 2], 1000.0]


def _selected_like_the_store(spans, steps):
    """The spans of those steps, and the step-less spans of their traces (store/spans.py)."""
    from otel_verl import semconv as sc

    in_steps = [s for s in spans if isinstance(s["attributes"].get(sc.GLOBAL_STEP), int)
                and steps[0] <= s["attributes"][sc.GLOBAL_STEP] <= steps[1]]
    traces = {s["traceId"] for s in in_steps}
    return in_steps + [s for s in spans if sc.GLOBAL_STEP not in s["attributes"] and s["traceId"] in traces]


@pytest.mark.parametrize("make, steps", [(lambda: straggler_run(extra_step=True), (2, 2)), (async_run, (1, 1))],
                         ids=["sync-step-2", "async-step-1"])
def test_a_steps_perfetto_trace_is_the_one_of_its_spans(tmp_path, stores, make, steps):
    from otel_verl.exporters.otlp_json_file import spans_from_files
    from otel_verl.tools.report import perfetto
    from otel_verl.tools.store import spans as store_spans

    needs_perfetto()
    trace_dir = make().write(str(tmp_path / "run"))
    store = stores(trace_dir)
    from_store = store_spans.of_steps(store, store_report.pick_run(store, None), steps)
    expected = _selected_like_the_store(spans_from_files([trace_dir + "/otlp"]), steps)
    assert sorted((s["traceId"], s["spanId"]) for s in from_store) == sorted((s["traceId"], s["spanId"]) for s in expected)
    a = perfetto.write_spans(from_store, str(tmp_path / "store.pftrace")).as_dict()
    b = perfetto.write_spans(expected, str(tmp_path / "files.pftrace")).as_dict()
    for d in (a, b):
        d.pop("path"), d.pop("bytes")
    assert a == b and a["slices"] == len(expected)


def needs_perfetto():
    from otel_verl.tools.report import perfetto

    try:
        perfetto.require_perfetto()
    except perfetto.PerfettoMissing as exc:  # the lowest-versions venv: protobuf older than perfetto's code
        pytest.skip(str(exc))


def test_report_steps_perfetto_writes_those_steps(tmp_path):
    needs_perfetto()
    trace_dir = straggler_run(extra_step=True).write(str(tmp_path / "run"))
    out = tmp_path / "step2.pftrace"
    proc = otel_verl("report", trace_dir, "--steps", "2", "--perfetto", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"perfetto: {out} (" in proc.stdout and "20 slices of 20 spans" in proc.stdout and out.stat().st_size > 0
    proc = otel_verl("report", trace_dir, "--steps", "9", "--perfetto", str(tmp_path / "none.pftrace"))
    assert proc.returncode == 1 and "--perfetto: no spans of step 9 in the store" in proc.stderr
