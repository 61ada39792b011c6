"""The report's ``slowest_trajectories`` as SQL on the store (``otel_verl/tools/store/slowest.py``)
equal the reference report's (tests/reference_report.py) on the same spans; ``steps`` ranks the trajectories of those
steps only."""

from __future__ import annotations


import pytest

from otel_verl import semconv as sc
from reference_report import build
from otel_verl.tools.store import slowest
from otel_verl.tools.store.report import pick_run
from store_checks import rounded
from otlp_runs import REPLICA_A, WORKER, async_run, server_resource, straggler_run, timing

pytest.importorskip("clickhouse_connect")


@pytest.fixture()
def stores(opened_store):
    return lambda path: opened_store(path)[0]


def sql_slowest(store, steps=None, top=5):
    return slowest.build(store, pick_run(store, None), steps, top=top)


def tricky_run():
    """The sync run, and beside it: a validation trajectory longer than any (left out); a
    trajectory whose turns sit below a span of their own, one turn resumed with a server span
    per attempt, the other on a server without its metrics (e2e only: no queue / prefill /
    decode); and a trajectory tied with another on duration (the span id decides)."""
    run = straggler_run()
    root = run.sample("v1", 0, 19)
    validation = run.trajectory(root, "0", 1, 0, 15,
                                [{"at": (0.1, 14), "server": (0.2, 13, REPLICA_A, timing(12, 1, 2))}])
    validation["attributes"].append({"key": sc.VALIDATE, "value": {"boolValue": True}})
    deep = run.trajectory(root, "1", 1, 3, 9)
    ids = {sc.UID: "v1", sc.TRAJ_UID: "1", sc.GLOBAL_STEP: 1}
    work = run.span("agent work", 3.1, 8.9, ids, parent=deep, resource=WORKER)
    resumed = run.span("chat tiny", 3.2, 6, {**ids, sc.GEN_AI_OPERATION_NAME: sc.OP_CHAT}, parent=work, resource=WORKER)
    for number, (lo, hi) in enumerate(((3.3, 4), (4.5, 5.9)), 1):
        attempt = run.span(sc.SPAN_LLM_ATTEMPT, lo, hi, {**ids, sc.LLM_ATTEMPT_NUMBER: number}, parent=resumed,
                           resource=WORKER)
        meta = {sc.llm_server_meta_attribute(k): v for k, v in timing(hi - lo - 0.1, 0.1, 0.3).items()}
        run.span(sc.SPAN_LLM_SERVER, lo + 0.05, hi - 0.05, meta, parent=attempt, resource=server_resource(REPLICA_A))
    plain = run.span("chat tiny", 6.1, 8, {**ids, sc.GEN_AI_OPERATION_NAME: sc.OP_CHAT}, parent=work, resource=WORKER)
    run.span(sc.SPAN_LLM_SERVER, 6.2, 7.9, {sc.llm_server_meta_attribute("e2e_latency"): 1.6}, parent=plain,
             resource=server_resource(REPLICA_A))
    run.span(sc.tool_span_name("calculator"), 8, 8.5, {**ids, sc.GEN_AI_OPERATION_NAME: sc.OP_EXECUTE_TOOL},
             parent=work, resource=WORKER)
    run.trajectory(root, "2", 1, 1, 2.7)  # as long as u1/1: no turns at all
    return run


@pytest.mark.parametrize("make", [straggler_run, lambda: straggler_run(extra_step=True, lineage=False), async_run,
                                  tricky_run], ids=["sync", "three-steps", "async", "tricky"])
@pytest.mark.parametrize("top", [5, 1, 100])
def test_the_slowest_trajectories_equal_the_in_memory_report(tmp_path, stores, make, top):
    trace_dir = make().write(str(tmp_path / "run"))
    memory = build([trace_dir], top=top)["slowest_trajectories"]
    assert memory  # the comparison means something
    assert rounded(sql_slowest(stores(trace_dir), top=top)) == rounded(memory)


def test_the_split_of_nested_resumed_and_metric_less_turns(tmp_path, stores):
    trace_dir = tricky_run().write(str(tmp_path / "run"))
    rows = sql_slowest(stores(trace_dir), top=100)
    assert [(r["uid"], r["traj_uid"]) for r in rows][:2] == [("u2", "1"), ("v1", "1")]  # the validation one left out
    deep = rounded(rows[1])
    assert (deep["turns"], deep["llm_s"], deep["tool_calls"], deep["tool_s"], deep["other_s"]) == (2, 4.7, 1, 0.5, 0.8)
    # both attempts' servers summed for the resumed turn; the e2e-only server leaves the parts unknown
    assert deep["llm_server_s"] == {"e2e": 0.6 + 1.3 + 1.6, "queue": None, "prefill": None, "decode": None,
                                    "client_overhead": round(4.7 - 3.5, 6)}
    tied = [r["span_id"] for r in rows if r["duration_s"] == pytest.approx(1.7)]  # u1/1 and v1/2
    assert len(tied) == 2 and tied == sorted(tied)


def test_steps_rank_the_trajectories_of_those_steps(tmp_path, stores):
    trace_dir = straggler_run(extra_step=True).write(str(tmp_path / "run"))
    every = build([trace_dir], top=1000)["slowest_trajectories"]
    store = stores(trace_dir)
    for steps, top in (((2, 3), 5), ((2, 2), 2), ((1, 1), 100)):
        expected = [r for r in every if steps[0] <= r["step"] <= steps[1]][:top]
        assert expected
        assert rounded(sql_slowest(store, steps, top)) == rounded(expected), steps
    assert sql_slowest(store, (7, 9)) == []
    assert sql_slowest(store, None, top=0) == []
