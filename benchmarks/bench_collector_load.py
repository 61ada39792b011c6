"""One training step's spans, exported over OTLP to a real OpenTelemetry Collector.

    python benchmarks/bench_collector_load.py [--prompts 1024] [--n 16] [--quick]
                                              [--protocol grpc|http/protobuf]
                                              [--bsp-default | --bsp-sdk] [--json PATH]

The span volume and shape of one GRPO step with ``--prompts`` prompts x ``--n``
single-turn trajectories goes through otel_verl's own code paths: ``configure()`` (OTLP
per the standard variables, the BatchSpanProcessor queue sizes otel_verl sets) and the
events API — ``samples_created``, ``rollout_dispatched``, per trajectory ``trajectory`` /
``agent_run`` / ``llm_call`` (with its ``llm_server_call``) / ``reward``,
``sample_stage_done`` for the five batch stages, the step and its stage spans,
``samples_finished``. For 1024 x 16 that is 89,098 spans. Everything is emitted from one
process as fast as the events API goes: a worst case (in a real run the trajectory and
server spans come from many worker and server processes, spread over the generation).

The collector is the repo's ``scripts/otelcol`` (built by
``scripts/build-otel-binaries.sh``) running the shipped
``collector-config/otelcol-file.yaml`` on free loopback ports; its file exporter writes
one file set per ``verl.run_id``, and every measured run has its own run id.

Each run is a fresh child process (``configure()`` is once per process). Reported per
run: spans emitted, wall time from the first event until ``flush()`` returned, spans/s,
process CPU (span creation + export), the CPU of the exporter thread alone (time spent
in ``export()``), the dropped/failed counters of ``otel_verl.health``, and the spans
found in the collector's output file once the collector has stopped. A baseline child
(tracing on, no endpoint) gives the CPU of span creation alone; export CPU = run CPU -
baseline CPU. The script prints "no span lost" and exits 0 when every emitted span is in
the collector's file and no counter reports a loss.

``--bsp-sdk`` runs with the OpenTelemetry SDK's own BatchSpanProcessor defaults (queue
2048, batch 512) instead of otel_verl's, to show what they lose.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))  # otel_binaries: find/start the collector

# The SDK's own defaults (opentelemetry-sdk BatchSpanProcessor), for --bsp-sdk.
SDK_BSP_DEFAULTS = {"OTEL_BSP_MAX_QUEUE_SIZE": "2048", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "512",
                    "OTEL_BSP_SCHEDULE_DELAY": "5000"}
BATCH_STAGES = ("reward", "old_log_prob", "ref_log_prob", "adv", "update_actor")


def expected_spans(prompts: int, n: int) -> int:
    """Spans one step emits: per uid sample + rollout + 5 sample stages; per trajectory
    trajectory, LLM call, LLM server, reward (the agent run is no span); the step and its
    9 stage spans."""
    return prompts * (2 + len(BATCH_STAGES)) + prompts * n * 4 + 1 + 9


# --------------------------------------------------------------------------- child: one step


def emit_step(prompts: int, n: int, workers: int = 8) -> None:
    """One single-turn GRPO step through the events API (trainer and worker sides)."""
    from otel_verl import events
    from otel_verl.semconv import Outcome, Stage

    trainer = "RayPPOTrainer"
    step = 1
    uids = [str(uuid.uuid4()) for _ in range(prompts)]
    row_uids = [u for u in uids for _ in range(n)]
    row_trajs = [str(j) for _ in uids for j in range(n)]
    row_workers = [i * workers // len(row_uids) for i in range(len(row_uids))]
    prompt_ids = list(range(200))
    completion_ids = list(range(300))
    events.step_begin(step, trainer=trainer, epoch=0, consumed_batches=0)
    with events.step_stage(Stage.GENERATION, step=step, trainer=trainer) as generation:
        events.samples_created(uids, step=step, trainer=trainer)
        carriers = events.rollout_dispatched(row_uids, row_trajs, row_workers, step=step, trainer=trainer) or []
        for i, (uid, traj, carrier) in enumerate(zip(row_uids, row_trajs, carriers)):
            with events.trajectory(uid, traj, step=step, agent_name="single_turn_agent", parent=carrier,
                                   n_samples=n, worker_index=row_workers[i]):
                with events.agent_run("SingleTurnAgentLoop"):
                    with events.llm_call(prompt_ids, model="qwen2.5-7b", provider="sglang", request_id=f"req-{i}",
                                         max_tokens=1024, temperature=1.0, top_p=1.0) as turn:
                        with events.llm_server_call(turn.carrier(), request_id=f"req-{i}", provider="sglang") as call:
                            call.record_meta({"e2e_latency": 1.5, "queue_time": 0.01, "prompt_tokens": 200,
                                              "completion_tokens": 300})
                        turn.finish(completion_ids, stop_reason="stop", server_meta=call.meta)
                with events.reward() as reward:
                    reward.score(1.0 if i % 2 else 0.0)
        events.rollout_returned(uids)
        generation.response_tokens(len(row_uids) * len(completion_ids))
    for stage in BATCH_STAGES:
        with events.step_stage(stage, step=step, trainer=trainer):
            start_ns = time.time_ns()
            events.sample_stage_done(stage, row_uids, row_trajs, step=step, start_ns=start_ns, trainer=trainer)
    for stage in (Stage.SAVE_CHECKPOINT, Stage.SYNC_PARAMS, Stage.RECORD_METRICS):
        with events.step_stage(stage, step=step, trainer=trainer):
            pass
    events.samples_finished(uids, Outcome.TRAINED)
    events.step_end()


class _EndCounter:
    """A span processor counting sampled spans that ended (what OTLP should receive)."""

    def __init__(self) -> None:
        self.ended = 0
        self.queue: Any = None  # the OTLP BatchSpanProcessor's queue, when found
        self.peak_queue = 0

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: Any) -> None:
        if span.context.trace_flags.sampled:
            self.ended += 1
            if self.queue is not None:
                self.peak_queue = max(self.peak_queue, len(self.queue))

    def _on_ending(self, span: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _time_exports(provider: Any) -> Dict[str, float]:
    """Wrap the OTLP exporter's ``export`` to add up the CPU its thread spends in it."""
    totals = {"export_cpu_s": 0.0, "export_calls": 0, "bsp_max_queue_size": None, "bsp_max_export_batch_size": None}
    from otel_verl import bootstrap
    from otel_verl.accelerated.batch import BatchExportProcessor

    for processor in bootstrap.span_processors():
        if not isinstance(processor, BatchExportProcessor) or processor.output != "otlp":
            continue
        totals["bsp_max_queue_size"] = processor.max_queue_spans
        totals["bsp_max_export_batch_size"] = processor.max_batch
        totals["queue"] = processor._queue
        exporter = processor.exporter
        original = exporter.export
        lock = threading.Lock()

        def export(spans: Any, _original: Any = original) -> Any:
            t0 = time.thread_time()
            try:
                return _original(spans)
            finally:
                with lock:
                    totals["export_cpu_s"] += time.thread_time() - t0
                    totals["export_calls"] += 1

        exporter.export = export
    return totals


def child(prompts: int, n: int) -> Dict[str, Any]:
    """Configure tracing from the environment, emit one step, flush, report (JSON)."""
    import logging

    logging.basicConfig(level=logging.ERROR)  # the SDK's "Queue full" warnings: counted instead
    from otel_verl import bootstrap, health

    on = bootstrap.configure(role="trainer")
    assert on, "tracing did not switch on"
    provider = bootstrap.provider()
    counter = _EndCounter()
    provider.add_span_processor(counter)
    exports = _time_exports(provider)
    counter.queue = exports.pop("queue", None)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cpu0, wall0 = time.process_time(), time.perf_counter()
    emit_step(prompts, n)
    emitted_wall = time.perf_counter() - wall0
    flushed = bootstrap.flush(timeout_s=300)
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    bootstrap.shutdown()
    counts = health.snapshot()
    return {
        "spans": counter.ended,
        "emit_wall_s": emitted_wall,
        "wall_s": wall,
        "cpu_s": cpu,
        "flushed": flushed,
        "dropped": counts["dropped"],
        "failures": counts["failures"],
        "bsp_peak_queue": counter.peak_queue,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024,
        **exports,
    }


# --------------------------------------------------------------------------- parent


def _clean_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "VERL_TRACE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return env


def run_child(prompts: int, n: int, env: Dict[str, str], timeout: float = 900) -> Dict[str, Any]:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", "--prompts", str(prompts), "--n", str(n),
             "--json", out.name],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=timeout, cwd=REPO,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"benchmark child exited {proc.returncode}:\n{proc.stderr[-4000:]}")
        return json.load(out)


def count_file_spans(directory: str) -> int:
    """Spans in the collector file exporter's OTLP-JSON lines under ``directory``."""
    from otel_verl.exporters.otlp_json_file import read_otlp_json_lines

    paths = []
    for root, _, files in os.walk(directory):
        paths += [os.path.join(root, f) for f in files if f.endswith(".jsonl")]
    total = 0
    for traces in read_otlp_json_lines(sorted(paths)):
        for rs in traces.get("resourceSpans", ()):
            for ss in rs.get("scopeSpans", ()):
                total += len(ss.get("spans", ()))
    return total


def run(
    prompts: int = 1024,
    n: int = 16,
    *,
    protocol: str = "grpc",
    bsp: str = "otel_verl",
    baseline: bool = True,
    workdir: Optional[str] = None,
    extra_env: Optional[Dict[str, str]] = None,
) -> Dict[str, Any]:
    """Start a collector, run the step through it (and a baseline), return the report.

    ``bsp``: ``otel_verl`` (the queue sizes otel_verl configures when the user set none)
    or ``sdk`` (the OpenTelemetry SDK's defaults). Raises ``LookupError`` when the
    collector binary is missing (see tests/otel_binaries.py)."""
    import otel_binaries as ob

    binary, reason = ob.find_binary("otelcol")
    if binary is None:
        raise LookupError(f"otelcol unavailable: {reason}")
    own_tmp = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="otv-bench-col-")
    file_dir = os.path.join(workdir, "traces")
    from pathlib import Path

    report: Dict[str, Any] = {"prompts": prompts, "n": n, "protocol": protocol, "bsp": bsp,
                              "expected_spans": expected_spans(prompts, n)}
    env = _clean_env()
    env["OTEL_VERL_ENABLED"] = "1"
    env["OTEL_VERL_OFFLOAD"] = "0"  # the exporter in this process, where its CPU is timed
    if baseline:
        report["baseline"] = run_child(prompts, n, {**env, "OTEL_VERL_RUN_ID": f"bench-baseline-{uuid.uuid4().hex[:8]}"})
    col = ob.start_otelcol(ob.CONFIG_DIR / "otelcol-file.yaml", Path(workdir),
                           {"OTELCOL_FILE_DIR": file_dir, "OTELCOL_LOG_LEVEL": "warn"})
    try:
        run_id = f"bench-{uuid.uuid4().hex[:8]}"
        endpoint = col.otlp_grpc_endpoint if protocol == "grpc" else col.otlp_http_endpoint
        child_env = {**env, "OTEL_VERL_RUN_ID": run_id, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                     "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}
        if bsp == "sdk":
            child_env.update(SDK_BSP_DEFAULTS)
        child_env.update(extra_env or {})
        result = run_child(prompts, n, child_env)
    finally:
        rc = col.process.stop(timeout=60)  # a clean stop flushes the collector's batch and files
    result["collector_exit"] = rc
    result["in_collector_file"] = count_file_spans(os.path.join(file_dir, run_id))
    result["spans_per_s"] = result["spans"] / result["wall_s"] if result["wall_s"] else 0.0
    if baseline:
        result["export_cpu_s_vs_baseline"] = result["cpu_s"] - report["baseline"]["cpu_s"]
    report["run"] = result
    report["lost"] = result["spans"] - result["in_collector_file"]
    report["dropped_counted"] = sum(result["dropped"].values())
    report["ok"] = (report["lost"] == 0 and report["dropped_counted"] == 0 and not result["failures"]
                    and result["spans"] == report["expected_spans"] and result["flushed"])
    if own_tmp and report["ok"]:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    else:
        report["workdir"] = workdir
    return report


def describe(report: Dict[str, Any]) -> str:
    r = report["run"]
    lines = [
        f"{report['prompts']} prompts x {report['n']} trajectories, OTLP {report['protocol']}, "
        f"BSP queue {r['bsp_max_queue_size']} / batch {r['bsp_max_export_batch_size']} ({report['bsp']} defaults)",
        f"  spans emitted:            {r['spans']} (expected {report['expected_spans']})",
        f"  wall (emit / + flush):    {r['emit_wall_s']:.2f} s / {r['wall_s']:.2f} s  -> {r['spans_per_s']:.0f} spans/s",
        f"  process CPU:              {r['cpu_s']:.2f} s ({1e6 * r['cpu_s'] / max(1, r['spans']):.1f} us/span)",
        f"  exporter thread CPU:      {r['export_cpu_s']:.2f} s in {r['export_calls']} export calls"
        f" ({1e6 * r['export_cpu_s'] / max(1, r['spans']):.1f} us/span)",
    ]
    if "baseline" in report:
        b = report["baseline"]
        lines.append(f"  baseline (no export) CPU: {b['cpu_s']:.2f} s -> export adds {r['export_cpu_s_vs_baseline']:.2f} s"
                     f" ({1e6 * r['export_cpu_s_vs_baseline'] / max(1, r['spans']):.1f} us/span)")
    lines += [
        f"  BSP queue peak:           {r['bsp_peak_queue']} spans (before the span is queued)",
        f"  peak RSS:                 {r['max_rss_mb']:.0f} MB",
        f"  dropped (health):         {r['dropped'] or 0}  failures: {r['failures'] or 0}",
        f"  in the collector's file:  {r['in_collector_file']} (collector exit {r['collector_exit']})",
        "  no span lost" if report["ok"] else f"  SPANS LOST: {report['lost']} missing from the file, "
                                               f"{report['dropped_counted']} counted as dropped",
    ]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="64 prompts x 16 (CI)")
    parser.add_argument("--protocol", default="grpc", choices=["grpc", "http/protobuf"])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--bsp-sdk", action="store_true", help="the SDK's BatchSpanProcessor defaults (queue 2048)")
    group.add_argument("--bsp-default", action="store_true", help="otel_verl's defaults (the default)")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for the measured run (e.g. OTEL_BSP_MAX_QUEUE_SIZE=8192)")
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.n = 64, 16
    if args.child:
        result = child(args.prompts, args.n)
        with open(args.json, "w") as f:
            json.dump(result, f)
        return 0
    try:
        report = run(args.prompts, args.n, protocol=args.protocol, bsp="sdk" if args.bsp_sdk else "otel_verl",
                     baseline=not args.no_baseline, extra_env=dict(e.split("=", 1) for e in args.env))
    except LookupError as exc:
        print(f"skipped: {exc}", file=sys.stderr)
        return 2
    print(describe(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
