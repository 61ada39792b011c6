"""The sample-flow CSV: one row per (uid, traj_uid) per pipeline event.

Consumers (an SLS collector with fixed ``csv_headers``) parse these bytes, so the format
is a contract: ``shared/LEGACY_FORMATS.md`` section 1. Which span start/end yields which
row is the table in ``docs/SPANS.md`` ("Sample-flow CSV").

Cost model: on_start/on_end run on the training thread or the agent loop's event loop.
An event only picks the shared fields and keeps a reference to its id list; its CSV
text, and the optional ``[FLOW_TRACE]`` stdout lines, are produced on the writer thread.
"""

from __future__ import annotations

import csv
import functools
import io
import os
import socket
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.trace import StatusCode

from otel_verl import health, semconv as sc
from otel_verl.exporters import _writer
from otel_verl.exporters._writer import BackgroundWriter, write_discovery_file
from otel_verl.payload import Payload, payload_of
from otel_verl.semconv import Kind

DISCOVERY_PATH = "/tmp/verl_trace_sample_path.txt"  # node-local: names the sample/ dir
JOB_ID_ENV = "DLC_JOB_ID"
NO_JOB_ID = "ENV_NOTFOUND_DLC_JOB_ID"
NO_TRAJ = "N/A"  # a row about a prompt, not one of its trajectories
DEFAULT_TRAINER = "RayPPOTrainer"
V1_TRAINER = "PPOTrainerV1"
_COMPLETE_STAGES = frozenset({"TRAIN_UPDATE", "FILTER_TRAJECTORIES"})
_pid = os.getpid()  # kept current by a fork hook: os.getpid() is a system call per row


def _refresh_pid() -> None:
    global _pid
    _pid = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_refresh_pid)

class _Rows:
    """The rows of one event: everything but (uid, traj) is shared.

    Holds a reference to the caller's traj list; nothing per row is built until
    :func:`render_rows` runs on the writer thread.
    """

    __slots__ = ("uid", "trajs", "source", "target", "stage", "step", "detail", "ts_ns")

    def __init__(
        self,
        uid: str,
        trajs: Sequence[str],
        source: str,
        target: str,
        stage: str,
        step: Optional[int],
        detail: str,
        ts_ns: int,
    ) -> None:
        self.uid = uid
        self.trajs = trajs
        self.source = source
        self.target = target
        self.stage = stage
        self.step = step if step is not None and step != -1 else None  # -1: unknown
        self.detail = detail
        self.ts_ns = ts_ns

    def content(self) -> str:
        return _content(self.source, self.target, self.stage, self.step, self.detail)

    def flow_trace_lines(self) -> List[str]:
        """The seed's opt-in ``[FLOW_TRACE]`` stdout lines for these rows."""
        iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.ts_ns / 1e9))
        tail = f"from={self.source} | to={self.target} | stage={self.stage}"
        if self.step is not None:
            tail += f" | global_step={self.step}"
        if self.detail:
            tail += f" | detail={self.detail}"
        return [f"[FLOW_TRACE] {iso} | uid={self.uid} | traj_uid={traj} | {tail}" for traj in self.trajs]


@functools.lru_cache(maxsize=256)
def _content(source: str, target: str, stage: str, step: Optional[int], detail: str) -> str:
    """The ``content`` cell. Cached: a worker's rows repeat a handful of them."""
    parts = [f"from={source}", f"to={target}", f"stage={stage}"]
    if step is not None:
        parts.append(f"global_step={step}")
    if detail:
        parts.append(f"detail={detail}")
    return "|".join(parts)


def sample_id(uid: str, traj: Any) -> str:
    """``{uid}/{traj}`` for a trajectory index, ``{uid}/sample`` for anything else."""
    traj = str(traj)
    return f"{uid}/{traj}" if traj.isdigit() else f"{uid}/sample"


def csv_line(cells: Sequence[Any]) -> str:
    """One row as Python's ``csv.writer`` (default dialect) writes it, line end included."""
    buf = io.StringIO()
    csv.writer(buf).writerow(cells)
    return buf.getvalue()


def _needs_quoting(text: str) -> bool:
    # the default dialect quotes a cell holding the delimiter, the quote or a line break
    return "," in text or '"' in text or "\r" in text or "\n" in text


@functools.lru_cache(maxsize=64)
def _quoted_cells(*cells: Any) -> str:
    """``cells`` as csv.writer writes them, without the line end. Cached: the spans of one
    batch stage share job id, status, timestamp and content."""
    return csv_line(cells)[:-2]


def render_rows(job_id: str, groups: Sequence[_Rows]) -> str:
    """The CSV text of ``groups``, byte-identical to ``csv.writer(f).writerow`` per row.

    Only ``sample_id`` differs between the rows of a group, so the shared cells are
    quoted once by ``csv.writer`` and each row is a concatenation (``csv.writer`` costs
    several microseconds a row; a batch stage is 16k rows). A digit traj never needs
    quoting, so a row needs ``csv.writer`` only when its uid does.
    """
    head = _quoted_cells(job_id, "sample") + ","
    out: List[str] = []
    for rows in groups:
        status = "COMPLETE" if rows.stage in _COMPLETE_STAGES else "RUNNING"
        ts_ms = rows.ts_ns // 1_000_000
        content = rows.content()
        uid = rows.uid
        trajs = rows.trajs
        if len(trajs) == 1 and not _needs_quoting(uid) and not _needs_quoting(content):
            # one row (every rollout worker event): a single concatenation
            out.append(f"{head}{sample_id(uid, trajs[0])},{status},{ts_ms},{content}\r\n")
            continue
        if _needs_quoting(uid):
            out.extend(csv_line((job_id, "sample", sample_id(uid, t), status, ts_ms, content)) for t in rows.trajs)
            continue
        if _needs_quoting(content):
            tail = "," + _quoted_cells(status, ts_ms, content) + "\r\n"
        else:  # status and the timestamp never need quoting
            tail = f",{status},{ts_ms},{content}\r\n"
        by_index, not_index = f"{head}{uid}/", f"{head}{uid}/sample{tail}"
        trajs = [str(t) for t in rows.trajs]
        if all(map(str.isdigit, trajs)):  # the common case: one join for the whole group
            out.append(by_index + (tail + by_index).join(trajs) + tail)
            continue
        out.extend(f"{by_index}{t}{tail}" if t.isdigit() else not_index for t in trajs)
    return "".join(out)


# --------------------------------------------------------------------------- span -> rows


def _attrs(span: Any) -> Any:
    return span.attributes or {}


def _uid(attrs: Any) -> str:
    return str(attrs.get(sc.UID, "unknown"))


def _trainer(attrs: Any) -> str:
    return str(attrs.get(sc.TRAINER) or DEFAULT_TRAINER)


def span_failed(span: Any) -> bool:
    # The seed wrote its "done" rows after the work returned, so a failed call writes none.
    status = getattr(span, "status", None)
    return status is not None and status.status_code is StatusCode.ERROR


def _sample_start(span: Any, payload: Payload) -> List[_Rows]:
    a = _attrs(span)
    return [
        _Rows(_uid(a), (NO_TRAJ,), "DataLoader", _trainer(a), "DATA_PREPROCESS", a.get(sc.GLOBAL_STEP),
              "uid_generated", span.start_time)
    ]


def _worker_runs(trajs: Sequence[str], workers: Sequence[int]) -> List[tuple]:
    """(worker, trajs) for each run of consecutive trajectories sent to one worker."""
    if not workers or len(set(workers)) == 1:
        return [(workers[0] if workers else 0, trajs)]
    runs: List[tuple] = []
    begin = 0
    for i in range(1, len(trajs) + 1):
        if i == len(trajs) or workers[i] != workers[begin]:
            runs.append((workers[begin], trajs[begin:i]))
            begin = i
    return runs


def _rollout_start(span: Any, payload: Payload) -> List[_Rows]:
    a = _attrs(span)
    uid, trainer, step, ts = _uid(a), _trainer(a), a.get(sc.GLOBAL_STEP), span.start_time
    data = payload.data
    trajs = getattr(data, "traj_uids", None) or a.get(sc.TRAJ_UIDS) or (NO_TRAJ,)
    workers = getattr(data, "worker_indices", None) or a.get(sc.WORKER_INDICES) or ()
    if getattr(data, "variant", "v0") == "v1" or trainer == V1_TRAINER:
        first_worker = workers[0] if workers else 0
        return [
            _Rows(uid, (NO_TRAJ,), V1_TRAINER, "AgentLoopManagerTQ", "DATA_DISPATCH", step,
                  "dispatched_to_agent_loop_manager", ts),
            _Rows(uid, (NO_TRAJ,), "AgentLoopManagerTQ", f"AgentLoopWorkerTQ_{first_worker}", "DATA_DISPATCH", step,
                  "dispatched_to_agent_loop_worker", ts),
        ]
    rows = [_Rows(uid, trajs, trainer, trainer, "DATA_PREPROCESS", step, "traj_uid_generated_by_repeat", ts)]
    for worker, run in _worker_runs(trajs, workers):
        rows.append(_Rows(uid, run, "AgentLoopManager", f"AgentLoopWorker_{worker}", "DATA_DISPATCH", step,
                          "dispatched_to_agent_loop_worker", ts))
    return rows


def _agent_name(attrs: Any, data: Any) -> str:
    return str(getattr(data, "agent_name", None) or attrs.get(sc.GEN_AI_AGENT_NAME) or "single_turn")


def _prompt_task_start(span: Any, payload: Payload) -> List[_Rows]:
    a = _attrs(span)
    return [
        _Rows(_uid(a), (NO_TRAJ,), "AgentLoopWorkerTQ", f"AgentLoop({_agent_name(a, payload.data)})", "AGENT_LOOP",
              a.get(sc.GLOBAL_STEP), "agent_task_started", span.start_time)
    ]


def _traj_ids(attrs: Any, data: Any) -> tuple:
    uid = getattr(data, "uid", None) or _uid(attrs)
    traj = getattr(data, "traj_uid", None) or str(attrs.get(sc.TRAJ_UID, NO_TRAJ))
    return uid, traj


def _trajectory_start(span: Any, payload: Payload) -> List[_Rows]:
    a, data = _attrs(span), payload.data
    uid, traj = _traj_ids(a, data)
    step = a.get(sc.GLOBAL_STEP)
    if getattr(data, "trainer_api", "v0") == "v1":
        n = getattr(data, "n_samples", None)
        detail = f"session_started_session_id={traj}_rollout_n={n if n is not None else NO_TRAJ}"
        return [_Rows(uid, (traj,), "AgentLoopWorkerTQ", "AgentLoopWorkerTQ", "AGENT_LOOP", step, detail, span.start_time)]
    return [
        _Rows(uid, (traj,), "AgentLoopWorker", f"AgentLoop({_agent_name(a, data)})", "AGENT_LOOP", step,
              "agent_task_started", span.start_time)
    ]


# The seed wrote LLM_GENERATE, AGENT_TOOL and ROLLOUT_REWARD rows without a global_step
# (LEGACY_FORMATS.md: only driver-side rows, agent_task_started and agent_run_completed
# carry it), so these rows leave it out although their spans know the step.


def _llm_start(span: Any, payload: Payload) -> List[_Rows]:
    a = _attrs(span)
    uid, traj = _traj_ids(a, None)
    loop_class = str(a.get(sc.AGENT_LOOP_CLASS) or "AgentLoop")
    return [_Rows(uid, (traj,), loop_class, "RolloutReplica", "LLM_GENERATE", None, "sending_generate_request",
                  span.start_time)]


def _llm_end(span: Any, payload: Payload) -> List[_Rows]:
    a = _attrs(span)
    uid, traj = _traj_ids(a, None)
    loop_class = str(a.get(sc.AGENT_LOOP_CLASS) or "AgentLoop")
    return [_Rows(uid, (traj,), "RolloutReplica", loop_class, "LLM_GENERATE", None, "received_generate_response",
                  span.end_time)]


def _tool_end(span: Any, payload: Payload) -> List[_Rows]:
    a = _attrs(span)
    uid, traj = _traj_ids(a, None)
    detail = f"tool_executed_name={a.get(sc.GEN_AI_TOOL_NAME, '')}"
    return [_Rows(uid, (traj,), "Tool", "ToolAgentLoop", "AGENT_TOOL", None, detail, span.end_time)]


def _trajectory_end(span: Any, payload: Payload) -> List[_Rows]:
    """The agent run's and the reward's rows, written when the trajectory ends (in this
    order, as the seed did): neither is a span of its own that ends earlier, and the
    trajectory's data holds when each happened. Written even when the trajectory
    failed afterwards (the run and the reward had completed)."""
    data = payload.data
    rows: List[_Rows] = []
    run_ns = getattr(data, "run_completed_ns", 0)
    reward = getattr(data, "reward_row", None)
    if not run_ns and reward is None:
        return rows
    a = _attrs(span)
    uid, traj = _traj_ids(a, data)
    if run_ns:
        # The seed's v1 worker shares this code path with v0: the target stays AgentLoopWorker.
        rows.append(_Rows(uid, (traj,), f"AgentLoop({_agent_name(a, data)})", "AgentLoopWorker", "AGENT_LOOP",
                          a.get(sc.GLOBAL_STEP), "agent_run_completed", run_ns))
    if reward is not None:
        rows.append(_Rows(uid, (traj,), "RewardLoopWorker", "AgentLoopWorker", "ROLLOUT_REWARD", None,
                          f"reward_score_computed_score={reward[1]}", reward[0]))
    return rows


_TRAINER = object()  # placeholder: the span's verl.trainer

# verl.stage of a sample-stage span -> (CSV stage, (from, to) in v0, (from, to) in v1, detail)
_SAMPLE_STAGES: Dict[str, tuple] = {
    sc.Stage.REWARD.value: ("TRAIN_REWARD", (_TRAINER, "RewardManager"), (V1_TRAINER, "RewardLoopManager"),
                            "reward_extracted"),
    sc.Stage.OLD_LOG_PROB.value: ("TRAIN_LOGPROB", ("ActorRolloutRefWorker", _TRAINER),
                                  ("ActorRolloutWorker", _TRAINER), "old_log_prob_computed"),
    sc.Stage.REF_LOG_PROB.value: ("TRAIN_REF_LOGPROB", ("RefPolicyWorker", _TRAINER), ("RefPolicyWorker", _TRAINER),
                                  "ref_log_prob_computed"),
    sc.Stage.ADVANTAGE.value: ("TRAIN_ADVANTAGE", (_TRAINER, _TRAINER), (_TRAINER, _TRAINER), "advantage_computed"),
    sc.Stage.UPDATE_ACTOR.value: ("TRAIN_UPDATE", ("ActorRolloutRefWorker", _TRAINER),
                                  ("ActorRolloutWorker", _TRAINER), "actor_parameters_updated"),
    sc.Stage.SAMPLE.value: ("TRAIN_SAMPLE", ("ReplayBuffer", V1_TRAINER), ("ReplayBuffer", V1_TRAINER),
                            "sampled_from_replay_buffer"),
    sc.Stage.FILTER.value: ("FILTER_TRAJECTORIES", (_TRAINER, _TRAINER), (_TRAINER, _TRAINER),
                            "trajectories_filtered"),
}


def _sample_stage_end(span: Any, payload: Payload) -> List[_Rows]:
    a = _attrs(span)
    spec = _SAMPLE_STAGES.get(str(a.get(sc.STAGE)))
    if spec is None:
        return []
    csv_stage, v0_route, v1_route, detail = spec
    trainer = _trainer(a)
    source, target = (v1_route if trainer == V1_TRAINER else v0_route)
    trajs = payload.data if payload.data is not None else a.get(sc.TRAJ_UIDS, (NO_TRAJ,))
    return [
        _Rows(_uid(a), trajs, trainer if source is _TRAINER else source, trainer if target is _TRAINER else target,
              csv_stage, a.get(sc.GLOBAL_STEP), detail, span.end_time)
    ]


def _step_stage_end(span: Any, payload: Payload) -> List[_Rows]:
    a = _attrs(span)
    if a.get(sc.STAGE) != sc.Stage.SYNC_PARAMS.value:
        return []
    step = a.get(sc.GLOBAL_STEP)
    detail = f"weights_synced_global_step={step if step is not None else -1}"
    return [_Rows("*", ("*",), "CheckpointEngineManager", "RolloutReplica", "SYNC_PARAMS", step, detail, span.end_time)]


RowBuilder = Callable[[Any, Payload], List[_Rows]]
_ON_START: Dict[Kind, RowBuilder] = {
    Kind.SAMPLE: _sample_start,
    Kind.ROLLOUT: _rollout_start,
    Kind.PROMPT_TASK: _prompt_task_start,
    Kind.TRAJECTORY: _trajectory_start,
    Kind.LLM_CALL: _llm_start,
}
# The agent run (no span) and the REWARD span: their rows come with the TRAJECTORY's end
# (_trajectory_end, called from on_end).
_ON_END: Dict[Kind, RowBuilder] = {
    Kind.LLM_CALL: _llm_end,
    Kind.TOOL: _tool_end,
    Kind.SAMPLE_STAGE: _sample_stage_end,
    Kind.STEP_STAGE: _step_stage_end,
}


class ValidationScope:
    """Spans of validation samples: marked with ``verl.validate`` (only traced when
    OTEL_VERL_TRACE_VALIDATION=1), and every span started under one of them (their LLM,
    tool and reward spans do not carry the attribute)."""

    def __init__(self) -> None:
        self._span_ids: set = set()

    def entered(self, span: Any) -> bool:
        """At span start: whether the span belongs to a validation sample."""
        parent = span.parent
        inherited = bool(self._span_ids) and parent is not None and parent.span_id in self._span_ids
        if inherited or _attrs(span).get(sc.VALIDATE):
            self._span_ids.add(span.context.span_id)
            return True
        return False

    def left(self, span: Any) -> bool:
        """At span end: whether the span belonged to a validation sample (forgets it).
        A span whose start this scope did not see (a kind no row is written for at
        its start) belongs to one when its parent, still open, does."""
        span_ids = self._span_ids
        if span_ids:
            span_id = span.context.span_id
            if span_id in span_ids:
                span_ids.discard(span_id)
                return True
            parent = span.parent
            if parent is not None and parent.span_id in span_ids:
                return True
        return bool(_attrs(span).get(sc.VALIDATE))


class SampleCsvProcessor(SpanProcessor):
    """Writes the sample-flow CSV rows of the spans of this process."""

    # The starts it writes rows for (the validation scope finds the other spans of a
    # validation sample through their open parent when they end); every end of the events API.
    on_start_kinds = frozenset(_ON_START)
    on_end_kinds = frozenset(Kind)

    def __init__(
        self,
        trace_dir: str,
        *,
        flow_stdout: bool = False,
        max_pending_rows: int = 1 << 20,
        stdout: Optional[TextIO] = None,
        discovery_path: Optional[str] = DISCOVERY_PATH,
    ) -> None:
        self.directory = os.path.join(trace_dir, "sample")
        self.writer = BackgroundWriter("sample_csv", max_pending_rows)
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
        pid = _writer._output_pid or _pid
        if self._path_pid != pid:
            self._path = os.path.join(self.directory, f"{self._hostname}-pid{pid}.csv")
            self._path_pid = pid
        return self._path

    # ------------------------------------------------------------------ span processor

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        try:
            payload = payload_of(span)
            if payload is None or self._validation.entered(span):
                return
            build = _ON_START.get(payload.kind)
            if build is not None:
                self._submit(build(span, payload))
        except Exception as exc:
            health.record_failure("sample_csv.on_start", exc)

    def on_end(self, span: ReadableSpan) -> None:
        try:
            payload = payload_of(span)
            if payload is None or self._validation.left(span):
                return
            if payload.kind is Kind.TRAJECTORY:
                self._submit(_trajectory_end(span, payload))
                return
            if span_failed(span):
                return
            build = _ON_END.get(payload.kind)
            if build is not None:
                self._submit(build(span, payload))
        except Exception as exc:
            health.record_failure("sample_csv.on_end", exc)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.writer.flush(timeout_millis / 1000.0)

    def shutdown(self) -> None:
        self.writer.close()

    # ------------------------------------------------------------------ writer side

    def _submit(self, groups: List[_Rows]) -> None:
        n_rows = len(groups[0].trajs) if len(groups) == 1 else sum(len(rows.trajs) for rows in groups)
        if n_rows:
            self.writer.submit(functools.partial(self._render, groups), n_rows)

    def _render(self, groups: List[_Rows]) -> tuple:
        if self._flow_stdout:
            self._print_flow_trace(groups)
        return self.path, render_rows(self._job_id, groups)

    def _print_flow_trace(self, groups: List[_Rows]) -> None:
        lines = [line for rows in groups for line in rows.flow_trace_lines()]
        try:
            out = self._stdout if self._stdout is not None else sys.stdout
            out.write("\n".join(lines) + "\n")
            out.flush()
        except Exception as exc:  # a closed stdout must not cost the CSV rows
            health.record_failure("sample_csv.flow_stdout", exc)
