"""Installing wrappers on verl, tolerant of version drift.

A :class:`Hook` names one wrap target as data (module, ``Class.method`` or function,
the parameters the wrapper reads). Installing checks that the target exists and has
those parameters; a missing or changed target is *skipped* with one warning, never an
exception. Targets in modules not imported yet are installed when the module is
imported (wrapt post-import hooks), so import order does not matter and a process pays
only for the verl modules it uses. :func:`status` lists what was installed or skipped.
"""

from __future__ import annotations

import functools
import inspect
import logging
import operator
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import wrapt
from opentelemetry.instrumentation.utils import unwrap

from otel_verl import health
from otel_verl.events import _core as _events_core
from otel_verl.instrumentation import tracing
from otel_verl.instrumentation._wrapper import owner_of, wrap

logger = logging.getLogger("otel_verl")

INSTALLED = "installed"
SKIPPED = "skipped"
PENDING = "pending"  # module not imported in this process (yet)


@dataclass(frozen=True)
class Hook:
    module: str  # e.g. "verl.experimental.agent_loop.agent_loop"
    target: str  # "Class.method" or "function"
    wrapper: Callable[..., Any]  # wrapt signature: (wrapped, instance, args, kwargs)
    params: Tuple[str, ...] = ()  # parameters the wrapper reads; checked before wrapping
    component: str = ""  # which instrumentation module owns it (for doctor)
    # For decorated targets whose decorator must stay outermost (verl's @auto_await looks
    # at its caller's frame): wrap ``target.__wrapped__`` and re-apply the decorator.
    redecorate: Optional[Callable[[Callable[..., Any]], Callable[..., Any]]] = None
    gate: str = "reports"  # when the wrapper may step aside: see REPORTS, STARTS, ALWAYS

    @property
    def name(self) -> str:
        return f"{self.module}:{self.target}"


@dataclass(frozen=True)
class _Patch:
    """One installed wrapper: where it is, and what to put back on uninstall."""

    owner: Any
    attr: str
    original: Any = None  # set when the attribute was replaced rather than wrapt-wrapped


# What a wrapper does decides when it can step aside (installed but tracing off costs a
# wrapt call and one check, not an argument binding):
REPORTS = "reports"  # only reports events: skipped while this process has no events runtime
STARTS = "starts"  # may switch tracing on in its process: skipped once that was found off
ALWAYS = "always"  # moves carriers out of verl's data or installs more hooks: always runs


# The events runtime, read in C (wrapt calls ``enabled`` before each wrapped call; a
# Python function would add a frame): a runtime object is true, None is false.
_reports_enabled = functools.partial(operator.attrgetter("_runtime"), _events_core)


def _starts_enabled() -> bool:
    return _events_core._runtime is not None or not tracing.known_off()


# wrapt's ``enabled`` check, asked before each call: a wrapper that steps aside is not
# called at all (a gate function around it would cost a call frame per wrapped call)
_ENABLED = {REPORTS: _reports_enabled, STARTS: _starts_enabled, ALWAYS: None}


_lock = threading.Lock()
_status: Dict[str, Tuple[str, str]] = {}  # hook name -> (state, reason)
_patches: List[_Patch] = []


def install_all(hooks: List[Hook]) -> None:
    for hook in hooks:
        with _lock:
            if _status.get(hook.name, ("",))[0] in (INSTALLED, PENDING):
                continue
            _status[hook.name] = (PENDING, "module not imported yet")
        if hook.module in sys.modules:
            _install(hook, sys.modules[hook.module])
        else:
            wrapt.register_post_import_hook(lambda module, h=hook: _install(h, module), hook.module)


def _install(hook: Hook, module: Any) -> None:
    try:
        problem = _check(hook, module)
        if problem:
            _skip(hook, problem)
            return
        owner, attr = owner_of(module, hook.target)
        enabled = _ENABLED[hook.gate]
        if hook.redecorate is None:
            wrap(module, hook.target, hook.wrapper, (hook.module, hook.target), enabled)
            patch = _Patch(owner, attr)
        else:
            original = inspect.getattr_static(owner, attr)
            inner = getattr(original, "__wrapped__", None)
            if inner is None:
                _skip(hook, f"{hook.target} is no longer decorated as expected (no __wrapped__)")
                return
            setattr(owner, attr, hook.redecorate(wrapt.FunctionWrapper(inner, hook.wrapper, enabled)))
            patch = _Patch(owner, attr, original)
        _installed(hook.name, patch)
    except Exception as exc:  # never let a hook break verl's import
        _skip(hook, f"{type(exc).__name__}: {exc}")


def install_on(owner: Any, attr: str, wrapper: Callable[..., Any]) -> None:
    """Wrap ``owner.attr`` found at run time (e.g. agent loop classes from verl's registry)."""
    target = f"{getattr(owner, '__qualname__', owner)}.{attr}"
    hook = Hook(module=getattr(owner, "__module__", "?"), target=target, wrapper=wrapper)
    with _lock:
        if _status.get(hook.name, ("",))[0] == INSTALLED:
            return
    if attr not in vars(owner):
        _skip(hook, f"{target} is inherited, not defined here")
        return
    try:
        wrap(owner, attr, wrapper, (hook.module, target), _reports_enabled)
    except Exception as exc:
        _skip(hook, f"{type(exc).__name__}: {exc}")
        return
    _installed(hook.name, _Patch(owner, attr))


def _installed(name: str, patch: _Patch) -> None:
    with _lock:
        _status[name] = (INSTALLED, "")
        _patches.append(patch)


def _check(hook: Hook, module: Any) -> str:
    owner: Any = module
    parts = hook.target.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part, None)
        if owner is None:
            return f"{'.'.join(parts[:-1])} not found"
    func = inspect.getattr_static(owner, parts[-1], None)
    if func is None:
        return f"{hook.target} not found"
    if isinstance(func, (staticmethod, classmethod)):
        func = func.__func__
    if not callable(func):
        return f"{hook.target} is not callable"
    if hook.params:
        try:
            sig = inspect.signature(func)
        except (TypeError, ValueError):
            return f"{hook.target}: signature unreadable"
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        missing = [p for p in hook.params if p not in sig.parameters and not has_var_kw]
        if missing:
            return f"{hook.target}: parameters changed (missing {', '.join(missing)})"
    return ""


def _skip(hook: Hook, reason: str) -> None:
    with _lock:
        _status[hook.name] = (SKIPPED, reason)
    logger.warning("otel_verl: hook %s skipped: %s", hook.name, reason)


def uninstall_all() -> None:
    with _lock:
        patches = list(_patches)
        _patches.clear()
        _status.clear()
    for patch in reversed(patches):
        try:
            if patch.original is not None:
                setattr(patch.owner, patch.attr, patch.original)
            else:
                unwrap(patch.owner, patch.attr)
        except Exception as exc:
            health.record_failure("hooks.uninstall", exc)


def status() -> Dict[str, Tuple[str, str]]:
    """``{hook name: (installed|skipped|pending, reason)}`` for this process."""
    with _lock:
        return dict(_status)
