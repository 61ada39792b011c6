"""The trace model: every span name, attribute key and span kind otel_verl emits.

This module is the single owner of the names listed in ``docs/SPANS.md``; wrappers,
the events API and the exporters import the constants from here instead of spelling
strings themselves. GenAI keys follow the OpenTelemetry GenAI semantic conventions
(status: Development); RL-specific keys live under ``verl.*``.
"""

from __future__ import annotations

import enum
import functools

INSTRUMENTATION_NAME = "otel_verl"

# --------------------------------------------------------------------------- resource
SERVICE_NAME = "service.name"
SERVICE_NAMESPACE = "service.namespace"
SERVICE_INSTANCE_ID = "service.instance.id"
RUN_ID = "verl.run_id"
ROLE = "verl.role"
HOST_NAME = "host.name"
PROCESS_PID = "process.pid"
RAY_NODE_ID = "ray.node_id"
RAY_ACTOR_ID = "ray.actor_id"
RAY_JOB_ID = "ray.job_id"


class Role(str, enum.Enum):
    """Value of the ``verl.role`` resource attribute: what a process does in the job."""

    TRAINER = "trainer"
    AGENT_LOOP_WORKER = "agent_loop_worker"
    LLM_SERVER = "llm_server"
    REWARD_WORKER = "reward_worker"
    DRIVER = "driver"
    WORKER = "worker"


# ``service.namespace`` of every otel_verl process; ``service.name`` says which kind of
# process it is, so that Jaeger, Tempo and Grafana list each role as its own service.
SERVICE_NAMESPACE_VERL = "verl"
ROLE_SERVICE_NAMES = {
    Role.TRAINER: "verl-trainer",
    Role.AGENT_LOOP_WORKER: "verl-rollout-worker",
    Role.LLM_SERVER: "verl-llm-server",
    Role.REWARD_WORKER: "verl-reward-worker",
    Role.DRIVER: "verl-driver",
    Role.WORKER: "verl-worker",
}


def service_name(role: "Role | str") -> str:
    """The default ``service.name`` of a process of ``role``; a role of the user's own
    (``OTEL_VERL_ROLE``) becomes ``verl-<role>``."""
    try:
        return ROLE_SERVICE_NAMES[Role(role)]
    except ValueError:
        return "verl-" + str(role).replace("_", "-")


# --------------------------------------------------------------------------- sample identity
UID = "verl.uid"
TRAJ_UID = "verl.traj_uid"
TRAJ_UIDS = "verl.traj_uids"
GLOBAL_STEP = "verl.global_step"
STAGE = "verl.stage"
VALIDATE = "verl.validate"
SESSION_ID = "verl.session_id"
WORKER_INDEX = "verl.agent_loop.worker_index"
WORKER_INDICES = "verl.agent_loop.worker_indices"
AGENT_LOOP_CLASS = "verl.agent_loop.class"
TRAINER = "verl.trainer"
LAYOUT = "verl.layout"
SAMPLE_OUTCOME = "verl.sample.outcome"
STALENESS = "verl.staleness"  # sample root: weight updates between its oldest weights and the trained ones (verl's count)
TRAINED_STEP = "verl.trained_step"  # sample root: the step that trained it
# The weight version (verl's global_steps of the weights a server held) that served an engine
# request (a turn, or each attempt of a resumed one); the oldest and newest behind a resumed
# turn, a trajectory and a trained sample
WEIGHT_VERSION = "verl.weight_version"
WEIGHT_VERSION_MIN = "verl.weight_version.min"
WEIGHT_VERSION_MAX = "verl.weight_version.max"
REWARD_SCORE = "verl.reward.score"
REWARD_MANAGER = "verl.reward.manager"  # the reward actor's reward manager class
EPOCH = "verl.epoch"
CONSUMED_BATCHES = "verl.consumed_batches"
RESPONSE_TOKENS = "verl.generation.response_tokens"
FETCH_EXHAUSTED = "verl.fetch.exhausted"  # a fetch_batch stage found the epoch's data used up
TOTAL_TRAINING_STEPS = "verl.total_training_steps"
TRAIN_BATCH_SIZE = "verl.train_batch_size"
ROLLOUT_N = "verl.rollout_n"
PPO_MINI_BATCH_SIZE = "verl.ppo_mini_batch_size"
NUM_MINIBATCHES = "verl.num_minibatches"
NUM_TURNS = "verl.num_turns"
LLM_REQUEST_ID = "verl.llm.request_id"
LLM_ATTEMPT_NUMBER = "verl.llm.attempt_number"  # 1, 2, ...: which engine request of a resumed turn
LLM_ATTEMPTS = "verl.llm.attempts"  # on a resumed turn: how many engine requests it took
LLM_SERVER_ID = "verl.llm.server_id"
LLM_SERVER_META_PREFIX = "verl.llm.server."  # + a numeric sglang/vLLM meta_info key

# --------------------------------------------------------------------------- GenAI
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_AGENT_NAME = "gen_ai.agent.name"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
GEN_AI_TOOL_TYPE = "gen_ai.tool.type"
GEN_AI_TOOL_CALL_ARGUMENTS = "gen_ai.tool.call.arguments"  # opt-in content
GEN_AI_TOOL_CALL_RESULT = "gen_ai.tool.call.result"  # opt-in content
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"  # opt-in content
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"  # opt-in content
# The reward, as the GenAI evaluation event on the trajectory it scores
GEN_AI_EVALUATION_RESULT = "gen_ai.evaluation.result"
GEN_AI_EVALUATION_NAME = "gen_ai.evaluation.name"
GEN_AI_EVALUATION_SCORE_VALUE = "gen_ai.evaluation.score.value"
GEN_AI_EVALUATION_SCORE_LABEL = "gen_ai.evaluation.score.label"
REWARD_EVALUATION_NAME = "verl.reward"  # its gen_ai.evaluation.name
ERROR_TYPE = "error.type"

# --------------------------------------------------------------------------- bounds
# Free text that reaches span attributes and names (agent, agent loop class, tool and model
# names, call/request ids, stop reasons, outcome details, server meta keys) is cut to this
# many characters; ids are cut the same in ``otel_verl.ids``.
MAX_TEXT_CHARS = 256
# Opt-in message content (OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT): each message
# text and tool-argument string is cut to this many characters before JSON encoding.
MAX_CONTENT_CHARS = 8192
# One span's whole message list (a conversation repeats on every turn): its newest messages
# that fit in this many characters of JSON are kept.
MAX_MESSAGES_CHARS = 65536

OP_CHAT = "chat"
OP_TEXT_COMPLETION = "text_completion"
OP_INVOKE_AGENT = "invoke_agent"
OP_EXECUTE_TOOL = "execute_tool"


class Subject(enum.Enum):
    """What a span stands for in the model, in its payload (``otel_verl.payload``):
    processors dispatch on it instead of parsing span names."""

    FIT = "fit"  # trainer: instant span at the start of fit, carries the run shape
    STEP = "step"  # trainer: root of a step trace
    STEP_STAGE = "step_stage"  # trainer: one stage of a step (generation, update actor, ...)
    SAMPLE = "sample"  # trainer: root of a sample (uid) trace
    ROLLOUT = "rollout"  # trainer: one uid's dispatch to the agent loop workers
    SAMPLE_STAGE = "sample_stage"  # trainer: one uid in one training stage, lists traj_uids
    PROMPT_TASK = "prompt_task"  # worker (v1): one prompt's task running its sessions
    TRAJECTORY = "trajectory"  # worker: one (uid, traj_uid) agent run (invoke_agent)
    LLM_CALL = "llm_call"  # worker: one generate call (chat / text_completion)
    LLM_ATTEMPT = "llm_attempt"  # worker: one engine request of a resumed LLM call
    LLM_SERVER = "llm_server"  # server actor: the server side of one generate call
    TOOL = "tool"  # worker: one tool execution (execute_tool)
    REWARD = "reward"  # worker: reward computation of one trajectory
    REWARD_WORKER = "reward_worker"  # reward actor: its side of one trajectory's reward computation


# --------------------------------------------------------------------------- span names
SPAN_FIT = "verl.fit"
SPAN_STEP = "verl.step"
SPAN_SAMPLE = "verl.sample"
SPAN_ROLLOUT = "verl.rollout"
SPAN_PROMPT_TASK = "verl.prompt_task"
SPAN_LLM_SERVER = "verl.llm_server.generate"
SPAN_LLM_ATTEMPT = "verl.llm.attempt"
SPAN_REWARD = "verl.reward"
SPAN_REWARD_WORKER = "verl.reward_worker.compute_score"


def step_stage_span_name(stage: str) -> str:
    return f"verl.stage {stage}"


def sample_stage_span_name(stage: str) -> str:
    return f"verl.sample_stage {stage}"


def agent_span_name(agent_name: str | None) -> str:
    return f"{OP_INVOKE_AGENT} {agent_name}" if agent_name else OP_INVOKE_AGENT


def llm_span_name(operation: str, model: str | None) -> str:
    return f"{operation} {model}" if model else operation


def tool_span_name(tool_name: str) -> str:
    return f"{OP_EXECUTE_TOOL} {tool_name}"


@functools.lru_cache(maxsize=256)
def llm_server_meta_attribute(meta_key: str) -> str:
    """``verl.llm.server.{key}`` for a numeric sglang/vLLM ``meta_info`` key, bounded.
    Cached: an engine reports the same handful of keys for every request."""
    key = str(meta_key)
    return LLM_SERVER_META_PREFIX + key[:MAX_TEXT_CHARS]


class Stage(str, enum.Enum):
    """``verl.stage``: a training-step stage. Step stages group a whole batch; the
    per-uid sample-stage spans of the batch stages reuse the same value."""

    FETCH_BATCH = "fetch_batch"  # disaggregated: wait for a batch from the replay queue
    GENERATION = "generation"
    REWARD = "reward"
    OLD_LOG_PROB = "old_log_prob"
    REF_LOG_PROB = "ref_log_prob"
    VALUES = "values"
    ADVANTAGE = "adv"
    UPDATE_CRITIC = "update_critic"
    UPDATE_ACTOR = "update_actor"
    SAVE_CHECKPOINT = "save_checkpoint"
    EVAL = "eval"
    RECORD_METRICS = "record_metrics"
    SYNC_PARAMS = "sync_params"
    SAMPLE = "sample"  # v1: trajectories taken from the replay buffer
    FILTER = "filter"  # trajectories dropped by a filter / eviction


class Outcome(str, enum.Enum):
    """``verl.sample.outcome``: how a sample's root span ended."""

    TRAINED = "trained"
    FILTERED = "filtered"
    EVICTED = "evicted"
    DROPPED = "dropped"
    CLEARED = "cleared_untrained"  # v1: its trajectories were cleared without an actor update
    NOT_CONSUMED = "never_consumed"  # v1: still waiting for training when fit ended
    OPEN_LIMIT = "evicted_open_span_limit"
    SHUTDOWN = "unfinished_at_shutdown"


class Layout(str, enum.Enum):
    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"
