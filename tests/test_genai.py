"""GenAI conventions as GenAI viewers read them: the agent, LLM and tool spans' gen_ai.*
attributes, and opt-in message content in the conventions' structured message shape."""

from __future__ import annotations

import asyncio
import json

import pytest

from otel_verl import events, health, semconv as sc, settings
from otel_verl.instrumentation import agent_loop

CAPTURE = {"OTEL_VERL_ENABLED": "1", settings.CAPTURE_CONTENT: "SPAN_ONLY"}

SYSTEM = {"role": "system", "content": "You add numbers."}
USER = {"role": "user", "content": "What is 2+3?"}
ASSISTANT_CALL = {"role": "assistant", "content": "",
                  "tool_calls": [{"type": "function", "id": "call_1",
                                  "function": {"name": "calculator", "arguments": {"expr": "2+3"}}}]}
TOOL = {"role": "tool", "content": "5", "tool_call_id": "call_1"}
ASSISTANT_FINAL = {"role": "assistant", "content": "It is 5."}


def decode(ids, skip_special_tokens=False):
    return "|".join(str(i) for i in ids)


def _spans(pipeline, operation):
    return [s for s in pipeline.spans() if s.attributes.get(sc.GEN_AI_OPERATION_NAME) == operation]


def _one(pipeline, operation):
    found = _spans(pipeline, operation)
    assert len(found) == 1, [s.name for s in pipeline.spans()]
    return found[0]


def _tool_agent_trajectory(messages=None):
    """Two turns of a tool agent, the way ToolAgentLoop keeps its conversation: one list,
    the assistant's tool call and the tool's result appended between the turns."""
    messages = [SYSTEM, USER] if messages is None else messages
    with events.trajectory("u1", "t1", step=3, agent_name="tool_agent", provider="sglang", decode=decode):
        with events.agent_run("ToolAgentLoop"):
            events.chat_messages(list(messages))  # the row's raw_prompt, as run() gets it
            events.chat_messages(messages)  # the loop's own list, before the first call
            with events.llm_call([1, 2, 3], model="qwen") as turn:
                turn.finish([4, 5], stop_reason="stop")
            messages.append(ASSISTANT_CALL)
            with events.tool_call("calculator", call_id="call_1", arguments='{"expr": "2+3"}') as tool:
                tool.result("5")
            messages.append(TOOL)
            events.chat_messages(messages)
            with events.llm_call([1, 2, 3, 4, 5, 6], model="qwen") as turn:
                turn.finish([7], stop_reason="length")
            messages.append(ASSISTANT_FINAL)


# --------------------------------------------------------------------------- always there


def test_agent_and_llm_spans_carry_provider_agent_and_conversation(make_pipeline):
    pipeline = make_pipeline([])
    _tool_agent_trajectory()
    agent = _one(pipeline, sc.OP_INVOKE_AGENT)
    chats = _spans(pipeline, sc.OP_CHAT)
    assert agent.name == "invoke_agent tool_agent"
    assert agent.attributes[sc.GEN_AI_AGENT_NAME] == "tool_agent"
    assert agent.attributes[sc.GEN_AI_PROVIDER_NAME] == "sglang"
    assert agent.attributes[sc.GEN_AI_CONVERSATION_ID] == "u1/t1"
    assert len(chats) == 2
    for chat in chats:
        assert chat.attributes[sc.GEN_AI_CONVERSATION_ID] == "u1/t1"
        assert chat.attributes[sc.GEN_AI_PROVIDER_NAME] == "verl"  # the client hook passes the engine
    # no content without the opt-in
    keys = {k for s in pipeline.spans() for k in s.attributes}
    assert not keys & {sc.GEN_AI_INPUT_MESSAGES, sc.GEN_AI_OUTPUT_MESSAGES, sc.GEN_AI_TOOL_CALL_ARGUMENTS,
                       sc.GEN_AI_TOOL_CALL_RESULT}


def test_trajectory_without_a_provider_names_verl(make_pipeline):
    pipeline = make_pipeline([])
    with events.trajectory("u", "0", step=1, agent_name="single_turn_agent"):
        pass
    assert _one(pipeline, sc.OP_INVOKE_AGENT).attributes[sc.GEN_AI_PROVIDER_NAME] == "verl"


# --------------------------------------------------------------------------- opt-in content


def test_llm_spans_carry_the_conversation_as_structured_messages(make_pipeline):
    pipeline = make_pipeline([], env=CAPTURE)
    _tool_agent_trajectory()
    first, second = sorted(_spans(pipeline, sc.OP_CHAT), key=lambda s: s.start_time)
    assert json.loads(first.attributes[sc.GEN_AI_INPUT_MESSAGES]) == [
        {"role": "system", "parts": [{"type": "text", "content": "You add numbers."}]},
        {"role": "user", "parts": [{"type": "text", "content": "What is 2+3?"}]},
    ]
    assert json.loads(second.attributes[sc.GEN_AI_INPUT_MESSAGES])[2:] == [
        {"role": "assistant", "parts": [{"type": "tool_call", "id": "call_1", "name": "calculator",
                                         "arguments": {"expr": "2+3"}}]},
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_1", "response": "5"}]},
    ]
    # output: the decoded completion (the loop parses tool calls only after the call)
    assert json.loads(first.attributes[sc.GEN_AI_OUTPUT_MESSAGES]) == [
        {"role": "assistant", "parts": [{"type": "text", "content": "4|5"}], "finish_reason": "stop"}]
    assert json.loads(second.attributes[sc.GEN_AI_OUTPUT_MESSAGES])[0]["finish_reason"] == "length"


def test_agent_span_carries_the_conversation_start_and_what_the_agent_added(make_pipeline):
    pipeline = make_pipeline([], env=CAPTURE)
    _tool_agent_trajectory()
    agent = _one(pipeline, sc.OP_INVOKE_AGENT)
    assert [m["role"] for m in json.loads(agent.attributes[sc.GEN_AI_INPUT_MESSAGES])] == ["system", "user"]
    output = json.loads(agent.attributes[sc.GEN_AI_OUTPUT_MESSAGES])
    assert [m["role"] for m in output] == ["assistant", "tool", "assistant"]
    assert output[-1]["parts"] == [{"type": "text", "content": "It is 5."}]


def test_single_turn_without_the_loops_list_shows_the_last_completion_as_agent_output(make_pipeline):
    pipeline = make_pipeline([], env=CAPTURE)
    with events.trajectory("u", "0", step=1, agent_name="single_turn_agent", decode=decode):
        with events.agent_run("SingleTurnAgentLoop"):
            events.chat_messages([USER])
            with events.llm_call([1, 2]) as turn:
                turn.finish([9], stop_reason="stop")
    agent = _one(pipeline, sc.OP_INVOKE_AGENT)
    chat = _one(pipeline, sc.OP_CHAT)
    assert agent.attributes[sc.GEN_AI_OUTPUT_MESSAGES] == chat.attributes[sc.GEN_AI_OUTPUT_MESSAGES]
    assert json.loads(agent.attributes[sc.GEN_AI_INPUT_MESSAGES])[0]["role"] == "user"


def test_a_call_without_messages_gets_its_decoded_prompt(make_pipeline):
    """A custom loop's later turns (no messages handed over): the decoded prompt, as one
    user message; the row's messages are for the first call only."""
    pipeline = make_pipeline([], env=CAPTURE)
    with events.trajectory("u", "0", step=1, agent_name="custom", decode=decode):
        events.chat_messages([USER])
        for prompt in ([1], [1, 2, 3]):
            with events.llm_call(prompt) as turn:
                turn.finish([9], stop_reason="stop")
    first, second = sorted(_spans(pipeline, sc.OP_CHAT), key=lambda s: s.start_time)
    assert json.loads(first.attributes[sc.GEN_AI_INPUT_MESSAGES])[0]["parts"][0]["content"] == "What is 2+3?"
    assert json.loads(second.attributes[sc.GEN_AI_INPUT_MESSAGES]) == [
        {"role": "user", "parts": [{"type": "text", "content": "1|2|3"}]}]


def test_a_plain_text_prompt_is_one_user_message(make_pipeline):
    pipeline = make_pipeline([], env=CAPTURE)
    with events.trajectory("u", "0", step=1, agent_name="custom", decode=decode):
        events.chat_messages("Hello there")
        with events.llm_call([1]) as turn:
            turn.finish([9], stop_reason="stop")
    assert json.loads(_one(pipeline, sc.OP_CHAT).attributes[sc.GEN_AI_INPUT_MESSAGES]) == [
        {"role": "user", "parts": [{"type": "text", "content": "Hello there"}]}]


def test_a_call_that_raises_still_shows_what_was_sent(make_pipeline):
    pipeline = make_pipeline([], env=CAPTURE)
    with events.trajectory("u", "0", step=1, agent_name="a", decode=decode):
        events.chat_messages([USER])
        with pytest.raises(RuntimeError):
            with events.llm_call([1]):
                raise RuntimeError("engine gone")
    chat = _one(pipeline, sc.OP_CHAT)
    assert json.loads(chat.attributes[sc.GEN_AI_INPUT_MESSAGES])[0]["role"] == "user"
    assert sc.GEN_AI_OUTPUT_MESSAGES not in chat.attributes


def test_tool_span_carries_arguments_and_result(make_pipeline):
    pipeline = make_pipeline([], env=CAPTURE)
    _tool_agent_trajectory()
    tool = _one(pipeline, sc.OP_EXECUTE_TOOL)
    assert tool.attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS] == '{"expr": "2+3"}'
    assert tool.attributes[sc.GEN_AI_TOOL_CALL_RESULT] == "5"


def test_message_parts_for_media_reasoning_and_unparsed_arguments():
    from otel_verl.events.messages import chat_messages_json

    messages = [
        {"role": "user", "content": [{"type": "image", "image": object()}, {"type": "text", "text": "what is it?"}]},
        {"role": "assistant", "content": "a cat", "reasoning_content": "looks furry",
         "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{not json"}}]},
        {"role": "tool", "content": [{"type": "text", "text": "done"}]},
    ]
    assert json.loads(chat_messages_json(messages)) == [
        {"role": "user", "parts": [{"type": "image"}, {"type": "text", "content": "what is it?"}]},
        {"role": "assistant", "parts": [{"type": "reasoning", "content": "looks furry"},
                                        {"type": "text", "content": "a cat"},
                                        {"type": "tool_call", "id": None, "name": "f", "arguments": "{not json"}]},
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": None, "response": "done"}]},
    ]


def test_content_is_bounded_per_part_and_per_span():
    from otel_verl.events.messages import chat_messages_json

    long_text = "x" * (sc.MAX_CONTENT_CHARS * 3)
    one = json.loads(chat_messages_json([{"role": "user", "content": long_text}]))
    assert len(one[0]["parts"][0]["content"]) == sc.MAX_CONTENT_CHARS
    many = [{"role": "user", "content": f"{i}:" + long_text} for i in range(40)]
    encoded = chat_messages_json(many)
    kept = json.loads(encoded)
    assert len(encoded) <= sc.MAX_MESSAGES_CHARS
    assert 0 < len(kept) < 40
    assert kept[-1]["parts"][0]["content"].startswith("39:")  # the newest are kept


# --------------------------------------------------------------------------- the switch


@pytest.mark.parametrize("value, captured", [
    ("true", True), ("SPAN_ONLY", True), ("span_and_event", True),
    ("false", False), ("NO_CONTENT", False), ("EVENT_ONLY", False),
])
def test_capture_values(make_pipeline, value, captured):
    pipeline = make_pipeline([], env={"OTEL_VERL_ENABLED": "1", settings.CAPTURE_CONTENT: value})
    _tool_agent_trajectory()
    keys = {k for s in pipeline.spans() for k in s.attributes}
    content = {sc.GEN_AI_INPUT_MESSAGES, sc.GEN_AI_OUTPUT_MESSAGES, sc.GEN_AI_TOOL_CALL_ARGUMENTS,
               sc.GEN_AI_TOOL_CALL_RESULT}
    assert (keys & content) == (content if captured else set())


def test_a_nonsense_value_warns_once_and_traces_without_content(make_pipeline, caplog, monkeypatch):
    monkeypatch.setattr(settings, "_warned", set())
    with caplog.at_level("WARNING", logger="otel_verl"):
        pipeline = make_pipeline([], env={"OTEL_VERL_ENABLED": "1", settings.CAPTURE_CONTENT: "verbose"})
        _tool_agent_trajectory()
        settings.load({"OTEL_VERL_ENABLED": "1", settings.CAPTURE_CONTENT: "verbose"})  # read again: no new warning
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and settings.CAPTURE_CONTENT in warnings[0]
    spans = pipeline.spans()
    assert len(_spans(pipeline, sc.OP_CHAT)) == 2 and len(_spans(pipeline, sc.OP_INVOKE_AGENT)) == 1
    assert not {k for s in spans for k in s.attributes} & {sc.GEN_AI_INPUT_MESSAGES, sc.GEN_AI_OUTPUT_MESSAGES}


# --------------------------------------------------------------------------- the verl wrappers


class _AgentData:
    def __init__(self, messages):
        self.messages = messages


class _ToolAgentLoop:
    """Stand-in with ToolAgentLoop's signatures: what the wrappers read."""

    async def run(self, sampling_params, priority=0, **kwargs):
        return kwargs["raw_prompt"]

    async def _handle_generating_state(self, agent_data, sampling_params, ignore_termination=False):
        with events.llm_call([1, 2]) as turn:
            turn.finish([3], stop_reason="stop")

    async def _call_tool(self, tool_call, tools_kwargs, agent_data):
        return _ToolResponse("72F and sunny"), 0.0, {}


class _ToolResponse:
    def __init__(self, text):
        self.text = text


class _FunctionCall:
    name = "weather"
    arguments = '{"city": "Paris"}'
    tool_call_id = "call_9"


def test_wrappers_hand_the_loops_messages_and_tool_results_over(make_pipeline):
    pipeline = make_pipeline([], env=CAPTURE)
    loop = _ToolAgentLoop()
    data = _AgentData([USER])

    async def scenario():
        with events.trajectory("u", "0", step=1, agent_name="tool_agent", provider="vllm", decode=decode):
            raw = await agent_loop._agent_run(loop.run, loop, ({},), {"raw_prompt": [USER]})
            assert raw == [USER]
            await agent_loop._handle_generating_state(loop._handle_generating_state, loop, (data, {}), {})
            data.messages.append(ASSISTANT_CALL)
            await agent_loop._call_tool(loop._call_tool, loop, (_FunctionCall(), {}, data), {})
            data.messages.append(TOOL)
            await agent_loop._handle_generating_state(loop._handle_generating_state, loop, (data,),
                                                      {"sampling_params": {}})

    asyncio.run(scenario())
    assert health.snapshot()["failures"] == {}
    first, second = sorted(_spans(pipeline, sc.OP_CHAT), key=lambda s: s.start_time)
    assert [m["role"] for m in json.loads(first.attributes[sc.GEN_AI_INPUT_MESSAGES])] == ["user"]
    assert [m["role"] for m in json.loads(second.attributes[sc.GEN_AI_INPUT_MESSAGES])] == ["user", "assistant", "tool"]
    tool = _one(pipeline, sc.OP_EXECUTE_TOOL)
    assert tool.attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS] == '{"city": "Paris"}'
    assert tool.attributes[sc.GEN_AI_TOOL_CALL_RESULT] == "72F and sunny"
    agent = _one(pipeline, sc.OP_INVOKE_AGENT)
    assert agent.attributes[sc.GEN_AI_PROVIDER_NAME] == "vllm"
    assert [m["role"] for m in json.loads(agent.attributes[sc.GEN_AI_OUTPUT_MESSAGES])] == ["assistant", "tool"]


def test_provider_comes_from_the_rollout_engine_read_once_per_config():
    class Config:
        def __init__(self, name):
            self.name = name
            self.reads = 0

        def __getattribute__(self, key):
            if key == "name":
                object.__setattr__(self, "reads", object.__getattribute__(self, "reads") + 1)
            return object.__getattribute__(self, key)

    class Worker:
        pass

    worker, sglang = Worker(), Config("sglang")
    assert [agent_loop._provider(worker, sglang) for _ in range(3)] == ["sglang"] * 3
    assert sglang.reads == 1
    assert agent_loop._provider(worker, Config("vllm")) == "vllm"  # a new config is read
    assert agent_loop._provider(Worker(), None) == "verl"
    assert agent_loop._provider(object(), Config("")) == "verl"  # no attributes on it: still answers


# --------------------------------------------------------------------------- real verl


@pytest.fixture(scope="module")
def tool_demo(tmp_path_factory):
    """The traced CPU demo's tool agent (real ToolAgentLoop, stand-in engine) with
    content capture on: 1 step, 2 prompts, n=2."""
    from demo_process import run_in_child
    from otel_verl.exporters.otlp_json_file import spans_from_files

    trace_dir = tmp_path_factory.mktemp("genai-demo")
    summary = run_in_child("demo", {"trace_dir": str(trace_dir), "steps": 1, "prompts": 2, "n": 2, "agent": "tool",
                                    "validate": False},
                           str(trace_dir) + "-run", env={settings.CAPTURE_CONTENT: "SPAN_ONLY"})
    return spans_from_files(summary["outputs"]["otlp_json"])


@pytest.mark.verl
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_real_tool_agent_loop_conversation_on_spans(tool_demo):
    spans = tool_demo
    agents = [s for s in spans if s["attributes"].get(sc.GEN_AI_OPERATION_NAME) == sc.OP_INVOKE_AGENT]
    assert len(agents) == 4
    for agent in agents:
        attrs = agent["attributes"]
        assert attrs[sc.GEN_AI_AGENT_NAME] == "tool_agent" and attrs[sc.GEN_AI_PROVIDER_NAME] == "sglang"
        conversation = attrs[sc.GEN_AI_CONVERSATION_ID]
        assert conversation == f"{attrs[sc.UID]}/{attrs[sc.TRAJ_UID]}"
        assert [m["role"] for m in json.loads(attrs[sc.GEN_AI_INPUT_MESSAGES])] == ["system", "user"]
        added = json.loads(attrs[sc.GEN_AI_OUTPUT_MESSAGES])
        assert [m["role"] for m in added] == ["assistant", "tool", "assistant"]
        [call] = [p for p in added[0]["parts"] if p["type"] == "tool_call"]
        assert call["name"] == "calculator" and isinstance(call["arguments"], dict)
        assert added[1]["parts"][0]["type"] == "tool_call_response"

        chats = sorted((s for s in spans if s["parentSpanId"] == agent["spanId"]
                        and s["attributes"].get(sc.GEN_AI_OPERATION_NAME) == sc.OP_CHAT),
                       key=lambda s: int(s["startTimeUnixNano"]))
        assert len(chats) == 2
        for chat in chats:
            assert chat["attributes"][sc.GEN_AI_CONVERSATION_ID] == conversation
            assert json.loads(chat["attributes"][sc.GEN_AI_OUTPUT_MESSAGES])[0]["role"] == "assistant"
        first_in, second_in = (json.loads(c["attributes"][sc.GEN_AI_INPUT_MESSAGES]) for c in chats)
        assert second_in[:2] == first_in and second_in[2:] == added[:2]  # the tool call and its result

        [tool] = [s for s in spans if s["parentSpanId"] == agent["spanId"]
                  and s["attributes"].get(sc.GEN_AI_OPERATION_NAME) == sc.OP_EXECUTE_TOOL]
        assert tool["attributes"][sc.GEN_AI_TOOL_CALL_RESULT] == added[1]["parts"][0]["response"]
        assert json.loads(tool["attributes"][sc.GEN_AI_TOOL_CALL_ARGUMENTS]) == call["arguments"]
