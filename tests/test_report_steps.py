"""The steps of ``otel-verl report`` when stages run at once (v1's ``generation`` beside
``fetch_batch``): each stage keeps its own time, the step's sums use their union, and the
table, the timeline and ``--compare`` say which stages were concurrent."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from otel_verl.tools.cli import main
from otel_verl.tools.report import timeline
from store_checks import report_of
from otel_verl.tools.report.compare import compare

from otlp_runs import Run, async_run, straggler_run

exact = lambda value: pytest.approx(value, abs=1e-9)  # noqa: E731  (times are whole nanoseconds)


def overlapping_run() -> Run:
    """Step 1 [0, 2.5]: generation [0, 2.0] and fetch_batch [0.1, 2.3] at once, then
    update_actor [2.3, 2.4]; step 2 [2.5, 3.5] one stage after another."""
    run = Run("overlap", trainer="PPOTrainerV1")
    run.step(1, 0, 2.5, [("generation", 0, 2.0), ("fetch_batch", 0.1, 2.3), ("update_actor", 2.3, 2.4)])
    run.step(2, 2.5, 3.5, [("generation", 2.5, 2.8), ("update_actor", 2.8, 3.4)])
    return run


def _table(stdout: str, title: str) -> list:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next((i for i in range(start + 3, len(lines)) if not lines[i].strip()), len(lines))
    return [line.split() for line in lines[start + 3:end]]


def test_concurrent_stages_keep_their_own_time_and_the_step_their_union(tmp_path):
    report = report_of([overlapping_run().write(str(tmp_path / "run"))])
    step, _ = report["steps"]
    one, two = report["stage_overlap"]
    assert step["stages"] == {"generation": exact(2.0), "fetch_batch": exact(2.2), "update_actor": exact(0.1)}
    assert one["stages_union_s"] == exact(2.4) and step["other_s"] == exact(0.1)
    # the stages' own times add to 4.3 s in a 2.5 s step: 1.9 s of them ran beside another
    assert one["concurrent_s"] == exact(1.9)
    assert one["concurrent_stages"] == ["fetch_batch", "generation"]  # in the stage order
    assert sum(step["stages"].values()) - one["concurrent_s"] + step["other_s"] == exact(step["duration_s"])
    assert (two["step"], two["concurrent_stages"], two["concurrent_s"]) == (2, [], exact(0.0))
    assert two["stages_union_s"] == exact(0.9)


def test_a_stage_run_twice_one_after_the_other_is_not_concurrent(tmp_path):
    report = report_of([async_run().write(str(tmp_path / "run"))])
    [step], [overlap] = report["steps"], report["stage_overlap"]
    assert step["stages"]["fetch_batch"] == exact(3.0)  # [1, 3] and [6, 7]
    assert overlap["concurrent_stages"] == [] and overlap["concurrent_s"] == exact(0.0)


def test_the_table_marks_concurrent_stages_and_reconciles_the_step(tmp_path):
    path = overlapping_run().write(str(tmp_path / "run"))
    result = CliRunner().invoke(main, ["report", path])
    assert result.exit_code == 0, result.output
    rows = _table(result.stdout, "Steps (s)")
    assert rows[:2] == [
        ["1", "2.500", "2.200*", "2.000*", "0.100", "0.100", "1.900"],
        ["2", "1.000", "-", "0.300", "0.600", "0.100", "0.000"],
    ]
    assert " ".join(rows[2]).startswith("* ran while another stage ran")  # the line under the table

    sync = CliRunner().invoke(main, ["report", straggler_run().write(str(tmp_path / "sync"))])
    assert sync.exit_code == 0, sync.output
    assert "concurrent" not in sync.stdout and "ran while another stage ran" not in sync.stdout


def test_the_timeline_draws_concurrent_stages_in_lanes_of_their_own(tmp_path):
    report = report_of([overlapping_run().write(str(tmp_path / "run"))], timeline=True)
    one, two = report["timeline"]
    assert [(b["stage"], b["lane"]) for b in one["stages"]] == [("generation", 0), ("fetch_batch", 1), ("update_actor", 0)]
    assert [b["lane"] for b in two["stages"]] == [0, 0]
    assert [row["stage_lanes"] for row in timeline.layout(report)["rows"]] == [2, 1]


def test_compare_marks_the_stages_that_ran_at_once(tmp_path):
    a = overlapping_run().write(str(tmp_path / "a"))
    b = overlapping_run().write(str(tmp_path / "b"))
    result = compare(report_of([a]), report_of([b]))
    assert {r["stage"]: r["concurrent"] for r in result["stages"]} == {
        "generation": True, "fetch_batch": True, "update_actor": False, "other": False}
    text = CliRunner().invoke(main, ["report", "--compare", a, b])
    assert text.exit_code == 0, text.output
    rows = _table(text.stdout, "Stages (s) summed")
    assert [row[0] for row in rows[:4]] == ["fetch_batch*", "generation*", "update_actor", "other"]
    assert " ".join(rows[4]).startswith("* ran while another stage ran")
