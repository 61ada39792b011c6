"""``VerlInstrumentor``: wraps stock verl's classes so a training run emits otel_verl spans.

Usage, as any opentelemetry-python-contrib instrumentor::

    from otel_verl.instrumentation import VerlInstrumentor
    VerlInstrumentor().instrument(tracer_provider=provider)  # or the global provider

It configures no SDK: building a provider with otel_verl's outputs is
``otel_verl.configure``'s job, and in every Ray process :mod:`otel_verl.activation`
instruments with ``provider_for_role`` (see :mod:`.tracing`), so that the first wrapper
to fire builds the provider for its process's role.

Each verl component has its own module whose ``hooks(...)`` lists its wrap targets
(:class:`otel_verl.instrumentation.hooks.Hook`) with thin wrappers that call
:mod:`otel_verl.events`, made by factories closing over the :class:`tracing.Tracing`
``instrument()`` built (the trainer modules: over the :class:`_trainer.TracedTrainer`
they share). A target that is missing or changed in the installed verl is skipped with
one warning; :func:`hooks.status` lists what was installed.
"""

from __future__ import annotations

import logging
from typing import Any, Collection, List, Optional

from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_verl import events
from otel_verl.instrumentation import hooks
from otel_verl.instrumentation.tracing import Tracing, use_provider
from otel_verl.instrumentation.package import _instruments

logger = logging.getLogger("otel_verl")


def all_hooks(tracing: Optional[Tracing] = None) -> List[hooks.Hook]:
    """Every wrap target of every component, in install order, their wrappers reporting
    through ``tracing`` (default: to the provider the events API reports to, if any)."""
    from otel_verl.instrumentation import (
        _trainer,
        agent_loop,
        agent_loop_tq,
        llm_client,
        llm_server,
        reward_loop,
        trainer_separation,
        trainer_v0,
        trainer_v1,
    )

    tracing = tracing or Tracing()
    traced = _trainer.TracedTrainer(tracing)
    return [
        *_trainer.hooks(traced),
        *trainer_v0.hooks(traced),
        *trainer_v1.hooks(traced),
        *trainer_separation.hooks(traced),
        *agent_loop.hooks(tracing),
        *agent_loop_tq.hooks(tracing),
        *llm_client.hooks(tracing),
        *llm_server.hooks(tracing),
        *reward_loop.hooks(tracing),
    ]


class VerlInstrumentor(BaseInstrumentor):
    """``instrument(tracer_provider=None, meter_provider=None, provider_for_role=None)``:
    spans go to ``tracer_provider``; without one, to the provider ``provider_for_role(role)``
    returns when the first wrapper fires; without either, to the provider the events API
    already reports to (``otel_verl.configure`` ran here), else to the global one.

    With ``meter_provider``, the metrics of ``docs/SPANS.md`` ("Metrics") are recorded into
    it as the spans end (a span processor added to the tracer provider: they are aggregates
    of the spans); ``otel_verl.configure`` builds its own otherwise."""

    _metrics: Any = None  # the metrics processor recording into the user's meter provider
    tracing: Optional[Tracing] = None  # what the installed wrappers report through

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        tracer_provider = kwargs.get("tracer_provider")
        provider_for_role = kwargs.get("provider_for_role")
        if tracer_provider is None and provider_for_role is not None:
            self.tracing = Tracing(provider_for_role)  # asked by the first wrapper to fire
        else:
            self.tracing = Tracing()
            if tracer_provider is not None or not events.enabled():
                use_provider(tracer_provider)
            # else configure() kept its own provider beside another library's global one: so do we
        meter_provider = kwargs.get("meter_provider")
        if meter_provider is not None:
            self._metrics = _metrics_into(meter_provider, tracer_provider or trace.get_tracer_provider())
        hooks.install_all(all_hooks(self.tracing))

    def _uninstrument(self, **kwargs: Any) -> None:
        # The events API keeps its provider: code of one's own (a custom agent loop)
        # may report through it without the verl wrappers.
        hooks.uninstall_all()
        self.tracing = None
        if self._metrics is not None:  # the tracer provider keeps it, recording nothing more
            self._metrics.shutdown()
            self._metrics = None


def _metrics_into(meter_provider: Any, tracer_provider: Any) -> Any:
    """A metrics processor recording into ``meter_provider``, on ``tracer_provider``'s spans."""
    from otel_verl.exporters.metrics import SpanMetricsProcessor

    add = getattr(tracer_provider, "add_span_processor", None)
    if add is None:  # the API's proxy: no SDK provider to derive the metrics from
        logger.warning("otel_verl: instrument(meter_provider=...) needs an SDK TracerProvider (tracer_provider=...) "
                       "to derive its metrics from the spans; no metrics")
        return None
    processor = SpanMetricsProcessor(meter_provider=meter_provider)
    add(processor)
    return processor
