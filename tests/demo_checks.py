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
