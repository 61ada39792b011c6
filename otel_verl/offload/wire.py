"""What goes between a traced process and its export process: frames and span snapshots.

A frame is a 4-byte big-endian length and a pickle of one message (both ends are the
same otel_verl in the same Python environment). Messages, as tuples:

- ``("config", HostConfig)``: first, once;
- ``("codec", codec_id, pickled (decode, encode))``: a tokenizer's functions, once each,
  before the first trajectory that names them (:func:`dumps_codec`);
- ``("forget_codec", codec_id)``: no later trajectory names it (the sender keeps a few);
- ``("spans", [snapshot, ...])``: span starts and ends, in the order they happened. A
  span whose start went over ends with what changed only (``END_OF`` the start's serial
  number): its name, ids, parent, kind, start time and scope are the start's; a start
  names a parent whose start went over (still open) by that serial number, and then its
  own context by its span id when the rest (trace id, flags, state) is the parent's;
- ``("flush", seq)``: answered on the reply pipe with ``(seq, health counters)`` once
  everything sent before it has been written and exported.

A snapshot holds plain values only (tuples, dicts, lists, bytes, str, int, float), so pickling
never runs Python code that could let the agent loop's thread change a value half-way. A
start holds its span's own attribute dict, not a copy: it goes as it is when its batch is
pickled (set meanwhile, an attribute shows at the start too; the end has them all anyway).

Record data that belongs to a trajectory still running (an LLM call's ``TurnData``, the
reward span's ``TrajectoryData``) is not sent with those spans: no output reads it there,
and the trajectory's own end carries all of it, complete. A trajectory's start carries
its identity only (uid, traj_uid, step, agent, trainer API, n).
"""

from __future__ import annotations

import pickle
import struct
from array import array
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Sequence, Tuple

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from otel_verl.lean_span import RECORD_ATTR
from otel_verl.record import (IDS_TYPECODE, OWN_RECORD_TYPES, PromptTail, SpanRecord, TrajectoryData, TurnData, completion_tokens, kept_ids,
                              prompt_tokens)
from otel_verl.semconv import Kind

START, END, END_OF = 0, 1, 2  # END_OF: the end of a span whose START carried a serial number
MAX_OPEN = 1 << 16  # started spans a Snapshotter remembers until they end
# How a span's record data travels: as it is, a trajectory's identity, a whole trajectory.
_AS_IS, _IDENTITY, _TRAJECTORY = 0, 1, 2
_HEADER = struct.Struct(">I")
PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
UNSENDABLE_CODEC = -1  # a tokenizer whose functions could not be pickled
# (enum members read once: off their class, each read is a Python __getattr__ call)
_TRAJECTORY_KIND, _UNSET_CODE = Kind.TRAJECTORY, StatusCode.UNSET


@dataclass(frozen=True)
class HostConfig:
    """What the export process needs to write the outputs of the process it serves."""

    settings: Any  # otel_verl.settings.Settings
    resource_attributes: Dict[str, Any]
    resource_schema_url: str
    pid: int  # the served process: files are named after it


# --------------------------------------------------------------------------- frames


def frame(message: Any) -> bytes:
    """One message as the bytes of its frame (header and pickle)."""
    body = pickle.dumps(message, PICKLE_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def write_frame(out: BinaryIO, message: Any) -> int:
    data = frame(message)
    out.write(data)
    out.flush()
    return len(data) - _HEADER.size


def read_frame(source: BinaryIO) -> Any:
    """The next message, or ``None`` at the end of the stream."""
    header = _read_exactly(source, _HEADER.size)
    if header is None:
        return None
    body = _read_exactly(source, _HEADER.unpack(header)[0])
    if body is None:
        return None
    return pickle.loads(body)


def _read_exactly(source: BinaryIO, size: int) -> Optional[bytes]:
    chunks, left = [], size
    while left:
        chunk = source.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def dumps_codec(codec: Tuple[Any, Any]) -> bytes:
    """A tokenizer's (decode, encode) pickled with cloudpickle, which takes what an agent
    loop may hand over besides a tokenizer's bound methods: a lambda, a closure, a
    function of the job's ``__main__`` (the export process has none of those by name)."""
    try:
        import cloudpickle
    except ImportError:  # plain pickle takes a tokenizer's bound methods
        return pickle.dumps(codec, PICKLE_PROTOCOL)
    return cloudpickle.dumps(codec, PICKLE_PROTOCOL)


# --------------------------------------------------------------------------- snapshots (sender)


class Snapshotter:
    """Turns started / ended spans into plain tuples; ``codec_id`` names a trajectory's
    (decode, encode) pair (the sender ships each pair once).

    Runs on the sender thread, a trajectory's spans at a time: it reads the SDK's span
    fields directly (``ReadableSpan``'s private attributes, which every SDK span and
    :class:`~otel_verl.lean_span.LeanSpan` have) rather than through a dozen properties
    and enum descriptors per span."""

    def __init__(self, codec_id: Callable[[Any, Any], int], max_open: int = MAX_OPEN) -> None:
        self._codec_id = codec_id
        self._scopes: Dict[int, tuple] = {}  # id(scope) -> (scope, its tuple): one tuple object, pickled once a batch
        # id(context) -> (context, serial) of the spans whose START went out and END not yet
        # (by SpanContext: an SDK span ends as a copy sharing it). The context is held, so
        # its id is not reused meanwhile. Bounded: beyond ``max_open`` (spans that never
        # end) a start gets no serial and its end goes whole.
        self._open: Dict[int, Tuple[Any, int]] = {}
        self._max_open = max_open
        self._serial = 0

    def start(self, span: Any) -> tuple:
        record = getattr(span, RECORD_ATTR, None)
        sent = None
        if record is not None:
            # (a turn's and a trajectory's data are their spans' records: no property call)
            data = record if type(record) in OWN_RECORD_TYPES else record.data
            if type(data) is TrajectoryData:
                sent = (record.kind._value_, _IDENTITY, _identity(data))
            else:
                sent = _record_as_is(record.kind, data)
        opened, context, parent = self._open, span._context, span._parent
        # a parent that is a started span here (a chat span's trajectory): named by its
        # serial, and the span's context by its span id where the rest is the parent's
        parent_open = opened.get(id(parent)) if parent is not None else None
        if parent_open is not None and parent_open[0] is parent:
            parent_sent = parent_open[1]
            # (SpanContext is a tuple: trace_id, span_id, is_remote, trace_flags, trace_state, is_valid)
            same = context[0] == parent[0] and context[3] == parent[3] and context[4] is parent[4] and not context[2]
            context_sent = context[1] if same else _context(context)
        else:
            parent_sent, context_sent = _context(parent), _context(context)
        if len(opened) < self._max_open:
            serial = self._serial = self._serial + 1
            opened[id(context)] = (context, serial)
        else:
            serial = None
        # The attributes as they are when the batch is pickled (on this thread, in one C
        # call): a copy per start would be one more object a span for the cyclic GC to count.
        attributes = span._attributes
        return (START, span._name, context_sent, parent_sent, span._kind._value_, span._start_time,
                attributes if type(attributes) is dict else dict(attributes), self._scope(span._instrumentation_scope),
                sent, serial)

    def end(self, span: Any) -> tuple:
        context = span._context
        opened = self._open.pop(id(context), None)
        record = getattr(span, RECORD_ATTR, None)
        sent = None
        if record is not None:
            kind, data = record.kind, record if type(record) in OWN_RECORD_TYPES else record.data
            if type(data) is TrajectoryData:
                sent = (kind._value_, _TRAJECTORY, self._trajectory(data)) if kind is _TRAJECTORY_KIND else (kind._value_, _AS_IS, None)
            else:
                sent = _record_as_is(kind, data)
        attributes, events, links, status = span._attributes, span._events, span._links, span._status
        dropped = None
        if type(attributes) is not dict or events or links:
            dropped = (span.dropped_attributes, span.dropped_events, span.dropped_links)
            attributes = dict(attributes)
        events = [(e.name, dict(e.attributes or {}), e.timestamp) for e in events] if events else None
        links = [(_context(link.context), dict(link.attributes or {})) for link in links] if links else None
        status = None if status._status_code is _UNSET_CODE else (status._status_code._value_, status._description)
        if opened is not None and opened[0] is context:
            return (END_OF, opened[1], attributes, sent, span._end_time, events, links, status, dropped)
        return (END, span._name, _context(span._context), _context(span._parent), span._kind._value_, span._start_time,
                attributes, self._scope(span._instrumentation_scope), sent, span._end_time, events, links, status, dropped)

    def _scope(self, scope: Any) -> Optional[tuple]:
        if scope is None:
            return None
        cached = self._scopes.get(id(scope))
        if cached is None or cached[0] is not scope:
            cached = self._scopes[id(scope)] = (scope, (scope.name, scope.version, scope.schema_url))
        return cached[1]

    def _trajectory(self, data: TrajectoryData) -> tuple:
        recorded = list(data.turns)
        turns = [
            (prompt, t.start_ts, t.prompt_token_count, t.end_ts, _packed_ids(t.completion_ids),
             t.completion_token_count, t.finish_reason, dict(t.server_meta), t.observation_text,
             t.observation_start_ts, t.observation_end_ts)
            for t, prompt in zip(recorded, _prompts_read(recorded))
        ]
        codec = self._codec_id(data.decode, data.encode) if (data.decode or data.encode) is not None else None
        return (_identity(data), data.completed_at, turns, dict(data.agent_metrics), data.reward_score,
                data.agent_loop_class, data.run_completed_ns, data.reward_row, codec)


def _record_as_is(kind: Kind, data: Any) -> tuple:
    """A record that travels as it is; a turn's data goes with its trajectory (and a
    trainer-side record is complete when its span ends)."""
    if data is None or type(data) is TurnData:
        return _DATALESS[kind]  # one tuple a kind: the batch's pickle writes it once
    return (kind._value_, _AS_IS, data)


_DATALESS = {kind: (kind._value_, _AS_IS, None) for kind in Kind}


def _prompts_read(turns: List[TurnData]) -> List[Tuple[int, Any]]:
    """Each turn's prompt as the outputs read it: ``(start, tokens)``, the ids from
    ``start`` up to the prompt's length at the call (tokens as :func:`_packed_ids`).

    The events API kept that much at the call already (a
    :class:`~otel_verl.record.PromptTail`: all of turn 0's prompt, of a later turn the ids
    after the previous turn's completion), and it goes as kept. A prompt that is a
    plain sequence (a record made elsewhere) is cut the same way here: the trajectory
    JSONL reads no id before the previous completion's end (``prompt_tokens +
    completion_tokens`` of that turn; its ``template_overhead_text`` slice starts there).
    Whole prompts would cost the trajectory's turns squared in tokens, copied and
    pickled here and unpickled in the export process; this is linear in them and
    compares nothing, whatever the agent loop did to its prompt between turns."""
    out: List[Tuple[int, Any]] = []
    start = 0
    for turn in turns:
        ids, count = turn.prompt_ids, turn.prompt_token_count
        if type(ids) is PromptTail and (count is None or count == len(ids)):
            out.append((ids.start, _packed_ids(ids.tokens)))
        else:
            end = len(ids) if count is None else min(count, len(ids))
            begin = min(start, end)
            out.append((begin, _packed_ids(ids[begin:end])))
        start = prompt_tokens(turn) + completion_tokens(turn)
    return out


def _prompt(start: int, sent: Any) -> Sequence[int]:
    """:func:`_prompts_read` undone for one turn."""
    tokens = _unpacked_ids(sent)
    return PromptTail(start, tokens) if start else tokens


def _packed_ids(ids: Any) -> Any:
    """Token ids as the bytes of an unsigned-int array (:func:`~otel_verl.record.kept_ids`,
    both ends are the same Python build): pickled as one copy, where a list pickles int
    by int. Ids that are no such ints (negative, too large, not ints) go as a list."""
    if type(ids) is not array or ids.typecode != IDS_TYPECODE:  # (as kept by the events API: no call)
        ids = kept_ids(ids)
    return ids.tobytes() if type(ids) is array else ids


def _unpacked_ids(sent: Any) -> list:
    """:func:`_packed_ids` undone."""
    if type(sent) is not bytes:
        return sent
    ids = array(IDS_TYPECODE)
    ids.frombytes(sent)
    return ids.tolist()


def _identity(data: TrajectoryData) -> tuple:
    return (data.uid, data.traj_uid, data.global_step, data.n_samples, data.agent_name, data.created_at,
            data.trainer_api)


def _context(ctx: Optional[SpanContext]) -> Optional[tuple]:
    if ctx is None:
        return None
    # A SpanContext is a tuple: (trace_id, span_id, is_remote, trace_flags, trace_state, is_valid);
    # indexing it is C, its properties are Python calls. TraceState keeps its entries in
    # ``_dict`` (its __len__ is a Python call too).
    state = ctx[4]
    entries = getattr(state, "_dict", state)
    return (ctx[0], ctx[1], ctx[2], int(ctx[3]), tuple(state.items()) if entries else None)


# --------------------------------------------------------------------------- spans again (host)


class RemoteSpan(ReadableSpan):
    """A span of the served process, as its span processors would have seen it."""


class Rebuilder:
    """Snapshots back into spans for the export process's span processors."""

    def __init__(self, config: HostConfig) -> None:
        self.resource = Resource(config.resource_attributes, config.resource_schema_url)
        self._scopes: Dict[tuple, InstrumentationScope] = {}
        self.codecs: Dict[int, Tuple[Any, Any]] = {}
        # serial -> (name, context, parent, kind, start, scope) of the started spans that
        # will end as END_OF (as many as the sender holds open, at most)
        self._open: Dict[int, tuple] = {}

    def span(self, snapshot: tuple) -> Tuple[int, RemoteSpan]:
        """``(START or END, the span)``."""
        what = snapshot[0]
        end_time = events = links = status = dropped = None
        if what == END_OF:
            _, serial, attributes, record, end_time, events, links, status, dropped = snapshot
            name, context, parent, kind, start, scope = self._open.pop(serial)
            what = END
        else:
            name, ctx, parent_ctx, kind_value, start, attributes, scope_key, record = snapshot[1:9]
            kind = SpanKind(kind_value)
            # a started parent comes as its serial; then a context that is the parent's
            # but for its span id as that id
            parent = self._open[parent_ctx][1] if type(parent_ctx) is int else _span_context(parent_ctx)
            if type(ctx) is int:
                context = SpanContext(parent.trace_id, ctx, False, parent.trace_flags, parent.trace_state)
            else:
                context = _span_context(ctx)
            scope = self._scope(scope_key)
            if what == END:
                end_time, events, links, status, dropped = snapshot[9:]
            elif snapshot[9] is not None:
                self._open[snapshot[9]] = (name, context, parent, kind, start, scope)
        span = RemoteSpan(
            name,
            context=context,
            parent=parent,
            resource=self.resource,
            attributes=attributes,
            events=[Event(n, a, t) for n, a, t in events] if events else (),
            links=[Link(_span_context(c), a) for c, a in links] if links else (),
            kind=kind,
            status=Status(StatusCode(status[0]), status[1]) if status else Status(StatusCode.UNSET),
            start_time=start,
            end_time=end_time,
            instrumentation_scope=scope,
        )
        if dropped:
            span._otel_verl_dropped = dropped  # read by the properties below
        if record is not None:
            kind_value, form, data = record
            setattr(span, RECORD_ATTR, SpanRecord(Kind(kind_value), self._data(form, data)))
        return what, span

    def _scope(self, scope: Optional[tuple]) -> Optional[InstrumentationScope]:
        if scope is None:
            return None
        made = self._scopes.get(scope)
        if made is None:
            made = self._scopes[scope] = InstrumentationScope(*scope)
        return made

    def _data(self, form: int, data: Any) -> Any:
        if form == _AS_IS:
            return data
        if form == _IDENTITY:
            return _trajectory_identity(data)
        identity, completed_at, turns, metrics, score, loop_class, run_ns, reward_row, codec = data
        decode, encode = self.codecs.get(codec, (None, None)) if codec is not None else (None, None)
        out = _trajectory_identity(identity)
        out.completed_at, out.agent_metrics, out.reward_score = completed_at, metrics, score
        out.agent_loop_class, out.run_completed_ns, out.reward_row = loop_class, run_ns, reward_row
        out.decode, out.encode = decode, encode
        out.turns = [
            TurnData(prompt_ids=_prompt(*p), start_ts=s, prompt_token_count=pc, end_ts=e, completion_ids=_unpacked_ids(c),
                     completion_token_count=cc, finish_reason=fr, server_meta=meta, observation_text=ot,
                     observation_start_ts=os_, observation_end_ts=oe)
            for p, s, pc, e, c, cc, fr, meta, ot, os_, oe in turns
        ]
        return out


def _trajectory_identity(identity: tuple) -> TrajectoryData:
    uid, traj_uid, step, n, agent, created_at, api = identity
    return TrajectoryData(uid=uid, traj_uid=traj_uid, global_step=step, n_samples=n, agent_name=agent,
                          created_at=created_at, trainer_api=api)


def _span_context(ctx: Optional[tuple]) -> Optional[SpanContext]:
    if ctx is None:
        return None
    trace_id, span_id, is_remote, flags, state = ctx
    return SpanContext(trace_id, span_id, is_remote, TraceFlags(flags), TraceState(list(state)) if state else None)


def _dropped(index: int) -> Callable[[Any], int]:
    def count(self: Any) -> int:
        dropped = getattr(self, "_otel_verl_dropped", None)
        return dropped[index] if dropped else 0

    return property(count)  # type: ignore[return-value]


RemoteSpan.dropped_attributes = _dropped(0)  # type: ignore[assignment]
RemoteSpan.dropped_events = _dropped(1)  # type: ignore[assignment]
RemoteSpan.dropped_links = _dropped(2)  # type: ignore[assignment]

