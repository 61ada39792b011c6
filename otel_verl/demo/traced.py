"""``otel-verl demo``: the CPU harness (real verl on a real local Ray cluster, stand-ins
only for GPU parts) with tracing switched on exactly as a user would switch it on.

Everything goes to the trace dir: the legacy files (``sample/``, ``progress/``,
``trajectory/``), the embedded OTLP-JSON spans (``otlp/``) and the harness's own
working files (``harness/``). With ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, spans are also
exported over OTLP.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shlex
import uuid
from typing import Any, Dict, List, Optional, Sequence

from otel_verl.demo.common import PHASES_FILE
from otel_verl.demo.progress import ProgressReporter


def run_demo(
    trace_dir: str,
    *,
    steps: int = 2,
    prompts: int = 4,
    n: int = 4,
    agent: str = "tool",
    trainer: str = "v0",
    server: Optional[str] = None,
    validate: bool = True,
    extra_env: Optional[Dict[str, str]] = None,
    worker_env: Optional[Dict[str, str]] = None,
    overrides: Sequence[str] = (),
    progress: bool = True,
    **harness_kwargs: Any,
) -> Dict[str, Any]:
    """Run the traced demo and return the harness summary plus where the outputs are.

    ``trainer`` picks the harness: ``v0`` (:func:`otel_verl.demo.harness.run_v0`),
    ``separation`` (the same harness with verl's experimental ``SeparateRayPPOTrainer``) or
    ``v1`` (:func:`otel_verl.demo.harness_v1.run_v1`, ``mode=`` among its keywords).
    ``extra_env`` goes into this process's environment (and so is forwarded to the
    workers when it is a tracing variable); ``worker_env`` only into the Ray workers'
    runtime env (e.g. ``PYTHONPATH`` for a custom agent loop's module). ``overrides`` and
    any other keyword (``adv_estimator``, ``agent_name``, ``agent_loop_config_path``,
    ``mode``, ...) go to the harness. ``server``: ``sglang`` (verl's SGLangHttpServer over
    a stand-in engine, the default) or ``standin`` (a stand-in server, not traced).
    ``progress``: tell on stderr what the run is doing (:mod:`otel_verl.demo.progress`).
    """
    trace_dir = os.path.abspath(trace_dir)
    os.makedirs(trace_dir, exist_ok=True)
    os.environ["VERL_TRACE_DIR"] = trace_dir
    os.environ.setdefault("OTEL_VERL_RUN_ID", f"demo-{uuid.uuid4().hex[:12]}")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.update(extra_env or {})
    harness_dir = os.path.join(trace_dir, "harness")
    reporter = ProgressReporter(os.path.join(harness_dir, PHASES_FILE), os.path.join(harness_dir, "metrics.jsonl"),
                                total_steps=steps) if progress else None
    with reporter or contextlib.nullcontext():
        if reporter is not None:
            reporter.phase(f"traced demo: verl's {trainer} trainer, {steps} steps; outputs in {trace_dir}")
        summary = _run_traced(trace_dir, harness_dir, reporter, steps=steps, prompts=prompts,
                              n=n, agent=agent, trainer=trainer, server=server, validate=validate,
                              worker_env=worker_env, overrides=overrides, harness_kwargs=harness_kwargs)
    summary["outputs"] = outputs(trace_dir)
    summary["run_id"] = os.environ["OTEL_VERL_RUN_ID"]
    summary["trainer"] = trainer
    summary["trace_dir"] = trace_dir
    return summary


def _run_traced(trace_dir: str, harness_dir: str, reporter: Optional[ProgressReporter], *, steps: int, prompts: int,
                n: int, agent: str, trainer: str, server: Optional[str], validate: bool,
                worker_env: Optional[Dict[str, str]], overrides: Sequence[str],
                harness_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    def phase(text: str) -> None:
        if reporter is not None:
            reporter.phase(text)

    phase("loading otel_verl, verl, torch and Ray")
    from otel_verl import activation, bootstrap

    if trainer in ("v0", "separation"):
        from otel_verl.demo.harness import run_v0 as run_harness

        if trainer == "separation":
            harness_kwargs["trainer_class"] = "SeparateRayPPOTrainer"
    elif trainer == "v1":
        from otel_verl.demo.harness_v1 import run_v1 as run_harness
    else:
        raise ValueError(f"trainer must be 'v0', 'v1' or 'separation', got {trainer!r}")

    if server is None:
        server = "sglang"  # verl's real SGLangHttpServer over a stand-in engine, in every mode

    from otel_verl.server_timing import ENABLE_METRICS_OVERRIDE

    # As `otel-verl run` adds it to a verl.trainer.main_ppo command: the sglang stand-in
    # reports per-request timing only with it, like sglang.
    overrides = [ENABLE_METRICS_OVERRIDE, *overrides]
    phase("switching tracing on, in this process and (by Ray's runtime env) in every Ray worker")
    activation.activate()  # this process (the driver) too, as `otel-verl run` would
    runtime_env = activation.runtime_env()
    runtime_env["env_vars"].update(worker_env or {})
    harness_kwargs.setdefault("trainer_in_actor", True)
    summary = run_harness(
        harness_dir,
        steps=steps,
        prompts=prompts,
        n=n,
        agent=agent,
        server=server,
        validate=validate,
        runtime_env=runtime_env,
        overrides=overrides,
        **harness_kwargs,
    )
    phase("writing the last spans and lines (tracing's shutdown)")
    bootstrap.shutdown()
    return summary


def outputs(trace_dir: str) -> Dict[str, Any]:
    """The files a traced run left in ``trace_dir``, by kind."""

    def files(pattern: str) -> list:
        return sorted(glob.glob(os.path.join(trace_dir, pattern)))

    return {
        "sample_csv": files("sample/*.csv"),
        "progress": files("progress/*.log"),
        "trajectory_jsonl": files("trajectory/*.jsonl"),
        "otlp_json": files("otlp/*.jsonl"),
    }


def describe(summary: Dict[str, Any]) -> str:
    """A short human summary: what ran and where the outputs are."""
    out = summary["outputs"]

    def lines(paths: list) -> int:
        total = 0
        for path in paths:
            with open(path, "rb") as f:
                total += sum(1 for _ in f)
        return total

    from otel_verl.exporters.otlp_json_file import spans_from_files

    spans = spans_from_files(out["otlp_json"]) if out["otlp_json"] else []
    traces = {s["traceId"] for s in spans}
    config = summary.get("config", {})
    rows = [
        f"run id: {summary.get('run_id')}",
        f"ran: {summary.get('trainer', 'v0')} trainer{' (' + config['mode'] + ')' if config.get('mode') else ''}, "
        f"{config.get('steps')} steps x {config.get('prompts')} prompts x n={config.get('n')} ({config.get('agent')} agent)",
        f"spans: {len(spans)} in {len(traces)} traces -> {os.path.dirname(out['otlp_json'][0]) if out['otlp_json'] else '-'}",
        f"sample-flow CSV rows: {lines(out['sample_csv'])} in {len(out['sample_csv'])} files",
        f"progress lines: {lines(out['progress'])} in {len(out['progress'])} files",
        f"trajectory JSONL lines: {lines(out['trajectory_jsonl'])} in {len(out['trajectory_jsonl'])} files",
    ]
    if summary.get("trace_dir"):
        rows += ["", *next_commands(summary["trace_dir"])]
    return "\n".join(rows)


def next_commands(trace_dir: str) -> List[str]:
    """What to run on a demo's output next (docs/BACKENDS.md, "Seeing a run in Jaeger")."""
    quoted = shlex.quote(trace_dir)
    return [
        "next:",
        f"  otel-verl report {quoted}",
        "      where the time went: steps and stages, slowest trajectories, replicas, losses",
        f"  otel-verl report {quoted} --perfetto {shlex.quote(os.path.join(trace_dir, 'run.pftrace'))}",
        "      the whole run as a timeline: open the file in https://ui.perfetto.dev",
        f"  otel-verl replay {quoted} --endpoint http://localhost:4318",
        "      into a running Jaeger (docker compose up -d jaeger; http://localhost:16686): docs/BACKENDS.md",
    ]
