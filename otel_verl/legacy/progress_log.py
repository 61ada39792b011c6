"""The training-progress log: bare text lines a progress panel parses.

The format is section 2 of ``docs/LEGACY_FORMATS.md``; which span start or end writes
which line is the "Progress log" table of ``docs/SPANS.md``. Lines always go to stdout
(flushed, at the moment of the event); with a trace dir they are also appended to
``{trace_dir}/progress/{YYYYMMDD-HH}.log`` by a background writer.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, TextIO

from opentelemetry.sdk.trace import ReadableSpan

from otel_verl import health, semconv as sc
from otel_verl.exporters._writer import (DEFAULT_MAX_PENDING_BYTES, BackgroundWriter, WriterProcessor, one_line,
                                        write_discovery_file)
from otel_verl.payload import payload_of
from otel_verl.semconv import Subject, Layout, Stage

DISCOVERY_PATH = "/tmp/verl_progress_path.txt"  # node-local: names the progress/ dir
V1_TRAINER = "PPOTrainerV1"
BAR = "=" * 20
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
        return f"{BAR} Step {step} {BAR}"
    epoch, consumed = attrs.get(sc.EPOCH, 0), attrs.get(sc.CONSUMED_BATCHES, 0)
    return f"{BAR} Epoch {epoch}, consumed {consumed} batches, Step {step} {BAR}"


def gen_throughput_line(n_tokens: Any, seconds: float) -> Optional[str]:
    if n_tokens is None or n_tokens < 0 or seconds <= 0:
        return None
    return f"gen throughput (token/s): {int(n_tokens) / seconds:.2f}"


@dataclass
class StepStage:
    """What the lines of a step-stage span say."""

    stage: str
    step: int  # -1: unknown
    disaggregated: bool
    trainer: str
    exhausted: bool = False  # fetch_batch: no batch was left (the end of an epoch)

    @property
    def prefix(self) -> str:
        return DISAGG_PREFIX if self.disaggregated else ""


def stage_start_lines(s: StepStage) -> List[str]:
    if s.stage == Stage.GENERATION.value:
        # Disaggregated trainers keep the rollout window but have no "start generation".
        window = f"Step {s.step} rollout started"
        return [window] if s.disaggregated else [window, "start generation"]
    if s.stage == Stage.UPDATE_ACTOR.value:
        return [f"Step {s.step} train started", f"{s.prefix}start update actor"]
    if s.stage == Stage.FETCH_BATCH.value:
        # bare in both disaggregated trainers, as the seed wrote them
        return [f"Trainer: try to load global batch@{s.step}, chunk[0/0] from replay_queue"]
    label = STAGE_LABELS.get(s.stage)
    return [f"{s.prefix}start {label}"] if label else []


def stage_end_lines(s: StepStage, response_tokens: Any, seconds: float) -> List[str]:
    if s.stage == Stage.GENERATION.value:
        lines = [] if s.disaggregated else ["end generation"]
        lines.append(f"Step {s.step} rollout finished")
        # v1 separate_async: the window is a replay-queue wait, not rollout production.
        if not (s.disaggregated and s.trainer == V1_TRAINER):
            throughput = gen_throughput_line(response_tokens, seconds)
            if throughput:
                lines.append(throughput)
        return lines
    if s.stage == Stage.UPDATE_ACTOR.value:
        return [f"{s.prefix}end update actor", f"Step {s.step} train finished"]
    if s.stage == Stage.FETCH_BATCH.value:
        if s.exhausted:  # the seed wrote only the "try to load" line when an epoch ran out
            return []
        return [f"Trainer: successfully load global batch@{s.step}, chunk[0/0] from replay_queue"]
    label = STAGE_LABELS.get(s.stage)
    return [f"{s.prefix}end {label}"] if label else []


def task_completed_line(span: Any, data: Any) -> str:
    attrs = span.attributes
    uid = getattr(data, "uid", None) or attrs.get(sc.UID, "unknown")
    traj = getattr(data, "traj_uid", None) or attrs.get(sc.TRAJ_UID, "N/A")
    score = attrs.get(sc.REWARD_SCORE)
    if score is None:
        score = getattr(data, "reward_score", None)
    score = float(score) if score is not None else 0.0
    return f"Task {uid}/{traj} is completed, score={score} status=Finished"


class ProgressLogProcessor(WriterProcessor):
    """Prints the progress lines of this process's spans; files them under a trace dir."""

    on_start_subjects = frozenset({Subject.FIT, Subject.STEP, Subject.STEP_STAGE})  # the spans it reads
    on_end_subjects = frozenset({Subject.STEP, Subject.STEP_STAGE, Subject.TRAJECTORY})

    def __init__(
        self,
        trace_dir: Optional[str],
        *,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        clock: Callable[[], float] = time.time,
        stdout: Optional[TextIO] = None,
        discovery_path: Optional[str] = DISCOVERY_PATH,
    ) -> None:
        self.directory = os.path.join(trace_dir, "progress") if trace_dir else None
        self.writer = BackgroundWriter("progress_log", max_pending_bytes) if self.directory else None
        self._clock = clock
        self._stdout = stdout
        self._discovery_path = discovery_path
        self._discovery_written = False
        # open step span id -> its verl.trainer: a stage span need not repeat it
        self._step_trainers: Dict[int, str] = {}
        self._path, self._path_minute = "", -1  # the hour file, and the minute it was made for

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        try:
            payload = payload_of(span)
            if payload is None:
                return
            if payload.subject is Subject.FIT:
                self._emit(fit_lines(span.attributes))
            elif payload.subject is Subject.STEP:
                self._step_trainers[span.context.span_id] = str(span.attributes.get(sc.TRAINER, ""))
                self._emit([step_banner(span.attributes)])
            elif payload.subject is Subject.STEP_STAGE:
                self._emit(stage_start_lines(self._step_stage(span)))
        except Exception as exc:
            health.record_failure("progress_log.on_start", exc)

    def on_end(self, span: ReadableSpan) -> None:
        try:
            payload = payload_of(span)
            if payload is None:
                return
            if payload.subject is Subject.STEP:
                self._step_trainers.pop(span.context.span_id, None)
            elif not span.status.is_ok:  # the seed wrote "end"/"completed" lines only on success
                return
            elif payload.subject is Subject.STEP_STAGE:
                seconds = (span.end_time - span.start_time) / 1e9
                response_tokens = span.attributes.get(sc.RESPONSE_TOKENS)
                self._emit(stage_end_lines(self._step_stage(span), response_tokens, seconds))
            elif payload.subject is Subject.TRAJECTORY and self.directory is not None:
                if not span.attributes.get(sc.VALIDATE):
                    self._emit([task_completed_line(span, payload.data)])
        except Exception as exc:
            health.record_failure("progress_log.on_end", exc)


    def _step_stage(self, span: Any) -> StepStage:
        attrs = span.attributes
        trainer = attrs.get(sc.TRAINER)
        if not trainer and span.parent is not None:
            trainer = self._step_trainers.get(span.parent.span_id)
        step = attrs.get(sc.GLOBAL_STEP)
        return StepStage(
            stage=str(attrs.get(sc.STAGE)),
            step=step if step is not None else -1,
            disaggregated=attrs.get(sc.LAYOUT) == Layout.DISAGGREGATED.value,
            trainer=str(trainer or ""),
            exhausted=bool(attrs.get(sc.FETCH_EXHAUSTED, False)),
        )

    def _emit(self, lines: List[str]) -> None:
        if not lines:
            return
        text = "\n".join(map(one_line, lines)) + "\n"
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
        """``{dir}/{YYYYMMDD-HH}.log`` of the local hour now. Made once a minute: time
        zones and daylight saving shift the hour on whole minutes."""
        now = self._clock()
        minute = int(now // 60)
        if minute != self._path_minute:
            hour = time.strftime("%Y%m%d-%H", time.localtime(now))
            self._path = os.path.join(self.directory, f"{hour}.log")
            self._path_minute = minute
        return self._path
