"""Context carriers round-trip through real Ray actor calls; the setup hook and
self-activation switch tracing on in actors; carriers never reach the actor's code."""

import numpy as np
import pytest

pytestmark = [pytest.mark.verl, pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module", autouse=True)
def _driver_configuration():
    """The driver's tracing (:func:`_driver_span` configures it) ends with this module: the
    next module on this worker starts with none."""
    yield
    from otel_verl import bootstrap

    bootstrap.shutdown(timeout_s=10)


def _span_ids(span):
    ctx = span.get_span_context()
    parent = getattr(span, "parent", None)
    return {
        "trace_id": ctx.trace_id,
        "span_id": ctx.span_id,
        "parent_span_id": parent.span_id if parent is not None else None,
    }


def _actors(ray):
    @ray.remote(num_cpus=0)
    class Inner:
        def handle(self, sampling_params: dict):
            from opentelemetry import trace

            from otel_verl import activation, bootstrap, carriers

            carrier = carriers.pop_dict(sampling_params)
            bootstrap.ensure("llm_server")
            tracer = bootstrap.provider().get_tracer("test")
            with tracer.start_as_current_span("inner", context=carriers.context_from(carrier)) as span:
                ids = _span_ids(span)
            return {**ids, "keys": sorted(sampling_params), "hook_calls": activation.setup_hook_calls,
                    "active": activation.is_active(), "tp_is_ours": trace.get_tracer_provider() is bootstrap.provider()}

    @ray.remote(num_cpus=0)
    class Outer:
        def __init__(self):
            self.inner = Inner.remote()

        def generate(self, data):
            import ray as ray_

            from otel_verl import activation, bootstrap, carriers

            row_carriers = carriers.pop_column(data)
            batch_carrier = carriers.pop_meta(data)
            bootstrap.ensure("agent_loop_worker")
            tracer = bootstrap.provider().get_tracer("test")
            with tracer.start_as_current_span("outer", context=carriers.context_from(row_carriers[0])) as span:
                ids = _span_ids(span)
                params = carriers.inject_dict({"temperature": 1.0}, carriers.TraceCarrier.from_span(span))
                nested = ray_.get(self.inner.handle.remote(params))
            return {
                **ids,
                "nested": nested,
                "columns": sorted(data.non_tensor_batch),
                "meta": sorted(data.meta_info),
                "batch_parent": carriers.context_from(batch_carrier) is not None,
                "hook_calls": activation.setup_hook_calls,
            }

        def generate_td(self, td):
            from otel_verl import carriers

            row_carriers = carriers.pop_tensordict(td)
            ctx = carriers.context_from(row_carriers[1])
            from opentelemetry import trace

            return {"parent": trace.get_current_span(ctx).get_span_context().span_id, "keys": sorted(td.keys())}

    return Inner, Outer


def _driver_span(name):
    from otel_verl import bootstrap

    assert bootstrap.configure(force=True) or bootstrap.is_configured()
    return bootstrap.provider().get_tracer("test").start_span(name)


def test_dataproto_column_and_meta_carriers_reach_actor_and_nested_actor(ray_cluster):
    ray = ray_cluster
    import torch
    from verl.protocol import DataProto

    from otel_verl import carriers

    _, Outer = _actors(ray)
    span = _driver_span("driver")
    data = DataProto.from_dict(
        tensors={"x": torch.zeros(2, 3)},
        non_tensors={"uid": np.array(["u0", "u1"], dtype=object)},
        meta_info={"global_steps": 1},
    )
    carrier = carriers.TraceCarrier.from_span(span)
    carriers.inject_column(data, [carrier, carrier])
    carriers.inject_meta(data, carrier)
    out = ray.get(Outer.remote().generate.remote(data))
    span.end()

    driver = span.get_span_context()
    assert out["trace_id"] == driver.trace_id
    assert out["parent_span_id"] == driver.span_id  # actor span is a child of the driver span
    nested = out["nested"]
    assert nested["trace_id"] == driver.trace_id
    assert nested["parent_span_id"] == out["span_id"]  # nested actor span: child of the actor span
    # the carriers are gone before the actor's (and the nested actor's) own code looks
    assert out["columns"] == ["uid"]
    assert out["meta"] == ["global_steps"]
    assert out["batch_parent"] is True
    assert nested["keys"] == ["temperature"]


def test_tensordict_field_carrier(ray_cluster):
    ray = ray_cluster
    import torch
    from tensordict import TensorDict

    from otel_verl import carriers

    _, Outer = _actors(ray)
    span = _driver_span("driver-td")
    td = TensorDict({"x": torch.zeros(2, 1)}, batch_size=[2])
    carriers.inject_tensordict(td, [carriers.TraceCarrier.from_span(span)] * 2)
    out = ray.get(Outer.remote().generate_td.remote(td))
    span.end()
    assert out["parent"] == span.get_span_context().span_id
    assert out["keys"] == ["x"]


def test_setup_hook_runs_once_per_worker_process(ray_cluster):
    ray = ray_cluster
    import torch
    from verl.protocol import DataProto

    from otel_verl import carriers

    _, Outer = _actors(ray)
    span = _driver_span("driver-hook")
    data = DataProto.from_dict(tensors={"x": torch.zeros(1, 1)})
    carriers.inject_column(data, [carriers.TraceCarrier.from_span(span)])
    actor = Outer.remote()
    first = ray.get(actor.generate.remote(data))
    second = ray.get(actor.generate.remote(data))
    span.end()
    assert first["hook_calls"] == second["hook_calls"] == 1
    assert first["nested"]["hook_calls"] == 1
    assert first["nested"]["active"] is True
    assert first["nested"]["tp_is_ours"] is True


def test_carrier_self_activates_a_worker_whose_runtime_env_lost_the_hook(ray_cluster):
    ray = ray_cluster

    from otel_verl import carriers

    # Ray passes the job's setup hook to workers in an env var that child runtime envs
    # inherit; overriding both is what a per-actor runtime env that drops it looks like.
    no_hook = {"worker_process_setup_hook": "os.getpid", "env_vars": {"__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR": "os.getpid"}}

    @ray.remote(num_cpus=0, runtime_env=no_hook)
    class HooklessWorker:
        def state(self):
            from otel_verl import activation

            return activation.is_active()

        def receive(self, row: dict):
            from otel_verl import activation

            return activation.is_active(), sorted(row)

    span = _driver_span("driver-self")
    worker = HooklessWorker.remote()
    assert ray.get(worker.state.remote()) is False
    saved_by_another_run = carriers.TraceCarrier(carriers.headers_of(span), "another-run")
    assert ray.get(worker.receive.remote(carriers.inject_dict({"k": 1}, saved_by_another_run)))[0] is False
    # ours switches it on, from the settings the job's runtime env still gave the worker
    active, keys = ray.get(worker.receive.remote(carriers.inject_dict({"k": 1}, carriers.TraceCarrier.from_span(span))))
    span.end()
    assert active is True
    assert keys == ["__otel_tp", "k"]  # the receiver pops it; here we only check activation
