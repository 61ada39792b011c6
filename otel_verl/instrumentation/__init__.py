"""``VerlInstrumentor``: wraps stock verl's classes so a training run emits otel_verl spans.

Usage (normally done for you in every Ray process by :mod:`otel_verl.activation`)::

    from otel_verl.instrumentation import VerlInstrumentor
    VerlInstrumentor().instrument()

Each verl component has its own module holding a table of wrap targets
(:class:`otel_verl.instrumentation.hooks.Hook`) and thin wrappers that call
:mod:`otel_verl.events`. A target that is missing or changed in the installed verl is
skipped with one warning; :func:`hooks.status` lists what was installed.
"""

from __future__ import annotations

from typing import Any, Collection, List

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_verl.instrumentation import hooks
from otel_verl.instrumentation.package import _instruments


def all_hooks() -> List[hooks.Hook]:
    """Every wrap target of every component, in install order."""
    from otel_verl.instrumentation import (
        _trainer,
        agent_loop,
        agent_loop_tq,
        llm_client,
        llm_server,
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
    ]


class VerlInstrumentor(BaseInstrumentor):
    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        hooks.install_all(all_hooks())

    def _uninstrument(self, **kwargs: Any) -> None:
        hooks.uninstall_all()
