"""Readers shared by the demo tests: the legacy files and span trees of a demo run."""

from __future__ import annotations

import csv
import glob
import json
import os
import re
from typing import Any, Dict, List

CSV_HEADERS = ["job_id", "cat", "sample_id", "sample_status", "timestamp", "content"]


def csv_rows(trace_dir: str) -> List[Dict[str, Any]]:
    """Every sample-flow CSV row (read as the SLS collector does), with its content fields
    parsed and an ``order`` key (timestamp, file, line) for per-sample sequences."""
    rows = []
    for path in sorted(glob.glob(os.path.join(trace_dir, "sample", "*.csv"))):
        with open(path, newline="") as f:
            for index, row in enumerate(csv.reader(f)):
                rec = dict(zip(CSV_HEADERS, row))
                rec["fields"] = dict(part.split("=", 1) for part in rec["content"].split("|"))
                rec["order"] = (int(rec["timestamp"]), path, index)
                rows.append(rec)
    return rows


def progress_lines(trace_dir: str) -> List[str]:
    lines = []
    for path in sorted(glob.glob(os.path.join(trace_dir, "progress", "*.log"))):
        with open(path, encoding="utf-8") as f:
            lines.extend(line.rstrip("\n") for line in f)
    return lines


def jsonl_lines(trace_dir: str) -> List[Dict[str, Any]]:
    lines = []
    for path in glob.glob(os.path.join(trace_dir, "trajectory", "*.jsonl")):
        with open(path, encoding="utf-8") as f:
            lines.extend(json.loads(line) for line in f)
    return lines


def matches(pattern: str, value: str) -> bool:
    """``*`` in ``pattern`` matches anything."""
    return re.fullmatch(re.escape(pattern).replace(r"\*", ".*"), value) is not None


def by_id(spans):
    return {s["spanId"]: s for s in spans}


def children(spans, parent, name_prefix=""):
    return [s for s in spans if s["parentSpanId"] == parent["spanId"] and s["name"].startswith(name_prefix)]


def descendants(spans, root):
    """Every span below ``root`` (children, their children, ...)."""
    out, todo = [], [root["spanId"]]
    while todo:
        parent = todo.pop()
        kids = [s for s in spans if s["parentSpanId"] == parent]
        out += kids
        todo += [k["spanId"] for k in kids]
    return out


def assert_the_store_reports_the_same(trace_dir: str, report: Dict[str, Any], store_dir: str) -> None:
    """The reference report of the run's spans (tests/reference_report.py, in Python) equals
    ``report`` (the CLI's JSON, which the embedded store beside the run built) and the SQL
    report of the same spans loaded into a store in ``store_dir`` (not the shared trace dir)."""
    import pytest

    pytest.importorskip("clickhouse_connect")
    from reference_report import build
    from otel_verl.tools.report.inputs import resolve
    from otel_verl.tools.store import Store, report as store_report

    samples = report["samples"]
    listed = len(samples["unfinished"]) if len(samples["unfinished"]) < samples["unfinished_count"] else None
    top = len(report["slowest_trajectories"])  # as many as the report lists
    trace_dir = str(trace_dir)  # as the CLI has it
    memory = build([trace_dir], top=top, unfinished_limit=listed)
    inputs = resolve([trace_dir])
    store = Store.embedded(store_dir)
    try:
        load = store.load(inputs.otlp_files)
        sql = store_report.build(store, inputs=inputs, load=load, timeline=True, unfinished_limit=listed, top=top)
    finally:
        store.close()
    for got in (sql, report):
        for key in ("stage_order", "trajectories", "shape", "runs", "trainer", "samples"):
            assert got[key] == memory[key], key
        for key in ("steps", "stage_overlap", "rollout_latency", "slowest_trajectories", "tail", "losses"):
            _assert_close(got[key], memory[key], key)
    _assert_close(sql["timeline"], memory["timeline"], "timeline")
    _assert_close(report["inputs"], memory["inputs"], "inputs")


def _assert_close(got: Any, want: Any, where: str) -> None:
    """Equal, floats within a nanosecond (the store sums in another order)."""
    if isinstance(want, float) and isinstance(got, (int, float)):
        assert abs(got - want) <= 1e-9 * max(1.0, abs(want)), (where, got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, got, want)
        for key in want:
            _assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_close(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)
