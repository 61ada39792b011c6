"""Installing wrappers on verl, tolerant of version drift.

A :class:`Hook` names one wrap target as data (module, ``Class.method`` or function,
the parameters the wrapper reads). Installing checks that the target exists and has
those parameters; a missing or changed target is *skipped* with one warning, never an
exception. Targets in modules not imported yet are installed when the module is
imported (``wrapt.when_imported``), so import order does not matter and a process pays
only for the verl modules it uses. :func:`status` lists what was installed or skipped.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import wrapt
from opentelemetry.instrumentation.utils import unwrap

from otel_verl import health

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

    @property
    def name(self) -> str:
        return f"{self.module}:{self.target}"


_lock = threading.Lock()
_status: Dict[str, Tuple[str, str]] = {}  # hook name -> (state, reason)
_installed: List[Hook] = []
_originals: Dict[str, Any] = {}  # hook name -> attribute replaced by a redecorated wrapper


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
        if hook.redecorate is None:
            _wrap(module, hook.target, hook.wrapper, (hook.module, hook.target))
        else:
            problem = _wrap_inner(hook, module)
            if problem:
                _skip(hook, problem)
                return
        with _lock:
            _status[hook.name] = (INSTALLED, "")
            _installed.append(hook)
    except Exception as exc:  # never let a hook break verl's import
        _skip(hook, f"{type(exc).__name__}: {exc}")


class _BoundPicklableWrapper(wrapt.BoundFunctionWrapper):
    def __reduce_ex__(self, protocol: int) -> Any:
        return self._self_parent.__reduce_ex__(protocol)


class PicklableFunctionWrapper(wrapt.FunctionWrapper):
    """A wrapt FunctionWrapper that pickles as a *reference* to the attribute it patches.

    Ray copies every method of an actor class into a subclass it pickles by value (its
    ``_modify_class`` / ``_inject_tracing_into_class``), capturing the method objects of
    the creating process. cloudpickle turns a plain FunctionWrapper into the bare wrapped
    function, so a worker would run the creator's unwrapped code and never our wrappers.
    Pickled by reference, the worker resolves the method in its own process: wrapped
    there when otel_verl is active, plain otherwise.
    """

    __bound_function_wrapper__ = _BoundPicklableWrapper

    def __init__(self, wrapped: Any, wrapper: Any, ref: Tuple[str, str]) -> None:
        super().__init__(wrapped, wrapper)
        self._self_ref = ref
        self._self_unbound = None

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        # Accessed on a class: always the same object, so that cloudpickle recognises
        # it (``getattr(module.Class, name) is obj``) and pickles it by reference.
        if instance is None and isinstance(self.__wrapped__, types.FunctionType):
            if self._self_unbound is None:
                self._self_unbound = super().__get__(None, owner)
            return self._self_unbound
        return super().__get__(instance, owner)

    def __reduce_ex__(self, protocol: int) -> Any:
        return (resolve_reference, self._self_ref)


def resolve_reference(module_name: str, target: str) -> Any:
    """``module.Class.attr`` as the receiving process has it (see PicklableFunctionWrapper)."""
    import importlib

    owner, attr = _owner(importlib.import_module(module_name), target)
    return getattr(owner, attr)


def _wrap(parent: Any, path: str, wrapper: Any, ref: Tuple[str, str]) -> None:
    wrapt.wrap_object(parent, path, PicklableFunctionWrapper, (wrapper, ref))


def _owner(module: Any, target: str) -> Tuple[Any, str]:
    owner_path, _, attr = target.rpartition(".")
    owner = module
    for part in filter(None, owner_path.split(".")):
        owner = getattr(owner, part)
    return owner, attr


def _wrap_inner(hook: Hook, module: Any) -> str:
    owner, attr = _owner(module, hook.target)
    original = inspect.getattr_static(owner, attr)
    inner = getattr(original, "__wrapped__", None)
    if inner is None:
        return f"{hook.target} is no longer decorated as expected (no __wrapped__)"
    setattr(owner, attr, hook.redecorate(wrapt.FunctionWrapper(inner, hook.wrapper)))
    _originals[hook.name] = original
    return ""


def install_on(owner: Any, attr: str, wrapper: Callable[..., Any], name: str) -> None:
    """Wrap ``owner.attr`` found at run time (e.g. agent loop classes from verl's registry)."""
    hook = Hook(module=getattr(owner, "__module__", "?"), target=f"{getattr(owner, '__qualname__', owner)}.{attr}",
                wrapper=wrapper, component=name)
    with _lock:
        if _status.get(hook.name, ("",))[0] == INSTALLED:
            return
    if attr not in getattr(owner, "__dict__", {}):
        _skip(hook, f"{hook.target} is inherited, not defined here")
        return
    try:
        _wrap(owner, attr, wrapper, (owner.__module__, f"{owner.__qualname__}.{attr}"))
    except Exception as exc:
        _skip(hook, f"{type(exc).__name__}: {exc}")
        return
    with _lock:
        _status[hook.name] = (INSTALLED, "")
        _installed.append(Hook(module="", target=attr, wrapper=wrapper, component=name, redecorate=None))
        _dynamic_owners[id(_installed[-1])] = owner


_dynamic_owners: Dict[int, Any] = {}


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
        hooks = list(_installed)
        _installed.clear()
        _status.clear()
        originals = dict(_originals)
        _originals.clear()
        dynamic = dict(_dynamic_owners)
        _dynamic_owners.clear()
    for hook in hooks:
        try:
            if id(hook) in dynamic:
                owner, attr = dynamic[id(hook)], hook.target
            else:
                owner, attr = _owner(sys.modules[hook.module], hook.target)
            if hook.name in originals:
                setattr(owner, attr, originals[hook.name])
            else:
                unwrap(owner, attr)
        except Exception as exc:
            health.record_failure("hooks.uninstall", exc)


def status() -> Dict[str, Tuple[str, str]]:
    """``{hook name: (installed|skipped|pending, reason)}`` for this process."""
    with _lock:
        return dict(_status)
