"""The ClickHouse dashboard's SQL, run on the span store.

Every panel query and the run variable's query of every dashboard on Grafana's ClickHouse
data source, with its macros and variables expanded as the data source expands them, runs
on the embedded span store (chDB, the engine a ClickHouse server runs) loaded with a run's
spans: a generated run (``tests/otlp_runs.py``) in the fast loop, a real demo run (real
verl on a local Ray cluster, its OTLP-JSON files) in the e2e one. Each query must return
rows with the columns its panel reads (the time column of a time series, a bar chart's x
field, the fields its overrides and data links name), and the numbers the panels show
must equal the spans': steps and stages, each step's trajectories and its slowest one,
staleness, tool calls, LLM turns per replica. A time range before the run and a run that
did not happen must each make every query come back empty.
"""

from __future__ import annotations

import collections
import datetime
import math
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import pytest

import grafana_dashboard as gd
from otel_verl import semconv as sc
from otel_verl.exporters.otlp_json_file import spans_from_files
from otlp_runs import T0_NS, WORKER, Run, async_run, straggler_run

pytest.importorskip("clickhouse_connect")

from otel_verl.tools.report.inputs import resolve  # noqa: E402
from otel_verl.tools.store import query as store_query  # noqa: E402
from otel_verl.tools.store.store import Store  # noqa: E402
import reference_report as memory_tail  # noqa: E402
from otel_verl.tools.report.spans import SpanIndex  # noqa: E402

SOURCE_TYPE = "grafana-clickhouse-datasource"
DASHBOARD = "otel-verl-clickhouse.json"
STEPS, PROMPTS, N = 2, 4, 2  # the shared demo the report tests read too: one run for all

# The data source's macros (its pkg/macros/macros.go): the range as whole Unix seconds.
_TIME_FILTER = re.compile(r"\$__timeFilter\(([^()]*)\)")
# Grafana's variable syntax: $name, ${name}, ${name:format}, [[name]]
_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\$(\w+)|\[\[(\w+)(?::[^\]]*)?\]\]")


def expand(sql: str, variables: Dict[str, Any], start: float, end: float) -> str:
    """``sql`` as the ClickHouse data source runs it: ``$__timeFilter(col)`` becomes
    ``col >= toDateTime(from) AND col <= toDateTime(to)`` (its backend), then each variable
    its value, a list of values as ``'a','b'`` (its frontend's format). Anything else
    starting with ``$`` is left, for the caller to find."""
    sql = _TIME_FILTER.sub(lambda m: f"{m[1].strip()} >= toDateTime({math.floor(start)}) AND "
                                     f"{m[1].strip()} <= toDateTime({math.floor(end)})", sql)

    def value(match: re.Match) -> str:
        name = match[1] or match[2] or match[3]
        if name not in variables:
            return match[0]
        chosen = variables[name]
        return "'" + "','".join(chosen) + "'" if isinstance(chosen, list) else str(chosen)

    return _VARIABLE.sub(value, sql)


def clickhouse_targets(dashboard: dict) -> List[Tuple[dict, dict]]:
    return [(panel, target) for panel in gd.all_panels(dashboard) for target in panel.get("targets", [])
            if (target.get("datasource") or panel.get("datasource") or {}).get("type") == SOURCE_TYPE]


def columns_read(panel: dict) -> set:
    """What the panel takes by name from its queries' results (any of them)."""
    names = {o["matcher"]["options"] for o in panel.get("fieldConfig", {}).get("overrides", [])
             if o["matcher"]["id"] == "byName"}
    if panel["type"] == "barchart":
        names.add(panel["options"]["xField"])
    return names


@dataclass
class LoadedRun:
    store: Store
    run_id: str
    spans: List[Dict[str, Any]]
    start: float  # the dashboard's time range: the run's, in Unix seconds
    end: float


def load(trace_dir: str, store_dir: str) -> LoadedRun:
    spans = spans_from_files(resolve([trace_dir]).otlp_files)
    (run_id,) = {s["resource"][sc.RUN_ID] for s in spans if sc.RUN_ID in s["resource"]}
    store = Store.embedded(store_dir)
    store.load(resolve([trace_dir]).otlp_files)
    return LoadedRun(store, run_id, spans, min(s["startTimeUnixNano"] for s in spans) / 1e9 - 1,
                     max(s["endTimeUnixNano"] for s in spans) / 1e9 + 1)


def run_panels(run: LoadedRun, name: str, run_id: str | None = None, start: float | None = None,
               end: float | None = None) -> Dict[Tuple[str, str], List[Dict[str, Any]]]:
    """Every ClickHouse query of dashboard ``name`` on ``run``'s store, by (panel title, refId):
    its rows as dicts, after checking that it returned the columns its panel reads."""
    dashboard = gd.dashboards()[name]
    variables = {v["name"]: v.get("query") for v in dashboard["templating"]["list"]
                 if v["type"] in ("textbox", "constant")}
    variables["run_id"] = run_id or run.run_id
    out, returned = {}, collections.defaultdict(set)
    for panel, target in clickhouse_targets(dashboard):
        sql = expand(target["rawSql"], variables, run.start if start is None else start,
                     run.end if end is None else end)
        assert not re.search(r"\$|\[\[", sql), f"panel {panel['title']!r}: a macro or variable left in {sql}"
        names, rows = store_query.run(run.store, sql)
        out[(panel["title"], target["refId"])] = [dict(zip(names, row)) for row in rows]
        if not rows:  # chDB's client names no columns then
            continue
        if target.get("format") == 0:  # a time series: its first column, named time, is the time
            assert names[0] == "time", f"panel {panel['title']!r} ({target['refId']}): {names}"
        returned[panel["title"]] |= set(names)
    for panel, _ in clickhouse_targets(dashboard):
        if not any(out[(panel["title"], t["refId"])] for t in panel["targets"]):
            continue
        missing = columns_read(panel) - returned[panel["title"]]
        assert not missing, f"panel {panel['title']!r} reads {missing}, not in {returned[panel['title']]}"
    return out


# ---------------------------------------------------------------------- what the spans say


def _seconds(span: Dict[str, Any]) -> float:
    return (span["endTimeUnixNano"] - span["startTimeUnixNano"]) / 1e9


def _operation(span: Dict[str, Any]) -> str:
    return span["attributes"].get(sc.GEN_AI_OPERATION_NAME, "")


def _training_trajectories(spans):
    return [s for s in spans if _operation(s) == sc.OP_INVOKE_AGENT and not s["attributes"].get(sc.VALIDATE)
            and s["attributes"].get(sc.GLOBAL_STEP) is not None]


def _replicas_of_turns(spans) -> Dict[str, set]:
    """turn span id -> the replicas of its engine requests, by the report's rule
    (``tail.engine_requests``, on the turn alone)."""
    index = SpanIndex(spans)
    out = {}
    for turn in spans:
        if _operation(turn) in (sc.OP_CHAT, sc.OP_TEXT_COMPLETION):
            alone = {"traceId": turn["traceId"], "spanId": "\0" + turn["spanId"]}
            index.children[(turn["traceId"], alone["spanId"])] = [turn]
            out[turn["spanId"]] = {replica for replica, _, _ in memory_tail.engine_requests(alone, index)}
    return out


def _trained_step(trajectory, per_traj, per_uid):
    """The step that trained the trajectory (report/tail.py's rule), else its generation step."""
    attrs = trajectory["attributes"]
    step = per_traj.get((attrs.get(sc.UID), str(attrs.get(sc.TRAJ_UID))), per_uid.get(attrs.get(sc.UID)))
    return attrs.get(sc.GLOBAL_STEP) if step is None else step


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def assert_the_panels_show_the_spans(results, spans) -> None:
    # the step timeline: one point per step, its duration; the stages' time per step
    steps = {s["attributes"][sc.GLOBAL_STEP]: s for s in spans if s["name"] == sc.SPAN_STEP}
    step_rows = results[("Step timeline", "A")]
    assert len(step_rows) == len(steps) > 0
    assert sorted(r["step_s"] for r in step_rows) == pytest.approx(sorted(map(_seconds, steps.values())), abs=1e-9)
    stage_seconds = collections.Counter()
    for s in spans:
        if s["name"].startswith("verl.stage ") and s["attributes"].get(sc.GLOBAL_STEP) in steps:
            stage_seconds[(s["attributes"][sc.GLOBAL_STEP], s["attributes"][sc.STAGE])] += _seconds(s)
    end_to_step = {s["endTimeUnixNano"] // 1000: step for step, s in steps.items()}  # the client's datetimes: µs
    shown = {(end_to_step[_unix_us(r["time"])], r["stage"]): r["seconds"] for r in results[("Step timeline", "B")]}
    assert shown.keys() == stage_seconds.keys()
    assert all(close(shown[k], stage_seconds[k]) for k in shown), (shown, stage_seconds)

    # each step's tail: the trajectories each step trained, the steps that generated them,
    # the longest, which one it was and its replica (the one that served most of its
    # engine requests' time; ties: by name)
    per_traj, per_uid = memory_tail.trained_steps(spans)
    index = SpanIndex(spans)
    by_step = collections.defaultdict(list)
    for s in _training_trajectories(spans):
        by_step[_trained_step(s, per_traj, per_uid)].append(s)
    tail = {r["step"]: r for r in results[("Each step's tail", "A")]}
    bars = {r["step"]: r for r in results[("Trajectory duration per step", "A")]}
    assert sorted(tail) == sorted(by_step) and sorted(bars) == sorted(str(step) for step in by_step)
    for step, trajectories in by_step.items():
        slowest = max(trajectories, key=_seconds)
        row = tail[step]
        assert row["trajectories"] == len(trajectories)
        generated = sorted({s["attributes"][sc.GLOBAL_STEP] for s in trajectories})
        assert row["generation_steps"] == ", ".join(map(str, generated))
        assert close(row["max_s"], _seconds(slowest)) and close(bars[str(step)]["max_s"], _seconds(slowest))
        durations = sorted(_seconds(s) for s in trajectories)
        for level in (50, 90, 99):  # quantileExact: the value at index floor(level * n) of the sorted ones
            exact = durations[min(len(durations) * level // 100, len(durations) - 1)]
            assert close(row[f"p{level}_s"], exact) and close(bars[str(step)][f"p{level}_s"], exact), (level, row)
        uid, traj = slowest["attributes"][sc.UID], slowest["attributes"][sc.TRAJ_UID]
        assert (row["slowest"], row["trace_id"]) == (f"{uid}/{traj}", slowest["traceId"])
        assert row["replica"] == (memory_tail.main_replica(memory_tail.engine_requests(slowest, index)) or ""), row

    # staleness of the trained samples, overall and per step
    trained = [s["attributes"] for s in spans if s["name"] == sc.SPAN_SAMPLE
               and s["attributes"].get(sc.SAMPLE_OUTCOME) == "trained" and sc.STALENESS in s["attributes"]]
    histogram = collections.Counter(str(a[sc.STALENESS]) for a in trained)
    assert {r["staleness_steps"]: r["samples"] for r in results[("Staleness of trained samples", "A")]} == histogram
    per_step = collections.defaultdict(lambda: [0, 0, 0, 0])  # staleness 0, 1, 2, 3 and more
    for a in trained:
        per_step[str(a.get(sc.TRAINED_STEP, a.get(sc.GLOBAL_STEP)))][min(int(a[sc.STALENESS]), 3)] += 1
    assert {r["trained_in"]: [r["staleness_0"], r["staleness_1"], r["staleness_2"], r["staleness_3_plus"]]
            for r in results[("Staleness per step", "A")]} == per_step

    # the slowest trajectories, longest first, each with its trace
    everything = sorted(_training_trajectories(spans), key=_seconds, reverse=True)
    slowest_rows = results[("Slowest trajectories", "A")]
    assert [r["duration_s"] for r in slowest_rows] == pytest.approx([_seconds(s) for s in everything[:20]], abs=1e-9)
    assert {r["trace_id"] for r in slowest_rows} <= {s["traceId"] for s in everything}

    # tool calls by tool; LLM turns by replica
    tools = [s for s in spans if _operation(s) == sc.OP_EXECUTE_TOOL]
    calls = collections.Counter(s["attributes"].get(sc.GEN_AI_TOOL_NAME, "") for s in tools)
    errors = collections.Counter(s["attributes"].get(sc.GEN_AI_TOOL_NAME, "") for s in tools
                                 if s["status"]["code"] == 2)  # STATUS_CODE_ERROR
    tool_rows = {r["tool"]: r for r in results[("Tool calls by tool", "A")]}
    assert {t: r["calls"] for t, r in tool_rows.items()} == calls
    assert {t: r["errors"] for t, r in tool_rows.items() if r["errors"]} == errors
    timeouts = collections.Counter(s["attributes"].get(sc.GEN_AI_TOOL_NAME, "") for s in tools
                                   if "timed out" in s["status"]["message"].lower())
    assert {t: r["timeouts"] for t, r in tool_rows.items() if r["timeouts"]} == timeouts
    turns = collections.Counter(replica for served in _replicas_of_turns(spans).values() for replica in served)
    assert {r["replica"]: r["turns"] for r in results[("LLM turns per replica", "A")]} == turns


def _unix_us(value: datetime.datetime) -> int:
    """A time the store's client returned (naive: UTC) in Unix microseconds."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.timezone.utc)
    delta = value - datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
    return (delta.days * 86400 + delta.seconds) * 10**6 + delta.microseconds


def assert_nothing_outside(run: LoadedRun, name: str) -> None:
    other = run_panels(run, name, run_id=f"not-{run.run_id}")
    assert not any(other.values()), {k: v for k, v in other.items() if v}
    before = run_panels(run, name, start=run.start - 7200, end=run.start - 3600)
    assert not any(before.values()), {k: v for k, v in before.items() if v}


def assert_the_run_variable_lists(run: LoadedRun, name: str) -> None:
    (variable,) = [v for v in gd.dashboards()[name]["templating"]["list"] if v["type"] == "query"]
    assert variable["datasource"]["type"] == SOURCE_TYPE
    sql = expand(variable["query"]["rawSql"], {}, run.start, run.end)
    assert not re.search(r"\$", sql), sql
    assert [row[0] for row in store_query.run(run.store, sql)[1]] == [run.run_id]


# ---------------------------------------------------------------------- generated runs (fast)


def test_the_clickhouse_dashboard_is_shipped():
    assert DASHBOARD in gd.dashboards_on(SOURCE_TYPE)


def test_the_macros_expand_as_the_data_source_expands_them():
    sql = "SELECT * FROM steps WHERE $__timeFilter( start ) AND run_id = '${run_id}' AND x IN ($many) AND [[one]] = 1"
    assert expand(sql, {"run_id": "r", "many": ["a", "b"], "one": "y"}, 1000.9, 2000.5) == (
        "SELECT * FROM steps WHERE start >= toDateTime(1000) AND start <= toDateTime(2000) AND run_id = 'r' "
        "AND x IN ('a','b') AND y = 1")
    assert expand("$__timeInterval(start) $other", {}, 0, 1) == "$__timeInterval(start) $other"  # unknown: left


def with_a_timed_out_tool_and_a_second_replica(run: Run) -> Run:
    """``run`` with, in its longest trajectory, a tool call that timed out and a short turn
    on a replica of its own (the trajectory's replica stays the one that served most)."""
    trajectories = [s for _, spans in run.spans.values() for s in spans if s["name"].startswith("invoke_agent")]
    longest = max(trajectories, key=lambda s: int(s["endTimeUnixNano"]) - int(s["startTimeUnixNano"]))
    values = {a["key"]: a["value"] for a in longest["attributes"]}
    ids = {sc.UID: values[sc.UID]["stringValue"], sc.TRAJ_UID: values[sc.TRAJ_UID]["stringValue"],
           sc.GLOBAL_STEP: int(values[sc.GLOBAL_STEP]["intValue"])}
    end = (int(longest["endTimeUnixNano"]) - T0_NS) / 1e9 / run.scale
    tool = run.span(sc.tool_span_name("search"), end - 0.3, end - 0.2,
                    {**ids, sc.GEN_AI_OPERATION_NAME: sc.OP_EXECUTE_TOOL, sc.GEN_AI_TOOL_NAME: "search"},
                    parent=longest, resource=WORKER)
    tool["status"] = {"code": 2, "message": "tool call timed out after 0.1 s"}
    run.span("chat tiny", end - 0.2, end - 0.1, {**ids, sc.GEN_AI_OPERATION_NAME: sc.OP_CHAT,
                                                 sc.LLM_SERVER_ID: "replica-spare"}, parent=longest, resource=WORKER)
    return run


@pytest.mark.parametrize("make", [straggler_run, async_run], ids=["sync", "async"])
@pytest.mark.parametrize("name", sorted(gd.dashboards_on(SOURCE_TYPE)))
def test_every_panel_query_shows_the_spans_of_a_generated_run(tmp_path, make, name):
    trace_dir = with_a_timed_out_tool_and_a_second_replica(make()).write(str(tmp_path / "run"))
    run = load(trace_dir, str(tmp_path / "store"))
    try:
        results = run_panels(run, name)
        empty = [key for key, rows in results.items() if not rows]
        assert not empty, f"queries that returned no rows: {empty}"
        assert_the_panels_show_the_spans(results, run.spans)
        assert_nothing_outside(run, name)
        assert_the_run_variable_lists(run, name)
    finally:
        run.store.close()


# ---------------------------------------------------------------------- a demo run (e2e)


@pytest.fixture(scope="module")
def demo_run(shared_demo, tmp_path_factory):
    trace_dir, _ = shared_demo(STEPS, PROMPTS, N)
    run = load(str(trace_dir), str(tmp_path_factory.mktemp("dashboard-clickhouse") / "store"))
    yield run
    run.store.close()


@pytest.mark.verl
@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(gd.dashboards_on(SOURCE_TYPE)))
def test_every_panel_query_shows_the_spans_of_a_demo_run(demo_run, name):
    results = run_panels(demo_run, name)
    empty = [key for key, rows in results.items() if not rows]
    assert not empty, f"queries that returned no rows on the demo: {empty}"
    assert len(results[("Step timeline", "A")]) == STEPS
    assert [r["trajectories"] for r in results[("Each step's tail", "A")]] == [PROMPTS * N] * STEPS
    assert_the_panels_show_the_spans(results, demo_run.spans)
    assert_nothing_outside(demo_run, name)
    assert_the_run_variable_lists(demo_run, name)
