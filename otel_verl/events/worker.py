"""Rollout-worker events: a trajectory and what happens inside it (agent run, LLM turns,
observations, tool calls, reward)."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, List, Mapping, Optional, Sequence

from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind

from otel_verl import carriers, health, semconv as sc
from otel_verl.clock import AnchoredClock
from otel_verl.ids import id_str
from otel_verl.rollout_data import TrajectoryData, TurnData, kept_ids, kept_prompt, token_list
from otel_verl.semconv import Subject
from otel_verl.text_codec import TextCodec, text_codec
from otel_verl.events import _core
from otel_verl.events._core import (
    _text,
    _capturing_content,
    _content,
    _sample_root_context,
    _start,
    SpanScope,
)
from otel_verl.events.messages import chat_messages_json, text_message_json


# --------------------------------------------------------------------------- rollout worker

# The running trajectory and LLM call, in the OpenTelemetry context (see SpanScope)
_TRAJ_KEY = otel_context.create_key("otel_verl.trajectory")
_TURN_KEY = otel_context.create_key("otel_verl.llm_call")


def _active_traj() -> Optional["_TrajectoryScope"]:
    traj = _core.current(_TRAJ_KEY)
    return traj if type(traj) is _TrajectoryScope else None  # not a _SuppressedTrajectory


def trajectory(
    uid: Any,
    traj_uid: Any,
    *,
    step: int,
    agent_name: str,
    provider: str = "verl",
    parent: Any = None,
    n_samples: Optional[int] = None,
    worker_index: Optional[int] = None,
    trainer_api: str = "v0",
    validate: bool = False,
    tokenizer: Any = None,
    decode: Any = None,
    encode: Any = None,
) -> ContextManager[Optional[TrajectoryData]]:
    """One (uid, traj_uid) agent run in a rollout worker: a GenAI ``invoke_agent`` span,
    current inside the ``with`` block.

    ``agent_name`` is the agent loop's registered name (``tool_agent``), ``provider`` the
    engine serving its LLM calls (``sglang``, ``vllm``; ``verl`` when unknown). The
    trajectory is the GenAI conversation: ``gen_ai.conversation.id`` is
    ``{uid}/{traj_uid}``, here and on its LLM spans.

    ``parent`` is the carrier the trainer sent with the row; without one the span is
    parented to the sample root's derived ids. ``tokenizer`` (its ``decode`` and
    ``encode``), or ``decode`` / ``encode`` of a loop without one, turn the turns' token
    ids into texts (for the outputs and content capture). The block gets the trajectory's data
    (``None`` when not traced) so the caller may add metrics.
    """
    rt = _core.state()
    if rt is None:
        return _UNTRACED
    if validate and not rt.settings.trace_validation:
        return _SuppressedTrajectory(None)
    try:
        uid_s, traj_s = id_str(uid), id_str(traj_uid)
        agent_name = _text(agent_name)
        parent_ctx = carriers.context_from(parent) if parent is not None else None
        if parent_ctx is None:
            parent_ctx = _sample_root_context(uid_s)
        codec = text_codec(tokenizer) if tokenizer is not None else (
            TextCodec(decode, encode) if decode is not None or encode is not None else None)
        clock = AnchoredClock()  # the trajectory's timestamps: their differences are durations
        data = TrajectoryData(uid_s, traj_s, int(step), n_samples, agent_name, clock.now(), trainer_api,
                              codec=codec)
        sample_attributes = {sc.UID: uid_s, sc.TRAJ_UID: traj_s, sc.GLOBAL_STEP: int(step)}
        conversation_id = f"{uid_s}/{traj_s}"
        attrs = {
            sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT,
            sc.GEN_AI_PROVIDER_NAME: _text(provider),
            sc.GEN_AI_AGENT_NAME: agent_name,
            sc.GEN_AI_CONVERSATION_ID: conversation_id,
            **sample_attributes,
        }
        if worker_index is not None:
            attrs[sc.WORKER_INDEX] = int(worker_index)
        if validate:
            attrs[sc.VALIDATE] = True
        span = _start(sc.agent_span_name(agent_name), Subject.TRAJECTORY, parent_ctx, attrs, data=data)
        if span is None:  # (counted)
            return _UNTRACED
        return _TrajectoryScope(span, data, worker_index, sample_attributes, conversation_id, clock)
    except Exception as exc:  # tracing failed: run untraced
        health.record_failure("events.trajectory", exc)
        return _UNTRACED


_UNTRACED = contextlib.nullcontext()  # a block that is not traced (gets None)


class _SuppressedTrajectory(SpanScope):
    """A validation trajectory that is not traced: everything inside it is silent."""

    key = _TRAJ_KEY


class _TrajectoryScope(SpanScope):
    """A trajectory while it runs: its span's ``with`` block (which gets the trajectory's
    data) and what the spans inside it read (the ``_TRAJ_KEY`` value)."""

    key = _TRAJ_KEY

    def __init__(self, span: Any, data: TrajectoryData, worker_index: Optional[int],
                 sample_attributes: Dict[str, Any], conversation_id: str = "",
                 clock: Optional[AnchoredClock] = None) -> None:
        super().__init__(span)
        self.data = data
        self.clock = clock if clock is not None else AnchoredClock()
        self.agent_loop_class: Optional[str] = None
        self.worker_index = worker_index
        self.sample_attributes = sample_attributes  # uid, traj_uid, step: on every span inside it
        self.conversation_id = conversation_id
        # Content capture only (see chat_messages): the messages the next LLM call sends,
        # the conversation's first messages and the agent loop's own list of them.
        self.next_messages: Any = None
        self.first_messages: Any = None
        self.live_messages: Any = None
        self.last_output: Optional[str] = None  # the last turn's gen_ai.output.messages
        self.weight_versions: List[int] = []  # of every engine request of its turns

    @property
    def decode(self) -> Any:
        """The tokenizer's decode (content capture shows texts with it), or ``None``."""
        codec = self.data.codec
        return codec.decode if codec is not None else None

    def value(self) -> TrajectoryData:
        return self.data

    def _ending(self, error: Optional[BaseException]) -> None:
        data = self.data
        data.completed_at = self.clock.now()
        if data.reward_score is not None:
            self.span.set_attribute(sc.REWARD_SCORE, data.reward_score)
        self.span.set_attribute(sc.NUM_TURNS, len(data.turns))
        _set_version_range(self.span, self.weight_versions)
        if self.first_messages is not None and _capturing_content():
            self._capture_content()

    def _capture_content(self) -> None:
        """The agent's input (the conversation's first messages) and output (what the
        agent loop added to its list: assistant turns with their tool calls, tool
        results; else the last turn's completion)."""
        first, count = self.first_messages
        self.span.set_attribute(sc.GEN_AI_INPUT_MESSAGES, chat_messages_json(first[:count]))
        live = self.live_messages
        if live is not None and len(live) > count:
            self.span.set_attribute(sc.GEN_AI_OUTPUT_MESSAGES, chat_messages_json(live[count:]))
        elif self.last_output is not None:
            self.span.set_attribute(sc.GEN_AI_OUTPUT_MESSAGES, self.last_output)


def agent_run(agent_loop_class: str) -> ContextManager[None]:
    """The agent loop's ``run()`` inside the current trajectory.

    No span of its own (nobody needs one: it spans the trajectory):
    ``verl.agent_loop.class`` goes on the trajectory span, and the time ``run()``
    returned on the trajectory's data. A ``run()``
    that raises records no completion; the trajectory span carries the error."""
    traj = _active_traj()
    if traj is None:
        return _UNTRACED
    try:
        agent_loop_class = _text(agent_loop_class)
        traj.agent_loop_class = agent_loop_class
        traj.data.agent_loop_class = agent_loop_class
        traj.span.set_attribute(sc.AGENT_LOOP_CLASS, agent_loop_class)
    except Exception as exc:
        health.record_failure("events.agent_run", exc)
    return _AgentRun(traj.data, traj.clock)


class _AgentRun:
    def __init__(self, data: TrajectoryData, clock: AnchoredClock) -> None:
        self._data = data
        self._clock = clock

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None:
            self._data.run_completed_ns = self._clock.now_ns()
        return False


@health.guarded(default=None)
def agent_metrics(metrics: Mapping[str, Any]) -> None:
    """The agent loop's own metrics for the current trajectory (a plain dict)."""
    traj = _active_traj()
    if traj is not None and metrics:
        traj.data.agent_metrics.update(metrics)


@health.guarded(default=None)
def trajectory_score(score: Any, *, label: Optional[str] = None) -> None:
    """A reward score the agent loop already had (no reward computation traced here);
    ``label``: the reward's verdict in words, where it gives one."""
    traj = _active_traj()
    if traj is not None and score is not None:
        traj.data.reward_score = float(score)
        _evaluation_result(traj, traj.data.reward_score, label)


def _evaluation_result(traj: "_TrajectoryScope", score: float, label: Optional[str]) -> None:
    """The reward as the GenAI conventions' evaluation result, an event on the trajectory
    span it scores (GenAI viewers read it there)."""
    attrs: Dict[str, Any] = {sc.GEN_AI_EVALUATION_NAME: sc.REWARD_EVALUATION_NAME,
                             sc.GEN_AI_EVALUATION_SCORE_VALUE: score}
    if label:
        attrs[sc.GEN_AI_EVALUATION_SCORE_LABEL] = _text(label)
    traj.span.add_event(sc.GEN_AI_EVALUATION_RESULT, attrs)


def _weight_version(value: Any) -> Optional[int]:
    """verl's ``global_steps`` of an engine request's output, as a version (None: not said)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _set_version_range(span: Any, versions: List[int]) -> None:
    if versions:
        span.set_attributes({sc.WEIGHT_VERSION_MIN: min(versions), sc.WEIGHT_VERSION_MAX: max(versions)})


class _EngineRequest(SpanScope):
    """A span whose context goes to the LLM server with the engine request: a turn, or
    an attempt of a resumed one (the ``_TURN_KEY`` value while it runs)."""

    key = _TURN_KEY
    finish_failure = ""  # where a failed finish is counted (each kind names its own)

    def __init__(self, span: Any) -> None:
        super().__init__(span)
        self._carrier: Optional[Dict[str, str]] = None

    def carrier(self) -> Dict[str, str]:
        """W3C headers of this span, for the server side (``traceparent``...)."""
        if self._carrier is None:
            self._carrier = carriers.headers_of(self.span) if self.span is not None else {}
        return self._carrier

    def finish(
        self,
        completion_ids: Sequence[int] = (),
        *,
        stop_reason: Any = None,
        output_tokens: Optional[int] = None,
        server_meta: Optional[Mapping[str, Any]] = None,
        weight_version: Any = None,
    ) -> None:
        """The engine's response (never raises: a failure is counted): the completion,
        why it stopped (``abort``: the engine was interrupted), the server's per-request
        timing and the weight version that served it."""
        try:
            self._respond(completion_ids, stop_reason, output_tokens, server_meta, _weight_version(weight_version))
        except Exception as exc:
            health.record_failure(self.finish_failure, exc)

    def _respond(self, completion_ids: Sequence[int], stop_reason: Any, output_tokens: Optional[int],
                 server_meta: Optional[Mapping[str, Any]], version: Optional[int]) -> None:
        raise NotImplementedError


class Turn(_EngineRequest):
    """What :func:`llm_call` yields (the ``with`` block of the call's span): the caller
    reports the response through it."""

    finish_failure = "worker.Turn.finish"

    def __init__(self, span: Any, data: Optional[TurnData], traj_data: Optional[TrajectoryData] = None,
                 sample_attributes: Optional[Dict[str, Any]] = None,
                 traj_versions: Optional[List[int]] = None, clock: Optional[AnchoredClock] = None) -> None:
        super().__init__(span)
        self.data = data
        self._traj_data = traj_data
        self._clock = clock if clock is not None else AnchoredClock()  # the trajectory's
        self._sample_attributes = sample_attributes or {}
        self.resumes = False  # generate calls inside this one are its attempts
        self.attempts = 0  # engine requests made for this turn by a resuming client
        self.weight_versions: List[int] = []  # of its attempts
        self._traj_versions = traj_versions if traj_versions is not None else []  # the trajectory's

    def served_by(self, version: Optional[int]) -> None:
        """An engine request of this turn was served by weight ``version``."""
        if version is not None:
            self.weight_versions.append(version)
            self._traj_versions.append(version)

    def value(self) -> "Turn":
        return self

    def _ending(self, error: Optional[BaseException]) -> None:
        if self.attempts:
            self.span.set_attribute(sc.LLM_ATTEMPTS, self.attempts)
        if error is not None and self._traj_data is not None:
            # A generate call that raised is no turn of the trajectory's data (its turns
            # are the calls that returned); its span keeps the error.
            _forget_turn(self._traj_data, self.data)

    def _ended(self, error: Optional[BaseException]) -> None:
        data = self.data
        if data is not None and not data.end_ts:
            data.end_ts = self._clock.now()

    def _respond(self, completion_ids: Sequence[int], stop_reason: Any, output_tokens: Optional[int],
                 server_meta: Optional[Mapping[str, Any]], version: Optional[int]) -> None:
        """``server_meta`` goes to the turn's data, not on this span (the server's own
        span, a child of this one, carries it). ``version``: of a resumed turn, its
        last attempt's; each attempt says its own, and the turn the range."""
        data = self.data
        if data is None:
            return
        if version is not None:
            self.span.set_attribute(sc.WEIGHT_VERSION, version)
            if not self.attempts:
                self.served_by(version)
        _set_version_range(self.span, self.weight_versions if self.attempts else [])
        data.end_ts = self._clock.now()
        kept = data.completion_ids = kept_ids(completion_ids) if completion_ids is not None else ()
        data.completion_token_count = output_tokens
        reason = data.finish_reason = str(stop_reason) if stop_reason else None
        attrs: Dict[str, Any] = {
            sc.GEN_AI_USAGE_OUTPUT_TOKENS: int(output_tokens if output_tokens is not None else len(kept))}
        if reason:
            attrs[sc.GEN_AI_RESPONSE_FINISH_REASONS] = (_text(reason),)
        if server_meta:
            data.server_meta.update(server_meta)
        self.span.set_attributes(attrs)
        self._capture_content(data)

    def _capture_content(self, data: TurnData) -> None:
        """Opt-in message content (see :class:`_CapturingTurn`)."""

    def attempt(self, prompt_ids: Sequence[int], request_id: Optional[str]) -> ContextManager["Attempt"]:
        """One engine request of this turn, made by a client that resumes an interrupted
        request (verl's ``FullyAsyncLLMServerClient``) until the turn is whole."""
        self.attempts += 1
        attrs: Dict[str, Any] = {
            sc.LLM_ATTEMPT_NUMBER: self.attempts,
            sc.GEN_AI_USAGE_INPUT_TOKENS: len(prompt_ids),
            **self._sample_attributes,
        }
        if request_id:
            attrs[sc.LLM_REQUEST_ID] = _text(request_id)
        span = _start(sc.SPAN_LLM_ATTEMPT, Subject.LLM_ATTEMPT, None, attrs, kind=SpanKind.CLIENT)
        return Attempt(span, self)


class Attempt(_EngineRequest):
    """One engine request of a resumed turn: a child of the turn's span and the parent of
    the server's span. The turn keeps the whole completion; the first attempt's server
    timing stands for the turn (its queue and first token are the turn's)."""

    finish_failure = "worker.Attempt.finish"

    def __init__(self, span: Any, turn: Turn) -> None:
        super().__init__(span)
        self._turn = turn
        self._turn_data = turn.data

    def value(self) -> "Attempt":
        return self

    def _respond(self, completion_ids: Sequence[int], stop_reason: Any, output_tokens: Optional[int],
                 server_meta: Optional[Mapping[str, Any]], version: Optional[int]) -> None:
        """Its tokens, why it stopped and its weight version on its span; the first
        attempt's server timing for the turn's data."""
        if self.span is None:
            return
        count = output_tokens if output_tokens is not None else len(completion_ids or ())
        attrs: Dict[str, Any] = {sc.GEN_AI_USAGE_OUTPUT_TOKENS: int(count)}
        if version is not None:
            attrs[sc.WEIGHT_VERSION] = version
            self._turn.served_by(version)
        if stop_reason:
            attrs[sc.GEN_AI_RESPONSE_FINISH_REASONS] = (_text(str(stop_reason)),)
        self.span.set_attributes(attrs)
        data = self._turn_data
        if server_meta and data is not None and not data.server_meta:
            data.server_meta.update(server_meta)


class _CapturingTurn(Turn):
    """A :class:`Turn` while content capture is on. Input: the chat messages the agent
    loop sends (:func:`chat_messages`), else the decoded prompt as one ``user`` message;
    output: the decoded completion as one ``assistant`` message (the agent loop parses
    its tool calls only after the call; they show as ``tool_call`` parts in the next
    turn's input and in the trajectory's output). It keeps the tokenizer's decode and
    the whole prompt (the turn's data keeps only the part the outputs read)."""

    def __init__(self, span: Any, data: TurnData, traj: "_TrajectoryScope", prompt: Any, messages: Any) -> None:
        super().__init__(span, data, traj.data, traj.sample_attributes, traj.weight_versions, traj.clock)
        self._traj = traj
        self._prompt = prompt
        self._messages = messages  # (list, count) or None

    def _ending(self, error: Optional[BaseException]) -> None:
        super()._ending(error)
        try:  # also for a call that raised: what was sent is what one looks at then
            messages = self._input_json()
            if messages is not None:
                self.span.set_attribute(sc.GEN_AI_INPUT_MESSAGES, messages)
        except Exception as exc:
            health.record_failure("events.capture_content", exc)

    def _input_json(self) -> Optional[str]:
        if self._messages is not None:
            messages, count = self._messages
            return chat_messages_json(messages[:count])
        decode = self._traj.decode
        if decode is None:  # a worker without a tokenizer: no text to show
            return None
        count = self.data.prompt_token_count
        prompt_ids = self._prompt[:count] if count is not None else self._prompt
        return text_message_json("user", decode(prompt_ids, skip_special_tokens=False))

    def _capture_content(self, data: TurnData) -> None:
        decode = self._traj.decode
        if decode is None:
            return
        try:
            completion = decode(token_list(data.completion_ids), skip_special_tokens=False)
        except Exception as exc:
            health.record_failure("events.capture_content", exc)
            return
        output = text_message_json("assistant", completion, data.finish_reason)
        self.span.set_attribute(sc.GEN_AI_OUTPUT_MESSAGES, output)
        self._traj.last_output = output


_UNTRACED_TURN = contextlib.nullcontext(Turn(None, None))


def llm_call(
    prompt_ids: Sequence[int],
    *,
    model: Optional[str] = None,
    provider: str = "verl",
    operation: str = sc.OP_CHAT,
    request_id: Optional[str] = None,
    max_tokens: Optional[int] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    resumes: bool = False,
) -> ContextManager[Turn]:
    """One generate call of the current trajectory (GenAI ``chat``/``text_completion``).

    ``resumes``: the caller completes an interrupted request by making more generate
    calls inside this one (verl's ``FullyAsyncLLMServerClient``); each of them is an
    :class:`Attempt` of this turn: one turn, one span and one turn of the trajectory's
    data however often it was resumed."""
    outer = _core.current(_TURN_KEY)
    if isinstance(outer, Turn) and outer.resumes and outer.span is not None:
        try:
            return outer.attempt(prompt_ids, request_id)
        except Exception as exc:
            health.record_failure("events.llm_attempt", exc)
            return _UNTRACED_TURN
    traj = _active_traj()
    if traj is None:
        return _UNTRACED_TURN
    try:
        turns = traj.data.turns
        data = TurnData(kept_prompt(prompt_ids, turns[-1] if turns else None), traj.clock.now(), len(prompt_ids))
        operation, model = _text(operation), _text(model) if model else None
        attrs: Dict[str, Any] = {
            sc.GEN_AI_OPERATION_NAME: operation,
            sc.GEN_AI_PROVIDER_NAME: _text(provider),
            sc.GEN_AI_CONVERSATION_ID: traj.conversation_id,
            sc.GEN_AI_USAGE_INPUT_TOKENS: data.prompt_token_count,
            **traj.sample_attributes,
            sc.AGENT_LOOP_CLASS: traj.agent_loop_class or "AgentLoop",
        }
        if model:
            attrs[sc.GEN_AI_REQUEST_MODEL] = model
        if request_id:
            attrs[sc.LLM_REQUEST_ID] = _text(request_id)
        if max_tokens is not None:
            attrs[sc.GEN_AI_REQUEST_MAX_TOKENS] = int(max_tokens)
        if temperature is not None:
            attrs[sc.GEN_AI_REQUEST_TEMPERATURE] = float(temperature)
        if top_p is not None:
            attrs[sc.GEN_AI_REQUEST_TOP_P] = float(top_p)
    except Exception as exc:  # malformed arguments: the call runs untraced
        health.record_failure("events.llm_call", exc)
        return _UNTRACED_TURN
    span = _start(sc.llm_span_name(operation, model), Subject.LLM_CALL, None, attrs, kind=SpanKind.CLIENT, data=data)
    if span is None:
        return _UNTRACED_TURN
    turns.append(data)
    if _capturing_content():
        messages, traj.next_messages = traj.next_messages, None  # for this call only
        turn: Turn = _CapturingTurn(span, data, traj, prompt_ids, messages)
    else:
        turn = Turn(span, data, traj.data, traj.sample_attributes, traj.weight_versions, traj.clock)
    turn.resumes = resumes
    return turn


@health.guarded(default=None)
def chat_messages(messages: Any) -> None:
    """The chat messages (OpenAI-style dicts: ``role``, ``content``, ``tool_calls``,
    ``tool_call_id``) the current trajectory's next LLM call sends, for its
    ``gen_ai.input.messages``. Only read while content capture is on; the list may be the
    agent loop's own (its length now is what the call sends). The first list a
    trajectory gets is its conversation's start (the trajectory span's input); a later
    list that grows from it gives the trajectory span's output."""
    if messages is None or not _capturing_content():
        return
    traj = _active_traj()
    if traj is None:
        return
    if isinstance(messages, (str, dict)):  # a custom loop's plain prompt or single message
        messages = [messages if isinstance(messages, dict) else {"role": "user", "content": messages}]
    entry = (messages, len(messages))
    traj.next_messages = entry
    if traj.first_messages is None:
        traj.first_messages = entry
    else:
        traj.live_messages = messages


def _forget_turn(traj_data: TrajectoryData, turn_data: TurnData) -> None:
    turns = traj_data.turns
    for i in range(len(turns) - 1, -1, -1):
        if turns[i] is turn_data:  # identity: TurnData compares by value
            del turns[i]
            return


@health.guarded(default=None)
def observation(texts: Sequence[str]) -> None:
    """Tool/environment messages added after the current trajectory's last turn."""
    traj = _active_traj()
    if traj is None or not traj.data.turns or not texts:
        return
    last = traj.data.turns[-1]
    last.observation_text = "\n".join(texts)
    last.observation_start_ts = last.end_ts or None
    last.observation_end_ts = traj.clock.now()


class ToolCall(SpanScope):
    """What :func:`tool_call` yields (the ``with`` block of the tool's span): the caller
    reports the tool's result through it."""

    def value(self) -> "ToolCall":
        return self

    @health.guarded(default=None)
    def result(self, value: Any) -> None:
        """The tool's result (its text): on the span only while content capture is on."""
        if self.span is not None and value is not None and _capturing_content():
            self.span.set_attribute(sc.GEN_AI_TOOL_CALL_RESULT, _content(value))


_UNTRACED_TOOL = contextlib.nullcontext(ToolCall(None))


def tool_call(
    name: str, *, call_id: Optional[str] = None, tool_type: str = "function", arguments: Any = None
) -> ContextManager[ToolCall]:
    """One tool execution of the current trajectory (GenAI ``execute_tool``).

    ``arguments`` (the model's argument text) and the result given to
    :meth:`ToolCall.result` go on the span only when content capture is switched on
    (``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``)."""
    traj = _active_traj()
    if traj is None:
        return _UNTRACED_TOOL
    try:
        name = _text(name)
        attrs = {
            sc.GEN_AI_OPERATION_NAME: sc.OP_EXECUTE_TOOL,
            sc.GEN_AI_TOOL_NAME: name,
            sc.GEN_AI_TOOL_TYPE: _text(tool_type),
            **traj.sample_attributes,
        }
        if call_id:
            attrs[sc.GEN_AI_TOOL_CALL_ID] = _text(call_id)
        if arguments is not None and _capturing_content():
            attrs[sc.GEN_AI_TOOL_CALL_ARGUMENTS] = _content(arguments)
    except Exception as exc:
        health.record_failure("events.tool_call", exc)
        return _UNTRACED_TOOL
    return ToolCall(_start(sc.tool_span_name(name), Subject.TOOL, None, attrs))


class RewardHandle(SpanScope):
    """What :func:`reward` yields (the ``with`` block of the reward span): the caller
    reports the score through it."""

    def __init__(self, span: Any, traj: Optional[_TrajectoryScope]) -> None:
        super().__init__(span)
        self.traj = traj
        self.scored: Optional[float] = None  # the score reported

    def value(self) -> "RewardHandle":
        return self

    @health.guarded(default=None)
    def score(self, value: Any, *, label: Optional[str] = None) -> None:
        """The trajectory's score; ``label``: the reward's verdict in words, where it gives one."""
        if self.traj is None:
            return
        score = self.scored = self.traj.data.reward_score = float(value)
        if self.span is not None:
            self.span.set_attribute(sc.REWARD_SCORE, score)
            _evaluation_result(self.traj, score, label)

    @health.guarded(default=None)
    def carrier(self) -> Optional[carriers.TraceCarrier]:
        """This reward span's context for the reward actor that computes the score, with
        the trajectory's identity for the actor's span (``None`` when not traced)."""
        if self.span is None or self.traj is None:
            return None
        return carriers.TraceCarrier.from_span(self.span, dict(self.traj.sample_attributes))

    def _ended(self, error: Optional[BaseException]) -> None:
        # with or without its span (none when no output reads it)
        if self.scored is not None:
            ended_ns = getattr(self.span, "end_time", None) or self.traj.clock.now_ns()
            self.traj.data.reward_scored = (ended_ns, self.scored)


_NO_REWARD = contextlib.nullcontext(RewardHandle(None, None))  # outside a traced trajectory


def reward() -> ContextManager[RewardHandle]:
    """Reward computation for the current trajectory, inside the rollout worker."""
    traj = _active_traj()
    if traj is None:
        return _NO_REWARD
    # (no payload data: when it scored and the score go with the trajectory's data)
    span = _start(sc.SPAN_REWARD, Subject.REWARD, None, dict(traj.sample_attributes), skippable=True)
    return RewardHandle(span, traj)


def current_trajectory() -> Optional[TrajectoryData]:
    traj = _active_traj()
    return traj.data if traj is not None else None


def current_turn() -> "Turn | Attempt | None":
    return _core.current(_TURN_KEY)
