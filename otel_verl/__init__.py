"""OpenTelemetry tracing for verl: one trace per prompt uid, one per training step.

``import otel_verl`` is cheap: it imports neither verl, torch nor Ray, and the
configurator (``otel_verl.bootstrap``) only when ``configure``, ``flush`` or ``shutdown``
is first used, so that code using only the instrumentation never loads it.

    import otel_verl
    otel_verl.configure(trace_dir="/tmp/trace")   # or VERL_TRACE_DIR / OTEL_EXPORTER_OTLP_ENDPOINT
"""

from typing import Any

from otel_verl.version import __version__

__all__ = ["configure", "flush", "shutdown", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("configure", "flush", "shutdown"):
        from otel_verl import bootstrap

        return getattr(bootstrap, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
