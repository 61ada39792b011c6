"""``VerlInstrumentor``: wraps stock verl's classes so a training run emits otel_verl spans.

Usage, as any opentelemetry-python-contrib instrumentor::

    from otel_verl.instrumentation import VerlInstrumentor
    VerlInstrumentor().instrument(tracer_provider=provider)  # or the global provider

It configures no SDK: building a provider with otel_verl's outputs is
``otel_verl.configure``'s job, and in every Ray process :mod:`otel_verl.activation`
instruments with ``provider_for_role`` (see :mod:`.tracing`), so that the first wrapper
to fire builds the provider for its process's role.

Each verl component has its own module holding a table of wrap targets
(:class:`otel_verl.instrumentation.hooks.Hook`) and thin wrappers that call
:mod:`otel_verl.events`. A target that is missing or changed in the installed verl is
skipped with one warning; :func:`hooks.status` lists what was installed.
"""

from __future__ import annotations

from typing import Any, Collection, List

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_verl import events
from otel_verl.instrumentation import hooks, tracing
from otel_verl.instrumentation.package import _instruments


def all_hooks() -> List[hooks.Hook]:
    """Every wrap target of every component, in install order."""
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

    return [
        *_trainer.HOOKS,
        *trainer_v0.HOOKS,
        *trainer_v1.HOOKS,
        *trainer_separation.HOOKS,
        *agent_loop.HOOKS,
        *agent_loop_tq.HOOKS,
        *llm_client.HOOKS,
        *llm_server.HOOKS,
        *reward_loop.HOOKS,
    ]


class VerlInstrumentor(BaseInstrumentor):
    """``instrument(tracer_provider=None, provider_for_role=None)``: spans go to
    ``tracer_provider``; without one, to the provider ``provider_for_role(role)`` returns
    when the first wrapper fires; without either, to the provider the events API already
    reports to (``otel_verl.configure`` ran here), else to the global one."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        tracer_provider = kwargs.get("tracer_provider")
        provider_for_role = kwargs.get("provider_for_role")
        if tracer_provider is None and provider_for_role is not None:
            tracing.provide_on_first_use(provider_for_role)
        elif tracer_provider is not None or not events.enabled():
            tracing.use_provider(tracer_provider)
        # else configure() kept its own provider beside another library's global one: so do we
        hooks.install_all(all_hooks())

    def _uninstrument(self, **kwargs: Any) -> None:
        # The events API keeps its provider: code of one's own (a custom agent loop)
        # may report through it without the verl wrappers.
        hooks.uninstall_all()
        tracing.provide_on_first_use(None)
