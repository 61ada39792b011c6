"""In-process data that rides on a span without being exported over OTLP.

Legacy outputs need more than a span's attributes: the id arrays of a batch stage, the
texts and token ids of a trajectory's turns. Putting those on OTLP spans would be costly
(16k ids per stage) and, for message content, a privacy leak (GenAI content capture is
opt-in). The events API attaches a :class:`SpanRecord` to each span it starts; span
processors in the same process read it; OTLP exporters never see it.
"""

from __future__ import annotations

import collections.abc
import contextvars
import weakref
from array import array
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple

from opentelemetry.trace import SpanKind

from otel_verl import lean_span
from otel_verl.semconv import Kind

_ATTR = lean_span.RECORD_ATTR
_new = object.__new__
IDS_TYPECODE = "I"  # C unsigned int: every tokenizer's ids fit
NO_SERVER_META: Mapping[str, float] = MappingProxyType({})  # a turn's until the server reports


@dataclass
class TurnData:
    """One LLM generate call of a trajectory, as the JSONL exporter needs it."""

    prompt_ids: Sequence[int]  # the events API keeps an array or a PromptTail (see kept_prompt)
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

    # A turn's data is its LLM span's record (see start_span): one object less a turn for
    # the cyclic GC to count, as long as the span waits to be sent.
    kind: ClassVar[Kind] = Kind.LLM_CALL

    @property
    def data(self) -> "TurnData":
        return self

    @classmethod
    def started(cls, prompt_ids: Sequence[int], start_ts: float, prompt_token_count: int) -> "TurnData":
        """A call's data as it starts; the other fields keep their defaults (the class's).
        (The generated ``__init__`` takes its eleven keyword arguments at several times
        the cost, once per LLM turn.)"""
        turn = _new(cls)
        turn.prompt_ids, turn.start_ts, turn.prompt_token_count = prompt_ids, start_ts, prompt_token_count
        turn.server_meta = NO_SERVER_META
        return turn


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


# --------------------------------------------------------------------------- token ids as kept



def kept_ids(ids: Any) -> Sequence[int]:
    """Token ids as a record keeps them until its trajectory ends: an unsigned-int array.

    The agent loop's list would stay alive with the record, and every young collection
    of the cyclic GC walks a live list id by id (hundreds of them a turn, a trajectory's
    turns at a time); an array holds no objects to visit, and pickles as one copy. Ids
    that are no such ints stay a list."""
    if type(ids) is array and ids.typecode == IDS_TYPECODE:
        return ids
    try:
        if type(ids) is list:  # (fromlist: a fifth cheaper than the constructor's sequence protocol)
            kept = array(IDS_TYPECODE)
            kept.fromlist(ids)
            return kept
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
    JSONL's ``template_overhead_text`` slice starts there, and reads no earlier one).
    Whole prompts would hold the trajectory's turns squared in ids. The previous turn
    counts only once it has returned (a custom loop may have calls overlap): before,
    its completion's end is unknown and the whole prompt is kept."""
    start = 0
    if previous is not None and previous.end_ts:
        start = min(prompt_tokens(previous) + completion_tokens(previous), len(prompt_ids))
    if not start:  # the whole prompt: its ids as they are kept (no PromptTail to count)
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

    kind: ClassVar[Kind] = Kind.TRAJECTORY  # the trajectory span's record (as TurnData's)

    @property
    def data(self) -> "TrajectoryData":
        return self

    @classmethod
    def started(cls, uid: str, traj_uid: str, global_step: int, n_samples: Optional[int], agent_name: str,
                created_at: float, trainer_api: str, decode: Optional[Callable[..., str]],
                encode: Optional[Callable[..., List[int]]]) -> "TrajectoryData":
        """A trajectory's data as it starts (see :meth:`TurnData.started`)."""
        traj = _new(cls)
        traj.uid, traj.traj_uid, traj.global_step, traj.n_samples = uid, traj_uid, global_step, n_samples
        traj.agent_name, traj.created_at, traj.trainer_api = agent_name, created_at, trainer_api
        traj.decode, traj.encode = decode, encode
        traj.turns, traj.agent_metrics = [], {}
        return traj


@dataclass
class RolloutData:
    """The trajectories of one uid as dispatched to the agent loop workers (batch order)."""

    traj_uids: List[str]
    worker_indices: List[int]
    variant: str = "v0"


@dataclass
class SpanRecord:
    kind: Kind
    data: Any = None


# The record of the span being started by :func:`start_span` (name, record): the SDK
# runs the processors' on_start inside ``tracer.start_span``, before the caller could
# attach anything to the span it returns.
_starting: contextvars.ContextVar[Optional[Tuple[str, SpanRecord]]] = contextvars.ContextVar(
    "otel_verl_starting_record", default=None
)


def record_for(record_kind: Kind, data: Any = None) -> Any:
    """The record a span of ``record_kind`` carries: a turn's or a trajectory's data is
    its own span's record; a kind's spans without data share one record (no
    :class:`SpanRecord` per span)."""
    if data is None:
        return _DATALESS[record_kind]
    if type(data) in OWN_RECORD_TYPES and data.kind is record_kind:
        return data
    return SpanRecord(record_kind, data)


def start_span(tracer: Any, name: str, record_kind: Kind, data: Any = None, *, lean: Any = None,
               context: Any = None, kind: SpanKind = SpanKind.INTERNAL, attributes: Optional[Dict[str, Any]] = None,
               links: Sequence[Any] = (), **more: Any) -> Any:
    """``tracer.start_span(name, ...)`` with the record (:func:`record_for`) readable from
    on_start on: a :class:`~otel_verl.lean_span.LeanSpan` where the tracer allows it
    (``lean``: the tracer's :func:`~otel_verl.lean_span.starter` or ``False``, when the
    caller has it)."""
    return start_recorded(tracer, name, record_for(record_kind, data), lean=lean, context=context, kind=kind,
                          attributes=attributes, links=links, **more)


def start_recorded(tracer: Any, name: str, record: Any, *, lean: Any = None, context: Any = None,
                   kind: SpanKind = SpanKind.INTERNAL, attributes: Optional[Dict[str, Any]] = None,
                   links: Sequence[Any] = (), **more: Any) -> Any:
    """:func:`start_span` for a record the caller made (:func:`record_for`)."""
    if lean is None:
        lean = lean_span.starter(tracer)
    if lean and not more:  # (a start time and the like: the tracer's own span)
        return lean.start(name, record, context, kind, attributes, links)
    token = _starting.set((name, record))
    try:
        span = tracer.start_span(name, context=context, kind=kind, attributes=attributes, links=links, **more)
    finally:
        _starting.reset(token)
    _bind(span, record)
    return span


OWN_RECORD_TYPES = frozenset((TurnData, TrajectoryData))  # data that is its own span's record
_DATALESS = {kind: SpanRecord(kind) for kind in Kind}  # (records are never changed)


def attach(span: Any, kind: Kind, data: Any = None) -> None:
    """Attach a record to an already started span (its on_start has not seen it)."""
    _bind(span, SpanRecord(kind, data))


def _bind(span: Any, record: SpanRecord) -> None:
    if getattr(span, _ATTR, None) is record:
        return
    try:
        setattr(span, _ATTR, record)
    except AttributeError:  # a non-SDK span (no-op provider): nothing to attach to
        return
    # on_end receives a fresh ReadableSpan (SDK ``Span._readable_span()``), not the span:
    # make that copy carry the record too. A weak reference avoids a span <-> closure cycle.
    make_readable = getattr(type(span), "_readable_span", None)
    if make_readable is None:
        return
    span_ref = weakref.ref(span)

    def readable_with_record() -> Any:
        readable = make_readable(span_ref())
        setattr(readable, _ATTR, record)
        return readable

    span._readable_span = readable_with_record


def record_of(span: Any) -> Optional[SpanRecord]:
    record = getattr(span, _ATTR, None)
    if record is None:
        starting = _starting.get()
        if starting is not None and getattr(span, "name", None) == starting[0]:
            record = starting[1]  # on_start of the span start_span() is starting
    return record
