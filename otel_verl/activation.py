"""Switching tracing on in every process of a verl job, without editing verl.

A verl job runs in many processes: the Hydra driver, the TaskRunner actor hosting the
trainer, AgentLoopWorker actors, LLM server actors, reward workers, GPU worker groups.
Each must install the wrappers itself. Four ways in, from most to least explicit:

1. Ray's ``worker_process_setup_hook`` (a *string* module path, so it is not pickled)
   plus forwarding of ``VERL_TRACE_DIR``, ``OTEL_*`` and ``OTEL_VERL_*`` to every worker.
   On ``python -m verl.trainer.main_ppo`` these are Hydra overrides
   (:func:`hydra_overrides`), which verl merges into ``ray.init``.
2. ``otel-verl run -- <command>``: puts :mod:`otel_verl._sitecustomize` on
   ``PYTHONPATH``; the driver then patches ``ray.init`` to add (1) for the user.
3. The ``opentelemetry_instrumentor`` entry point, for ``opentelemetry-instrument``.
4. Self-activation: unpickling a :class:`otel_verl.carriers.TraceCarrier` of this
   process's run in a process where tracing is off turns it on with the process's own
   settings (verl overrides per-actor runtime envs in places, which can drop the job's
   setup hook; Ray still merges the job's ``env_vars`` into every actor's, so (1)'s
   forwarded variables are there). A carrier brings no settings and changes nothing in
   ``os.environ``: it may come from data another run saved (TransferQueue).
   A carrier is unpickled by :func:`restore_carrier`, which pickle names by its module
   path: importing this module registers it with :mod:`otel_verl.carriers`, and a
   process that receives such a carrier imports this module to unpickle it. The
   instrumentation itself never imports this module nor :mod:`otel_verl.bootstrap`.

Everything here is idempotent and never raises.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from typing import Any, Dict, List, Mapping, Optional

from otel_verl import carriers, forks, health, settings

logger = logging.getLogger("otel_verl")

SETUP_HOOK = "otel_verl.activation.worker_setup"

_lock = threading.Lock()
_activated_pid: Optional[int] = None
_pid = os.getpid()  # kept current by a fork hook: every carrier unpickled asks (a system call each)


@forks.in_child
def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


setup_hook_calls = 0  # how often the hook ran in this process (tests, doctor)


def worker_setup() -> None:
    """Ray ``worker_process_setup_hook``: runs once in each worker process."""
    global setup_hook_calls
    setup_hook_calls += 1
    activate()


def activate() -> bool:
    """Install the verl wrappers in this process when its settings switch tracing on.

    The tracer provider itself is built lazily, by
    :func:`otel_verl.bootstrap.provider_for_role` when the first wrapper fires: only
    the wrappers know the process's role. Returns whether tracing is on.
    """
    global _activated_pid
    try:
        with _lock:
            if _activated_pid == _pid:
                return True
            if not settings.load().enabled:
                return False
            _activated_pid = _pid
        from opentelemetry.instrumentation.dependencies import get_dependency_conflicts

        from otel_verl import bootstrap
        from otel_verl.instrumentation import VerlInstrumentor

        instrumentor = VerlInstrumentor()
        conflict = get_dependency_conflicts(instrumentor.instrumentation_dependencies())
        if conflict is not None:  # the instrumentor would print a bare "DependencyConflict"
            why = "verl is not installed here" if conflict.found is None else f"{conflict.found} is not {conflict.required}"
            logger.warning("otel_verl: tracing is off in %s: %s (install otel-verl[verl] where training runs)",
                           sys.executable or "this Python", why)
            return False
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument(provider_for_role=bootstrap.provider_for_role)
        return True
    except settings.ConfigError as exc:
        logger.error("otel_verl: tracing stays off: %s", exc)
        return False
    except Exception as exc:
        health.record_failure("activation.activate", exc)
        return False


def restore_carrier(
    headers: Dict[str, str], run_id: Any, row: Optional[Mapping[str, Any]] = None
) -> "carriers.TraceCarrier":
    """Unpickles a carrier sent from a process where this module was imported: switches
    tracing on here first when the carrier comes from this process's run (see module
    docs). A carrier from another run still gives its context as a parent: it is where
    the row came from (a sample saved by one run and finished by the next), and each
    span's resource says which run it belongs to."""
    carrier = carriers.restore(headers, run_id, row)
    if _activated_pid != _pid and carrier.run_id is not None:
        _activate_for_run(carrier.run_id)
    return carrier


def _activate_for_run(carrier_run_id: str) -> None:
    """Self-activation for a carrier of this process's run; never raises: unpickling
    never fails because of tracing."""
    try:
        from otel_verl import bootstrap

        if carrier_run_id == bootstrap.known_run_id():
            activate()
    except Exception as exc:
        health.record_failure("activation.carrier", exc)


carriers.restore_with(restore_carrier)


def is_active() -> bool:
    return _activated_pid == _pid


# --------------------------------------------------------------------------- Ray runtime env


def runtime_env(base: Optional[Mapping[str, Any]] = None, env: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """``base`` (a Ray runtime_env) plus otel_verl's setup hook and forwarded variables
    (never a secret: Ray writes a runtime env into its logs).

    A setup hook the user set already is kept (theirs wins; then only the self-
    activation path turns tracing on in workers) and reported once.
    """
    out: Dict[str, Any] = dict(base or {})
    hook = out.get("worker_process_setup_hook")
    if hook is None:
        out["worker_process_setup_hook"] = SETUP_HOOK
    elif hook != SETUP_HOOK:
        logger.warning("otel_verl: runtime_env already has worker_process_setup_hook=%r; "
                       "otel_verl relies on self-activation in workers", hook)
    env_vars = dict(settings.forwarded_env(env))
    env_vars.update(out.get("env_vars") or {})  # the user's explicit values win
    out["env_vars"] = settings.with_run_resource(env_vars)
    return out


def hydra_overrides(env: Optional[Mapping[str, str]] = None) -> List[str]:
    """Hydra overrides that switch tracing on in a ``verl.trainer.main_ppo`` run. Secrets
    (:func:`otel_verl.settings.is_secret`) are left out, as from every runtime env."""
    prefix = "+ray_kwargs.ray_init.runtime_env"
    out = [f"{prefix}.worker_process_setup_hook={SETUP_HOOK}"]
    for key, value in sorted(settings.with_run_resource(settings.forwarded_env(env)).items()):
        out.append(f"{prefix}.env_vars.{key}={hydra_quote(value)}")
    return out


def hydra_quote(value: str) -> str:
    """``value`` as one Hydra override value (quoted unless it is a plain word or path).

    Inside quotes Hydra halves only the backslashes before a quote (the one that escapes
    it and the string's closing one): those are doubled, the others left as they are."""
    if value and all(c.isalnum() or c in "/._-:" for c in value):
        return value
    escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    escaped = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped)
    return "'" + escaped + "'"


def patch_ray_init() -> None:
    """Make every later ``ray.init`` in this process carry :func:`runtime_env`."""
    import wrapt

    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        try:
            kwargs = dict(kwargs)
            kwargs["runtime_env"] = runtime_env(kwargs.get("runtime_env"))
        except Exception as exc:
            health.record_failure("activation.ray_init", exc)
        return wrapped(*args, **kwargs)

    @wrapt.when_imported("ray")
    def _patch(ray_module: Any) -> None:
        if not getattr(ray_module.init, "_otel_verl_patched", False):
            wrapt.wrap_function_wrapper(ray_module, "init", wrapper)
            ray_module.init._otel_verl_patched = True


def driver_activate() -> None:
    """What ``otel-verl run`` does in the launched process (via sitecustomize)."""
    try:
        if not settings.load().enabled:
            return
        os.environ.setdefault(settings.RUN_ID, _new_run_id())
        patch_ray_init()
        activate()
    except Exception as exc:
        health.record_failure("activation.driver", exc)


def _new_run_id() -> str:
    import uuid

    return uuid.uuid4().hex
