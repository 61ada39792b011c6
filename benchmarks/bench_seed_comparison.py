"""Tracing CPU per training step: otel_verl against a faithful replay of the seed patch.

    python benchmarks/bench_seed_comparison.py               # full size, updates docs/PERFORMANCE.md
    python benchmarks/bench_seed_comparison.py --scale ci    # reduced size (CI: checks it runs, no timing)

Scenarios: (A) one v0 step at 1024 prompts x 16 single-turn trajectories;
(B) 256 prompts x 8 with 4-turn tool trajectories (4 LLM turns, 3 tool calls).

What runs. verl's work is stubbed (stand-in classes with verl 0.9.1's signatures: the
``RayPPOTrainer`` methods and ray_trainer functions, ``AgentLoopManager``,
``AgentLoopWorker``, ``SingleTurnAgentLoop`` / ``ToolAgentLoop``, ``LLMServerClient``,
``SGLangHttpServer`` and sglang's ``TokenizerManager``), and otel_verl's REAL wrappers
(``otel_verl.instrumentation.trainer_v0`` / ``agent_loop`` / ``llm_client`` /
``llm_server`` hook tables, installed on the stand-ins by ``hooks.install_all`` exactly as
on verl) drive the real events API, span processors and exporters of a pipeline built by
``bootstrap.configure``. No wrapper needs to be bypassed: the stand-ins give the wrappers
the attributes they read (``non_tensor_batch``, ``meta_info``, ``global_steps``,
``rollout_config``, ``tokenizer``, ``TokenOutput.extra_fields`` ...). Per step the driver
runs the v0 ``fit`` body: ``_get_gen_batch`` (uid per prompt, step start), the ``gen``
timer around ``AgentLoopManager.generate_sequences`` (dispatch with carriers, the carrier
column pickled / unpickled as Ray moves it, the agent loops of the workers, then the LLM
server calls of those turns), ``extract_reward``, ``_compute_old_log_prob``,
``_compute_ref_log_prob``, ``compute_advantage``, ``_update_actor``, ``update_weights``
(sync params), ``compute_data_metrics`` / ``Tracking.log`` (step end).

Variants, each in its own child process, in the same invocation:

- ``off``: the stand-ins with nothing installed (the stubbed verl work; subtracted);
- ``seed``: the seed's hooks at the same points (``[FLOW_TRACE]`` print + ``put_nowait``
  on a 10,000-row queue per row, the CSV thread writing batches of 64, ``log_progress``
  print + hourly-file append per line, TrajectoryTracker / TurnRecord / Trajectory
  dataclasses, ``asdict`` + ``json.dumps`` + single-thread executor JSONL writes), using
  ``bench_legacy_exporters.SeedLikeFlowWriter`` / ``SeedLikeProgressLog``;
- ``legacy``: otel_verl with ``VERL_TRACE_DIR`` only (CSV, progress, JSONL; no OTLP);
- ``legacy+otlp``: the same plus OTLP/gRPC to a local otelcol (``~/.cache/otel_verl/bin/otelcol``
  with ``collector-config/otelcol-file.yaml``; without the binary, the in-process OTLP/HTTP
  ``SpanSink`` of ``bench_worker_overhead.py``, whose threads then count as ours).
- ``legacy+otlp offload``: the same outputs written by an export process
  (``OTEL_VERL_OFFLOAD=1``, as rollout workers and the trainer run by default): the process's CPU as above,
  the export process's CPU (``psutil``) reported apart, per window.

stdout of the children (``[FLOW_TRACE]`` and progress lines) goes to a file, as a Ray
worker's goes to its log file.

Measured per step window (process CPU ``time.process_time``: every thread of the process,
writer and exporter threads included; per-thread ``/proc/self/task`` deltas name them):
the trainer part (the step minus the worker / server windows) and the worker part
(``generate_sequences``' agent loops, then a flush of every output, so that writer and
export threads' work lands in the window that caused it). Tracing CPU = variant minus
``off``. Per single-turn trajectory = worker tracing CPU / trajectories in A; per extra
LLM turn = (per trajectory in B - per trajectory in A) / 3 (each extra turn has its tool
call and observation). The cyclic GC's share: ``gc.callbacks`` time each collection's
thread CPU in the step (what the objects tracing keeps alive cost beyond making them).
Drops: ``otel_verl.health`` counters (every output) for otel_verl;
the seed's rows refused by its full queue. Also: 20 sustained steps of scenario A with
legacy+otlp (0 drops), RSS growth over 100 steps of a small scenario, and the
installed-but-disabled cost per wrapped call (wrapped stand-in with tracing off minus the
bare stand-in).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

DOC = os.path.join(ROOT, "docs", "PERFORMANCE.md")
BEGIN_MARK = "<!-- BEGIN bench_seed_comparison -->"
END_MARK = "<!-- END bench_seed_comparison -->"
VARIANTS = ("off", "seed", "legacy", "legacy+otlp", "legacy+otlp offload")
TRACED = ("legacy", "legacy+otlp", "legacy+otlp offload")  # otel_verl's variants

SCALES = {
    # prompts, n, turns: scenario A / B; steps: warm-up + measured; sustained / memory steps
    "full": dict(a=(1024, 16), b=(256, 8), warmup=0, steps=1, sustained=20, sustained_size=(64, 16),
                 mem_steps=100, mem_size=(16, 8), disabled_calls=100_000, tokenizer="model"),
    "ci": dict(a=(32, 4), b=(8, 4), warmup=1, steps=1, sustained=3, sustained_size=(16, 4),
               mem_steps=5, mem_size=(8, 2), disabled_calls=2_000, tokenizer="stub"),
}
TOOL_TURNS = 4
N_WORKERS = 8
PROMPT_TOKENS, COMPLETION_TOKENS, OBSERVATION_TOKENS = 128, 256, 32

# The goals of docs/PERFORMANCE.md this benchmark measures (a rollout worker's CPU per
# trajectory and turn is bench_worker_wrappers's: here it is a figure of the table above)
TARGETS = {
    "ratio_vs_seed": 0.5,
    "legacy_ratio_vs_seed": 0.3,
    "trainer_ms": 300.0,
    "drops": 0,
    "disabled_us": 1.0,
    "mem_mb": 50.0,
}
SEED_REFERENCE = "seed patch replayed when the comparison was set up: 9.5 s/step at A (0.8 s trainer), 3.6 s at B, 424 us/turn, 528 us/traj"


# =========================================================================== verl stand-ins
# Module-level names the hook tables target (``Hook(module, target)``), with verl 0.9.1's
# signatures. The driver calls them through module globals / class attributes, so the
# installed wrappers are what runs.


class DataProto:
    """What the wrappers read of verl's DataProto."""

    def __init__(self, non_tensor_batch: Dict[str, Any], meta_info: Optional[dict] = None) -> None:
        self.non_tensor_batch = non_tensor_batch
        self.meta_info = meta_info or {}
        self.batch = None

    def __len__(self) -> int:
        return len(next(iter(self.non_tensor_batch.values()))) if self.non_tensor_batch else 0


class _Timer:
    __slots__ = ("name", "timing", "t0")

    def __init__(self, name: str, timing: dict) -> None:
        self.name, self.timing = name, timing

    def __enter__(self) -> "_Timer":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.timing[self.name] = time.perf_counter() - self.t0


def marked_timer(name: str, timing_raw: dict, color: str = None, domain: Optional[str] = None, category: Optional[str] = None):
    return _Timer(name, timing_raw)


def extract_reward(batch: "DataProto"):
    return None


def compute_advantage(data: DataProto, adv_estimator: Any = "grpo", gamma: float = 1.0, lam: float = 1.0, num_repeat: int = 1,
                      norm_adv_by_std_in_grpo: bool = True, config: Any = None) -> DataProto:
    return data


def compute_data_metrics(batch: DataProto, use_critic: bool = True) -> dict:
    return {}


class Tracking:
    def log(self, data: dict, step: int, backend: Any = None) -> None:
        pass


class RayPPOTrainer:
    def __init__(self, n_batches: int) -> None:
        self.global_steps = 0
        self.train_dataloader = range(n_batches)

    def _get_gen_batch(self, batch: DataProto) -> DataProto:
        return batch

    def _validate(self, merged: bool = False):
        return {}

    def _compute_old_log_prob(self, batch: DataProto):
        return batch

    def _compute_ref_log_prob(self, batch: DataProto):
        return batch

    def _update_actor(self, batch: DataProto) -> DataProto:
        return batch


class TokenOutput:
    __slots__ = ("token_ids", "stop_reason", "num_preempted", "extra_fields")

    def __init__(self, token_ids: List[int], stop_reason: str, extra_fields: dict) -> None:
        self.token_ids, self.stop_reason, self.num_preempted, self.extra_fields = token_ids, stop_reason, None, extra_fields


class _Config:
    """What the LLM-client wrapper reads of the run's config (model name, rollout name)."""

    def __init__(self) -> None:
        rollout = argparse.Namespace(name="sglang", n=16, full_determinism=False)
        self.actor_rollout_ref = argparse.Namespace(model=argparse.Namespace(path="/models/Qwen2.5-7B-Instruct"), rollout=rollout)


SGLANG_META = {"completion_tokens": COMPLETION_TOKENS, "e2e_latency": 0.812, "queue_time": 0.0021,
               "request_received_ts": 1787215072.1, "prefill_finished_ts": 1787215072.14,
               "prefill_launch_latency": 0.0305, "prompt_tokens": PROMPT_TOKENS, "cached_tokens": 0}


class TokenizerManager:
    async def generate_request(self, obj: Any, request: Any = None):
        yield {"meta_info": SGLANG_META}


class SGLangHttpServer:
    def __init__(self) -> None:
        self.tokenizer_manager = TokenizerManager()

    async def generate(self, prompt_ids: List[int], sampling_params: dict, request_id: str, image_data: Any = None,
                       video_data: Any = None) -> TokenOutput:
        obj = argparse.Namespace(external_trace_header=None, rid=request_id)
        async for _ in self.tokenizer_manager.generate_request(obj):  # the wrapped engine call
            pass
        return TokenOutput(COMPLETION_IDS, "stop", {})


class LLMServerClient:
    """Returns at once what the server sends back; the (request id, prompt) of every call is
    kept so that the server side of these turns can be replayed in its own window."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.sent: List[tuple] = []

    def _vllm_request_id(self, request_id: str) -> str:
        return uuid.uuid4().hex

    async def generate(self, request_id, *, prompt_ids: List[int], sampling_params: Dict[str, Any], image_data: Any = None,
                       video_data: Any = None, audio_data: Any = None, mm_processor_kwargs: Any = None, **kwargs: Any) -> TokenOutput:
        rid = self._vllm_request_id(request_id)
        self.sent.append(rid)
        # what the server wrapper hands back in extra_fields (sglang meta, numeric keys)
        return TokenOutput(COMPLETION_IDS, "stop", {SERVER_META_KEY: dict(SGLANG_META)})


class AgentLoopOutput:
    __slots__ = ("prompt_ids", "response_ids", "reward_score", "metrics", "num_turns")

    def __init__(self, prompt_ids: List[int], response_ids: List[int], num_turns: int) -> None:
        self.prompt_ids, self.response_ids, self.num_turns = prompt_ids, response_ids, num_turns
        self.reward_score = None
        self.metrics = {"generate_sequences": 0.8, "tool_calls": 0.0, "num_preempted": -1}


class SingleTurnAgentLoop:
    def __init__(self, client: LLMServerClient) -> None:
        self.client = client

    async def run(self, sampling_params: Dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        out = await self.client.generate(kwargs["request_id"], prompt_ids=PROMPT_IDS, sampling_params=sampling_params)
        return AgentLoopOutput(PROMPT_IDS, out.token_ids, 1)


class FunctionCall:
    __slots__ = ("name", "arguments", "tool_call_id")

    def __init__(self, name: str, arguments: str, tool_call_id: str) -> None:
        self.name, self.arguments, self.tool_call_id = name, arguments, tool_call_id


class AgentData:
    def __init__(self) -> None:
        self.messages: List[dict] = [{"role": "user", "content": "What is 17 * 23? Use the calculator."}]


class ToolAgentLoop:
    def __init__(self, client: LLMServerClient) -> None:
        self.client = client

    async def run(self, sampling_params: Dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        agent_data = AgentData()
        prompt = list(PROMPT_IDS)
        for turn in range(TOOL_TURNS):
            out = await self.client.generate(kwargs["request_id"], prompt_ids=prompt, sampling_params=sampling_params)
            prompt = prompt + out.token_ids
            if turn < TOOL_TURNS - 1:
                agent_data.tool_call = FunctionCall("calculator", '{"expression": "17 * 23"}', f"call_{turn}")
                await self._handle_processing_tools_state(agent_data)
                prompt = prompt + OBSERVATION_IDS + TEMPLATE_IDS
        return AgentLoopOutput(PROMPT_IDS, prompt[len(PROMPT_IDS):], TOOL_TURNS)

    async def _handle_processing_tools_state(self, agent_data: AgentData):
        await self._call_tool(agent_data.tool_call, {}, agent_data)
        agent_data.messages.append({"role": "assistant", "content": "<tool_call>...</tool_call>"})
        agent_data.messages.append({"role": "tool", "content": OBSERVATION_TEXT})
        return "generating"

    async def _call_tool(self, tool_call: FunctionCall, tools_kwargs: Dict[str, Any], agent_data: AgentData):
        return OBSERVATION_TEXT, 0.0, {}


class AgentLoopWorker:
    def __init__(self, index: int, config: Any, tokenizer: Any, n: int) -> None:
        self.index = index
        self.rollout_config = argparse.Namespace(n=n)
        self.tokenizer = tokenizer
        self.client = LLMServerClient(config)
        self.reward_loop_worker_handles = [object()]  # reward computed in the agent loop

    async def generate_chunk(self, chunk: DataProto, tool: bool) -> List[AgentLoopOutput]:
        columns = chunk.non_tensor_batch
        names = list(columns)
        rows = [dict(zip(names, values)) for values in zip(*(columns[k] for k in names))]
        agent_name = "tool_agent" if tool else "single_turn_agent"
        trajectory = {"step": chunk.meta_info["global_steps"], "sample_index": 0, "rollout_n": 0, "validate": False}
        sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": COMPLETION_TOKENS}
        return await asyncio.gather(*(
            self._run_agent_loop(sampling, trajectory, agent_name=agent_name, request_id=uuid.uuid4().hex, **row)
            for row in rows))

    async def _run_agent_loop(self, sampling_params: dict, trajectory: dict, *, agent_name: str, trace: bool = True, **kwargs: Any):
        loop = ToolAgentLoop(self.client) if agent_name == "tool_agent" else SingleTurnAgentLoop(self.client)
        output = await loop.run(sampling_params, **kwargs)
        await self._compute_score([output], kwargs)
        return output

    async def _compute_score(self, outputs: List[AgentLoopOutput], kwargs: dict) -> None:
        outputs[-1].reward_score = 1.0


class AgentLoopManager:
    """Splits the batch over the workers as ``DataProto.chunk`` does and moves each chunk's
    columns through pickle (Ray's transfer: the carrier column travels with the rows)."""

    def __init__(self, workers: List[AgentLoopWorker], tool: bool, probe: "StepProbe") -> None:
        self.agent_loop_workers = workers
        self.tool = tool
        self.probe = probe

    async def generate_sequences(self, prompts: DataProto) -> DataProto:
        self.probe.worker_begin()
        n, k = len(prompts), len(self.agent_loop_workers)
        base, extra = divmod(n, k)
        start = 0
        for i, worker in enumerate(self.agent_loop_workers):
            size = base + (1 if i < extra else 0)
            columns = {name: col[start:start + size] for name, col in prompts.non_tensor_batch.items()}
            columns = pickle.loads(pickle.dumps(columns, protocol=5))  # to the worker actor
            chunk = DataProto(columns, dict(prompts.meta_info))
            await worker.generate_chunk(chunk, self.tool)
            start += size
        self.probe.worker_end()
        # the LLM server processes' side of these turns, in their own window
        self.probe.server_begin()
        server = SERVER
        for worker in self.agent_loop_workers:
            sent, worker.client.sent = worker.client.sent, []
            for rid in sent:
                await server.generate(prompt_ids=PROMPT_IDS, sampling_params={}, request_id=rid)
        self.probe.server_end()
        out = DataProto({"uid": prompts.non_tensor_batch["uid"]}, dict(prompts.meta_info))
        return out


PROMPT_IDS: List[int] = list(range(300, 300 + PROMPT_TOKENS))
COMPLETION_IDS: List[int] = [300 + (i * 7) % 200 for i in range(COMPLETION_TOKENS)]
OBSERVATION_IDS: List[int] = list(range(320, 320 + OBSERVATION_TOKENS))
TEMPLATE_IDS: List[int] = [1, 2, 3, 4, 5]
OBSERVATION_TEXT = "391"
SERVER_META_KEY = "__otel_llm"
SERVER: Any = None


class StubTokenizer:
    """Fallback when the stand-in model's tokenizer is unavailable (decode cost ~ length)."""

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return " ".join(f"t{i}" for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return [ord(c) for c in text]


def load_tokenizer(kind: str = "model") -> Any:
    if kind == "stub":
        return StubTokenizer(), "stub tokenizer (--scale ci: no transformers import)"
    try:
        from transformers import AutoTokenizer

        from otel_verl.demo.tiny_model import ensure_tiny_model

        return AutoTokenizer.from_pretrained(ensure_tiny_model()), "stand-in model tokenizer (HF fast BPE)"
    except Exception as exc:  # pragma: no cover - environment without transformers
        return StubTokenizer(), f"stub tokenizer ({type(exc).__name__})"


# =========================================================================== CPU accounting


def thread_cpu() -> Dict[str, float]:
    """CPU seconds of each live thread of this process, by Python thread name (/proc)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: Dict[str, float] = {}
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            name = names.get(int(tid))
            if name is None:
                with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm") as f:
                    name = "native:" + f.read().strip()
            name = name or f"tid{tid}"
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    except OSError:
        pass
    return out


class GcClock:
    """Thread CPU the cyclic GC spends, by generation, while ``counting``: what the
    step's live objects cost beyond making them."""

    def __init__(self) -> None:
        self.counting = False
        self.seconds = [0.0, 0.0, 0.0]
        self.runs = [0, 0, 0]
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: Dict[str, int]) -> None:
        if not self.counting:
            return
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.seconds[info["generation"]] += time.thread_time() - self._start
            self.runs[info["generation"]] += 1

    def take(self) -> Dict[str, Any]:
        taken = {"seconds": [round(s, 4) for s in self.seconds], "runs": list(self.runs)}
        self.seconds, self.runs = [0.0, 0.0, 0.0], [0, 0, 0]
        return taken


def export_cpu() -> float:
    """CPU seconds so far of this process's export processes (none: 0)."""
    from bench_worker_overhead import _cpu_seconds, _export_process_pids

    return sum(_cpu_seconds(pid) for pid in _export_process_pids())


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class StepProbe:
    """Process / main-thread CPU of the worker and server windows inside a step, and the
    CPU of this process's export processes (``otel_verl.offload``) in the worker windows."""

    def __init__(self, flush: Any) -> None:
        self.flush = flush
        self.worker_cpu = self.server_cpu = self.worker_main = self.worker_export = 0.0
        self._p = self._t = self._e = 0.0

    def reset(self) -> None:
        self.worker_cpu = self.server_cpu = self.worker_main = self.worker_export = 0.0

    def worker_begin(self) -> None:
        self.flush()  # the trainer's outputs so far are the trainer's
        self._p, self._t, self._e = time.process_time(), time.thread_time(), export_cpu()

    def worker_end(self) -> None:
        self.flush()  # (an export process's flush: everything written and exported)
        self.worker_cpu += time.process_time() - self._p
        self.worker_main += time.thread_time() - self._t
        self.worker_export += export_cpu() - self._e

    def server_begin(self) -> None:
        self._p = time.process_time()

    def server_end(self) -> None:
        self.flush()
        self.server_cpu += time.process_time() - self._p


# =========================================================================== the seed's hooks


# The seed's TurnRecord / TrajectoryRecord dataclasses and line format, as replayed by the
# JSONL benchmark (same fields, same order, same pruning).
from bench_trajectory_jsonl import BaselineTrajectory as SeedTrajectory  # noqa: E402
from bench_trajectory_jsonl import BaselineTurn as SeedTurn  # noqa: E402
from bench_trajectory_jsonl import baseline_line  # noqa: E402


class SeedTrajectoryStore:
    """The seed's TrajectoryStore: asdict, field pruning, two json.dumps, executor write."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self._file = open(os.path.join(directory, f"trajectory_{os.getpid()}.jsonl"), "a")
        self._path = self._file.name
        self._executor = ThreadPoolExecutor(max_workers=1)
        self.lines = 0

    def _write_sync(self, line: str) -> None:
        try:
            os.path.getsize(self._path)  # the rotation check
            self._file.write(line + "\n")
            self._file.flush()
            self.lines += 1
        except Exception:
            pass

    def write(self, trajectory: SeedTrajectory) -> None:
        self._executor.submit(self._write_sync, baseline_line(trajectory))

    def flush(self) -> None:
        self._executor.submit(lambda: None).result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._file.close()


SEED_STAGES = {  # marked_timer name -> progress stage text
    "gen": "generation", "reward": "compute reward", "old_log_prob": "compute log prob", "ref": "compute ref log prob",
    "adv": "compute adv", "update_actor": "update actor", "update_weights": "sync params",
}
SEED_ROWS = {  # batch stage -> (stage, from, to, detail)
    "extract_reward": ("TRAIN_REWARD", "RayPPOTrainer", "RewardManager", "reward_extracted"),
    "_compute_old_log_prob": ("TRAIN_LOGPROB", "ActorRolloutRefWorker", "RayPPOTrainer", "old_log_prob_computed"),
    "_compute_ref_log_prob": ("TRAIN_REF_LOGPROB", "RefPolicyWorker", "RayPPOTrainer", "ref_log_prob_computed"),
    "compute_advantage": ("TRAIN_ADVANTAGE", "RayPPOTrainer", "RayPPOTrainer", "advantage_computed"),
    "_update_actor": ("TRAIN_UPDATE", "ActorRolloutRefWorker", "RayPPOTrainer", "actor_parameters_updated"),
}


class Seed:
    """The seed's instrumentation of the same call sites, as wrapt wrappers on the stand-ins."""

    def __init__(self, trace_dir: str) -> None:
        from bench_legacy_exporters import SeedLikeFlowWriter, SeedLikeProgressLog

        os.makedirs(os.path.join(trace_dir, "sample"), exist_ok=True)
        self.flow = SeedLikeFlowWriter(os.path.join(trace_dir, "sample", f"{socket.gethostname()}-pid{os.getpid()}.csv"))
        self.progress = SeedLikeProgressLog(trace_dir)
        self.store = SeedTrajectoryStore(os.path.join(trace_dir, "trajectory"))
        self.records: Dict[str, List[Any]] = {}
        self.lock = threading.Lock()
        self.rows_offered = 0
        self.tokenizer: Any = None
        self.step = 0

    def trace_flow(self, uid: Any, traj: Any, src: str, dst: str, stage: str, detail: str = "", step: int = -1) -> None:
        n = len(uid) if not isinstance(uid, str) else (len(traj) if not isinstance(traj, str) else 1)
        self.rows_offered += n
        self.flow.trace_flow(uid, traj, src, dst, stage, detail, step)

    def log(self, line: str) -> None:
        self.progress.log_progress(line)

    def flush(self) -> None:
        q = self.flow._queue
        while not q.empty():
            time.sleep(0.002)
        time.sleep(0.005)  # the last batch being written
        self.store.flush()

    def close(self) -> None:
        self.flow.shutdown()
        self.store.close()
        self.progress.shutdown()

    # ------------------------------------------------------------------ trainer
    def get_gen_batch(self, wrapped, instance, args, kwargs):
        step = instance.global_steps
        self.step = step
        self.log(f"==================== Epoch 0, consumed {step - 1} batches, Step {step} ====================")
        self.trace_flow(list(args[0].non_tensor_batch["uid"]), "N/A", "DataLoader", "RayPPOTrainer", "DATA_PREPROCESS",
                        "uid_generated", step)
        return wrapped(*args, **kwargs)

    def marked_timer(self, wrapped, instance, args, kwargs):
        timer = wrapped(*args, **kwargs)
        stage = SEED_STAGES.get(args[0])
        if stage is None:
            return timer
        seed = self

        class Timer:
            def __enter__(self_inner):
                if stage == "generation":
                    seed.log(f"Step {seed.step} rollout started")
                if stage == "update actor":
                    seed.log(f"Step {seed.step} train started")
                seed.log(f"start {stage}")
                return timer.__enter__()

            def __exit__(self_inner, *exc):
                timer.__exit__(*exc)
                seed.log(f"end {stage}")
                if stage == "generation":
                    seed.log(f"Step {seed.step} rollout finished")
                    seed.log(f"gen throughput (token/s): {123456.78:.2f}")
                if stage == "update actor":
                    seed.log(f"Step {seed.step} train finished")
                if stage == "sync params":
                    seed.trace_flow("*", "*", "CheckpointEngineManager", "RolloutReplica", "SYNC_PARAMS",
                                    f"weights_synced_global_step={seed.step}", seed.step)

        return Timer()

    async def generate_sequences(self, wrapped, instance, args, kwargs):
        prompts = args[0]
        uids = list(prompts.non_tensor_batch["uid"])
        trajs = list(prompts.non_tensor_batch["traj_uid"])
        self.trace_flow(uids, trajs, "RayPPOTrainer", "RayPPOTrainer", "DATA_PREPROCESS", "traj_uid_generated_by_repeat", self.step)
        k = len(instance.agent_loop_workers)
        base, extra = divmod(len(uids), k)
        start = 0
        for i in range(k):
            size = base + (1 if i < extra else 0)
            self.trace_flow(uids[start:start + size], trajs[start:start + size], "AgentLoopManager", f"AgentLoopWorker_{i}",
                            "DATA_DISPATCH", "dispatched_to_agent_loop_worker", self.step)
            start += size
        return await wrapped(*args, **kwargs)

    def batch_stage(self, name: str):
        stage, src, dst, detail = SEED_ROWS[name]

        def wrapper(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            batch = args[0] if args else next(iter(kwargs.values()))
            self.trace_flow(batch.non_tensor_batch["uid"], batch.non_tensor_batch["traj_uid"], src, dst, stage, detail, self.step)
            return result

        return wrapper

    # ------------------------------------------------------------------ worker
    async def run_agent_loop(self, wrapped, instance, args, kwargs):
        uid, traj = str(kwargs["uid"]), str(kwargs["traj_uid"])
        step = args[1]["step"]
        agent_name = kwargs["agent_name"]
        key = f"prompt-{uid}/sample-{traj}"
        with self.lock:
            self.records[key] = []
        token = _seed_traj.set(key)
        created = time.time()
        self.trace_flow(uid, traj, "AgentLoopWorker", f"AgentLoop({agent_name})", "AGENT_LOOP", "agent_task_started", step)
        try:
            output = await wrapped(*args, **kwargs)
        finally:
            _seed_traj.reset(token)
        self.trace_flow(uid, traj, f"AgentLoop({agent_name})", "AgentLoopWorker", "AGENT_LOOP", "agent_run_completed", step)
        with self.lock:
            records = self.records.pop(key, [])
        completed = time.time()
        tok = instance.tokenizer
        for i, rec in enumerate(records):
            rec.turn_index = i
        for i in range(1, len(records)):
            prev, cur = records[i - 1], records[i]
            obs = len(prev.observation_token_ids) if prev.observation_token_ids else 0
            overhead = cur.prompt_token_count - prev.prompt_token_count - prev.completion_token_count - obs
            cur.template_overhead_tokens = overhead
            if overhead > 0:
                o = prev.prompt_token_count + prev.completion_token_count
                cur.template_overhead_text = tok.decode(cur._prompt_ids[o:o + overhead], skip_special_tokens=False)
        initial = tok.decode(list(records[0]._prompt_ids), skip_special_tokens=False) if records else None
        traj_obj = SeedTrajectory(
            request_id=traj, prompt_uid=uid, sample_index=int(traj) if traj.isdigit() else None, n_samples=instance.rollout_config.n,
            replica_id=os.getpid(), global_step=step, created_at_ts=created, completed_at_ts=completed,
            total_time_ms=(completed - created) * 1000, turns=[r for r in records], initial_prompt_text=initial,
            initial_prompt_token_ids=list(records[0]._prompt_ids) if records else None,
            agent_metrics={**output.metrics, "reward_score": output.reward_score})
        for t in traj_obj.turns:
            del t._prompt_ids
        self.store.write(traj_obj)
        self.log(f"Task {uid}/{traj} is completed, score={output.reward_score} status=Finished")
        return output

    async def generate(self, wrapped, instance, args, kwargs):
        key = _seed_traj.get()
        prompt_ids = kwargs["prompt_ids"]
        rec = SeedTurn(turn_index=-1, completion_text="", completion_token_ids=[], finish_reason="", start_ts=time.time(),
                       prompt_token_count=len(prompt_ids))
        rec._prompt_ids = prompt_ids
        uid, traj = key.split("/", 1) if key else ("?", "?")
        self.trace_flow(uid, traj, "SingleTurnAgentLoop", "RolloutReplica", "LLM_GENERATE", "sending_generate_request", self.step)
        output = await wrapped(*args, **kwargs)
        meta = output.extra_fields.get(SERVER_META_KEY) or {}
        tok = instance_tokenizer()
        rec.completion_text = tok.decode(output.token_ids, skip_special_tokens=False)
        rec.completion_token_ids = output.token_ids
        rec.finish_reason = output.stop_reason
        rec.completion_token_count = meta.get("completion_tokens")
        e2e = meta.get("e2e_latency")
        rec.sglang_time_ms = e2e * 1000 if e2e is not None else None
        p, r = meta.get("prefill_finished_ts"), meta.get("request_received_ts")
        rec.sglang_ttft_ms = (p - r) * 1000 if p is not None and r is not None else None
        q = meta.get("queue_time")
        rec.sglang_queue_time_ms = q * 1000 if q is not None else None
        pll = meta.get("prefill_launch_latency")
        rec.sglang_prefill_ms = pll * 1000 if pll is not None else None
        if rec.sglang_time_ms is not None:
            rec.sglang_decode_time_ms = max(0, rec.sglang_time_ms - (rec.sglang_queue_time_ms or 0) - (rec.sglang_ttft_ms or 0))
        rec.end_ts = time.time()
        rec.completion_time_ms = (rec.end_ts - rec.start_ts) * 1000
        self.trace_flow(uid, traj, "RolloutReplica", "SingleTurnAgentLoop", "LLM_GENERATE", "received_generate_response", self.step)
        with self.lock:
            records = self.records.get(key)
            if records is not None:
                records.append(rec)
        return output

    async def call_tool(self, wrapped, instance, args, kwargs):
        result = await wrapped(*args, **kwargs)
        key = _seed_traj.get() or "?/?"
        uid, traj = key.split("/", 1)
        self.trace_flow(uid, traj, "Tool", "ToolAgentLoop", "AGENT_TOOL", f"tool_executed_name={args[0].name}", self.step)
        return result

    async def tools_state(self, wrapped, instance, args, kwargs):
        agent_data = args[0]
        before = len(agent_data.messages)
        result = await wrapped(*args, **kwargs)
        key = _seed_traj.get()
        with self.lock:
            records = self.records.get(key)
            rec = records[-1] if records else None
        if rec is not None:
            parts = [str(m.get("content") or "") for m in agent_data.messages[before:] if m.get("role") in ("tool", "function")]
            if parts:
                rec.observation_text = "\n".join(parts)
                rec.observation_token_ids = instance_tokenizer().encode(rec.observation_text, add_special_tokens=False)
                rec.observation_start_ts = rec.end_ts
                rec.observation_end_ts = time.time()
                rec.observation_time_ms = (rec.observation_end_ts - rec.observation_start_ts) * 1000
                rec.turn_total_time_ms = rec.completion_time_ms + rec.observation_time_ms
        return result

    async def compute_score(self, wrapped, instance, args, kwargs):
        result = await wrapped(*args, **kwargs)
        key = _seed_traj.get() or "?/?"
        uid, traj = key.split("/", 1)
        self.trace_flow(uid, traj, "RewardLoopWorker", "AgentLoopWorker", "ROLLOUT_REWARD",
                        f"reward_score_computed_score={args[0][-1].reward_score}", self.step)
        return result

    def install(self) -> None:
        import wrapt

        mod = sys.modules[__name__]
        w = wrapt.wrap_function_wrapper
        w(mod, "RayPPOTrainer._get_gen_batch", self.get_gen_batch)
        w(mod, "marked_timer", self.marked_timer)
        w(mod, "AgentLoopManager.generate_sequences", self.generate_sequences)
        for name in SEED_ROWS:
            target = name if name in ("extract_reward", "compute_advantage") else f"RayPPOTrainer.{name}"
            w(mod, target, self.batch_stage(name))
        w(mod, "AgentLoopWorker._run_agent_loop", self.run_agent_loop)
        w(mod, "AgentLoopWorker._compute_score", self.compute_score)
        w(mod, "LLMServerClient.generate", self.generate)
        w(mod, "ToolAgentLoop._call_tool", self.call_tool)
        w(mod, "ToolAgentLoop._handle_processing_tools_state", self.tools_state)


import contextvars  # noqa: E402

_seed_traj: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("seed_traj", default=None)
_TOKENIZER: Any = None


def instance_tokenizer() -> Any:
    return _TOKENIZER


# =========================================================================== otel_verl's hooks on the stand-ins


def install_otel_verl() -> List[str]:
    """The real hook tables, retargeted at this module's stand-ins (the wrappers, the
    hook installer and its signature checks are otel_verl's own)."""
    from otel_verl.instrumentation import _trainer, agent_loop, hooks, llm_client, llm_server, trainer_v0
    from otel_verl.instrumentation.tracing import Tracing

    mod = __name__
    tracing = Tracing()
    table = []
    skip = {"RayPPOTrainer.fit", "AgentLoopWorker.__init__", "AgentLoopWorker._postprocess",
            # not on the v0 path with sglang measured here: the async trainers' resuming
            # client, vLLM's engine, and the message hook that only works with content capture
            "FullyAsyncLLMServerClient.generate", "AsyncLLM.generate", "ToolAgentLoop._handle_generating_state"}
    for hook in [*trainer_v0.hooks(_trainer.TracedTrainer(tracing)), *agent_loop.hooks(tracing),
                 *llm_client.hooks(tracing), *llm_server.hooks(tracing)]:
        if hook.target in skip or hook.target.startswith("vLLMHttpServer"):
            continue
        table.append(dataclasses.replace(hook, module=mod, redecorate=None))
    hooks.install_all(table)
    # what AgentLoopWorker.__init__'s wrapper does for the registered agent loop classes
    hooks.install_on(SingleTurnAgentLoop, "run", agent_loop._agent_run)
    hooks.install_on(ToolAgentLoop, "run", agent_loop._agent_run)
    status = hooks.status()
    bad = [f"{k}: {v}" for k, v in status.items() if v[0] != hooks.INSTALLED]
    if bad:
        raise RuntimeError("hooks not installed on the stand-ins: " + "; ".join(bad))
    return sorted(status)


# =========================================================================== one step


def make_batch(uids: List[str], n: int, step: int) -> DataProto:
    rows = [u for u in uids for _ in range(n)]
    return DataProto({"uid": np.array(rows, dtype=object)}, {"global_steps": step})


def run_step(trainer: RayPPOTrainer, manager: AgentLoopManager, n_prompts: int, n: int, step: int, loop: asyncio.AbstractEventLoop) -> None:
    """The body of ``RayPPOTrainer.fit`` for one step (v0, GRPO with a reference policy)."""
    trainer.global_steps = step
    timing: Dict[str, float] = {}
    uids = [str(uuid.uuid4()) for _ in range(n_prompts)]
    batch = DataProto({"uid": np.array(uids, dtype=object)}, {"global_steps": step})
    gen_batch = trainer._get_gen_batch(batch)
    with marked_timer("step", timing):
        gen_batch = make_batch(uids, n, step)  # repeat(interleave=True)
        gen_batch.non_tensor_batch["traj_uid"] = np.array([str(i % n) for i in range(len(gen_batch))], dtype=object)
        with marked_timer("gen", timing):
            output = loop.run_until_complete(manager.generate_sequences(gen_batch))
        batch = make_batch(uids, n, step)
        batch.non_tensor_batch["traj_uid"] = output.non_tensor_batch.get("traj_uid", gen_batch.non_tensor_batch["traj_uid"])
        with marked_timer("reward", timing):
            extract_reward(batch)
        with marked_timer("old_log_prob", timing):
            trainer._compute_old_log_prob(batch)
        with marked_timer("ref", timing):
            trainer._compute_ref_log_prob(batch)
        with marked_timer("adv", timing):
            batch = compute_advantage(batch, adv_estimator="grpo")
        with marked_timer("update_actor", timing):
            trainer._update_actor(batch)
        with marked_timer("update_weights", timing):
            pass
    metrics = compute_data_metrics(batch)
    Tracking().log(metrics, step)


# =========================================================================== child: one (scenario, variant)


def start_receiver(work: str) -> Dict[str, Any]:
    """otelcol with collector-config/otelcol-file.yaml on free ports, else the in-process sink."""
    binary = os.path.expanduser("~/.cache/otel_verl/bin/otelcol")
    if os.path.exists(binary):
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from pathlib import Path

        import otel_binaries

        col = otel_binaries.start_otelcol(Path(ROOT) / "collector-config" / "otelcol-file.yaml", Path(work),
                                          env={"OTELCOL_FILE_DIR": os.path.join(work, "otelcol-out"), "OTELCOL_LOG_LEVEL": "warn"})
        return {"kind": "otelcol (OTLP/gRPC, collector-config/otelcol-file.yaml)", "endpoint": col.otlp_grpc_endpoint,
                "protocol": "grpc", "stop": col.process.stop, "pid": col.process.proc.pid if hasattr(col.process, "proc") else None}
    from bench_worker_overhead import SpanSink

    sink = SpanSink()
    return {"kind": "in-process OTLP/HTTP SpanSink (its threads count as ours)", "endpoint": sink.endpoint,
            "protocol": "http/protobuf", "stop": sink.close, "sink": sink}


def child(args: argparse.Namespace) -> Dict[str, Any]:
    global SERVER, _TOKENIZER
    variant, scenario = args.variant, args.scenario
    n_prompts, n = args.size
    tool = scenario == "B"
    work = args.work
    trace_dir = os.path.join(work, "trace")
    os.makedirs(trace_dir, exist_ok=True)
    tokenizer, tok_kind = load_tokenizer(args.tokenizer)
    _TOKENIZER = tokenizer
    for key in [k for k in os.environ if k.startswith("OTEL_") or k == "VERL_TRACE_DIR"]:
        del os.environ[key]
    os.environ["OTEL_VERL_RUN_ID"] = f"bench-{uuid.uuid4().hex[:8]}"
    stdout_path = os.path.join(work, "stdout.log")
    real_stdout = sys.stdout
    sys.stdout = open(stdout_path, "w")

    from otel_verl import bootstrap, health

    health.reset()
    seed = None
    flush = lambda: None  # noqa: E731
    if variant == "seed":
        seed = Seed(trace_dir)
        seed.install()
        flush = seed.flush
    elif variant in TRACED:
        os.environ["VERL_TRACE_DIR"] = trace_dir
        os.environ["OTEL_VERL_OTLP_FILE"] = "0"
        os.environ["OTEL_VERL_OFFLOAD"] = "1" if variant.endswith("offload") else "0"
        # this one process runs the step's N_WORKERS rollout workers, each of which queues
        # for its own export process in a real run: their queues' room together
        from otel_verl.settings import DEFAULT_MAX_QUEUE_MB

        os.environ["OTEL_VERL_MAX_QUEUE_MB"] = str(N_WORKERS * DEFAULT_MAX_QUEUE_MB)
        if variant.startswith("legacy+otlp"):
            os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = args.endpoint
            os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] = args.protocol
        install_otel_verl()
        if not bootstrap.configure(role="trainer"):
            raise RuntimeError("otel_verl did not configure")
        flush = bootstrap.flush
    elif variant == "disabled":
        install_otel_verl()  # installed, never configured: tracing off

    probe = StepProbe(flush)
    config = _Config()
    workers = [AgentLoopWorker(i, config, tokenizer, n) for i in range(N_WORKERS)]
    manager = AgentLoopManager(workers, tool, probe)
    SERVER = SGLangHttpServer()
    trainer = RayPPOTrainer(n_batches=1000)
    loop = asyncio.new_event_loop()
    steps: List[Dict[str, Any]] = []
    rss: List[float] = []
    total_steps = args.warmup + args.steps
    threads0: Dict[str, float] = {}
    gc_clock = GcClock()
    try:
        for step in range(1, total_steps + 1):
            if step == args.warmup + 1:
                threads0 = thread_cpu()
            gc.collect()
            probe.reset()
            p0, t0, w0, e0 = time.process_time(), time.thread_time(), time.perf_counter(), export_cpu()
            gc_clock.counting = True
            run_step(trainer, manager, n_prompts, n, step, loop)
            flush()
            gc_clock.counting = False
            collections = gc_clock.take()
            p1, t1, w1, e1 = time.process_time(), time.thread_time(), time.perf_counter(), export_cpu()
            rss.append(rss_mb())
            if step > args.warmup:
                steps.append({"cpu": p1 - p0, "main": t1 - t0, "wall": w1 - w0, "worker": probe.worker_cpu,
                              "worker_main": probe.worker_main, "server": probe.server_cpu,
                              "export": e1 - e0, "worker_export": probe.worker_export,
                              "trainer": (p1 - p0) - probe.worker_cpu - probe.server_cpu, "gc": collections})
        threads1 = thread_cpu()
        disabled = measure_disabled(trainer, workers[0], args.disabled_calls) if variant in ("off", "disabled") else None
    finally:
        if seed is not None:
            seed.close()
        if variant in TRACED:
            bootstrap.shutdown()
        loop.close()
        sys.stdout.close()
        sys.stdout = real_stdout
    counts = count_outputs(trace_dir, stdout_path)
    result = {
        "variant": variant, "scenario": scenario, "prompts": n_prompts, "n": n, "tool": tool, "trajectories": n_prompts * n,
        "turns_per_traj": TOOL_TURNS if tool else 1, "warmup": args.warmup, "steps": steps, "rss_mb": rss,
        "threads": {k: round(threads1.get(k, 0.0) - threads0.get(k, 0.0), 3) for k in threads1
                    if threads1.get(k, 0.0) - threads0.get(k, 0.0) > 0.005},
        "tokenizer": tok_kind, "outputs": counts, "health": health.snapshot(), "disabled": disabled,
    }
    if seed is not None:
        result["seed_dropped"] = seed.flow.dropped
        result["seed_rows_offered"] = seed.rows_offered
    return result


def count_outputs(trace_dir: str, stdout_path: str) -> Dict[str, int]:
    def lines(path: str) -> int:
        with open(path, "rb") as f:
            return sum(1 for _ in f)

    out = {"csv_rows": 0, "progress_lines": 0, "jsonl_lines": 0, "task_lines": 0, "flow_stdout_lines": 0}
    for sub, key in (("sample", "csv_rows"), ("progress", "progress_lines"), ("trajectory", "jsonl_lines")):
        d = os.path.join(trace_dir, sub)
        if os.path.isdir(d):
            for name in os.listdir(d):
                out[key] += lines(os.path.join(d, name))
                if sub == "progress":
                    with open(os.path.join(d, name), encoding="utf-8") as f:
                        out["task_lines"] += sum(1 for line in f if line.startswith("Task "))
    with open(stdout_path, "rb") as f:
        out["flow_stdout_lines"] = sum(1 for line in f if line.startswith(b"[FLOW_TRACE]"))
    return out


def expected_rows(n_prompts: int, n: int, tool: bool, steps: int) -> Dict[str, int]:
    """Legacy rows a v0 run of ``steps`` steps must write (LEGACY_FORMATS.md)."""
    trajs = n_prompts * n
    turns = TOOL_TURNS if tool else 1
    tools = TOOL_TURNS - 1 if tool else 0
    per_step_csv = (n_prompts  # uid_generated
                    + trajs  # traj_uid_generated_by_repeat
                    + trajs  # dispatched
                    + trajs * (1 + 2 * turns + tools + 1 + 1)  # started, 2/turn, tools, completed, reward
                    + 5 * trajs  # reward, log prob, ref, adv, update
                    + 1)  # sync params
    return {"csv_rows": per_step_csv * steps, "jsonl_lines": trajs * steps, "task_lines": trajs * steps}


def measure_disabled(trainer: RayPPOTrainer, worker: AgentLoopWorker, calls: int) -> Dict[str, float]:
    """Per call: the stand-in as wrapped (installed, tracing off) vs its bare function.

    Measured in the ``disabled`` child (wrappers installed, otel_verl never configured,
    the wrappers' trainer already seen in the steps run before) and in ``off`` (bare)."""
    batch = make_batch(["u0"], 4, 1)
    batch.non_tensor_batch["traj_uid"] = np.array(["0", "1", "2", "3"], dtype=object)
    client = worker.client
    timing: Dict[str, float] = {}

    def drive(coro: Any) -> Any:
        try:
            coro.send(None)
        except StopIteration as stop:
            return stop.value
        raise RuntimeError("stand-in awaited")

    cases = {
        "RayPPOTrainer._compute_old_log_prob (sync method)": lambda: trainer._compute_old_log_prob(batch),
        "marked_timer (sync function)": lambda: marked_timer("old_log_prob", timing),
        "LLMServerClient._vllm_request_id (sync method)": lambda: client._vllm_request_id("r"),
        "LLMServerClient.generate (async method)": lambda: drive(client.generate("r", prompt_ids=PROMPT_IDS, sampling_params={})),
        "ToolAgentLoop._call_tool (async method)": lambda: drive(ToolAgentLoop(client)._call_tool(FunctionCall("c", "{}", "1"), {}, None)),
    }
    out = {}
    for name, fn in cases.items():
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        client.sent.clear()
        out[name] = best
    return out


# =========================================================================== parent


TOKENIZER_KIND = "model"


def run_child(variant: str, scenario: str, size: tuple, steps: int, warmup: int, receiver: Dict[str, Any], work: str,
              disabled_calls: int = 0, timeout: float = 3600) -> Dict[str, Any]:
    d = tempfile.mkdtemp(prefix=f"seedcmp-{variant.replace('+', '_').replace(' ', '_')}-{scenario}-", dir=work)
    result_path = os.path.join(d, "result.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--variant", variant, "--scenario", scenario,
           "--size", str(size[0]), str(size[1]), "--steps", str(steps), "--warmup", str(warmup), "--work", d,
           "--endpoint", receiver.get("endpoint", ""), "--protocol", receiver.get("protocol", ""),
           "--disabled-calls", str(disabled_calls), "--result", result_path, "--tokenizer", TOKENIZER_KIND]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"child {variant}/{scenario} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(result_path) as f:
        result = json.load(f)
    result["child_wall_s"] = time.time() - t0
    shutil.rmtree(d, ignore_errors=True)
    return result


def med(values: List[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


def per_step(result: Dict[str, Any], key: str) -> float:
    return med([s[key] for s in result["steps"]])


def gc_per_step(result: Dict[str, Any]) -> float:
    """The traced process's cyclic-GC CPU in the step, every generation."""
    return med([sum(s["gc"]["seconds"]) for s in result["steps"]])


def analyse(results: Dict[str, Dict[str, Dict[str, Any]]], extra: Dict[str, Any]) -> Dict[str, Any]:
    """Tracing CPU per step = variant - off, per window."""
    out: Dict[str, Any] = {"scenarios": {}}
    for scenario, by_variant in results.items():
        off = by_variant["off"]
        rows = {}
        for variant in VARIANTS[1:]:
            r = by_variant[variant]
            total = per_step(r, "cpu") - per_step(off, "cpu")
            trainer = per_step(r, "trainer") - per_step(off, "trainer")
            worker = per_step(r, "worker") - per_step(off, "worker")
            server = per_step(r, "server") - per_step(off, "server")
            worker_main = per_step(r, "worker_main") - per_step(off, "worker_main")
            trajs = r["trajectories"]
            export, worker_export = per_step(r, "export"), per_step(r, "worker_export")
            rows[variant] = {"total_s": total + export, "trainer_s": trainer, "worker_s": worker, "server_s": server,
                             "worker_main_s": worker_main, "per_traj_us": worker / trajs * 1e6,
                             "per_traj_loop_us": worker_main / trajs * 1e6, "export_s": export,
                             "worker_export_s": worker_export, "per_traj_export_us": worker_export / trajs * 1e6,
                             "gc_s": gc_per_step(r) - gc_per_step(off),
                             "wall_s": per_step(r, "wall"), "threads": r["threads"], "health": r["health"],
                             "outputs": r["outputs"], "seed_dropped": r.get("seed_dropped"),
                             "seed_rows_offered": r.get("seed_rows_offered")}
        out["scenarios"][scenario] = {"prompts": off["prompts"], "n": off["n"], "trajectories": off["trajectories"],
                                      "turns": off["turns_per_traj"], "off_cpu_s": per_step(off, "cpu"),
                                      "steps": len(off["steps"]), "variants": rows,
                                      "expected": expected_rows(off["prompts"], off["n"], off["tool"],
                                                                off["warmup"] + len(off["steps"]))}
    a, b = out["scenarios"]["A"]["variants"], out["scenarios"]["B"]["variants"]
    for variant in VARIANTS[1:]:
        a[variant]["per_turn_us"] = (b[variant]["per_traj_us"] - a[variant]["per_traj_us"]) / (TOOL_TURNS - 1)
        a[variant]["per_turn_export_us"] = (
            b[variant]["per_traj_export_us"] - a[variant]["per_traj_export_us"]) / (TOOL_TURNS - 1)
    out.update(extra)
    return out


def _us_or_blank(us: float) -> str:
    return f"{us:.0f} us" if us else ""


def verdict(value: float, target: float, lower_is_better: bool = True) -> str:
    ok = value <= target if lower_is_better else value >= target
    if ok:
        return "met"
    return f"MISSED by {value - target:+.3g} ({value / target:.2f}x target)" if target else f"MISSED ({value:g})"


def report(an: Dict[str, Any], command: str, receiver_kind: str, tokenizer: str) -> str:
    A, B = an["scenarios"]["A"], an["scenarios"]["B"]
    av, bv = A["variants"], B["variants"]
    full = av["legacy+otlp"]
    lines = [
        "## Tracing cost against the seed", "",
        f"Command: `{command}`", "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} shared cores (noisy: compare ratios within this run). "
        f"OTLP receiver: {receiver_kind}. Tokenizer for the JSONL decode (seed and otel_verl alike): {tokenizer}. "
        f"Scenario A: {A['prompts']} prompts x {A['n']} single-turn trajectories; B: {B['prompts']} x {B['n']} with "
        f"{B['turns']}-turn tool trajectories ({B['turns'] - 1} tool calls); {A['steps']} measured step(s) after warm-up, "
        f"median. Tracing CPU = the variant's process CPU (all threads) minus the same step with nothing installed "
        f"({A['off_cpu_s']:.2f} s at A, {B['off_cpu_s']:.2f} s at B), plus its export process's CPU (offload: "
        f"the outputs written by an export process, as rollout workers and the trainer run by default; the trainer, worker and "
        f"server columns are the traced process alone; the cyclic GC's, a part of the tracing CPU, is its collections' "
        f"thread CPU in the step, less the same with nothing installed).", "",
        "### Per step, by variant", "",
        "| scenario | variant | tracing CPU / step | trainer | rollout worker | LLM server | per trajectory (worker) | of it on the event loop | export process: per trajectory (worker windows) | cyclic GC in the traced process | rows dropped | wall / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, sc_ in (("A", A), ("B", B)):
        for variant in VARIANTS[1:]:
            r = sc_["variants"][variant]
            dropped = r["seed_dropped"] if variant == "seed" else sum(r["health"]["dropped"].values())
            dropped_s = f"{dropped} of {r['seed_rows_offered']} (silent)" if variant == "seed" else f"{dropped}"
            lines.append(f"| {name} | {variant} | {r['total_s']:.3f} s | {r['trainer_s'] * 1e3:.0f} ms | {r['worker_s']:.3f} s | "
                         f"{r['server_s'] * 1e3:.0f} ms | {r['per_traj_us']:.0f} us | {r['per_traj_loop_us']:.0f} us | "
                         f"{_us_or_blank(r['per_traj_export_us'])} | {r['gc_s'] * 1e3:.0f} ms | {dropped_s} | {r['wall_s']:.2f} s |")
    seed_a, seed_b = av["seed"], bv["seed"]
    off_a = av["legacy+otlp offload"]
    ratio_a = full["total_s"] / max(seed_a["total_s"], 1e-9)
    ratio_b = bv["legacy+otlp"]["total_s"] / max(seed_b["total_s"], 1e-9)
    sus, mem, dis = an["sustained"], an["memory"], an["disabled"]
    sus_drops = sum(sus["health"]["dropped"].values())
    dis_worst = max(dis.values()) if dis else 0.0
    legacy_rows = []
    for name, variants in (("A", av), ("B", bv)):
        legacy, seed = variants["legacy"]["total_s"], variants["seed"]["total_s"]
        ratio = legacy / max(seed, 1e-9)
        legacy_rows.append((f"legacy outputs alone / step, {name} (legacy vs seed)", f"{legacy:.2f} s vs {seed:.2f} s",
                            f"{ratio:.2f}x", "<= 0.3x", verdict(ratio, TARGETS["legacy_ratio_vs_seed"])))
    rows = [
        ("all tracing CPU / step, A (legacy + OTLP vs seed)", f"{full['total_s']:.2f} s vs {seed_a['total_s']:.2f} s",
         f"{ratio_a:.2f}x", "<= 0.5x", verdict(ratio_a, TARGETS["ratio_vs_seed"])),
        ("all tracing CPU / step, B (legacy + OTLP vs seed)", f"{bv['legacy+otlp']['total_s']:.2f} s vs {seed_b['total_s']:.2f} s",
         f"{ratio_b:.2f}x", "<= 0.5x", verdict(ratio_b, TARGETS["ratio_vs_seed"])),
        *legacy_rows,
        ("trainer share / step, A (16k trajectories), via its export process (the default)",
         f"{off_a['trainer_s'] * 1e3:.0f} ms (seed {seed_a['trainer_s'] * 1e3:.0f} ms)",
         f"{off_a['trainer_s'] * 1e3 / TARGETS['trainer_ms']:.2f}x target", "<= 300 ms",
         verdict(off_a["trainer_s"] * 1e3, TARGETS["trainer_ms"])),
        ("the same, its outputs written in its process (OTEL_VERL_OFFLOAD=0)", f"{full['trainer_s'] * 1e3:.0f} ms",
         f"{full['trainer_s'] * 1e3 / TARGETS['trainer_ms']:.2f}x target", "<= 300 ms", verdict(full["trainer_s"] * 1e3, TARGETS["trainer_ms"])),
        ("dropped spans/rows, sustained", f"{sus_drops} over {sus['steps']} steps of {sus['prompts']}x{sus['n']} "
         f"(csv {sus['outputs']['csv_rows']}/{sus['expected']['csv_rows']} rows)", "", "0", "met" if sus_drops == 0 else f"MISSED ({sus_drops})"),
        ("installed-but-disabled, per wrapped call (worst)", f"{dis_worst:.2f} us", f"{dis_worst / TARGETS['disabled_us']:.2f}x target",
         "<= 1 us", verdict(dis_worst, TARGETS["disabled_us"])),
        (f"RSS growth over {mem['steps']} steps ({mem['prompts']}x{mem['n']}, legacy + OTLP)",
         f"{mem['growth_mb']:.1f} MB (step 5 -> {mem['steps']})", f"{mem['growth_mb'] / TARGETS['mem_mb']:.2f}x target",
         "<= 50 MB", verdict(mem["growth_mb"], TARGETS["mem_mb"])),
    ]
    lines += ["", "### Against the goals", "", "| measure | measured | ratio | target | verdict |", "|---|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    lines += ["", "### Installed-but-disabled, per call (wrapped stand-in, tracing off, minus the bare stand-in)", "",
              "| call | added |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} us |" for k, v in dis.items()]
    lines += ["", "### Where the otel_verl threads' CPU goes (A, legacy + OTLP, all measured steps, /proc per thread)", "",
              "| thread | CPU s |", "|---|---|"]
    for name, s in sorted(full["threads"].items(), key=lambda kv: -kv[1])[:8]:
        lines.append(f"| {name} | {s:.2f} |")
    lines += ["", f"Outputs checked against the expected counts: A legacy+otlp csv {full['outputs']['csv_rows']} / "
              f"{A['expected']['csv_rows']} rows, jsonl {full['outputs']['jsonl_lines']} / {A['expected']['jsonl_lines']}, "
              f"Task lines {full['outputs']['task_lines']} / {A['expected']['task_lines']}; the seed's CSV holds "
              f"{seed_a['outputs']['csv_rows']} of {seed_a['seed_rows_offered']} rows. For scale: {SEED_REFERENCE}."]
    return "\n".join(lines)


def write_doc(section: str) -> None:
    text = open(DOC, encoding="utf-8").read() if os.path.exists(DOC) else "# Performance\n"
    block = f"{BEGIN_MARK}\n{section.rstrip()}\n{END_MARK}"
    if BEGIN_MARK in text and END_MARK in text:
        start, end = text.index(BEGIN_MARK), text.index(END_MARK) + len(END_MARK)
        text = text[:start] + block + text[end:]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(text)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="full")
    parser.add_argument("--json", help="also write the analysed results here")
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/PERFORMANCE.md (default for --scale ci)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--scenario", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--protocol", default="", help=argparse.SUPPRESS)
    parser.add_argument("--disabled-calls", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", default="model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = child(args)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return 0

    cfg = SCALES[args.scale]
    global TOKENIZER_KIND
    TOKENIZER_KIND = cfg["tokenizer"]
    command = "python benchmarks/bench_seed_comparison.py" + ("" if args.scale == "full" else f" --scale {args.scale}")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    work = tempfile.mkdtemp(prefix="bench_seed_comparison_")
    receiver = start_receiver(work)
    t_start = time.time()
    try:
        results: Dict[str, Dict[str, Any]] = {}
        for scenario, size in (("A", cfg["a"]), ("B", cfg["b"])):
            results[scenario] = {}
            for variant in VARIANTS:
                print(f"[bench] scenario {scenario} {size[0]}x{size[1]} variant {variant} ...", file=sys.stderr, flush=True)
                results[scenario][variant] = run_child(variant, scenario, size, cfg["steps"], cfg["warmup"], receiver, work,
                                                       cfg["disabled_calls"] if variant == "off" else 0)
        print(f"[bench] sustained: {cfg['sustained']} steps of {cfg['sustained_size']} legacy+otlp ...", file=sys.stderr, flush=True)
        sus = run_child("legacy+otlp", "A", cfg["sustained_size"], cfg["sustained"], 0, receiver, work)
        print(f"[bench] memory: {cfg['mem_steps']} steps of {cfg['mem_size']} legacy+otlp ...", file=sys.stderr, flush=True)
        mem = run_child("legacy+otlp", "A", cfg["mem_size"], cfg["mem_steps"], 0, receiver, work)
        print("[bench] installed-but-disabled ...", file=sys.stderr, flush=True)
        dis = run_child("disabled", "A", cfg["mem_size"], 1, 0, receiver, work, cfg["disabled_calls"])
    finally:
        receiver["stop"]()
        shutil.rmtree(work, ignore_errors=True)
    bare = results["A"]["off"]["disabled"]
    disabled = {k: dis["disabled"][k] - bare[k] for k in bare}
    rss = mem["rss_mb"]
    base_i = min(4, len(rss) - 1)
    extra = {
        "sustained": {"steps": len(sus["steps"]), "prompts": sus["prompts"], "n": sus["n"], "health": sus["health"],
                      "outputs": sus["outputs"], "expected": expected_rows(sus["prompts"], sus["n"], False, len(sus["steps"]))},
        "memory": {"steps": len(mem["steps"]), "prompts": mem["prompts"], "n": mem["n"], "rss_mb": [rss[0], rss[base_i], rss[-1]],
                   "growth_mb": rss[-1] - rss[base_i], "health": mem["health"]},
        "disabled": disabled,
        "disabled_bare_us": bare,
        "receiver": receiver["kind"],
        "tokenizer": results["A"]["legacy"]["tokenizer"],
        "wall_s": time.time() - t_start,
        "scale": args.scale,
    }
    an = analyse(results, extra)
    section = report(an, command, receiver["kind"], extra["tokenizer"])
    print(section)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(an, f, indent=1, default=str)
    if args.scale == "full" and not args.no_doc:
        write_doc(section)
        print(f"\n[bench] docs/PERFORMANCE.md updated ({time.time() - t_start:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
