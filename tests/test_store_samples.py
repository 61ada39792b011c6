"""The ``samples`` section from the store (``otel_verl/tools/store/samples.py``) equals the
reference report's (tests/reference_report.py): roots by outcome, the sample-flow CSV's uids, the unfinished samples;
``--steps`` selects the samples of those steps."""

from __future__ import annotations

import os

import pytest

from otel_verl import semconv as sc
from reference_report import build
from otel_verl.tools.store import samples
from otlp_runs import WORKER, async_run, straggler_run

pytest.importorskip("clickhouse_connect")

JOB = "ENV_NOTFOUND_DLC_JOB_ID"


@pytest.fixture()
def stores(opened_store):
    """``stores(trace_dir)`` -> (store, inputs)."""
    def open_(path):
        store, _, inputs = opened_store(path)
        return store, inputs

    return open_


def ms(seconds: float) -> int:
    return 1_700_000_000_000 + round(seconds * 1000)


def csv_row(sample_id: str, status: str, at, content: str) -> str:
    return f"{JOB},sample,{sample_id},{status},{at},{content}\r\n"


def unfinished_run(trace_dir: str) -> str:
    """The sync straggler run and: u5, seen by workers in step 2 and never finished; u6,
    staged in step 2, its root ``aborted``; v1, a validation uid without a root; u7 without a
    root but with a COMPLETE CSV row; c1 and c2 only in the CSV (c2 without a readable time).
    The CSV's last row of u5 comes after its last span."""
    run = straggler_run()
    agent = {sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT, sc.TRAJ_UID: "0", sc.GLOBAL_STEP: 2}
    u5 = run.span(sc.agent_span_name("tool_agent"), 21, 24, {**agent, sc.UID: "u5"}, resource=WORKER)
    run.span(sc.SPAN_REWARD, 24, 24.5, {sc.UID: "u5", sc.TRAJ_UID: "0", sc.GLOBAL_STEP: 2}, parent=u5,
             resource=WORKER)
    u6 = run.span(sc.SPAN_SAMPLE, 20, 28, {sc.UID: "u6", sc.SAMPLE_OUTCOME: "aborted", sc.GLOBAL_STEP: 2})
    run.uids[u6["spanId"]] = "u6"
    run.sample_stage(u6, "old_log_prob", 2, 26, 27)
    run.span(sc.agent_span_name("tool_agent"), 21, 22, {**agent, sc.UID: "v1", sc.VALIDATE: True},
             resource=WORKER)
    run.span(sc.agent_span_name("tool_agent"), 21, 23, {**agent, sc.UID: "u7"}, resource=WORKER)
    run.write(trace_dir)
    os.makedirs(os.path.join(trace_dir, "sample"))
    with open(os.path.join(trace_dir, "sample", "host-pid1.csv"), "w", encoding="utf-8", newline="") as f:
        f.write(csv_row("u1/sample", "RUNNING", ms(0), "from=DataLoader|to=RayPPOTrainer|stage=DATA_PREPROCESS|"
                        "global_step=1|detail=uid_generated"))
        f.write(csv_row("u1/0", "COMPLETE", ms(18), "from=RayPPOTrainer|to=RayPPOTrainer|stage=TRAIN_UPDATE|"
                        "global_step=1"))
        f.write(csv_row("u5/0", "RUNNING", ms(25), "from=AgentLoopWorker_0|to=AgentLoopManager|stage=AGENT_DONE|"
                        "global_step=2"))
        f.write(csv_row("u7/0", "COMPLETE", ms(27), "from=RayPPOTrainer|to=RayPPOTrainer|stage=TRAIN_UPDATE|"
                        "global_step=2"))
        f.write(csv_row("c1/sample", "RUNNING", ms(20), "from=DataLoader|to=RayPPOTrainer|stage=DATA_PREPROCESS|"
                        "global_step=2|detail=uid_generated"))
        f.write(csv_row("c2/0", "RUNNING", "soon", "from=AgentLoopManager|to=AgentLoopWorker_0|stage=DATA_DISPATCH"))
        f.write(csv_row("*/sample", "RUNNING", ms(19), "from=RayPPOTrainer|to=LLMServer|stage=WEIGHT_SYNC|"
                        "global_step=1"))
    return trace_dir


@pytest.mark.parametrize("make", [straggler_run, lambda: straggler_run(extra_step=True, lineage=False), async_run],
                         ids=["sync", "three-steps", "async"])
def test_the_samples_of_generated_runs_equal_the_in_memory_ones(tmp_path, stores, make):
    trace_dir = make().write(str(tmp_path / "run"))
    store, inputs = stores(trace_dir)
    run = store.rows("SELECT any(RunId) AS run FROM otel_traces")[0]["run"]
    assert samples.build(store, run, None, inputs=inputs) == build([trace_dir])["samples"]


@pytest.mark.parametrize("limit", [20, 2, None])
def test_unfinished_samples_and_the_csv_equal_the_in_memory_ones(tmp_path, stores, limit):
    trace_dir = unfinished_run(str(tmp_path / "run"))
    store, inputs = stores(trace_dir)
    sql = samples.build(store, "sync-run", None, inputs=inputs, limit=limit)
    assert sql == build([trace_dir], unfinished_limit=limit)["samples"]
    assert sql["unfinished_count"] == 4 and sql["csv_uids"] == 5


def test_the_unfinished_samples_say_where_they_were_last_seen(tmp_path, stores):
    trace_dir = unfinished_run(str(tmp_path / "run"))
    store, inputs = stores(trace_dir)
    assert samples.build(store, "sync-run", None, inputs=inputs) == {
        "roots": 5,
        "outcomes": {"aborted": 1, "trained": 4},
        "csv_uids": 5,
        "unfinished_count": 4,
        "unfinished": [
            {"uid": "c2", "state": "no finished verl.sample span", "step": None, "last_seen": "CSV"},
            {"uid": "c1", "state": "no finished verl.sample span", "step": 2, "last_seen": "CSV DATA_PREPROCESS"},
            {"uid": "u5", "state": "no finished verl.sample span", "step": 2, "last_seen": "CSV AGENT_DONE"},
            {"uid": "u6", "state": "outcome aborted", "step": 2, "last_seen": "span verl.sample"},
        ],
    }


def test_steps_select_the_samples_of_those_steps(tmp_path, stores):
    trace_dir = unfinished_run(str(tmp_path / "run"))
    store, inputs = stores(trace_dir)
    step_2 = samples.build(store, "sync-run", (2, 2), inputs=inputs)
    assert step_2["roots"] == 3 and step_2["outcomes"] == {"aborted": 1, "trained": 2}  # u3-2, u4-2, u6
    assert [u["uid"] for u in step_2["unfinished"]] == ["c1", "u5", "u6"]  # c2's step is unknown
    assert step_2["csv_uids"] == 3  # c1, u5, u7: their last CSV rows are of step 2
    step_1 = samples.build(store, "sync-run", (1, 1), inputs=inputs)
    assert (step_1["roots"], step_1["unfinished"], step_1["csv_uids"]) == (2, [], 1)  # u1, u2; u1's CSV rows
    nothing = samples.build(store, "sync-run", (7, 9), inputs=inputs)
    assert nothing == {"roots": 0, "outcomes": {}, "csv_uids": 0, "unfinished_count": 0, "unfinished": []}


def test_a_store_without_its_csv_counts_none(tmp_path, stores):
    """A server's store has no files beside it: the spans' unfinished samples only."""
    trace_dir = unfinished_run(str(tmp_path / "run"))
    store, _ = stores(trace_dir)
    sql = samples.build(store, "sync-run", None)
    assert sql["csv_uids"] == 0
    assert [(u["uid"], u["last_seen"]) for u in sql["unfinished"]] == [
        ("u5", "span verl.reward"), ("u6", "span verl.sample"), ("u7", "span invoke_agent tool_agent")]
