"""VerlInstrumentor as an opentelemetry-python-contrib instrumentor: it reports to the
provider it is given (or the global one) and builds none; otel_verl's configurator hands
it ``provider_for_role`` instead. Each case runs in a fresh interpreter: instrumenting and providers are process-wide."""

import os
import subprocess
import sys
import textwrap

SPANS = """
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    def provider_with_exporter():
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return provider, exporter

    def one_sample(uid):
        from otel_verl import events
        events.samples_created([uid], step=1, trainer="RayPPOTrainer")
        events.samples_finished([uid], "trained")
"""


def _run(code: str, env: dict | None = None) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SPANS) + textwrap.dedent(code)],
                          env={**base, **(env or {})}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_spans_go_to_the_provider_given_and_no_provider_is_built():
    out = _run("""
        from opentelemetry import trace
        from otel_verl import bootstrap
        from otel_verl.instrumentation import VerlInstrumentor, tracing

        provider, exporter = provider_with_exporter()
        VerlInstrumentor().instrument(tracer_provider=provider)
        one_sample("u-1")
        assert tracing.flush()
        assert [s.name for s in exporter.get_finished_spans()] == ["verl.sample"]
        assert [s.instrumentation_scope.name for s in exporter.get_finished_spans()] == ["otel_verl"]
        assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)  # the global one untouched
        assert not bootstrap.is_configured()
        VerlInstrumentor().uninstrument()
        one_sample("u-2")  # the events API keeps its provider: one's own code may still report
        assert len(exporter.get_finished_spans()) == 2
        print("ok")
    """, {"OTEL_VERL_ENABLED": "1"})
    assert out.strip() == "ok"


def test_without_a_provider_spans_go_to_the_global_one_even_set_later():
    out = _run("""
        from opentelemetry import trace
        from otel_verl.instrumentation import VerlInstrumentor

        VerlInstrumentor().instrument()
        provider, exporter = provider_with_exporter()
        trace.set_tracer_provider(provider)
        one_sample("u-1")
        assert [s.name for s in exporter.get_finished_spans()] == ["verl.sample"]
        print("ok")
    """)
    assert out.strip() == "ok"


def test_provider_for_role_is_asked_once_by_the_first_wrapper_that_fires():
    out = _run("""
        from otel_verl import events
        from otel_verl.instrumentation import VerlInstrumentor, tracing

        provider, exporter = provider_with_exporter()
        asked = []

        def provider_for_role(role):
            asked.append(role)
            return provider

        VerlInstrumentor().instrument(provider_for_role=provider_for_role)
        assert asked == [] and not events.enabled() and not tracing.known_off()
        assert tracing.ensure("agent_loop_worker") and tracing.ensure("trainer")
        assert asked == ["agent_loop_worker"]
        one_sample("u-1")
        assert [s.name for s in exporter.get_finished_spans()] == ["verl.sample"]
        print("ok")
    """)
    assert out.strip() == "ok"

