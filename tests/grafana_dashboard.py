"""The shipped Grafana dashboards and their PromQL, read for the tests: which metric names and
labels a query selects (tests/test_grafana.py checks the JSON; tests/test_metrics_e2e.py
checks that a real run's scrape has every one)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

REPO_ROOT = Path(__file__).resolve().parent.parent
GRAFANA_DIR = REPO_ROOT / "collector-config" / "grafana"
DASHBOARDS_DIR = GRAFANA_DIR / "dashboards"
PROVISIONING_DIR = GRAFANA_DIR / "provisioning"

# PromQL words that are followed by "(" or stand alone, never a metric name
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                 "offset"}
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{((?:[^}\"]|\"(?:[^\"\\\\]|\\.)*\")*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*\"((?:[^\"\\]|\\.)*)\"")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def dashboards() -> Dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS_DIR.glob("*.json"))}


def all_panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def prometheus_exprs(dashboard: dict) -> List[str]:
    """Every PromQL expression: panel targets and query variables."""
    exprs = [t["expr"] for p in all_panels(dashboard) for t in p.get("targets", []) if "expr" in t]
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        if variable.get("type") == "query" and isinstance(query, dict) and query.get("query"):
            exprs.append(query["query"])
    return exprs


def selectors(expr: str) -> List[Tuple[str, Set[str], Set[str]]]:
    """``(metric, matcher labels, grouping labels)`` of each vector selector in ``expr``
    (``label_values(metric, label)`` counts as a selector of ``label``). Grafana's
    ``$variables`` are no PromQL and are left out."""
    grouping = {label.strip() for group in _GROUPING.findall(expr) for label in group.split(",") if label.strip()}
    grouping.discard("le")  # a histogram's bucket label, on every *_bucket series
    out = []
    for name, inner in _SELECTOR.findall(expr):
        out.append((name, {label for label, _, _ in _MATCHER.findall(inner)}, set(grouping)))
    for name, label in re.findall(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)",
                                  expr):
        out.append((name, {label}, set()))
    return out


def unbraced_names(expr: str) -> Set[str]:
    """Names in ``expr`` that are neither functions, keywords, labels in braces or
    groupings, nor selectors with braces: a query the tests cannot check (each dashboard
    query selects its metric with braces)."""
    stripped = re.sub(r"\"(?:[^\"\\\\]|\\.)*\"", "\"\"", expr)
    stripped = re.sub(r"\{[^}]*\}", "{}", stripped)
    stripped = _GROUPING.sub("", stripped)
    stripped = re.sub(r"\[[^\]]*\]", "", stripped)
    stripped = re.sub(r"label_values\([^)]*\)", "", stripped)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", stripped):
        word, end = match.group(0), match.end()
        rest = stripped[end:].lstrip()
        if word in _PROMQL_WORDS or rest.startswith("(") or rest.startswith("{"):
            continue
        if stripped[max(0, match.start() - 1)] == "$":
            continue
        names.add(word)
    return names
