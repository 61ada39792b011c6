"""VerlInstrumentor as an opentelemetry-python-contrib instrumentor: it reports to the
provider it is given (or the global one) and builds none; otel_verl's configurator hands
it ``provider_for_role`` instead. Carriers name the configurator only where one runs.
A case runs in a fresh interpreter where it sets the global provider or asks which
modules a process imported."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.verl  # instrument() checks the installed verl

# what a fresh interpreter's case starts with: this module's helpers
SPANS = f"""
    import sys
    sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from test_instrumentor import _provider_with_exporter as provider_with_exporter, _one_sample as one_sample
"""


def _run(code: str, env: dict | None = None) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SPANS) + textwrap.dedent(code)],
                          env={**base, **(env or {})}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture
def instrumentor():
    """``VerlInstrumentor()``, uninstrumented after the test, leaving the events API as it
    found it (the instrumentor is a process-wide singleton, as in contrib)."""
    from otel_verl import events
    from otel_verl.instrumentation import VerlInstrumentor, tracing

    before = events.state()
    yield VerlInstrumentor()
    VerlInstrumentor().uninstrument()
    tracing.stop()
    events.install(before)


def _provider_with_exporter():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _one_sample(uid):
    from otel_verl import events

    events.samples_created([uid], step=1, trainer="RayPPOTrainer")
    events.samples_finished([uid], "trained")


def _names(exporter):
    return [s.name for s in exporter.get_finished_spans()]


def test_spans_go_to_the_provider_given_and_no_provider_is_built(instrumentor):
    from opentelemetry import trace

    from otel_verl import bootstrap
    from otel_verl.instrumentation import tracing

    provider, exporter = _provider_with_exporter()
    global_provider = trace.get_tracer_provider()  # the API's proxy, or one an earlier test here set
    built = bootstrap.provider()  # None, or one an earlier test in this worker built
    instrumentor.instrument(tracer_provider=provider)
    _one_sample("u-1")
    assert tracing.flush()
    assert _names(exporter) == ["verl.sample"]
    assert [s.instrumentation_scope.name for s in exporter.get_finished_spans()] == ["otel_verl"]
    assert trace.get_tracer_provider() is global_provider  # the global one untouched
    assert bootstrap.provider() is built  # nothing configured in its place
    instrumentor.uninstrument()
    _one_sample("u-2")  # the events API keeps its provider: one's own code may still report
    assert len(exporter.get_finished_spans()) == 2


def test_a_second_instrumentation_reports_to_its_own_provider(instrumentor):
    from otel_verl import events

    first, first_spans = _provider_with_exporter()
    second, second_spans = _provider_with_exporter()
    instrumentor.instrument(tracer_provider=first)
    first_state = events.state()
    events.samples_created(["open"], step=1, trainer="RayPPOTrainer")
    _one_sample("u-1")
    instrumentor.uninstrument()
    instrumentor.instrument(tracer_provider=second)
    _one_sample("u-2")
    assert events.open_sample_count() == 0  # the first one's open sample is not the second's
    with first_state.activated():  # the first instrumentation's state lives on beside it
        _one_sample("u-3")
        events.samples_finished(["open"], "trained")
    assert _names(second_spans) == ["verl.sample"]
    assert [s.attributes["verl.uid"] for s in first_spans.get_finished_spans()] == ["u-1", "u-3", "open"]


def test_instrumenting_inside_an_activated_state_installs_the_provider_for_the_process(instrumentor):
    from otel_verl import events
    from otel_verl.instrumentation import tracing

    provider, exporter = _provider_with_exporter()
    activated = tracing.state_for(provider)  # one's own block reporting to that provider
    tracing.stop()
    with activated.activated():
        instrumentor.instrument(tracer_provider=provider)
    assert events.state() is not None and events.state() is not activated
    _one_sample("u-1")  # outside the block: through the process's state
    assert _names(exporter) == ["verl.sample"]


def test_metrics_go_to_the_meter_provider_given(instrumentor):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_verl import events

    def points():
        return {m.name: m for rm in reader.get_metrics_data().resource_metrics
                for sm in rm.scope_metrics for m in sm.metrics}

    provider, _ = _provider_with_exporter()
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    instrumentor.instrument(tracer_provider=provider, meter_provider=meters)
    _one_sample("u-1")
    with events.trajectory("u-1", "0", step=1, agent_name="tool_agent"):
        pass
    names = points()
    assert names["verl.samples"].data.data_points[0].value == 1
    assert names["verl.trajectory.duration"].data.data_points[0].count == 1
    instrumentor.uninstrument()
    with events.trajectory("u-2", "0", step=1, agent_name="tool_agent"):
        pass  # uninstrumented: no more metrics into the user's provider
    assert points()["verl.trajectory.duration"].data.data_points[0].count == 1
    meters.shutdown()  # the user's to shut down, not otel_verl's


def test_without_a_provider_spans_go_to_the_global_one_even_set_later():
    # a fresh interpreter: the global provider can be set once per process
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


def test_provider_for_role_is_asked_once_by_the_first_wrapper_that_fires(instrumentor):
    from otel_verl import events
    from otel_verl.instrumentation import tracing

    provider, exporter = _provider_with_exporter()
    asked = []

    def provider_for_role(role):
        asked.append(role)
        return provider

    tracing.stop()  # no state yet in this process
    instrumentor.instrument(provider_for_role=provider_for_role)
    assert asked == [] and not events.enabled()
    assert instrumentor.tracing.active("agent_loop_worker") and instrumentor.tracing.active("trainer")
    assert asked == ["agent_loop_worker"]
    _one_sample("u-1")
    assert _names(exporter) == ["verl.sample"]


CARRIER = """
    import pickle, pickletools, sys
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
    from otel_verl import carriers
    span = NonRecordingSpan(SpanContext(0x1234, 0x5678, False, TraceFlags(TraceFlags.SAMPLED)))
    data = pickle.dumps(carriers.TraceCarrier.from_span(span, {"uid": "u-1"}))
    names = [arg for op, arg, _ in pickletools.genops(data) if op.name in ("GLOBAL", "STACK_GLOBAL", "SHORT_BINUNICODE")]
    print(data.hex(), [n for n in names if isinstance(n, str) and n.startswith(("otel_verl", "restore"))])
"""

RECEIVE = """
    import pickle, sys
    carrier = pickle.loads(bytes.fromhex(sys.argv[1]))
    from otel_verl import carriers
    from otel_verl.instrumentation import hooks
    assert carriers.take_arrived("u-1") is carrier
    print(carrier.headers["traceparent"], "otel_verl.activation" in sys.modules, bool(hooks.status()))
"""


def _receive(data_hex: str, env: dict) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(RECEIVE), data_hex], env={**base, **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip()


def test_a_carrier_sent_without_the_configurator_unpickles_without_it():
    data, names = _run(CARRIER, {"OTEL_VERL_ENABLED": "1"}).split(" ", 1)
    assert eval(names) == ["otel_verl.carriers", "restore"]  # noqa: S307 - our own repr
    traceparent = "00-00000000000000000000000000001234-0000000000005678-01"
    assert _receive(data, {"OTEL_VERL_ENABLED": "1"}) == f"{traceparent} False False"


def test_a_carrier_sent_by_the_configurator_switches_tracing_on_where_it_arrives():
    run = {"OTEL_VERL_ENABLED": "1", "OTEL_VERL_RUN_ID": "run-1"}
    data, names = _run("import otel_verl.activation\n" + textwrap.dedent(CARRIER), run).split(" ", 1)
    assert eval(names) == ["otel_verl.activation", "restore_carrier"]  # noqa: S307 - our own repr
    traceparent = "00-00000000000000000000000000001234-0000000000005678-01"
    # a process of the same run, with its own settings (its Ray runtime env)
    assert _receive(data, run) == f"{traceparent} True True"
    # the carrier brings no settings: a process without any stays off
    assert _receive(data, {"OTEL_VERL_RUN_ID": "run-1"}) == f"{traceparent} True False"


def test_without_a_provider_spans_go_where_configure_sent_them_beside_a_foreign_global():
    out = _run("""
        from opentelemetry import trace
        import otel_verl
        from otel_verl import bootstrap
        from otel_verl.instrumentation import VerlInstrumentor

        theirs, their_spans = provider_with_exporter()  # e.g. sglang's, set in its server process first
        trace.set_tracer_provider(theirs)
        assert otel_verl.configure(force=True)
        our_spans = InMemorySpanExporter()
        bootstrap.provider().add_span_processor(SimpleSpanProcessor(our_spans))
        VerlInstrumentor().instrument()
        one_sample("u-1")
        assert [s.name for s in our_spans.get_finished_spans()] == ["verl.sample"]
        assert their_spans.get_finished_spans() == ()
        print("ok")
    """)
    assert out.strip() == "ok"
