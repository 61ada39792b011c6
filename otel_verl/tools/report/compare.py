"""``otel-verl report --compare A B``: two runs side by side.

Each of A and B is one run's report (:func:`otel_verl.tools.store.report.read`: a trace
dir, OTLP-JSON files, or a run of a ClickHouse server's store). :func:`compare` puts their steps,
stages and rollout latency percentiles next to each other with the ratio B/A:

- ``steps``: each step both runs have, its ``verl.step`` duration in A and B;
  ``steps_total`` their sum;
- ``stages``: each stage both runs have (and ``other``), its time summed over those steps,
  and ``concurrent``: whether it ran at once with another stage in one of them (the
  stages' times then add to more than the steps');
- ``rollout_latency``: each step both runs have trajectories for, the trajectory count
  and p50 / p90 / p99 / max of their durations;
- ``differences``: where the runs' shapes (trainer, layout, sync/async, prompts per step,
  n, steps) or stages differ, and ``summary``, the line that says so.

A ratio is ``None`` where either side is missing or A's is 0. :func:`draw` draws the
comparison PNG (matplotlib, as :mod:`otel_verl.tools.report.timeline`).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from otel_verl.tools.report.timeline import DPI, require_matplotlib

SECTIONS = ("steps", "stage_overlap", "rollout_latency", "shape")  # what a comparison reads of each report
SHAPE_KEYS = ("trainer", "layout", "mode", "prompts", "n", "steps")
LATENCY_KEYS = ("count", "p50_s", "p90_s", "p99_s", "max_s")
OTHER = "other"
WIDTH_INCHES = 14.0
HEIGHT_INCHES = 4.8
COLORS = {"a": "#1f77b4", "b": "#ff7f0e"}


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """B/A; ``None`` where either is unknown or A is 0."""
    if a is None or b is None or a == 0 or (isinstance(a, float) and math.isnan(a)) \
            or (isinstance(b, float) and math.isnan(b)):
        return None
    return b / a


def _side(a: Optional[float], b: Optional[float]) -> Dict[str, Optional[float]]:
    return {"a_s": a, "b_s": b, "ratio": ratio(a, b)}


def _sum(values: List[Optional[float]]) -> Optional[float]:
    return None if any(v is None for v in values) else sum(values)


def shape_text(shape: Dict[str, Any]) -> str:
    """``RayPPOTrainer, colocated, sync, 4 prompts x n=2, 2 steps``."""
    known = {key: "?" if shape[key] is None else shape[key] for key in ("prompts", "n")}
    return (f"{shape['trainer'] or '-'}, {shape['layout'] or '-'}, {shape['mode']}, "
            f"{known['prompts']} prompts x n={known['n']}, {shape['steps']} steps")


def _listed(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return "-" if value is None else str(value)


def compare(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    """Two reports side by side (see the module docstring for the keys); they need
    :data:`SECTIONS`."""
    a_steps = {row["step"]: row for row in a["steps"]}
    b_steps = {row["step"]: row for row in b["steps"]}
    shared_steps = sorted(set(a_steps) & set(b_steps))
    steps = [{"step": step, **_side(a_steps[step]["duration_s"], b_steps[step]["duration_s"])} for step in shared_steps]
    steps_total = _side(_sum([r["a_s"] for r in steps]), _sum([r["b_s"] for r in steps])) if steps else None

    shared_stages = [s for s in a["stage_order"] if s in b["stage_order"]]
    concurrent = {stage for report in (a, b) for row in report["stage_overlap"] if row["step"] in shared_steps
                  for stage in row["concurrent_stages"]}
    stages = []
    for stage in shared_stages + [OTHER]:
        def total(rows: Dict[Any, Dict[str, Any]]) -> Optional[float]:
            if stage == OTHER:
                return _sum([rows[step]["other_s"] for step in shared_steps]) if shared_steps else None
            return sum(rows[step]["stages"].get(stage, 0.0) for step in shared_steps)
        stages.append({"stage": stage, **_side(total(a_steps), total(b_steps)), "concurrent": stage in concurrent})

    a_lat = {row["step"]: row for row in a["rollout_latency"]}
    b_lat = {row["step"]: row for row in b["rollout_latency"]}
    latency = []
    for step in sorted(set(a_lat) & set(b_lat), key=lambda s: (s is None, s if isinstance(s, int) else 0)):
        latency.append({
            "step": step,
            "a": {key: a_lat[step][key] for key in LATENCY_KEYS},
            "b": {key: b_lat[step][key] for key in LATENCY_KEYS},
            "ratio": {key: ratio(a_lat[step][key], b_lat[step][key]) for key in LATENCY_KEYS},
        })

    differences = [{"what": key, "a": a["shape"][key], "b": b["shape"][key]}
                   for key in SHAPE_KEYS if a["shape"][key] != b["shape"][key]]
    only_a = [s for s in a["stage_order"] if s not in b["stage_order"]]
    only_b = [s for s in b["stage_order"] if s not in a["stage_order"]]
    if only_a or only_b:
        differences.append({"what": "stages only in one", "a": only_a, "b": only_b})
    if a_steps.keys() != b_steps.keys() and len(a_steps) == len(b_steps):
        differences.append({"what": "step numbers", "a": sorted(a_steps), "b": sorted(b_steps)})
    if differences:
        said = "; ".join(f"{d['what']} {_listed(d['a'])} vs {_listed(d['b'])}" for d in differences)
        summary = (f"the runs differ: {said}; compared on what they share: "
                   f"{len(shared_steps)} step(s), {len(shared_stages)} stage(s)")
    else:
        summary = f"the runs have the same shape: {shape_text(a['shape'])}"
    return {
        **{name: {"paths": r["inputs"]["paths"], "runs": r["runs"], "shape": r["shape"],
                  **{key: r["inputs"][key] for key in ("truncated_files", "repaired_files", "skipped_files")}}
           for name, r in (("a", a), ("b", b))},
        "differences": differences,
        "summary": summary,
        "steps": steps,
        "steps_total": steps_total,
        "stages": stages,
        "rollout_latency": latency,
    }


def layout(comparison: Dict[str, Any]) -> Dict[str, Any]:
    """What :func:`draw` puts where (also what tests check the picture against)."""
    return {
        "panels": ["step time", "stage time", "rollout latency"],
        "steps": [row["step"] for row in comparison["steps"]],
        "stages": [row["stage"] for row in comparison["stages"]],
        "latency_steps": [row["step"] for row in comparison["rollout_latency"]],
        "width_px": round(WIDTH_INCHES * DPI),
        "height_px": round(HEIGHT_INCHES * DPI),
    }


def _label(side: Dict[str, Any], name: str) -> str:
    return f"{name}: {', '.join(side['paths'])}"


def draw(comparison: Dict[str, Any], path: str) -> Dict[str, Any]:
    """Write the comparison PNG to ``path``: step times per step, stage times over the
    shared steps and the rollout latency percentiles per step, A beside B; returns
    :func:`layout`."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib import pyplot as plt

    info = layout(comparison)
    fig, (steps_ax, stages_ax, latency_ax) = plt.subplots(
        1, 3, figsize=(WIDTH_INCHES, HEIGHT_INCHES), dpi=DPI, gridspec_kw={"width_ratios": [2, 3, 3]})
    width = 0.4
    try:
        rows = comparison["steps"]
        xs = range(len(rows))
        for offset, side in ((-width / 2, "a"), (width / 2, "b")):
            steps_ax.bar([x + offset for x in xs], [r[f"{side}_s"] or 0.0 for r in rows], width,
                         color=COLORS[side], label=side.upper())
        steps_ax.set_xticks(list(xs), [str(r["step"]) for r in rows])
        steps_ax.set_xlabel("step", fontsize=9)
        steps_ax.set_ylabel("seconds", fontsize=9)
        steps_ax.set_title("step time (verl.step)", fontsize=9, loc="left")

        stages = comparison["stages"]
        ys = range(len(stages))
        for offset, side in ((-width / 2, "a"), (width / 2, "b")):
            stages_ax.barh([y + offset for y in ys], [r[f"{side}_s"] or 0.0 for r in stages], width,
                           color=COLORS[side], label=side.upper())
        for y, r in zip(ys, stages):
            if r["ratio"] is not None:
                stages_ax.annotate(f"{r['ratio']:.2f}x", (max(r["a_s"] or 0.0, r["b_s"] or 0.0), y),
                                   xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
        stages_ax.set_yticks(list(ys), [r["stage"] for r in stages], fontsize=8)
        stages_ax.invert_yaxis()
        if any((r["a_s"] or 0.0) > 0 or (r["b_s"] or 0.0) > 0 for r in stages):
            stages_ax.set_xscale("log")  # generation dwarfs the training stages
        stages_ax.set_xlabel("seconds over the shared steps, log scale (B/A beside the bars)", fontsize=9)
        stages_ax.set_title("stage time", fontsize=9, loc="left")

        latency = comparison["rollout_latency"]
        xs = range(len(latency))
        palette = plt.get_cmap("tab10").colors
        for i, key in enumerate(("p50_s", "p90_s", "p99_s", "max_s")):
            for side, style in (("a", "-"), ("b", "--")):
                latency_ax.plot(list(xs), [r[side][key] for r in latency], style, marker="o", markersize=3,
                                color=palette[i], label=f"{key[:-2]} {side.upper()}")
        latency_ax.set_xticks(list(xs), [str(r["step"]) for r in latency])
        latency_ax.set_xlabel("step", fontsize=9)
        latency_ax.set_ylabel("seconds", fontsize=9)
        latency_ax.set_title("rollout latency (invoke_agent): A solid, B dashed", fontsize=9, loc="left")
        latency_ax.legend(fontsize=7, ncol=4, frameon=False)

        for ax in (steps_ax, stages_ax, latency_ax):
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
        steps_ax.legend(fontsize=8, frameon=False)
        fig.suptitle(f"otel-verl compare   {_label(comparison['a'], 'A')}   vs   {_label(comparison['b'], 'B')}\n"
                     f"{comparison['summary']}", fontsize=9)
        fig.subplots_adjust(left=0.05, right=0.98, top=0.82, bottom=0.13, wspace=0.3)
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)
    return info
