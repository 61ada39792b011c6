"""Put on PYTHONPATH by ``otel-verl run``: activates otel_verl in every Python process
started under it (the driver, and Ray workers of a local cluster, which inherit the
environment), then hands over to any other ``sitecustomize`` further down the path."""

import importlib.util
import os
import sys

try:
    from otel_verl.activation import driver_activate

    driver_activate()
except Exception:  # tracing must never stop a program from starting
    pass

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.origin and os.path.dirname(os.path.abspath(_spec.origin)) != _here:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
