"""Shared fixtures: an in-process tracing pipeline driven through the real events API."""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable, List

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/ helpers (otel_binaries, ...)

# The test modules of the offline tools (the report, the span store, replay): they read
# files with chDB, not spans through the OpenTelemetry SDK, so the lowest-versions run
# (scripts/test-lowest.sh) leaves them out, by the marker they get here
TOOLS_MODULES = ("test_report", "test_store", "test_tools_hostile_input", "test_dashboard_clickhouse")


def pytest_collection_modifyitems(items: List[Any]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__.startswith(TOOLS_MODULES):
            item.add_marker(pytest.mark.tools)


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest-xdist is the test extra's: without it, one process
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:
    # Under pytest-xdist (scripts/test.sh: --dist loadfile) a module runs on one worker
    # (its module fixtures run once), and so do the modules reading the session's shared
    # demo (a demo run takes 30-60 s).
    SHARED_DEMO = "shared_demo"

    class _ModuleScheduling(LoadScopeScheduling):
        """pytest-xdist's ``loadfile``, with the modules that read the shared demo as one
        unit, and the end-to-end units first: xdist takes the units by their number of
        tests, and an end-to-end module (a demo, Ray, the Go binaries) takes tens of
        seconds for a few, which would end the run on one worker while the other idles."""

        def __init__(self, config: Any, log: Any = None) -> None:
            super().__init__(config, log)
            self._units: dict = {}  # module -> its unit
            self._end_to_end: set = set()  # units with an end-to-end module
            self._ordered = False

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            unit = self._units.get(module)
            if unit is None:
                with open(os.path.join(str(self.config.rootpath), module), encoding="utf-8") as f:
                    text = f.read()
                unit = self._units[module] = SHARED_DEMO if f"{SHARED_DEMO}(" in text else module
                if "mark.e2e" in text:
                    self._end_to_end.add(unit)
            return unit

        def _assign_work_unit(self, node: Any) -> None:
            if not self._ordered:
                self._ordered = True
                units = sorted(self.workqueue.items(), key=lambda unit: unit[0] not in self._end_to_end)
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
        return _ModuleScheduling(config, log) if config.getvalue("dist") == "loadfile" else None


class Pipeline:
    """A TracerProvider wired like bootstrap does (uid ids, record-dropped sampler, the
    events API's spans started by a SlimTracer) with the given processors and an
    in-memory exporter (``in_memory``; it reads every span), installed as the tracing
    state. ``sdk_spans``: the events API starts the SDK's own spans instead, as with a
    provider otel_verl did not build."""

    def __init__(self, processors: Iterable[Any], env: dict | None = None, sampler: Any = None,
                 sdk_spans: bool = False, resource: dict | None = None, in_memory: bool = True) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from otel_verl import settings
        from otel_verl.instrumentation import tracing
        from otel_verl.sampling import IsolatingSpanProcessor, UidIdGenerator, record_dropped_samples
        from otel_verl.slim_span import SlimTracer

        self.exporter = InMemorySpanExporter()
        self.ids = UidIdGenerator()
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": "verl", "verl.role": "trainer", "verl.run_id": "test-run",
                                      **(resource or {})}),
            sampler=record_dropped_samples(sampler),
            id_generator=self.ids,
            active_span_processor=(active := IsolatingSpanProcessor()),  # as bootstrap: subjects routed per processor
        )
        self.sampler = self.provider.sampler
        self.processors: List[Any] = list(processors)
        for p in self.processors:
            self.provider.add_span_processor(p)
        if in_memory:
            self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.settings = settings.load(env or {"OTEL_VERL_ENABLED": "1"})
        assert tracing.use_provider(self.provider, self.settings,
                                    None if sdk_spans else SlimTracer(self.provider, active))

    def spans(self):
        return self.exporter.get_finished_spans()

    def close(self) -> None:
        from otel_verl import events
        from otel_verl.instrumentation import tracing

        events.end_open_samples()
        events.end_open_prompt_tasks()
        self.provider.shutdown()
        tracing.stop()


@pytest.fixture
def make_pipeline():
    """``make_pipeline([processors], env=None, sampler=None, sdk_spans=False, resource=None,
    in_memory=True) -> Pipeline``; closed after the test."""
    made: List[Pipeline] = []

    def factory(processors: Iterable[Any] = (), env: dict | None = None, sampler: Any = None,
                sdk_spans: bool = False, resource: dict | None = None, in_memory: bool = True) -> Pipeline:
        pipeline = Pipeline(processors, env, sampler, sdk_spans, resource, in_memory)
        made.append(pipeline)
        return pipeline

    yield factory
    for pipeline in made:
        pipeline.close()


@pytest.fixture(autouse=True)
def _reset_health():
    from otel_verl import health

    health.reset()
    yield


RAY_TEST_ENV = {"OTEL_VERL_ENABLED": "1", "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster whose workers get otel_verl's setup hook and env vars."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from otel_verl import activation

    # the driver and its workers are one run, as under the launcher: a carrier switches
    # tracing on only in a process of the run it names
    env = {**RAY_TEST_ENV, "OTEL_VERL_RUN_ID": os.environ.setdefault("OTEL_VERL_RUN_ID", "ray-test-run")}
    runtime_env = activation.runtime_env(env=env)
    tests_dir = os.path.dirname(__file__)  # test modules defining actors
    runtime_env["env_vars"]["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
    yield ray
    ray.shutdown()


@pytest.fixture()
def opened_store():
    """``opened_store(trace_dir)``: ``(store, load, inputs)`` of its embedded span store,
    loaded (:func:`otel_verl.tools.store.store.open_store`); chDB holds one store a process,
    so the one opened before is closed."""
    from otel_verl.tools.store.store import open_store

    opened = []

    def open_(path):
        for store in opened:
            store.close()
        opened.clear()
        store, load, inputs = open_store([path], None)
        opened.append(store)
        return store, load, inputs

    yield open_
    for store in opened:
        store.close()


@pytest.fixture(scope="session")
def shared_demo(tmp_path_factory):
    """``shared_demo(steps, prompts, n)``: ``(trace_dir, summary)`` of the traced v0 demo with
    the tool agent, run once a session for each shape (a demo takes 30-60 s) and shared by
    the tests that only read it: they must not change its files (a report's store beside
    them is the report's own)."""
    from demo_process import run_in_child

    runs = {}

    def run(steps: int, prompts: int, n: int):
        shape = (steps, prompts, n)
        if shape not in runs:
            name = f"demo-{steps}x{prompts}xn{n}"
            trace_dir = tmp_path_factory.mktemp(name)
            summary = run_in_child("demo", {"trace_dir": str(trace_dir), "steps": steps, "prompts": prompts, "n": n,
                                            "agent": "tool"}, str(tmp_path_factory.mktemp(f"{name}-run")))
            runs[shape] = (trace_dir, summary)
        return runs[shape]

    return run
