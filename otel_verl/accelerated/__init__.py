"""otel_verl's faster versions of four parts of the OpenTelemetry SDK, and nothing else.

``otlp_encoding`` and ``otlp_exporter`` replace the SDK's OTLP protobuf/JSON encoding and its
``OTLPSpanExporter``: the SDK's encoder costs 46.4 µs a span (60.8 µs a chat span), this one
4.7 µs from otel_verl's span records (``benchmarks/bench_otlp_encoder.py``); its bytes equal
the SDK's on randomized spans (``tests/test_otlp_encoding.py``), and the exporter reads the
SDK's variables and retries as it does (``tests/test_otlp_exporter.py``). ``batch`` replaces
``BatchSpanProcessor``, whose queue of 2048 spans a 1024 x 16 step's bursts overflow
(``benchmarks/bench_collector_load.py``) and whose drops go uncounted: its queue is bounded in
bytes and every loss is counted (``tests/test_faults.py``, ``tests/test_otlp.py``).
``metric_aggregation`` replaces the ``MeterProvider``'s instruments and aggregation, which cost
7-12 µs a record: 27-29 µs a single-turn trajectory against 59-98 µs (``bench_sdk_costs``,
``docs/PERFORMANCE.md``), with the SDK's points for the same spans (``tests/test_metrics.py``).

``OTEL_VERL_ACCELERATED=false`` puts the SDK's own parts back in their place (``otel_verl.outputs``).
Nothing here imports the configurator, the events API or the instrumentation.
"""
