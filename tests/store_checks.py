"""What the report's tests share: the report of some paths as ``otel-verl report`` builds
it, and floats rounded for equality with the reference report (the engine sums in another
order)."""

from __future__ import annotations

import math


def rounded(value):
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 6)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def report_of(paths, **options):
    """``otel-verl report PATHS --json``'s dict, built in this process: their embedded store
    (beside a trace dir, else in otel_verl's cache), loaded with what they gained, read."""
    from otel_verl.tools.store import report
    from otel_verl.tools.store.store import open_store

    store, load, inputs = open_store(list(paths), None)
    with store:
        return report.read(store, list(paths), inputs=inputs, load=load, **options)
