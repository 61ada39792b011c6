"""The legacy outputs: the files an existing pipeline reads, byte for byte as the seed
wrote them (``docs/LEGACY_FORMATS.md``).

:mod:`.sample_csv`, :mod:`.progress_log`, :mod:`.trajectory_jsonl`: one span processor per
file, over the shared background writer of :mod:`otel_verl.exporters._writer`. They read
span records: their attributes, and of a rollout's spans the payload's data
(:mod:`otel_verl.rollout_data`: a trajectory's turns and token ids, a rollout's dispatch).
Their rows, the rows' order and every rule of the seed's are here; nothing else in
otel_verl knows these formats. The outputs module (:mod:`otel_verl.outputs`) makes them
with :func:`outputs`.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

__all__ = ["outputs"]


def outputs(settings: Any) -> List[Tuple[type, Callable[[], Any]]]:
    """The legacy outputs of a process with ``settings``, each as its class and its maker:
    the progress log (stdout, and its files with a trace dir), and with a trace dir the CSV
    and the trajectory JSONL."""
    from otel_verl.legacy.progress_log import ProgressLogProcessor

    planned: List[Tuple[type, Callable[[], Any]]] = [(ProgressLogProcessor, lambda: ProgressLogProcessor(
        settings.trace_dir, max_pending_bytes=settings.max_queue_bytes))]
    if settings.trace_dir:
        from otel_verl.legacy.sample_csv import SampleCsvProcessor
        from otel_verl.legacy.trajectory_jsonl import TrajectoryJsonlProcessor

        planned.append((SampleCsvProcessor, lambda: SampleCsvProcessor(
            settings.trace_dir, flow_stdout=settings.flow_stdout, max_pending_bytes=settings.max_queue_bytes)))
        planned.append((TrajectoryJsonlProcessor, lambda: TrajectoryJsonlProcessor(
            settings.trace_dir, max_file_bytes=settings.jsonl_max_bytes, max_pending_bytes=settings.max_queue_bytes,
            max_text_chars=settings.jsonl_max_text_chars)))
    return planned
