"""The wrapper type otel_verl patches verl with: a wrapt FunctionWrapper that survives Ray.

Ray copies every method of an actor class into a subclass it pickles by value (its
``_modify_class`` / ``_inject_tracing_into_class``), capturing the method objects of the
process that called ``ray.remote(cls)``. cloudpickle turns a plain FunctionWrapper into
the bare wrapped function, so an actor would run its creator's *unwrapped* code and
never our wrappers. This wrapper pickles as a *reference* to the attribute it patches:
the actor process resolves it in its own module, wrapped there when otel_verl is active
in it, plain otherwise.
"""

from __future__ import annotations

import importlib
import types
from typing import Any, Tuple

import wrapt


def owner_of(root: Any, target: str) -> Tuple[Any, str]:
    """``(object holding the attribute, attribute name)`` of a dotted ``target`` in ``root``."""
    owner_path, _, attr = target.rpartition(".")
    owner = root
    for part in filter(None, owner_path.split(".")):
        owner = getattr(owner, part)
    return owner, attr


def resolve_reference(module_name: str, target: str) -> Any:
    """``module.Class.attr`` as the unpickling process has it."""
    owner, attr = owner_of(importlib.import_module(module_name), target)
    return getattr(owner, attr)


_bind = wrapt.FunctionWrapper.__get__  # (no super() per method access: several per LLM turn)


class _BoundPicklableWrapper(wrapt.BoundFunctionWrapper):
    def __reduce_ex__(self, protocol: int) -> Any:
        return self._self_parent.__reduce_ex__(protocol)


class PicklableFunctionWrapper(wrapt.FunctionWrapper):
    __bound_function_wrapper__ = _BoundPicklableWrapper

    def __init__(self, wrapped: Any, wrapper: Any, ref: Tuple[str, str]) -> None:
        super().__init__(wrapped, wrapper)
        self._self_ref = ref  # (module name, dotted attribute path)
        self._self_unbound = None

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is not None:  # a method call on an instance: wrapt's own binding
            return _bind(self, instance, owner)
        # Accessed on a class: always the same object, so that cloudpickle recognises it
        # (``getattr(module.Class, name) is obj``) and pickles it by reference.
        if isinstance(self.__wrapped__, types.FunctionType):
            if self._self_unbound is None:
                self._self_unbound = _bind(self, None, owner)
            return self._self_unbound
        return _bind(self, None, owner)

    def __reduce_ex__(self, protocol: int) -> Any:
        return (resolve_reference, self._self_ref)


def wrap(root: Any, target: str, wrapper: Any, ref: Tuple[str, str]) -> None:
    """Patch ``root.<target>`` with ``wrapper`` (wrapt signature)."""
    wrapt.wrap_object(root, target, PicklableFunctionWrapper, (wrapper, ref))
