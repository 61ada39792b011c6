"""The training-progress log: bare text lines a progress panel parses.

Format: ``shared/LEGACY_FORMATS.md`` section 2; which span start/end yields which line:
the "Progress log" table of ``docs/SPANS.md``. Lines always go to stdout (flushed, at
the moment of the event); with a trace dir they are also appended to
``{trace_dir}/progress/{YYYYMMDD-HH}.log`` by a background writer. Progress lines are a
handful per stage, so they are formatted on the caller's thread.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, TextIO

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from otel_verl import health, semconv as sc
from otel_verl.exporters._writer import BackgroundWriter, write_discovery_file
from otel_verl.exporters.sample_csv import span_failed
from otel_verl.payload import payload_of
from otel_verl.semconv import Kind, Layout, Stage

DISCOVERY_PATH = "/tmp/verl_progress_path.txt"  # node-local: names the progress/ dir
V1_TRAINER = "PPOTrainerV1"
_BAR = "=" * 20
DISAGG_PREFIX = "disagg: "

# Stages written as a "start {label}" / "end {label}" pair. generation, update_actor and
# fetch_batch have lines of their own; update_critic, sample and filter write nothing.
STAGE_LABELS: Dict[str, str] = {
    Stage.REWARD.value: "compute reward",
    Stage.OLD_LOG_PROB.value: "compute log prob",
    Stage.REF_LOG_PROB.value: "compute ref log prob",
    Stage.VALUES.value: "compute values",
    Stage.ADVANTAGE.value: "compute adv",
    Stage.SAVE_CHECKPOINT.value: "save checkpoint",
    Stage.EVAL.value: "eval",
    Stage.RECORD_METRICS.value: "record metrics",
    Stage.SYNC_PARAMS.value: "sync params",
}


def fit_lines(attrs: Any) -> List[str]:
    total = attrs.get(sc.TOTAL_TRAINING_STEPS)
    return [
        f"Total training steps: {total}",
        f"'train_batch_size': {attrs.get(sc.TRAIN_BATCH_SIZE)},",
        f"'rollout_n': {attrs.get(sc.ROLLOUT_N)},",
        f"'ppo_mini_batch_size': {attrs.get(sc.PPO_MINI_BATCH_SIZE)},",
        f"'num_minibatches': {attrs.get(sc.NUM_MINIBATCHES)},",
        f"'total_training_steps': {total}",
    ]


def step_banner(attrs: Any) -> str:
    step = attrs.get(sc.GLOBAL_STEP)
    if attrs.get(sc.LAYOUT) == Layout.DISAGGREGATED.value:
        return f"{_BAR} Step {step} {_BAR}"
    epoch, consumed = attrs.get(sc.EPOCH, 0), attrs.get(sc.CONSUMED_BATCHES, 0)
    return f"{_BAR} Epoch {epoch}, consumed {consumed} batches, Step {step} {_BAR}"


def gen_throughput_line(n_tokens: Any, seconds: float) -> Optional[str]:
    if n_tokens is None or n_tokens < 0 or seconds <= 0:
        return None
    return f"gen throughput (token/s): {int(n_tokens) / seconds:.2f}"


class _StageView:
    """What the lines of one step-stage span depend on."""

    __slots__ = ("stage", "step", "disaggregated", "trainer", "prefix")

    def __init__(self, attrs: Any, trainer: str) -> None:
        self.stage = str(attrs.get(sc.STAGE))
        step = attrs.get(sc.GLOBAL_STEP)
        self.step = step if step is not None else -1
        self.disaggregated = attrs.get(sc.LAYOUT) == Layout.DISAGGREGATED.value
        self.trainer = trainer
        self.prefix = DISAGG_PREFIX if self.disaggregated else ""


def stage_start_lines(view: _StageView) -> List[str]:
    if view.stage == Stage.GENERATION.value:
        # Disaggregated trainers keep the rollout window but have no "start generation".
        window = f"Step {view.step} rollout started"
        return [window] if view.disaggregated else [window, "start generation"]
    if view.stage == Stage.UPDATE_ACTOR.value:
        return [f"Step {view.step} train started", f"{view.prefix}start update actor"]
    if view.stage == Stage.FETCH_BATCH.value:
        prefix = DISAGG_PREFIX if view.trainer == V1_TRAINER else ""
        return [f"{prefix}Trainer: try to load global batch@{view.step}, chunk[0/0] from replay_queue"]
    label = STAGE_LABELS.get(view.stage)
    return [f"{view.prefix}start {label}"] if label else []


def stage_end_lines(view: _StageView, attrs: Any, seconds: float) -> List[str]:
    if view.stage == Stage.GENERATION.value:
        lines = [] if view.disaggregated else ["end generation"]
        lines.append(f"Step {view.step} rollout finished")
        # v1 separate_async: the window is a replay-queue wait, not rollout production.
        if not (view.disaggregated and view.trainer == V1_TRAINER):
            throughput = gen_throughput_line(attrs.get(sc.RESPONSE_TOKENS), seconds)
            if throughput:
                lines.append(throughput)
        return lines
    if view.stage == Stage.UPDATE_ACTOR.value:
        return [f"{view.prefix}end update actor", f"Step {view.step} train finished"]
    if view.stage == Stage.FETCH_BATCH.value:
        prefix = DISAGG_PREFIX if view.trainer == V1_TRAINER else ""
        return [f"{prefix}Trainer: successfully load global batch@{view.step}, chunk[0/0] from replay_queue"]
    label = STAGE_LABELS.get(view.stage)
    return [f"{view.prefix}end {label}"] if label else []


def task_completed_line(span: Any, data: Any) -> str:
    attrs = span.attributes or {}
    uid = getattr(data, "uid", None) or attrs.get(sc.UID, "unknown")
    traj = getattr(data, "traj_uid", None) or attrs.get(sc.TRAJ_UID, "N/A")
    score = attrs.get(sc.REWARD_SCORE)
    if score is None:
        score = getattr(data, "reward_score", None)
    score = float(score) if score is not None else 0.0
    return f"Task {uid}/{traj} is completed, score={score} status=Finished"


class ProgressLogProcessor(SpanProcessor):
    """Prints the progress lines of this process's spans; files them under a trace dir."""

    on_start_kinds = frozenset({Kind.FIT, Kind.STEP, Kind.STEP_STAGE})  # the spans it reads
    on_end_kinds = frozenset({Kind.STEP, Kind.STEP_STAGE, Kind.TRAJECTORY})

    def __init__(
        self,
        trace_dir: Optional[str],
        *,
        max_pending_lines: int = 1 << 20,
        clock: Callable[[], float] = time.time,
        stdout: Optional[TextIO] = None,
        discovery_path: Optional[str] = DISCOVERY_PATH,
    ) -> None:
        self.directory = os.path.join(trace_dir, "progress") if trace_dir else None
        self.writer = BackgroundWriter("progress_log", max_pending_lines) if self.directory else None
        self._clock = clock
        self._stdout = stdout
        self._discovery_path = discovery_path
        self._discovery_written = False
        # open step span id -> its verl.trainer: a stage span need not repeat it
        self._step_trainers: Dict[int, str] = {}
        self._hour_cache: Optional[tuple] = None  # (from, until, path) of the current log file

    # ------------------------------------------------------------------ span processor

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        try:
            payload = payload_of(span)
            if payload is None:
                return
            attrs = span.attributes or {}
            if payload.kind is Kind.FIT:
                self._emit(fit_lines(attrs))
            elif payload.kind is Kind.STEP:
                self._step_trainers[span.context.span_id] = str(attrs.get(sc.TRAINER, ""))
                self._emit([step_banner(attrs)])
            elif payload.kind is Kind.STEP_STAGE:
                self._emit(stage_start_lines(self._stage_view(span, attrs)))
        except Exception as exc:
            health.record_failure("progress_log.on_start", exc)

    def on_end(self, span: ReadableSpan) -> None:
        try:
            payload = payload_of(span)
            if payload is None:
                return
            if payload.kind is Kind.STEP:
                self._step_trainers.pop(span.context.span_id, None)
            elif span_failed(span):  # the seed wrote "end"/"completed" lines only on success
                return
            elif payload.kind is Kind.STEP_STAGE:
                attrs = span.attributes or {}
                seconds = (span.end_time - span.start_time) / 1e9
                self._emit(stage_end_lines(self._stage_view(span, attrs), attrs, seconds))
            elif payload.kind is Kind.TRAJECTORY and self.directory is not None:
                if not (span.attributes or {}).get(sc.VALIDATE):
                    self._emit([task_completed_line(span, payload.data)])
        except Exception as exc:
            health.record_failure("progress_log.on_end", exc)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.writer.flush(timeout_millis / 1000.0) if self.writer is not None else True

    def shutdown(self) -> None:
        if self.writer is not None:
            self.writer.close()

    # ------------------------------------------------------------------ output

    def _stage_view(self, span: Any, attrs: Any) -> _StageView:
        trainer = attrs.get(sc.TRAINER)
        if not trainer and span.parent is not None:
            trainer = self._step_trainers.get(span.parent.span_id)
        return _StageView(attrs, str(trainer or ""))

    def _emit(self, lines: List[str]) -> None:
        if not lines:
            return
        text = "\n".join(lines) + "\n"
        try:
            out = self._stdout if self._stdout is not None else sys.stdout
            out.write(text)
            out.flush()
        except Exception as exc:  # a closed stdout must not cost the file lines
            health.record_failure("progress_log.stdout", exc)
        if self.writer is not None:
            if not self._discovery_written:  # with the first line for the file, as the seed did
                self._discovery_written = True
                write_discovery_file(self._discovery_path, self.directory)
            self.writer.write(self._hour_path(), text, len(lines))

    def _hour_path(self) -> str:
        """``{dir}/{YYYYMMDD-HH}.log`` of now; formatted once a minute at most."""
        now = self._clock()
        cached = self._hour_cache
        if cached is not None and cached[0] <= now < cached[1]:
            return cached[2]
        hour = time.strftime("%Y%m%d-%H", time.localtime(now))
        path = os.path.join(self.directory, f"{hour}.log")
        # valid until the next whole minute (DST / time-zone offsets change on minutes)
        start = now - (now % 60)
        self._hour_cache = (start, start + 60, path)
        return path
