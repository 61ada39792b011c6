"""Synthetic runs for the report tests: spans laid out by hand, written as the OTLP-JSON
files otel_verl writes (one ``{"resourceSpans": [...]}`` line per process), so that what
the report must find (the straggler, the idle replica, the waits) is known exactly."""

from __future__ import annotations

import itertools
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from otel_verl import semconv as sc

T0_NS = 1_700_000_000 * 10**9  # the run's clock starts here; span times are seconds after it
TRAINER = {sc.ROLE: "trainer", sc.SERVICE_NAME: "verl-trainer", sc.SERVICE_INSTANCE_ID: "trainer-1"}
WORKER = {sc.ROLE: "agent_loop_worker", sc.SERVICE_NAME: "verl-rollout-worker", sc.SERVICE_INSTANCE_ID: "worker-1"}


def ns(seconds: float) -> int:
    return T0_NS + round(seconds * 1e9)


def server_resource(actor_id: str) -> Dict[str, Any]:
    return {sc.ROLE: "llm_server", sc.SERVICE_NAME: "verl-llm-server", sc.SERVICE_INSTANCE_ID: f"process-{actor_id}",
            sc.RAY_ACTOR_ID: actor_id}


def any_value(value: Any) -> Dict[str, Any]:
    """A Python value as an OTLP-JSON ``AnyValue``."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, (list, tuple)):
        return {"arrayValue": {"values": [any_value(v) for v in value]}}
    return {"stringValue": str(value)}


def otlp_attributes(attrs: Dict[str, Any]) -> List[Dict[str, Any]]:
    """A dict as OTLP-JSON attributes (``[{"key", "value"}]``)."""
    return [{"key": k, "value": any_value(v)} for k, v in attrs.items()]


class Run:
    """Spans of one run, by process (resource); :meth:`write` makes its trace dir."""

    def __init__(self, run_id: str = "synthetic", trainer: str = "RayPPOTrainer", layout: str = "colocated",
                 scale: float = 1.0) -> None:
        """``scale``: every time given is multiplied by it (a run ``scale`` times slower)."""
        self.run_id, self.trainer, self.layout, self.scale = run_id, trainer, layout, scale
        self.spans: Dict[str, Tuple[Dict[str, Any], List[Dict[str, Any]]]] = {}
        self._ids = itertools.count(1)
        self.uids: Dict[str, str] = {}  # sample root span id -> its uid

    def span(self, name: str, start: float, end: float, attrs: Optional[Dict[str, Any]] = None,
             parent: Optional[Dict[str, Any]] = None, trace: Optional[str] = None,
             resource: Dict[str, Any] = TRAINER) -> Dict[str, Any]:
        resource = {**resource, sc.RUN_ID: self.run_id}
        key = json.dumps(resource, sort_keys=True)
        span = {
            "traceId": parent["traceId"] if parent else (trace or f"{next(self._ids):032x}"),
            "spanId": f"{next(self._ids):016x}",
            "parentSpanId": parent["spanId"] if parent else "",
            "name": name,
            "kind": 1,
            "startTimeUnixNano": str(ns(start * self.scale)),
            "endTimeUnixNano": str(ns(end * self.scale)),
            "attributes": otlp_attributes(attrs or {}),
            "status": {},
        }
        self.spans.setdefault(key, (resource, []))[1].append(span)
        return span

    # ------------------------------------------------------------------ trainer side

    def fit(self, prompts: int, n: int, steps: int) -> None:
        self.span(sc.SPAN_FIT, 0, 0, {sc.TRAINER: self.trainer, sc.LAYOUT: self.layout, sc.TRAIN_BATCH_SIZE: prompts,
                                      sc.ROLLOUT_N: n, sc.TOTAL_TRAINING_STEPS: steps})

    def step(self, step: int, start: float, end: float, stages: Sequence[Tuple[str, float, float]]) -> None:
        """A ``verl.step`` span and its ``verl.stage`` children: ``(stage, start, end)``."""
        attrs = {sc.GLOBAL_STEP: step, sc.TRAINER: self.trainer, sc.LAYOUT: self.layout}
        root = self.span(sc.SPAN_STEP, start, end, attrs)
        for stage, lo, hi in stages:
            self.span(sc.step_stage_span_name(stage), lo, hi, {**attrs, sc.STAGE: stage}, parent=root)

    def sample(self, uid: str, start: float, end: float, trained_in: Optional[int] = None,
               traj_uids: Sequence[str] = (), **lineage: int) -> Dict[str, Any]:
        """A ``verl.sample`` root (``staleness=``, ``trained_step=`` become ``verl.staleness`` /
        ``verl.trained_step``); ``trained_in``: a ``verl.sample_stage update_actor`` span in that step,
        listing ``traj_uids`` when given."""
        attrs: Dict[str, Any] = {sc.UID: uid, sc.SAMPLE_OUTCOME: "trained"}
        if "staleness" in lineage:
            attrs[sc.STALENESS] = lineage["staleness"]
        if "trained_step" in lineage:
            attrs[sc.TRAINED_STEP] = lineage["trained_step"]
        root = self.span(sc.SPAN_SAMPLE, start, end, attrs)
        self.uids[root["spanId"]] = uid
        if trained_in is not None:
            self.sample_stage(root, "update_actor", trained_in, end - 0.01, end, traj_uids)
        return root

    def sample_stage(self, root: Dict[str, Any], stage: str, step: int, start: float, end: float,
                     traj_uids: Sequence[str] = ()) -> Dict[str, Any]:
        """A ``verl.sample_stage {stage}`` span of the sample ``root`` in the training step ``step``."""
        attrs: Dict[str, Any] = {sc.UID: self.uids[root["spanId"]], sc.GLOBAL_STEP: step, sc.STAGE: stage}
        if traj_uids:
            attrs[sc.TRAJ_UIDS] = list(traj_uids)
        return self.span(sc.sample_stage_span_name(stage), start, end, attrs, parent=root)

    # ------------------------------------------------------------------ rollout side

    def trajectory(self, root: Dict[str, Any], traj: str, step: int, start: float, end: float,
                   turns: Sequence[Dict[str, Any]] = (), tool: Optional[Tuple[float, float]] = None,
                   reward: Optional[Tuple[float, float]] = None) -> Dict[str, Any]:
        """An ``invoke_agent`` span under the sample ``root``. Each turn: ``{"at": (start, end)}``
        and either ``"server": (start, end, actor_id, timing)`` (a ``verl.llm_server.generate``
        child, its process named by the actor id), or ``"attempts": [(start, end), ...]``
        (``verl.llm.attempt`` children), with ``"server_id"`` for ``verl.llm.server_id``."""
        ids = {sc.UID: self.uids[root["spanId"]], sc.TRAJ_UID: traj, sc.GLOBAL_STEP: step}
        span = self.span(sc.agent_span_name("tool_agent"), start, end,
                         {**ids, sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT}, parent=root, resource=WORKER)
        for turn in turns:
            attrs = {**ids, sc.GEN_AI_OPERATION_NAME: sc.OP_CHAT}
            if turn.get("server_id"):
                attrs[sc.LLM_SERVER_ID] = turn["server_id"]
            chat = self.span("chat tiny", *turn["at"], attrs, parent=span, resource=WORKER)
            if "server" in turn:
                lo, hi, actor, timing = turn["server"]
                meta = {sc.llm_server_meta_attribute(k): v * self.scale for k, v in timing.items()}
                self.span(sc.SPAN_LLM_SERVER, lo, hi, meta,
                          parent=chat, resource=server_resource(actor))
            for number, (lo, hi) in enumerate(turn.get("attempts", ()), 1):
                self.span(sc.SPAN_LLM_ATTEMPT, lo, hi, {**ids, sc.LLM_ATTEMPT_NUMBER: number}, parent=chat, resource=WORKER)
        if tool:
            self.span(sc.tool_span_name("calculator"), *tool, {**ids, sc.GEN_AI_OPERATION_NAME: sc.OP_EXECUTE_TOOL},
                      parent=span, resource=WORKER)
        if reward:
            self.span(sc.SPAN_REWARD, *reward, ids, parent=span, resource=WORKER)
        return span

    def write(self, trace_dir: str) -> str:
        os.makedirs(os.path.join(trace_dir, "otlp"), exist_ok=True)
        with open(os.path.join(trace_dir, "otlp", "spans.jsonl"), "w", encoding="utf-8") as f:
            for resource, spans in self.spans.values():
                line = {"resourceSpans": [{"resource": {"attributes": otlp_attributes(resource)},
                                           "scopeSpans": [{"scope": {"name": "otel_verl"}, "spans": spans}]}]}
                f.write(json.dumps(line) + "\n")
        return trace_dir


def timing(e2e: float, queue: float, ttft: float) -> Dict[str, float]:
    """sglang's meta for a request: queue = ``queue``, prefill = ``ttft - queue``, decode = ``e2e - ttft``."""
    return {"e2e_latency": e2e, "queue_time": queue, "first_token_latency": ttft}


# ---------------------------------------------------------------------- the runs the tests read

STRAGGLER = ("u2", "1")  # uid, traj of the 10x slower trajectory of step 1
REPLICA_A, REPLICA_B = "replica-a", "replica-b"


def straggler_run(lineage: bool = True, scale: float = 1.0, extra_step: bool = False, run_id: str = "sync-run") -> Run:
    """A sync colocated run (RayPPOTrainer, 2 prompts x n=2 a step) on two LLM server
    replicas. Step 1 [0, 20]: generation [0, 12], trajectories in [1, 11]; u2/1 takes 10 s on
    replica B (the others 1 to 1.7 s), so the rollout window is [1, 11]. Step 2 [20, 30]:
    every request on replica A, B serves nothing. ``extra_step``: a third step like the second."""
    run = Run(run_id, scale=scale)
    run.fit(prompts=2, n=2, steps=3 if extra_step else 2)
    run.step(1, 0, 20, [("generation", 0, 12), ("reward", 12, 12.5), ("old_log_prob", 12.5, 14),
                        ("update_actor", 14, 18), ("sync_params", 18, 19)])
    lineage_1 = {"staleness": 0, "trained_step": 1} if lineage else {}
    u1 = run.sample("u1", 0, 19, trained_in=1, **lineage_1)
    u2 = run.sample("u2", 0, 19, trained_in=1, **lineage_1)
    fast = timing(0.6, 0.1, 0.3)
    run.trajectory(u1, "0", 1, 1, 2, [{"at": (1.1, 1.9), "server": (1.2, 1.8, REPLICA_A, fast)}])
    run.trajectory(u1, "1", 1, 1, 2.7, [{"at": (1.1, 2.6), "server": (1.2, 2.5, REPLICA_B, fast)}])
    run.trajectory(u2, "0", 1, 1, 2.1, [{"at": (1.1, 2.05), "server": (1.3, 2.0, REPLICA_A, fast)}])
    run.trajectory(u2, "1", 1, 1, 11, [{"at": (1.5, 10.5), "server": (2, 10, REPLICA_B, timing(8, 1, 3))}],
                   tool=(10.5, 10.7), reward=(10.7, 10.9))
    for step in ((2, 3) if extra_step else (2,)):
        t = (step - 2) * 10  # the third step is the second one, 10 s later
        run.step(step, 20 + t, 30 + t, [("generation", 20 + t, 23 + t), ("update_actor", 23 + t, 28 + t),
                                        ("sync_params", 28 + t, 29 + t)])
        stale = [{"staleness": 1, "trained_step": step}, {"staleness": 0, "trained_step": step}] if lineage else [{}, {}]
        u3 = run.sample(f"u3-{step}", 20 + t, 29 + t, trained_in=step, **stale[0])
        u4 = run.sample(f"u4-{step}", 20 + t, 29 + t, trained_in=step, **stale[1])
        for root, traj, span, chat, server in (
            (u3, "0", (21, 22), (21.1, 21.9), (21.2, 21.8)),
            (u3, "1", (21, 22.5), (21.4, 22.4), (21.5, 22.3)),
            (u4, "0", (21.5, 22.5), (21.55, 22.1), (21.6, 22.0)),  # ends with u3/1, shorter: the tie is u3/1's
            (u4, "1", (21, 21.5), (21.05, 21.45), (21.1, 21.4)),
        ):
            run.trajectory(root, traj, step, span[0] + t, span[1] + t, [
                {"at": (chat[0] + t, chat[1] + t), "server": (server[0] + t, server[1] + t, REPLICA_A, fast)}])
    return run


def async_run() -> Run:
    """A separate_async-like run (PPOTrainerV1, disaggregated) whose rollouter runs beside
    the trainer. Step 1 [0, 10]: fetch_batch [1, 3] and [6, 7] between the training stages,
    sync_params [8, 9.5]; the rollouter's trajectories cover [0, 8] and [9.5, 10], one of them
    open through the sync, its turn aborted at 8.0 and resumed at 9.6. Requests name their
    replica by ``verl.llm.server_id`` (no server spans)."""
    run = Run("async-run", trainer="PPOTrainerV1", layout="disaggregated")
    run.fit(prompts=2, n=1, steps=1)
    run.step(1, 0, 10, [("fetch_batch", 1, 3), ("old_log_prob", 3, 4), ("update_actor", 4, 6),
                        ("fetch_batch", 6, 7), ("update_actor", 7, 8), ("sync_params", 8, 9.5)])
    a1 = run.sample("a1", -3, 8, trained_in=1, staleness=1, trained_step=1)
    a2 = run.sample("a2", -3, 8, trained_in=1, staleness=1, trained_step=1)
    a3 = run.sample("a3", 5, 12)
    a4 = run.sample("a4", 5, 12, staleness=2, trained_step=2)
    run.trajectory(a1, "0", 0, -2, 3, [{"at": (-1.9, 2.9), "server_id": "gpu-0", "attempts": [(-1.8, 2.8)]}])
    run.trajectory(a2, "0", 0, 2.5, 8, [{"at": (2.6, 7.9), "server_id": "gpu-1", "attempts": [(2.7, 7.8)]}])
    run.trajectory(a3, "0", 1, 9.5, 12, [{"at": (9.6, 11.9), "server_id": "gpu-0", "attempts": [(9.7, 11.8)]}])
    run.trajectory(a4, "0", 1, 5, 11, [{"at": (5.1, 10.9), "server_id": "gpu-1", "attempts": [(5.2, 8.0), (9.6, 10.8)]}])
    return run
