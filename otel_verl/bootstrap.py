"""Building the tracing pipeline of one process: :func:`configure`.

``configure`` runs once per process (idempotent, fork-safe, never raises). It builds a
TracerProvider whose spans feed, depending on the settings:

- OTLP (gRPC or HTTP, per the standard ``OTEL_EXPORTER_OTLP_*`` variables) through a
  BatchSpanProcessor, when an endpoint is set;
- the legacy outputs (sample-flow CSV, progress log, trajectory JSONL) when a trace dir
  is set; progress lines go to stdout whenever tracing is on;
- the embedded default, ``{trace_dir}/otlp/*.jsonl`` in the Collector file exporter's
  line format, when there is a trace dir and no endpoint;
- metrics derived from the spans (:mod:`otel_verl.exporters.metrics`), sent where the spans
  go: OTLP to the endpoint, else ``{trace_dir}/otlp-metrics/*.jsonl`` (``OTEL_METRICS_EXPORTER``).

Sampling is per sample: the standard ``OTEL_TRACES_SAMPLER`` decides on the uid-derived
trace id, but a sample it drops is still *recorded* so the legacy outputs stay complete;
only OTLP exporters skip it. When another library already installed a global provider
(sglang does in its server process) it is left in place: otel_verl keeps its own
provider for its spans instead of fighting over the global one.

The provider is handed to the instrumentation (the events API and the verl wrappers,
:mod:`otel_verl.instrumentation`), which never imports this module: in a Ray worker
the wrappers ask for it through :func:`provider_for_role` when they first fire.
"""

from __future__ import annotations

import _thread
import atexit
import dataclasses
import logging
import os
import signal
import socket
import threading
import uuid
from typing import Any, FrozenSet, List, Optional

from otel_verl import forks, health, settings as settings_mod
from otel_verl.deadline import Deadline
from otel_verl.semconv import Role
from otel_verl import semconv as sc

logger = logging.getLogger("otel_verl")

_lock = threading.RLock()
_provider: Any = None
_processors: Any = None  # its IsolatingSpanProcessor
_settings: Optional[settings_mod.Settings] = None
_shut_down: Optional[threading.Event] = None  # set when the shutdown under way is done
_atexit_registered = False
_previous_sigterm: Any = signal.SIG_DFL  # what SIGTERM did before otel_verl's handler
_terminating = False  # SIGTERM came: once tracing is shut down it does what it did before


def configure(
    trace_dir: Optional[str] = None,
    *,
    role: "Role | str | None" = None,
    force: bool = False,
) -> bool:
    """Set up tracing in this process once. Returns whether tracing is on.

    ``trace_dir`` given here wins over ``VERL_TRACE_DIR``; ``force`` traces even with no
    trace dir and no endpoint (spans then reach only in-process processors).
    """
    global _provider, _settings
    try:
        with _lock:
            if _provider is not None:
                return True
            cfg = settings_mod.load(trace_dir=trace_dir)
            if force and cfg.forced is None:
                cfg = settings_mod.Settings(**{**cfg.__dict__, "forced": True})
            _settings = cfg
            if not cfg.enabled:
                return False
            _provider = _build(cfg, _role_value(role))
            _register_shutdown()
            return True
    except settings_mod.ConfigError as exc:
        logger.error("otel_verl: tracing stays off: %s", exc)
        return False
    except Exception as exc:  # never let tracing set-up break the process
        health.record_failure("bootstrap.configure", exc)
        return False


def ensure(role: "Role | str | None" = None) -> bool:
    """Called by wrappers on first use: configures with the role the caller knows."""
    if _provider is not None:
        return True
    if known_off():
        return False
    return configure(role=role)


def provider_for_role(role: "Role | str") -> Any:
    """What :class:`otel_verl.instrumentation.VerlInstrumentor` asks for when its first
    wrapper fires in a process: this process's provider, built for ``role`` if there is
    none yet; ``None`` when tracing is off here."""
    return _provider if ensure(role) else None


def known_off() -> bool:
    """This process's settings were read and say tracing is off (wrappers then step aside
    without reading their arguments; :func:`configure` reads the settings again)."""
    cfg = _settings
    return _provider is None and cfg is not None and not cfg.enabled


def is_configured() -> bool:
    return _provider is not None


def provider() -> Any:
    return _provider


def span_processors() -> tuple:
    """The span processors of the provider :func:`configure` built (empty before)."""
    return _processors.processors if _processors is not None and _provider is not None else ()


def _role_value(role: "Role | str | None") -> str:
    if role is None:
        role = os.environ.get(settings_mod.ROLE) or Role.WORKER
    return role.value if isinstance(role, Role) else str(role)


# --------------------------------------------------------------------------- pipeline


def _build(cfg: settings_mod.Settings, role: str) -> Any:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from otel_verl.instrumentation import tracing
    from otel_verl.sampling import IsolatingSpanProcessor, UidIdGenerator, record_dropped_samples
    from otel_verl.slim_span import SlimTracer

    global _processors
    _processors = IsolatingSpanProcessor(timeout_s=cfg.shutdown_timeout_s)
    tracer_provider = TracerProvider(
        resource=_resource(role),
        sampler=record_dropped_samples(),
        id_generator=UidIdGenerator(),
        # a raising span processor is counted (health), never raised into training code
        active_span_processor=_processors,
        shutdown_on_exit=False,  # ours, within the shutdown deadline
    )
    if cfg.offloads(role):
        tracer_provider.add_span_processor(_offload(cfg, tracer_provider.resource))
    else:
        for processor in output_processors(cfg, dict(tracer_provider.resource.attributes)):
            tracer_provider.add_span_processor(processor)
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        trace.set_tracer_provider(tracer_provider)
    else:
        logger.info("otel_verl: a global TracerProvider is already installed; otel_verl keeps its own")
    # the events API reports to it, with spans that cost a fraction of the SDK's
    tracing.use_provider(tracer_provider, cfg, SlimTracer(tracer_provider, _processors))
    return tracer_provider


def output_processors(cfg: settings_mod.Settings, resource_attributes: Optional[dict] = None) -> List[Any]:
    """The span processors writing this process's outputs: the legacy files (a trace dir
    set), OTLP (an endpoint set), the embedded OTLP-JSON files (a trace dir, no endpoint),
    the metrics, and the loss file (a trace dir) of the process of ``resource_attributes``.
    Also what the export process of :mod:`otel_verl.offload` runs. Each queues what it
    gets and writes from a thread of its own: none waits on another."""
    from otel_verl import legacy

    processors = legacy.processors(cfg)
    if cfg.write_otlp_files:
        from otel_verl.exporters.otlp_json_file import OtlpJsonFileExporter

        exporter = OtlpJsonFileExporter(os.path.join(cfg.trace_dir, "otlp"))
        # soon in the file: a process that dies leaves at most this much of its spans unwritten
        processors.append(_batch_processor(exporter, "otlp_json_file", cfg, schedule_delay_s=FILE_BATCH_DELAY_S,
                                           writes_files=True))
    metrics = _metrics_processor(cfg)
    if metrics is not None:
        processors.append(metrics)
    if cfg.otlp_endpoint:
        processors.append(_batch_processor(_otlp_exporter(cfg), "otlp", cfg, **_bsp_options()))
    if cfg.trace_dir:
        from otel_verl.exporters.loss_file import LossFileProcessor

        processors.append(LossFileProcessor(cfg.trace_dir, resource_attributes, outputs=processors))
    return processors


METRICS_EXPORTER = "OTEL_METRICS_EXPORTER"
OTLP_METRICS_ENDPOINT = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
_METRICS_EXPORTERS = ("otlp", "console", "none")
# beside otlp/, whose files every span reader (report, replay) takes for spans only
METRICS_FILES_DIR = "otlp-metrics"


def _metrics_processor(cfg: settings_mod.Settings) -> Any:
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
    return SpanMetricsProcessor(lambda: _metric_exporters(cfg, wanted, endpoint),
                                shutdown_timeout_s=cfg.shutdown_timeout_s, accelerated=cfg.accelerated)


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


EXPORT_PROCESS_SHARE = 0.75
EXPORT_PROCESS_MARGIN_S = 1.0  # of the deadline, to send it the last spans, read its answer and let it exit


def _offload(cfg: settings_mod.Settings, resource: Any) -> Any:
    """One processor handing every span to an export process that runs
    :func:`output_processors` (see :mod:`otel_verl.offload`)."""
    from otel_verl.offload.forwarder import OffloadSpanProcessor
    from otel_verl.offload.wire import HostConfig

    # the export process keeps a share of the shutdown deadline: the rest is for sending it
    # the last spans, reading back what it could not export and killing it if it hangs
    timeout_s = cfg.shutdown_timeout_s
    share = max(0.1 * timeout_s, min(timeout_s * EXPORT_PROCESS_SHARE, timeout_s - EXPORT_PROCESS_MARGIN_S))
    host_cfg = dataclasses.replace(cfg, shutdown_timeout_s=share)
    config = HostConfig(host_cfg, dict(resource.attributes), resource.schema_url, os.getpid())
    # past its restart limit, the process writes its outputs itself, as OTEL_VERL_OFFLOAD=0 does
    return OffloadSpanProcessor(config, max_pending_bytes=cfg.max_queue_bytes, start_subjects=output_start_subjects(),
                                end_subjects=output_end_subjects(cfg),
                                in_process_outputs=lambda: output_processors(cfg, config.resource_attributes),
                                shutdown_timeout_s=cfg.shutdown_timeout_s)


def output_start_subjects() -> FrozenSet[Any]:
    """The payload subjects whose start an output of :func:`output_processors` reads (OTLP reads
    ends only): the export process gets no other span's start."""
    from otel_verl import legacy

    return legacy.start_subjects()


def output_end_subjects(cfg: settings_mod.Settings) -> Optional[FrozenSet[Any]]:
    """The payload subjects whose end an output of :func:`output_processors` reads, ``None``
    for every span (OTLP and the OTLP-JSON files read all): the export process gets no
    other span, and a span only it would read is not made (see ``events._core._start``)."""
    if cfg.otlp_endpoint or cfg.write_otlp_files:
        return None
    from otel_verl import legacy

    subjects = legacy.end_subjects()
    try:
        wanted = metrics_outputs(cfg)
    except ValueError:  # no metrics (said where the processors are made)
        wanted = []
    if wanted:
        from otel_verl.exporters.metrics import SpanMetricsProcessor

        subjects |= SpanMetricsProcessor.on_end_subjects
    return subjects


def _otlp_exporter(cfg: settings_mod.Settings) -> Any:
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


FILE_BATCH_DELAY_S = 0.5  # the OTLP-JSON files' batches: spans are in the file within a second


def _bsp_options() -> dict:
    """The OTLP batch processor's options: the standard ``OTEL_BSP_*`` variables, the
    SDK's defaults where they are unset. Its queue is bounded in bytes besides
    (``OTEL_VERL_MAX_QUEUE_MB``): a 1024 x 16 step ends up to ~6k spans faster than one
    exporter thread on 2 cores sends them (batch stages end 1024 sample-stage spans at
    once, benchmarks/bench_collector_load.py), which the SDK's 2048 spans would drop."""
    from otel_verl.accelerated.batch import options_from_env

    return {"schedule_delay_s": 5.0, **options_from_env()}


def _batch_processor(exporter: Any, output: str, cfg: settings_mod.Settings, **options: Any) -> Any:
    """A batch processor of ``exporter`` whose losses are counted under ``output``. With
    ``OTEL_VERL_ACCELERATED=false`` OTLP gets the SDK's (:func:`_sdk_batch_processor`); the
    OTLP-JSON files keep otel_verl's either way: an output of otel_verl's own, no stand-in
    for a part of the SDK."""
    if output == "otlp" and not cfg.accelerated:
        return _sdk_batch_processor(exporter, **options)
    from otel_verl.accelerated.batch import BatchExportProcessor

    return BatchExportProcessor(exporter, output, max_queue_bytes=cfg.max_queue_bytes,
                                shutdown_timeout_s=cfg.shutdown_timeout_s, **options)


# the OpenTelemetry specification's defaults of OTEL_BSP_MAX_QUEUE_SIZE and _MAX_EXPORT_BATCH_SIZE
SDK_BSP_MAX_QUEUE_SPANS = 2048
SDK_BSP_MAX_BATCH = 512


def _sdk_batch_processor(exporter: Any, schedule_delay_s: float, max_queue_spans: int = SDK_BSP_MAX_QUEUE_SPANS,
                         max_batch: int = SDK_BSP_MAX_BATCH) -> Any:
    """The SDK's ``BatchSpanProcessor`` with the ``OTEL_BSP_*`` values of :func:`_bsp_options`
    (a bad one left out there, with a warning: the SDK's default applies). Its queue is bounded
    in spans, not bytes, and it drops the spans it cannot queue, or its exporter did not
    deliver, with a log line and no count otel_verl could report (``otel_verl.health``, the
    loss file): what ``OTEL_VERL_ACCELERATED=false`` trades for the SDK's own code."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # the SDK refuses a delay of 0 (otel_verl's: export at once) and a batch over the queue
    return BatchSpanProcessor(exporter, max_queue_size=max_queue_spans,
                              schedule_delay_millis=max(1.0, schedule_delay_s * 1000),
                              max_export_batch_size=min(max_batch, max_queue_spans))


def _resource(role: str) -> Any:
    from opentelemetry.sdk.resources import Resource

    attrs = {
        sc.RUN_ID: run_id(),
        sc.ROLE: role,
        sc.HOST_NAME: socket.gethostname(),
        sc.PROCESS_PID: os.getpid(),
        **_ray_ids(),
    }
    resource = Resource.create(attrs)
    # the service.* attributes the user set (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES,
    # a resource detector) win over ours; the SDK names an unnamed service unknown_service
    defaults = {
        sc.SERVICE_NAME: sc.service_name(role),
        sc.SERVICE_NAMESPACE: sc.SERVICE_NAMESPACE_VERL,
        sc.SERVICE_INSTANCE_ID: str(uuid.uuid4()),  # this process's, never inherited
    }
    have = resource.attributes
    missing = {key: value for key, value in defaults.items()
               if not have.get(key) or (key == sc.SERVICE_NAME and str(have[key]).startswith("unknown_service"))}
    return resource.merge(Resource(missing))


def run_id() -> str:
    """One id per training run, the same in every process: :func:`known_run_id`, else a
    new uuid. Kept in ``OTEL_VERL_RUN_ID``: the carriers this process sends name their
    run by it, and children started from here share it."""
    value = known_run_id() or uuid.uuid4().hex
    os.environ[settings_mod.RUN_ID] = value
    return value


def known_run_id() -> Optional[str]:
    """``OTEL_VERL_RUN_ID`` (the launcher and the Ray runtime env forward it), else the
    Ray job id; ``None`` where neither is known. Makes up none and writes nothing."""
    value = os.environ.get(settings_mod.RUN_ID)
    if value:
        return value
    job = _ray_ids().get(sc.RAY_JOB_ID)
    return f"ray-job-{job}" if job else None


def _ray_ids() -> dict:
    import sys

    ray = sys.modules.get("ray")  # never import Ray just for this
    if ray is None or not ray.is_initialized():
        return {}
    out = {}
    try:
        ctx = ray.get_runtime_context()
        out[sc.RAY_JOB_ID] = ctx.get_job_id()
        out[sc.RAY_NODE_ID] = ctx.get_node_id()
        actor = ctx.get_actor_id()
        if actor:
            out[sc.RAY_ACTOR_ID] = actor
    except Exception:
        pass
    return {k: v for k, v in out.items() if v}


# --------------------------------------------------------------------------- shutdown


def flush(timeout_s: Optional[float] = None) -> bool:
    """Export and write everything accepted so far, waiting at most ``timeout_s`` (default
    ``OTEL_VERL_SHUTDOWN_TIMEOUT_S``). False when not all of it was done in time: the
    rest is still exported later, or counted as lost at shutdown."""
    if _provider is None:
        return True
    try:
        return bool(_provider.force_flush(int(_timeout_s(timeout_s) * 1000)))
    except Exception as exc:
        health.record_failure("bootstrap.flush", exc)
        return False


def shutdown(timeout_s: Optional[float] = None) -> None:
    """End open sample spans, flush every output, stop the exporters, all within
    ``timeout_s`` (default ``OTEL_VERL_SHUTDOWN_TIMEOUT_S``): spans not exported by then
    are counted as lost. Idempotent; a call during another thread's shutdown waits for it."""
    global _provider, _shut_down
    deadline = Deadline(_timeout_s(timeout_s))
    with _lock:
        provider, _provider = _provider, None
        if provider is not None:
            _shut_down = threading.Event()
        shut_down, processors = _shut_down, _processors
    if provider is None:
        if shut_down is not None:
            shut_down.wait(deadline.left_s())
        return
    from otel_verl import events
    from otel_verl.instrumentation import tracing

    try:
        events.end_open_samples()
        events.end_open_prompt_tasks()
    except Exception as exc:
        health.record_failure("bootstrap.shutdown", exc)
    tracing.stop()  # a span ending from here on would reach outputs being closed
    try:
        processors.shutdown(timeout_millis=deadline.left_ms())
    except Exception as exc:
        health.record_failure("bootstrap.shutdown", exc)
    finally:
        _report_losses()
        shut_down.set()


def _timeout_s(timeout_s: Optional[float]) -> float:
    if timeout_s is not None:
        return timeout_s
    cfg = _settings
    return cfg.shutdown_timeout_s if cfg is not None else settings_mod.DEFAULT_SHUTDOWN_TIMEOUT_S


def _report_losses() -> None:
    counts = health.snapshot()
    if counts["dropped"] or counts["failures"]:
        logger.warning("otel_verl: at shutdown: dropped=%s failures=%s", counts["dropped"], counts["failures"])


def _register_shutdown() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_shutdown_at_exit)
        forks.in_child(_after_fork_in_child)
        _atexit_registered = True
        _follow_ray_init()
    _install_sigterm_handler()


def _install_sigterm_handler() -> None:
    """SIGTERM shuts tracing down first, then does what it did before: the default (the
    process dies of it) or the handler another library installed (Ray's driver raises
    SystemExit, whose exit would otherwise abort the process before any output flushed).
    An ignored SIGTERM stays ignored."""
    global _previous_sigterm
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set a handler
    try:
        current = signal.getsignal(signal.SIGTERM)
        if current is _on_sigterm or current is signal.SIG_IGN:
            return
        _previous_sigterm = signal.SIG_DFL if current is None else current
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not the main interpreter thread / unsupported
        pass


def _follow_ray_init() -> None:
    """``ray.init`` sets a SIGTERM handler of its own and registers its shutdown at exit,
    which tears Ray down (and aborts the driver) before ours would run: after it, ours
    are put in front again."""
    import wrapt

    def after_init(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return wrapped(*args, **kwargs)
        finally:
            try:
                if _provider is not None:
                    atexit.unregister(_shutdown_at_exit)
                    atexit.register(_shutdown_at_exit)  # runs before Ray's (last in, first out)
                    _install_sigterm_handler()
            except Exception as exc:
                health.record_failure("bootstrap.ray_init", exc)

    @wrapt.when_imported("ray")
    def _patch(ray_module: Any) -> None:
        if not getattr(ray_module.init, "_otel_verl_follows", False):
            wrapt.wrap_function_wrapper(ray_module, "init", after_init)
            ray_module.init._otel_verl_follows = True


def _on_sigterm(signum: int, frame: Any) -> None:
    """Hands the shutdown to a new thread and returns: the code this handler interrupted
    may hold a lock the shutdown takes, and would never release it under the handler."""
    global _terminating
    _terminating = True
    # a second SIGTERM does at once what the first would have done without us
    signal.signal(signal.SIGTERM, _previous_sigterm)
    try:
        # threading.Thread.start takes threading's own lock, which the interrupted code
        # may hold too; _thread takes none
        _thread.start_new_thread(_terminate, ())
    except Exception:  # no thread to be had: as without us, now
        os.kill(os.getpid(), signal.SIGTERM)


def _terminate() -> None:
    """Shut tracing down (within its deadline), then let SIGTERM do what it did before:
    the process dies of it, or the handler we stood in front of runs (on the main thread)."""
    try:
        shutdown()
    finally:
        os.kill(os.getpid(), signal.SIGTERM)


def _shutdown_at_exit() -> None:
    shutdown()  # waits for one under way (SIGTERM's, when the main thread ends meanwhile)
    if _terminating and _previous_sigterm is signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGTERM)  # die of it, as without us


# after the child's own finalizers, which may still end spans
MULTIPROCESSING_EXIT_PRIORITY = -100


def _after_fork_in_child() -> None:
    # The SDK's BatchSpanProcessor, our writers and the events API's state reset
    # themselves in the child. A lock another thread held at fork time would never be
    # released here.
    global _lock, _shut_down
    _lock = threading.RLock()
    _shut_down = None  # a shutdown the parent had under way is the parent's
    # a multiprocessing child ends by os._exit, past atexit: shut down among its finalizers
    forks.at_multiprocessing_exit(shutdown, MULTIPROCESSING_EXIT_PRIORITY)


