"""In-process data that rides with a span without being exported over OTLP.

Legacy outputs need more than a span's attributes: the traj_uids of a batch stage, the
texts and token ids of a trajectory's turns. Putting those on OTLP spans would be costly
(16k ids per stage) and, for message content, a privacy leak (GenAI content capture is
opt-in). The events API starts each span with a :class:`Payload` (what the span stands
for, and its data); span processors in the same process read it with :func:`payload_of`;
OTLP exporters never see it.

A span's payload is readable from the start of its ``on_start`` to the end of its
``on_end``. It rides on the span: an events-API span (``SlimSpan``) holds it and hands it
to its record (``SpanRecord.payload``), which the export process rebuilds with it. Only a
span of another provider's tracer (the SDK's own) is kept by span id while open. The
processors' ``on_start`` gets it through a context variable (a tracer calls them inside
``start_span``, before the caller holds the span). A processor that reads a payload later
(a batch writer) keeps a reference to it.
"""

from __future__ import annotations

import collections.abc
import contextvars
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from opentelemetry.trace import Span, Tracer

from otel_verl.semconv import Subject
from otel_verl.slim_span import SlimSpan

IDS_TYPECODE = "I"  # C unsigned int: every tokenizer's ids fit


class Payload(NamedTuple):
    """What a span stands for, and the data the legacy outputs read of it."""

    subject: Subject
    data: Any = None


# --------------------------------------------------------------------------- span <-> payload

# (trace id, span id) of an open span that cannot hold its payload (the SDK's) -> its payload
_open: Dict[Tuple[int, int], Payload] = {}
_starting: contextvars.ContextVar[Optional[Payload]] = contextvars.ContextVar("otel_verl_starting", default=None)


def start_span(tracer: Tracer, name: str, payload: Payload, **kwargs: Any) -> Span:
    """``tracer.start_span(name, **kwargs)`` whose span carries ``payload`` until it ends
    (end it with :func:`end_span`)."""
    token = _starting.set(payload)
    try:
        span = tracer.start_span(name, **kwargs)
    finally:
        _starting.reset(token)
    if type(span) is SlimSpan:
        span.payload = payload
    elif span.is_recording():
        _open[_key(span.get_span_context())] = payload
    return span


def end_span(span: Span, end_time: Optional[int] = None) -> None:
    """End a span of :func:`start_span` (its processors read the payload in ``on_end``)."""
    try:
        span.end(end_time=end_time)
    finally:
        if _open:
            _open.pop(_key(span.get_span_context()), None)


def payload_of(span: Any) -> Optional[Payload]:
    """The payload of a span that a processor gets in ``on_start`` or ``on_end``."""
    payload = getattr(span, "payload", None)  # a SpanRecord's, a SlimSpan's
    if payload is None and _open:
        payload = _open.get(_key(span.context))
    return payload if payload is not None else _starting.get()


def open_count() -> int:
    """Open spans whose payload is kept by span id (a test checks nothing is left behind)."""
    return len(_open)


def _key(context: Any) -> Tuple[int, int]:
    return context.trace_id, context.span_id


# --------------------------------------------------------------------------- rollout worker data

@dataclass
class TurnData:
    """One LLM generate call of a trajectory, as the trajectory JSONL needs it."""

    prompt_ids: Sequence[int]  # an array or a PromptTail (see kept_prompt)
    start_ts: float
    # len(prompt_ids) when the call started: agent loops extend their prompt list in
    # place after each turn (ToolAgentLoop: ``prompt_ids += response_ids``).
    prompt_token_count: Optional[int] = None
    end_ts: float = 0.0
    completion_ids: Sequence[int] = ()
    completion_token_count: Optional[int] = None  # the server's count when it gave one
    finish_reason: str = ""
    server_meta: Mapping[str, float] = field(default_factory=dict)  # sglang/vLLM timing keys
    observation_text: Optional[str] = None
    observation_start_ts: Optional[float] = None
    observation_end_ts: Optional[float] = None


def prompt_tokens(turn: TurnData) -> int:
    """The turn's prompt length as the outputs count it (at the call, else the ids')."""
    count = turn.prompt_token_count
    return count if count is not None else _length(turn.prompt_ids)


def completion_tokens(turn: TurnData) -> int:
    """The turn's completion length as the outputs count it (the server's, else the ids')."""
    count = turn.completion_token_count
    return count if count is not None else _length(turn.completion_ids)


def _length(ids: Any) -> int:
    return len(ids) if ids is not None else 0  # not `ids or ()`: ids may be a numpy array


def kept_ids(ids: Any) -> Sequence[int]:
    """Token ids as a turn keeps them until its trajectory ends: an unsigned-int array.

    A live list of ints is walked id by id at every young collection of the cyclic GC;
    an array holds no objects to visit, and pickles as one copy. Ids that are no such
    ints stay a list."""
    if type(ids) is array and ids.typecode == IDS_TYPECODE:
        return ids
    try:
        return array(IDS_TYPECODE, ids)
    except (TypeError, ValueError, OverflowError):
        return list(ids)


def token_list(ids: Any) -> Any:
    """Kept ids as a tokenizer's ``decode`` takes them (a list; other sequences as they are)."""
    if type(ids) is PromptTail:
        ids = ids[:]  # UnsentTokens unless it was kept whole
    return ids.tolist() if type(ids) is array else ids


def kept_prompt(prompt_ids: Sequence[int], previous: Optional[TurnData]) -> Sequence[int]:
    """What the outputs read of a turn's prompt, taken at the call: all of the first
    turn's; of a later one the ids after the previous turn's completion (the trajectory
    JSONL's ``template_overhead_text`` starts there). Whole prompts would hold a
    trajectory's turns squared in ids. The previous turn counts only once it has
    returned (a custom loop may have calls overlap)."""
    start = 0
    if previous is not None and previous.end_ts:
        start = min(prompt_tokens(previous) + completion_tokens(previous), len(prompt_ids))
    if not start:
        return kept_ids(prompt_ids)
    return PromptTail(start, kept_ids(prompt_ids[start:]))


class UnsentTokens(LookupError):
    """Prompt ids that were not kept (no output reads them)."""


class PromptTail(collections.abc.Sequence):
    """A turn's prompt of which only the ids from ``start`` on were kept: as long as the
    prompt was; reading an id before ``start`` raises :class:`UnsentTokens` (not
    IndexError, which would end an iteration as if the prompt were empty)."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: Sequence[int]) -> None:
        self.start, self.tokens = start, tokens

    def __len__(self) -> int:
        return self.start + len(self.tokens)

    def __getitem__(self, index: Any) -> Any:
        start = self.start
        if isinstance(index, slice):
            begin, stop, step = index.indices(len(self))
            if begin < start and begin < stop or step != 1:
                raise UnsentTokens(f"prompt ids [{begin}:{stop}:{step}] (only [{start}:] were kept)")
            return self.tokens[begin - start:stop - start]
        position = index + len(self) if index < 0 else index
        if position < 0 or position >= len(self):
            raise IndexError("prompt index out of range")
        if position < start:
            raise UnsentTokens(f"prompt id {index} (only [{start}:] were kept)")
        return self.tokens[position - start]

    def __repr__(self) -> str:
        return f"PromptTail(start={self.start}, tokens={self.tokens!r})"


@dataclass
class TrajectoryData:
    """Everything the rollout worker knows about one (uid, traj_uid) run."""

    uid: str
    traj_uid: str
    global_step: int
    n_samples: Optional[int]
    agent_name: str
    created_at: float
    trainer_api: str = "v0"  # "v0" (AgentLoopWorker) or "v1" (AgentLoopWorkerTQ)
    completed_at: float = 0.0
    turns: List[TurnData] = field(default_factory=list)
    agent_metrics: Dict[str, Any] = field(default_factory=dict)
    reward_score: Optional[float] = None
    # The agent loop's run() (no span of its own: attributes on the trajectory span):
    # its class, and when it returned (ns; 0: it did not return, or never ran).
    agent_loop_class: Optional[str] = None
    run_completed_ns: int = 0
    # (end ns, score) of a reward span that ended scored: the CSV writes its row with the
    # trajectory's end, after agent_run_completed (the order of the seed's rows).
    reward_row: Optional[Tuple[int, float]] = None
    # tokenizer.decode / tokenizer.encode of the worker; the JSONL exporter decodes texts
    # off the event loop, so only references are kept here.
    decode: Optional[Callable[..., str]] = None
    encode: Optional[Callable[..., List[int]]] = None

    def approx_bytes(self) -> int:
        """About the memory its turns hold (kept token ids, texts), for the bounded queues
        it waits in."""
        size = 512
        for turn in self.turns:
            size += 256 + ID_BYTES * (_held(turn.prompt_ids) + _held(turn.completion_ids))
            if turn.observation_text:
                size += len(turn.observation_text)
        return size


ID_BYTES = 8  # a kept id: 4 in an array, more in a list


def _held(ids: Any) -> int:
    if type(ids) is PromptTail:
        ids = ids.tokens
    return len(ids) if ids is not None else 0


@dataclass
class RolloutData:
    """The trajectories of one uid as dispatched to the agent loop workers (batch order)."""

    traj_uids: List[str]
    worker_indices: List[int]
    variant: str = "v0"
