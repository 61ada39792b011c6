"""CPU that tracing adds to the rollout worker (AgentLoopWorker actors), per LLM turn and
per trajectory.

    python benchmarks/bench_worker_overhead.py                # full run, updates docs/PERFORMANCE.md
    python benchmarks/bench_worker_overhead.py --quick        # tiny run: only checks that it works

Two measurements in one invocation:

1. **End to end.** The CPU harness (real verl v0 ``fit``, AgentLoopWorker actors running
   ``SingleTurnAgentLoop``, verl's ``SGLangHttpServer.generate`` over the stand-in engine;
   the trainer in a subprocess, each run its own Ray cluster) traced with legacy files
   under a trace dir and OTLP/HTTP to a sink in this process. Through the harness's
   ``on_fit`` hook the script reads the CPU time (user + system, all threads: the event
   loop, the writer threads, the OTLP export thread) of every AgentLoopWorker process
   (``psutil``, pids from the actors' ``__ray_call__``), and apart from it the CPU of the
   workers' export processes (``otel_verl.offload``). Before fit each worker builds its
   tracing pipeline (``bootstrap.ensure``; reported on its own); ``--warmup-steps`` pay
   the remaining one-time costs (first files, first export connection, first calls).

   - **A/B in one run** (``--ab-pairs``): measured steps alternate tracing on / paused in
     the workers (the tracing state uninstalled, so every events call is a no-op),
     in the same processes; a step's window is its generation plus a flush of the
     workers' outputs. Added CPU per trajectory / per LLM turn = median(on) -
     median(paused) of the steps' CPU divided by their trajectories / generate calls.
     A ``gc.callbacks`` probe in each worker adds the steps' garbage-collection CPU and
     full collections (a full one walks verl's and torch's whole heap).
   - **Separate runs** (``--repeats``): stock verl (tracing off) vs traced, alternately,
     from the first measured step to the end of fit. Closest to "off vs on", but two
     runs differ by seconds of worker CPU on a shared machine whatever the tracing.
2. **In-process attribution.** The rollout worker's events-API calls for N trajectories
   (``events.trajectory`` / ``agent_run`` / ``llm_call`` + ``Turn.finish`` / ``reward`` /
   ``agent_metrics``, with the carrier unpickled as Ray does, the model/provider lookup
   of the LLM-client wrapper on the run's config and the request-id tag) through the real
   processors, added one at a time: spans only, + progress log, + sample CSV, +
   trajectory JSONL (decoding with the stand-in tokenizer), + OTLP/HTTP export; and the
   same outputs written by an export process (``otel_verl.offload``, the rollout workers'
   default), whose CPU is read apart (``psutil``, its own process). CPU is
   ``time.process_time`` (all threads) until everything is written/exported, minus the
   same loop with tracing off, best of ``--micro-repeats`` (a repeat on a shared machine
   only ever gets slower than the code's own cost); "event loop" is the calling thread
   alone (``time.thread_time``). Per LLM turn = the slope between 1-turn and 8-turn
   trajectories. The seed patch's worker hooks (``bench_seed_comparison.Seed``) run the
   same trajectories in the same rounds, so otel_verl / seed is read within one run (the
   goals were set at 0.47x / 0.24x of the seed's cost of that time).
   ``cProfile`` of the calling thread lists the top functions.

Targets: <= 100 us per LLM turn, <= 250 us per single-turn trajectory (its JSONL line
included).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TARGET_TURN_US = 100.0
TARGET_TRAJ_US = 250.0
# What the seed patch cost when these goals were set ("replayed on this kind of machine"):
# the targets are about 0.47x / 0.24x of it. The in-process attribution replays the seed
# in the same run, so the ratio can be read whatever the machine's speed that hour.
ISSUE_SEED_TRAJ_US = 528.0
ISSUE_SEED_TURN_US = 424.0
DOC = os.path.join(ROOT, "docs", "PERFORMANCE.md")
DOC_SECTION = "## Rollout worker overhead"
TRACING_VARS_PREFIXES = ("OTEL_", "VERL_TRACE_DIR")


# --------------------------------------------------------------------------- OTLP/HTTP sink


class SpanSink:
    """A minimal OTLP/HTTP receiver on loopback: accepts ``POST /v1/traces`` (protobuf,
    optionally gzip) and counts the spans; takes ``POST /v1/metrics`` too (otel_verl's
    metrics go to the same endpoint) and counts the requests."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        sink = self
        self.spans = 0
        self.requests = 0
        self.metric_requests = 0
        self._lock = threading.Lock()
        span_response = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        metric_response = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path.endswith("/v1/metrics"):
                    metrics_service_pb2.ExportMetricsServiceRequest().ParseFromString(body)
                    with sink._lock:
                        sink.metric_requests += 1
                    response = metric_response
                else:
                    request = trace_service_pb2.ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                    with sink._lock:
                        sink.spans += n
                        sink.requests += 1
                    response = span_response
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(response)))
                self.end_headers()
                self.wfile.write(response)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="otlp-sink")
        self._thread.start()

    def count(self) -> int:
        with self._lock:
            return self.spans

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def tracing_env(mode: str, trace_dir: str, endpoint: str) -> Dict[str, str]:
    """The child's environment: no tracing variable for ``off``; a trace dir and OTLP/HTTP
    to the sink for ``on``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(TRACING_VARS_PREFIXES)}
    env.update({"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"})
    if mode in ("on", "ab"):
        env.update({
            "VERL_TRACE_DIR": trace_dir,
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_VERL_RUN_ID": f"bench-{uuid.uuid4().hex[:12]}",
        })
    else:
        env["OTEL_VERL_ENABLED"] = "0"
    return env


# --------------------------------------------------------------------------- 1. end to end (child)


def _export_process_pids(pid: Optional[int] = None) -> List[int]:
    """The export processes (:mod:`otel_verl.offload`) serving process ``pid`` (this one by
    default). They are no children of it (they detach to outlive it): found by the
    ``--served-pid`` they were started with, less the short-lived starter, its child."""
    import psutil

    served = str(os.getpid() if pid is None else pid)
    found = []
    for process in psutil.process_iter(["cmdline", "ppid"]):
        cmdline = process.info["cmdline"] or []
        if "otel_verl.offload.host" not in cmdline or "--served-pid" not in cmdline:
            continue
        at = cmdline.index("--served-pid") + 1
        if at < len(cmdline) and cmdline[at] == served and str(process.info["ppid"]) != served:
            found.append(process.pid)
    return found


def _cpu_seconds(pid: int) -> float:
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    except ImportError:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class WorkerCpuProbe:
    """``run_v0(on_fit=...)``: CPU seconds of the AgentLoopWorker processes.

    ``runs`` mode: from the start of the generation of step ``warmup_steps + 1`` to the end
    of fit (which flushes the workers' outputs). ``ab`` mode (tracing on): one window per
    measured step, from just before its generation to just after it and a flush of the
    workers' outputs (so the step's writing and exporting is in its window), with tracing
    in the workers paused (tracing state uninstalled) on every other measured step:
    on, off, on, off, ... in the same processes. The warm-up steps pay the one-time costs
    (first files, first export connection, first-call code paths); the pipeline set-up
    itself is measured before fit."""

    def __init__(self, warmup_steps: int, ab: bool = False) -> None:
        self.warmup_steps = warmup_steps
        self.ab = ab
        self.generations = 0
        self.pids: List[int] = []
        self.exporters: List[int] = []  # the workers' export processes (otel_verl.offload), if any
        self.setup_s = 0.0
        self.start: Dict[int, float] = {}
        self.export_start = 0.0
        self.t0 = 0.0
        self.windows: List[Dict[str, Any]] = []

    def __call__(self, trainer: Any, phase: str) -> Any:
        import ray

        manager = trainer.async_rollout_manager
        handles = list(manager.agent_loop_workers)
        if phase == "start":
            self.pids = ray.get([h.__ray_call__.remote(_actor_pid) for h in handles])
            before = self._read()
            ray.get([h.__ray_call__.remote(_actor_tracing_setup) for h in handles])
            self.setup_s = sum(self._read().values()) - sum(before.values())
            self.exporters = [child for pid in self.pids for child in _export_process_pids(pid)]
            generate = manager.generate_sequences  # (instrumented when tracing is on)

            def generate_sequences(*args: Any, **kwargs: Any) -> Any:
                self.generations += 1
                measured = self.generations > self.warmup_steps
                if measured and not self.ab and not self.start:
                    # the warm-up steps' outputs written and exported first: an export
                    # process's one-time costs (its tokenizer's imports) are theirs
                    ray.get([h.__ray_call__.remote(_actor_flush) for h in handles])
                    self.start, self.export_start, self.t0 = self._read(), self._read_exporters(), time.time()
                if not (measured and self.ab):
                    return generate(*args, **kwargs)
                traced = (self.generations - self.warmup_steps) % 2 == 1
                ray.get([h.__ray_call__.remote(_actor_flush) for h in handles])  # as above
                ray.get([h.__ray_call__.remote(_actor_set_tracing, traced) for h in handles])
                requests = _server_requests(trainer)
                threads = ray.get([h.__ray_call__.remote(_actor_threads_cpu) for h in handles])
                cpu, export, t = self._read(), self._read_exporters(), time.time()
                output = generate(*args, **kwargs)
                ray.get([h.__ray_call__.remote(_actor_flush) for h in handles])
                end, export_end = self._read(), self._read_exporters()
                threads_end = ray.get([h.__ray_call__.remote(_actor_threads_cpu) for h in handles])
                by_thread: Dict[str, float] = {}
                for before, after in zip(threads, threads_end):
                    for name, seconds in after.items():
                        by_thread[name] = by_thread.get(name, 0.0) + seconds - before.get(name, 0.0)
                self.windows.append({
                    "traced": traced, "wall_s": time.time() - t, "trajectories": len(output),
                    "llm_turns": _server_requests(trainer) - requests,
                    "cpu_s": sum(end[pid] - cpu[pid] for pid in self.pids),
                    "export_cpu_s": export_end - export,
                    "threads": by_thread,
                })
                return output

            manager.generate_sequences = generate_sequences  # instance attribute: fit calls it
            return None
        result = {"pids": self.pids, "setup_cpu_s": self.setup_s, "generations": self.generations}
        if self.ab:
            ray.get([h.__ray_call__.remote(_actor_set_tracing, True) for h in handles])
            result["windows"] = self.windows
            return result
        end, export_end = self._read(), self._read_exporters()
        if not self.start:
            raise RuntimeError(f"fit ran {self.generations} generations; the probe needs more than {self.warmup_steps}")
        result.update({
            "measured_wall_s": time.time() - self.t0,
            "worker_cpu_s": sum(end[pid] - self.start[pid] for pid in self.pids),
            "per_worker_cpu_s": [end[pid] - self.start[pid] for pid in self.pids],
            "export_cpu_s": export_end - self.export_start,
        })
        return result

    def _read(self) -> Dict[int, float]:
        return {pid: _cpu_seconds(pid) for pid in self.pids}

    def _read_exporters(self) -> float:
        return sum(_cpu_seconds(pid) for pid in self.exporters)


def _server_requests(trainer: Any) -> int:
    return sum(s.get("requests", 0) for s in trainer.server_stats())


def _actor_pid(actor: Any = None) -> int:
    return os.getpid()


def _actor_tracing_setup(actor: Any = None) -> bool:
    """Build the worker's tracing pipeline now (it is built lazily on the first traced
    call): its one-time cost stays out of the per-turn figures. No-op when off."""
    try:
        from otel_verl import activation, bootstrap
        from otel_verl.semconv import Role

        return bool(activation.is_active() and bootstrap.ensure(Role.AGENT_LOOP_WORKER))
    except Exception:
        return False


def _actor_set_tracing(actor: Any, on: bool) -> bool:
    """Pause (uninstall the tracing state: every events call is then a no-op) or resume
    tracing in this worker, between steps."""
    import builtins

    from otel_verl import events

    saved = "_otel_verl_bench_state"
    if events.state() is not None:
        setattr(builtins, saved, events.state())
    events.install(getattr(builtins, saved, None) if on else None)
    return events.enabled()


LOOP_THREAD = "event loop"
TRACING_THREADS = "otel_verl threads"  # writer threads + the OTLP export thread


GC_COLLECTIONS = ("gc young collections", "gc middle collections", "gc full collections")  # by generation
GC_SECONDS = "gc seconds"  # CPU in collections of any generation, whichever thread ran them


def _gc_counters() -> Dict[str, float]:
    """This process's garbage collections since the first call (a ``gc.callbacks`` probe,
    kept on ``builtins``: this function reaches the actor pickled by value)."""
    import builtins
    import gc

    counters = getattr(builtins, "_otel_verl_bench_gc", None)
    if counters is None:
        counters = builtins._otel_verl_bench_gc = dict.fromkeys((*GC_COLLECTIONS, GC_SECONDS, "started"), 0.0)

        def probe(phase: str, info: Dict[str, Any]) -> None:
            if phase == "start":
                counters["started"] = time.thread_time()
                return
            counters[GC_SECONDS] += time.thread_time() - counters["started"]
            counters[GC_COLLECTIONS[min(2, int(info.get("generation", 0)))]] += 1

        gc.callbacks.append(probe)
    return {key: counters[key] for key in (*GC_COLLECTIONS, GC_SECONDS)}


def _actor_threads_cpu(actor: Any = None) -> Dict[str, float]:
    """CPU seconds of this process's threads by kind: the asyncio loop running the agent
    loops, otel_verl's writer and export threads, everything else (Ray, verl pools); and
    the process's garbage collections so far (:func:`_gc_counters`)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {LOOP_THREAD: 0.0, TRACING_THREADS: 0.0, "other threads": 0.0}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), "")
        if name.startswith("AsyncIO Thread"):  # Ray's event loop thread of an async actor
            kind = LOOP_THREAD
        elif name.startswith("otel-verl-") or name == "OtelBatchSpanRecordProcessor":
            kind = TRACING_THREADS
        else:
            kind = "other threads"
        out[kind] += (int(fields[11]) + int(fields[12])) / tick
    out.update(_gc_counters())
    return out


def _actor_flush(actor: Any = None) -> bool:
    from otel_verl import bootstrap

    return bootstrap.flush()


def child_e2e(args: argparse.Namespace) -> Dict[str, Any]:
    from otel_verl.demo.harness import run_v0

    runtime_env = None
    if args.mode in ("on", "ab"):
        from otel_verl import activation

        activation.activate()
        runtime_env = activation.runtime_env()
    ab = args.mode == "ab"
    probe = WorkerCpuProbe(args.warmup_steps, ab=ab)
    steps = args.warmup_steps + (2 * args.ab_pairs if ab else args.steps)
    summary = run_v0(
        args.out, steps=steps, prompts=args.prompts, n=args.n, agent=args.agent, validate=False,
        server="sglang", runtime_env=runtime_env, on_fit=probe, agent_workers=args.agent_workers,
        latency_s=args.latency,
    )
    if runtime_env is not None:
        from otel_verl import bootstrap

        bootstrap.shutdown()
    result = dict(summary["on_fit"])
    result.update({"mode": args.mode, "steps_run": summary["steps_run"], "fit_s": summary["timings"].get("fit_s")})
    if not ab:
        measured = [step for step in summary["trajectories_per_step"] if int(step) > args.warmup_steps]
        all_trajectories = sum(summary["trajectories_per_step"].values())
        trajectories = sum(summary["trajectories_per_step"][step] for step in measured)
        result.update({
            "trajectories": trajectories,
            # generate calls the servers answered, in the measured steps' share
            "llm_turns": summary["server"]["requests"] * trajectories / max(1, all_trajectories),
        })
    if runtime_env is not None:
        trace_dir = os.environ["VERL_TRACE_DIR"]
        result["jsonl_lines"] = _count_lines(os.path.join(trace_dir, "trajectory"))
        result["csv_rows"] = _count_lines(os.path.join(trace_dir, "sample"))
    return result


def _count_lines(directory: str) -> int:
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                total += sum(1 for _ in f)
    return total


# --------------------------------------------------------------------------- 2. in-process (child)

PROMPT_TOKENS, COMPLETION_TOKENS = 86, 24
MICRO_VARIANTS = ("spans", "+progress", "+csv", "+jsonl", "+otlp")
# The same outputs written by an export process (otel_verl.offload), as rollout workers
# run them by default; its CPU is measured apart from the worker process's.
OFFLOAD_VARIANT = "via export process"
PACE_S = 0.002  # paced runs: one trajectory every ~2 ms


def _micro_pipeline(variant: str, trace_dir: str, endpoint: str) -> Any:
    """The rollout worker's pipeline as bootstrap builds it, with the processors up to
    ``variant``. Returns the provider (installed as the tracing state)."""
    from opentelemetry.sdk.trace import TracerProvider

    from otel_verl import bootstrap, events, outputs, settings
    from otel_verl.legacy.progress_log import ProgressLogProcessor
    from otel_verl.legacy.sample_csv import SampleCsvProcessor
    from otel_verl.legacy.trajectory_jsonl import TrajectoryJsonlProcessor
    from otel_verl.sampling import IsolatingSpanProcessor, UidIdGenerator, record_dropped_samples

    cfg = settings.load({"VERL_TRACE_DIR": trace_dir, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
    ids, sampler = UidIdGenerator(), record_dropped_samples()
    provider = TracerProvider(
        resource=bootstrap._resource("agent_loop_worker"), sampler=sampler, id_generator=ids,
        active_span_processor=IsolatingSpanProcessor(),
    )
    if variant == OFFLOAD_VARIANT:
        provider.add_span_processor(bootstrap._offload(cfg, provider.resource))
        events.install(events.TracingState(provider, provider.get_tracer("otel_verl"), ids, cfg, sampler))
        return provider
    level = MICRO_VARIANTS.index(variant)
    if level >= 1:
        provider.add_span_processor(ProgressLogProcessor(trace_dir, max_pending_bytes=cfg.max_queue_bytes))
    if level >= 2:
        provider.add_span_processor(SampleCsvProcessor(trace_dir, max_pending_bytes=cfg.max_queue_bytes))
    if level >= 3:
        provider.add_span_processor(TrajectoryJsonlProcessor(trace_dir, max_file_bytes=cfg.jsonl_max_bytes,
                                                             max_pending_bytes=cfg.max_queue_bytes))
    if level >= 4:
        from otel_verl.accelerated.otlp_exporter import OtlpSpanExporter

        exporter = OtlpSpanExporter(endpoint=endpoint + "/v1/traces", protocol="http/protobuf")  # as the outputs module makes it
        provider.add_span_processor(outputs.batch_processor(exporter, "otlp", cfg, **outputs.bsp_options()))
    events.install(events.TracingState(provider, provider.get_tracer("otel_verl"), ids, cfg, sampler))
    return provider


def _micro_workload(
    count: int, turns: int, tokenizer: Any, carrier_bytes: List[bytes], client: Any, pace_s: float = 0.0
) -> None:
    """What the wrappers do in a rollout worker for ``count`` trajectories of ``turns``
    LLM turns each (single-turn shape when turns == 1). ``client`` stands for verl's
    LLMServerClient (its ``config`` is the run's DictConfig)."""
    import pickle

    from otel_verl import carriers, events
    from otel_verl.instrumentation.llm_client import _model_and_provider

    prompt_ids = list(range(1000, 1000 + PROMPT_TOKENS))
    completion_ids = list(range(2000, 2000 + COMPLETION_TOKENS))
    meta = {"e2e_latency": 0.06, "queue_time": 0.0001, "request_received_ts": 1.0, "prefill_finished_ts": 1.01,
            "prefill_launch_latency": 0.0001}
    request_id = uuid.uuid4().hex
    traced = events.enabled()  # untraced: stock verl has no carrier, no wrapper work
    for i in range(count):
        carrier, row = None, {}
        if traced:  # the row's carrier, unpickled by Ray and popped by the _run_agent_loop wrapper
            kwargs = {carriers.COLUMN: pickle.loads(carrier_bytes[i % len(carrier_bytes)]), "uid": f"u{i}"}
            carrier = carriers.pop_kwargs(kwargs)
            row = getattr(carrier, "row", None) or {}
        with events.trajectory(f"uid-{i // 8}", row.get("traj_uid", str(i % 8)), step=1, agent_name="single_turn_agent",
                               parent=carrier, n_samples=8, worker_index=0, tokenizer=tokenizer):
            with events.agent_run("SingleTurnAgentLoop"):
                ids = list(prompt_ids)
                for _ in range(turns):
                    model, provider = _model_and_provider(client) if traced else (None, "verl")  # llm_client._generate
                    with events.llm_call(ids, model=model, provider=provider, request_id=request_id,
                                         max_tokens=128, temperature=1.0, top_p=1.0) as turn:
                        if traced:
                            carriers.tag_request_id(request_id, turn.carrier())  # llm_client._engine_request_id
                        turn.finish(completion_ids, stop_reason="stop", output_tokens=COMPLETION_TOKENS,
                                    server_meta=dict(meta))
                    ids = ids + completion_ids
            with events.reward() as reward:
                reward.score(1.0)
            events.agent_metrics({"generate_sequences": 0.06, "tool_calls": 0.0, "compute_score": 0.001,
                                  "num_preempted": -1})
        if pace_s:
            time.sleep(pace_s)


SEED_VARIANTS = ("seed-bare", "seed")
# CPU of the process (all its threads), of its calling thread, of its export process
MEASURES = ("total_us", "loop_us", "export_us")


def _run_now(coro: Any) -> Any:
    """Run a coroutine that never suspends (stand-ins return at once) without a loop."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("the seed replay's stand-ins must not suspend")


def _seed_micro_workload(count: int, turns: int, tokenizer: Any, replay: Any) -> None:
    """The same trajectories through the seed patch's worker hooks
    (``bench_seed_comparison.Seed``: its ``_run_agent_loop``, LLM ``generate`` and
    ``_compute_score`` wrappers, the seed's own code and outputs), around stand-ins that
    return at once; ``replay`` ``None`` runs the stand-ins bare (the baseline)."""
    import bench_seed_comparison as seed_bench

    prompt_ids = list(range(1000, 1000 + PROMPT_TOKENS))
    completion_ids = list(range(2000, 2000 + COMPLETION_TOKENS))
    meta = {"e2e_latency": 0.06, "queue_time": 0.0001, "request_received_ts": 1.0, "prefill_finished_ts": 1.01,
            "prefill_launch_latency": 0.0001, "completion_tokens": COMPLETION_TOKENS}
    worker = argparse.Namespace(tokenizer=tokenizer, rollout_config=argparse.Namespace(n=8))
    seed_bench._TOKENIZER = tokenizer

    async def llm_server(**kwargs: Any) -> Any:
        return seed_bench.TokenOutput(completion_ids, "stop", {seed_bench.SERVER_META_KEY: dict(meta)})

    async def score(outputs: Any) -> None:
        return None

    async def agent_loop(*args: Any, **kwargs: Any) -> Any:
        ids = list(prompt_ids)
        for _ in range(turns):
            request = {"prompt_ids": ids}
            await (replay.generate(llm_server, None, (), request) if replay else llm_server(**request))
            ids = ids + completion_ids
        output = seed_bench.AgentLoopOutput(prompt_ids, completion_ids, turns)
        output.reward_score = 1.0
        await (replay.compute_score(score, worker, ([output],), {}) if replay else score([output]))
        return output

    for i in range(count):
        args, kwargs = (None, {"step": 1}), {"uid": f"uid-{i // 8}", "traj_uid": str(i % 8), "agent_name": "single_turn_agent"}
        _run_now(replay.run_agent_loop(agent_loop, worker, args, kwargs) if replay else agent_loop(*args, **kwargs))


def child_micro(args: argparse.Namespace) -> Dict[str, Any]:
    import cProfile
    import gc
    import io
    import pickle
    import pstats

    from transformers import AutoTokenizer

    from otel_verl import activation, carriers, events
    from otel_verl.demo.tiny_model import ensure_tiny_model

    # As in a traced worker, where tracing is already active: unpickling a carrier then
    # costs no activation attempt.
    activation._activated_pid = os.getpid()

    from otel_verl.demo.harness import build_config, harness_overrides

    model_dir = ensure_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    client = argparse.Namespace(config=build_config(harness_overrides(
        model_dir=model_dir, train_files="train.parquet", val_files="test.parquet", output_dir=tempfile.gettempdir(),
        steps=1, prompts=2, n=2, agent="single", validate=False, agent_workers=2, tool_config_path=None)))
    # carriers as the trainer pickles them (one rollout span per uid, a row per traj)
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    carrier_bytes = []
    for u in range(16):
        span = NonRecordingSpan(SpanContext(0x1000 + u, 0x2000 + u, False, TraceFlags(TraceFlags.SAMPLED)))
        base = carriers.TraceCarrier.from_span(span)
        carrier_bytes += [pickle.dumps(base.with_row({"traj_uid": str(k), "worker": 0})) for k in range(8)]
    count, root = args.micro_trajectories, tempfile.mkdtemp(prefix="otel_verl_bench_micro_")
    # The export process builds its OTLP exporter from the standard variables, as in a worker.
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": args.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    sys_stdout, sys.stdout = sys.stdout, open(os.devnull, "w")  # progress lines also go to stdout

    def measure(variant: Optional[str], turns: int, pace_s: float = 0.0, n: int = count) -> Dict[str, float]:
        if variant in SEED_VARIANTS:
            return measure_seed(variant, turns, n)
        provider = _micro_pipeline(variant, os.path.join(root, f"{variant}-{turns}"), args.endpoint) if variant else None
        if provider is None:
            events.install(None)
        _micro_workload(min(50, count), turns, tokenizer, carrier_bytes, client)  # warm-up: files, threads, connection
        if provider is not None:
            provider.force_flush()
        gc.collect()
        exporters = _export_process_pids()
        e0 = sum(_cpu_seconds(pid) for pid in exporters)
        p0, t0 = time.process_time(), time.thread_time()
        _micro_workload(n, turns, tokenizer, carrier_bytes, client, pace_s)
        t1 = time.thread_time()
        if provider is not None:
            provider.force_flush()
        p1 = time.process_time()
        e1 = sum(_cpu_seconds(pid) for pid in exporters)
        if provider is not None:
            provider.shutdown()
            events.install(None)
        return {"total_us": (p1 - p0) / n * 1e6, "loop_us": (t1 - t0) / n * 1e6, "export_us": (e1 - e0) / n * 1e6}

    def measure_seed(variant: str, turns: int, n: int) -> Dict[str, float]:
        from bench_seed_comparison import Seed

        events.install(None)
        replay = Seed(os.path.join(root, f"{variant}-{turns}-{time.time_ns()}")) if variant == "seed" else None
        if replay is not None:
            replay.step = 1
        _seed_micro_workload(min(50, count), turns, tokenizer, replay)  # warm-up
        if replay is not None:
            replay.flush()
        gc.collect()
        p0, t0 = time.process_time(), time.thread_time()
        _seed_micro_workload(n, turns, tokenizer, replay)
        t1 = time.thread_time()
        if replay is not None:
            replay.flush()  # its CSV thread and JSONL executor: their work is in the window
        p1 = time.process_time()
        if replay is not None:
            replay.close()
        return {"total_us": (p1 - p0) / n * 1e6, "loop_us": (t1 - t0) / n * 1e6, "export_us": 0.0}

    # Best of the repeats (as timeit does): on a shared machine a repeat only ever gets
    # slower (preemption, cache thrash), never faster, than the code's own cost.
    # The variants are measured in rounds (off, spans, +progress, ..., then again), so a
    # busy spell of the machine hits all of them rather than one.
    results: Dict[str, Any] = {"trajectories": count, "repeats": args.micro_repeats, "variants": {}}

    def best_of_rounds(variants: tuple, turns: int, pace_s: float = 0.0, n: int = count) -> Dict[Any, Dict[str, float]]:
        runs: Dict[Any, List[Dict[str, float]]] = {v: [] for v in variants}
        for _ in range(args.micro_repeats):
            for variant in variants:
                runs[variant].append(measure(variant, turns, pace_s, n))
        return {v: {k: min(r[k] for r in rs) for k in MEASURES} for v, rs in runs.items()}

    try:
        for turns in (1, 8):
            # the seed's replay in the same rounds: its ratio holds whatever the machine does meanwhile
            best = best_of_rounds((None,) + MICRO_VARIANTS + (OFFLOAD_VARIANT,) + SEED_VARIANTS, turns,
                                  n=count if turns == 1 else max(20, count // 2))
            for variant in MICRO_VARIANTS + (OFFLOAD_VARIANT,):
                results["variants"][f"{variant}/{turns}"] = {k: best[variant][k] - best[None][k] for k in MEASURES}
            results["variants"][f"seed/{turns}"] = {k: best["seed"][k] - best["seed-bare"][k] for k in MEASURES}
        # Events spread out in time, as in a worker waiting on its LLM calls: every
        # output's writer thread (and the export thread) wakes up for fewer lines.
        best = best_of_rounds((None, "+otlp"), 1, PACE_S, max(20, count // 4))
        results["paced"] = {k: best["+otlp"][k] - best[None][k] for k in MEASURES}
        # where the calling thread's time goes (full pipeline, single turn)
        provider = _micro_pipeline("+otlp", os.path.join(root, "profile"), args.endpoint)
        profiler = cProfile.Profile(time.thread_time)  # CPU time: waiting for a core on a busy machine is no cost
        profiler.enable()
        _micro_workload(count, 1, tokenizer, carrier_bytes, client)
        profiler.disable()
        provider.force_flush()
        provider.shutdown()
        events.install(None)
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(18)
        results["profile"] = buf.getvalue()
    finally:
        sys.stdout.close()
        sys.stdout = sys_stdout
        shutil.rmtree(root, ignore_errors=True)
    from otel_verl import health

    results["dropped"] = health.snapshot()["dropped"]  # nothing may be lost, or the costs are too low
    return results


# --------------------------------------------------------------------------- parent


def _run_child(kind: str, args: argparse.Namespace, env: Dict[str, str], extra: List[str], timeout_s: float) -> Dict[str, Any]:
    fd, result_path = tempfile.mkstemp(prefix="bench_worker_", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--result", result_path,
           "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps), "--ab-pairs", str(args.ab_pairs), "--prompts", str(args.prompts), "--n", str(args.n), "--agent", args.agent,
           "--agent-workers", str(args.agent_workers), "--latency", str(args.latency),
           "--micro-trajectories", str(args.micro_trajectories), "--micro-repeats", str(args.micro_repeats)] + extra
    log_path = result_path[:-5] + ".log"
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0:
        with open(log_path, errors="replace") as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"{kind} child failed (rc={proc.returncode}); log {log_path}:\n{tail}")
    with open(result_path) as f:
        result = json.load(f)
    for path in (result_path, log_path):
        os.remove(path)
    return result


def _median(values: List[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run_e2e(args: argparse.Namespace, sink: SpanSink, work: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if args.repeats:
        runs: Dict[str, List[Dict[str, Any]]] = {"off": [], "on": []}
        for r in range(args.repeats):
            for mode in ("off", "on"):
                res = _e2e_run(args, sink, work, mode, r)
                runs[mode].append(res)
                print(f"  {mode:3s} run #{r}: worker CPU {res['worker_cpu_s']:.3f}s over {res['measured_wall_s']:.1f}s, "
                      f"{res['trajectories']} trajectories, {res['llm_turns']:.0f} LLM turns"
                      + (f", {res['spans_received']} spans exported, {res.get('jsonl_lines')} JSONL lines" if mode == "on" else ""),
                      flush=True)
        off = _median([r["worker_cpu_s"] for r in runs["off"]])
        on = _median([r["worker_cpu_s"] for r in runs["on"]])
        trajectories = _median([r["trajectories"] for r in runs["on"]])
        turns = _median([r["llm_turns"] for r in runs["on"]])
        out["runs"] = {
            "runs": runs, "off_cpu_s": off, "on_cpu_s": on, "added_cpu_s": on - off,
            "trajectories": trajectories, "llm_turns": turns,
            "per_trajectory_us": (on - off) / trajectories * 1e6 if trajectories else float("nan"),
            "per_turn_us": (on - off) / turns * 1e6 if turns else float("nan"),
            "off_spread_s": (min(r["worker_cpu_s"] for r in runs["off"]), max(r["worker_cpu_s"] for r in runs["off"])),
            "on_spread_s": (min(r["worker_cpu_s"] for r in runs["on"]), max(r["worker_cpu_s"] for r in runs["on"])),
            "setup_cpu_s": _median([r["setup_cpu_s"] for r in runs["on"]]),
            "export_cpu_s": _median([r.get("export_cpu_s", 0.0) for r in runs["on"]]),
        }
    if args.ab_pairs:
        res = _e2e_run(args, sink, work, "ab", 0)
        windows = res["windows"]
        for w in windows:
            print(f"  ab step ({'on ' if w['traced'] else 'off'}): worker CPU {w['cpu_s']:.3f}s over {w['wall_s']:.1f}s, "
                  f"{w['trajectories']} trajectories, {w['llm_turns']} LLM turns; "
                  + ", ".join(f"{k} {v:.0f}" if k in GC_COLLECTIONS else f"{k} {v:.2f}s"
                              for k, v in w["threads"].items()), flush=True)
        per_traj = {t: [w["cpu_s"] / w["trajectories"] for w in windows if w["traced"] is t and w["trajectories"]]
                    for t in (True, False)}
        per_turn = {t: [w["cpu_s"] / w["llm_turns"] for w in windows if w["traced"] is t and w["llm_turns"]]
                    for t in (True, False)}
        kinds = (LOOP_THREAD, TRACING_THREADS, "other threads", GC_SECONDS)
        per_export = {t: _median([w.get("export_cpu_s", 0.0) / w["trajectories"] for w in windows
                                  if w["traced"] is t and w["trajectories"]]) * 1e6 for t in (True, False)}
        per_kind = {
            kind: {t: _median([w["threads"].get(kind, 0.0) / w["trajectories"] for w in windows
                               if w["traced"] is t and w["trajectories"]]) * 1e6 for t in (True, False)}
            for kind in kinds
        }
        out["ab"] = {
            "windows": windows,
            "per_kind_us": per_kind,
            "export_per_trajectory_us": per_export,
            "gcs_per_step": {t: [_median([w["threads"].get(key, 0.0) for w in windows if w["traced"] is t])
                                 for key in GC_COLLECTIONS] for t in (True, False)},
            "on_per_trajectory_us": _median(per_traj[True]) * 1e6,
            "off_per_trajectory_us": _median(per_traj[False]) * 1e6,
            "per_trajectory_us": (_median(per_traj[True]) - _median(per_traj[False])) * 1e6,
            "per_turn_us": (_median(per_turn[True]) - _median(per_turn[False])) * 1e6,
            "on_spread_us": (min(per_traj[True]) * 1e6, max(per_traj[True]) * 1e6),
            "off_spread_us": (min(per_traj[False]) * 1e6, max(per_traj[False]) * 1e6),
            "trajectories_per_step": _median([w["trajectories"] for w in windows]),
            "turns_per_trajectory": sum(w["llm_turns"] for w in windows) / max(1, sum(w["trajectories"] for w in windows)),
            "spans_received": res["spans_received"],
            "setup_cpu_s": res["setup_cpu_s"],
        }
    return out


def _e2e_run(args: argparse.Namespace, sink: SpanSink, work: str, mode: str, r: int) -> Dict[str, Any]:
    out = os.path.join(work, f"e2e-{mode}-{r}")
    env = tracing_env(mode, os.path.join(out, "trace"), sink.endpoint)
    spans_before = sink.count()
    t = time.time()
    res = _run_child("e2e", args, env, ["--mode", mode, "--out", os.path.join(out, "harness")], args.timeout)
    res["spans_received"] = sink.count() - spans_before
    res["run_s"] = time.time() - t
    return res


def micro_table(micro: Dict[str, Any]) -> List[str]:
    v = micro["variants"]
    lines = [
        "| pipeline (added one at a time) | CPU / single-turn trajectory | of which event loop | CPU / extra LLM turn |",
        "|---|---|---|---|",
    ]
    prev1 = prev_slope = 0.0
    for variant in MICRO_VARIANTS:
        one, slope = v[f"{variant}/1"], micro_per_turn(micro, variant)
        lines.append(
            f"| {variant} | {one['total_us']:.0f} us (+{one['total_us'] - prev1:.0f}) | {one['loop_us']:.0f} us "
            f"| {slope:.0f} us (+{slope - prev_slope:.0f}) |"
        )
        prev1, prev_slope = one["total_us"], slope
    if f"{OFFLOAD_VARIANT}/1" in v:
        one = v[f"{OFFLOAD_VARIANT}/1"]
        lines += [
            "",
            "| the same outputs (+otlp) | worker process: CPU / single-turn trajectory | of which event loop "
            "| CPU / extra LLM turn | export process: CPU / trajectory | CPU / extra turn |",
            "|---|---|---|---|---|---|",
            f"| in the worker process (above) | {v['+otlp/1']['total_us']:.0f} us | {v['+otlp/1']['loop_us']:.0f} us "
            f"| {micro_per_turn(micro):.0f} us | | |",
            f"| via an export process (rollout workers' default) | {one['total_us']:.0f} us | {one['loop_us']:.0f} us "
            f"| {micro_per_turn(micro, OFFLOAD_VARIANT):.0f} us | {one['export_us']:.0f} us "
            f"| {micro_per_turn(micro, OFFLOAD_VARIANT, 'export_us'):.0f} us |",
        ]
    return lines


def micro_per_turn(micro: Dict[str, Any], variant: str = "+otlp", measure: str = "total_us") -> float:
    v = micro["variants"]
    return (v[f"{variant}/8"][measure] - v[f"{variant}/1"][measure]) / 7


def default_variant(micro: Dict[str, Any]) -> str:
    """The pipeline a rollout worker runs by default: via its export process."""
    return OFFLOAD_VARIANT if f"{OFFLOAD_VARIANT}/1" in micro["variants"] else "+otlp"


def micro_seed_lines(micro: Dict[str, Any]) -> List[str]:
    """The seed patch replayed in the same rounds, and the ratios the targets stand for."""
    v = micro["variants"]
    if "seed/1" not in v:
        return []
    seed_traj, seed_turn = v["seed/1"]["total_us"], micro_per_turn(micro, "seed")

    def ratio(ours: float, seed: float) -> str:
        return f"{ours / seed:.2f}x" if seed > 0 else "n/a"

    ours = [("otel_verl, full pipeline in the worker process", "+otlp")]
    if f"{OFFLOAD_VARIANT}/1" in v:
        ours.append(("otel_verl, via the export process (worker process only)", OFFLOAD_VARIANT))
    lines = [
        "| | CPU / single-turn trajectory | of which event loop | CPU / extra LLM turn |",
        "|---|---|---|---|",
        f"| seed patch, replayed (same calls, same rounds) | {seed_traj:.0f} us | {v['seed/1']['loop_us']:.0f} us "
        f"| {seed_turn:.0f} us |",
    ]
    for label, variant in ours:
        traj, turn = v[f"{variant}/1"]["total_us"], micro_per_turn(micro, variant)
        lines += [
            f"| {label} | {traj:.0f} us | {v[variant + '/1']['loop_us']:.0f} us | {turn:.0f} us |",
            f"| the same / seed | {ratio(traj, seed_traj)} | | {ratio(turn, seed_turn)} |",
        ]
    return lines + [
        f"| what the targets are of the seed's {ISSUE_SEED_TRAJ_US:.0f} / {ISSUE_SEED_TURN_US:.0f} us in the issue "
        f"| {TARGET_TRAJ_US / ISSUE_SEED_TRAJ_US:.2f}x | | {TARGET_TURN_US / ISSUE_SEED_TURN_US:.2f}x |",
        "",
        "The seed row runs the seed patch's own worker hooks (`bench_seed_comparison.Seed`: `[FLOW_TRACE]` print and "
        "queue per row, progress print and file append, `TurnRecord` / `asdict` / `json.dumps` JSONL with its "
        "executor) on the same trajectories, minus the same stand-ins bare. otel_verl's outputs also include OTLP.",
        "",
    ]


def report(args: argparse.Namespace, e2e: Optional[Dict[str, Any]], micro: Optional[Dict[str, Any]], command: str) -> str:
    lines = [DOC_SECTION, "", f"Command: `{command}`", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} shared cores (other jobs running: noisy). "
             f"Targets: <= {TARGET_TURN_US:.0f} us per LLM turn, <= {TARGET_TRAJ_US:.0f} us per single-turn trajectory "
             "(its JSONL line included).", ""]
    def verdict(value: float, target: float, spread: Optional[float] = None) -> str:
        # an end-to-end difference smaller than the untraced steps' own spread, or below
        # zero, is the machine's noise, not a cost that meets a target
        if value < 0 or (spread is not None and value < spread):
            return f"{value:.0f} us (unresolved: within the untraced runs' spread{f' of {spread:.0f} us' if spread else ''})"
        return f"{value:.0f} us ({'meets' if value <= target else 'misses'} <= {target:.0f})"

    if e2e is not None and "ab" in e2e:
        ab = e2e["ab"]
        lines += [
            f"### End to end, A/B in one run: AgentLoopWorker processes, {args.warmup_steps} warm-up step then "
            f"{args.ab_pairs} pairs of steps with tracing on / paused in the workers ({ab['trajectories_per_step']:.0f} "
            f"trajectories a step, {args.prompts} prompts x n={args.n}, {args.agent} agent, "
            f"{ab['turns_per_trajectory']:.2f} LLM turns a trajectory, {args.agent_workers} workers)",
            "",
            "A step's window: its generation plus a flush of the workers' outputs (CSV, progress, JSONL, OTLP/HTTP "
            "to a local sink). Median over the steps of each kind [min-max].",
            "",
            "| worker CPU per trajectory | tracing paused | tracing on | added by tracing |",
            "|---|---|---|---|",
            f"| per trajectory | {ab['off_per_trajectory_us']:.0f} us [{ab['off_spread_us'][0]:.0f}-{ab['off_spread_us'][1]:.0f}] "
            f"| {ab['on_per_trajectory_us']:.0f} us [{ab['on_spread_us'][0]:.0f}-{ab['on_spread_us'][1]:.0f}] "
            f"| {verdict(ab['per_trajectory_us'], TARGET_TRAJ_US, ab['off_spread_us'][1] - ab['off_spread_us'][0])} |",
            f"| per LLM turn | | | {verdict(ab['per_turn_us'], TARGET_TURN_US, ab['off_spread_us'][1] - ab['off_spread_us'][0])} |",
        ] + [
            f"| of it: {kind} | {ab['per_kind_us'][kind][False]:.0f} us | {ab['per_kind_us'][kind][True]:.0f} us "
            f"| {ab['per_kind_us'][kind][True] - ab['per_kind_us'][kind][False]:.0f} us |"
            for kind in (LOOP_THREAD, TRACING_THREADS, "other threads")
        ] + [
            "| garbage collection (any thread; young / middle / full collections a step, all workers: "
            f"{'/'.join(f'{c:.0f}' for c in ab['gcs_per_step'][False])} paused, "
            f"{'/'.join(f'{c:.0f}' for c in ab['gcs_per_step'][True])} on) "
            f"| {ab['per_kind_us'][GC_SECONDS][False]:.0f} us | {ab['per_kind_us'][GC_SECONDS][True]:.0f} us "
            f"| {ab['per_kind_us'][GC_SECONDS][True] - ab['per_kind_us'][GC_SECONDS][False]:.0f} us |",
            f"| one-time pipeline set-up (all workers, before fit) | | {ab['setup_cpu_s'] * 1000:.0f} ms | |",
            f"| not in the rows above: the workers' export processes (other processes) "
            f"| {ab['export_per_trajectory_us'][False]:.0f} us | {ab['export_per_trajectory_us'][True]:.0f} us "
            f"| {ab['export_per_trajectory_us'][True] - ab['export_per_trajectory_us'][False]:.0f} us |",
            "",
            f"The {TRACING_THREADS} row is exact (those threads exist for tracing only and run in the traced "
            "steps only); the event-loop row compares steps whose verl work itself varies by a second or more on a "
            "shared machine, so it is noisy (the in-process attribution below isolates it).",
            "",
        ]
    if e2e is not None and "runs" in e2e:
        runs = e2e["runs"]
        lines += [
            f"### End to end, separate runs: stock verl vs traced ({args.warmup_steps} warm-up + {args.steps} measured "
            f"step(s) x {args.prompts} prompts x n={args.n}, {args.agent} agent; median of {args.repeats} alternating "
            "off/on runs, each its own Ray cluster)",
            "",
            "| | tracing off | tracing on | added |",
            "|---|---|---|---|",
            f"| worker CPU, measured steps to end of fit (all workers) | {runs['off_cpu_s']:.3f} s "
            f"[{runs['off_spread_s'][0]:.3f}-{runs['off_spread_s'][1]:.3f}] | {runs['on_cpu_s']:.3f} s "
            f"[{runs['on_spread_s'][0]:.3f}-{runs['on_spread_s'][1]:.3f}] | {runs['added_cpu_s'] * 1000:.1f} ms |",
            f"| per trajectory ({runs['trajectories']:.0f}) | | | {verdict(runs['per_trajectory_us'], TARGET_TRAJ_US)} |",
            f"| per LLM turn ({runs['llm_turns']:.0f}) | | | {verdict(runs['per_turn_us'], TARGET_TURN_US)} |",
            f"| not in the rows above: the workers' export processes (other processes) | | "
            f"{runs['export_cpu_s']:.3f} s | {runs['export_cpu_s'] / runs['trajectories'] * 1e6 if runs['trajectories'] else float('nan'):.0f} us "
            "a trajectory |",
            "",
            "Separate runs differ by seconds of worker CPU on this shared machine whatever the tracing (see the "
            "spread), so this table only bounds the overhead; the A/B and the attribution below resolve it.",
            "",
        ]
    if micro is not None:
        lines += [
            f"### In-process attribution (the worker's events-API calls, {micro['trajectories']} trajectories, "
            f"{PROMPT_TOKENS}-token prompts, {COMPLETION_TOKENS}-token completions; minus the same loop untraced)",
            "",
        ] + micro_table(micro) + [
            "",
            f"Full pipeline in the worker process: {micro['variants']['+otlp/1']['total_us']:.0f} us per single-turn "
            f"trajectory, {micro_per_turn(micro):.0f} us per extra LLM turn. As rollout workers run it ({default_variant(micro)}): "
            f"{verdict(micro['variants'][default_variant(micro) + '/1']['total_us'], TARGET_TRAJ_US)} per single-turn "
            f"trajectory, {verdict(micro_per_turn(micro, default_variant(micro)), TARGET_TURN_US)} per extra LLM turn "
            f"in the worker process"
            + (f", and {micro['variants'][OFFLOAD_VARIANT + '/1']['export_us']:.0f} us / "
               f"{micro_per_turn(micro, OFFLOAD_VARIANT, 'export_us'):.0f} us in its export process on another core. "
               if default_variant(micro) == OFFLOAD_VARIANT else ". ") +
            f"Paced (one single-turn trajectory every {PACE_S * 1000:.0f} ms, as events arrive in a worker): "
            f"{micro['paced']['total_us']:.0f} us per trajectory, {micro['paced']['loop_us']:.0f} us of it on the event loop. "
            f"Lost spans/lines: {micro.get('dropped') or 'none'}.",
            "",
        ] + micro_seed_lines(micro)
    return "\n".join(lines)


def write_doc(section: str, extra_notes: str = "") -> None:
    text = ""
    if os.path.exists(DOC):
        with open(DOC, encoding="utf-8") as f:
            text = f.read()
    if not text.strip():
        text = "# Performance\n"
    body = section.rstrip() + "\n" + (extra_notes.rstrip() + "\n" if extra_notes else "")
    start = text.find(DOC_SECTION)
    if start < 0:
        text = text.rstrip() + "\n\n" + body
    else:
        # the section ends at the next heading or at another benchmark's generated block
        ends = [i for i in (text.find(mark, start + len(DOC_SECTION)) for mark in ("\n## ", "\n<!-- BEGIN "))
                if i >= 0]
        end = min(ends) if ends else -1
        notes_marker = "<!-- notes kept by bench_worker_overhead.py -->"
        kept = ""
        old = text[start:end if end >= 0 else len(text)]
        if notes_marker in old:  # hand-written notes below the marker survive a rerun
            kept = old[old.index(notes_marker):].rstrip() + "\n"
        text = text[:start] + body + ("\n" + kept if kept else "") + (text[end:] if end >= 0 else "")
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(text)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny run for CI: checks that everything works")
    parser.add_argument("--repeats", type=int, default=1, help="separate off/on run pairs (alternating; 0: none)")
    parser.add_argument("--ab-pairs", type=int, default=3,
                        help="in one traced run, measured step pairs with tracing on / paused in the workers (0: none)")
    parser.add_argument("--steps", type=int, default=1, help="measured steps (after the warm-up steps)")
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--agent", choices=("single", "tool"), default="single")
    parser.add_argument("--agent-workers", type=int, default=2)
    parser.add_argument("--latency", type=float, default=0.05, help="stand-in engine latency per request (s)")
    parser.add_argument("--micro-trajectories", type=int, default=1000)
    parser.add_argument("--micro-repeats", type=int, default=7)
    parser.add_argument("--no-e2e", action="store_true")
    parser.add_argument("--no-micro", action="store_true")
    parser.add_argument("--no-doc", action="store_true", help=f"do not update {os.path.relpath(DOC, ROOT)}")
    parser.add_argument("--timeout", type=float, default=1200.0, help="per run (s)")
    parser.add_argument("--work-dir", default=None, help="keep the runs' outputs here (default: a temporary dir, removed)")
    # child process plumbing
    parser.add_argument("--child", choices=("e2e", "micro"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("off", "on", "ab"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        result = child_e2e(args) if args.child == "e2e" else child_micro(args)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return 0

    command = "python benchmarks/bench_worker_overhead.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    if args.quick:
        args.repeats, args.ab_pairs, args.warmup_steps, args.steps, args.prompts, args.n = 1, 1, 1, 1, 2, 2
        args.micro_trajectories, args.micro_repeats = 100, 1
    work = args.work_dir or tempfile.mkdtemp(prefix="otel_verl_bench_worker_")
    sink = SpanSink()
    e2e = micro = None
    try:
        if not args.no_e2e:
            print(f"end to end: {args.repeats} x (off, on) runs, an A/B run of {args.ab_pairs} step pairs; "
                  f"{args.prompts} prompts x n={args.n} a step ({args.agent} agent); work dir {work}", flush=True)
            e2e = run_e2e(args, sink, work)
        if not args.no_micro:
            print(f"in-process attribution: {args.micro_trajectories} trajectories per variant", flush=True)
            env = tracing_env("off", "", "")
            env.pop("OTEL_VERL_ENABLED", None)
            micro = _run_child("micro", args, env, ["--endpoint", sink.endpoint], args.timeout)
    finally:
        sink.close()
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    section = report(args, e2e, micro, command)
    print()
    print(section)
    if micro is not None:
        print("cProfile of the calling thread (full pipeline, single-turn trajectories):")
        print("\n".join(micro["profile"].splitlines()[:40]))
    ok = True
    if args.quick:
        if e2e is not None and "runs" in e2e:
            on = e2e["runs"]["runs"]["on"][0]
            expected = (args.warmup_steps + args.steps) * args.prompts * args.n
            good = on["trajectories"] == args.steps * args.prompts * args.n and on["jsonl_lines"] == expected and on["spans_received"] > 0
            ok = ok and good
            print(f"quick check (runs): trajectories={on['trajectories']} jsonl_lines={on['jsonl_lines']} "
                  f"spans_received={on['spans_received']} -> {'ok' if good else 'FAILED'}")
        if e2e is not None and "ab" in e2e:
            windows = e2e["ab"]["windows"]
            good = [w["traced"] for w in windows] == [True, False] * args.ab_pairs and all(
                w["trajectories"] == args.prompts * args.n for w in windows) and e2e["ab"]["spans_received"] > 0
            ok = ok and good
            print(f"quick check (A/B): {len(windows)} step windows, spans_received={e2e['ab']['spans_received']} "
                  f"-> {'ok' if good else 'FAILED'}")
        if micro is not None and micro.get("dropped"):
            ok = False
            print(f"quick check: the attribution runs lost {micro['dropped']} -> FAILED")
    elif not args.no_doc:
        write_doc(section)
        print(f"wrote {os.path.relpath(DOC, ROOT)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
