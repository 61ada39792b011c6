"""Durations across a jump of the system clock (NTP stepping it, a container restored from a
checkpoint): the spans, the trajectory JSONL's times, the progress log's throughput and the
batch stages' spans measure what passed, on the monotonic clock; timestamps stay epoch time."""

from __future__ import annotations

import io
import json
import sys
import time
import types

import pytest

from otel_verl import events
from otel_verl.legacy.progress_log import ProgressLogProcessor
from otel_verl.legacy.trajectory_jsonl import TrajectoryJsonlProcessor
from otel_verl.semconv import Stage

JUMP_S = -2 * 3600.0  # the system clock steps two hours back
PAUSE_S = 0.05  # what passes, for real, around the jump


class JumpingClock:
    """The system clock as every module reads it (``time.time``, ``time.time_ns``, and a
    module's own ``time_ns`` bound at import), stepped by :meth:`jump`; the monotonic
    clock runs on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.shift_ns = 0
        real_time, real_time_ns = time.time, time.time_ns

        def jumped_time() -> float:
            return real_time() + self.shift_ns / 1e9

        def jumped_time_ns() -> int:
            return real_time_ns() + self.shift_ns

        for name, module in list(sys.modules.items()):
            if (name.startswith(("otel_verl", "opentelemetry.sdk")) and module is not None
                    and getattr(module, "time_ns", None) is real_time_ns):
                monkeypatch.setattr(module, "time_ns", jumped_time_ns)
        monkeypatch.setattr(time, "time", jumped_time)
        monkeypatch.setattr(time, "time_ns", jumped_time_ns)

    def jump(self) -> None:
        time.sleep(PAUSE_S / 2)
        self.shift_ns += int(JUMP_S * 1e9)
        time.sleep(PAUSE_S / 2)


@pytest.fixture
def clock(monkeypatch):
    return JumpingClock(monkeypatch)


def durations_s(pipeline) -> dict:
    return {span.name: (span.end_time - span.start_time) / 1e9 for span in pipeline.spans()}


def test_a_span_open_across_the_jump_lasts_what_passed(make_pipeline, clock):
    pipeline = make_pipeline()
    before = time.time()
    with events.trajectory("u1", "0", step=1, agent_name="tool_agent", provider="sglang"):
        with events.llm_call([1, 2, 3], model="qwen") as turn:
            clock.jump()
            turn.finish([4, 5], stop_reason="stop")
    spans = pipeline.spans()
    assert len(spans) == 2
    for name, seconds in durations_s(pipeline).items():
        assert PAUSE_S <= seconds < 60, f"{name}: {seconds} s"
    # epoch time, from where the span started
    assert all(abs(span.start_time / 1e9 - before) < 60 for span in spans)


def test_a_trajectorys_times_in_the_jsonl_measure_what_passed(make_pipeline, clock, tmp_path):
    """``total_time_ms`` came out as -7,199,950 ms: two readings of the system clock."""
    jsonl = TrajectoryJsonlProcessor(str(tmp_path), discovery_path=None)
    make_pipeline([jsonl])
    started = time.time()
    with events.trajectory("u1", "0", step=1, agent_name="tool_agent", provider="sglang"):
        with events.llm_call([1, 2, 3], model="qwen") as turn:
            clock.jump()
            turn.finish([4, 5], stop_reason="stop")
        events.observation(["tool says hi"])
    assert jsonl.force_flush()
    (path,) = list((tmp_path / "trajectory").glob("*.jsonl"))
    (line,) = path.read_text().splitlines()
    record = json.loads(json.loads(line)["raw_message"])
    assert PAUSE_S * 1000 <= record["total_time_ms"] < 60_000
    assert record["completed_at_ts"] - record["created_at_ts"] == pytest.approx(record["total_time_ms"] / 1000)
    assert abs(record["created_at_ts"] - started) < 60  # epoch seconds, as the format says
    (turn_record,) = record["turns"]
    assert PAUSE_S * 1000 <= turn_record["completion_time_ms"] < 60_000
    assert turn_record["observation_time_ms"] >= 0
    assert turn_record["end_ts"] - turn_record["start_ts"] == pytest.approx(turn_record["completion_time_ms"] / 1000)


def test_the_gen_throughput_line_survives_the_jump(make_pipeline, clock):
    out = io.StringIO()
    make_pipeline([ProgressLogProcessor(None, stdout=out, discovery_path=None)])
    with events.step(1, trainer="RayPPOTrainer", epoch=0, consumed_batches=0):
        with events.step_stage(Stage.GENERATION) as generation:
            clock.jump()
            generation.response_tokens(1000)
    (line,) = [line for line in out.getvalue().splitlines() if line.startswith("gen throughput")]
    assert 0 < float(line.rsplit(" ", 1)[1]) <= 1000 / PAUSE_S


def test_a_batch_stages_sample_spans_last_what_the_stage_took(make_pipeline, clock):
    from otel_verl.instrumentation import _trainer
    from otel_verl.instrumentation.tracing import Tracing

    pipeline = make_pipeline()
    rows = _trainer.BatchRows(["u1", "u2"], ["0", "0"])
    traced = _trainer.TracedTrainer(Tracing())
    wrapper = _trainer.batch_stage_wrapper(traced, Stage.ADVANTAGE, "RayPPOTrainer", lambda *args: rows)
    traced.bind(types.SimpleNamespace(global_steps=3), "RayPPOTrainer")
    assert wrapper(lambda: clock.jump() or "result", object(), (), {}) == "result"
    spans = pipeline.spans()
    assert len(spans) == 2
    for span in spans:
        assert PAUSE_S <= (span.end_time - span.start_time) / 1e9 < 60
