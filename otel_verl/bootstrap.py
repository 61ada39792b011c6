"""Building the tracing pipeline of one process: :func:`configure`.

``configure`` runs once per process (idempotent, fork-safe, never raises). It builds a
TracerProvider whose spans feed the outputs the settings ask for (:mod:`otel_verl.outputs`:
the legacy files, OTLP, the OTLP-JSON files, metrics), written here or, in a rollout
worker and the trainer, by an export process (:mod:`otel_verl.offload`).

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
from typing import Any, Optional

from otel_verl import forks, health, outputs, settings as settings_mod
from otel_verl.deadline import Deadline
from otel_verl.semconv import Role
from otel_verl import semconv as sc

logger = logging.getLogger("otel_verl")

class Configurator:
    """This process's tracing pipeline, one per process (:data:`CONFIGURATOR`): its one
    provider, the settings it was built with, its shutdown and SIGTERM handling. The
    module's functions are its methods, for the code that knows no configurator."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.provider: Any = None  # the TracerProvider configure built; None before and after
        self.processors: Any = None  # its IsolatingSpanProcessor
        self.settings: Optional[settings_mod.Settings] = None  # as last read
        self.shut_down: Optional[threading.Event] = None  # set when the shutdown under way is done
        self.registered = False  # at exit, after fork, after ray.init
        self.previous_sigterm: Any = signal.SIG_DFL  # what SIGTERM did before otel_verl's handler
        self.terminating = False  # SIGTERM came: once tracing is shut down it does what it did before
        self.sigterm_handler = self._on_sigterm  # one bound method: the installed handler is told by it

    def configure(self, trace_dir: Optional[str] = None, *, role: "Role | str | None" = None,
                  force: bool = False) -> bool:
        """Set up tracing in this process once. Returns whether tracing is on.

        ``trace_dir`` given here wins over ``VERL_TRACE_DIR``; ``force`` traces even with no
        trace dir and no endpoint (spans then reach only in-process processors)."""
        from otel_verl.sampling import IsolatingSpanProcessor

        try:
            with self.lock:
                if self.provider is not None:
                    return True
                cfg = settings_mod.load(trace_dir=trace_dir)
                if force and cfg.forced is None:
                    cfg = settings_mod.Settings(**{**cfg.__dict__, "forced": True})
                self.settings = cfg
                if not cfg.enabled:
                    return False
                self.processors = IsolatingSpanProcessor(timeout_s=cfg.shutdown_timeout_s)
                self.provider = _build(cfg, _role_value(role), self.processors)
                self._register_shutdown()
                return True
        except settings_mod.ConfigError as exc:
            logger.error("otel_verl: tracing stays off: %s", exc)
            return False
        except Exception as exc:  # never let tracing set-up break the process
            health.record_failure("bootstrap.configure", exc)
            return False

    def ensure(self, role: "Role | str | None" = None) -> bool:
        """Whether tracing is on, configuring it on first use with the role the caller knows."""
        if self.provider is not None:
            return True
        if self.known_off():
            return False
        return self.configure(role=role)

    def known_off(self) -> bool:
        """This process's settings were read and say tracing is off (wrappers then step aside
        without reading their arguments; :meth:`configure` reads the settings again)."""
        cfg = self.settings
        return self.provider is None and cfg is not None and not cfg.enabled

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Export and write everything accepted so far, waiting at most ``timeout_s``
        (default ``OTEL_VERL_SHUTDOWN_TIMEOUT_S``). False when not all of it was done in
        time: the rest is still exported later, or counted as lost at shutdown."""
        from otel_verl.instrumentation import tracing

        provider = self.provider
        return True if provider is None else tracing.flush(timeout_s, provider)

    def shutdown(self, timeout_s: Optional[float] = None) -> None:
        """End open sample spans, flush every output, stop the exporters, all within
        ``timeout_s`` (default ``OTEL_VERL_SHUTDOWN_TIMEOUT_S``): spans not exported by then
        are counted as lost. Idempotent; a call during another thread's shutdown waits for it."""
        from otel_verl import events
        from otel_verl.instrumentation import tracing

        deadline = Deadline(tracing.flush_timeout_s() if timeout_s is None else timeout_s)
        with self.lock:
            provider, self.provider = self.provider, None
            if provider is not None:
                self.shut_down = threading.Event()
            shut_down, processors = self.shut_down, self.processors
        if provider is None:
            if shut_down is not None:
                shut_down.wait(deadline.left_s())
            return
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

    # ------------------------------------------------------------------ exit, fork, SIGTERM

    def _register_shutdown(self) -> None:
        if not self.registered:
            atexit.register(self._shutdown_at_exit)
            forks.in_child(self._after_fork_in_child)
            self.registered = True
            self._follow_ray_init()
        self._install_sigterm_handler()

    def _install_sigterm_handler(self) -> None:
        """SIGTERM shuts tracing down first, then does what it did before: the default (the
        process dies of it) or the handler another library installed (Ray's driver raises
        SystemExit, whose exit would otherwise abort the process before any output flushed).
        An ignored SIGTERM stays ignored."""
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set a handler
        try:
            current = signal.getsignal(signal.SIGTERM)
            if current == self.sigterm_handler or current is signal.SIG_IGN:
                return
            self.previous_sigterm = signal.SIG_DFL if current is None else current
            signal.signal(signal.SIGTERM, self.sigterm_handler)
        except (ValueError, OSError):  # not the main interpreter thread / unsupported
            pass

    def _follow_ray_init(self) -> None:
        """``ray.init`` sets a SIGTERM handler of its own and registers its shutdown at exit,
        which tears Ray down (and aborts the driver) before ours would run: after it, ours
        are put in front again."""
        import wrapt

        def after_init(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            try:
                return wrapped(*args, **kwargs)
            finally:
                try:
                    if self.provider is not None:
                        atexit.unregister(self._shutdown_at_exit)
                        atexit.register(self._shutdown_at_exit)  # runs before Ray's (last in, first out)
                        self._install_sigterm_handler()
                except Exception as exc:
                    health.record_failure("bootstrap.ray_init", exc)

        @wrapt.when_imported("ray")
        def _patch(ray_module: Any) -> None:
            if not getattr(ray_module.init, "_otel_verl_follows", False):
                wrapt.wrap_function_wrapper(ray_module, "init", after_init)
                ray_module.init._otel_verl_follows = True

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """Hands the shutdown to a new thread and returns: the code this handler interrupted
        may hold a lock the shutdown takes, and would never release it under the handler."""
        self.terminating = True
        # a second SIGTERM does at once what the first would have done without us
        signal.signal(signal.SIGTERM, self.previous_sigterm)
        try:
            # threading.Thread.start takes threading's own lock, which the interrupted code
            # may hold too; _thread takes none
            _thread.start_new_thread(self._terminate, ())
        except Exception:  # no thread to be had: as without us, now
            os.kill(os.getpid(), signal.SIGTERM)

    def _terminate(self) -> None:
        """Shut tracing down (within its deadline), then let SIGTERM do what it did before:
        the process dies of it, or the handler we stood in front of runs (on the main thread)."""
        try:
            self.shutdown()
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    def _shutdown_at_exit(self) -> None:
        self.shutdown()  # waits for one under way (SIGTERM's, when the main thread ends meanwhile)
        if self.terminating and self.previous_sigterm is signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGTERM)  # die of it, as without us

    def _after_fork_in_child(self) -> None:
        # Our batch processors, writers and the events API's state reset themselves in the
        # child. A lock another thread held at fork time would never be released here.
        self.lock = threading.RLock()
        self.shut_down = None  # a shutdown the parent had under way is the parent's
        # a multiprocessing child ends by os._exit, past atexit: shut down among its finalizers
        # (the module's function: multiprocessing keeps what it runs by a weak reference)
        forks.at_multiprocessing_exit(shutdown, MULTIPROCESSING_EXIT_PRIORITY)


# after the child's own finalizers, which may still end spans
MULTIPROCESSING_EXIT_PRIORITY = -100

CONFIGURATOR = Configurator()  # this process's


def configure(trace_dir: Optional[str] = None, *, role: "Role | str | None" = None, force: bool = False) -> bool:
    """:meth:`Configurator.configure` of this process."""
    return CONFIGURATOR.configure(trace_dir, role=role, force=force)


def ensure(role: "Role | str | None" = None) -> bool:
    """:meth:`Configurator.ensure` of this process."""
    return CONFIGURATOR.ensure(role)


def flush(timeout_s: Optional[float] = None) -> bool:
    """:meth:`Configurator.flush` of this process."""
    return CONFIGURATOR.flush(timeout_s)


def shutdown(timeout_s: Optional[float] = None) -> None:
    """:meth:`Configurator.shutdown` of this process."""
    CONFIGURATOR.shutdown(timeout_s)


def provider_for_role(role: "Role | str") -> Any:
    """What :class:`otel_verl.instrumentation.VerlInstrumentor` asks for when its first
    wrapper fires in a process: this process's provider, built for ``role`` if there is
    none yet; ``None`` when tracing is off here."""
    return CONFIGURATOR.provider if CONFIGURATOR.ensure(role) else None


def known_off() -> bool:
    return CONFIGURATOR.known_off()


def is_configured() -> bool:
    return CONFIGURATOR.provider is not None


def provider() -> Any:
    return CONFIGURATOR.provider


def span_processors() -> tuple:
    """The span processors of the provider :func:`configure` built (empty before)."""
    configurator = CONFIGURATOR
    return configurator.processors.processors if configurator.provider is not None else ()


def _role_value(role: "Role | str | None") -> str:
    if role is None:
        role = os.environ.get(settings_mod.ROLE) or Role.WORKER
    return role.value if isinstance(role, Role) else str(role)


def _report_losses() -> None:
    counts = health.snapshot()
    if counts["dropped"] or counts["failures"]:
        logger.warning("otel_verl: at shutdown: dropped=%s failures=%s", counts["dropped"], counts["failures"])


# --------------------------------------------------------------------------- pipeline


def _build(cfg: settings_mod.Settings, role: str, processors: Any) -> Any:
    """The provider of a process of ``role``, its span processors in ``processors``."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from otel_verl.instrumentation import tracing
    from otel_verl.sampling import UidIdGenerator, record_dropped_samples
    from otel_verl.slim_span import SlimTracer

    tracer_provider = TracerProvider(
        resource=_resource(role),
        sampler=record_dropped_samples(),
        id_generator=UidIdGenerator(),
        # a raising span processor is counted (health), never raised into training code
        active_span_processor=processors,
        shutdown_on_exit=False,  # ours, within the shutdown deadline
    )
    if cfg.offloads(role):
        tracer_provider.add_span_processor(_offload(cfg, tracer_provider.resource))
    else:
        for output in outputs.build(cfg, dict(tracer_provider.resource.attributes)):
            tracer_provider.add_span_processor(output)
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        trace.set_tracer_provider(tracer_provider)
    else:
        logger.info("otel_verl: a global TracerProvider is already installed; otel_verl keeps its own")
    # the events API reports to it, with spans that cost a fraction of the SDK's
    tracing.use_provider(tracer_provider, cfg, SlimTracer(tracer_provider, processors))
    return tracer_provider


EXPORT_PROCESS_SHARE = 0.75
EXPORT_PROCESS_MARGIN_S = 1.0  # of the deadline, to send it the last spans, read its answer and let it exit


def _offload(cfg: settings_mod.Settings, resource: Any) -> Any:
    """One processor handing every span an output reads to an export process that runs
    the outputs (see :mod:`otel_verl.offload`)."""
    from otel_verl.offload.forwarder import OffloadSpanProcessor
    from otel_verl.offload.wire import HostConfig

    # the export process keeps a share of the shutdown deadline: the rest is for sending it
    # the last spans, reading back what it could not export and killing it if it hangs
    timeout_s = cfg.shutdown_timeout_s
    share = max(0.1 * timeout_s, min(timeout_s * EXPORT_PROCESS_SHARE, timeout_s - EXPORT_PROCESS_MARGIN_S))
    host_cfg = dataclasses.replace(cfg, shutdown_timeout_s=share)
    config = HostConfig(host_cfg, dict(resource.attributes), resource.schema_url, os.getpid())
    # past its restart limit, the process writes its outputs itself, as OTEL_VERL_OFFLOAD=0 does
    return OffloadSpanProcessor(config, max_pending_bytes=cfg.max_queue_bytes, start_subjects=outputs.starts_read(cfg),
                                end_subjects=outputs.ends_read(cfg),
                                in_process_outputs=lambda: outputs.build(cfg, config.resource_attributes),
                                shutdown_timeout_s=cfg.shutdown_timeout_s)


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
