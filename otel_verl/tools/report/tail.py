"""The tail of each step, explained: which trajectory set the step's rollout wall clock,
on which LLM server replica, how loaded the replicas were, how long each side of the
loop waited for the other, and how stale the trained samples were.

Definitions (docs/REPORT.md says the same):

- A step's **trajectories** are the training trajectory spans (``invoke_agent``, not
  ``verl.validate``) that step trained: the ``verl.global_step`` of the
  ``verl.sample_stage`` spans that list the trajectory in ``verl.traj_uids`` (the earliest,
  should several steps list it), else of its sample's stage spans, else its sample root's
  ``verl.trained_step``. In the sync modes a trajectory no step trained belongs to the step
  that generated it (its own ``verl.global_step``); in the async ones, where a step trains
  what earlier weights generated, it gated no step and is counted as ``untrained``. Each
  row says the **generation steps** of its trajectories. A step's **rollout window** runs
  from the first one's start to the last one's end.
- The **critical-path trajectory** is the one that ended last (ties: the longer one): it
  set the end of the rollout window. Its split is :func:`spans.trajectory_split`'s, as
  for the slowest trajectories.
- An **engine request** is what one replica served: a ``verl.llm_server.generate`` span
  (under its ``chat`` turn, or under the turn's ``verl.llm.attempt`` when verl's client
  resumed it), else, without a server span, the attempt or the turn itself when it names
  its server. Its **replica** is the turn's (or attempt's) ``verl.llm.server_id``, else the
  server span's process (``ray.actor_id``, else ``service.instance.id``). The replica of a
  trajectory is the one that served the most of its requests' time.
- A replica's **busy time** in a step is the union of its engine requests' intervals
  within the step's rollout window (requests of any training trajectory: what the replica
  did during that window), its **requests** those overlapping the window. Every replica
  seen in the run is ranked, so one that served nothing in the step is the idlest with 0.
- The **training side's wait** in a step is the part of its ``verl.step`` span in which
  the trainer waits for samples: the ``generation`` and ``fetch_batch`` stages (v1's
  ``generation`` is its replay-buffer wait) and the gap from the step's start to its first
  other stage. The **rollout side's wait** is the part of the same span in which no
  training trajectory runs; a trajectory runs from its start to its end except between an
  aborted engine request and the attempt that resumes it (a weight sync's pause). One
  rule for every layout: in the sync ones it comes to the rollout (training waits) and the
  training stages (rollout idles); in ``colocate_async`` / ``separate_async`` it is what
  the spans' overlap leaves.
- The **staleness** histogram counts the ``verl.sample`` roots by ``verl.staleness`` (the
  weight updates between the oldest weights behind the sample and the ones its training
  step trains, as verl counts it: docs/SPANS.md, "Lineage") per ``verl.trained_step``;
  roots without both attributes are left out.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

from otel_verl import semconv as sc
from otel_verl.tools.report.spans import SpanIndex, is_llm_call

SAMPLE_STAGE_PREFIX = sc.sample_stage_span_name("")
WAITING_STAGES = (sc.Stage.GENERATION.value, sc.Stage.FETCH_BATCH.value)  # the trainer waits for samples
NO_LINEAGE = "no lineage in these spans"

Interval = Tuple[int, int]
Request = Tuple[str, int, int]  # (replica, start ns, end ns)


def _replica_of_process(resource: Dict[str, Any]) -> Optional[str]:
    value = resource.get(sc.RAY_ACTOR_ID) or resource.get(sc.SERVICE_INSTANCE_ID)
    return str(value) if value else None


def engine_requests(traj: Dict[str, Any], index: SpanIndex) -> List[Request]:
    """The trajectory's engine requests as ``(replica, start, end)``; requests whose
    replica is unknown are left out."""
    out: List[Request] = []
    for turn in (s for s in index.descendants(traj) if is_llm_call(s)):
        attempts = [c for c in index.children_of(turn) if c["name"] == sc.SPAN_LLM_ATTEMPT]
        for unit in [turn, *attempts]:
            named = unit["attributes"].get(sc.LLM_SERVER_ID) or turn["attributes"].get(sc.LLM_SERVER_ID)
            servers = [c for c in index.children_of(unit) if c["name"] == sc.SPAN_LLM_SERVER]
            for server in servers:
                replica = str(named) if named else _replica_of_process(server.get("resource") or {})
                if replica:
                    out.append((replica, server["startTimeUnixNano"], server["endTimeUnixNano"]))
            # a turn with attempts is no request of its own: its attempts are
            if not servers and named and (unit is not turn or not attempts):
                out.append((str(named), unit["startTimeUnixNano"], unit["endTimeUnixNano"]))
    return out


def main_replica(requests: List[Request]) -> Optional[str]:
    """The replica that served the most of ``requests``' time (ties: by name)."""
    served: Dict[str, int] = defaultdict(int)
    for replica, start, end in requests:
        served[replica] += end - start
    return min(served, key=lambda r: (-served[r], r)) if served else None


def load_rank(load: Dict[str, Any]) -> Tuple[float, int, str]:
    """How a window's replicas rank from idlest to busiest: busy time, then requests, then name."""
    return load["busy_s"], load["requests"], load["replica"]












