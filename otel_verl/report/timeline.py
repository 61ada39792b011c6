"""The timeline picture of ``otel-verl report --png``: one row per training step.

Each row is the step's stage Gantt (``verl.stage`` spans as coloured bars on the top lane)
over its trajectories (each ``invoke_agent`` span a thin bar, stacked by start time), on
a shared axis of seconds since the step started. Rendered with matplotlib's Agg backend
(no display needed).
"""

from __future__ import annotations

from typing import Any, Dict, List

ROW_INCHES = 1.9  # height of one step's row
HEADER_INCHES = 0.9  # title and legend
WIDTH_INCHES = 11.0
DPI = 90
TRAJECTORY_COLOR = "#4c72b0"


def layout(report: Dict[str, Any]) -> Dict[str, Any]:
    """What :func:`draw` puts where (also what tests check the picture against)."""
    rows = report["timeline"]
    return {
        "rows": [{"step": r["step"], "stage_bars": len(r["stages"]), "trajectory_bars": len(r["trajectories"])} for r in rows],
        "width_px": round(WIDTH_INCHES * DPI),
        "height_px": round((HEADER_INCHES + ROW_INCHES * max(1, len(rows))) * DPI),
        "stages": sorted({b["stage"] for r in rows for b in r["stages"]}, key=_stage_key(report)),
    }


def _stage_key(report: Dict[str, Any]):
    order = {stage: i for i, stage in enumerate(report["stage_order"])}
    return lambda stage: (order.get(stage, len(order)), stage)


def draw(report: Dict[str, Any], path: str) -> Dict[str, Any]:
    """Write the PNG to ``path``; returns :func:`layout`."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib import pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    info = layout(report)
    rows: List[Dict[str, Any]] = report["timeline"]
    n = max(1, len(rows))
    fig, axes = plt.subplots(
        n, 1, squeeze=False,
        figsize=(info["width_px"] / DPI, info["height_px"] / DPI), dpi=DPI,
    )
    palette = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    colors = {stage: palette[i % len(palette)] for i, stage in enumerate(info["stages"])}
    try:
        for ax, row in zip(axes[:, 0], rows):
            trajs = row["trajectories"]
            lanes = max(1, len(trajs))
            # trajectories fill [0, 1); the stage lane sits above them at [1.15, 1.75)
            if trajs:  # one collection per step: stacked thin bars, one lane each
                height = 1.0 / lanes
                verts = []
                for i, b in enumerate(trajs):
                    y0, y1 = i * height, (i + 0.8) * height
                    x0, x1 = b["start_s"], b["start_s"] + b["duration_s"]
                    verts.append([(x0, y0), (x0, y1), (x1, y1), (x1, y0)])
                ax.add_collection(PolyCollection(verts, facecolors=TRAJECTORY_COLOR, edgecolors="none"))
            for b in row["stages"]:
                ax.broken_barh([(b["start_s"], max(b["duration_s"], 0.0))], (1.15, 0.6), facecolors=colors[b["stage"]])
            ends = [b["start_s"] + b["duration_s"] for b in row["stages"] + trajs] or [1.0]
            ax.set_xlim(0, max(ends) * 1.01 or 1.0)
            ax.set_ylim(-0.05, 1.8)
            ax.set_yticks([0.5, 1.45], [f"{len(trajs)} traj.", "stages"], fontsize=8)
            ax.set_ylabel(f"step {row['step']}", rotation=0, ha="right", va="center", fontsize=10)
            ax.tick_params(axis="x", labelsize=8)
            ax.grid(axis="x", alpha=0.3)
        axes[-1, 0].set_xlabel("seconds since the step started")
        handles = [Patch(color=colors[s], label=s) for s in info["stages"]]
        handles.append(Patch(color=TRAJECTORY_COLOR, label="trajectory (invoke_agent)"))
        fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
        fig.suptitle("otel-verl timeline: stages and rollouts per step", y=1 - 0.15 / (info["height_px"] / DPI), fontsize=10)
        fig.subplots_adjust(left=0.12, right=0.98, top=1 - HEADER_INCHES / (info["height_px"] / DPI),
                            bottom=0.45 / (info["height_px"] / DPI), hspace=0.45)
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)
    return info
