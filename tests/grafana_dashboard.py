"""The shipped Grafana dashboards and their PromQL, read for the tests: which metric names and
labels a query selects (tests/test_grafana.py checks the JSON; tests/test_metrics_e2e.py
checks that a real run's scrape has every one), and each query as Grafana sends it to
Prometheus (tests/test_dashboard_prometheus.py runs them on a real one)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

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


def dashboards_on(source_type: str) -> Dict[str, dict]:
    """The dashboards that query a datasource of that type."""
    return {name: d for name, d in dashboards().items() if source_type in datasource_types(d)}


def all_panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def datasource_types(dashboard: dict) -> Set[str]:
    """The types of the datasources its panels, their targets and its variables query."""
    sources = [v["datasource"] for v in dashboard.get("templating", {}).get("list", []) if "datasource" in v]
    for panel in all_panels(dashboard):
        sources += [panel.get("datasource")] + [t.get("datasource") for t in panel.get("targets", [])]
    return {source["type"] for source in sources if source}


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


# --------------------------------------------------------------------------
# What Grafana sends its Prometheus datasource for a query: the template variables and
# the interval variables substituted, the step, the time range aligned to the step.
# (Grafana's public/app/core/utils/rangeutil.ts, pkg/promlib/models/query.go and the
# Prometheus datasource's interpolateQueryExpr.)

# Grafana's variable syntax: $name, [[name:format]], ${name.field:format}
_VARIABLE = re.compile(r"\$(\w+)|\[\[(\w+?)(?::(\w+))?\]\]|\$\{(\w+)(?:\.([^:^\}]+))?(?::([^\}]+))?\}")
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000,
            "y": 31_536_000_000}
# roundInterval: an interval up to the first bound becomes the second (both ms)
_ROUNDED_MS = [(10, 1), (15, 10), (35, 20), (75, 50), (150, 100), (350, 200), (750, 500), (1500, 1000),
               (3500, 2000), (7500, 5000), (12500, 10000), (17500, 15000), (25000, 20000), (45000, 30000),
               (90000, 60000), (210000, 120000), (450000, 300000), (750000, 600000), (1050000, 900000),
               (1500000, 1200000), (2700000, 1800000), (5400000, 3600000), (9000000, 7200000),
               (16200000, 10800000), (32400000, 21600000), (86400000, 43200000)]
DEFAULT_SCRAPE_INTERVAL = "15s"  # the Prometheus datasource's, without a timeInterval
SAFE_RESOLUTION = 11000  # Grafana never asks Prometheus for more points than this


def duration_ms(text: str) -> int:
    """A Grafana interval ("15s", "1m30s", "<10s") in ms; a bare number is seconds."""
    text = text.strip().strip("<>")
    if text.isdigit():
        return int(text) * 1000
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not an interval: {text!r}")
    return sum(int(n) * _UNIT_MS[u] for n, u in parts)


def round_interval_ms(ms: float) -> int:
    for bound, rounded in _ROUNDED_MS:
        if ms <= bound:
            return rounded
    raise ValueError(f"{ms} ms: only intervals up to a day are rounded here")


def format_interval(ms: int) -> str:
    """$__interval's text (gtime.FormatInterval): the largest whole unit."""
    for unit in ("y", "d", "h", "m", "s", "ms"):
        if ms >= _UNIT_MS[unit]:
            return f"{ms // _UNIT_MS[unit]}{unit}"
    return "1ms"


def format_go_duration(ms: int) -> str:
    """$__rate_interval's text (Go's time.Duration.String): "4s", "1m0s", "1h0m0s"."""
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return (f"{hours}h{minutes}m" if hours else f"{minutes}m" if minutes else "") + f"{seconds}s"


def regex_escape(value: str) -> str:
    """The Prometheus datasource's escape of a value in a multi-value or All variable,
    for a regex matcher inside a PromQL string: ``a.b`` -> ``a\\\\.b``."""
    value = value.replace("\\", "\\\\\\\\")
    return re.sub(r"[$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m.group(0), value)


def _format_variable(variable: dict, values: List[str], fmt: Optional[str]) -> str:
    if values == ["$__all"]:
        if variable.get("allValue") is not None:
            return variable["allValue"]  # as written, whatever the format
        values = [o["value"] for o in variable.get("options", []) if o.get("value") != "$__all"]
    if fmt is None:  # the Prometheus datasource's own formatting
        if not variable.get("multi") and not variable.get("includeAll"):
            return values[0].replace("\\", "\\\\").replace("'", "\\\\'") if values else ""
        escaped = [regex_escape(v) for v in values]
        return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"
    if fmt == "raw":
        return ",".join(values)
    if fmt == "pipe":
        return "|".join(values)
    if fmt == "regex":
        escaped = [re.sub(r"[\\^$*+?.()|\[\]{}/]", lambda m: "\\" + m.group(0), v) for v in values]
        return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"
    raise ValueError(f"variable format {fmt!r} is not implemented here")


def interpolate(expr: str, variables: Dict[str, dict], selected: Dict[str, List[str]],
                builtins: Dict[str, str]) -> str:
    """``expr`` with Grafana's variables substituted: ``builtins`` (``__interval``, ...) and
    the dashboard ``variables`` (name -> templating entry) with their ``selected`` values
    (``["$__all"]``: All). An unknown variable stays, as in Grafana."""
    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2) or match.group(4)
        fmt = match.group(3) or match.group(6)
        if name in builtins and not fmt:
            return builtins[name]
        if name in variables and name in selected:
            return _format_variable(variables[name], selected[name], fmt)
        return match.group(0)

    return _VARIABLE.sub(replace, expr)


def legend_labels(legend_format: Optional[str]) -> Set[str]:
    """The labels a legend format names (``{{verl_stage}}``)."""
    return set(re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", legend_format or ""))


def label_values_query(query: str) -> Tuple[str, Optional[str]]:
    """``label_values(selector, label)`` / ``label_values(label)`` -> (label, selector)."""
    match = re.fullmatch(r"\s*label_values\(\s*(?:(.+?)\s*,\s*)?([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", query)
    if not match:
        raise ValueError(f"not a label_values query: {query!r}")
    return match.group(2), match.group(1)


@dataclass
class PrometheusRequest:
    """One panel target as Grafana's Prometheus datasource sends it."""

    expr: str
    step_s: float
    start: float  # of the range query: aligned to the step, as Grafana aligns it
    end: float
    at: float  # of the instant query: the time range's end
    instant: bool  # /api/v1/query
    range: bool  # /api/v1/query_range


def prometheus_request(panel: dict, target: dict, variables: Dict[str, dict], selected: Dict[str, List[str]],
                       start: float, end: float, scrape_interval: str, width_px: int) -> PrometheusRequest:
    """``target`` of ``panel`` for the time range ``start``..``end`` (unix s), the
    datasource's scrape interval (its ``timeInterval``) and a dashboard ``width_px``
    wide (a panel's data points default to its width in pixels)."""
    range_ms = int(round((end - start) * 1000))
    max_points = panel.get("maxDataPoints") or max(1, round(panel["gridPos"]["w"] / 24 * width_px))
    min_interval = target.get("interval") or panel.get("interval") or scrape_interval
    if min_interval.startswith("$"):  # a variable as min step: the calculation's default
        min_interval = scrape_interval
    interval = round_interval_ms(max(range_ms / max_points, duration_ms(min_interval)))
    step = max(interval, round_interval_ms(range_ms / SAFE_RESOLUTION))
    scrape = duration_ms(scrape_interval)
    rate_interval = max(interval + scrape, 4 * scrape)
    range_s = int(round(range_ms / 1000))
    builtins = {
        "__interval": format_interval(interval), "__interval_ms": str(interval),
        "__rate_interval": format_go_duration(rate_interval), "__rate_interval_ms": str(rate_interval),
        "__range": f"{range_s}s", "__range_s": str(range_s), "__range_ms": str(range_ms),
    }
    instant, range_ = bool(target.get("instant")), bool(target.get("range"))
    if not instant and not range_:  # older dashboards: a range query
        range_ = True
    step_s = step / 1000
    return PrometheusRequest(
        expr=interpolate(target["expr"], variables, selected, builtins), step_s=step_s,
        start=(start // step_s) * step_s, end=(end // step_s) * step_s, at=end, instant=instant, range=range_,
    )
