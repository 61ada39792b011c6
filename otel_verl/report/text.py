"""The report as terminal tables (rich)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from rich import box
from rich.console import Console
from rich.table import Table


def _s(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def _table(console: Console, title: str, columns: List[str]) -> Table:
    console.print()
    console.print(title, markup=False, highlight=False, style="bold")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True)
    return table


def render(report: Dict[str, Any], console: Console) -> None:
    inputs = report["inputs"]
    runs = ", ".join(report["runs"]) or "-"
    console.print(
        f"{inputs['spans']} spans in {inputs['traces']} traces from {len(inputs['otlp_files'])} file(s), "
        f"{inputs['lines']} line(s); run {runs}; trainer {report['trainer'] or '-'}",
        markup=False, highlight=False,
    )
    console.print(f"truncated: {inputs['truncated']}", markup=False, highlight=False)

    stages = report["stage_order"]
    table = _table(console, "Steps (s): verl.step and its verl.stage spans", ["step", "total", *stages, "other"])
    for row in report["steps"]:
        table.add_row(
            str(row["step"]) + ("" if row["finished"] else " (open)"),
            _s(row["duration_s"]),
            *(_s(row["stages"].get(stage)) for stage in stages),
            _s(row["other_s"]),
        )
    console.print(table)

    table = _table(console, "Rollout latency per step (s): trajectory (invoke_agent) spans",
                   ["step", "trajectories", "p50", "p90", "p99", "max"])
    for row in report["rollout_latency"]:
        table.add_row(str(row["step"]), str(row["count"]), _s(row["p50_s"]), _s(row["p90_s"]), _s(row["p99_s"]), _s(row["max_s"]))
    console.print(table)

    table = _table(
        console,
        f"Slowest trajectories (s) of {report['trajectories']}: LLM = client time of its LLM spans; queue / prefill / "
        "decode = the server's share of it; client = the rest of it (routing, transport)",
        ["uid/traj", "step", "total", "turns", "LLM", "queue", "prefill", "decode", "client", "tools", "reward", "other"],
    )
    for t in report["slowest_trajectories"]:
        server = t["llm_server_s"] or {}
        table.add_row(
            f"{t['uid']}/{t['traj_uid']}", str(t["step"]), _s(t["duration_s"]), str(t["turns"]), _s(t["llm_s"]),
            _s(server.get("queue")), _s(server.get("prefill")), _s(server.get("decode")),
            _s(server.get("client_overhead")), _s(t["tool_s"]), _s(t["reward_s"]), _s(t["other_s"]),
        )
    console.print(table)

    samples = report["samples"]
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

    losses = report["losses"]
    console.print("", markup=False)
    console.print(f"Loss counters: {losses['note']}", markup=False, highlight=False)
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
