"""OpenTelemetry tracing for verl: one trace per prompt uid, one per training step.

``import otel_verl`` is cheap: it imports neither verl, torch nor Ray.

    import otel_verl
    otel_verl.configure(trace_dir="/tmp/trace")   # or VERL_TRACE_DIR / OTEL_EXPORTER_OTLP_ENDPOINT
"""

from otel_verl.bootstrap import configure, flush, shutdown
from otel_verl.version import __version__

__all__ = ["configure", "flush", "shutdown", "__version__"]
