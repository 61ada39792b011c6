"""The report's ``tail`` as SQL on the store (``otel_verl/tools/store/tail.py``) equals
the reference one (tests/reference_report.py) on the same spans; ``steps`` selects
the steps by the step that trained their trajectories."""

from __future__ import annotations


import pytest

from reference_report import build
import reference_report as memory_tail
from reference_report import read_spans, training_trajectories
from otel_verl.tools.report.inputs import Lines, resolve
from otel_verl.tools.report.spans import SpanIndex
from otel_verl.tools.store import report as store_report, tail as store_tail
from store_checks import rounded
from otlp_runs import REPLICA_A, REPLICA_B, Run, async_run, straggler_run, timing

pytest.importorskip("clickhouse_connect")


@pytest.fixture()
def stores(opened_store):
    return lambda path: opened_store(path)[0]


def sql_tail(store, steps=None, asynchronous=None):
    """The store's tail, in the shape mode the store's report finds unless given."""
    run = store_report.pick_run(store, None)
    if asynchronous is None:
        asynchronous = store_report.build(store, run_id=run)["shape"]["mode"] == "async"
    return store_tail.build(store, run, steps, asynchronous)


def selected(memory, steps):
    """The reference tail restricted to steps first..last."""
    in_steps = [r for r in memory["staleness"]["per_step"] if steps[0] <= r["trained_step"] <= steps[1]]
    return {**memory, "steps": [r for r in memory["steps"] if steps[0] <= r["step"] <= steps[1]],
            "staleness": {"lineage": bool(in_steps), "note": None if in_steps else memory_tail.NO_LINEAGE,
                          "per_step": in_steps}}


@pytest.mark.parametrize("make", [straggler_run, lambda: straggler_run(extra_step=True, lineage=False), async_run],
                         ids=["sync", "three-steps-no-lineage", "async"])
def test_the_sql_tail_equals_the_in_memory_one(tmp_path, stores, make):
    trace_dir = make().write(str(tmp_path / "run"))
    memory = build([trace_dir])["tail"]
    assert rounded(sql_tail(stores(trace_dir))) == rounded(memory)


def test_steps_select_their_rows_and_rank_every_replica_of_the_run(tmp_path, stores):
    trace_dir = straggler_run(extra_step=True).write(str(tmp_path / "run"))
    memory = build([trace_dir])["tail"]
    sql = sql_tail(stores(trace_dir), steps=(2, 3))
    assert [r["step"] for r in sql["steps"]] == [2, 3]
    assert rounded(sql) == rounded(selected(memory, (2, 3)))
    # replica B served nothing in steps 2-3: still ranked, the idlest
    assert sql["replicas"] == [REPLICA_A, REPLICA_B]
    assert sql["steps"][0]["replicas"]["idlest"] == {"replica": REPLICA_B, "busy_s": 0.0, "requests": 0,
                                                     "busy_fraction": 0.0}


def test_an_async_step_holds_what_earlier_weights_generated(tmp_path, stores):
    trace_dir = async_run().write(str(tmp_path / "run"))
    memory = build([trace_dir])["tail"]
    store = stores(trace_dir)
    step_2 = sql_tail(store, steps=(2, 2))
    # a4 was generated in step 1 and trained in step 2 (its root's trained_step): step 2's
    # row, read from step 2's rows and the trajectory it trained
    assert rounded(step_2["steps"]) == rounded([r for r in memory["steps"] if r["step"] == 2])
    assert step_2["steps"][0]["rollout_window"]["generation_steps"] == [1]
    assert step_2["staleness"]["per_step"] == [{"trained_step": 2, "samples": 1,
                                                "histogram": [{"staleness": 2, "samples": 1}]}]
    # a3, generated in step 1, no step trained: untrained among step 1's trajectories
    assert (sql_tail(store, steps=(1, 1))["untrained"], step_2["untrained"], memory["untrained"]) == (1, 0, 1)


def test_no_step_selected_is_an_empty_tail(tmp_path, stores):
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    sql = sql_tail(stores(trace_dir), steps=(9, 9))
    assert sql == {"replicas": [REPLICA_A, REPLICA_B], "steps": [], "untrained": 0,
                   "staleness": {"lineage": False, "note": memory_tail.NO_LINEAGE, "per_step": []}}


def test_trajectories_no_step_trained_belong_to_their_generation_step_when_sync(tmp_path, stores):
    """No sample stage, no trained_step: sync counts the trajectory in the step that
    generated it; async leaves it untrained. One turn without a server span names its
    replica; a resumed one pauses between its attempts."""
    run = Run("plain")
    run.fit(prompts=1, n=2, steps=1)
    run.step(1, 0, 10, [("generation", 0, 6), ("update_actor", 6, 9)])
    root = run.sample("p1", 0, 9)
    run.trajectory(root, "0", 1, 1, 4, [{"at": (1.1, 3.9), "server": (1.2, 3.8, REPLICA_A, timing(2.6, 0.1, 0.5))}])
    run.trajectory(root, "1", 1, 1, 5, [{"at": (1.1, 4.9), "server_id": REPLICA_B, "attempts": [(1.2, 2), (3, 4.8)]}])
    trace_dir = run.write(str(tmp_path / "run"))
    store = stores(trace_dir)
    spans = read_spans(resolve([trace_dir]).otlp_files, Lines())
    for asynchronous in (False, True):
        memory = memory_tail.tail_section(spans, SpanIndex(spans), training_trajectories(spans), asynchronous)
        assert rounded(sql_tail(store, asynchronous=asynchronous)) == rounded(memory), asynchronous
    sync = sql_tail(store, asynchronous=False)
    assert sync["steps"][0]["rollout_window"]["trajectories"] == 2
    assert sync["steps"][0]["critical_path"]["replica"] == REPLICA_B
    assert sql_tail(store, asynchronous=True)["untrained"] == 2
