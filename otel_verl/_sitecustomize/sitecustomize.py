"""Put on PYTHONPATH by ``otel-verl run``: activates otel_verl in every Python process
started under it (the driver, and Ray workers of a local cluster, which inherit the
environment), then hands over to any other ``sitecustomize`` further down the path.

Any Python the command starts runs this, also one that cannot import otel_verl (a system
Python, a virtual environment without it): there it says in one line that tracing is off
and why, and still hands over. It imports only the standard library before that."""

import importlib.machinery
import importlib.util
import os
import sys


def _activate():
    try:
        from otel_verl.activation import driver_activate
    except Exception as exc:  # tracing must never stop a program from starting
        python = sys.executable or "this Python"
        if isinstance(exc, ImportError) and (exc.name or "").split(".")[0] == "otel_verl":
            why = "it cannot import otel_verl (install otel-verl in that environment)"
        else:
            why = "importing otel_verl failed ({}: {})".format(type(exc).__name__, exc)
        sys.stderr.write("otel-verl: tracing is off in {}: {}\n".format(python, why))
        return
    driver_activate()  # never raises: what fails is counted in otel_verl.health


def _run_next_sitecustomize():
    """Run the ``sitecustomize`` this one hides: the first on ``sys.path`` after this directory."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or not spec.origin or os.path.dirname(os.path.abspath(spec.origin)) == here:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


try:
    _activate()
finally:
    _run_next_sitecustomize()
