"""CPU per span type and per output: what each kind of span costs in each output.

    python benchmarks/bench_span_costs.py            # 512 trajectories a workload, best of 3
    python benchmarks/bench_span_costs.py --quick    # 32, once: only checks that it works

Three workloads go through otel_verl's events API in one process, as its wrappers call it
in a rollout worker (and the LLM server's request spans in the same process): single-turn
trajectories (the trajectory, its LLM call, the server's request, the reward), 4-turn ones
(three more LLM calls and requests, each turn's prompt the last one's plus 64 tokens), and
4-turn ones with a tool call between turns. Each runs with otel_verl's provider and:

- no output: the spans made and ended on the calling thread (the events API's part);
- one output alone, as the outputs module builds it: the sample-flow CSV, the progress log, the
  trajectory JSONL (token ids decoded by a stand-in byte tokenizer), the OTLP-JSON files,
  OTLP (otel_verl's encoder, OTLP/HTTP to a receiver in another process), the metrics.

Each run is the process's CPU (every thread: the outputs' writer and batch threads
included) over the trajectories and a flush of the output, best of the rounds, less the
same trajectories with tracing off. An output's row is its run less the no-output run.
Per single-turn trajectory = run / trajectories (an output's fixed costs, building it and
its first and last export, spread over them: at 512 a few µs); per extra LLM turn =
(4-turn - single-turn) / 3; per tool call = (tool - 4-turn) / 3.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402

from otel_verl import events, health, outputs, settings  # noqa: E402
from otel_verl.instrumentation import tracing  # noqa: E402
from otel_verl.sampling import IsolatingSpanProcessor, UidIdGenerator, record_dropped_samples  # noqa: E402
from otel_verl.slim_span import SlimTracer  # noqa: E402

TURNS = 4
PROMPT_TOKENS, COMPLETION_TOKENS, TURN_TOKENS = 512, 256, 64
SERVER_META = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS, "cached_tokens": 0,
               "e2e_latency": 0.5, "queue_time": 0.02, "request_received_ts": 1.7e9,
               "prefill_finished_time": 1.7e9 + 0.03}
OUTPUTS = ("sample_csv", "progress_log", "trajectory_jsonl", "otlp_json_file", "otlp", "metrics")
# a receiver of OTLP/HTTP requests in a process of its own: answers each with 200
RECEIVER = """
import http.server, sys
class Ok(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def decode(ids: Any, **options: Any) -> str:
    """A stand-in tokenizer's decode: a byte per token."""
    return bytes(i % 128 for i in ids).decode("ascii")


def workload(n: int, turns: int, tools: bool) -> None:
    """``n`` trajectories of ``turns`` LLM calls (a tool call between two)."""
    for i in range(n):
        uid = f"6f1c3a0e-1111-2222-3333-{i:012x}"
        with events.trajectory(uid, f"{uid}_{i % 16}", step=1, agent_name="tool_agent", provider="sglang",
                               worker_index=0, decode=decode):
            prompt = list(range(PROMPT_TOKENS))
            for turn_index in range(turns):
                if tools and turn_index:
                    with events.tool_call("calculator", call_id=f"c{i}-{turn_index}") as tool:
                        tool.result("42")
                with events.llm_call(prompt, model="Qwen2.5-7B-Instruct", provider="sglang",
                                     request_id=f"r{i}-{turn_index}", max_tokens=COMPLETION_TOKENS) as turn:
                    headers = turn.carrier()
                    with events.llm_server_call(headers, request_id=f"r{i}-{turn_index}", provider="sglang") as call:
                        call.record_meta(SERVER_META)
                    completion = list(range(COMPLETION_TOKENS))
                    turn.finish(completion, stop_reason="stop", server_meta=dict(SERVER_META))
                prompt = prompt + completion + list(range(TURN_TOKENS))
            with events.reward() as reward:
                reward.score(1.0)


def processors_of(output: Optional[str], trace_dir: str, endpoint: str) -> List[Any]:
    """The output's span processor as the outputs module builds it (none: no output)."""
    if output is None:
        return []
    env = {settings.TRACE_DIR: trace_dir, "OTEL_VERL_ENABLED": "1"}
    if output == "otlp":
        env[settings.OTLP_ENDPOINT] = endpoint
    if output == "otlp_json_file":
        env["OTEL_VERL_OTLP_FILE"] = "1"
    cfg = settings.load(env)
    if output == "metrics":  # over OTLP, as the metrics go where the spans go
        return [outputs.metrics_processor(cfg)]
    built = outputs.build(cfg, {"verl.role": "agent_loop_worker"})
    wanted = {"sample_csv": "SampleCsvProcessor", "progress_log": "ProgressLogProcessor",
              "trajectory_jsonl": "TrajectoryJsonlProcessor"}.get(output)
    chosen = [p for p in built if (type(p).__name__ == wanted if wanted else getattr(p, "output", None) == output)]
    for other in built:
        if other not in chosen:
            other.shutdown()
    return chosen


def run_cpu_s(output: Optional[str], n: int, turns: int, tools: bool, endpoint: str, traced: bool = True) -> float:
    """CPU of one run: the workload, then a flush of its output. What it prints (the
    progress lines) goes to a file, as a Ray worker's output goes to its log."""
    with tempfile.TemporaryDirectory() as trace_dir, open(os.path.join(trace_dir, "stdout"), "w") as log, \
            contextlib.redirect_stdout(log):
        active = IsolatingSpanProcessor()
        provider = TracerProvider(resource=Resource.create({"service.name": "bench", "verl.role": "agent_loop_worker"}),
                                  sampler=record_dropped_samples(), id_generator=UidIdGenerator(),
                                  active_span_processor=active)
        for processor in processors_of(output, trace_dir, endpoint):
            provider.add_span_processor(processor)
        if traced:
            tracing.use_provider(provider, settings.load({"OTEL_VERL_ENABLED": "1"}), SlimTracer(provider, active))
        start = time.process_time()
        workload(n, turns, tools)
        provider.force_flush(60_000)
        cpu = time.process_time() - start
        provider.shutdown()
        tracing.stop()
        return cpu


@contextlib.contextmanager
def otlp_receiver():
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def measure(n: int, rounds: int) -> Dict[str, Dict[str, float]]:
    """output -> workload -> best CPU (s) of the rounds, stock runs included (``stock``)."""
    shapes = {"single-turn": (1, False), "4-turn": (TURNS, False), "4-turn tools": (TURNS, True)}
    variants: List[Optional[str]] = ["stock", None, *OUTPUTS]
    best: Dict[str, Dict[str, float]] = {str(v): {s: float("inf") for s in shapes} for v in variants}
    with otlp_receiver() as endpoint:
        os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                           "OTEL_METRICS_EXPORTER": "otlp"})
        for _ in range(rounds):
            for variant in variants:  # in turns: the machine's load changes alike for each
                for shape, (turns, tools) in shapes.items():
                    cpu = run_cpu_s(None if variant == "stock" else variant, n, turns, tools, endpoint,
                                    traced=variant != "stock")
                    best[str(variant)][shape] = min(best[str(variant)][shape], cpu)
    return best


def table(best: Dict[str, Dict[str, float]], n: int) -> List[str]:
    def per_span_type(run: Dict[str, float], base: Dict[str, float]) -> List[float]:
        cost = {shape: (run[shape] - base[shape]) / n * 1e6 for shape in run}
        return [cost["single-turn"], (cost["4-turn"] - cost["single-turn"]) / (TURNS - 1),
                (cost["4-turn tools"] - cost["4-turn"]) / (TURNS - 1)]

    lines = ["| part | per single-turn trajectory | per extra LLM turn | per tool call |", "|---|---|---|---|"]
    rows: List[tuple] = [("events API, no output (the calling thread)", per_span_type(best["None"], best["stock"]))]
    rows += [(output, per_span_type(best[output], best["None"])) for output in OUTPUTS]
    total = [sum(row[1][i] for row in rows) for i in range(3)]
    for name, costs in [*rows, ("all of the above", total)]:
        lines.append(f"| {name} | " + " | ".join(f"{c:.0f} µs" for c in costs) + " |")
    return lines


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 trajectories, once: checks that it works")
    parser.add_argument("-n", type=int, help="trajectories a workload (default 512)")
    args = parser.parse_args(argv)
    n, rounds = (32, 1) if args.quick else (512, 3)
    n = args.n or n
    health.reset()
    best = measure(n, rounds)
    print(f"{n} trajectories a workload, best of {rounds}; CPU of every thread, less the stock run")
    print("\n".join(table(best, n)))
    lost = health.snapshot()
    print(f"dropped: {lost['dropped'] or 'none'}; failures: {lost['failures'] or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
