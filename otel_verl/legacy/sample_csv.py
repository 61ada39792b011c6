"""The sample-flow CSV: one row per (uid, traj_uid) per pipeline event.

Consumers (an SLS collector with fixed ``csv_headers``) parse these bytes: the format is
section 1 of ``docs/LEGACY_FORMATS.md``; which span start or end writes which row is the
"Sample-flow CSV" table of ``docs/SPANS.md``.

A span becomes :class:`Rows` (the cells an event's rows share, and its trajectories); the
text, and the optional ``[FLOW_TRACE]`` stdout lines, are made on the writer thread, off
the training loop (a batch stage is 16k rows at 1024 prompts x 16).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, TextIO, Tuple

from opentelemetry.sdk.trace import ReadableSpan

from otel_verl import health, semconv as sc
from otel_verl.exporters._writer import (DEFAULT_MAX_PENDING_BYTES, BackgroundWriter, WriterProcessor, one_line,
                                        output_pid, write_discovery_file)
from otel_verl.payload import Payload, payload_of
from otel_verl.semconv import Subject, Stage

DISCOVERY_PATH = "/tmp/verl_trace_sample_path.txt"  # node-local: names the sample/ dir
JOB_ID_ENV = "DLC_JOB_ID"
NO_JOB_ID = "ENV_NOTFOUND_DLC_JOB_ID"
ROW_BYTES = 256  # a row's text, for the writer's queue bound (uids, names, a detail)
NO_TRAJ = "N/A"  # a row about a prompt, not one of its trajectories
DEFAULT_TRAINER = "RayPPOTrainer"
V1_TRAINER = "PPOTrainerV1"
COMPLETE_STAGES = frozenset({"TRAIN_UPDATE", "FILTER_TRAJECTORIES"})


class Rows(NamedTuple):
    """The rows of one event: one per trajectory in ``trajs``, all other cells shared.

    A tuple: queued for the writer, one object for the cyclic GC to visit, where a
    dataclass instance is two (see :mod:`otel_verl.exporters._writer`)."""

    uid: str
    trajs: Sequence[Any]  # may be the caller's list: it is only read, on the writer thread
    source: str
    target: str
    stage: str
    step: Optional[int]  # None or -1: unknown, left out
    detail: str
    ts_ns: int

    def fields(self) -> List[str]:
        """from, to and stage, then the step when it is known and the detail when there is one."""
        fields = [f"from={self.source}", f"to={self.target}", f"stage={self.stage}"]
        if self.step is not None and self.step != -1:
            fields.append(f"global_step={self.step}")
        if self.detail:
            fields.append(f"detail={self.detail}")
        return fields

    def content(self) -> str:
        return "|".join(self.fields())

    def flow_trace_lines(self) -> List[str]:
        """The seed's opt-in ``[FLOW_TRACE]`` stdout lines for these rows."""
        iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.ts_ns / 1e9))
        tail = " | ".join(self.fields())
        return [one_line(f"[FLOW_TRACE] {iso} | uid={self.uid} | traj_uid={traj} | {tail}") for traj in self.trajs]


def sample_id(uid: str, traj: Any) -> str:
    """``{uid}/{traj}`` for a trajectory index, ``{uid}/sample`` for anything else."""
    traj = str(traj)
    return f"{uid}/{traj}" if traj.isdigit() else f"{uid}/sample"


def csv_cell(text: str) -> str:
    """A cell as ``csv.writer``'s default dialect writes it: in double quotes, its quotes
    doubled, when it holds a comma, a double quote or a line break."""
    if "," in text or '"' in text or "\r" in text or "\n" in text:
        return '"' + text.replace('"', '""') + '"'
    return text


def render_rows(job_id: str, groups: Sequence[Rows]) -> str:
    """The CSV text of ``groups``: the bytes ``csv.writer`` writes, row by row, with the
    control characters of every cell escaped (:func:`one_line`): a row is one line.

    Put together from quoted cells rather than by ``csv.writer``, which would double
    the CPU of a batch stage's rows (``benchmarks/bench_legacy_exporters.py``)."""
    head = f"{csv_cell(one_line(job_id))},sample,"
    lines: List[str] = []
    for rows in groups:
        status = "COMPLETE" if rows.stage in COMPLETE_STAGES else "RUNNING"
        tail = f",{status},{rows.ts_ns // 1_000_000},{csv_cell(one_line(rows.content()))}\r\n"
        uid = one_line(rows.uid)  # once a group: the trajs of sample ids are digits or "sample"
        lines.extend(f"{head}{csv_cell(sample_id(uid, traj))}{tail}" for traj in rows.trajs)
    return "".join(lines)


# --------------------------------------------------------------------------- span -> rows


def _uid(attrs: Any) -> str:
    return str(attrs.get(sc.UID, "unknown"))


def _trainer(attrs: Any) -> str:
    return str(attrs.get(sc.TRAINER) or DEFAULT_TRAINER)


def _agent_name(attrs: Any, data: Any) -> str:
    return str(getattr(data, "agent_name", None) or attrs.get(sc.GEN_AI_AGENT_NAME) or "single_turn")


def _loop_class(attrs: Any) -> str:
    return str(attrs.get(sc.AGENT_LOOP_CLASS) or "AgentLoop")


def _traj_ids(attrs: Any, data: Any = None) -> Tuple[str, str]:
    uid = getattr(data, "uid", None) or _uid(attrs)
    traj = getattr(data, "traj_uid", None) or str(attrs.get(sc.TRAJ_UID, NO_TRAJ))
    return uid, traj


def _worker_runs(trajs: Sequence[str], workers: Sequence[int]) -> List[Tuple[int, Sequence[str]]]:
    """(worker, trajs) for each run of consecutive trajectories sent to one worker."""
    if not workers:
        return [(0, trajs)]
    runs: List[Tuple[int, List[str]]] = []
    for traj, worker in zip(trajs, workers):
        if runs and runs[-1][0] == worker:
            runs[-1][1].append(traj)
        else:
            runs.append((worker, [traj]))
    return runs


def sample_start(span: Any, payload: Payload) -> List[Rows]:
    a = span.attributes
    return [Rows(_uid(a), (NO_TRAJ,), "DataLoader", _trainer(a), "DATA_PREPROCESS", a.get(sc.GLOBAL_STEP),
                 "uid_generated", span.start_time)]


def rollout_start(span: Any, payload: Payload) -> List[Rows]:
    a, data = span.attributes, payload.data
    uid, trainer, step, ts = _uid(a), _trainer(a), a.get(sc.GLOBAL_STEP), span.start_time
    trajs = getattr(data, "traj_uids", None) or a.get(sc.TRAJ_UIDS) or (NO_TRAJ,)
    workers = getattr(data, "worker_indices", None) or a.get(sc.WORKER_INDICES) or ()
    if getattr(data, "variant", "v0") == "v1" or trainer == V1_TRAINER:
        first_worker = workers[0] if workers else 0
        return [
            Rows(uid, (NO_TRAJ,), V1_TRAINER, "AgentLoopManagerTQ", "DATA_DISPATCH", step,
                 "dispatched_to_agent_loop_manager", ts),
            Rows(uid, (NO_TRAJ,), "AgentLoopManagerTQ", f"AgentLoopWorkerTQ_{first_worker}", "DATA_DISPATCH", step,
                 "dispatched_to_agent_loop_worker", ts),
        ]
    rows = [Rows(uid, trajs, trainer, trainer, "DATA_PREPROCESS", step, "traj_uid_generated_by_repeat", ts)]
    for worker, run in _worker_runs(trajs, workers):
        rows.append(Rows(uid, run, "AgentLoopManager", f"AgentLoopWorker_{worker}", "DATA_DISPATCH", step,
                         "dispatched_to_agent_loop_worker", ts))
    return rows


def prompt_task_start(span: Any, payload: Payload) -> List[Rows]:
    a = span.attributes
    return [Rows(_uid(a), (NO_TRAJ,), "AgentLoopWorkerTQ", f"AgentLoop({_agent_name(a, payload.data)})", "AGENT_LOOP",
                 a.get(sc.GLOBAL_STEP), "agent_task_started", span.start_time)]


def trajectory_start(span: Any, payload: Payload) -> List[Rows]:
    a, data = span.attributes, payload.data
    uid, traj = _traj_ids(a, data)
    step = a.get(sc.GLOBAL_STEP)
    if getattr(data, "trainer_api", "v0") == "v1":
        n = getattr(data, "n_samples", None)
        detail = f"session_started_session_id={traj}_rollout_n={n if n is not None else NO_TRAJ}"
        return [Rows(uid, (traj,), "AgentLoopWorkerTQ", "AgentLoopWorkerTQ", "AGENT_LOOP", step, detail,
                     span.start_time)]
    return [Rows(uid, (traj,), "AgentLoopWorker", f"AgentLoop({_agent_name(a, data)})", "AGENT_LOOP", step,
                 "agent_task_started", span.start_time)]


# The seed wrote its LLM_GENERATE, AGENT_TOOL and ROLLOUT_REWARD rows without a
# global_step, so these rows leave it out although their spans know the step.


def llm_start(span: Any, payload: Payload) -> List[Rows]:
    uid, traj = _traj_ids(span.attributes)
    return [Rows(uid, (traj,), _loop_class(span.attributes), "RolloutReplica", "LLM_GENERATE", None,
                 "sending_generate_request", span.start_time)]


def llm_end(span: Any, payload: Payload) -> List[Rows]:
    uid, traj = _traj_ids(span.attributes)
    return [Rows(uid, (traj,), "RolloutReplica", _loop_class(span.attributes), "LLM_GENERATE", None,
                 "received_generate_response", span.end_time)]


def tool_end(span: Any, payload: Payload) -> List[Rows]:
    uid, traj = _traj_ids(span.attributes)
    detail = f"tool_executed_name={span.attributes.get(sc.GEN_AI_TOOL_NAME, '')}"
    return [Rows(uid, (traj,), "Tool", "ToolAgentLoop", "AGENT_TOOL", None, detail, span.end_time)]


def trajectory_end(span: Any, payload: Payload) -> List[Rows]:
    """The agent run's and the reward's rows, in this order as the seed wrote them. Neither
    is a span that ends on its own: the trajectory's data says when each happened."""
    a, data = span.attributes, payload.data
    uid, traj = _traj_ids(a, data)
    rows = []
    run_ns = getattr(data, "run_completed_ns", 0)
    if run_ns:
        # The seed's v1 worker shared this code with v0: the target stays AgentLoopWorker.
        rows.append(Rows(uid, (traj,), f"AgentLoop({_agent_name(a, data)})", "AgentLoopWorker", "AGENT_LOOP",
                         a.get(sc.GLOBAL_STEP), "agent_run_completed", run_ns))
    reward = getattr(data, "reward_scored", None)
    if reward is not None:
        end_ns, score = reward
        rows.append(Rows(uid, (traj,), "RewardLoopWorker", "AgentLoopWorker", "ROLLOUT_REWARD", None,
                         f"reward_score_computed_score={score}", end_ns))
    return rows


TRAINER = "{trainer}"  # in a route: the span's verl.trainer
# verl.stage of a sample-stage span -> (CSV stage, (from, to) in v0, (from, to) in v1, detail)
SAMPLE_STAGES: Dict[str, Tuple[str, Tuple[str, str], Tuple[str, str], str]] = {
    Stage.REWARD.value: (
        "TRAIN_REWARD", (TRAINER, "RewardManager"), (V1_TRAINER, "RewardLoopManager"), "reward_extracted"),
    Stage.OLD_LOG_PROB.value: (
        "TRAIN_LOGPROB", ("ActorRolloutRefWorker", TRAINER), ("ActorRolloutWorker", TRAINER),
        "old_log_prob_computed"),
    Stage.REF_LOG_PROB.value: (
        "TRAIN_REF_LOGPROB", ("RefPolicyWorker", TRAINER), ("RefPolicyWorker", TRAINER), "ref_log_prob_computed"),
    Stage.ADVANTAGE.value: (
        "TRAIN_ADVANTAGE", (TRAINER, TRAINER), (TRAINER, TRAINER), "advantage_computed"),
    Stage.UPDATE_ACTOR.value: (
        "TRAIN_UPDATE", ("ActorRolloutRefWorker", TRAINER), ("ActorRolloutWorker", TRAINER),
        "actor_parameters_updated"),
    Stage.SAMPLE.value: (
        "TRAIN_SAMPLE", ("ReplayBuffer", V1_TRAINER), ("ReplayBuffer", V1_TRAINER), "sampled_from_replay_buffer"),
    Stage.FILTER.value: (
        "FILTER_TRAJECTORIES", (TRAINER, TRAINER), (TRAINER, TRAINER), "trajectories_filtered"),
}


def sample_stage_end(span: Any, payload: Payload) -> List[Rows]:
    a = span.attributes
    spec = SAMPLE_STAGES.get(str(a.get(sc.STAGE)))
    if spec is None:
        return []
    csv_stage, v0_route, v1_route, detail = spec
    trainer = _trainer(a)
    source, target = (part.format(trainer=trainer) for part in (v1_route if trainer == V1_TRAINER else v0_route))
    trajs = payload.data if payload.data is not None else a.get(sc.TRAJ_UIDS, (NO_TRAJ,))
    return [Rows(_uid(a), trajs, source, target, csv_stage, a.get(sc.GLOBAL_STEP), detail, span.end_time)]


def step_stage_end(span: Any, payload: Payload) -> List[Rows]:
    a = span.attributes
    if a.get(sc.STAGE) != Stage.SYNC_PARAMS.value:
        return []
    step = a.get(sc.GLOBAL_STEP)
    detail = f"weights_synced_global_step={step if step is not None else -1}"
    return [Rows("*", ("*",), "CheckpointEngineManager", "RolloutReplica", "SYNC_PARAMS", step, detail, span.end_time)]


RowsOf = Callable[[Any, Payload], List[Rows]]
ROWS_AT_START: Dict[Subject, RowsOf] = {
    Subject.SAMPLE: sample_start,
    Subject.ROLLOUT: rollout_start,
    Subject.PROMPT_TASK: prompt_task_start,
    Subject.TRAJECTORY: trajectory_start,
    Subject.LLM_CALL: llm_start,
}
ROWS_AT_END: Dict[Subject, RowsOf] = {
    Subject.LLM_CALL: llm_end,
    Subject.TOOL: tool_end,
    Subject.TRAJECTORY: trajectory_end,  # also the agent run's (no span) and the REWARD span's rows
    Subject.SAMPLE_STAGE: sample_stage_end,
    Subject.STEP_STAGE: step_stage_end,
}


class ValidationScope:
    """Spans of validation samples, which write no rows: spans marked ``verl.validate``
    (traced only with OTEL_VERL_TRACE_VALIDATION=1), and the spans started under one of
    them (their LLM, tool and reward spans do not carry the attribute)."""

    def __init__(self) -> None:
        self._span_ids: set = set()

    def entered(self, span: Any) -> bool:
        """At span start: whether the span belongs to a validation sample."""
        if span.attributes.get(sc.VALIDATE) or self._parent_inside(span):
            self._span_ids.add(span.context.span_id)
            return True
        return False

    def left(self, span: Any) -> bool:
        """At span end: whether the span belonged to a validation sample (and forget it).
        A span whose start this scope did not see (no row is written at its start)
        belongs to one when its parent, still open, does."""
        span_id = span.context.span_id
        if span_id in self._span_ids:
            self._span_ids.discard(span_id)
            return True
        return bool(span.attributes.get(sc.VALIDATE)) or self._parent_inside(span)

    def _parent_inside(self, span: Any) -> bool:
        return bool(self._span_ids) and span.parent is not None and span.parent.span_id in self._span_ids


class SampleCsvProcessor(WriterProcessor):
    """Writes the sample-flow CSV rows of the spans of this process."""

    # The spans it reads (IsolatingSpanProcessor hands it no others): the starts it writes
    # rows for, their ends (its validation scope forgets them there) and the ends it writes
    # rows for.
    on_start_subjects = frozenset(ROWS_AT_START)
    on_end_subjects = frozenset(ROWS_AT_START) | frozenset(ROWS_AT_END)

    def __init__(
        self,
        trace_dir: str,
        *,
        flow_stdout: bool = False,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        stdout: Optional[TextIO] = None,
        discovery_path: Optional[str] = DISCOVERY_PATH,
    ) -> None:
        self.directory = os.path.join(trace_dir, "sample")
        self.writer = BackgroundWriter("sample_csv", max_pending_bytes, render=self._render)
        self._job_id = os.environ.get(JOB_ID_ENV, NO_JOB_ID)
        self._hostname = socket.gethostname()
        self._flow_stdout = flow_stdout
        self._stdout = stdout
        self._validation = ValidationScope()
        self._path, self._path_pid = "", 0
        write_discovery_file(discovery_path, self.directory)

    @property
    def path(self) -> str:
        """This process's CSV file (a forked child writes its own)."""
        pid = output_pid()
        if pid != self._path_pid:
            self._path = os.path.join(self.directory, f"{self._hostname}-pid{pid}.csv")
            self._path_pid = pid
        return self._path

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        try:
            payload = payload_of(span)
            if payload is None or self._validation.entered(span):
                return
            rows_of = ROWS_AT_START.get(payload.subject)
            if rows_of is not None:
                self._write(rows_of(span, payload))
        except Exception as exc:
            health.record_failure("sample_csv.on_start", exc)

    def on_end(self, span: ReadableSpan) -> None:
        try:
            payload = payload_of(span)
            if payload is None or self._validation.left(span):
                return
            # The seed wrote an event's "done" row after the work returned: a failed span
            # writes none. A trajectory's rows are its agent run's and its reward's, which
            # had completed even when the trajectory failed afterwards.
            if not span.status.is_ok and payload.subject is not Subject.TRAJECTORY:
                return
            rows_of = ROWS_AT_END.get(payload.subject)
            if rows_of is not None:
                self._write(rows_of(span, payload))
        except Exception as exc:
            health.record_failure("sample_csv.on_end", exc)


    def _write(self, groups: List[Rows]) -> None:
        n_rows = sum(len(rows.trajs) for rows in groups)
        if n_rows:
            self.writer.submit(tuple(groups), n_rows, n_rows * ROW_BYTES)

    def _render(self, groups: Sequence[Rows]) -> Tuple[str, str]:
        # on the writer thread
        if self._flow_stdout:
            self._print_flow_trace(groups)
        return self.path, render_rows(self._job_id, groups)

    def _print_flow_trace(self, groups: Sequence[Rows]) -> None:
        lines = [line for rows in groups for line in rows.flow_trace_lines()]
        try:
            out = self._stdout if self._stdout is not None else sys.stdout
            out.write("\n".join(lines) + "\n")
            out.flush()
        except Exception as exc:  # a closed stdout must not cost the CSV rows
            health.record_failure("sample_csv.flow_stdout", exc)
