"""CPU per span of otel_verl's OTLP encoders against the SDK's, on the demo's span shapes.

    python benchmarks/bench_otlp_encoder.py            # 256 prompts x 4 trajectories, best of 5
    python benchmarks/bench_otlp_encoder.py --quick    # 16 x 2, once: only checks that it works

The spans are the real ones: a training step of single-turn trajectories goes through
otel_verl's events API into an SDK TracerProvider with a resource as bootstrap builds it
(the trajectory, its chat span with ~12 attributes and the server's span under it, its
reward; the trainer's sample, rollout, sample-stage spans with their traj_uid lists and
links, the step and its stages). Each kind is encoded on its own, and the whole step in
batches of 512 as the BatchSpanProcessor hands them over:

- the SDK: ``encode_spans(spans).SerializeToString()`` on its ``ReadableSpan``s;
- ours: :class:`otel_verl.accelerated.otlp_encoding.ProtobufEncoder` (the same bytes, which
  is checked) and :class:`~otel_verl.accelerated.otlp_encoding.JsonEncoder`, each with the
  conversion of the spans into records that the exporter makes before encoding
  (``records_of``), and the protobuf encoding of the records alone.

The cyclic GC stays on, as in a traced process. ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.sdk.version import __version__ as SDK_VERSION  # noqa: E402

from otel_verl import events, health, settings  # noqa: E402
from otel_verl.accelerated.otlp_encoding import JsonEncoder, ProtobufEncoder, records_of  # noqa: E402
from otel_verl.instrumentation import tracing  # noqa: E402
from otel_verl.semconv import Outcome, Stage  # noqa: E402

from bench_sdk_costs import best_cpu_s  # noqa: E402  (this folder: the same CPU timing)

BATCH = 512  # the BatchSpanProcessor's default export batch
TRAINER = "RayPPOTrainer"
SERVER_META = {"prompt_tokens": 128, "completion_tokens": 256, "cached_tokens": 0, "e2e_latency": 0.5,
               "queue_time": 0.02, "prefill_launch_latency": 0.01, "request_received_ts": 1.7e9,
               "prefill_finished_ts": 1.7e9 + 0.03}
KINDS = {  # label -> which span names
    "chat": lambda name: name.startswith("chat "),
    "trajectory": lambda name: name.startswith("invoke_agent"),
    "stage": lambda name: name.startswith(("verl.sample_stage", "verl.stage", "verl.step")),
}


def run_step(prompts: int, trajectories: int) -> List[Any]:
    """One colocated step of ``prompts`` x ``trajectories`` single-turn trajectories."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({
        "service.name": "verl-rollout-worker", "service.namespace": "verl", "verl.role": "agent_loop_worker",
        "service.instance.id": "0b6f5d0e-8f4b-4f7e-9d51-4e0c0f6a1c11", "verl.run_id": "run-20261203-0001",
        "host.name": "node-17", "process.pid": 41234, "ray.job_id": "02000000", "ray.node_id": "f" * 56}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    if not tracing.use_provider(provider, settings.load({"OTEL_VERL_ENABLED": "1"})):
        raise RuntimeError("the events API did not take the provider")
    uids = [f"6f1c3a0e-1111-2222-3333-{i:012x}" for i in range(prompts)]
    rows_uids = [u for u in uids for _ in range(trajectories)]
    rows_trajs = [str(i) for _ in uids for i in range(trajectories)]
    events.step_begin(1, trainer=TRAINER, epoch=0, consumed_batches=0)
    with events.step_stage(Stage.GENERATION, step=1):
        events.samples_created(uids, step=1, trainer=TRAINER)
        carriers = events.rollout_dispatched(rows_uids, rows_trajs, [i % 4 for i in range(len(rows_uids))],
                                             step=1, trainer=TRAINER) or [None] * len(rows_uids)
        for i, (uid, traj, carrier) in enumerate(zip(rows_uids, rows_trajs, carriers)):
            with events.trajectory(uid, traj, step=1, agent_name="single_turn_agent", parent=carrier,
                                   n_samples=trajectories, provider="sglang", worker_index=i % 4):
                with events.agent_run("SingleTurnAgentLoop"):
                    with events.llm_call(list(range(128)), model="Qwen2.5-7B-Instruct", provider="sglang",
                                         request_id=f"req-{i}", max_tokens=256, temperature=1.0, top_p=1.0) as turn:
                        with events.llm_server_call(turn.carrier(), request_id=f"req-{i}", provider="sglang") as server:
                            server.record_meta(SERVER_META)
                        turn.finish(list(range(256)), stop_reason="stop", server_meta=dict(SERVER_META))
                with events.reward() as reward:
                    reward.score(1.0)
        events.rollout_returned(uids)
    for stage in (Stage.REWARD, Stage.OLD_LOG_PROB, Stage.ADVANTAGE, Stage.UPDATE_ACTOR):
        started = time.time_ns()
        with events.step_stage(stage, step=1):
            events.sample_stage_done(stage, rows_uids, rows_trajs, step=1, start_ns=started, trainer=TRAINER)
    events.samples_finished(uids, Outcome.TRAINED)
    events.step_end()
    spans = list(exporter.get_finished_spans())
    provider.shutdown()
    tracing.stop()
    return spans


def batches(items: List[Any]) -> List[List[Any]]:
    return [items[i:i + BATCH] for i in range(0, len(items), BATCH)]


def measure(spans: List[Any], rounds: int) -> Dict[str, float]:
    """µs per span: the SDK's protobuf encoding, ours, our JSON; and the bytes per span."""
    sdk_batches = batches(spans)
    record_batches = [records_of(batch) for batch in sdk_batches]
    proto, json_encoder = ProtobufEncoder(), JsonEncoder()
    ours = [proto.encode(batch) for batch in record_batches]
    theirs = [encode_spans(batch).SerializeToString() for batch in sdk_batches]
    if ours != theirs:
        raise AssertionError("otel_verl's protobuf bytes differ from the SDK's")
    if proto.sdk_batches:
        raise AssertionError("a batch went through the SDK's encoder")
    n = len(spans)
    return {
        "spans": n,
        "attributes_per_span": sum(len(span.attributes) for span in spans) / n,
        "sdk_us": best_cpu_s(lambda: [encode_spans(b).SerializeToString() for b in sdk_batches], rounds) / n * 1e6,
        "ours_us": best_cpu_s(lambda: [proto.encode(records_of(b)) for b in sdk_batches], rounds) / n * 1e6,
        "ours_encoding_us": best_cpu_s(lambda: [proto.encode(b) for b in record_batches], rounds) / n * 1e6,
        "ours_json_us": best_cpu_s(lambda: [json_encoder.encode(records_of(b)) for b in sdk_batches], rounds) / n * 1e6,
        "bytes_per_span": sum(map(len, ours)) / n,
    }


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 prompts x 2 trajectories, once: checks that it works")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    prompts, trajectories, rounds = (16, 2, 1) if args.quick else (256, 4, 5)
    spans = run_step(prompts, trajectories)
    rows: Dict[str, Dict[str, float]] = {}
    for label, matches in KINDS.items():
        rows[label] = measure([span for span in spans if matches(span.name)], rounds)
    rows["whole step"] = measure(spans, rounds)
    print(f"opentelemetry-sdk {SDK_VERSION}, {prompts} prompts x {trajectories} single-turn trajectories "
          f"({len(spans)} spans), batches of {BATCH}, GC on, best of {rounds}")
    print("us/span; ours = records_of + encode, as the exporter does; (encode) = the records' encoding alone")
    print(f"{'spans':<12}{'count':>7}{'attrs':>7}{'SDK':>8}{'ours':>8}{'ratio':>7}{'(encode)':>10}"
          f"{'ours JSON':>11}{'bytes/span':>12}")
    for label, row in rows.items():
        print(f"{label:<12}{row['spans']:>7}{row['attributes_per_span']:>7.1f}{row['sdk_us']:>8.1f}"
              f"{row['ours_us']:>8.1f}{row['sdk_us'] / row['ours_us']:>6.1f}x{row['ours_encoding_us']:>10.1f}"
              f"{row['ours_json_us']:>11.1f}{row['bytes_per_span']:>12.0f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"sdk_version": SDK_VERSION, "rows": rows, "health": health.snapshot()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
