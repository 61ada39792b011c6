"""CPU cost of one trajectory JSONL line: otel_verl vs a seed-like writer.

otel_verl: a single-turn trajectory through the events API (trajectory, agent_run,
llm_call -> finish, agent_metrics, reward: five spans) with the TrajectoryJsonlProcessor,
which decodes and formats on its writer thread.

Seed-like baseline, on the same token ids and meta: what the original patch did per
trajectory on the agent loop's event loop: decode the completion at the turn, fill a
turn dataclass, build the trajectory dataclass (decoding the initial prompt), ``asdict``,
drop fields, ``json.dumps`` twice, then hand the line to a one-thread executor that
appends and flushes.

Both are measured in process CPU time (every thread, the writer's included) from the
first trajectory until every line is on disk, plus the CPU of the calling thread alone
(what the event loop pays). One run each, after a warm-up.

    python benchmarks/bench_trajectory_jsonl.py            # 5000 trajectories
    python benchmarks/bench_trajectory_jsonl.py --quick    # a few seconds, for CI
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from otel_verl import events, settings  # noqa: E402
from otel_verl.legacy.trajectory_jsonl import TrajectoryJsonlProcessor  # noqa: E402

PROMPT_TOKENS = 256
COMPLETION_TOKENS = 512
SERVER_META = {
    "e2e_latency": 1.111,
    "queue_time": 0.012,
    "request_received_ts": 1787215072.2,
    "prefill_finished_ts": 1787215072.25,
    "prefill_launch_latency": 0.031,
}
METRICS = {"generate_sequences": 1.201, "tool_calls": 0.0, "compute_score": 0.0547, "num_preempted": -1}


class VocabTokenizer:
    """A cheap stand-in for a Hugging Face tokenizer: ids index a fixed list of pieces."""

    def __init__(self) -> None:
        words = ["the", " answer", " is", " 42", ".", " Joanie", " pays", " é", " 世界", "\n", "<|im_end|>"]
        self.pieces = [w for _ in range(100) for w in words][:1000]

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        pieces = self.pieces
        return "".join([pieces[i] for i in ids])

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        return [0] * (len(text) // 4)


# --------------------------------------------------------------------------- otel_verl


def run_otel_verl(n: int, out_dir: str, tok: VocabTokenizer, prompt: List[int], completion: List[int],
                  with_processor: bool = True) -> Dict[str, float]:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    from otel_verl.sampling import UidIdGenerator, record_dropped_samples

    ids = UidIdGenerator()
    provider = TracerProvider(resource=Resource.create({"service.name": "verl"}),
                              sampler=record_dropped_samples(), id_generator=ids)
    processor = None
    if with_processor:
        processor = TrajectoryJsonlProcessor(out_dir, discovery_path=None)
        provider.add_span_processor(processor)
    events.install(events.TracingState(provider, provider.get_tracer("otel_verl"), ids,
                                        settings.load({"OTEL_VERL_ENABLED": "1"})))
    try:
        uid = "92ee95cb-f14d-4a51-92a5-9a2a0f88d1d5"

        def one(i: int) -> None:
            with events.trajectory(uid, str(i % 16), step=3, agent_name="single_turn_agent", n_samples=16,
                                   decode=tok.decode, encode=tok.encode):
                with events.agent_run("SingleTurnAgentLoop"):
                    with events.llm_call(prompt, model="qwen") as turn:
                        turn.finish(completion, stop_reason="length", server_meta=SERVER_META)
                events.agent_metrics(METRICS)
                with events.reward() as reward:
                    reward.score(1.0)

        return _measure(n, one, lambda: processor.force_flush() if processor else None)
    finally:
        provider.shutdown()
        events.install(None)


# --------------------------------------------------------------------------- seed-like baseline


@dataclass
class BaselineTurn:  # the seed's turn fields, in its order
    turn_index: int
    prompt_token_count: Optional[int] = None
    prompt_text: Optional[str] = None
    completion_text: str = ""
    completion_token_ids: List[int] = field(default_factory=list)
    completion_token_count: Optional[int] = None
    finish_reason: str = ""
    observation_text: Optional[str] = None
    observation_token_ids: Optional[List[int]] = None
    start_ts: float = 0.0
    end_ts: float = 0.0
    observation_start_ts: Optional[float] = None
    observation_end_ts: Optional[float] = None
    turn_total_time_ms: Optional[float] = None
    completion_time_ms: float = 0.0
    observation_time_ms: Optional[float] = None
    sglang_rid: str = ""
    sglang_time_ms: Optional[float] = None
    sglang_queue_time_ms: Optional[float] = None
    sglang_ttft_ms: Optional[float] = None
    sglang_prefill_ms: Optional[float] = None
    sglang_decode_time_ms: Optional[float] = None
    template_overhead_tokens: Optional[int] = None
    template_overhead_text: Optional[str] = None


@dataclass
class BaselineTrajectory:
    request_id: str
    prompt_uid: Optional[str] = None
    sample_index: Optional[int] = None
    n_samples: Optional[int] = None
    replica_id: int = -1
    global_step: Optional[int] = None
    created_at_ts: float = 0.0
    completed_at_ts: float = 0.0
    total_time_ms: float = 0.0
    turns: List[BaselineTurn] = field(default_factory=list)
    initial_prompt_text: Optional[str] = None
    initial_prompt_token_ids: Optional[List[int]] = None
    agent_metrics: Optional[dict] = None


class BaselineStore:
    """Appends lines from a one-thread executor, flushing after each, as the seed did."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a")
        self._executor = ThreadPoolExecutor(max_workers=1)

    def _write(self, line: str) -> None:
        self._file.write(line + "\n")
        self._file.flush()

    def write(self, line: str) -> None:
        self._executor.submit(self._write, line)

    def flush(self) -> None:
        self._executor.submit(lambda: None).result()  # one thread: runs after every write

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._file.close()


def baseline_line(traj: BaselineTrajectory) -> str:
    d = dataclasses.asdict(traj)
    for key in ("initial_prompt_token_ids", "replica_id"):
        d.pop(key, None)
    for turn in d["turns"]:
        for key in ("completion_token_ids", "observation_token_ids", "prompt_text", "sglang_rid"):
            turn.pop(key, None)
        if turn["turn_total_time_ms"] is None:
            turn["turn_total_time_ms"] = (turn["completion_time_ms"] or 0.0) + (turn["observation_time_ms"] or 0.0)
    top = {"prompt_uid": d.pop("prompt_uid"), "sample_index": d.pop("sample_index")}
    top["raw_message"] = json.dumps(d, ensure_ascii=False)
    return json.dumps(top, ensure_ascii=False)


def run_baseline(n: int, out_dir: str, tok: VocabTokenizer, prompt: List[int], completion: List[int]) -> Dict[str, float]:
    os.makedirs(out_dir, exist_ok=True)
    store = BaselineStore(os.path.join(out_dir, "baseline.jsonl"))
    uid = "92ee95cb-f14d-4a51-92a5-9a2a0f88d1d5"

    def one(i: int) -> None:
        created = time.time()
        turn = BaselineTurn(turn_index=-1, prompt_token_count=len(prompt), start_ts=time.time())
        turn.completion_text = tok.decode(completion, skip_special_tokens=False)
        turn.completion_token_ids = list(completion)
        turn.finish_reason = "length"
        turn.completion_token_count = len(completion)
        meta = SERVER_META
        turn.sglang_time_ms = meta["e2e_latency"] * 1000
        turn.sglang_ttft_ms = (meta["prefill_finished_ts"] - meta["request_received_ts"]) * 1000
        turn.sglang_queue_time_ms = meta["queue_time"] * 1000
        turn.sglang_prefill_ms = meta["prefill_launch_latency"] * 1000
        turn.sglang_decode_time_ms = max(0, turn.sglang_time_ms - turn.sglang_queue_time_ms - turn.sglang_ttft_ms)
        turn.end_ts = time.time()
        turn.completion_time_ms = (turn.end_ts - turn.start_ts) * 1000
        turn.turn_index = 0
        completed = time.time()
        traj = BaselineTrajectory(
            request_id=str(i % 16), prompt_uid=uid, sample_index=i % 16, n_samples=16, global_step=3,
            created_at_ts=created, completed_at_ts=completed, total_time_ms=(completed - created) * 1000,
            turns=[turn], initial_prompt_text=tok.decode(list(prompt), skip_special_tokens=False),
            initial_prompt_token_ids=list(prompt), agent_metrics={**METRICS, "reward_score": 1.0},
        )
        store.write(baseline_line(traj))

    try:
        return _measure(n, one, store.flush)
    finally:
        store.close()


# --------------------------------------------------------------------------- measuring


def _measure(n: int, one: Callable[[int], None], drain: Callable[[], Any]) -> Dict[str, float]:
    for i in range(min(50, n)):  # warm-up: imports, first file, thread start
        one(i)
    drain()
    wall, cpu, caller = time.perf_counter(), time.process_time(), time.thread_time()
    for i in range(n):
        one(i)
    caller = time.thread_time() - caller
    drain()
    return {
        "cpu_us": (time.process_time() - cpu) / n * 1e6,
        "caller_us": caller / n * 1e6,
        "wall_us": (time.perf_counter() - wall) / n * 1e6,
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few hundred trajectories (CI)")
    parser.add_argument("-n", type=int, default=None, help="trajectories per run (default 5000, --quick 300)")
    args = parser.parse_args(argv)
    n = args.n or (300 if args.quick else 5000)

    tok = VocabTokenizer()
    prompt = [i % 1000 for i in range(PROMPT_TOKENS)]
    completion = [(7 * i) % 1000 for i in range(COMPLETION_TOKENS)]
    tmp = tempfile.mkdtemp(prefix="bench_trajectory_jsonl_")
    try:
        ours = run_otel_verl(n, os.path.join(tmp, "ours"), tok, prompt, completion)
        spans_only = run_otel_verl(n, os.path.join(tmp, "spans"), tok, prompt, completion, with_processor=False)
        base = run_baseline(n, os.path.join(tmp, "base"), tok, prompt, completion)
        lines = sum(1 for _ in open(next(os.scandir(os.path.join(tmp, "ours", "trajectory"))).path))
        assert lines == n + min(50, n), lines
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"single-turn trajectories: {n} (prompt {PROMPT_TOKENS} tokens, completion {COMPLETION_TOKENS} tokens)")
    print(f"{'':44}{'process CPU':>14}{'caller thread':>16}{'wall':>12}")
    rows = [
        ("otel_verl: events + JSONL processor", ours),
        ("otel_verl: events only (5 spans, no files)", spans_only),
        ("seed-like: dataclass + asdict + json.dumps", base),
    ]
    for label, r in rows:
        print(f"{label:44}{r['cpu_us']:>11.1f} us{r['caller_us']:>13.1f} us{r['wall_us']:>9.1f} us")
    print(f"ratio otel_verl / seed-like: process CPU {ours['cpu_us'] / base['cpu_us']:.2f}x, "
          f"caller thread {ours['caller_us'] / base['caller_us']:.2f}x")
    print(f"JSONL processor alone (events+JSONL minus events only): "
          f"process CPU {ours['cpu_us'] - spans_only['cpu_us']:.1f} us, "
          f"caller thread {ours['caller_us'] - spans_only['caller_us']:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
