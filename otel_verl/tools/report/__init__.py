"""``otel-verl report``: where a run's time went, read back from its spans.

Input: a trace dir (``{trace_dir}/otlp/*.jsonl`` and the legacy files next to it), or
OTLP-JSON files / directories written by otel_verl or by the Collector's file exporter
(same format), loaded into the span store; or a ClickHouse server's store. The report is
SQL on the store's views (:func:`otel_verl.tools.store.report.read`), a JSON-ready dict;
this package defines its figures (:mod:`.analysis`, :mod:`.tail`, :mod:`.spans`) and
renders it (:mod:`.text`, :mod:`.timeline`, :mod:`.compare`, :mod:`.perfetto`):

- ``inputs``: files, lines, spans, traces, ``truncated`` (last lines cut short, skipped),
  ``repaired`` (texts not well-formed UTF-8, read as U+FFFD), ``skipped_files`` (FIFOs,
  sockets, devices, directories where a file was expected);
- ``steps``: per ``verl.global_step`` the step span's duration, each stage's time
  (``stage_order`` gives the columns) and ``other_s`` (step time no stage covers);
- ``stage_overlap``: per step ``stages_union_s`` (the time any stage ran),
  ``concurrent_stages`` (those that ran while another did) and ``concurrent_s`` (what the
  stages' times add beyond their union; 0 when they ran one after another);
- ``rollout_latency``: per step, p50/p90/p99/max of the trajectory span durations;
- ``slowest_trajectories``: the slowest trajectories split into LLM (client; and the
  server's queue / prefill / decode when it reported them), tools, reward, other;
- ``samples``: ``verl.sample`` outcomes and the samples that never finished;
- ``losses``: otel_verl's loss and failure counters from a trace dir's metric files
  (``recorded``: ``{"dropped": {output: n}, "failures": {where: n}}``, ``None`` without
  metric files), SDK span-limit drops, and the legacy-files-vs-spans consistency checks;
- ``timeline`` (with ``--png``): per step, stage and trajectory bars for :func:`timeline.draw`;
- ``tail``: per step the critical-path trajectory and its replica, the busiest and idlest
  replica, the training and rollout sides' waits, and the staleness histogram
  (:mod:`otel_verl.tools.report.tail` defines them);
- ``shape``: trainer, layout, sync / async, prompts per step, n, steps;
- ``no_spans``: ``None``, or for a trace dir without spans why (``reason``: ``collector``,
  the run sent them over OTLP; ``span files missing``; ``empty``), the ``line`` that says
  so and where to report on them, and the ``runs`` its loss files name. The sections
  that read spans are then empty, the legacy-files-vs-spans checks left out.

:func:`otel_verl.tools.report.compare.compare` puts two runs' reports side by side
(``otel-verl report --compare A B``).

:func:`otel_verl.tools.report.text.render` prints it as tables; :func:`otel_verl.tools.report.timeline.draw`
draws the PNG.
"""

from otel_verl.tools.report.inputs import InputError

__all__ = ["InputError"]
