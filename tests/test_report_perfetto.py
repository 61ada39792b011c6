"""``otel-verl report --perfetto``: the trace file read back with Perfetto's own protos.

Runs are written here as OTLP-JSON files, process by process, with times chosen to make
trajectories, tool calls and server requests overlap; the file is parsed with the
``perfetto`` package's ``perfetto_trace_pb2`` and every track, slice, flow and counter is
checked against the spans. One e2e test does the same on a real demo run
(:func:`check_run_in_perfetto`, which the v1 and separation trainers' demo tests use too).
"""

from __future__ import annotations

import json
import os
import stat
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import pytest
from click.testing import CliRunner
from google.protobuf import runtime_version

from otel_verl.tools.cli import main
from otel_verl.exporters.otlp_json_file import spans_from_files
from otel_verl.tools.report import perfetto
from otlp_runs import any_value

try:
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
except runtime_version.VersionError as exc:  # the lowest-versions venv: protobuf 5, older than perfetto's code
    pytest.skip(f"the perfetto package needs a newer protobuf runtime: {exc}", allow_module_level=True)

MS = 1_000_000
T0 = 1_800_000_000_000_000_000
UID_A = "aaaaaaaa-0000-4000-8000-000000000001"
UID_B = "bbbbbbbb-0000-4000-8000-000000000002"


# --------------------------------------------------------------------------- writing runs


class Run:
    """OTLP-JSON spans of made-up processes; times in ms after T0."""

    def __init__(self) -> None:
        self.processes: Dict[str, Dict[str, Any]] = {}
        self.spans: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
        self._ids = 0

    def process(self, name: str, role: Optional[str], pid: Optional[int], host: str = "node-0",
                service: Optional[str] = None, instance: bool = True) -> str:
        resource = {"host.name": host, "service.name": service or f"verl-{role}"}
        if role:
            resource["verl.role"] = role
        if pid is not None:
            resource["process.pid"] = pid
        if instance:
            resource["service.instance.id"] = f"instance-{name}"
        self.processes[name] = resource
        return name

    def span(self, process: str, name: str, start_ms: float, end_ms: float, parent: Optional[Dict[str, Any]] = None,
             trace: Optional[str] = None, kind: int = 1, **attributes: Any) -> Dict[str, Any]:
        self._ids += 1
        span = {"traceId": trace or (parent["traceId"] if parent else "%032x" % (0xF00 + self._ids)),
                "spanId": "%016x" % (0xABC000 + self._ids), "name": name, "kind": kind,
                "startTimeUnixNano": str(T0 + int(start_ms * MS)) if start_ms is not None else "0",
                "endTimeUnixNano": str(T0 + int(end_ms * MS)),
                "attributes": [{"key": k.replace("__", "."), "value": any_value(v)} for k, v in attributes.items()],
                "status": {}}
        if parent:
            span["parentSpanId"] = parent["spanId"]
        self.spans[process].append(span)
        return span

    def write(self, directory) -> str:
        otlp = os.path.join(str(directory), "otlp")
        os.makedirs(otlp, exist_ok=True)
        for name, spans in self.spans.items():
            resource = {"attributes": [{"key": k, "value": any_value(v)} for k, v in self.processes[name].items()]}
            with open(os.path.join(otlp, f"spans-{name}.jsonl"), "w", encoding="utf-8") as f:
                f.write(json.dumps({"resourceSpans": [{"resource": resource, "scopeSpans": [
                    {"scope": {"name": "otel_verl"}, "spans": spans}]}]}) + "\n")
        return str(directory)


def trace_of(uid: str) -> str:
    return uid.replace("-", "")


def trajectory(run: Run, worker: str, parent: Dict[str, Any], uid: str, traj: str, start: float, end: float):
    return run.span(worker, "invoke_agent tool_agent", start, end, parent, gen_ai__operation__name="invoke_agent",
                    verl__uid=uid, verl__traj_uid=traj, gen_ai__agent__name="tool_agent")


def chat(run: Run, worker: str, parent: Dict[str, Any], start: float, end: float, tokens: int = 50):
    return run.span(worker, "chat qwen", start, end, parent, kind=3, gen_ai__operation__name="chat",
                    gen_ai__usage__output_tokens=tokens, verl__uid=parent and _attr(parent, "verl.uid"))


def _attr(span: Dict[str, Any], key: str) -> Any:
    for kv in span["attributes"]:
        if kv["key"] == key:
            return next(iter(kv["value"].values()))
    return None


def v0_run() -> Tuple[Run, Dict[str, Dict[str, Any]]]:
    """A v0 step of 2 prompts x 2 trajectories on 2 workers and 2 LLM servers, with an
    sglang engine's request spans, a reward worker, parallel tool calls in one trajectory
    and two workers on different hosts with the same pid."""
    run = Run()
    trainer = run.process("trainer", "trainer", 100)
    w0 = run.process("w0", "agent_loop_worker", 200)
    w1 = run.process("w1", "agent_loop_worker", 200, host="node-1")
    s0 = run.process("s0", "llm_server", 300)
    s1 = run.process("s1", "llm_server", 301)
    rw = run.process("rw", "reward_worker", 400)
    engine = run.process("sglang", None, None, service="sglang", instance=False)
    named: Dict[str, Dict[str, Any]] = {}
    named["fit"] = run.span(trainer, "verl.fit", 0, 0, verl__trainer="RayPPOTrainer", verl__rollout_n=2)
    step = named["step"] = run.span(trainer, "verl.step", 10, 1000, verl__global_step=1)
    run.span(trainer, "verl.stage generation", 10, 600, step, verl__stage="generation", verl__global_step=1)
    run.span(trainer, "verl.stage update_actor", 700, 800, step, verl__stage="update_actor", verl__global_step=1)
    for uid in (UID_A, UID_B):
        key = uid[0]
        sample = named[f"sample {key}"] = run.span(trainer, "verl.sample", 5, 900, trace=trace_of(uid), verl__uid=uid,
                                                   verl__sample__outcome="trained")
        named[f"rollout {key}"] = run.span(trainer, "verl.rollout", 10, 600, sample, verl__uid=uid,
                                           verl__traj_uids=["0", "1"], verl__agent_loop__worker_indices=[0, 0])
        named[f"reward stage {key}"] = run.span(trainer, "verl.sample_stage reward", 610, 620, sample, verl__uid=uid,
                                                verl__stage="reward", verl__traj_uids=["0", "1"])
        named[f"update stage {key}"] = run.span(trainer, "verl.sample_stage update_actor", 700, 800, sample,
                                                verl__uid=uid, verl__stage="update_actor", verl__traj_uids=["0", "1"])
    # A/0 on w0: two turns, two tool calls at once between them, a reward computed by the reward worker
    t = named["A/0"] = trajectory(run, w0, named["rollout a"], UID_A, "0", 20, 400)
    c = named["A/0 chat 1"] = chat(run, w0, t, 30, 100)
    named["A/0 server 1"] = run.span(s0, "verl.llm_server.generate", 35, 95, c, kind=2,
                                     verl__llm__server__completion_tokens=50, verl__llm__server__e2e_latency=0.06)
    req = named["A/0 engine"] = run.span(engine, " Req 0a0a0a0a", 36, 94, c, kind=2, rid="0a0a0a0a")
    named["A/0 scheduler"] = run.span(engine, "Scheduler [TP 0]", 40, 90, req)
    named["A/0 tool 1"] = run.span(w0, "execute_tool calculator", 110, 150, t, gen_ai__operation__name="execute_tool")
    named["A/0 tool 2"] = run.span(w0, "execute_tool search", 120, 160, t, gen_ai__operation__name="execute_tool")
    c = named["A/0 chat 2"] = chat(run, w0, t, 170, 300, tokens=30)
    named["A/0 server 2"] = run.span(s1, "verl.llm_server.generate", 175, 290, c, kind=2,
                                     verl__llm__server__completion_tokens=30)
    reward = run.span(w0, "verl.reward", 310, 390, t, verl__reward__score=1.0)
    run.span(rw, "verl.reward_worker.compute_score", 320, 380, reward, kind=2, verl__reward__score=1.0)
    # A/1 on w0, overlapping A/0; its request overlaps A/0's on server 0
    t = named["A/1"] = trajectory(run, w0, named["rollout a"], UID_A, "1", 25, 450)
    c = named["A/1 chat 1"] = chat(run, w0, t, 30, 200, tokens=80)
    named["A/1 server 1"] = run.span(s0, "verl.llm_server.generate", 40, 190, c, kind=2)  # tokens from its chat
    run.span(w0, "verl.reward", 210, 440, t, verl__reward__score=0.0)
    # B/0 and B/1 on w1
    for traj, (start, end) in (("0", (20, 500)), ("1", (22, 300))):
        t = named[f"B/{traj}"] = trajectory(run, w1, named["rollout b"], UID_B, traj, start, end)
        c = named[f"B/{traj} chat 1"] = chat(run, w1, t, start + 10, end - 20, tokens=100)
        named[f"B/{traj} server 1"] = run.span(s1, "verl.llm_server.generate", start + 20, end - 30, c, kind=2,
                                               verl__llm__server__completion_tokens=100)
        run.span(w1, "verl.reward", end - 15, end - 5, t)
    return run, named


# --------------------------------------------------------------------------- reading the file back


class Trace:
    """A .pftrace parsed with Perfetto's protos, checked as the trace processor reads it:
    one sequence whose first packet clears its incremental state; interned names defined
    before use; every event on a track described before it; events in time order; every
    slice end closing the innermost open slice of its track."""

    def __init__(self, path: str) -> None:
        trace = pb.Trace()
        with open(path, "rb") as f:
            trace.ParseFromString(f.read())
        self.packets = list(trace.packet)
        self.tracks: Dict[int, Any] = {}
        self.slices: List[Dict[str, Any]] = []
        self.counters: Dict[int, List[Tuple[int, float]]] = defaultdict(list)
        self.flows: Dict[int, List[Dict[str, Any]]] = defaultdict(list)
        self.terminated: Dict[int, Dict[str, Any]] = {}
        names: Dict[int, str] = {}
        arg_names: Dict[int, str] = {}
        strings: Dict[int, str] = {}
        open_slices: Dict[int, List[Dict[str, Any]]] = defaultdict(list)
        assert self.packets[0].sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
        last_ts = 0
        for packet in self.packets:
            assert packet.trusted_packet_sequence_id == self.packets[0].trusted_packet_sequence_id
            if packet.HasField("interned_data"):
                for entry in packet.interned_data.event_names:
                    assert entry.iid not in names
                    names[entry.iid] = entry.name
                for entry in packet.interned_data.debug_annotation_names:
                    assert entry.iid not in arg_names
                    arg_names[entry.iid] = entry.name
                for entry in packet.interned_data.debug_annotation_string_values:
                    assert entry.iid not in strings
                    strings[entry.iid] = entry.str.decode()
            if packet.HasField("track_descriptor"):
                track = packet.track_descriptor
                assert track.uuid not in self.tracks
                assert not track.HasField("parent_uuid") or track.parent_uuid in self.tracks
                self.tracks[track.uuid] = track
            if not packet.HasField("track_event"):
                continue
            event = packet.track_event
            assert event.track_uuid in self.tracks
            assert packet.timestamp >= last_ts
            last_ts = packet.timestamp
            if event.type == pb.TrackEvent.TYPE_COUNTER:
                assert self.tracks[event.track_uuid].HasField("counter")
                value = event.double_counter_value if event.HasField("double_counter_value") else event.counter_value
                self.counters[event.track_uuid].append((packet.timestamp, value))
                continue
            if event.type == pb.TrackEvent.TYPE_SLICE_END:
                assert open_slices[event.track_uuid], "an end with no open slice"
                closing = open_slices[event.track_uuid].pop()
                closing["dur"] = packet.timestamp - closing["ts"]
                continue
            assert event.type in (pb.TrackEvent.TYPE_SLICE_BEGIN, pb.TrackEvent.TYPE_INSTANT)
            assert packet.sequence_flags & pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
            stack = open_slices[event.track_uuid]
            record = {"track": event.track_uuid, "name": names[event.name_iid], "ts": packet.timestamp,
                      "dur": 0 if event.type == pb.TrackEvent.TYPE_INSTANT else None, "depth": len(stack),
                      "args": {arg_names[a.name_iid]: _decode(a, strings) for a in event.debug_annotations}}
            self.slices.append(record)
            if event.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
                stack.append(record)
            for flow in event.flow_ids:
                assert flow not in self.terminated
                self.flows[flow].append(record)
            for flow in event.terminating_flow_ids:
                assert flow not in self.terminated
                self.flows[flow].append(record)
                self.terminated[flow] = record
        assert not any(open_slices.values()), "slices left open"
        self.by_span = {(s["args"]["otel.trace_id"], s["args"]["otel.span_id"]): s for s in self.slices}
        assert len(self.by_span) == len(self.slices)

    def process_of(self, uuid: int) -> Any:
        track = self.tracks[uuid]
        while not track.HasField("process"):
            track = self.tracks[track.parent_uuid]
        return track

    def family_of(self, uuid: int) -> Any:
        """The track itself, or the one it is an overlap lane of."""
        track = self.tracks[uuid]
        parent = self.tracks.get(track.parent_uuid)
        return parent if parent is not None and not parent.HasField("process") else track

    def processes(self) -> Dict[str, Any]:
        return {t.process.process_name: t for t in self.tracks.values() if t.HasField("process")}


def _decode(annotation: Any, strings: Dict[int, str]) -> Any:
    kind = annotation.WhichOneof("value")
    if kind == "string_value_iid":
        return strings[annotation.string_value_iid]
    if kind is not None:
        return getattr(annotation, kind)
    if annotation.array_values:
        return [_decode(a, strings) for a in annotation.array_values]
    if annotation.dict_entries:
        return {a.name: _decode(a, strings) for a in annotation.dict_entries}
    return None


def convert(tmp_path, run: Run) -> Tuple[perfetto.Written, Trace, List[Dict[str, Any]]]:
    trace_dir = run.write(tmp_path / "run")
    out = str(tmp_path / "run.pftrace")
    spans = spans_from_files(os.path.join(trace_dir, "otlp"))
    return perfetto.write_spans(spans, out), Trace(out), spans


def key(span: Dict[str, Any]) -> Tuple[str, str]:
    return (span["traceId"], span["spanId"])


def flat(named: Dict[str, Any], spans: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """The run's named spans as read back (flat dicts)."""
    by_key = {key(s): s for s in spans}
    return {name: by_key[(s["traceId"], s["spanId"])] for name, s in named.items()}


def descendants_in_process(spans: List[Dict[str, Any]], root: Dict[str, Any]) -> List[Dict[str, Any]]:
    out, todo = [], [root]
    while todo:
        current = todo.pop()
        kids = [s for s in spans if s["parentSpanId"] == current["spanId"] and s["resource"] == root["resource"]]
        out += kids
        todo += kids
    return out


# --------------------------------------------------------------------------- tests


def test_every_span_is_one_slice_with_its_name_times_and_attributes(tmp_path):
    run, _ = v0_run()
    written, trace, spans = convert(tmp_path, run)
    assert written.spans == written.slices == len(spans) == len(trace.slices) and written.left_out == {}
    assert set(trace.by_span) == {key(s) for s in spans}
    for span in spans:
        piece = trace.by_span[key(span)]
        assert piece["name"] == span["name"]
        assert piece["ts"] == span["startTimeUnixNano"]
        assert piece["dur"] == span["endTimeUnixNano"] - span["startTimeUnixNano"]
        assert {k: v for k, v in piece["args"].items() if not k.startswith("otel.")} == span["attributes"]
        assert piece["args"].get("otel.parent_span_id") == span["parentSpanId"]
    fit = next(s for s in trace.slices if s["name"] == "verl.fit")
    assert fit["dur"] == 0  # a span that lasts no time is an instant


def test_a_process_track_per_role_and_replica(tmp_path):
    run, _ = v0_run()
    _, trace, spans = convert(tmp_path, run)
    processes = trace.processes()
    assert set(processes) == {"trainer", "rollout worker 0", "rollout worker 1", "LLM server 0", "LLM server 1",
                              "reward worker", "sglang"}
    pids = [t.process.pid for t in processes.values()]
    assert len(set(pids)) == len(pids)
    assert processes["trainer"].process.pid == 100 and processes["LLM server 1"].process.pid == 301
    # the two workers share pid 200 on two hosts: one keeps it, the other gets a pid no process can have
    assert sorted(processes[f"rollout worker {i}"].process.pid for i in (0, 1))[0] == 200
    assert sorted(processes[f"rollout worker {i}"].process.pid for i in (0, 1))[1] > 1 << 22
    for span in spans:
        labels = set(trace.process_of(trace.by_span[key(span)]["track"]).process.process_labels)
        expected = {f"{k}={v}" for k, v in span["resource"].items()
                    if k in ("service.name", "host.name", "process.pid", "service.instance.id")}
        assert expected <= labels, (span["name"], labels)


def test_one_track_per_trajectory_with_its_turns_tools_and_reward(tmp_path):
    run, named = v0_run()
    _, trace, spans = convert(tmp_path, run)
    named = flat(named, spans)
    trajectories = [s for s in spans if s["name"].startswith("invoke_agent")]
    tracks = {t.name: t for t in trace.tracks.values()
              if t.name.startswith("trajectory ") and trace.tracks[t.parent_uuid].HasField("process")}
    assert len(tracks) == len(trajectories) == 4
    for traj in trajectories:
        name = f"trajectory {traj['attributes']['verl.uid']}/{traj['attributes']['verl.traj_uid']}"
        on_it = {k for k, s in trace.by_span.items() if trace.family_of(s["track"]).uuid == tracks[name].uuid}
        assert on_it == {key(traj)} | {key(s) for s in descendants_in_process(spans, traj)}
        assert trace.by_span[key(traj)]["track"] == tracks[name].uuid
        assert trace.process_of(tracks[name].uuid).process.process_name.startswith("rollout worker")
    # the second of two tool calls running at once goes to an overlap lane of its trajectory
    tool_2 = trace.by_span[key(named["A/0 tool 2"])]
    assert trace.tracks[tool_2["track"]].name == f"trajectory {UID_A}/0 #2"
    assert trace.by_span[key(named["A/0 tool 1"])]["track"] == tracks[f"trajectory {UID_A}/0"].uuid


def test_slices_on_every_track_nest(tmp_path):
    """The trace processor stacks the slices of a track: any two of them must be disjoint
    or one inside the other, and each sits inside the slice below it."""
    run, named = v0_run()
    _, trace, spans = convert(tmp_path, run)
    named = flat(named, spans)
    per_track = defaultdict(list)
    for piece in trace.slices:
        per_track[piece["track"]].append(piece)
    for pieces in per_track.values():
        for a in pieces:
            for b in pieces:
                if a is b:
                    continue
                a_end, b_end = a["ts"] + a["dur"], b["ts"] + b["dur"]
                disjoint = a_end <= b["ts"] or b_end <= a["ts"]
                nested = (a["ts"] <= b["ts"] and b_end <= a_end) or (b["ts"] <= a["ts"] and a_end <= b_end)
                assert disjoint or nested, (a["name"], b["name"])
    # a turn sits inside its trajectory; the trainer's stages inside their step
    assert trace.by_span[key(named["A/0 chat 1"])]["depth"] == 1
    assert trace.by_span[key(named["A/0 scheduler"])]["depth"] == 1
    # server 0's two overlapping requests: two lanes of its requests track
    lanes = {trace.tracks[trace.by_span[key(named[n])]["track"]].name for n in ("A/0 server 1", "A/1 server 1")}
    assert lanes == {"requests", "requests #2"}


def test_the_trainers_steps_and_samples(tmp_path):
    run, _ = v0_run()
    _, trace, spans = convert(tmp_path, run)
    for span in spans:
        track = trace.family_of(trace.by_span[key(span)]["track"])
        if span["name"].startswith(("verl.step", "verl.stage ", "verl.fit")):
            assert track.name == "steps"
        elif span["name"].startswith(("verl.sample", "verl.rollout")):
            assert track.name == f"sample {span['attributes']['verl.uid']}"
        elif span["name"] == "verl.reward_worker.compute_score":
            assert track.name == "reward requests"
        elif span["resource"].get("verl.role") in ("llm_server", None):
            assert track.name == "requests"  # verl's server spans; the engine's request spans
        else:
            assert track.name.startswith("trajectory ")


def test_a_flow_follows_each_trajectory_from_dispatch_to_the_stage_that_trained_it(tmp_path):
    run, named = v0_run()
    _, trace, spans = convert(tmp_path, run)
    named = flat(named, spans)
    expected = {}
    for traj in ("A/0", "A/1", "B/0", "B/1"):
        uid = traj[0].lower()
        turns = [s for name, s in named.items() if name.startswith(traj + " ")
                 and not name.startswith(f"{traj} tool")]  # turns, their server and engine spans
        chain = [named[f"rollout {uid}"], named[traj], *turns, named[f"update stage {uid}"]]
        expected[key(named[traj])] = [key(s) for s in sorted(chain, key=lambda s: s["startTimeUnixNano"])]
    found = {}
    for flow, pieces in trace.flows.items():
        assert trace.terminated[flow] is pieces[-1]
        ids = [(p["args"]["otel.trace_id"], p["args"]["otel.span_id"]) for p in pieces]
        trajectory = next(i for i in ids if trace.by_span[i]["name"].startswith("invoke_agent"))
        found[trajectory] = ids
    assert found == expected


def test_a_v1_flow_goes_through_its_prompt_task_and_ends_at_the_last_stage_listing_it(tmp_path):
    run = Run()
    trainer = run.process("trainer", "trainer", 100)
    worker = run.process("w0", "agent_loop_worker", 200)
    sample = run.span(trainer, "verl.sample", 0, 900, trace=trace_of(UID_A), verl__uid=UID_A)
    rollout = run.span(trainer, "verl.rollout", 10, 500, sample, verl__uid=UID_A)
    task = run.span(worker, "verl.prompt_task", 20, 480, rollout, verl__uid=UID_A)
    kept = trajectory(run, worker, task, UID_A, "s0", 30, 400)
    turn = chat(run, worker, kept, 40, 300)
    dropped = trajectory(run, worker, task, UID_A, "s1", 35, 450)  # listed by no stage: its flow ends with it
    sampled = run.span(trainer, "verl.sample_stage sample", 600, 610, sample, verl__uid=UID_A, verl__stage="sample",
                       verl__traj_uids=["s0"])
    filtered = run.span(trainer, "verl.sample_stage filter", 620, 630, sample, verl__uid=UID_A, verl__stage="filter",
                        verl__traj_uids=["s0"])
    written, trace, _ = convert(tmp_path, run)
    flows = sorted([[(p["args"]["otel.span_id"]) for p in pieces] for pieces in trace.flows.values()])
    assert written.flows == 2
    assert flows == sorted([[s["spanId"] for s in (rollout, task, kept, turn, filtered)],
                            [s["spanId"] for s in (rollout, task, dropped)]])
    assert sampled["spanId"] not in {i for f in flows for i in f}
    prompt_track = trace.tracks[trace.by_span[(trace_of(UID_A), task["spanId"])]["track"]]
    assert prompt_track.name == f"prompt {UID_A}"


def _open_at(spans: List[Dict[str, Any]], ts: int) -> int:
    return sum(s["startTimeUnixNano"] <= ts < s["endTimeUnixNano"] for s in spans)


def test_counters_of_each_worker_and_server(tmp_path):
    run, _ = v0_run()
    written, trace, spans = convert(tmp_path, run)
    counters = {(trace.process_of(uuid).process.process_name, trace.tracks[uuid].name): points
                for uuid, points in trace.counters.items()}
    assert set(counters) == {
        *((f"rollout worker {i}", name) for i in (0, 1)
          for name in ("trajectories in flight", "LLM calls in flight", "output tokens/s")),
        *((f"LLM server {i}", name) for i in (0, 1) for name in ("requests in flight", "output tokens/s"))}
    assert written.counter_tracks == len(counters)
    assert written.counter_points == sum(map(len, counters.values()))
    processes = {t.process.process_name: t for t in trace.processes().values()}

    def of(process: str, predicate) -> List[Dict[str, Any]]:
        labels = set(processes[process].process.process_labels)
        return [s for s in spans if predicate(s) and f"service.instance.id={s['resource']['service.instance.id']}" in labels]

    for (process, name), points in counters.items():
        if name == "output tokens/s":
            continue
        members = of(process, {
            "trajectories in flight": lambda s: s["name"].startswith("invoke_agent"),
            "LLM calls in flight": lambda s: s["name"].startswith("chat "),
            "requests in flight": lambda s: s["name"] == "verl.llm_server.generate"}[name])
        assert points and points[-1][1] == 0
        changes = sorted({s["startTimeUnixNano"] for s in members} | {s["endTimeUnixNano"] for s in members})
        assert [ts for ts, _ in points] == changes
        for ts, value in points:
            assert value == _open_at(members, ts), (process, name, ts)
    # tokens/s, summed over its bins, gives every output token back
    chats = {p: sum(s["attributes"]["gen_ai.usage.output_tokens"] for s in of(p, lambda s: s["name"].startswith("chat ")))
             for p in ("rollout worker 0", "rollout worker 1")}
    assert chats == {"rollout worker 0": 160, "rollout worker 1": 200}
    server_tokens = {"LLM server 0": 50 + 80, "LLM server 1": 30 + 100 + 100}  # 80: the count of its chat
    for process, total in {**chats, **server_tokens}.items():
        points = counters[(process, "output tokens/s")]
        assert points[-1][1] == 0.0
        tokens = sum(rate * (next_ts - ts) / 1e9 for (ts, rate), (next_ts, _) in zip(points, points[1:]))
        assert tokens == pytest.approx(total)


def test_left_out_spans_are_counted_by_reason(tmp_path):
    run, _ = v0_run()
    no_start = run.span("w0", "verl.reward", None, 10)
    backwards = run.span("w0", "verl.reward", 50, 40)
    trace_dir = run.write(tmp_path / "run")
    files = sorted(os.path.join(trace_dir, "otlp", f) for f in os.listdir(os.path.join(trace_dir, "otlp")))
    out = str(tmp_path / "run.pftrace")
    written = perfetto.write_spans(spans_from_files([*files, files[0]]), out)  # one file given twice
    duplicates = len(run.spans[os.path.basename(files[0])[len("spans-"):-len(".jsonl")]])
    assert written.left_out == {"duplicate": duplicates, "no_start_time": 1, "ends_before_start": 1}
    trace = Trace(out)
    spans = spans_from_files(files)
    assert written.slices == len(trace.slices) == len(spans) - 2
    assert not {key(no_start), key(backwards)} & set(trace.by_span)
    assert written.spans == len(spans) + duplicates
    assert written.lines()[1:] == [
        f"perfetto: left out {duplicates} span(s): the same trace and span id as a span already read "
        "(a file given twice, or a collector's copy)",
        "perfetto: left out 1 span(s): no start time",
        "perfetto: left out 1 span(s): ends before it starts"]


# --------------------------------------------------------------------------- the command


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_report_perfetto_writes_the_file_and_says_what_it_holds(tmp_path):
    run, _ = v0_run()
    trace_dir = run.write(tmp_path / "run")
    out = tmp_path / "run.pftrace"
    result = cli("report", trace_dir, "--perfetto", str(out))
    assert result.exit_code == 0, result.output
    trace = Trace(str(out))
    lines = [line for line in result.stdout.splitlines() if line.startswith("perfetto: ")]
    assert lines == [f"perfetto: {out} ({out.stat().st_size / 1e6:.1f} MB): {len(trace.slices)} slices of "
                     f"{len(trace.slices)} spans on {len({s['track'] for s in trace.slices})} tracks (4 trajectories) "
                     f"in 7 processes, 4 flows, {len(trace.counters)} counter tracks "
                     f"({sum(map(len, trace.counters.values()))} points)",
                     "perfetto: left out none"]
    result = cli("report", trace_dir, "--json", "--perfetto", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)["perfetto"]
    assert data["slices"] == len(trace.slices) and data["bytes"] == out.stat().st_size and data["left_out"] == {}


def _one_line_error(result, needle: str) -> None:
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and needle in lines[0], result.stderr


def test_report_perfetto_bad_paths_are_one_line_errors(tmp_path):
    run, _ = v0_run()
    trace_dir = run.write(tmp_path / "run")
    (tmp_path / "empty").mkdir()
    _one_line_error(cli("report", str(tmp_path / "empty"), "--perfetto", str(tmp_path / "x.pftrace")), "no OTLP-JSON files")
    _one_line_error(cli("report", trace_dir, "--perfetto", str(tmp_path / "missing" / "x.pftrace")),
                    "cannot write the Perfetto trace (No such file or directory)")
    _one_line_error(cli("report", trace_dir, trace_dir, "--compare", "--perfetto", str(tmp_path / "x.pftrace")),
                    "--perfetto writes one run")
    assert sorted(os.listdir(tmp_path)) == ["empty", "run"]


def test_without_the_perfetto_package_the_option_says_how_to_install_it(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "perfetto" else find_spec(name, *a))
    run, _ = v0_run()
    result = cli("report", run.write(tmp_path / "run"), "--perfetto", str(tmp_path / "x.pftrace"))
    _one_line_error(result, "--perfetto: needs the perfetto package: pip install 'otel-verl[report]'")
    assert not (tmp_path / "x.pftrace").exists()


def test_a_file_that_cannot_be_written_leaves_nothing_behind(tmp_path):
    run, _ = v0_run()
    trace_dir = run.write(tmp_path / "run")
    (tmp_path / "taken").mkdir()  # the trace goes to a temporary file first; it cannot replace a directory
    with pytest.raises(perfetto.OutputError, match="taken: cannot write the Perfetto trace"):
        perfetto.write_spans(spans_from_files(os.path.join(trace_dir, "otlp")), str(tmp_path / "taken"))
    assert sorted(os.listdir(tmp_path)) == ["run", "taken"] and not os.listdir(tmp_path / "taken")


def test_the_file_follows_the_umask_as_the_png_and_json_do(tmp_path):
    run, _ = v0_run()
    trace_dir = run.write(tmp_path / "run")
    before = os.umask(0o022)
    try:
        perfetto.write_spans(spans_from_files(os.path.join(trace_dir, "otlp")), str(tmp_path / "shared.pftrace"))
        os.umask(0o027)
        perfetto.write_spans(spans_from_files(os.path.join(trace_dir, "otlp")), str(tmp_path / "group.pftrace"))
    finally:
        os.umask(before)
    assert stat.S_IMODE(os.stat(tmp_path / "shared.pftrace").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "group.pftrace").st_mode) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["group.pftrace", "run", "shared.pftrace"]  # no temporary file left


def test_lone_surrogates_in_any_text_become_replacement_characters(tmp_path):
    """A span name, attribute key and value, event name, status message and resource with a
    lone surrogate each (the Perfetto protos refuse them): written with U+FFFD, said once."""
    run = Run()
    worker = run.process("w", "agent_loop_worker", 7, host="node-\udc80")
    span = run.span(worker, "step-\udc80", 0, 10, **{"key-\ud800": "value-\udfff"})
    span["events"] = [{"name": "event-\udc81", "timeUnixNano": span["startTimeUnixNano"]}]
    span["status"] = {"code": 2, "message": "failed-\ud83d"}
    out = tmp_path / "run.pftrace"
    result = cli("report", run.write(tmp_path / "run"), "--perfetto", str(out))
    assert result.exit_code == 0, result.output
    assert "character(s) not well-formed UTF-8" in result.stderr
    trace = Trace(str(out))
    (only,) = trace.slices
    assert only["name"] == "step-\ufffd"
    assert only["args"]["key-\ufffd"] == "value-\ufffd"
    assert only["args"]["otel.events"] == ["event-\ufffd at +0.000 ms"]
    assert only["args"]["otel.status_message"] == "failed-\ufffd"
    assert "host.name=node-\ufffd" in trace.process_of(only["track"]).process.process_labels


# --------------------------------------------------------------------------- a real demo


@pytest.fixture(scope="module")
def demo(shared_demo):
    return shared_demo(2, 4, 2)


def check_run_in_perfetto(trace_dir, out) -> Tuple["Trace", List[Dict[str, Any]]]:
    """``otel-verl report TRACE_DIR --perfetto OUT`` on a demo run, read back: every span of
    the run is one slice with its name and times, and each trajectory that was trained is
    one flow from its dispatch through its turns to the stage that trained it."""
    result = cli("report", str(trace_dir), "--perfetto", str(out))
    assert result.exit_code == 0, result.output
    assert "perfetto: left out none" in result.stdout
    trace = Trace(str(out))
    spans = spans_from_files(os.path.join(str(trace_dir), "otlp"))
    assert set(trace.by_span) == {key(s) for s in spans}
    for span in spans:
        piece = trace.by_span[key(span)]
        assert (piece["name"], piece["ts"], piece["dur"]) == (
            span["name"], span["startTimeUnixNano"], span["endTimeUnixNano"] - span["startTimeUnixNano"])
    trajectories = [s for s in spans if s["name"].startswith("invoke_agent")]
    assert sum(t.name.startswith("trajectory ") for t in trace.tracks.values()) == len(trajectories)

    def listed_by(stage_prefix):
        return {(s["attributes"]["verl.uid"], t) for s in spans if s["name"].startswith(stage_prefix)
                for t in s["attributes"]["verl.traj_uids"]}

    trained, staged = listed_by("verl.sample_stage update_actor"), listed_by("verl.sample_stage ")
    # a flow for each trajectory, to the stage that trained it where one did (v1's sample stage
    # takes some that are never trained; a run that ends leaves others to no stage)
    assert len(trace.flows) == len(trajectories) > 0
    by_key = {key(s): s for s in spans}
    ends = {"trained": 0, "staged": 0, "none": 0}
    for pieces in trace.flows.values():
        chain = [by_key[(p["args"]["otel.trace_id"], p["args"]["otel.span_id"])] for p in pieces]
        traj = next(s for s in chain if s["name"].startswith("invoke_agent"))
        ancestors, parent = [], by_key.get((traj["traceId"], traj["parentSpanId"]))
        while parent is not None:
            ancestors.append(parent["name"])
            parent = by_key.get((parent["traceId"], parent["parentSpanId"]))
        if {"verl.rollout", "verl.sample"} & set(ancestors):
            assert chain[0]["name"] in ("verl.rollout", "verl.sample")
        else:  # its dispatch never ended: an async run ended while its prompt was in flight
            assert chain[0]["name"] in ("verl.prompt_task", traj["name"])
        ids = (traj["attributes"]["verl.uid"], traj["attributes"]["verl.traj_uid"])
        if ids in trained:
            assert chain[-1]["name"] == "verl.sample_stage update_actor"
            ends["trained"] += 1
        elif ids in staged:
            assert chain[-1]["name"].startswith("verl.sample_stage ")
            ends["staged"] += 1
        else:
            assert not any(s["name"].startswith("verl.sample_stage") for s in chain)
            ends["none"] += 1
        turns = [s for s in spans if s["parentSpanId"] == traj["spanId"] and s["name"].startswith("chat ")]
        assert turns and all(key(t) in {key(s) for s in chain} for t in turns)
    assert ends["trained"] > 0
    return trace, spans


@pytest.mark.e2e
@pytest.mark.verl
@pytest.mark.timeout(900)
def test_a_demo_run_in_perfetto(demo, tmp_path):
    trace_dir, _ = demo
    trace, spans = check_run_in_perfetto(trace_dir, tmp_path / "demo.pftrace")
    names = set(trace.processes())
    assert {"trainer", "LLM server", "reward worker"} <= names and {"rollout worker 0", "rollout worker 1"} <= names
    trajectories = [s for s in spans if s["name"].startswith("invoke_agent")]
    assert len(trajectories) == 2 * 4 * 2 == len(trace.flows)  # v0 trains every trajectory of its step
    by_key = {key(s): s for s in spans}
    for pieces in trace.flows.values():
        chain = [by_key[(p["args"]["otel.trace_id"], p["args"]["otel.span_id"])] for p in pieces]
        assert chain[0]["name"] == "verl.rollout"
        traj = next(s for s in chain if s["name"].startswith("invoke_agent"))
        turns = [s for s in spans if s["parentSpanId"] == traj["spanId"] and s["name"].startswith("chat ")]
        assert len(turns) == 2
        assert sum(s["name"] == "verl.llm_server.generate" for s in chain) == len(turns)
    counters = {(trace.process_of(u).process.process_name, trace.tracks[u].name) for u in trace.counters}
    assert ("LLM server", "requests in flight") in counters and ("LLM server", "output tokens/s") in counters
    assert {("rollout worker 0", "trajectories in flight"), ("rollout worker 1", "trajectories in flight")} <= counters
