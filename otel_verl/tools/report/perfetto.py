"""``otel-verl report --perfetto FILE``: a run's spans as a Perfetto TrackEvent trace.

The file is Perfetto's native protobuf trace (TrackEvent packets, written with the
``perfetto`` package's trace builder), for the Perfetto UI (ui.perfetto.dev, "Open trace
file"). Its layout:

- a **process track** per traced process (the resource: ``service.instance.id``, else host
  and ``process.pid``), named by its ``verl.role`` (else its ``service.name``) and its
  index among the processes of that role: ``trainer``, ``rollout worker 0``, ``LLM server
  1``, ``reward worker``, ``sglang``, ...;
- in it, **slice tracks**: ``steps`` (``verl.fit``, ``verl.step`` and its ``verl.stage``
  spans), ``sample {uid}`` (``verl.sample``, ``verl.rollout``, ``verl.sample_stage``),
  ``prompt {uid}`` (v1's ``verl.prompt_task``), one ``trajectory {uid}/{traj_uid}`` per
  trajectory (``invoke_agent`` with its turns, tool calls, reward), ``requests``
  (``verl.llm_server.generate``, engine request spans), ``reward requests``
  (``verl.reward_worker.compute_score``) and ``spans`` (anything else). A span goes to the
  track of its nearest ancestor in the same process that names one;
- slices on one track must nest, so spans that overlap without nesting (parallel tool
  calls, concurrent requests) go to child tracks of it, ``{name} #2``, ``#3``, ...;
- **flows**, one per trajectory: its dispatch (the trainer's ``verl.rollout``, else its
  ``verl.sample``), v1's ``verl.prompt_task``, the trajectory, each LLM turn with its
  attempts and server requests, and the sample stage that trained it (``update_actor``,
  else its last ``verl.sample_stage``);
- **counters** per rollout worker (trajectories and LLM calls in flight, output tokens/s
  of its LLM calls) and per LLM server (requests in flight, output tokens/s), tokens
  spread evenly over each call and summed per time bin.

Every span is one slice (an instant when it lasts no time) or is left out and counted by
reason (:data:`LEFT_OUT_REASONS`): a second copy of a span (the same trace and span id),
a span with no start time or one that ends before it starts.
"""

from __future__ import annotations

import json
import os
import secrets
from collections import defaultdict
from dataclasses import dataclass, field
from heapq import heappop, heappush
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from otel_verl import semconv as sc

DUPLICATE = "duplicate"
NO_START_TIME = "no_start_time"
ENDS_BEFORE_START = "ends_before_start"
LEFT_OUT_REASONS = {
    DUPLICATE: "the same trace and span id as a span already read (a file given twice, or a collector's copy)",
    NO_START_TIME: "no start time",
    ENDS_BEFORE_START: "ends before it starts",
}

ROLE_LABELS = {
    sc.Role.TRAINER.value: "trainer",
    sc.Role.AGENT_LOOP_WORKER.value: "rollout worker",
    sc.Role.LLM_SERVER.value: "LLM server",
    sc.Role.REWARD_WORKER.value: "reward worker",
    sc.Role.DRIVER.value: "driver",
    sc.Role.WORKER.value: "worker",
}

# Track families, in the order their tracks are listed inside a process.
STEPS, REQUESTS, REWARDS, SPANS, SAMPLE, PROMPT, TRAJECTORY = (
    "steps", "requests", "reward requests", "spans", "sample", "prompt", "trajectory")
_FAMILY_ORDER = {kind: rank for rank, kind in enumerate((STEPS, REQUESTS, REWARDS, SPANS, SAMPLE, PROMPT, TRAJECTORY))}

# Counter tracks.
TRAJECTORIES_IN_FLIGHT = "trajectories in flight"
LLM_CALLS_IN_FLIGHT = "LLM calls in flight"
REQUESTS_IN_FLIGHT = "requests in flight"
OUTPUT_TOKENS_PER_S = "output tokens/s"
SERVER_COMPLETION_TOKENS = sc.LLM_SERVER_META_PREFIX + "completion_tokens"

# A pid above Linux's largest pid_max (2**22): for processes without a pid of their own or
# whose pid another process of the run (on another host) has too.
_SYNTHETIC_PID_BASE = 1 << 22
_TOKEN_BINS = 500  # about this many tokens/s points over the run
_SEQUENCE_ID = 1


class OutputError(Exception):
    """The trace file cannot be written (a missing directory, a full disk, ...)."""


class PerfettoMissing(RuntimeError):
    """The ``perfetto`` package (or a protobuf runtime its code accepts) is not installed."""


def require_perfetto() -> None:
    """Raise :class:`PerfettoMissing` with the fix unless the trace builder imports."""
    import importlib.util

    if importlib.util.find_spec("perfetto") is None:
        raise PerfettoMissing("needs the perfetto package: pip install 'otel-verl[report]'")
    try:
        from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder  # noqa: F401
    except Exception as exc:  # protobuf's VersionError: the package's generated code needs a newer runtime
        raise PerfettoMissing(f"the perfetto package does not load ({exc}): it needs protobuf 6.31 or newer") from None


@dataclass
class Written:
    """What :func:`write_spans` put in the file, and what it left out."""

    path: str
    bytes: int = 0
    spans: int = 0  # spans read
    slices: int = 0
    processes: int = 0
    slice_tracks: int = 0
    trajectory_tracks: int = 0
    flows: int = 0
    counter_tracks: int = 0
    counter_points: int = 0
    left_out: Dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        return {
            "path": self.path, "bytes": self.bytes, "spans": self.spans, "slices": self.slices,
            "processes": self.processes, "slice_tracks": self.slice_tracks,
            "trajectory_tracks": self.trajectory_tracks, "flows": self.flows,
            "counter_tracks": self.counter_tracks, "counter_points": self.counter_points,
            "left_out": {reason: {"spans": self.left_out[reason], "why": why}
                         for reason, why in LEFT_OUT_REASONS.items() if reason in self.left_out},
        }

    def lines(self) -> List[str]:
        out = [f"perfetto: {self.path} ({self.bytes / 1e6:.1f} MB): {self.slices} slices of {self.spans} spans "
               f"on {self.slice_tracks} tracks ({self.trajectory_tracks} trajectories) in {self.processes} processes, "
               f"{self.flows} flows, {self.counter_tracks} counter tracks ({self.counter_points} points)"]
        if self.left_out:
            out += [f"perfetto: left out {self.left_out[reason]} span(s): {why}"
                    for reason, why in LEFT_OUT_REASONS.items() if reason in self.left_out]
        else:
            out.append("perfetto: left out none")
        return out


def write_spans(spans: Sequence[Dict[str, Any]], out_path: str) -> Written:
    """Write flat spans (:func:`otel_verl.exporters.otlp_json_file.spans_from_files`'s
    dicts) to ``out_path``; the file appears whole or not at all."""
    require_perfetto()
    layout = _Layout(spans)
    written = Written(path=out_path, spans=len(spans), left_out=dict(layout.left_out))
    directory = os.path.dirname(os.path.abspath(out_path))
    try:
        fd, tmp = _create_beside(directory)
    except OSError as exc:
        raise OutputError(f"{out_path}: cannot write the Perfetto trace ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            _Writer(f, layout).write()
        os.replace(tmp, out_path)
        written.bytes = os.path.getsize(out_path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise OutputError(f"{out_path}: cannot write the Perfetto trace ({exc.strerror or exc})") from None
        raise
    written.slices = len(layout.kept)
    written.processes = len(layout.processes)
    written.slice_tracks = sum(len(family.lanes) for family in layout.families)
    written.trajectory_tracks = sum(family.kind == TRAJECTORY for family in layout.families)
    written.flows = len(layout.flows)
    written.counter_tracks = len(layout.counters)
    written.counter_points = sum(len(counter.points) for counter in layout.counters)
    return written


def _create_beside(directory: str) -> Tuple[int, str]:
    """A new temporary file in ``directory``, made with the umask's mode as the PNG and the
    JSON are (``tempfile.mkstemp`` makes 0600, which ``os.replace`` would keep)."""
    for _ in range(100):
        path = os.path.join(directory, f".perfetto-{os.getpid()}-{secrets.token_hex(4)}.tmp")
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {directory}")


# --------------------------------------------------------------------------- layout


@dataclass
class _Process:
    key: str
    resource: Dict[str, Any]
    role: str
    first_ns: int
    uuid: int = 0
    pid: int = 0
    name: str = ""
    families: List["_Family"] = field(default_factory=list)
    counters: List["_Counter"] = field(default_factory=list)


@dataclass
class _Lane:
    uuid: int
    open_ends: List[int] = field(default_factory=list)  # ends of its open slices, innermost last
    open_spans: List[int] = field(default_factory=list)  # their span indices
    busy_until: int = 0  # end of its outermost open slice
    listed_free: bool = False


@dataclass
class _Family:
    kind: str
    name: str
    process: _Process
    first_ns: int
    lanes: List[_Lane] = field(default_factory=list)
    busy: List[Tuple[int, int]] = field(default_factory=list)  # heap of (busy_until, lane index)
    free: List[int] = field(default_factory=list)  # heap of lane indices


@dataclass
class _Counter:
    uuid: int
    name: str
    process: _Process
    unit_name: str
    points: List[Tuple[int, float]]
    is_double: bool


class _Layout:
    """Where each span goes: its process, track family, lane; the flows and counters."""

    def __init__(self, spans: Sequence[Dict[str, Any]]) -> None:
        self.left_out: Dict[str, int] = {}
        self.kept: List[Dict[str, Any]] = self._keep(spans)
        self.by_id: Dict[Tuple[str, str], int] = {(s["traceId"], s["spanId"]): i for i, s in enumerate(self.kept)}
        self._next_uuid = 1
        self.processes: List[_Process] = []
        self.process_of: List[_Process] = self._processes()
        self.families: List[_Family] = []
        self.family_of: List[_Family] = self._families()
        # (ts, order, kind, track uuid, span index): kind 0 end, 1 begin, 2 instant
        self.events: List[Tuple[int, int, int, int, int]] = []
        self._place()
        self.flows: List[List[int]] = self._flows()
        self.counters: List[_Counter] = self._counters()

    def uuid(self) -> int:
        self._next_uuid += 1
        return self._next_uuid

    def _keep(self, spans: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
        kept, seen = [], set()
        for span in spans:
            key = (span["traceId"], span["spanId"])
            start, end = span["startTimeUnixNano"], span["endTimeUnixNano"]
            reason = (DUPLICATE if key in seen else NO_START_TIME if start <= 0
                      else ENDS_BEFORE_START if end < start else None)
            if reason:
                self.left_out[reason] = self.left_out.get(reason, 0) + 1
                continue
            seen.add(key)
            kept.append(span)
        return kept

    # ------------------------------------------------------------------ processes

    def _processes(self) -> List[_Process]:
        by_key: Dict[str, _Process] = {}
        process_of = []
        for span in self.kept:
            resource = span["resource"]
            key = _process_key(resource)
            process = by_key.get(key)
            if process is None:
                role = str(resource.get(sc.ROLE) or resource.get(sc.SERVICE_NAME) or "process")
                process = by_key[key] = _Process(key, resource, role, span["startTimeUnixNano"])
            process.first_ns = min(process.first_ns, span["startTimeUnixNano"])
            process_of.append(process)
        roles: Dict[str, List[_Process]] = defaultdict(list)
        for process in by_key.values():
            roles[process.role].append(process)
        role_rank = {role: rank for rank, role in enumerate(ROLE_LABELS)}
        taken = set()
        for role in sorted(roles, key=lambda r: (role_rank.get(r, len(role_rank)), r)):
            members = sorted(roles[role], key=lambda p: (p.first_ns, p.key))
            for index, process in enumerate(members):
                label = ROLE_LABELS.get(role, role)
                process.name = f"{label} {index}" if len(members) > 1 else label
                process.uuid = self.uuid()
                pid = process.resource.get(sc.PROCESS_PID)
                process.pid = pid if isinstance(pid, int) and 0 < pid < _SYNTHETIC_PID_BASE and pid not in taken else 0
                taken.add(process.pid)
                self.processes.append(process)
        synthetic = _SYNTHETIC_PID_BASE
        for process in self.processes:
            if not process.pid:
                synthetic += 1
                process.pid = synthetic
        return process_of

    # ------------------------------------------------------------------ families

    def _families(self) -> List[_Family]:
        by_key: Dict[Tuple[Any, ...], _Family] = {}
        family_of: List[Optional[_Family]] = [None] * len(self.kept)
        for index in range(len(self.kept)):
            chain: List[int] = []
            current = index
            family = None
            while family_of[current] is None:
                chain.append(current)
                key = _defining_key(self.kept[current])
                if key is not None:
                    family = self._family(by_key, key, current)
                    break
                parent = self._local_parent(current)
                if parent is None or parent in chain:  # a root here (or a cycle of parent ids)
                    family = self._family(by_key, (_root_kind(self.kept[current]),), current)
                    break
                current = parent
            if family is None:
                family = family_of[current]
            for member in chain:
                family_of[member] = family
                family.first_ns = min(family.first_ns, self.kept[member]["startTimeUnixNano"])
        return family_of  # type: ignore[return-value]

    def _parent(self, index: int) -> Optional[int]:
        span = self.kept[index]
        return self.by_id.get((span["traceId"], span["parentSpanId"])) if span["parentSpanId"] else None

    def _local_parent(self, index: int) -> Optional[int]:
        """The span's parent when it is in the same process."""
        parent = self._parent(index)
        if parent is None or self.process_of[parent] is not self.process_of[index]:
            return None
        return parent

    def _family(self, by_key: Dict[Tuple[Any, ...], _Family], key: Tuple[Any, ...], index: int) -> _Family:
        process = self.process_of[index]
        full_key = (process.key,) + key
        family = by_key.get(full_key)
        if family is None:
            kind = key[0]
            name = {SAMPLE: lambda: f"sample {key[1]}", PROMPT: lambda: f"prompt {key[1]}",
                    TRAJECTORY: lambda: f"trajectory {key[1]}/{key[2]}"}.get(kind, lambda: kind)()
            family = by_key[full_key] = _Family(kind, name, process, self.kept[index]["startTimeUnixNano"])
            process.families.append(family)
            self.families.append(family)
        return family

    # ------------------------------------------------------------------ lanes

    def _place(self) -> None:
        """Put each span on a lane of its family where it nests: its parent's lane when it
        fits there, else the lowest lane free at its start (a new one when none is)."""
        order = sorted(range(len(self.kept)), key=lambda i: (self.kept[i]["startTimeUnixNano"],
                                                              -self.kept[i]["endTimeUnixNano"], self._depth(i)))
        lane_index: Dict[int, int] = {}  # span -> its lane's index in its family
        counter = 0
        for index in order:
            span = self.kept[index]
            start, end = span["startTimeUnixNano"], span["endTimeUnixNano"]
            family = self.family_of[index]
            chosen = None
            parent = self._local_parent(index)
            if parent is not None and parent in lane_index and self.family_of[parent] is family:
                candidate = lane_index[parent]
                lane = family.lanes[candidate]
                counter = self._close(lane, start, counter)
                if not lane.open_ends or lane.open_ends[-1] >= end:
                    chosen = candidate
            if chosen is None:
                chosen = self._free_lane(family, start)
                counter = self._close(family.lanes[chosen], start, counter)
            lane = family.lanes[chosen]
            lane_index[index] = chosen
            counter += 1
            self.events.append((start, counter, 2 if end == start else 1, lane.uuid, index))
            if not lane.open_ends:  # outermost on its lane: the lane is busy until it ends
                lane.busy_until = end
                heappush(family.busy, (end, chosen))
            if end > start:
                lane.open_ends.append(end)
                lane.open_spans.append(index)
        for family in self.families:
            for lane in family.lanes:
                counter = self._close(lane, None, counter)

    def _close(self, lane: _Lane, before: Optional[int], counter: int) -> int:
        """End the lane's open slices that end by ``before`` (all when ``None``)."""
        while lane.open_ends and (before is None or lane.open_ends[-1] <= before):
            end = lane.open_ends.pop()
            counter += 1
            self.events.append((end, counter, 0, lane.uuid, lane.open_spans.pop()))
        return counter

    def _free_lane(self, family: _Family, start: int) -> int:
        while family.busy and family.busy[0][0] <= start:
            busy_until, index = heappop(family.busy)
            lane = family.lanes[index]
            if lane.busy_until == busy_until and not lane.listed_free:
                lane.listed_free = True
                heappush(family.free, index)
        while family.free:
            index = heappop(family.free)
            lane = family.lanes[index]
            lane.listed_free = False
            if lane.busy_until <= start:
                return index
        uuid = self.uuid()
        family.lanes.append(_Lane(uuid))
        return len(family.lanes) - 1

    def _depth(self, index: int) -> int:
        depth = 0
        parent = self._local_parent(index)
        while parent is not None and depth < 64:
            depth += 1
            parent = self._local_parent(parent)
        return depth

    # ------------------------------------------------------------------ flows

    def _flows(self) -> List[List[int]]:
        """Per trajectory: the slices its flow goes through, in the order of their starts."""
        children: Dict[int, List[int]] = defaultdict(list)
        stages_of_uid: Dict[Tuple[str, str], List[int]] = defaultdict(list)
        for index, span in enumerate(self.kept):
            parent = self._parent(index)
            if parent is not None:
                children[parent].append(index)
            if span["name"].startswith(sc.sample_stage_span_name("")):
                stages_of_uid[(span["traceId"], str(span["attributes"].get(sc.UID)))].append(index)
        flows = []
        for index, span in enumerate(self.kept):
            if not is_trajectory(span):
                continue
            chain = self._dispatch_of(index) + [index] + self._turns_of(index, children)
            stage = self._training_stage(span, stages_of_uid)
            if stage is not None:
                chain.append(stage)
            if len(chain) > 1:
                flows.append(sorted(chain, key=lambda i: (self.kept[i]["startTimeUnixNano"], i)))
        return flows

    def _dispatch_of(self, index: int) -> List[int]:
        """The trajectory's dispatch (nearest ``verl.rollout``, else ``verl.sample``
        ancestor) and v1's ``verl.prompt_task`` between them."""
        found: List[int] = []
        sample = None
        current = index
        for _ in range(64):  # deeper than any trace otel_verl writes; bounds a cycle of parent ids
            parent = self._parent(current)
            if parent is None:
                break
            current, span = parent, self.kept[parent]
            if span["name"] == sc.SPAN_PROMPT_TASK and not found:
                found.append(parent)
            elif span["name"] == sc.SPAN_ROLLOUT:
                return [parent] + found
            elif span["name"] == sc.SPAN_SAMPLE:
                sample = parent
        return ([sample] if sample is not None else []) + found

    def _turns_of(self, index: int, children: Dict[int, List[int]]) -> List[int]:
        """The trajectory's LLM turns, their attempts, and the server (and engine) spans
        below them, in any process."""
        out: List[int] = []
        seen = {index}
        todo = [child for child in children.get(index, ()) if is_llm_call(self.kept[child])]
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            out.append(current)
            todo.extend(c for c in children.get(current, ()) if not is_trajectory(self.kept[c]))
        return out

    def _training_stage(self, trajectory: Dict[str, Any], stages_of_uid: Dict[Tuple[str, str], List[int]]) -> Optional[int]:
        attributes = trajectory["attributes"]
        traj = attributes.get(sc.TRAJ_UID)
        stages = [i for i in stages_of_uid.get((trajectory["traceId"], str(attributes.get(sc.UID))), ())
                  if traj is None or sc.TRAJ_UIDS not in self.kept[i]["attributes"]
                  or str(traj) in [str(t) for t in self.kept[i]["attributes"][sc.TRAJ_UIDS] or ()]]
        if not stages:
            return None
        update = sc.Stage.UPDATE_ACTOR.value
        trained = [i for i in stages if self.kept[i]["attributes"].get(sc.STAGE) == update]
        return max(trained or stages, key=lambda i: (self.kept[i]["endTimeUnixNano"], i))

    # ------------------------------------------------------------------ counters

    def _counters(self) -> List[_Counter]:
        starts = [s["startTimeUnixNano"] for s in self.kept]
        ends = [s["endTimeUnixNano"] for s in self.kept]
        width = _bin_width(min(starts), max(ends)) if self.kept else 1
        trajectories: Dict[int, List[int]] = defaultdict(list)
        calls: Dict[int, List[int]] = defaultdict(list)
        requests: Dict[int, List[int]] = defaultdict(list)
        for index, span in enumerate(self.kept):
            process = id(self.process_of[index])
            if is_trajectory(span):
                trajectories[process].append(index)
            elif is_llm_call(span):
                calls[process].append(index)
            elif span["name"] == sc.SPAN_LLM_SERVER:
                requests[process].append(index)
        counters = []
        for process in self.processes:
            key = id(process)
            if trajectories.get(key):
                counters.append(self._counter(process, TRAJECTORIES_IN_FLIGHT, "trajectories",
                                              _in_flight(self.kept, trajectories[key]), False))
            if calls.get(key):
                counters.append(self._counter(process, LLM_CALLS_IN_FLIGHT, "calls", _in_flight(self.kept, calls[key]), False))
                tokens = [(i, _number(self.kept[i]["attributes"].get(sc.GEN_AI_USAGE_OUTPUT_TOKENS))) for i in calls[key]]
                if any(n for _, n in tokens):
                    counters.append(self._counter(process, OUTPUT_TOKENS_PER_S, "tokens/s",
                                                  _token_rate(self.kept, tokens, width), True))
            if requests.get(key):
                counters.append(self._counter(process, REQUESTS_IN_FLIGHT, "requests",
                                              _in_flight(self.kept, requests[key]), False))
                tokens = [(i, self._request_tokens(i)) for i in requests[key]]
                if any(n for _, n in tokens):
                    counters.append(self._counter(process, OUTPUT_TOKENS_PER_S, "tokens/s",
                                                  _token_rate(self.kept, tokens, width), True))
        return counters

    def _request_tokens(self, index: int) -> float:
        """A server request's output tokens: the server's count, else its turn's or attempt's."""
        own = _number(self.kept[index]["attributes"].get(SERVER_COMPLETION_TOKENS))
        if own:
            return own
        parent = self._parent(index)
        return _number(self.kept[parent]["attributes"].get(sc.GEN_AI_USAGE_OUTPUT_TOKENS)) if parent is not None else 0.0

    def _counter(self, process: _Process, name: str, unit: str, points: List[Tuple[int, float]], is_double: bool) -> _Counter:
        counter = _Counter(self.uuid(), name, process, unit, points, is_double)
        process.counters.append(counter)
        return counter


def is_trajectory(span: Dict[str, Any]) -> bool:
    return span["attributes"].get(sc.GEN_AI_OPERATION_NAME) == sc.OP_INVOKE_AGENT


def is_llm_call(span: Dict[str, Any]) -> bool:
    return span["attributes"].get(sc.GEN_AI_OPERATION_NAME) in (sc.OP_CHAT, sc.OP_TEXT_COMPLETION)


def _process_key(resource: Dict[str, Any]) -> str:
    instance = resource.get(sc.SERVICE_INSTANCE_ID)
    if instance:
        return f"instance:{instance}"
    if resource.get(sc.PROCESS_PID) is not None:
        return f"pid:{resource.get(sc.HOST_NAME)}:{resource.get(sc.PROCESS_PID)}:{resource.get(sc.SERVICE_NAME)}"
    return "resource:" + json.dumps(resource, sort_keys=True, default=str)


def _defining_key(span: Dict[str, Any]) -> Optional[Tuple[Any, ...]]:
    """The family a span names by itself (``None``: it follows its parent)."""
    name = span["name"]
    attributes = span["attributes"]
    if name in (sc.SPAN_STEP, sc.SPAN_FIT) or name.startswith(sc.step_stage_span_name("")):
        return (STEPS,)
    uid = attributes.get(sc.UID)
    if uid is None:
        return None
    if name in (sc.SPAN_SAMPLE, sc.SPAN_ROLLOUT) or name.startswith(sc.sample_stage_span_name("")):
        return (SAMPLE, str(uid))
    if is_trajectory(span):
        return (TRAJECTORY, str(uid), str(attributes.get(sc.TRAJ_UID)))
    if name == sc.SPAN_PROMPT_TASK:
        return (PROMPT, str(uid))
    return None


def _root_kind(span: Dict[str, Any]) -> str:
    """The family of a span whose parent is in another process (or absent)."""
    name = span["name"]
    if name == sc.SPAN_LLM_SERVER or name.strip().startswith("Req ") or name == "llm_request":  # sglang's, vLLM's
        return REQUESTS
    if name == sc.SPAN_REWARD_WORKER:
        return REWARDS
    return SPANS


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else 0.0


def _in_flight(spans: Sequence[Dict[str, Any]], members: Iterable[int]) -> List[Tuple[int, float]]:
    """How many of the spans are open, after every change at each time one starts or ends."""
    changes: Dict[int, int] = defaultdict(int)
    for index in members:
        start, end = spans[index]["startTimeUnixNano"], spans[index]["endTimeUnixNano"]
        if end > start:
            changes[start] += 1
            changes[end] -= 1
    points, level = [], 0
    for ts in sorted(changes):
        level += changes[ts]
        points.append((ts, float(level)))
    return points


def _bin_width(first: int, last: int) -> int:
    """A round bin width (1, 2 or 5 x 10^k ns, at least 1 ms) giving about _TOKEN_BINS bins."""
    target = max((last - first) / _TOKEN_BINS, 1e6)
    magnitude = 1
    while True:
        for step in (1, 2, 5):
            if step * magnitude >= target:
                return step * magnitude
        magnitude *= 10


def _token_rate(spans: Sequence[Dict[str, Any]], tokens: Sequence[Tuple[int, float]], width: int) -> List[Tuple[int, float]]:
    """Tokens per second in bins of ``width`` ns, each span's tokens spread evenly over it;
    one point per bin from the first to the last, then 0."""
    bins: Dict[int, float] = defaultdict(float)  # tokens in the bins a span starts or ends in
    covered: Dict[int, float] = defaultdict(float)  # changes of the summed rate of the spans covering whole bins
    covering: Dict[int, int] = defaultdict(int)  # changes of how many spans cover whole bins
    for index, count in tokens:
        if not count:
            continue
        start, end = spans[index]["startTimeUnixNano"], spans[index]["endTimeUnixNano"]
        first, last = start // width, end // width
        if end == start or first == last:
            bins[first] += count
            continue
        rate = count / (end - start)
        bins[first] += rate * ((first + 1) * width - start)
        bins[last] += rate * (end - last * width)
        if last > first + 1:
            covered[first + 1] += rate
            covered[last] -= rate
            covering[first + 1] += 1
            covering[last] -= 1
    if not bins:
        return []
    low, high = min(bins), max(bins)
    per_second = 1e9 / width
    points, rate, spans_covering = [], 0.0, 0
    for b in range(low, high + 1):
        spans_covering += covering.get(b, 0)
        rate = rate + covered.get(b, 0.0) if spans_covering else 0.0  # no rounding residue once none covers
        points.append((b * width, (bins.get(b, 0.0) + rate * width) * per_second))
    return points + [((high + 1) * width, 0.0)]


# --------------------------------------------------------------------------- writing


class _Writer:
    """Packets in time order on one sequence, names and strings interned."""

    def __init__(self, f: Any, layout: _Layout) -> None:
        from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
        from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder

        self.pb = pb
        self.builder = StreamingTraceProtoBuilder(f)
        self.layout = layout
        self.event_names: Dict[str, int] = {}
        self.annotation_names: Dict[str, int] = {}
        self.strings: Dict[str, int] = {}
        self.flow_ids: Dict[int, List[int]] = defaultdict(list)
        self.terminating: Dict[int, List[int]] = defaultdict(list)
        for flow_id, chain in enumerate(layout.flows, 1):
            for index in chain[:-1]:
                self.flow_ids[index].append(flow_id)
            self.terminating[chain[-1]].append(flow_id)

    def write(self) -> None:
        pb = self.pb
        first = min((e[0] for e in self.layout.events), default=0)
        packet = self.builder.create_packet()
        packet.trusted_packet_sequence_id = _SEQUENCE_ID
        packet.sequence_flags = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
        packet.timestamp = first
        # The span times are wall-clock ns: saying so lets the UI show times of day.
        packet.clock_snapshot.primary_trace_clock = pb.BUILTIN_CLOCK_BOOTTIME
        for clock in (pb.BUILTIN_CLOCK_BOOTTIME, pb.BUILTIN_CLOCK_REALTIME):
            entry = packet.clock_snapshot.clocks.add()
            entry.clock_id = clock
            entry.timestamp = first
        self.builder.write_packet(packet)
        for descriptor in self._descriptors():
            self.builder.write_packet(descriptor)
        counter_events = [(ts, 0, counter, value) for counter in self.layout.counters for ts, value in counter.points]
        slice_events = sorted(self.layout.events)
        counter_events.sort(key=lambda e: (e[0], e[2].uuid))
        ci = 0
        for ts, _, kind, track, index in slice_events:
            while ci < len(counter_events) and counter_events[ci][0] <= ts:
                self._counter_packet(*counter_events[ci])
                ci += 1
            self._slice_packet(ts, kind, track, index)
        for event in counter_events[ci:]:
            self._counter_packet(*event)

    def _descriptors(self) -> Iterable[Any]:
        pb = self.pb
        for process in self.layout.processes:
            packet = self.builder.create_packet()
            packet.trusted_packet_sequence_id = _SEQUENCE_ID
            track = packet.track_descriptor
            track.uuid = process.uuid
            track.process.pid = process.pid
            track.process.process_name = process.name
            track.process.process_labels.extend(_process_labels(process.resource))
            track.child_ordering = pb.TrackDescriptor.EXPLICIT
            yield packet
            rank = 0
            for counter in process.counters:
                rank += 1
                yield self._track(counter.uuid, process.uuid, counter.name, rank, counter=counter)
            for family in sorted(process.families, key=lambda f: (_FAMILY_ORDER[f.kind], f.first_ns, f.name)):
                rank += 1
                head = family.lanes[0].uuid
                yield self._track(head, process.uuid, family.name, rank, ordered=len(family.lanes) > 1)
                for number, lane in enumerate(family.lanes[1:], 2):
                    yield self._track(lane.uuid, head, f"{family.name} #{number}", number)

    def _track(self, uuid: int, parent: int, name: str, rank: int, ordered: bool = False, counter: Optional[_Counter] = None) -> Any:
        pb = self.pb
        packet = self.builder.create_packet()
        packet.trusted_packet_sequence_id = _SEQUENCE_ID
        track = packet.track_descriptor
        track.uuid = uuid
        track.parent_uuid = parent
        track.name = name
        track.sibling_order_rank = rank
        track.sibling_merge_behavior = pb.TrackDescriptor.SIBLING_MERGE_BEHAVIOR_NONE
        if ordered:
            track.child_ordering = pb.TrackDescriptor.EXPLICIT
        if counter is not None:
            track.counter.unit_name = counter.unit_name
            if not counter.is_double:
                track.counter.unit = pb.CounterDescriptor.UNIT_COUNT
        return packet

    def _slice_packet(self, ts: int, kind: int, track: int, index: int) -> None:
        pb = self.pb
        packet = self.builder.create_packet()
        packet.trusted_packet_sequence_id = _SEQUENCE_ID
        packet.sequence_flags = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
        packet.timestamp = ts
        event = packet.track_event
        event.track_uuid = track
        if kind == 0:
            event.type = pb.TrackEvent.TYPE_SLICE_END
            self.builder.write_packet(packet)
            return
        event.type = pb.TrackEvent.TYPE_SLICE_BEGIN if kind == 1 else pb.TrackEvent.TYPE_INSTANT
        span = self.layout.kept[index]
        interned = packet.interned_data
        event.name_iid = self._intern(self.event_names, span["name"], interned.event_names, "name")
        for key, value in _annotations(span):
            self._annotate(event.debug_annotations.add(), key, value, interned)
        if index in self.flow_ids:
            event.flow_ids.extend(self.flow_ids[index])
        if index in self.terminating:
            event.terminating_flow_ids.extend(self.terminating[index])
        self.builder.write_packet(packet)

    def _counter_packet(self, ts: int, _: int, counter: _Counter, value: float) -> None:
        pb = self.pb
        packet = self.builder.create_packet()
        packet.trusted_packet_sequence_id = _SEQUENCE_ID
        packet.timestamp = ts
        event = packet.track_event
        event.type = pb.TrackEvent.TYPE_COUNTER
        event.track_uuid = counter.uuid
        if counter.is_double:
            event.double_counter_value = value
        else:
            event.counter_value = int(value)
        self.builder.write_packet(packet)

    def _intern(self, table: Dict[str, int], text: str, entries: Any, field_name: str) -> int:
        iid = table.get(text)
        if iid is None:
            iid = table[text] = len(table) + 1
            entry = entries.add()
            entry.iid = iid
            setattr(entry, field_name, text.encode("utf-8", "replace") if field_name == "str" else text)
        return iid

    def _annotate(self, annotation: Any, key: Optional[str], value: Any, interned: Any) -> None:
        if key is not None:
            iid = self.annotation_names.get(key)
            annotation.name_iid = iid or self._intern(self.annotation_names, key, interned.debug_annotation_names, "name")
        kind = type(value)
        if kind is str:
            if len(value) > 256 or key == SPAN_ID:  # unique or long: interning would only add a table entry
                annotation.string_value = value
            else:
                iid = self.strings.get(value)
                annotation.string_value_iid = iid or self._intern(
                    self.strings, value, interned.debug_annotation_string_values, "str")
        elif kind is bool:
            annotation.bool_value = value
        elif kind is int:
            if -(1 << 63) <= value < (1 << 63):
                annotation.int_value = value
            else:
                annotation.string_value = str(value)
        elif kind is float:
            annotation.double_value = value
        elif kind is list or kind is tuple:
            for item in value:
                self._annotate(annotation.array_values.add(), None, item, interned)
            if not value:
                annotation.string_value = "[]"
        elif kind is dict:
            for item_key, item in value.items():
                entry = annotation.dict_entries.add()
                entry.name = str(item_key)
                self._annotate(entry, None, item, interned)
        elif kind is bytes:
            annotation.string_value = value.hex()
        else:
            annotation.string_value = "" if value is None else str(value)


SPAN_ID = "otel.span_id"
_SPAN_KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def _annotations(span: Dict[str, Any]) -> List[Tuple[str, Any]]:
    """The slice's arguments: the span's ids, kind, status, attributes, events and links."""
    out: List[Tuple[str, Any]] = [("otel.trace_id", span["traceId"]), (SPAN_ID, span["spanId"])]
    if span["parentSpanId"]:
        out.append(("otel.parent_span_id", span["parentSpanId"]))
    out.append(("otel.kind", _SPAN_KINDS.get(span["kind"], str(span["kind"]))))
    status = span.get("status") or {}
    if status.get("code"):
        out.append(("otel.status", "error" if status["code"] == 2 else "ok"))
        if status.get("message"):
            out.append(("otel.status_message", status["message"]))
    out.extend((key, value) for key, value in span["attributes"].items() if value is not None)
    events = span.get("events") or ()
    if events:
        start = span["startTimeUnixNano"]
        out.append(("otel.events", [f"{e['name']} at +{(e['timeUnixNano'] - start) / 1e6:.3f} ms" for e in events]))
    links = span.get("links") or ()
    if links:
        out.append(("otel.links", [f"{link['traceId']}/{link['spanId']}" for link in links]))
    return out


def _process_labels(resource: Dict[str, Any]) -> List[str]:
    keys = (sc.SERVICE_NAME, sc.HOST_NAME, sc.PROCESS_PID, sc.SERVICE_INSTANCE_ID, sc.RAY_ACTOR_ID, sc.RUN_ID)
    return [f"{key}={resource[key]}" for key in keys if resource.get(key) is not None]
