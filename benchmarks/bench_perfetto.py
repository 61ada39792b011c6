"""``otel-verl report --perfetto`` on one generated training step: time and file size.

    python benchmarks/bench_perfetto.py [--prompts 1024] [--n 16] [--turns 1] [--quick]
                                        [--json PATH] [--keep DIR]

Writes the OTLP-JSON files of one demo-shaped v0 step with ``--prompts`` prompts x
``--n`` trajectories, one file per process as otel_verl writes them (``otlp/spans-*.jsonl``,
512 spans a line): a trainer (``verl.fit``, the step and its 9 stages, per uid
``verl.sample``, ``verl.rollout`` and 5 ``verl.sample_stage`` spans), 8 rollout workers
(per trajectory ``invoke_agent`` with ``--turns`` ``chat`` turns, an ``execute_tool``
between two turns, and ``verl.reward``), 8 LLM servers (a ``verl.llm_server.generate``
per turn) and a reward worker (``verl.reward_worker.compute_score`` per trajectory). The
rollout lasts about a minute: every trajectory starts within the first second, as verl
dispatches them, and the turns of a server end spread over the minute, so its requests
overlap as a loaded engine's do.

Then it times what ``otel-verl report TRACE_DIR --perfetto FILE`` does: the files loaded
into the span store beside them and the run's spans read back (``read_s``), tracks laid
out and the trace written (:func:`otel_verl.tools.report.perfetto.write_spans`), and prints
the time and the file's size.
For 1024 x 16 single-turn trajectories that is 89,099 spans.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any, Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))  # otlp_runs: spans as OTLP-JSON

from otel_verl import semconv as sc  # noqa: E402
from otel_verl.ids import trace_id_for_uid  # noqa: E402
from otlp_runs import otlp_attributes  # noqa: E402

WORKERS, SERVERS = 8, 8
SAMPLE_STAGES = ("reward", "old_log_prob", "ref_log_prob", "adv", "update_actor")
STEP_STAGES = ("generation", "reward", "old_log_prob", "ref_log_prob", "adv", "update_actor", "record_metrics",
               "sync_params", "eval")
MODEL = "qwen2.5-7b"
S = 1_000_000_000


def expected_spans(prompts: int, n: int, turns: int) -> int:
    """fit + step + its stages; per uid sample, rollout, sample stages; per trajectory the
    agent span, its turns with their server spans, tools between turns, reward and the
    reward worker's span."""
    return 2 + len(STEP_STAGES) + prompts * (2 + len(SAMPLE_STAGES)) + prompts * n * (3 + 2 * turns + (turns - 1))


class _Process:
    def __init__(self, role: str, pid: int, run_id: str) -> None:
        self.pid = pid
        self.resource = {"attributes": otlp_attributes({
            sc.SERVICE_NAME: sc.service_name(role), sc.SERVICE_NAMESPACE: "verl",
            sc.SERVICE_INSTANCE_ID: str(uuid.uuid4()), sc.ROLE: role, sc.RUN_ID: run_id,
            sc.HOST_NAME: "node-0", sc.PROCESS_PID: pid})}
        self.spans: List[Dict[str, Any]] = []

    def span(self, rng: random.Random, trace_id: int, parent: str | None, name: str, kind: int, start: int, end: int,
             attributes: Dict[str, Any], span_id: str | None = None) -> str:
        span_id = span_id or "%016x" % rng.getrandbits(64)
        span = {"traceId": "%032x" % trace_id, "spanId": span_id, "name": name, "kind": kind,
                "startTimeUnixNano": str(start), "endTimeUnixNano": str(end),
                "attributes": otlp_attributes(attributes), "status": {}}
        if parent:
            span["parentSpanId"] = parent
        self.spans.append(span)
        return span_id

    def write(self, directory: str, mode: str = "w") -> None:
        with open(os.path.join(directory, f"spans-node-0-pid{self.pid}.jsonl"), mode, encoding="utf-8") as f:
            for i in range(0, len(self.spans), 512):
                line = {"resourceSpans": [{"resource": self.resource, "scopeSpans": [
                    {"scope": {"name": "otel_verl"}, "spans": self.spans[i:i + 512]}]}]}
                f.write(json.dumps(line, separators=(",", ":")) + "\n")


STEP_INTERVAL_S = 100  # between two steps' starts: a step lasts about 78 s


def generate(trace_dir: str, prompts: int, n: int, turns: int, seed: int = 0, step: int = 1) -> int:
    """Write one step's OTLP-JSON files under ``trace_dir/otlp``; returns the span count.
    A ``step`` after the first is appended to the files, ``STEP_INTERVAL_S`` after the one
    before it, without the run's ``verl.fit`` span: one run of several steps (give each
    step its own ``seed`` for its own uids)."""
    rng = random.Random(seed)
    run_id = "bench-perfetto"
    otlp = os.path.join(trace_dir, "otlp")
    os.makedirs(otlp, exist_ok=True)
    trainer = _Process(sc.Role.TRAINER.value, 1000, run_id)
    workers = [_Process(sc.Role.AGENT_LOOP_WORKER.value, 2000 + i, run_id) for i in range(WORKERS)]
    servers = [_Process(sc.Role.LLM_SERVER.value, 3000 + i, run_id) for i in range(SERVERS)]
    rewarder = _Process(sc.Role.REWARD_WORKER.value, 4000, run_id)
    t0 = (1_800_000_000 + (step - 1) * STEP_INTERVAL_S) * S
    rollout_s = 60.0
    step_attrs = {sc.GLOBAL_STEP: step, sc.TRAINER: "RayPPOTrainer"}
    generation_end = t0 + int((rollout_s + 2) * S)
    stage_times = {}
    at = generation_end
    for stage in STEP_STAGES[1:]:
        stage_times[stage] = (at, at + 2 * S)
        at += 2 * S
    stage_times["generation"] = (t0, generation_end)
    step_end = at
    if step == 1:
        trainer.span(rng, rng.getrandbits(128), None, sc.SPAN_FIT, 1, t0 - S, t0 - S + 1000,
                     {sc.TRAINER: "RayPPOTrainer", sc.TOTAL_TRAINING_STEPS: 1, sc.ROLLOUT_N: n})
    step_trace = rng.getrandbits(128)
    step_id = trainer.span(rng, step_trace, None, sc.SPAN_STEP, 1, t0, step_end, dict(step_attrs))
    for stage in STEP_STAGES:
        start, end = stage_times[stage]
        trainer.span(rng, step_trace, step_id, sc.step_stage_span_name(stage), 1, start, end,
                     {**step_attrs, sc.STAGE: stage})
    request = 0
    for p in range(prompts):
        uid = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        trace = trace_id_for_uid(uid)
        uid_attrs = {sc.UID: uid, **step_attrs}
        sample = trainer.span(rng, trace, None, sc.SPAN_SAMPLE, 1, t0, step_end,
                              {**uid_attrs, sc.SAMPLE_OUTCOME: "trained"})
        trajs = [str(j) for j in range(n)]
        rollout = trainer.span(rng, trace, sample, sc.SPAN_ROLLOUT, 1, t0, generation_end,
                               {**uid_attrs, sc.TRAJ_UIDS: trajs})
        for stage in SAMPLE_STAGES:
            start, end = stage_times[stage]
            trainer.span(rng, trace, sample, sc.sample_stage_span_name(stage), 1, start + 1000, end - 1000,
                         {**uid_attrs, sc.STAGE: stage, sc.TRAJ_UIDS: trajs})
        for traj in trajs:
            row = p * n + int(traj)
            worker = workers[row * WORKERS // (prompts * n)]
            traj_attrs = {sc.UID: uid, sc.TRAJ_UID: traj, sc.GLOBAL_STEP: step}
            start = t0 + int(rng.uniform(0.1, 1.0) * S)
            finish = t0 + int(rng.uniform(5.0, rollout_s) * S)
            slot = (finish - start - 60_000_000) // turns  # the turns, tools between them, then a 50 ms reward
            agent_id = "%016x" % rng.getrandbits(64)
            at = start + 1_000_000
            for turn in range(turns):
                server = servers[request % SERVERS]
                request += 1
                end = at + slot - 3_000_000
                chat = worker.span(rng, trace, agent_id, f"chat {MODEL}", 3, at, end, {
                    **traj_attrs, sc.GEN_AI_OPERATION_NAME: sc.OP_CHAT, sc.GEN_AI_REQUEST_MODEL: MODEL,
                    sc.GEN_AI_USAGE_INPUT_TOKENS: 512, sc.GEN_AI_USAGE_OUTPUT_TOKENS: 256,
                    sc.LLM_REQUEST_ID: uuid.UUID(int=rng.getrandbits(128)).hex})
                server.span(rng, trace, chat, sc.SPAN_LLM_SERVER, 2, at + 500_000, end - 500_000, {
                    sc.GEN_AI_PROVIDER_NAME: "sglang", sc.llm_server_meta_attribute("completion_tokens"): 256,
                    sc.llm_server_meta_attribute("e2e_latency"): (end - at - 1_000_000) / S})
                at = end + 1_000_000
                if turn < turns - 1:
                    worker.span(rng, trace, agent_id, sc.tool_span_name("calculator"), 1, at, at + 500_000, {
                        **traj_attrs, sc.GEN_AI_OPERATION_NAME: sc.OP_EXECUTE_TOOL, sc.GEN_AI_TOOL_NAME: "calculator"})
                    at += 1_000_000
            reward = worker.span(rng, trace, agent_id, sc.SPAN_REWARD, 1, finish - 51_000_000, finish - 1_000_000,
                                 {**traj_attrs, sc.REWARD_SCORE: 1.0})
            rewarder.span(rng, trace, reward, sc.SPAN_REWARD_WORKER, 2, finish - 50_000_000, finish - 2_000_000,
                          {**traj_attrs, sc.REWARD_SCORE: 1.0})
            worker.span(rng, trace, rollout, sc.agent_span_name("tool_agent"), 1, start, finish, {
                **traj_attrs, sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT, sc.GEN_AI_AGENT_NAME: "tool_agent",
                sc.NUM_TURNS: turns, sc.REWARD_SCORE: 1.0}, span_id=agent_id)
    processes = [trainer, *workers, *servers, rewarder]
    for process in processes:
        process.write(otlp, "w" if step == 1 else "a")
    return sum(len(process.spans) for process in processes)


def run(prompts: int, n: int, turns: int, keep: str | None = None) -> Dict[str, Any]:
    from otel_verl.tools.report import perfetto
    from otel_verl.tools.store import spans as store_spans
    from otel_verl.tools.store.store import open_store

    work = tempfile.mkdtemp(prefix="bench-perfetto-")
    try:
        trace_dir = os.path.join(work, "trace")
        generated = generate(trace_dir, prompts, n, turns)
        out = os.path.join(keep or work, "step.pftrace")
        started = time.perf_counter()
        store, _, _ = open_store([trace_dir], None)
        with store:
            spans = store_spans.of_run(store, None)
        read_s = time.perf_counter() - started
        written = perfetto.write_spans(spans, out)
        total_s = time.perf_counter() - started
        return {"prompts": prompts, "n": n, "turns": turns, "spans": generated, "read_s": read_s,
                "convert_s": total_s - read_s, "total_s": total_s, **written.as_dict()}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--n", type=int, default=16, help="trajectories per prompt")
    parser.add_argument("--turns", type=int, default=1, help="LLM turns per trajectory (a tool call between two)")
    parser.add_argument("--quick", action="store_true", help="16 prompts x 4, 2 turns: checks that it works")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--keep", help="write the .pftrace into this directory and keep it")
    args = parser.parse_args(argv)
    prompts, n, turns = (16, 4, 2) if args.quick else (args.prompts, args.n, args.turns)
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    result = run(prompts, n, turns, args.keep)
    print(f"{prompts} prompts x {n} trajectories, {turns} turn(s): {result['spans']:,} spans")
    print(f"conversion: {result['total_s']:.1f} s (loading the OTLP-JSON files and reading the spans back "
          f"{result['read_s']:.1f} s, "
          f"tracks and trace {result['convert_s']:.1f} s)")
    print(f"file: {result['bytes'] / 1e6:.1f} MB, {result['slices']:,} slices on {result['slice_tracks']:,} tracks "
          f"({result['trajectory_tracks']:,} trajectories), {result['flows']:,} flows, "
          f"{result['counter_tracks']} counter tracks, left out: {sum(v['spans'] for v in result['left_out'].values())}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
