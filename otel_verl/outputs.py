"""The outputs of a process: every span processor that writes what its spans say.

An output declares its contract (:class:`Output`): the span starts and ends it reads, by
the subject of their payload; a flush and a shutdown within the deadline it is given;
what it holds unwritten (what it would lose should the process die now). :func:`build`
makes the outputs the settings ask for: the legacy files (:mod:`otel_verl.legacy`), the
OTLP-JSON files, OTLP, the span metrics, the ones ``OTEL_VERL_OUTPUTS`` names, and last
the loss file, which reads the others' counts. The configurator runs them in the traced
process, or the export process (:mod:`otel_verl.offload.host`) runs them on the spans
sent to it; which of those spans are sent, and which are made at all, follows from the
outputs' declarations (:func:`starts_read`, :func:`ends_read`), read off their classes
before any output is made.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Protocol, Tuple, runtime_checkable

from otel_verl import health
from otel_verl import settings as settings_mod
from otel_verl.semconv import Subject

logger = logging.getLogger("otel_verl")

Subjects = Optional[FrozenSet[Subject]]  # ``None``: every span, with a payload or without


@runtime_checkable
class Output(Protocol):
    """What the configurator and the export process know of an output. Its class declares
    ``on_start_subjects`` and ``on_end_subjects``: an output is called for no other span."""

    on_start_subjects: Subjects  # the spans whose start it reads (as they started)
    on_end_subjects: Subjects  # the spans whose end it reads (their SpanRecord)
    finish_order: int  # flushed and shut down after every output of a lower order
    writes_files: bool  # an export process answers a flush once it wrote what came before

    def on_start(self, span: Any, parent_context: Any = None) -> None: ...

    def on_end(self, span: Any) -> None: ...

    def force_flush(self, timeout_millis: int = 30000) -> bool: ...

    def shutdown(self, timeout_millis: Optional[int] = None) -> None:
        """Writes or counts as lost all it holds, within ``timeout_millis``."""

    def checkpoint(self) -> Callable[[Optional[float]], bool]:
        """A wait (``wait(timeout_s)``: whether in time) for what it got so far to be
        written or counted."""

    def pending(self) -> Dict[str, int]:
        """What it holds, neither written nor counted, by the output name its losses
        are counted under (:mod:`otel_verl.health`)."""


Planned = Tuple[type, Callable[[], Output]]  # (the class that declares what it reads, its maker)


def build(cfg: settings_mod.Settings, resource_attributes: Optional[dict] = None) -> List[Output]:
    """The outputs of a process with ``cfg`` (that of ``resource_attributes``). Each
    queues what it gets and writes from a thread of its own: none waits on another."""
    outputs: List[Output] = []
    for kind, make in plan(cfg):
        try:
            outputs.append(make())
        except settings_mod.ConfigError:
            raise  # the user's to fix: tracing stays off, saying why
        except Exception as exc:  # the other outputs go on
            health.record_failure(f"outputs.{kind.__name__}", exc)
    if cfg.trace_dir:
        from otel_verl.exporters.loss_file import LossFileProcessor

        outputs.append(LossFileProcessor(cfg.trace_dir, resource_attributes, outputs=outputs))
    return outputs


def plan(cfg: settings_mod.Settings) -> List[Planned]:
    """The outputs :func:`build` makes (the loss file aside: it reads no span), unmade."""
    from otel_verl import legacy

    planned: List[Planned] = list(legacy.outputs(cfg))
    if cfg.write_otlp_files:
        from otel_verl.accelerated.batch import BatchExportProcessor
        from otel_verl.exporters.otlp_json_file import OtlpJsonFileExporter

        # soon in the file: a process that dies leaves at most this much of its spans unwritten
        planned.append((BatchExportProcessor, lambda: batch_processor(
            OtlpJsonFileExporter(os.path.join(cfg.trace_dir, "otlp")), "otlp_json_file", cfg,
            schedule_delay_s=FILE_BATCH_DELAY_S, writes_files=True)))
    metrics = _metrics_plan(cfg)
    if metrics is not None:
        planned.append(metrics)
    if cfg.otlp_endpoint:
        from otel_verl.accelerated.batch import BatchExportProcessor

        # (the SDK's BatchSpanProcessor, OTEL_VERL_ACCELERATED=false, reads what this one reads)
        make = batch_processor if cfg.accelerated else sdk_batch_processor
        planned.append((BatchExportProcessor, lambda: make(otlp_exporter(cfg), "otlp", cfg, **bsp_options())))
    planned += _named_outputs(cfg)
    return planned


def starts_read(cfg: settings_mod.Settings) -> Subjects:
    """The subjects whose span starts an output of ``cfg`` reads (``None``: every span's)."""
    return _union(kind.on_start_subjects for kind, _ in plan(cfg))


def ends_read(cfg: settings_mod.Settings) -> Subjects:
    """The subjects whose span ends an output of ``cfg`` reads (``None``: every span's, as
    OTLP reads them). A span no output reads, and no other span needs, is not made
    (``events._core``)."""
    return _union(kind.on_end_subjects for kind, _ in plan(cfg))


def _union(declared: Iterable[Subjects]) -> Subjects:
    subjects: FrozenSet[Subject] = frozenset()
    for one in declared:
        if one is None:
            return None
        subjects |= one
    return subjects


# --------------------------------------------------------------------------- named outputs


def _named_outputs(cfg: settings_mod.Settings) -> List[Planned]:
    """The classes ``OTEL_VERL_OUTPUTS`` names, each made as ``Class(settings)``. One that
    cannot be imported or is no :class:`Output` is left out, logged once and counted."""
    planned: List[Planned] = []
    for name in cfg.outputs:
        try:
            kind = named_class(name)
        except Exception as exc:
            health.record_failure("outputs.import", exc)
            logger.error("otel_verl: %s=%s: %s; that output is left out", settings_mod.OUTPUTS, name, exc)
            continue
        planned.append((kind, lambda kind=kind: kind(cfg)))
    return planned


def named_class(name: str) -> type:
    """The class ``module:Class`` names, checked against :class:`Output`."""
    module, _, attribute = name.partition(":")
    kind: Any = importlib.import_module(module)
    for part in attribute.split("."):
        kind = getattr(kind, part)
    missing = [member for member in _MEMBERS if not hasattr(kind, member)]
    if not isinstance(kind, type) or missing:
        raise TypeError(f"{name} is no output class (lacks {', '.join(missing) or 'a class'}; "
                        "see otel_verl.outputs.Output)")
    return kind


_MEMBERS = tuple(sorted(set(Output.__annotations__) | {
    name for name, value in vars(Output).items() if callable(value) and not name.startswith("_")}))


# --------------------------------------------------------------------------- OTLP


FILE_BATCH_DELAY_S = 0.5  # the OTLP-JSON files' batches: spans are in the file within a second


def otlp_exporter(cfg: settings_mod.Settings) -> Any:
    """The OTLP span exporter the standard variables ask for (endpoint, protocol, headers,
    timeout, compression, certificates), sending a batch as requests under the receivers'
    size limit: otel_verl's own (its encoders write the SDK encoder's bytes at a fraction
    of its CPU), or with ``OTEL_VERL_ACCELERATED=false`` the SDK's."""
    protocol = settings_mod.otlp_protocol("TRACES")
    if cfg.accelerated:
        from otel_verl.accelerated.otlp_exporter import OtlpSpanExporter

        return OtlpSpanExporter(protocol=protocol)
    from otel_verl.exporters.otlp import RequestSplittingExporter, sdk_exporter_arguments

    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:  # the SDK's HTTP exporter sends protobuf only
        raise settings_mod.ConfigError(f"{settings_mod.ACCELERATED}=false: the SDK's exporters take grpc or "
                                       f"http/protobuf, not {protocol!r}")
    return RequestSplittingExporter(OTLPSpanExporter(**sdk_exporter_arguments(protocol)))


def bsp_options() -> dict:
    """The OTLP batch processor's options: the standard ``OTEL_BSP_*`` variables, the
    SDK's defaults where they are unset. Its queue is bounded in bytes besides
    (``OTEL_VERL_MAX_QUEUE_MB``): a 1024 x 16 step ends up to ~6k spans faster than one
    exporter thread on 2 cores sends them (batch stages end 1024 sample-stage spans at
    once, benchmarks/bench_collector_load.py), which the SDK's 2048 spans would drop."""
    from otel_verl.accelerated.batch import options_from_env

    return {"schedule_delay_s": 5.0, **options_from_env()}


def batch_processor(exporter: Any, output: str, cfg: settings_mod.Settings, **options: Any) -> Any:
    """A batch processor of ``exporter`` whose losses are counted under ``output``."""
    from otel_verl.accelerated.batch import BatchExportProcessor

    return BatchExportProcessor(exporter, output, max_queue_bytes=cfg.max_queue_bytes,
                                shutdown_timeout_s=cfg.shutdown_timeout_s, **options)


# the OpenTelemetry specification's defaults of OTEL_BSP_MAX_QUEUE_SIZE and _MAX_EXPORT_BATCH_SIZE
SDK_BSP_MAX_QUEUE_SPANS = 2048
SDK_BSP_MAX_BATCH = 512


def sdk_batch_processor(exporter: Any, output: str, cfg: settings_mod.Settings, schedule_delay_s: float,
                        max_queue_spans: int = SDK_BSP_MAX_QUEUE_SPANS, max_batch: int = SDK_BSP_MAX_BATCH) -> Any:
    """The SDK's ``BatchSpanProcessor`` with the ``OTEL_BSP_*`` values of :func:`bsp_options`
    (a bad one left out there, with a warning: the SDK's default applies). Its queue is bounded
    in spans, not bytes, and it drops the spans it cannot queue, or its exporter did not
    deliver, with a log line and no count otel_verl could report (``otel_verl.health``, the
    loss file): what ``OTEL_VERL_ACCELERATED=false`` trades for the SDK's own code."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # the SDK refuses a delay of 0 (otel_verl's: export at once) and a batch over the queue
    return BatchSpanProcessor(exporter, max_queue_size=max_queue_spans,
                              schedule_delay_millis=max(1.0, schedule_delay_s * 1000),
                              max_export_batch_size=min(max_batch, max_queue_spans))


# --------------------------------------------------------------------------- metrics


METRICS_EXPORTER = "OTEL_METRICS_EXPORTER"
OTLP_METRICS_ENDPOINT = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
_METRICS_EXPORTERS = ("otlp", "console", "none")
# beside otlp/, whose files every span reader (report, replay) takes for spans only
METRICS_FILES_DIR = "otlp-metrics"


def _metrics_plan(cfg: settings_mod.Settings) -> Optional[Planned]:
    """The span processor deriving metrics from the spans (``docs/SPANS.md``, "Metrics"),
    exporting them to :func:`metrics_outputs`; ``None`` when there is nowhere to send them."""
    try:
        wanted = metrics_outputs(cfg)
    except ValueError as exc:
        logger.error("otel_verl: %s; no metrics", exc)
        return None
    if not wanted:
        return None
    from otel_verl.exporters.metrics import SpanMetricsProcessor

    endpoint = _metrics_endpoint()
    return SpanMetricsProcessor, lambda: SpanMetricsProcessor(lambda: _metric_exporters(cfg, wanted, endpoint),
                                                              shutdown_timeout_s=cfg.shutdown_timeout_s,
                                                              accelerated=cfg.accelerated)


def metrics_processor(cfg: settings_mod.Settings) -> Any:
    """The span metrics' processor of ``cfg``, made; ``None`` when it has none."""
    planned = _metrics_plan(cfg)
    return planned[1]() if planned is not None else None


def metrics_outputs(cfg: settings_mod.Settings) -> List[str]:
    """Where ``OTEL_METRICS_EXPORTER`` (default ``otlp``) sends the metrics: ``otlp`` (to the
    metrics endpoint, else the traces' one), ``files`` (the OTLP-JSON files beside the spans',
    when there is no endpoint), ``console``. ``ValueError`` for an exporter otel_verl lacks."""
    raw = os.environ.get(METRICS_EXPORTER) or "otlp"
    names = [n.strip() for n in raw.lower().split(",") if n.strip()]
    unknown = [n for n in names if n not in _METRICS_EXPORTERS]
    if unknown:
        raise ValueError(f"{METRICS_EXPORTER}={raw}: unknown exporter {', '.join(unknown)} "
                         "(expected otlp, console or none)")
    wanted = []
    # files first: their reader's last collection must not wait on an OTLP exporter's retries
    if "otlp" in names and cfg.write_otlp_files:
        wanted.append("files")
    if "otlp" in names and _metrics_endpoint():
        wanted.append("otlp")
    if "console" in names:
        wanted.append("console")
    return wanted


def _metrics_endpoint() -> Optional[str]:
    """``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``, else ``OTEL_EXPORTER_OTLP_ENDPOINT``, else
    the traces' own endpoint (its ``/v1/traces`` path made ``/v1/metrics``): the metrics go
    where the traces go unless told otherwise."""
    endpoint = os.environ.get(OTLP_METRICS_ENDPOINT) or os.environ.get(settings_mod.OTLP_ENDPOINT)
    if endpoint:
        return endpoint
    traces = os.environ.get(settings_mod.OTLP_TRACES_ENDPOINT)
    if not traces:
        return None
    return traces[: -len("/v1/traces")] + "/v1/metrics" if traces.rstrip("/").endswith("/v1/traces") else traces


def _metric_exporters(cfg: settings_mod.Settings, wanted: List[str], endpoint: Optional[str]) -> List[Any]:
    """The exporters in ``wanted``."""
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

    exporters = []
    for name in wanted:
        try:
            if name == "otlp":
                exporter = _otlp_metric_exporter(endpoint)
            elif name == "files":
                from otel_verl.exporters.otlp_json_metrics import OtlpJsonMetricFileExporter

                exporter = OtlpJsonMetricFileExporter(os.path.join(cfg.trace_dir, METRICS_FILES_DIR))
            else:
                exporter = ConsoleMetricExporter()
            exporters.append(exporter)
        except Exception as exc:  # the spans' outputs go on without these metrics
            health.record_failure(f"metrics.{name}", exc)
    return exporters


def _otlp_metric_exporter(endpoint: Optional[str]) -> Any:
    """The SDK's OTLP metric exporter the standard variables ask for; ``endpoint`` given
    only when it is not the exporter's own variable (the traces' endpoint reused)."""
    protocol = settings_mod.otlp_protocol("METRICS", endpoint=endpoint)
    own = os.environ.get(OTLP_METRICS_ENDPOINT)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    elif protocol in ("http/protobuf", "http/json"):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        if not own and not os.environ.get(settings_mod.OTLP_ENDPOINT):
            return OTLPMetricExporter(endpoint=endpoint)  # a full URL, from the traces' one
        return OTLPMetricExporter()
    else:
        raise ValueError(f"OTLP protocol {protocol!r}: the SDK's metric exporters take grpc or http/protobuf")
    return OTLPMetricExporter() if own or os.environ.get(settings_mod.OTLP_ENDPOINT) else OTLPMetricExporter(endpoint=endpoint)
