"""Rollout-worker CPU per LLM turn, per tool call and per single-turn trajectory, through
otel_verl's real wrappers (the goals, via the export process: <= 75 us per extra LLM
turn, <= 150 us per single-turn trajectory with its JSONL line).

    python benchmarks/bench_worker_wrappers.py            # 1024 trajectories a round, 6 rounds
    python benchmarks/bench_worker_wrappers.py --quick    # tiny run: only checks that it works

``bench_worker_overhead.py``'s in-process attribution calls the events API the way the
wrappers would; this one runs the wrappers themselves. The hook tables of
``otel_verl.instrumentation`` (``_run_agent_loop``, agent ``run()``, ``_compute_score``,
``LLMServerClient.generate`` / ``_vllm_request_id``, ``ToolAgentLoop._call_tool`` /
``_handle_processing_tools_state``) are installed by ``hooks.install_all`` on the verl
stand-ins of ``bench_seed_comparison`` (verl 0.9.1's signatures; the LLM server answers
at once with 256 completion tokens and sglang's timing keys). Three agent loops, their
trajectories run concurrently on one event loop as in an AgentLoopWorker: single-turn;
4 LLM turns; 4 LLM turns with a tool call and its observation between them
(ToolAgentLoop's shape). A traced row carries the trainer's carrier, as in a job
whose trainer is traced too: the worker's chunk of the column is unpickled once a round,
as Ray hands it over (one pickle: the carriers' class is resolved once).

Each round runs every agent loop twice in the same process: stock (no wrapper installed,
``hooks.uninstall_all``) and traced (wrappers installed, legacy files + OTLP/HTTP to a
loopback sink). Added CPU = traced - stock, best of the rounds: per single-turn
trajectory; per extra LLM turn = (4-turn - single-turn) / 3; per tool call = (tool
trajectory - 4-turn trajectory) / 3. "Worker process" is ``time.process_time`` (every
thread: event loop, the export process's sender); "event loop" the calling thread alone;
the export process (``otel_verl.offload``, the rollout workers' default) is another
process, its CPU read apart (``psutil``). ``--offload 0`` writes the outputs in the
worker process instead. Each configuration runs in a child process of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

TARGET_TURN_US = 75.0
TARGET_TRAJ_US = 150.0
AGENTS = ("single", "llm4", "tool4")  # single-turn, 4 LLM turns, 4 LLM turns + 3 tool calls
TURNS = 4  # LLM turns of the multi-turn loops (bench_seed_comparison.TOOL_TURNS)
CONFIGS = (("via an export process (rollout workers' default)", "1"), ("outputs in the worker process", "0"))


class Workload:
    """The three agent loops on the verl stand-ins, stock or traced (``traced(on)``), run
    as ``n`` concurrent trajectories of one AgentLoopWorker (``run(agent, on)``)."""

    def __init__(self, n: int, offload: str, endpoint: str, work: str, tokenizer: str = "model") -> None:
        import bench_seed_comparison as stand_ins

        for key in [k for k in os.environ if k.startswith("OTEL_") or k == "VERL_TRACE_DIR"]:
            del os.environ[key]
        os.environ.update({"VERL_TRACE_DIR": os.path.join(work, f"trace-{offload}"), "OTEL_VERL_OTLP_FILE": "0",
                           "OTEL_VERL_OFFLOAD": offload, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
        assert stand_ins.TOOL_TURNS == TURNS, "the per-turn slopes assume 4-turn loops"
        stand_ins._TOKENIZER, _ = stand_ins.load_tokenizer(tokenizer)

        from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

        from otel_verl import activation, bootstrap, carriers
        from otel_verl.events import _core
        from otel_verl.instrumentation import hooks
        from otel_verl.instrumentation.agent_loop import _agent_run

        if not bootstrap.configure(role="agent_loop_worker"):
            raise RuntimeError("otel_verl did not configure")
        self._state, self._core, self._hooks, self._agent_run = _core.state(), _core, hooks, _agent_run
        self.stand_ins, self.n = stand_ins, n

        class FourTurnAgentLoop(stand_ins.ToolAgentLoop):
            """ToolAgentLoop's turns without its tool calls (an environment's reply instead)."""

            async def run(self, sampling_params: Dict[str, Any], **kwargs: Any) -> Any:
                prompt = list(stand_ins.PROMPT_IDS)
                for _ in range(stand_ins.TOOL_TURNS):
                    out = await self.client.generate(kwargs["request_id"], prompt_ids=prompt, sampling_params=sampling_params)
                    prompt = prompt + out.token_ids + stand_ins.OBSERVATION_IDS
                return stand_ins.AgentLoopOutput(stand_ins.PROMPT_IDS, prompt[len(stand_ins.PROMPT_IDS):], stand_ins.TOOL_TURNS)

        self._four, self._single = FourTurnAgentLoop, stand_ins.SingleTurnAgentLoop
        self.worker = stand_ins.AgentLoopWorker(0, stand_ins._Config(), stand_ins._TOKENIZER, 8)
        self.loop = asyncio.new_event_loop()
        self._trajectory = {"step": 1, "sample_index": 0, "rollout_n": 0, "validate": False}
        self._sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": stand_ins.COMPLETION_TOKENS}
        # Each row's carrier as the traced trainer sends it (its rollout span's context, the
        # row's traj_uid and worker): the worker's chunk of the column, pickled as one (Ray
        # hands the worker its chunk in one pickle); a traced round unpickles it, as Ray
        # does (stock verl has no such column).
        self._carriers = pickle.dumps([carriers.TraceCarrier.from_span(NonRecordingSpan(SpanContext(
            0x1000 + i // 8, 0x2000 + i // 8, False, TraceFlags(TraceFlags.SAMPLED)))).with_row(
            {"traj_uid": str(i % 8), "worker": 0}) for i in range(n)])
        self._column = carriers.COLUMN
        activation._activated_pid = os.getpid()  # a traced worker: carriers need not activate tracing

    def traced(self, on: bool) -> None:
        if on:
            self.stand_ins.install_otel_verl()
            self._hooks.install_on(self._four, "run", self._agent_run)
            self._core.install(self._state)
        else:
            self._core.install(None)
            self._hooks.uninstall_all()

    def _row(self, i: int, chunk: Optional[List[Any]]) -> Dict[str, Any]:
        columns = {"uid": f"uid-{i // 8}", "traj_uid": str(i % 8)}
        if chunk is not None:
            columns[self._column] = chunk[i]
        return columns

    def run(self, agent: str, on: bool) -> None:
        """``n`` trajectories of ``agent`` at once, every output written and exported."""
        # the stand-in worker picks ToolAgentLoop for "tool_agent", the module's single-turn class otherwise
        self.stand_ins.SingleTurnAgentLoop = self._four if agent == "llm4" else self._single
        name = "tool_agent" if agent == "tool4" else "single_turn_agent"

        async def trajectories() -> None:
            chunk = pickle.loads(self._carriers) if on else None
            await asyncio.gather(*(self.worker._run_agent_loop(self._sampling, self._trajectory, agent_name=name,
                                                               request_id=f"r{i}", **self._row(i, chunk))
                                   for i in range(self.n)))

        self.loop.run_until_complete(trajectories())
        self.flush()
        self.worker.client.sent = []

    def flush(self) -> None:
        from otel_verl import bootstrap

        bootstrap.flush()  # every output written, exported (and the export process's work done)

    def close(self) -> None:
        from otel_verl import bootstrap

        self.traced(False)
        bootstrap.shutdown()
        self.stand_ins.SingleTurnAgentLoop = self._single


def child(n: int, rounds: int, offload: str, endpoint: str, work: str) -> Dict[str, Any]:
    from bench_worker_overhead import _cpu_seconds, _export_process_pids

    from otel_verl import health

    workload = Workload(n, offload, endpoint, work)

    def export_cpu() -> float:
        return sum(_cpu_seconds(pid) for pid in _export_process_pids(os.getpid()))

    best: Dict[str, Dict[str, float]] = {}
    for r in range(rounds + 1):  # round 0 warms up
        for on in (False, True):
            workload.traced(on)
            for agent in AGENTS:
                gc.collect()
                workload.flush()
                p0, t0, e0 = time.process_time(), time.thread_time(), export_cpu()
                workload.run(agent, on)
                p1, t1, e1 = time.process_time(), time.thread_time(), export_cpu()
                if r == 0:
                    continue
                key = f"{'traced' if on else 'stock'}/{agent}"
                got = {"process_us": (p1 - p0) / n * 1e6, "loop_us": (t1 - t0) / n * 1e6, "export_us": (e1 - e0) / n * 1e6}
                prev = best.get(key)
                best[key] = got if prev is None else {k: min(prev[k], got[k]) for k in got}
    workload.close()
    return {"n": n, "rounds": rounds, "offload": offload, "best": best, "health": health.snapshot()}


def added(best: Dict[str, Dict[str, float]], measure: str) -> Dict[str, float]:
    """Traced minus stock: per single-turn trajectory, per extra LLM turn, per tool call."""
    d = {a: best[f"traced/{a}"][measure] - best[f"stock/{a}"][measure] for a in AGENTS}
    extra = TURNS - 1
    return {"trajectory": d["single"], "llm_turn": (d["llm4"] - d["single"]) / extra,
            "tool_call": (d["tool4"] - d["llm4"]) / extra}


def report(results: List[Dict[str, Any]]) -> str:
    lines = ["| outputs written | worker process: / single-turn trajectory (event loop) | / extra LLM turn (event loop) "
             "| / tool call (event loop) | export process: / trajectory, / LLM turn, / tool call |", "|---|---|---|---|---|"]
    verdicts = []
    for label, result in results:
        p, l = added(result["best"], "process_us"), added(result["best"], "loop_us")
        e = added(result["best"], "export_us") if result["offload"] == "1" else None
        lines.append(
            f"| {label} | {p['trajectory']:.0f} us ({l['trajectory']:.0f}) | {p['llm_turn']:.0f} us ({l['llm_turn']:.0f}) "
            f"| {p['tool_call']:.0f} us ({l['tool_call']:.0f}) | "
            + (f"{e['trajectory']:.0f} / {e['llm_turn']:.0f} / {e['tool_call']:.0f} us |" if e else "|"))
        verdicts.append(
            f"{label}: {p['trajectory']:.0f} us per single-turn trajectory "
            f"({'meets' if p['trajectory'] <= TARGET_TRAJ_US else 'misses'} <= {TARGET_TRAJ_US:.0f}), "
            f"{p['llm_turn']:.0f} us per LLM turn ({'meets' if p['llm_turn'] <= TARGET_TURN_US else 'misses'} "
            f"<= {TARGET_TURN_US:.0f}), {p['llm_turn'] + p['tool_call']:.0f} us per LLM turn with its tool call.")
    dropped = {k: v for _, r in results for k, v in r["health"]["dropped"].items()}
    n, rounds = results[0][1]["n"], results[0][1]["rounds"]
    head = (f"Added by tracing in the worker process (traced - stock, best of {rounds} rounds of {n} trajectories; "
            "legacy files + OTLP/HTTP to a loopback sink):")
    return "\n".join([head, "", *lines, "", *verdicts, f"Lost spans/lines: {dropped or 'none'}."])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 trajectories, 1 round: checks that it works")
    parser.add_argument("--trajectories", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--offload", default="1", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    n, rounds = (64, 1) if args.quick else (args.trajectories, args.rounds)
    if args.child:
        result = child(n, rounds, args.offload, args.endpoint, os.path.dirname(os.path.abspath(args.result)))
        with open(args.result, "w") as f:
            json.dump(result, f)
        return 0

    from bench_worker_overhead import SpanSink

    sink = SpanSink()
    work = tempfile.mkdtemp(prefix="bench_worker_wrappers_")
    results = []
    try:
        for label, offload in CONFIGS:
            print(f"[bench] {label} ...", file=sys.stderr, flush=True)
            result_path = os.path.join(work, f"result-{offload}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--offload", offload, "--endpoint", sink.endpoint,
                   "--trajectories", str(n), "--rounds", str(rounds), "--result", result_path]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
            env.setdefault("RAY_AUTH_MODE", "disabled")
            # stdout: the progress lines the outputs print (a Ray worker's go to its log file)
            proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"child (offload={offload}) failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
            with open(result_path) as f:
                body = f.read()
            results.append((label, json.loads(body)))
    finally:
        sink.close()
        shutil.rmtree(work, ignore_errors=True)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({label: r for label, r in results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
