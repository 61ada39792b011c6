"""Which TracerProvider the wrappers and the events API report to in this process.

As in opentelemetry-python-contrib, the instrumentation builds no provider: it uses the
one it is given (``VerlInstrumentor().instrument(tracer_provider=...)``), else the global
one. A configurator that builds providers (``otel_verl.configure``, the Ray setup hook)
may instead hand over ``provider_for_role``: the provider is then asked for by the first
wrapper that fires, because only the wrappers know their process's role (trainer,
rollout worker, LLM server), and the role decides the provider's resource and outputs.
``instrument()`` makes one :class:`Tracing` holding that choice and hands it to the
wrappers' factories, as the contrib instrumentations hand their handler to theirs.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from opentelemetry import trace

from otel_verl import events, health, settings as settings_mod
from otel_verl.semconv import INSTRUMENTATION_NAME
from otel_verl.version import __version__

logger = logging.getLogger("otel_verl")

ProviderForRole = Callable[[str], Optional[Any]]  # role -> TracerProvider, or None: tracing off here


class Tracing:
    """What the wrappers of one ``instrument()`` report through: the events API's state,
    and where none is installed yet, ``provider_for_role`` to ask for one (once)."""

    def __init__(self, provider_for_role: Optional[ProviderForRole] = None) -> None:
        self._provider_for_role = provider_for_role
        self._said_off = False  # provider_for_role answered None: tracing stays off here

    def active(self, role: str) -> bool:
        """Whether the events API reports to a provider; where it does not, the first call
        asks ``provider_for_role(role)`` (only the wrappers know their process's role)."""
        if events.enabled():
            return True
        ask = self._provider_for_role
        if ask is None or self._said_off:
            return False
        try:
            provider = ask(role)
        except Exception as exc:
            health.record_failure("instrumentation.provider_for_role", exc)
            provider = None
        if provider is None:
            self._said_off = True
            return False
        return use_provider(provider)


def use_provider(tracer_provider: Any = None, settings: Optional[settings_mod.Settings] = None,
                 tracer: Optional[trace.Tracer] = None) -> bool:
    """Make the events API report to ``tracer_provider`` (the global one when ``None``),
    starting its spans with ``tracer`` (default: the provider's tracer; a configurator that
    built the provider hands over a :class:`otel_verl.slim_span.SlimTracer` of it).

    ``settings`` (otel_verl's own switches: open-sample bound, validation, message
    content) are read from the environment when not given. Handing over the provider
    the events API already reports to keeps its open samples. Returns whether the
    events API reports to a provider now; never raises.
    """
    provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
    try:
        events.install_for(provider, lambda: state_for(provider, settings, tracer))
        return True
    except settings_mod.ConfigError as exc:
        logger.error("otel_verl: tracing stays off: %s", exc)
    except Exception as exc:
        health.record_failure("instrumentation.use_provider", exc)
    return False


def state_for(tracer_provider: Any, settings: Optional[settings_mod.Settings] = None,
              tracer: Optional[trace.Tracer] = None) -> events.TracingState:
    """A tracing state reporting to ``tracer_provider`` (see :func:`use_provider`), not
    installed: ``with state.activated():`` reports to it in one block.

    Raises :class:`otel_verl.settings.ConfigError` on bad settings."""
    cfg = settings if settings is not None else settings_mod.load()
    if tracer is None:
        tracer = trace.get_tracer(INSTRUMENTATION_NAME, __version__, tracer_provider=tracer_provider)
    return events.TracingState(tracer_provider, tracer, _id_generator(tracer_provider), cfg,
                               getattr(tracer_provider, "sampler", None))


def _id_generator(provider: Any) -> Any:
    ids = getattr(provider, "id_generator", None)
    if hasattr(ids, "next_ids"):
        return ids
    logger.info("otel_verl: the TracerProvider's id generator is not otel_verl.sampling.UidIdGenerator: "
                "sample root spans get its ids, not ids derived from their uid")
    return _ProviderIds()


class _ProviderIds:
    """For a provider with an id generator of its own: sample roots get its ids."""

    def next_ids(self, trace_id: int, span_id: int) -> None:
        pass


def stop() -> None:
    """The events API reports nowhere (the provider is being shut down)."""
    events.install(None)


def flush(timeout_s: Optional[float] = None, provider: Any = None) -> bool:
    """Export and write everything ``provider`` (default: the one the events API reports
    to) has accepted, waiting at most ``timeout_s`` (default: :func:`flush_timeout_s`)."""
    if provider is None:
        current = events.state()
        provider = current.provider if current is not None else None
    if isinstance(provider, trace.ProxyTracerProvider):  # the global one, set since
        provider = trace.get_tracer_provider()
    force_flush = getattr(provider, "force_flush", None)  # the API's TracerProvider has none
    if force_flush is None:
        return True
    if timeout_s is None:
        timeout_s = flush_timeout_s()
    try:
        return bool(force_flush(int(timeout_s * 1000)))
    except Exception as exc:
        health.record_failure("instrumentation.flush", exc)
        return False


def flush_timeout_s() -> float:
    """How long a flush may take here (``OTEL_VERL_SHUTDOWN_TIMEOUT_S``)."""
    current = events.state()
    return current.settings.shutdown_timeout_s if current is not None else settings_mod.DEFAULT_SHUTDOWN_TIMEOUT_S


def flush_in_actor(actor: Any = None) -> bool:
    """:func:`flush` for ``actor.__ray_call__`` (which passes the actor instance)."""
    return flush()
