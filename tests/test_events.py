"""The events API on SDK spans: trace shape, attributes, payloads, and what happens when
tracing is off or a block fails."""

from __future__ import annotations

from typing import Any, List, Tuple

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.trace import SpanKind, StatusCode

from otel_verl import events, payload, semconv as sc
from otel_verl.ids import trace_id_for_uid
from otel_verl.rollout_data import TrajectoryData, TurnData
from otel_verl.semconv import Subject, Stage


class PayloadSeen(SpanProcessor):
    """Records (when, span name, payload) for every start and end."""

    def __init__(self) -> None:
        self.seen: List[Tuple[str, str, Any]] = []

    def on_start(self, span, parent_context=None) -> None:
        self.seen.append(("start", span.name, payload.payload_of(span)))

    def on_end(self, span) -> None:
        self.seen.append(("end", span.name, payload.payload_of(span)))


@pytest.fixture
def seen(make_pipeline):
    processor = PayloadSeen()
    pipeline = make_pipeline([processor])
    pipeline.open_before = payload.open_count()
    return processor, pipeline


def _by_name(spans, name):
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


def _one_trajectory(**llm_kwargs):
    with events.trajectory("u1", "t1", step=3, agent_name="tool_agent", worker_index=2) as traj:
        with events.agent_run("ToolAgentLoop"):
            with events.llm_call([1, 2, 3], model="qwen", **llm_kwargs) as turn:
                turn.finish([4, 5], stop_reason="stop", server_meta={"e2e_latency": 0.5})
            with events.tool_call("calculator", call_id="c1"):
                pass
        with events.reward() as reward:
            reward.score(1.0)
    return traj


def test_a_trajectory_is_one_subtree_of_the_uid_trace(seen):
    _, pipeline = seen
    traj = _one_trajectory(request_id="r1")
    spans = pipeline.spans()
    agent = _by_name(spans, sc.agent_span_name("tool_agent"))
    chat = _by_name(spans, sc.llm_span_name(sc.OP_CHAT, "qwen"))
    tool = _by_name(spans, sc.tool_span_name("calculator"))
    reward = _by_name(spans, sc.SPAN_REWARD)

    assert agent.context.trace_id == trace_id_for_uid("u1")
    for child in (chat, tool, reward):
        assert child.parent.span_id == agent.context.span_id
        assert child.context.trace_id == agent.context.trace_id
        assert child.attributes[sc.UID] == "u1" and child.attributes[sc.TRAJ_UID] == "t1"
    assert chat.kind is SpanKind.CLIENT
    assert agent.attributes[sc.GEN_AI_OPERATION_NAME] == sc.OP_INVOKE_AGENT
    assert agent.attributes[sc.AGENT_LOOP_CLASS] == "ToolAgentLoop"
    assert agent.attributes[sc.NUM_TURNS] == 1 and agent.attributes[sc.REWARD_SCORE] == 1.0
    assert agent.attributes[sc.WORKER_INDEX] == 2
    assert chat.attributes[sc.GEN_AI_REQUEST_MODEL] == "qwen"
    assert chat.attributes[sc.GEN_AI_USAGE_INPUT_TOKENS] == 3
    assert chat.attributes[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == 2
    assert chat.attributes[sc.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert chat.attributes[sc.LLM_REQUEST_ID] == "r1"
    assert tool.attributes[sc.GEN_AI_TOOL_CALL_ID] == "c1"

    # the turn's data: ids as the outputs read them, the server's timing for the JSONL
    (data,) = traj.turns
    assert list(data.prompt_ids) == [1, 2, 3] and list(data.completion_ids) == [4, 5]
    assert data.server_meta == {"e2e_latency": 0.5} and data.finish_reason == "stop"
    assert traj.reward_score == 1.0 and traj.run_completed_ns > 0


def test_processors_read_each_spans_payload_at_start_and_end(seen):
    processor, pipeline = seen
    traj = _one_trajectory()
    kinds = {(when, name): found.subject for when, name, found in processor.seen}
    agent, chat = sc.agent_span_name("tool_agent"), sc.llm_span_name(sc.OP_CHAT, "qwen")
    assert kinds[("start", agent)] is Subject.TRAJECTORY and kinds[("end", agent)] is Subject.TRAJECTORY
    assert kinds[("start", chat)] is Subject.LLM_CALL and kinds[("end", chat)] is Subject.LLM_CALL
    assert kinds[("end", sc.tool_span_name("calculator"))] is Subject.TOOL
    assert kinds[("end", sc.SPAN_REWARD)] is Subject.REWARD
    ends = {name: found.data for when, name, found in processor.seen if when == "end"}
    assert ends[agent] is traj and isinstance(ends[chat], TurnData)
    assert payload.open_count() == pipeline.open_before  # nothing kept once the spans ended


def test_a_failed_llm_call_is_no_turn_and_its_span_keeps_the_error(seen):
    _, pipeline = seen
    with events.trajectory("u1", "t1", step=1, agent_name="a") as traj:
        with pytest.raises(RuntimeError):
            with events.llm_call([1]):
                raise RuntimeError("server went away")
    assert traj.turns == []
    chat = _by_name(pipeline.spans(), sc.llm_span_name(sc.OP_CHAT, None))
    assert chat.status.status_code is StatusCode.ERROR
    assert chat.attributes[sc.ERROR_TYPE] == "RuntimeError"
    assert payload.open_count() == pipeline.open_before


def test_the_trajectory_is_current_inside_its_block_and_restored_after(seen):
    before = trace.get_current_span()
    with events.trajectory("u1", "t1", step=1, agent_name="a") as traj:
        assert isinstance(traj, TrajectoryData)
        assert events.current_trajectory() is traj
        with events.llm_call([1]) as turn:
            assert events.current_turn() is turn
            assert trace.get_current_span() is turn.span
        assert events.current_turn() is None
    assert events.current_trajectory() is None
    assert trace.get_current_span() is before


def test_a_validation_trajectory_is_silent_unless_traced(seen):
    processor, pipeline = seen
    with events.trajectory("u1", "t1", step=1, agent_name="a", validate=True) as traj:
        assert traj is None
        with events.llm_call([1]) as turn:
            turn.finish([2])
        with events.tool_call("x"):
            pass
    assert pipeline.spans() == () or list(pipeline.spans()) == []
    assert processor.seen == []


def test_tracing_off_every_event_is_a_no_op():
    from otel_verl.instrumentation import tracing

    tracing.stop()
    with events.trajectory("u1", "t1", step=1, agent_name="a") as traj:
        assert traj is None
        with events.llm_call([1]) as turn:
            turn.finish([2])
        with events.tool_call("x"):
            pass
        with events.reward() as reward:
            reward.score(1.0)
    events.samples_created(["u1"], step=1, trainer="t")
    with events.step_stage(Stage.OLD_LOG_PROB, step=1) as stage:
        assert stage.span is None


def test_batch_stage_spans_have_the_stage_times_the_sample_parent_and_the_stage_link(seen):
    processor, pipeline = seen
    events.samples_created(["u1", "u2"], step=1, trainer="RayPPOTrainer")
    with events.step_stage(Stage.OLD_LOG_PROB, step=1, trainer="RayPPOTrainer"):
        events.sample_stage_done(Stage.OLD_LOG_PROB, ["u1", "u1", "u2"], ["a", "b", "c"], step=1,
                                 start_ns=1_000, trainer="RayPPOTrainer")
    events.samples_finished(["u1", "u2"], sc.Outcome.TRAINED)
    spans = pipeline.spans()
    name = sc.sample_stage_span_name(Stage.OLD_LOG_PROB.value)
    per_uid = {s.attributes[sc.UID]: s for s in spans if s.name == name}
    roots = {s.attributes[sc.UID]: s for s in spans if s.name == sc.SPAN_SAMPLE}
    stage_span = _by_name(spans, sc.step_stage_span_name(Stage.OLD_LOG_PROB.value))
    assert set(per_uid) == {"u1", "u2"}
    for uid, span in per_uid.items():
        assert span.parent.span_id == roots[uid].context.span_id
        assert span.start_time == 1_000 and span.end_time >= span.start_time
        assert [link.context.span_id for link in span.links] == [stage_span.context.span_id]
    assert per_uid["u1"].attributes[sc.TRAJ_UIDS] == ("a", "b")
    stage_payloads = [found for when, n, found in processor.seen if n == name and when == "end"]
    assert sorted(found.data for found in stage_payloads) == [["a", "b"], ["c"]]
    assert payload.open_count() == pipeline.open_before


def test_the_llm_server_span_joins_the_turn_through_its_headers(seen):
    _, pipeline = seen
    with events.trajectory("u1", "t1", step=1, agent_name="a"):
        with events.llm_call([1]) as turn:
            headers = turn.carrier()
    assert headers["traceparent"].startswith("00-")
    with events.llm_server_call(headers, request_id="r9", provider="sglang") as call:
        assert events.current_server_call() is call
        call.record_meta({"queue_time": 0.25, "finish_reason": {"type": "stop"}})
    server = _by_name(pipeline.spans(), sc.SPAN_LLM_SERVER)
    chat = _by_name(pipeline.spans(), sc.llm_span_name(sc.OP_CHAT, None))
    assert server.parent.span_id == chat.context.span_id and server.kind is SpanKind.SERVER
    assert server.attributes[sc.llm_server_meta_attribute("queue_time")] == 0.25
    assert call.meta == {"queue_time": 0.25}


def test_a_raising_processor_is_counted_and_the_others_still_see_the_span(make_pipeline):
    from otel_verl import health

    class Raising(SpanProcessor):
        def on_end(self, span):
            raise ValueError("broken processor")

    after = PayloadSeen()
    pipeline = make_pipeline([Raising(), after])
    with events.trajectory("u1", "t1", step=1, agent_name="a"):
        pass
    assert [name for when, name, _ in after.seen if when == "end"] == [sc.agent_span_name("a")]
    assert len(pipeline.spans()) == 1
    assert any("Raising.on_end" in key for key in health.snapshot().get("failures", {}))


def test_text_with_a_lone_surrogate_reaches_every_output_well_formed(make_pipeline, tmp_path):
    """A model's tool name or a uid may hold a lone surrogate (json.loads makes one): the
    events API writes it as U+FFFD, so OTLP's protobuf and the files take the span."""
    import json

    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from otel_verl import health
    from otel_verl.legacy.sample_csv import SampleCsvProcessor

    csv_proc = SampleCsvProcessor(str(tmp_path), discovery_path=None)
    pipeline = make_pipeline([csv_proc])
    odd = json.loads('"calc\\ud800"')
    with events.trajectory(f"u{odd}", "0", step=1, agent_name="tool_agent"):
        with events.agent_run("ToolAgentLoop"):
            with events.tool_call(odd, call_id=odd):
                pass
    spans = pipeline.spans()
    tool = next(s for s in spans if s.name.startswith("execute_tool"))
    assert tool.name == "execute_tool calc\ufffd" and tool.attributes[sc.GEN_AI_TOOL_CALL_ID] == "calc\ufffd"
    assert tool.attributes[sc.UID] == "ucalc\ufffd"
    encode_spans(spans).SerializeToString()  # protobuf takes every string
    assert csv_proc.force_flush()
    with open(csv_proc.path, encoding="utf-8") as f:
        assert "tool_executed_name=calc\ufffd" in f.read()
    assert health.snapshot()["failures"] == {"text.lone_surrogate": 3}  # uid, tool name, call id


def test_an_sglang_server_without_its_metrics_is_noted_once(seen, caplog):
    from otel_verl import health, server_timing

    with events.trajectory("u1", "t1", step=1, agent_name="a"):
        with events.llm_call([1]) as turn:
            headers = turn.carrier()
    with caplog.at_level("WARNING", logger="otel_verl"):
        for request in range(3):  # three finished requests of a server without enable_metrics
            with events.llm_server_call(headers, request_id=f"r{request}", provider="sglang") as call:
                call.record_meta({"e2e_latency": 0.5, "prompt_tokens": 3, "finish_reason": {"type": "stop"}})
        # with its metrics, and a vLLM server (no sglang meta): nothing to note
        with events.llm_server_call(headers, request_id="r3", provider="sglang") as call:
            call.record_meta({"e2e_latency": 0.5, "queue_time": 0.1, "request_received_ts": 1.0,
                              "prefill_finished_time": 1.2})
        with events.llm_server_call(headers, request_id="r4", provider="vllm") as call:
            call.record_meta({"e2e_latency": 0.5})
    assert health.notes() == {server_timing.TIMING_MISSING: 3}
    notes = [r.getMessage() for r in caplog.records if "per-request timing missing" in r.getMessage()]
    assert len(notes) == 1
    assert server_timing.ENABLE_METRICS_OVERRIDE in notes[0] and "sglang_ttft_ms" in notes[0]


@pytest.mark.parametrize("sdk_spans", [False, True], ids=["slim_spans", "sdk_spans"])
def test_the_reward_is_a_genai_evaluation_result_on_the_trajectory_it_scores(make_pipeline, sdk_spans):
    pipeline = make_pipeline(sdk_spans=sdk_spans)
    with events.trajectory("u1", "t1", step=1, agent_name="tool_agent"):
        with events.reward() as reward:
            reward.score(0.5, label="correct")
    with events.trajectory("u1", "t2", step=1, agent_name="tool_agent"):
        events.trajectory_score(1)  # a score the agent loop had already: no reward span
    agents = {s.attributes[sc.TRAJ_UID]: s for s in pipeline.spans() if s.name == sc.agent_span_name("tool_agent")}
    results = {}
    for traj_uid, span in agents.items():
        [event] = [e for e in span.events if e.name == sc.GEN_AI_EVALUATION_RESULT]
        results[traj_uid] = dict(event.attributes)
    assert results == {
        "t1": {sc.GEN_AI_EVALUATION_NAME: "verl.reward", sc.GEN_AI_EVALUATION_SCORE_VALUE: 0.5,
               sc.GEN_AI_EVALUATION_SCORE_LABEL: "correct"},
        "t2": {sc.GEN_AI_EVALUATION_NAME: "verl.reward", sc.GEN_AI_EVALUATION_SCORE_VALUE: 1.0},
    }
    assert agents["t1"].attributes[sc.REWARD_SCORE] == 0.5  # beside the verl.* attribute


def test_each_turn_carries_its_weight_version_and_the_trajectory_their_range(seen):
    _, pipeline = seen
    with events.trajectory("u1", "t1", step=2, agent_name="a"):
        for version in (5, None, 6):  # a server that says nothing leaves its turn without one
            with events.llm_call([1], model="m") as turn:
                turn.finish([2], weight_version=version)
    spans = pipeline.spans()
    chats = [s for s in spans if s.name == sc.llm_span_name(sc.OP_CHAT, "m")]
    assert [s.attributes.get(sc.WEIGHT_VERSION) for s in chats] == [5, None, 6]
    assert not any(sc.WEIGHT_VERSION_MIN in s.attributes for s in chats)  # a range only for resumed turns
    agent = _by_name(spans, sc.agent_span_name("a"))
    assert (agent.attributes[sc.WEIGHT_VERSION_MIN], agent.attributes[sc.WEIGHT_VERSION_MAX]) == (5, 6)


def test_a_trained_sample_says_the_step_that_trained_it_and_its_staleness(seen):
    _, pipeline = seen
    events.samples_created(["u1", "u2", "u3"], step=3, trainer="RayPPOTrainer")
    # u1's rows came from weights 3 and 2; u2's rows say no version; u3 is filtered
    events.samples_finished(["u1", "u1", "u2"], sc.Outcome.TRAINED, trained_step=4, oldest_versions=[3, 2, None])
    events.samples_finished(["u3"], sc.Outcome.FILTERED)
    roots = {s.attributes[sc.UID]: s.attributes for s in pipeline.spans() if s.name == sc.SPAN_SAMPLE}
    lineage = {uid: {k: v for k, v in attrs.items() if k in (sc.TRAINED_STEP, sc.WEIGHT_VERSION_MIN, sc.STALENESS)}
               for uid, attrs in roots.items()}
    assert lineage == {
        "u1": {sc.TRAINED_STEP: 4, sc.WEIGHT_VERSION_MIN: 2, sc.STALENESS: 1},  # verl's count: 4 - 1 - 2
        "u2": {sc.TRAINED_STEP: 4},
        "u3": {},
    }


class TrajectoryEnds(PayloadSeen):
    """Reads the ends of trajectory spans only, as the trajectory JSONL does."""

    on_start_subjects: frozenset = frozenset()
    on_end_subjects = frozenset({Subject.TRAJECTORY})


def test_a_span_no_output_reads_is_not_made_and_what_it_records_still_arrives(make_pipeline, tmp_path):
    """With the legacy files alone no output reads an LLM server's, a reward's or a reward
    actor's span: none is made, and what they record still reaches the trajectory (the
    engine's timing, the score and the CSV's reward row). An output that reads every
    span brings them back."""
    from otel_verl.legacy.sample_csv import SampleCsvProcessor

    csv = SampleCsvProcessor(str(tmp_path / "trace"), discovery_path=None)
    trajectories = TrajectoryEnds()
    pipeline = make_pipeline([csv, trajectories], in_memory=False)

    def one_trajectory(uid: str):
        with events.trajectory(uid, "0", step=1, agent_name="single_turn_agent") as traj:
            with events.llm_call([1, 2, 3], model="m") as turn:
                with events.llm_server_call(turn.carrier(), request_id="r", provider="sglang") as server:
                    server.record_meta({"queue_time": 0.5, "e2e_latency": 0.8, "prompt_tokens": 3})
                turn.finish([4], server_meta=server.meta)
            with events.reward() as reward:
                reward.score(1.0)
                carrier = reward.carrier()
            with events.reward_worker_call(carrier) as actor:
                actor.score(1.0)
        return traj, server, reward, actor

    traj, server, reward, actor = one_trajectory("u1")
    assert (server.span, reward.span, actor.span) == (None, None, None)
    assert traj.turns[0].server_meta == {"queue_time": 0.5, "e2e_latency": 0.8, "prompt_tokens": 3}
    assert traj.reward_score == 1.0 and traj.reward_scored[1] == 1.0
    assert [name for _, name, _ in trajectories.seen] == [sc.agent_span_name("single_turn_agent")]
    assert csv.force_flush()
    details = [row.rsplit(",", 1)[-1].strip() for row in open(csv.path, encoding="utf-8")]
    assert details[-1] == ("from=RewardLoopWorker|to=AgentLoopWorker|stage=ROLLOUT_REWARD|"
                           "detail=reward_score_computed_score=1.0")

    every = PayloadSeen()  # no subjects said: it reads every span
    pipeline.provider.add_span_processor(every)
    traj, server, reward, actor = one_trajectory("u2")
    assert None not in (server.span, reward.span, actor.span)
    ended = [name for when, name, _ in every.seen if when == "end"]
    assert {sc.SPAN_LLM_SERVER, sc.SPAN_REWARD, sc.SPAN_REWARD_WORKER} <= set(ended)
    assert traj.reward_scored[1] == 1.0
    from otel_verl import health

    assert health.snapshot() == {"failures": {}, "dropped": {}}


def test_a_processor_that_names_its_subjects_wrongly_never_reaches_the_caller(make_pipeline):
    """Whether a span may be left out is asked of the processors: one whose subjects
    cannot be searched is counted, and the reward is still scored."""
    from otel_verl import health

    class Unsearchable(PayloadSeen):
        on_start_subjects: frozenset = frozenset()
        on_end_subjects = 42  # not a collection

    make_pipeline([Unsearchable()], in_memory=False)
    with events.trajectory("u1", "0", step=1, agent_name="single_turn_agent") as traj:
        with events.reward() as reward:
            reward.score(0.5)
    assert traj.reward_score == 0.5 and traj.reward_scored[1] == 0.5
    assert health.snapshot()["failures"].get("events.start_span", 0) >= 1
