"""Pieces of the verl wrappers checked against verl's own behaviour (no Ray needed)."""

import numpy as np
import pytest

from otel_verl import carriers
from otel_verl.instrumentation import hooks
from otel_verl.instrumentation.trainer_v0 import _traj_uids, _worker_indices


def _proto(n, with_tensors=True, **columns):
    import torch
    from verl.protocol import DataProto

    tensors = {"x": torch.arange(n).unsqueeze(1)} if with_tensors else None
    non_tensors = {k: np.array(v, dtype=object) for k, v in columns.items()} or {"i": np.arange(n)}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


@pytest.mark.verl
@pytest.mark.parametrize("n, workers", [(16, 4), (10, 3), (7, 2), (3, 5), (12, 1)])
@pytest.mark.parametrize("with_tensors", [True, False])
def test_worker_indices_match_dataproto_chunk(n, workers, with_tensors):
    data = _proto(n, with_tensors, i=list(range(n)))
    data.meta_info = {}
    try:
        chunks = data.chunk(workers)
    except AssertionError:  # verl refuses unequal chunks without padding: nothing to predict
        pytest.skip("verl requires equal chunks here")
    expected = [k for k, chunk in enumerate(chunks) for _ in range(len(chunk))]
    assert _worker_indices(data, workers) == expected


@pytest.mark.verl
def test_traj_uids_follow_interleaved_repeat_and_label_remax_baseline():
    prompts = _proto(2, uid=["a", "b"])
    repeated = prompts.repeat(repeat_times=3, interleave=True)
    uids = list(repeated.non_tensor_batch["uid"])
    assert _traj_uids(repeated, uids) == ["0", "1", "2", "0", "1", "2"]
    repeated.non_tensor_batch["__do_sample__"] = np.array([True] * 4 + [False] * 2)
    assert _traj_uids(repeated, uids) == ["0", "1", "2", "0", "baseline", "baseline"]


def test_request_id_tag_round_trip():
    headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    tagged = carriers.tag_request_id("abc123", headers)
    assert tagged != "abc123"
    assert carriers.untag_request_id(tagged) == ("abc123", headers)
    assert carriers.untag_request_id("plain") == ("plain", None)
    assert carriers.tag_request_id(tagged, headers) == tagged  # never tagged twice


class _ToolLoop:
    async def _call_tool(self, tool_call, tools_kwargs, agent_data):
        return tool_call

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        return request_id


@pytest.mark.parametrize("how", ["bound method", "bound method, no instance", "unbound, self in args",
                                 "plain function wrapper on an instance"])
def test_arguments_are_read_as_python_binds_them(how):
    """``_args.arguments`` against ``inspect.signature(...).bind`` for every way verl
    passes arguments and wrapt hands them over; ``with_argument`` replaces one in place."""
    import inspect

    from otel_verl.instrumentation._args import arguments, with_argument

    loop = _ToolLoop()
    calls = [((("tc", {"k": 1}, "data"), {}), "_call_tool"), ((("tc",), {"tools_kwargs": {}, "agent_data": "data"}), "_call_tool"),
             ((("rid",), {"prompt_ids": [1, 2], "sampling_params": {"t": 1}}), "generate"),
             (((), {"request_id": "rid", "prompt_ids": [3], "sampling_params": {}}), "generate")]
    for (args, kwargs), name in calls:
        expected = inspect.signature(getattr(loop, name)).bind(*args, **kwargs).arguments
        expected.update(expected.pop("kwargs", {}))
        if how == "bound method":
            wrapped, instance = getattr(loop, name), loop
        elif how == "bound method, no instance":
            wrapped, instance = getattr(loop, name), None
        elif how == "unbound, self in args":
            wrapped, instance, args = getattr(_ToolLoop, name), None, (loop,) + args
        else:
            wrapped, instance = getattr(_ToolLoop, name), loop
        found_self, found = arguments(wrapped, instance, args, kwargs)
        assert found_self is loop and found == expected, (how, name)
        first = next(iter(expected))
        new_args, new_kwargs = with_argument(wrapped, instance, args, kwargs, first, "new")
        assert arguments(wrapped, instance, new_args, new_kwargs)[1] == {**expected, first: "new"}, (how, name)
        assert len(new_args) == len(args), (how, name)


class _Target:
    def method(self, batch, step=0):
        return batch

    async def coro(self, prompts):
        return prompts


def test_missing_or_changed_target_is_skipped_with_one_warning(caplog):
    import sys
    import types

    module = types.ModuleType("fake_verl_mod")
    module.Target = _Target
    sys.modules["fake_verl_mod"] = module
    try:
        calls = []

        def wrapper(wrapped, instance, args, kwargs):
            calls.append(args)
            return wrapped(*args, **kwargs)

        hooks.install_all([
            hooks.Hook("fake_verl_mod", "Target.method", wrapper, ("batch",)),
            hooks.Hook("fake_verl_mod", "Target.renamed", wrapper, ()),
            hooks.Hook("fake_verl_mod", "Target.coro", wrapper, ("batch",)),
            hooks.Hook("fake_verl_mod", "Missing.method", wrapper, ()),
        ])
        status = hooks.status()
        assert status["fake_verl_mod:Target.method"][0] == hooks.INSTALLED
        assert status["fake_verl_mod:Target.renamed"] == (hooks.SKIPPED, "Target.renamed not found")
        assert status["fake_verl_mod:Target.coro"] == (hooks.SKIPPED, "Target.coro: parameters changed (missing batch)")
        assert status["fake_verl_mod:Missing.method"] == (hooks.SKIPPED, "Missing not found")
        assert _Target().method(5) == 5 and calls == [(5,)]
        assert caplog.text.count("skipped") == 3
    finally:
        hooks.uninstall_all()
        del sys.modules["fake_verl_mod"]
    assert not hasattr(_Target.method, "__wrapped__")


class _Later:
    def method(self, x):
        return x


def test_a_hook_waiting_for_its_module_is_forgotten_by_uninstall():
    """Uninstalled before its module is imported, a hook is not installed by the import;
    instrumented twice before it, it is installed once."""
    import sys
    import types

    import wrapt

    calls = []

    def wrapper(wrapped, instance, args, kwargs):
        calls.append(args)
        return wrapped(*args, **kwargs)

    hook = hooks.Hook("fake_later_mod", "_Later.method", wrapper)
    for times in (1, 2):
        hooks.install_all([hook])
        assert hooks.status()[hook.name][0] == hooks.PENDING
        hooks.uninstall_all()
        if times == 2:  # and a new install of it before the import: one wrap
            hooks.install_all([hook])
        module = types.ModuleType("fake_later_mod")
        module._Later = _Later
        sys.modules["fake_later_mod"] = module
        try:
            wrapt.notify_module_loaded(module)  # what wrapt's import finder does once a module is imported
            assert _Later().method(1) == 1
        finally:
            hooks.uninstall_all()
            del sys.modules["fake_later_mod"]
        assert calls == ([] if times == 1 else [(1,)])
        calls.clear()
    assert not hasattr(_Later.method, "__wrapped__")


def test_instrumented_again_before_the_import_the_new_wrapper_is_installed():
    """Each instrumentation's wrappers close over its own state: after uninstrument and a
    new instrument, the module's import installs the new wrapper, never the earlier one
    (whose post-import hook wrapt keeps)."""
    import sys
    import types

    import wrapt

    calls = []

    def wrapper_of(name):
        def wrapper(wrapped, instance, args, kwargs):
            calls.append(name)
            return wrapped(*args, **kwargs)

        return wrapper

    hooks.install_all([hooks.Hook("fake_again_mod", "_Later.method", wrapper_of("first"))])
    hooks.uninstall_all()
    hooks.install_all([hooks.Hook("fake_again_mod", "_Later.method", wrapper_of("second"))])
    module = types.ModuleType("fake_again_mod")
    module._Later = _Later
    sys.modules["fake_again_mod"] = module
    try:
        wrapt.notify_module_loaded(module)
        assert _Later().method(1) == 1
        assert calls == ["second"]
    finally:
        hooks.uninstall_all()
        del sys.modules["fake_again_mod"]
    assert not hasattr(_Later.method, "__wrapped__")


class _Worker:
    async def _run_agent_loop(self, sampling_params, trajectory, *, agent_name, **kwargs):
        return sorted(kwargs)


def test_with_tracing_off_calls_pass_through_and_the_provider_is_asked_once():
    """``provider_for_role`` said off: wrapped calls run verl's code with verl's own
    arguments (the trainer's carrier column still never reaches it) and nothing asks again."""
    import asyncio
    import sys
    import types

    from otel_verl import events
    from otel_verl.instrumentation import agent_loop
    from otel_verl.instrumentation.tracing import Tracing

    module = types.ModuleType("fake_off_mod")
    module.Worker = _Worker
    sys.modules["fake_off_mod"] = module
    asked = []
    tracing = Tracing(lambda role: asked.append(role))  # None: tracing off here
    try:
        hooks.install_all([hooks.Hook("fake_off_mod", "Worker._run_agent_loop", agent_loop._run_agent_loop(tracing))])
        worker = _Worker()
        for _ in range(2):
            got = asyncio.run(worker._run_agent_loop({}, {"step": 1}, agent_name="a", uid="u", **{carriers.COLUMN: "c"}))
            assert got == ["uid"]
        assert asked == ["agent_loop_worker"] and not events.enabled()
    finally:
        hooks.uninstall_all()
        del sys.modules["fake_off_mod"]


class _Client:
    async def generate(self, request_id, *, prompt_ids, sampling_params):
        return [request_id, len(prompt_ids)]


def test_with_tracing_off_the_llm_client_returns_verls_own_coroutine():
    """No layer of ours around an LLM call while the events API reports nowhere: the
    wrapped generate hands back verl's coroutine itself."""
    import asyncio
    import sys
    import types

    from otel_verl import events
    from otel_verl.instrumentation import llm_client
    from otel_verl.instrumentation.tracing import Tracing

    module = types.ModuleType("fake_client_mod")
    module.Client = _Client
    sys.modules["fake_client_mod"] = module
    generate = next(h for h in llm_client.hooks(Tracing()) if h.target == "LLMServerClient.generate")
    try:
        hooks.install_all([hooks.Hook("fake_client_mod", "Client.generate", generate.wrapper)])
        assert not events.enabled()
        call = _Client().generate("r1", prompt_ids=[1, 2], sampling_params={})
        assert call.cr_code is _Client.generate.__wrapped__.__code__
        assert asyncio.run(call) == ["r1", 2]
    finally:
        hooks.uninstall_all()
        del sys.modules["fake_client_mod"]


class _Actor:
    def method(self, x):
        return x


@pytest.mark.verl
def test_wrapped_methods_survive_rays_copy_of_an_actor_class():
    """``ray.remote(cls)`` makes a subclass holding the methods it finds on ``cls`` and
    cloudpickles it by value: the copy still calls our wrapper, not the bare method."""
    import sys
    import types

    import ray.cloudpickle as cloudpickle
    from ray.actor import _modify_class
    from ray.util.tracing.tracing_helper import _inject_tracing_into_class

    module = types.ModuleType("fake_actor_mod")
    module._Actor = _Actor
    _Actor.__module__ = "fake_actor_mod"
    sys.modules["fake_actor_mod"] = module
    calls = []

    def wrapper(wrapped, instance, args, kwargs):
        calls.append(instance)
        return wrapped(*args, **kwargs)

    try:
        hooks.install_all([hooks.Hook("fake_actor_mod", "_Actor.method", wrapper, ("x",))])
        copy = _modify_class(_Actor)
        _inject_tracing_into_class(copy)
        actor = cloudpickle.loads(cloudpickle.dumps(copy))()
        assert actor.method(5) == 5 and calls == [actor]
    finally:
        hooks.uninstall_all()
        del sys.modules["fake_actor_mod"]
        _Actor.__module__ = __name__


def test_the_end_of_fit_never_raises_into_verl():
    from otel_verl import health
    from otel_verl.instrumentation import _trainer
    from otel_verl.instrumentation.tracing import Tracing

    def no_actors(trainer):
        raise AttributeError("a manager verl renamed")

    wrapper = _trainer.fit_wrapper(_trainer.TracedTrainer(Tracing()), "T", no_actors)
    assert wrapper(lambda: 42, object(), (), {}) == 42
    assert "fit_end" in str(health.snapshot()["failures"])


def test_only_numeric_server_meta_becomes_server_span_attributes(make_pipeline):
    from otel_verl import events

    pipeline = make_pipeline()
    meta = {"e2e_latency": 0.5, "queue_time": np.float64(0.25), "cached_tokens": 3, "aborted": True,
            "finish_reason": "stop", "weights": np.int64(7)}
    with events.trajectory("u1", "0", step=1, agent_name="a"):
        with events.llm_call([1, 2], model="m") as turn:
            with events.llm_server_call(turn.carrier(), request_id="r", provider="sglang") as call:
                call.record_meta(meta)
            turn.finish([3], stop_reason="stop", server_meta=meta)
    by_name = {s.name: dict(s.attributes) for s in pipeline.spans()}
    kept = {name: {k[len("verl.llm.server."):]: v for k, v in attrs.items() if k.startswith("verl.llm.server.")}
            for name, attrs in by_name.items()}
    assert kept["verl.llm_server.generate"] == {"e2e_latency": 0.5, "queue_time": 0.25, "cached_tokens": 3}  # no bool, str or np.int64
    assert kept["chat m"] == {}  # on the server's span only (the turn keeps them for the JSONL)


@pytest.mark.verl
def test_tokenizer_functions_reach_another_process_without_transformers(tmp_path):
    """The export process decodes and encodes with the ``TextCodec`` it is sent: the
    tokenizer's own results, loaded without importing transformers."""
    import pickle
    import subprocess
    import sys

    import torch
    from transformers import AutoTokenizer

    from otel_verl.demo.tiny_model import ensure_tiny_model
    from otel_verl.text_codec import text_codec

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model(str(tmp_path / "model")))
    text = "hello <tool_call>world</tool_call> 12 + 30 = 42 <|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    codec = text_codec(tokenizer)
    assert codec is text_codec(tokenizer)  # sent once per tokenizer
    decode, encode = codec
    for given in (ids, np.array(ids), torch.tensor(ids)):
        assert decode(given, skip_special_tokens=True) == tokenizer.decode(given, skip_special_tokens=True)
    assert encode(text, add_special_tokens=False) == ids
    (tmp_path / "codec").write_bytes(pickle.dumps(codec))
    code = ("import pickle, sys; decode, encode = pickle.load(open(sys.argv[1], 'rb'));"
            "print(repr(decode(eval(sys.argv[2]))), encode(sys.argv[3], add_special_tokens=False),"
            " 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "codec"), repr(ids), text],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == f"{tokenizer.decode(ids)!r} {ids} False"
