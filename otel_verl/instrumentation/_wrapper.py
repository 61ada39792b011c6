"""The wrapt FunctionWrapper otel_verl patches verl with, made to survive Ray.

``ray.remote(cls)`` copies the methods of an actor class into a subclass that cloudpickle
sends to the actor process by value. cloudpickle sends a plain FunctionWrapper as the
bare function it wraps, so the actor would run verl's code without our wrappers. This
wrapper pickles as a reference to the attribute it patches instead: the actor process
looks it up in its own copy of the module (wrapped there when tracing is on there).
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


class _BoundPicklableWrapper(wrapt.BoundFunctionWrapper):
    def __reduce_ex__(self, protocol: int) -> Any:
        return self._self_parent.__reduce_ex__(protocol)


class PicklableFunctionWrapper(wrapt.FunctionWrapper):
    __bound_function_wrapper__ = _BoundPicklableWrapper

    def __init__(self, wrapped: Any, wrapper: Any, reference: Tuple[str, str]) -> None:
        super().__init__(wrapped, wrapper)
        self._self_reference = reference  # (module name, dotted attribute path)
        self._self_on_class = None

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        # cloudpickle sends a method by reference only if looking it up on its class again
        # gives the very same object: so a lookup on the class always returns one object.
        if instance is None and isinstance(self.__wrapped__, types.FunctionType):
            if self._self_on_class is None:
                self._self_on_class = super().__get__(None, owner)
            return self._self_on_class
        return super().__get__(instance, owner)

    def __reduce_ex__(self, protocol: int) -> Any:
        return resolve_reference, self._self_reference


def wrap(owner: Any, attr: str, wrapper: Any, reference: Tuple[str, str]) -> None:
    """Patch ``owner.attr`` with ``wrapper`` (wrapt's ``(wrapped, instance, args, kwargs)``);
    ``reference``: (module name, dotted path) where another process finds it."""
    wrapt.wrap_object(owner, attr, PicklableFunctionWrapper, (wrapper, reference))
