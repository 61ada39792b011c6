"""The span store (``otel_verl/tools/store``): OTLP-JSON files loaded into chDB as the
Collector's clickhouseexporter writes ``otel_traces``, incrementally, never failing on a
line; the views agree with the spans; ``otel-verl query``."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import subprocess
import sys
import time
from typing import Any, Dict, List

import pytest

from otel_verl import semconv as sc
from otel_verl.exporters.otlp_json_file import spans_from_files
from reference_report import build
from otel_verl.tools.store import Store, embedded_path
from otel_verl.tools.store.store import open_store, rejected_lines
from otlp_runs import TRAINER, Run, async_run, otlp_attributes, straggler_run

pytest.importorskip("clickhouse_connect")


def otel_verl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "otel_verl.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture()
def store_of():
    """``store_of(trace_dir)``: its embedded store, loaded; closed after the test (chDB
    holds one store per process)."""
    opened: List[Store] = []

    def open_(*paths: str) -> Store:
        for store in opened:
            store.close()
        opened.clear()
        store, _, _ = open_store(list(paths), None)
        opened.append(store)
        return store

    yield open_
    for store in opened:
        store.close()


def line(resource: Dict[str, Any], spans: List[Dict[str, Any]], scope: Dict[str, str] | None = None) -> str:
    return json.dumps({"resourceSpans": [{"resource": {"attributes": otlp_attributes(resource)},
                                          "scopeSpans": [{"scope": scope or {"name": "otel_verl"}, "spans": spans}]}]})


def span(name: str, span_id: str, **fields: Any) -> Dict[str, Any]:
    return {"traceId": "ab" * 16, "spanId": span_id, "name": name, "kind": 1,
            "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000001500000000", **fields}


# --------------------------------------------------------------------------- as the Collector writes them


def go_as_string(value: Dict[str, Any]) -> str:
    """pcommon.Value.AsString (pdata v1.67) of an OTLP-JSON AnyValue, for the values below."""
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return str(int(value["intValue"]))
    if "doubleValue" in value:
        v = float(value["doubleValue"])
        return str(int(v)) if v.is_integer() and abs(v) < 1e21 else repr(v)
    if "boolValue" in value:
        return "true" if value["boolValue"] else "false"
    if "bytesValue" in value:
        return value["bytesValue"]
    if "arrayValue" in value:
        return json.dumps([_raw(v) for v in value["arrayValue"]["values"]], ensure_ascii=False, separators=(",", ":"))
    raise AssertionError(value)


def _raw(value: Dict[str, Any]) -> Any:
    if "intValue" in value:
        return int(value["intValue"])
    return next(iter(value.values()))


ATTRIBUTES = [
    {"key": "text", "value": {"stringValue": "a/b \u00e9 \U0001F600 \"q\""}},
    {"key": "int", "value": {"intValue": "-9007199254740993"}},
    {"key": "int_as_number", "value": {"intValue": 42}},
    {"key": "half", "value": {"doubleValue": 0.5}},
    {"key": "whole", "value": {"doubleValue": 2.0}},
    {"key": "yes", "value": {"boolValue": True}},
    {"key": "no", "value": {"boolValue": False}},
    {"key": "bytes", "value": {"bytesValue": base64.b64encode(b"\x00\xff").decode()}},
    {"key": "uids", "value": {"arrayValue": {"values": [{"stringValue": "0/1"}, {"stringValue": "\u00e9"}]}}},
    {"key": "ints", "value": {"arrayValue": {"values": [{"intValue": "1"}, {"intValue": "-2"}]}}},
]


def test_a_span_is_a_row_as_the_collector_writes_it(tmp_path, store_of):
    otlp = tmp_path / "run" / "otlp"
    otlp.mkdir(parents=True)
    spans = [
        span("server", "1" * 16, kind=2, parentSpanId="2" * 16, traceState="k=v", attributes=ATTRIBUTES,
             status={"code": 2, "message": "boom"},
             events=[{"timeUnixNano": "1700000000250000000", "name": "exception",
                      "attributes": [{"key": "exception.type", "value": {"stringValue": "ValueError"}}]}],
             links=[{"traceId": "CD" * 16, "spanId": "3" * 16, "attributes": [{"key": "n", "value": {"intValue": "1"}}]}]),
        span("client", "4" * 16, kind=3, status={"code": 1}),
        span("plain", "5" * 16, kind=0),
    ]
    (otlp / "spans.jsonl").write_text(line({**TRAINER, sc.RUN_ID: "r1"}, spans, {"name": "otel_verl", "version": "9"}) + "\n")
    store = store_of(str(tmp_path / "run"))
    rows = {r["SpanName"]: r for r in store.rows(
        "SELECT *, toUnixTimestamp64Nano(Timestamp) AS ns, toUnixTimestamp64Nano(Events.Timestamp[1]) AS event_ns, "
        "RunId, Role, Step FROM otel_traces")}
    row = rows["server"]
    assert (row["TraceId"], row["SpanId"], row["ParentSpanId"], row["TraceState"]) == ("ab" * 16, "1" * 16, "2" * 16, "k=v")
    assert (row["SpanKind"], row["StatusCode"], row["StatusMessage"]) == ("Server", "Error", "boom")
    assert (rows["client"]["SpanKind"], rows["client"]["StatusCode"]) == ("Client", "Ok")
    assert (rows["plain"]["SpanKind"], rows["plain"]["StatusCode"]) == ("Unspecified", "Unset")
    assert (row["ns"], row["Duration"]) == (1_700_000_000_000_000_000, 1_500_000_000)
    assert (row["ServiceName"], row["ScopeName"], row["ScopeVersion"]) == ("verl-trainer", "otel_verl", "9")
    assert row["SpanAttributes"] == {kv["key"]: go_as_string(kv["value"]) for kv in ATTRIBUTES}
    assert row["ResourceAttributes"][sc.RUN_ID] == "r1" and (row["RunId"], row["Role"], row["Step"]) == ("r1", "trainer", -1)
    assert (row["Events.Name"], row["event_ns"], row["Events.Attributes"]) == (
        ["exception"], 1_700_000_000_250_000_000, [{"exception.type": "ValueError"}])
    assert (row["Links.TraceId"], row["Links.SpanId"], row["Links.Attributes"]) == (["cd" * 16], ["3" * 16], [{"n": "1"}])


def test_doubles_are_written_as_the_engine_prints_them(tmp_path, store_of):
    """Where the store and the Collector differ (docs/STORE.md): a double's text."""
    otlp = tmp_path / "run" / "otlp"
    otlp.mkdir(parents=True)
    values = [0.1, 1e-7, 123456.789, -3.25]
    attrs = [{"key": f"d{i}", "value": {"doubleValue": v}} for i, v in enumerate(values)]
    (otlp / "spans.jsonl").write_text(line(TRAINER, [span("s", "1" * 16, attributes=attrs)]) + "\n")
    got = store_of(str(tmp_path / "run")).rows("SELECT SpanAttributes AS a FROM otel_traces")[0]["a"]
    assert [float(got[f"d{i}"]) for i in range(len(values))] == values


# --------------------------------------------------------------------------- loading


def test_every_span_is_loaded_once_and_a_second_load_reads_only_what_is_new(tmp_path, store_of):
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    path = os.path.join(trace_dir, "otlp", "spans.jsonl")
    expected = len(spans_from_files([path]))
    store = store_of(trace_dir)
    assert store.rows("SELECT count() AS n FROM otel_traces")[0]["n"] == expected
    assert store.load([path]).spans == 0
    more = async_run()
    with open(path, "a", encoding="utf-8") as f:
        for resource, spans in more.spans.values():
            f.write(line(resource, spans) + "\n")
    added = sum(len(spans) for _, spans in more.spans.values())
    assert store.load([path]).spans == added
    assert store.rows("SELECT count() AS n, uniqExact(RunId, TraceId, SpanId) AS ids FROM otel_traces")[0] == {
        "n": expected + added, "ids": expected + added}
    assert sorted(r["run_id"] for r in store.rows("SELECT DISTINCT run_id FROM steps")) == ["async-run", "sync-run"]


def test_a_line_still_being_written_is_left_for_the_next_load(tmp_path, store_of):
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    path = os.path.join(trace_dir, "otlp", "spans.jsonl")
    whole = len(spans_from_files([path]))
    extra = line(TRAINER, [span("late", "9" * 16)])
    with open(path, "a", encoding="utf-8") as f:
        f.write(extra[:40])
    store = store_of(trace_dir)
    load = store.load([path])
    assert store.rows("SELECT count() AS n FROM otel_traces")[0]["n"] == whole
    with open(path, "a", encoding="utf-8") as f:
        f.write(extra[40:] + "\n")
    load = store.load([path])
    assert load.spans == 1 and load.pending == []
    assert store.rows("SELECT count() AS n FROM otel_traces WHERE SpanName = 'late'")[0]["n"] == 1


def test_the_pending_fragment_is_said(tmp_path):
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    with open(os.path.join(trace_dir, "otlp", "spans.jsonl"), "a", encoding="utf-8") as f:
        f.write('{"resourceSpans": [{"scopeSpans"')
    proc = otel_verl("query", trace_dir, "SELECT count() FROM steps")
    assert proc.returncode == 0, proc.stderr
    assert "ends with a truncated line (32 bytes; still being written?)" in proc.stderr


def test_a_replaced_file_rebuilds_the_store_without_duplicates(tmp_path, store_of):
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    path = os.path.join(trace_dir, "otlp", "spans.jsonl")
    store = store_of(trace_dir)
    os.remove(path)
    async_run().write(trace_dir)  # a new file at the same path
    load = store.load([path])
    assert load.reloaded
    assert store.rows("SELECT count() AS n FROM otel_traces")[0]["n"] == len(spans_from_files([path]))
    assert [r["run_id"] for r in store.rows("SELECT DISTINCT run_id FROM steps")] == ["async-run"]


def test_lines_that_are_no_span_data_are_named_and_the_rest_is_loaded(tmp_path):
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    path = os.path.join(trace_dir, "otlp", "spans.jsonl")
    good = len(spans_from_files([path]))
    with open(path, "a", encoding="utf-8") as f:
        f.write("not json at all\n")
        f.write('{"resourceSpans": [5]}\n')
        f.write('{"resourceMetrics": []}\n')
        f.write(line(TRAINER, [span("after", "7" * 16)]) + "\n")
    lines = sum(1 for _ in open(path, encoding="utf-8"))
    proc = otel_verl("query", trace_dir, "--format", "csv", "SELECT count() AS n FROM otel_traces")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["n", str(good + 1)]
    warned = [x for x in proc.stderr.splitlines() if x.startswith("warning: ")]
    assert [w.split(": ")[1] for w in warned] == [f"{path}:{n}" for n in (lines - 3, lines - 2, lines - 1)], warned
    assert "not JSON" in warned[0] and "not OTLP span data" in warned[1] and 'no "resourceSpans"' in warned[2]
    # a second run still names them: the store keeps them
    again = otel_verl("query", trace_dir, "SELECT 1")
    assert [x for x in again.stderr.splitlines() if x.startswith("warning: ")] == warned


def test_text_that_is_not_utf8_is_repaired_and_counted(tmp_path, store_of):
    otlp = tmp_path / "run" / "otlp"
    otlp.mkdir(parents=True)
    text = line(TRAINER, [span("s", "1" * 16, attributes=[{"key": "k", "value": {"stringValue": "x"}}])])
    raw = text.replace('"x"', '"a\\udc80b"').encode() + b"\n" + text.replace('"x"', '"c\xffd"').encode("latin-1") + b"\n"
    (otlp / "spans.jsonl").write_bytes(raw)
    store = Store.embedded(embedded_path([str(tmp_path / "run")]))
    try:
        load = store.load([str(otlp / "spans.jsonl")])
        assert load.repaired == {str(otlp / "spans.jsonl"): 2}
        values = sorted(r["v"] for r in store.rows("SELECT SpanAttributes['k'] AS v FROM otel_traces"))
        assert values == ["a\ufffdb", "c\ufffdd"]
    finally:
        store.close()


# --------------------------------------------------------------------------- the views


@pytest.mark.parametrize("make", [straggler_run, async_run], ids=["sync", "async"])
def test_the_views_agree_with_the_report_read_from_the_spans(tmp_path, store_of, make):
    trace_dir = make().write(str(tmp_path / "run"))
    report = build([trace_dir])
    store = store_of(trace_dir)
    steps = store.rows("SELECT step, duration_s FROM steps ORDER BY step")
    assert [(r["step"], round(r["duration_s"], 9)) for r in steps] == [
        (row["step"], round(row["duration_s"], 9)) for row in report["steps"] if row["finished"]]
    stages = store.rows("SELECT step, stage, sum(duration_s) AS s FROM stages GROUP BY step, stage")
    assert {(r["step"], r["stage"]): round(r["s"], 9) for r in stages} == {
        (row["step"], stage): round(s, 9) for row in report["steps"] for stage, s in row["stages"].items()}
    latency = store.rows("SELECT step, count() AS n, quantileExactInclusive(0.5)(duration_s) AS p50, max(duration_s) AS mx "
                         "FROM trajectories WHERE NOT validate GROUP BY step ORDER BY step")
    assert [(r["step"], r["n"], round(r["p50"], 9), round(r["mx"], 9)) for r in latency] == [
        (row["step"], row["count"], round(row["p50_s"], 9), round(row["max_s"], 9)) for row in report["rollout_latency"]]
    outcomes = store.rows("SELECT outcome, count() AS n FROM samples GROUP BY outcome")
    assert {r["outcome"] or "(none)": r["n"] for r in outcomes} == report["samples"]["outcomes"]


def test_the_views_type_what_they_read(tmp_path, store_of):
    store = store_of(straggler_run().write(str(tmp_path / "run")))
    trained = store.rows("SELECT uid, staleness, trained_step FROM samples ORDER BY uid")
    assert [(r["uid"], r["staleness"], r["trained_step"]) for r in trained] == [
        ("u1", 0, 1), ("u2", 0, 1), ("u3-2", 1, 2), ("u4-2", 0, 2)]
    consumed = store.rows("SELECT step, uid, stage FROM sample_stages ORDER BY uid")
    assert [(r["step"], r["uid"]) for r in consumed] == [(1, "u1"), (1, "u2"), (2, "u3-2"), (2, "u4-2")]
    tools = store.rows("SELECT uid, traj_uid, tool, duration_s FROM tool_calls")
    assert [(r["uid"], r["traj_uid"], r["tool"], round(r["duration_s"], 6)) for r in tools] == [("u2", "1", "", 0.2)]
    requests = store.rows("SELECT e2e_s, queue_s FROM llm_requests ORDER BY e2e_s DESC LIMIT 1")
    assert requests == [{"e2e_s": 8.0, "queue_s": 1.0}]
    assert store.rows("SELECT count() AS n FROM weight_syncs") == [{"n": 2}]


# --------------------------------------------------------------------------- otel-verl query


def test_query_prints_a_table_csv_and_json(tmp_path):
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    sql = "SELECT step, round(duration_s, 3) AS seconds FROM steps ORDER BY step"
    table = otel_verl("query", trace_dir, sql)
    assert table.returncode == 0, table.stderr
    assert "seconds" in table.stdout and "2 rows" in table.stdout
    csv_ = otel_verl("query", trace_dir, "--format", "csv", sql)
    assert csv_.stdout.splitlines() == ["step,seconds", "1,20.0", "2,10.0"]
    data = json.loads(otel_verl("query", trace_dir, "--format", "json", sql).stdout)
    assert data == [{"step": 1, "seconds": 20.0}, {"step": 2, "seconds": 10.0}]
    assert os.path.isdir(os.path.join(trace_dir, "store"))  # kept beside the run


def test_query_answers_what_no_dashboard_does(tmp_path):
    """docs/STORE.md's questions, on a run whose answers are known."""
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    stale = otel_verl("query", trace_dir, "--format", "json",
                      "SELECT s.uid AS uid, s.staleness AS staleness, avg(t.reward) AS reward FROM samples s "
                      "JOIN trajectories t ON t.run_id = s.run_id AND t.uid = s.uid "
                      "WHERE s.staleness >= 1 GROUP BY uid, staleness")
    assert json.loads(stale.stdout) == [{"uid": "u3-2", "staleness": 1, "reward": None}]
    slowest = otel_verl("query", trace_dir, "--format", "json",
                        "SELECT step, argMax(server_instance, e2e_s) AS replica FROM llm_requests r "
                        "JOIN llm_turns l ON l.span_id = r.parent_span_id AND l.trace_id = r.trace_id "
                        "GROUP BY step ORDER BY step")
    assert json.loads(slowest.stdout) == [{"step": 1, "replica": "process-replica-b"},
                                          {"step": 2, "replica": "process-replica-a"}]


@pytest.mark.parametrize("sql, needle", [
    ("DROP TABLE otel_traces", "readonly"),
    ("INSERT INTO otel_traces (SpanName) VALUES ('x')", "readonly"),
    ("SELECT nope FROM steps", "Unknown expression identifier `nope`"),
])
def test_query_refuses_writes_and_says_what_is_wrong_in_one_line(tmp_path, sql, needle):
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    proc = otel_verl("query", trace_dir, sql)
    assert proc.returncode == 1
    [error] = [x for x in proc.stderr.splitlines() if x.startswith("Error: ")]
    assert needle.lower() in error.lower() and "Traceback" not in proc.stderr, proc.stderr
    assert otel_verl("query", trace_dir, "--format", "csv", "SELECT count() FROM steps").stdout.splitlines()[1] == "2"


def test_query_without_a_store_is_a_one_line_error(tmp_path):
    proc = otel_verl("query", "SELECT 1")
    assert proc.returncode == 1 and "give a trace dir (or OTLP-JSON files) or --clickhouse URL" in proc.stderr
    proc = otel_verl("query", "--clickhouse", "http://user:secret@127.0.0.1:1/otel", "SELECT 1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    [error] = [x for x in proc.stderr.splitlines() if x.startswith("Error: ")]
    assert error == "Error: ClickHouse at http://user:***@127.0.0.1:1/otel: cannot connect (connection refused)"
    proc = otel_verl("query", str(tmp_path / "missing"), "SELECT 1")
    assert proc.returncode == 1 and "no such file or directory" in proc.stderr


def test_a_light_install_without_the_store_says_which_extra(tmp_path):
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    for command in (["query", trace_dir, "SELECT 1"], ["report", trace_dir], ["report", "--compare", trace_dir, trace_dir]):
        code = ("import sys; sys.modules['clickhouse_connect'] = None; from otel_verl.tools.cli import main; "
                f"main({command!r})")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1
        assert proc.stderr.strip().splitlines() == [
            "Error: the span store needs chDB and clickhouse-connect: pip install 'otel-verl[report]'"]


def test_the_store_of_several_paths_lives_in_the_cache(tmp_path, monkeypatch):
    a = straggler_run().write(str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert embedded_path([a]) == os.path.join(a, "store")
    files = [os.path.join(a, "otlp", "spans.jsonl")]
    assert embedded_path(files).startswith(str(tmp_path / "cache" / "otel_verl" / "stores"))
    assert embedded_path(files) == embedded_path(list(files)) != embedded_path([a, a + "/otlp/spans.jsonl"])


def test_rejected_lines_are_counted_beyond_those_named(tmp_path, store_of):
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    with open(os.path.join(trace_dir, "otlp", "spans.jsonl"), "a", encoding="utf-8") as f:
        f.write("x\n" * 25)
    store = store_of(trace_dir)
    total, shown = rejected_lines(store, 20)
    assert total == 25 and len(shown) == 20 and not math.isnan(total)


def test_a_rebuilt_store_counts_its_rejected_lines_once(tmp_path, store_of):
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    path = os.path.join(trace_dir, "otlp", "spans.jsonl")
    with open(path, "a", encoding="utf-8") as f:
        f.write("x\n" * 3)
    store = store_of(trace_dir)
    with open(path, "rb") as f, open(path + ".new", "wb") as new:
        new.write(f.read())
    os.replace(path + ".new", path)  # the same lines in another file: the store is rebuilt
    assert store.load([path]).reloaded
    assert rejected_lines(store, 20)[0] == 3


def test_a_trace_dir_copied_without_its_links_reports(tmp_path):
    import shutil

    trace_dir = straggler_run().write(str(tmp_path / "run"))
    steps = otel_verl("query", trace_dir, "--format", "csv", "SELECT count() AS n FROM steps")  # its store, beside it
    assert steps.returncode == 0, steps.stderr
    copy = str(tmp_path / "copy")
    shutil.copytree(trace_dir, copy)  # follows the store's links: its engine no longer opens it as it is
    proc = otel_verl("query", copy, "--format", "csv", "SELECT count() AS n FROM steps")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == steps.stdout


MERGE = """
import sys
from otel_verl.tools.store.store import open_store
store, _, _ = open_store([sys.argv[1]], None)
for _ in range(4):
    store.client.command("INSERT INTO otel_traces SELECT * FROM otel_traces LIMIT 1")
store.client.command("OPTIMIZE TABLE otel_traces FINAL")
print(store.query("SELECT count() FROM system.parts WHERE table = 'otel_traces' AND NOT active")[1][0][0])
"""


def test_parts_a_merge_replaced_leave_the_disk_at_an_open_a_minute_later(tmp_path, store_of):
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    merged = subprocess.run([sys.executable, "-c", MERGE, trace_dir], capture_output=True, text=True, timeout=120)
    assert int(merged.stdout) > 0, merged.stderr  # a report process ends before a server would remove them
    minutes_ago = time.time() - 300
    for root, dirs, files in os.walk(os.path.join(trace_dir, "store")):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (minutes_ago, minutes_ago))
    store = store_of(trace_dir)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        outdated = store.rows("SELECT count() AS n FROM system.parts WHERE table = 'otel_traces' AND NOT active")[0]["n"]
        if not outdated:
            break
        time.sleep(0.2)
    assert outdated == 0


# --------------------------------------------------------------------------- docs/STORE.md

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "STORE.md")


def test_the_docs_list_each_view_with_its_columns(tmp_path, store_of):
    store = store_of(straggler_run().write(str(tmp_path / "run")))
    documented = {}
    for row in open(DOCS, encoding="utf-8"):
        if row.startswith("| `"):
            view, _, columns = (cell.strip() for cell in row.strip().strip("|").split("|"))
            documented[view.strip("`")] = re.findall(r"`([a-z_0-9]+)` ", columns)
    views = [r["name"] for r in store.rows("SELECT name FROM system.tables WHERE database = currentDatabase() "
                                           "AND engine = 'View' ORDER BY name")]
    assert sorted(documented) == views
    for view in views:
        assert documented[view] == [r["name"] for r in store.rows(f"DESCRIBE TABLE {view}")], view


def test_the_docs_queries_run(tmp_path):
    text = open(DOCS, encoding="utf-8").read()
    block = text.split("```bash\n")[1].split("```")[0]
    queries = [q.split('"', 1)[1].rsplit('"', 1)[0] for q in block.replace("\n  ", " ").split("\n")
               if q.startswith("otel-verl query")]
    assert len(queries) == 3
    trace_dir = async_run().write(str(tmp_path / "run"))
    for sql in queries:
        proc = otel_verl("query", trace_dir, "--format", "json", sql)
        assert proc.returncode == 0, (sql, proc.stderr)
        json.loads(proc.stdout)
