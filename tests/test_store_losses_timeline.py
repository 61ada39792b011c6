"""The report's ``losses`` and ``timeline`` from the span store (``otel_verl/tools/store/
losses.py``, ``timeline.py``) equal the reference report's (tests/reference_report.py) on the same trace dir: legacy
files that disagree with the spans, SDK span-limit drops, a torn last line, a step range,
stages that ran at once, a step without its ``verl.step`` span."""

from __future__ import annotations

import json
import os

import pytest

from otel_verl import semconv as sc
from reference_report import build
from otel_verl.tools.store import losses, timeline
from otel_verl.tools.store.report import pick_run
from store_checks import rounded
from otlp_runs import WORKER, Run, async_run, straggler_run

pytest.importorskip("clickhouse_connect")


@pytest.fixture()
def stores(opened_store):
    """``stores(trace_dir)`` -> (store, load, inputs, run)."""
    def open_(path):
        store, load, inputs = opened_store(path)
        return store, load, inputs, pick_run(store, None)

    return open_


def sections(opened, steps=None):
    store, load, inputs, run = opened
    return (losses.build(store, run, inputs=inputs, load=load), timeline.build(store, run, steps))


def same_as_in_memory(trace_dir, opened):
    memory = build([trace_dir])
    sql_losses, sql_timeline = sections(opened)
    assert sql_losses == memory["losses"]
    assert rounded(sql_timeline) == rounded(memory["timeline"])
    return memory


def overlapping_run() -> Run:
    """Step 1: generation [0, 8] beside fetch_batch [1, 3] and update_actor [3, 6] (two lanes),
    a validation trajectory (not on the timeline); step 2: stages without a verl.step span
    (it starts at its first stage, 11)."""
    run = Run("overlap-run", trainer="PPOTrainerV1", layout="disaggregated")
    run.fit(prompts=1, n=2, steps=2)
    run.step(1, 0, 10, [("generation", 0, 8), ("fetch_batch", 1, 3), ("update_actor", 3, 6), ("sync_params", 8, 9)])
    root = run.sample("s1", 0, 9, trained_in=1)
    run.trajectory(root, "0", 1, 0.5, 4)
    run.trajectory(root, "1", 1, 0.2, 5)
    run.span(sc.agent_span_name("tool_agent"), 1, 2, {sc.UID: "v1", sc.TRAJ_UID: "0", sc.GLOBAL_STEP: 1, sc.VALIDATE: True,
                                                      sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT}, resource=WORKER)
    for stage, lo, hi in (("fetch_batch", 11, 12), ("update_actor", 12, 14)):
        run.span(sc.step_stage_span_name(stage), lo, hi, {sc.GLOBAL_STEP: 2, sc.STAGE: stage})
    return run


@pytest.mark.parametrize("make", [straggler_run, lambda: straggler_run(extra_step=True, lineage=False), async_run,
                                  overlapping_run, lambda: straggler_run(run_id="")],
                         ids=["sync", "three-steps", "async", "overlapping-stages", "no-run-id"])
def test_losses_and_timeline_equal_the_in_memory_report(tmp_path, stores, make):
    trace_dir = make().write(str(tmp_path / "run"))
    same_as_in_memory(trace_dir, stores(trace_dir))


def test_concurrent_stages_get_lanes_and_a_step_without_its_span_starts_at_its_first_stage(tmp_path, stores):
    trace_dir = overlapping_run().write(str(tmp_path / "run"))
    store, _, _, run = stores(trace_dir)
    first, second = timeline.build(store, run)
    assert [(b["stage"], b["lane"]) for b in first["stages"]] == [
        ("generation", 0), ("fetch_batch", 1), ("update_actor", 1), ("sync_params", 0)]
    assert [b["start_s"] for b in first["trajectories"]] == [0.2, 0.5]  # by start; no validation trajectory
    assert second == {"step": 2, "stages": [{"stage": "fetch_batch", "start_s": 0.0, "duration_s": 1.0, "lane": 0},
                                            {"stage": "update_actor", "start_s": 1.0, "duration_s": 2.0, "lane": 0}],
                      "trajectories": []}


def test_a_step_range_selects_the_timeline_and_keeps_the_losses_whole_run(tmp_path, stores):
    trace_dir = straggler_run(extra_step=True).write(str(tmp_path / "run"))
    memory = build([trace_dir])
    opened = stores(trace_dir)
    sql_losses, sql_timeline = sections(opened, steps=(2, 3))
    assert [row["step"] for row in sql_timeline] == [2, 3]
    assert rounded(sql_timeline) == rounded([row for row in memory["timeline"] if row["step"] in (2, 3)])
    assert sql_losses == memory["losses"]
    assert list(timeline.rows(opened[0], opened[3], (7, 9))) == []  # no such steps: an empty selection


def write_legacy(trace_dir, progress: int, jsonl: int, started: int) -> None:
    """Legacy files beside the spans: ``progress`` 'Task ... is completed' lines, ``jsonl``
    trajectory lines, ``started`` sample-flow CSV trajectory start rows."""
    for part, name, lines in (
        ("progress", "progress.log", [f"Task u{i}/0 is completed, score=1.0 status=Finished" for i in range(progress)]),
        ("trajectory", "trajectory.jsonl", [json.dumps({"uid": f"u{i}", "traj_uid": "0"}) for i in range(jsonl)]),
        ("sample", "sample.csv", [f"job,sample,u{i}/0,RUNNING,1700000000000,from=AgentLoopWorker|to=AgentLoop(tool_agent)"
                                  f"|stage=AGENT_LOOP|global_step=1|detail=agent_task_started" for i in range(started)]),
    ):
        os.makedirs(os.path.join(trace_dir, part), exist_ok=True)
        with open(os.path.join(trace_dir, part, name), "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))


@pytest.mark.parametrize("counts, verdicts", [
    ((8, 8, 8), ["consistent"] * 3),
    ((8, 7, 9), ["consistent", "more spans than legacy lines: legacy lines lost (or files from another run)",
                 "fewer spans than legacy lines: OTLP sampling on, or spans lost"]),
    ((8, 8, 10), ["consistent", "consistent",
                  "2 started and never finished: running when the run ended, or their process died"]),
], ids=["agree", "a-jsonl-line-lost", "still-running"])
def test_legacy_files_against_the_spans(tmp_path, stores, counts, verdicts):
    trace_dir = straggler_run().write(str(tmp_path / "run"))  # 8 training trajectories
    write_legacy(trace_dir, *counts)
    memory = same_as_in_memory(trace_dir, stores(trace_dir))
    checks = memory["losses"]["consistency"]
    assert [(c["legacy"], c["trajectory_spans"], c["verdict"]) for c in checks] == [
        (n, 8, verdict) for n, verdict in zip(counts, verdicts)]


def test_span_limit_drops_a_torn_last_line_and_loss_files(tmp_path, stores):
    from otel_verl.exporters.loss_file import LossFileProcessor

    run = straggler_run()
    spans = [span for _, of_process in run.spans.values() for span in of_process]
    spans[0]["droppedAttributesCount"] = 3
    spans[1].update(droppedAttributesCount=2, droppedEventsCount=5, droppedLinksCount=1)
    trace_dir = run.write(str(tmp_path / "run"))
    with open(os.path.join(trace_dir, "otlp", "spans.jsonl"), "a", encoding="utf-8") as f:
        f.write('{"resourceSpans": [{"resource"')  # a process killed mid-write
    LossFileProcessor(trace_dir, {"verl.role": "trainer", "verl.run_id": run.run_id}).shutdown()
    opened = stores(trace_dir)
    memory = same_as_in_memory(trace_dir, opened)
    assert memory["losses"]["span_limit_drops"] == {"attributes": 5, "events": 5, "links": 1}
    assert memory["losses"]["truncated_lines"] == 1
    assert memory["losses"]["note"].endswith("(the loss files of 1 process)")
    # a second open loads nothing new: the same figures (the torn line still waits)
    assert sections(stores(trace_dir))[0] == memory["losses"]


def test_a_store_without_its_files_says_none_recorded(tmp_path, stores):
    """A server's store: no inputs, no load (the Collector filled it)."""
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    store, _, _, run = stores(trace_dir)
    section = losses.build(store, run)
    assert section["recorded"] is None and section["note"].startswith("none recorded")
    assert section["consistency"] == [] and section["truncated_lines"] == 0
