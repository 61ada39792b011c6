"""The timeline picture of ``otel-verl report --png``: one row per training step.

Each row holds two panels on the same clock (seconds since the step started): on the
left the step's stage Gantt (``verl.stage`` spans as coloured bars, stages that ran at
once in lanes of their own, the span of its rollouts as a bar below), on the right the rollout window, each trajectory
(``invoke_agent`` span) a thin bar, stacked by start time. A run longer than
``MAX_ROWS`` steps shows that many, evenly spread from the first to the last. Rendered
with matplotlib's Agg backend (no display needed); matplotlib comes with the ``report``
extra.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List

ROW_INCHES = 1.9  # height of one step's row
HEADER_INCHES = 0.9  # title and legend
FOOTER_INCHES = 0.5  # x axis labels
WIDTH_INCHES = 11.0
DPI = 90
TRAJECTORY_COLOR = "#3b3b3b"
MAX_ROWS = 24
STAGE_BAND = (0.4, 0.6)  # (bottom, height) of the stages' bars in a step's Gantt, shared by its lanes


def _shown(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    if len(rows) <= MAX_ROWS:
        return rows
    picks = sorted({round(i * (len(rows) - 1) / (MAX_ROWS - 1)) for i in range(MAX_ROWS)})
    return [rows[i] for i in picks]


def layout(report: Dict[str, Any]) -> Dict[str, Any]:
    """What :func:`draw` puts where (also what tests check the picture against)."""
    rows = _shown(report["timeline"])
    return {
        "steps_total": len(report["timeline"]),
        "rows": [{"step": r["step"], "stage_bars": len(r["stages"]), "stage_lanes": _lanes(r),
                  "trajectory_bars": len(r["trajectories"])} for r in rows],
        "width_px": round(WIDTH_INCHES * DPI),
        "height_px": round((HEADER_INCHES + FOOTER_INCHES + ROW_INCHES * max(1, len(rows))) * DPI),
        "stages": sorted({b["stage"] for r in rows for b in r["stages"]}, key=_stage_key(report)),
    }


def _lanes(row: Dict[str, Any]) -> int:
    return 1 + max((b.get("lane", 0) for b in row["stages"]), default=0)


def _stage_key(report: Dict[str, Any]):
    order = {stage: i for i, stage in enumerate(report["stage_order"])}
    return lambda stage: (order.get(stage, len(order)), stage)


class MatplotlibMissing(RuntimeError):
    """matplotlib is not installed: the timeline cannot be drawn."""


INSTALL_HINT = "pip install 'otel-verl[report]'"


def require_matplotlib() -> None:
    """Raise :class:`MatplotlibMissing`, naming the extra to install, when :func:`draw`
    cannot run here."""
    try:
        importlib.import_module("matplotlib")
    except ImportError as exc:
        raise MatplotlibMissing(f"the timeline PNG needs matplotlib, which is not installed: {INSTALL_HINT}") from exc


def draw(report: Dict[str, Any], path: str) -> Dict[str, Any]:
    """Write the PNG to ``path``; returns :func:`layout`."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib import pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    info = layout(report)
    rows: List[Dict[str, Any]] = _shown(report["timeline"])
    height_in = info["height_px"] / DPI
    fig, axes = plt.subplots(
        max(1, len(rows)), 2, squeeze=False, gridspec_kw={"width_ratios": [3, 2]},
        figsize=(info["width_px"] / DPI, height_in), dpi=DPI,
    )
    palette = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    colors = {stage: palette[i % len(palette)] for i, stage in enumerate(info["stages"])}
    try:
        for (gantt, rollout), row in zip(axes, rows):
            trajs = row["trajectories"]
            # left: the whole step, stages as bars; the trajectories' window as a thin bar below
            lane_height = STAGE_BAND[1] / _lanes(row)
            for b in row["stages"]:
                gantt.broken_barh([(b["start_s"], b["duration_s"])],
                                  (STAGE_BAND[0] + b.get("lane", 0) * lane_height, lane_height * 0.9),
                                  facecolors=colors[b["stage"]])
            if trajs:
                lo = min(b["start_s"] for b in trajs)
                hi = max(b["start_s"] + b["duration_s"] for b in trajs)
                gantt.broken_barh([(lo, hi - lo)], (0.05, 0.2), facecolors=TRAJECTORY_COLOR)
            ends = [b["start_s"] + b["duration_s"] for b in row["stages"] + trajs]
            gantt.set_xlim(0, max(ends + [1e-3]) * 1.01)
            gantt.set_ylim(0, 1.05)
            gantt.set_yticks([0.15, 0.7], ["rollouts", "stages"], fontsize=8)
            gantt.set_title(f"step {row['step']}", loc="left", fontsize=9, fontweight="bold")
            # right: the rollout window, one thin bar per trajectory, stacked by start time
            if trajs:
                lanes = len(trajs)
                verts = []
                for i, b in enumerate(trajs):
                    y0, y1 = i / lanes, (i + 0.8) / lanes
                    x0, x1 = b["start_s"], b["start_s"] + b["duration_s"]
                    verts.append([(x0, y0), (x0, y1), (x1, y1), (x1, y0)])
                rollout.add_collection(PolyCollection(verts, facecolors=TRAJECTORY_COLOR, edgecolors="none"))
                pad = (hi - lo) * 0.02 or 1e-3
                rollout.set_xlim(lo - pad, hi + pad)
            rollout.set_ylim(0, 1)
            rollout.set_yticks([])
            rollout.set_ylabel(f"{len(trajs)} traj.", fontsize=8)
            for ax in (gantt, rollout):
                ax.tick_params(axis="x", labelsize=8)
                ax.grid(axis="x", alpha=0.3)
        axes[-1, 0].set_xlabel("seconds since the step started", fontsize=9)
        axes[-1, 1].set_xlabel("rollout window (same clock)", fontsize=9)
        handles = [Patch(color=colors[s], label=s) for s in info["stages"]]
        handles.append(Patch(color=TRAJECTORY_COLOR, label="trajectory (invoke_agent)"))
        fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.3 / height_in),
                   ncol=min(len(handles), 7), fontsize=8, frameon=False)
        title = "otel-verl timeline: stages and rollouts per step"
        if len(rows) < info["steps_total"]:
            title += f" ({len(rows)} of {info['steps_total']} steps, evenly spread)"
        fig.suptitle(title, y=1 - 0.05 / height_in, fontsize=10)
        fig.subplots_adjust(left=0.08, right=0.98, top=1 - HEADER_INCHES / height_in,
                            bottom=FOOTER_INCHES / height_in, hspace=0.6, wspace=0.08)
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)
    return info
