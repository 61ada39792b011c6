"""A known workload through the real events API, and what it must leave behind.

Imported by the fault and security tests in *fresh interpreters* (``configure()`` installs
process-wide state), with ``tests/`` on ``PYTHONPATH``. :func:`emit` drives one training
step the way the verl wrappers do; :func:`expected` says how many CSV rows, progress
lines, JSONL lines and spans it yields; :func:`report` prints what this process wrote,
dropped and failed (``RESULT {json}`` on stdout), read back by :func:`parse_result`.
Whole-line checks of the files a run left: :func:`file_lines`. Misbehaving endpoints
(``fault_servers.py`` in its own process): :func:`fault_server`.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import io
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any, Dict, Iterator, List, Optional

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TRAINER = "RayPPOTrainer"


def expected(n_uids: int, n_traj: int, *, fit: bool = True) -> Dict[str, int]:
    """What one :func:`emit` call yields (see docs/SPANS.md, the legacy tables)."""
    un = n_uids * n_traj
    return {
        # uid_generated + (repeat + dispatch) per traj + 6 worker rows per traj
        # (agent_task_started, sending/received, tool, agent_run_completed, reward)
        # + reward_extracted + actor_parameters_updated per traj + one weight-sync row
        "csv_rows": n_uids + 2 * un + 6 * un + 2 * un + 1,
        # [fit 6] banner, generation 2+2, Task per traj, reward 2, update_actor 2+2, sync 2
        "progress_lines": (6 if fit else 0) + 1 + 4 + un + 2 + 4 + 2,
        "jsonl_lines": un,
        # [fit] step, 4 stages, sample+rollout+2 sample stages per uid, 4 per traj
        # (invoke_agent, chat, execute_tool, reward: the agent run is no span)
        "spans": (1 if fit else 0) + 1 + 4 + 4 * n_uids + 4 * un,
    }


def emit(
    step: int,
    uids: List[Any],
    n_traj: int,
    *,
    fit: bool = True,
    tokenizer: Any = None,
    decode: Any = None,
    encode: Any = None,
    tool_arguments: Optional[str] = None,
    observation: Optional[str] = None,
    prompt_ids: Any = (11, 12, 13),
    completion_ids: Any = (21, 22),
) -> float:
    """One colocated training step of ``uids`` x ``n_traj`` trajectories (a tool turn and a
    scored reward each). Returns the seconds spent inside the events API calls."""
    from otel_verl import events
    from otel_verl.semconv import Outcome, Stage

    started = time.perf_counter()
    if fit:
        events.fit_started(trainer=TRAINER, total_training_steps=3, train_batch_size=len(uids), rollout_n=n_traj,
                           ppo_mini_batch_size=len(uids))
    events.step_begin(step, trainer=TRAINER, epoch=0, consumed_batches=step - 1)
    rows_uids = [u for u in uids for _ in range(n_traj)]
    rows_trajs = [str(i) for _ in uids for i in range(n_traj)]
    with events.step_stage(Stage.GENERATION, step=step):
        events.samples_created(uids, step=step, trainer=TRAINER)
        carriers = events.rollout_dispatched(rows_uids, rows_trajs, [i % 2 for i in range(len(rows_uids))],
                                             step=step, trainer=TRAINER) or [None] * len(rows_uids)
        for uid, traj, carrier in zip(rows_uids, rows_trajs, carriers):
            with events.trajectory(uid, traj, step=step, agent_name="tool_agent", parent=carrier, n_samples=n_traj,
                                   tokenizer=tokenizer, decode=decode, encode=encode):
                with events.agent_run("ToolAgentLoop"):
                    with events.llm_call(list(prompt_ids), model="tiny-model") as turn:
                        turn.finish(list(completion_ids), stop_reason="stop")
                    with events.tool_call("calculator", call_id="call-1", arguments=tool_arguments):
                        pass
                    if observation is not None:
                        events.observation([observation])
                with events.reward() as reward:
                    reward.score(1.0)
        events.rollout_returned(uids)
    for stage in (Stage.REWARD, Stage.UPDATE_ACTOR):
        t0 = time.time_ns()
        with events.step_stage(stage, step=step):
            events.sample_stage_done(stage, rows_uids, rows_trajs, step=step, start_ns=t0, trainer=TRAINER)
    with events.step_stage(Stage.SYNC_PARAMS, step=step):
        pass
    events.samples_finished(uids, Outcome.TRAINED)
    events.step_end()
    return time.perf_counter() - started


class SpanCounter:
    """A span processor counting the sampled spans that ended (what OTLP must account for)."""

    def __init__(self) -> None:
        self.sampled = 0
        self.ended = 0

    def on_start(self, span, parent_context=None) -> None:
        pass

    def _on_ending(self, span) -> None:
        pass

    def on_end(self, span) -> None:
        self.ended += 1
        if span.context.trace_flags.sampled:
            self.sampled += 1

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def attach_counter() -> SpanCounter:
    from otel_verl import bootstrap

    counter = SpanCounter()
    bootstrap.provider().add_span_processor(counter)
    return counter


class Outputs:
    """References to this process's outputs, taken before shutdown forgets them."""

    def __init__(self) -> None:
        from otel_verl import bootstrap
        from otel_verl.accelerated.batch import BatchExportProcessor

        processors = bootstrap.span_processors()
        self.legacy = [p for p in processors if getattr(p, "writer", None) is not None]
        self.batch = [p for p in processors if isinstance(p, BatchExportProcessor)]

    def report(self, **extra: Any) -> Dict[str, Any]:
        from otel_verl import health

        writers = {}
        for p in self.legacy:
            writer = p.writer
            writers[writer.output] = {"written": writer.written_lines, "dropped": writer.dropped_lines}
        exported = {p.output: p.exported for p in self.batch}
        return {"health": health.snapshot(), "writers": writers, "exported": exported, "pid": os.getpid(), **extra}


def print_result(result: Dict[str, Any]) -> None:
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


def parse_result(stdout: str) -> Dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no RESULT line in:\n{stdout[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


# --------------------------------------------------------------------------- subprocesses


def clean_env(env: Dict[str, str]) -> Dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_", "DLC_"))}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")]))
    return {**base, **env}


def run_python(code: str, env: Dict[str, str], *, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=clean_env(env), capture_output=True,
                          text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:{proc.stdout[-3000:]}\nstderr:{proc.stderr[-6000:]}"
    return proc


def popen_python(code: str, env: Dict[str, str], **kwargs: Any) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=clean_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


@contextlib.contextmanager
def fault_server(mode: str, *args: str) -> Iterator[int]:
    """``tests/fault_servers.py MODE`` in its own process; yields its loopback port."""
    import pytest

    proc = subprocess.Popen([sys.executable, os.path.join(TESTS_DIR, "fault_servers.py"), mode, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = (proc.stdout.readline() if proc.stdout else "").strip()
        if line.startswith("SKIP"):
            pytest.skip(line)
        assert line.startswith("PORT "), f"fault server {mode} did not start: {line!r}"
        yield int(line.split()[1])
    finally:
        proc.kill()
        proc.wait(10)


def free_port() -> int:
    """A loopback port nothing listens on (an endpoint that is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- files

CSV_HEADERS = ["job_id", "cat", "sample_id", "sample_status", "timestamp", "content"]


def _regular(paths: List[str]) -> List[str]:
    # a symlink to /dev/full (a disk-full case) is no file of ours: reading it never ends
    return [p for p in paths if os.path.isfile(p)]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def file_lines(trace_dir: str) -> Dict[str, Any]:
    """Every legacy/OTLP-JSON file under ``trace_dir``, checked for whole lines only:
    each file is empty or ends with its line end, every CSV row has 6 cells, every JSONL
    and OTLP-JSON line parses. Returns the parsed contents per output."""
    out: Dict[str, Any] = {"csv": [], "progress": [], "jsonl": [], "otlp": [], "files": {}}
    for path in _regular(sorted(glob.glob(os.path.join(trace_dir, "sample", "*")))):
        data = _read(path)
        assert not data or data.endswith(b"\r\n"), f"torn CSV tail in {path}: {data[-80:]!r}"
        rows = list(csv.reader(io.StringIO(data.decode("utf-8"), newline="")))
        assert all(len(r) == 6 for r in rows), f"bad CSV row in {path}"
        assert data.count(b"\r\n") == len(rows)
        out["csv"].extend(dict(zip(CSV_HEADERS, r)) for r in rows)
        out["files"][path] = len(rows)
    for path in _regular(sorted(glob.glob(os.path.join(trace_dir, "progress", "*")))):
        data = _read(path)
        assert not data or data.endswith(b"\n"), f"torn progress tail in {path}: {data[-80:]!r}"
        lines = data.decode("utf-8").split("\n")[:-1] if data else []
        out["progress"].extend(lines)
        out["files"][path] = len(lines)
    for kind, pattern in (("jsonl", "trajectory"), ("otlp", "otlp")):
        for path in _regular(sorted(glob.glob(os.path.join(trace_dir, pattern, "*")))):
            data = _read(path)
            assert not data or data.endswith(b"\n"), f"torn {kind} tail in {path}: {data[-80:]!r}"
            lines = [json.loads(line) for line in data.decode("utf-8").split("\n")[:-1]] if data else []
            out[kind].extend(lines)
            out["files"][path] = len(lines)
    return out


def otlp_spans(lines: List[dict]) -> List[dict]:
    """Flattened spans of OTLP-JSON lines, each with its resource attributes."""
    spans = []
    for line in lines:
        for rs in line.get("resourceSpans", []):
            resource = {a["key"]: next(iter(a["value"].values())) for a in rs.get("resource", {}).get("attributes", [])}
            for ss in rs.get("scopeSpans", []):
                for span in ss.get("spans", []):
                    spans.append({**span, "resource": resource})
    return spans


def new_uids(n: int) -> List[str]:
    return [str(uuid.uuid4()) for _ in range(n)]
