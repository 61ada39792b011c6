"""Metrics as OTLP-JSON lines, in the OpenTelemetry Collector file exporter's format.

The metrics' embedded default when no OTLP endpoint is set, beside the spans' files: each
collection becomes one ``{"resourceMetrics":[...]}`` line in
``{trace_dir}/otlp-metrics/metrics-{hostname}-pid{pid}.jsonl`` (rotated as the spans' files
are; a directory of its own, as span readers take every ``otlp/*.jsonl`` line for spans).
The JSON is the SDK's OTLP encoding through protobuf's ``MessageToDict`` with the
Collector's spelling: lowerCamelCase keys, enums as integers, exemplars' ids in lowercase hex.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Dict

from opentelemetry.sdk.metrics import Counter, Histogram, ObservableCounter, ObservableGauge, ObservableUpDownCounter, UpDownCounter
from opentelemetry.sdk.metrics.export import AggregationTemporality, MetricExporter, MetricExportResult

from otel_verl import health
from otel_verl.exporters._writer import REOPEN_CHECK_S
from otel_verl.exporters.otlp_json_file import OtlpJsonFileExporter

OUTPUT = "otlp_json_metrics_file"
FILE_PREFIX = "metrics"

# Cumulative, as the OTLP exporters default to: a line holds the totals so far, and the
# last line of a file is the whole run's.
_CUMULATIVE = {kind: AggregationTemporality.CUMULATIVE for kind in
               (Counter, UpDownCounter, Histogram, ObservableCounter, ObservableUpDownCounter, ObservableGauge)}


class OtlpJsonMetricFileExporter(MetricExporter):
    """Appends one whole ``{"resourceMetrics":[...]}`` line per collection."""

    def __init__(self, directory: str, *, max_file_bytes: int = 100 * 1024 * 1024,
                 reopen_check_s: float = REOPEN_CHECK_S) -> None:
        super().__init__(preferred_temporality=_CUMULATIVE)
        # its file follows its path as the spans' files do (deleted, renamed: opened again)
        self.files = OtlpJsonFileExporter(directory, max_file_bytes=max_file_bytes, prefix=FILE_PREFIX, output=OUTPUT,
                                          reopen_check_s=reopen_check_s)

    @property
    def path(self) -> Any:
        return self.files.path

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        try:
            encoded = resource_metrics_dict(metrics_data)
            if not encoded.get("resourceMetrics"):
                return MetricExportResult.SUCCESS
            data = (json.dumps(encoded, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        except Exception as exc:
            health.record_failure(f"{OUTPUT}.encode", exc)
            return MetricExportResult.FAILURE
        if self.files.append_line(data):
            return MetricExportResult.SUCCESS
        health.record_dropped(OUTPUT, 1, "the metrics file could not be written")
        return MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True  # every export is written before it returns

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.files.shutdown()


def resource_metrics_dict(metrics_data: Any) -> Dict[str, Any]:
    """``{"resourceMetrics": [...]}`` of the SDK's ``MetricsData``, as the Collector writes it."""
    from google.protobuf import json_format
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

    out = json_format.MessageToDict(encode_metrics(metrics_data), use_integers_for_enums=True)
    for resource in out.get("resourceMetrics", ()):
        for scope in resource.get("scopeMetrics", ()):
            for metric in scope.get("metrics", ()):
                for kind in metric.values():
                    for point in kind.get("dataPoints", ()) if isinstance(kind, dict) else ():
                        for exemplar in point.get("exemplars", ()):
                            for key in ("traceId", "spanId"):
                                if key in exemplar:
                                    exemplar[key] = base64.b64decode(exemplar[key]).hex()
    return out
