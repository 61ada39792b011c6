"""Installing the wrappers on verl, tolerant of version drift.

A :class:`Hook` names one wrap target: module, ``Class.method`` or function, and the
parameters the wrapper reads. A target that is missing or whose parameters changed in
the installed verl is skipped with one warning, never an exception. Targets in modules
not imported yet are wrapped when their module is imported (wrapt post-import hooks), so
import order does not matter. :func:`status` lists what was installed or skipped.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import wrapt
from opentelemetry.instrumentation.utils import unwrap

from otel_verl import health
from otel_verl.instrumentation._wrapper import owner_of, wrap

logger = logging.getLogger("otel_verl")

INSTALLED = "installed"
SKIPPED = "skipped"
PENDING = "pending"  # module not imported in this process (yet)


@dataclass(frozen=True)
class Hook:
    module: str  # e.g. "verl.experimental.agent_loop.agent_loop"
    target: str  # "Class.method" or "function"
    wrapper: Callable[..., Any]  # wrapt's (wrapped, instance, args, kwargs)
    params: Tuple[str, ...] = ()  # parameters the wrapper reads; checked before wrapping
    component: str = ""  # the instrumentation module that owns it (for doctor)
    # For a decorated target whose decorator must stay outermost (verl's @auto_await looks
    # at its caller's frame): wrap ``target.__wrapped__`` and apply the decorator again.
    redecorate: Optional[Callable[[Callable[..., Any]], Callable[..., Any]]] = None

    @property
    def name(self) -> str:
        return f"{self.module}:{self.target}"


_lock = threading.Lock()
_status: Dict[str, Tuple[str, str]] = {}  # hook name -> (state, reason)
_waiting: Dict[str, Hook] = {}  # hook name -> the hook waiting for its module to be imported
_patches: List[Tuple[Any, str, Any]] = []  # (owner, attribute, original or None when wrapt-wrapped)


def install_all(hooks: List[Hook]) -> None:
    for hook in hooks:
        with _lock:
            if _status.get(hook.name, ("",))[0] in (INSTALLED, PENDING):
                continue
            _status[hook.name] = (PENDING, "module not imported yet")
            _waiting[hook.name] = hook
        if hook.module in sys.modules:
            _install(hook, sys.modules[hook.module])
        else:
            wrapt.register_post_import_hook(lambda module, h=hook: _install_if_pending(h, module), hook.module)


def _install_if_pending(hook: Hook, module: Any) -> None:
    """A post-import hook (wrapt keeps it for good): installs only while this very hook
    still waits for its module: not after an uninstall, nor an earlier instrumentation's
    wrapper after instrumenting again."""
    with _lock:
        if _waiting.get(hook.name) is not hook:
            return
    _install(hook, module)


def _install(hook: Hook, module: Any) -> None:
    try:
        problem = _check(hook, module)
        if problem:
            _skip(hook, problem)
            return
        owner, attr = owner_of(module, hook.target)
        if hook.redecorate is None:
            wrap(owner, attr, hook.wrapper, (hook.module, hook.target))
            _installed(hook.name, (owner, attr, None))
            return
        original = inspect.getattr_static(owner, attr)
        inner = getattr(original, "__wrapped__", None)
        if inner is None:
            _skip(hook, f"{hook.target} is no longer decorated as expected (no __wrapped__)")
            return
        setattr(owner, attr, hook.redecorate(wrapt.FunctionWrapper(inner, hook.wrapper)))
        _installed(hook.name, (owner, attr, original))
    except Exception as exc:  # never let a hook break verl's import
        _skip(hook, f"{type(exc).__name__}: {exc}")


def install_on(owner: Any, attr: str, wrapper: Callable[..., Any]) -> None:
    """Wrap ``owner.attr`` found at run time (e.g. agent loop classes from verl's registry)."""
    target = f"{owner.__qualname__}.{attr}"
    hook = Hook(module=owner.__module__, target=target, wrapper=wrapper)
    with _lock:
        if _status.get(hook.name, ("",))[0] == INSTALLED:
            return
    if attr not in vars(owner):
        _skip(hook, f"{target} is inherited, not defined here")
        return
    try:
        wrap(owner, attr, wrapper, (hook.module, target))
    except Exception as exc:
        _skip(hook, f"{type(exc).__name__}: {exc}")
        return
    _installed(hook.name, (owner, attr, None))


def _installed(name: str, patch: Tuple[Any, str, Any]) -> None:
    with _lock:
        _waiting.pop(name, None)
        _status[name] = (INSTALLED, "")
        _patches.append(patch)


def _check(hook: Hook, module: Any) -> str:
    """What keeps ``hook`` from being installed on ``module`` ("" when nothing)."""
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
            parameters = inspect.signature(func).parameters
        except (TypeError, ValueError):
            return f"{hook.target}: signature unreadable"
        takes_any_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        missing = [p for p in hook.params if p not in parameters and not takes_any_keyword]
        if missing:
            return f"{hook.target}: parameters changed (missing {', '.join(missing)})"
    return ""


def _skip(hook: Hook, reason: str) -> None:
    with _lock:
        _waiting.pop(hook.name, None)
        _status[hook.name] = (SKIPPED, reason)
    logger.warning("otel_verl: hook %s skipped: %s", hook.name, reason)


def uninstall_all() -> None:
    with _lock:
        patches = list(_patches)
        _patches.clear()
        _status.clear()
        _waiting.clear()
    for owner, attr, original in reversed(patches):
        try:
            if original is None:
                unwrap(owner, attr)
            else:
                setattr(owner, attr, original)
        except Exception as exc:
            health.record_failure("hooks.uninstall", exc)


def status() -> Dict[str, Tuple[str, str]]:
    """``{hook name: (installed|skipped|pending, reason)}`` for this process."""
    with _lock:
        return dict(_status)
