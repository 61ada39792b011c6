"""The report as terminal tables (rich)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from rich import box
from rich.console import Console
from rich.table import Table

from otel_verl.tools.report.compare import LATENCY_KEYS, shape_text


def _s(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def _table(console: Console, title: str, columns: List[str]) -> Table:
    console.print()
    console.print(title, markup=False, highlight=False, style="bold")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True)
    return table


CONCURRENT_MARK = "*"  # after a stage's time: it overlapped another stage of the step
SPLIT_COLUMNS = ["queue", "prefill", "decode", "client", "tools", "reward", "other"]


def _split_cells(t: Dict[str, Any]) -> List[str]:
    """A trajectory's split (:func:`otel_verl.tools.report.spans.trajectory_split`) under ``SPLIT_COLUMNS``."""
    server = t["llm_server_s"] or {}
    return [_s(server.get("queue")), _s(server.get("prefill")), _s(server.get("decode")),
            _s(server.get("client_overhead")), _s(t["tool_s"]), _s(t["reward_s"]), _s(t["other_s"])]


def _render_tail(tail: Dict[str, Any], console: Console) -> None:
    rows = tail["steps"]
    table = _table(console, "Critical path per step (s): of the trajectories the step trained, the one that ended last "
                   "(generated: in which step; started: after the window's start), and its replica",
                   ["step", "rollout wall", "uid/traj", "generated", "started", "total", "replica", *SPLIT_COLUMNS])
    for row in rows:
        t = row["critical_path"]
        if t is None:
            table.add_row(str(row["step"]), "-", "no trajectories", *["-"] * (4 + len(SPLIT_COLUMNS)))
            continue
        generated = "-" if t["generation_step"] is None else str(t["generation_step"])
        table.add_row(str(row["step"]), _s(row["rollout_window"]["wall_s"]), f"{t['uid']}/{t['traj_uid']}", generated,
                      _s(t["started_s"]), _s(t["duration_s"]), t["replica"] or "-", *_split_cells(t))
    console.print(table)
    if tail.get("untrained"):
        console.print(f"{tail['untrained']} trajectories trained in no step (async: generated, never consumed): "
                      "in no step's critical path", markup=False, highlight=False)

    if not tail["replicas"]:
        console.print()
        console.print("LLM server replicas: none named in these spans (no verl.llm_server.generate spans, "
                      "no verl.llm.server_id)", markup=False, highlight=False)
    else:
        table = _table(console, f"LLM server replicas per step ({len(tail['replicas'])} in the run): busy = the union of "
                       "its requests within the step's rollout window (s)",
                       ["step", "busiest", "busy", "requests", "idlest", "busy", "requests"])
        for row in rows:
            load = row["replicas"]
            if load is None:
                continue
            hi, lo = load["busiest"], load["idlest"]
            table.add_row(str(row["step"]), hi["replica"], _s(hi["busy_s"]), str(hi["requests"]),
                          lo["replica"], _s(lo["busy_s"]), str(lo["requests"]))
        console.print(table)

    table = _table(console, "Waiting per step (s): training = the trainer waiting for samples (generation, fetch_batch, "
                   "the start before its first other stage); rollout = no trajectory running",
                   ["step", "step time", "training waits", "rollout waits"])
    for row in rows:
        wait = row["waiting"]
        if wait is not None:
            table.add_row(str(row["step"]), _s(wait["step_s"]), _s(wait["training_s"]), _s(wait["rollout_s"]))
    console.print(table)

    staleness = tail["staleness"]
    if not staleness["lineage"]:
        console.print()
        console.print(f"Staleness: {staleness['note']}", markup=False, highlight=False)
        return
    values = sorted({h["staleness"] for row in staleness["per_step"] for h in row["histogram"]})
    table = _table(console, "Staleness of the trained samples: verl.sample roots per verl.trained_step and verl.staleness "
                   "(steps behind the weights that generated them)", ["trained step", "samples", *map(str, values)])
    for row in staleness["per_step"]:
        counts = {h["staleness"]: h["samples"] for h in row["histogram"]}
        table.add_row(str(row["trained_step"]), str(row["samples"]), *(str(counts.get(v, 0)) for v in values))
    console.print(table)


def _render_steps(report: Dict[str, Any], console: Console) -> None:
    """The steps and rollout-latency tables."""
    stages = report["stage_order"]
    overlap = {row["step"]: row for row in report.get("stage_overlap", ())}
    concurrent = any(row["concurrent_s"] > 0 for row in overlap.values())
    table = _table(console, "Steps (s): verl.step and its verl.stage spans",
                   ["step", "total", *stages, "other", *(["concurrent"] if concurrent else [])])
    for row in report["steps"]:
        mine = overlap.get(row["step"], {})
        marked = set(mine.get("concurrent_stages", ()))
        table.add_row(
            str(row["step"]) + ("" if row["finished"] else " (open)"),
            _s(row["duration_s"]),
            *(_s(row["stages"].get(stage)) + (CONCURRENT_MARK if stage in marked else "") for stage in stages),
            _s(row["other_s"]),
            *([_s(mine.get("concurrent_s"))] if concurrent else []),
        )
    console.print(table)
    if concurrent:
        console.print(f"{CONCURRENT_MARK} ran while another stage ran: each stage's time is its own, so a step's stage "
                      "columns add to more than it by 'concurrent' (total = stages - concurrent + other)",
                      markup=False, highlight=False)

    table = _table(console, "Rollout latency per step (s): trajectory (invoke_agent) spans",
                   ["step", "trajectories", "p50", "p90", "p99", "max"])
    for row in report["rollout_latency"]:
        table.add_row(str(row["step"]), str(row["count"]), _s(row["p50_s"]), _s(row["p90_s"]), _s(row["p99_s"]), _s(row["max_s"]))
    console.print(table)


def render(report: Dict[str, Any], console: Console) -> None:
    inputs = report["inputs"]
    runs = ", ".join(report["runs"]) or "-"
    if report.get("no_spans"):
        # every section but the loss counters reads spans: none printed empty, no verdict on spans
        console.print(report["no_spans"]["line"], markup=False, highlight=False)
        console.print(f"run {runs}", markup=False, highlight=False)
        _render_loss_counters(report["losses"], console)
        console.print()
        return
    selected = report["selected_steps"]
    read = (f"from {len(inputs['otlp_files'])} file(s), {inputs['lines']} line(s)" if inputs["otlp_files"]
            else f"from {', '.join(inputs['paths'])}")
    console.print(
        f"{inputs['spans']} spans in {inputs['traces']} traces {read}; run {runs}; trainer {report['trainer'] or '-'}"
        + (f"; steps {selected[0]}-{selected[1]}" if selected else ""),
        markup=False, highlight=False,
    )
    console.print(f"truncated: {inputs['truncated']}", markup=False, highlight=False)

    _render_steps(report, console)
    _render_slowest(report, console)
    _render_tail(report["tail"], console)
    _render_samples(report["samples"], console)
    _render_losses(report["losses"], console)


def _render_slowest(report: Dict[str, Any], console: Console) -> None:
    table = _table(
        console,
        f"Slowest trajectories (s) of {report['trajectories']}: LLM = client time of its LLM spans; queue / prefill / "
        "decode = the server's share of it; client = the rest of it (routing, transport)",
        ["uid/traj", "step", "total", "turns", "LLM", *SPLIT_COLUMNS],
    )
    for t in report["slowest_trajectories"]:
        table.add_row(f"{t['uid']}/{t['traj_uid']}", str(t["step"]), _s(t["duration_s"]), str(t["turns"]), _s(t["llm_s"]),
                      *_split_cells(t))
    console.print(table)


def _render_samples(samples: Dict[str, Any], console: Console) -> None:
    outcomes = ", ".join(f"{k} {v}" for k, v in samples["outcomes"].items()) or "-"
    console.print()
    console.print(f"Samples: {samples['roots']} verl.sample roots ({outcomes})", markup=False, highlight=False)
    if not samples["unfinished_count"]:
        console.print("never finished: none", markup=False, highlight=False)
    else:
        table = _table(console, f"never finished: {samples['unfinished_count']}", ["uid", "step", "state", "last seen"])
        for u in samples["unfinished"]:
            table.add_row(u["uid"], str(u["step"] if u["step"] is not None else "-"), u["state"], u["last_seen"])
        console.print(table)
        if samples["unfinished_count"] > len(samples["unfinished"]):
            console.print(f"... and {samples['unfinished_count'] - len(samples['unfinished'])} more (--json lists them)",
                          markup=False, highlight=False)


def _render_losses(losses: Dict[str, Any], console: Console) -> None:
    _render_loss_counters(losses, console)
    limits = losses["span_limit_drops"]
    console.print(
        f"SDK span-limit drops: attributes {limits['attributes']}, events {limits['events']}, links {limits['links']}",
        markup=False, highlight=False,
    )
    if losses["consistency"]:
        table = _table(console, "Legacy files vs spans", ["legacy output", "lines", "trajectory spans", "verdict"])
        for c in losses["consistency"]:
            table.add_row(c["what"], str(c["legacy"]), str(c["trajectory_spans"]), c["verdict"])
        console.print(table)
    else:
        console.print("Legacy files vs spans: no legacy files among the inputs", markup=False, highlight=False)
    console.print()


def _render_loss_counters(losses: Dict[str, Any], console: Console) -> None:
    console.print("", markup=False)
    console.print(f"Loss counters: {losses['note']}", markup=False, highlight=False)


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def render_comparison(comparison: Dict[str, Any], console: Console) -> None:
    """:func:`otel_verl.tools.report.compare.compare`'s result as tables."""
    for name in ("a", "b"):
        side = comparison[name]
        console.print(f"{name.upper()}: {', '.join(side['paths'])} (run {', '.join(side['runs']) or '-'}; "
                      f"{shape_text(side['shape'])})", markup=False, highlight=False)
    console.print(comparison["summary"], markup=False, highlight=False)

    table = _table(console, "Steps (s): verl.step, A beside B", ["step", "A", "B", "B/A"])
    for row in comparison["steps"]:
        table.add_row(str(row["step"]), _s(row["a_s"]), _s(row["b_s"]), _ratio(row["ratio"]))
    total = comparison["steps_total"]
    if total is not None:
        table.add_row("all", _s(total["a_s"]), _s(total["b_s"]), _ratio(total["ratio"]))
    console.print(table)

    table = _table(console, "Stages (s) summed over the steps both runs have", ["stage", "A", "B", "B/A"])
    for row in comparison["stages"]:
        table.add_row(row["stage"] + (CONCURRENT_MARK if row["concurrent"] else ""), _s(row["a_s"]), _s(row["b_s"]),
                      _ratio(row["ratio"]))
    console.print(table)
    if any(row["concurrent"] for row in comparison["stages"]):
        console.print(f"{CONCURRENT_MARK} ran while another stage ran: the stages add to more than the steps",
                      markup=False, highlight=False)

    table = _table(console, "Rollout latency per step (s): trajectory (invoke_agent) spans",
                   ["step", "", "A", "B", "B/A"])
    for row in comparison["rollout_latency"]:
        for key in LATENCY_KEYS:
            cell = str if key == "count" else _s
            table.add_row(str(row["step"]) if key == "count" else "", "trajectories" if key == "count" else key[:-2],
                          cell(row["a"][key]), cell(row["b"][key]), _ratio(row["ratio"][key]))
    console.print(table)
    console.print()
