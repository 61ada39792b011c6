"""The turn's context reaches the engines (vLLM ``trace_headers``, sglang
``external_trace_header``), and the engine-span stand-in writes spans shaped like theirs
under it."""

from __future__ import annotations

import asyncio
import sys
import types

import pytest

pytest.importorskip("verl", reason="the engine stand-ins answer with verl's TokenOutput")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind

from otel_verl import carriers, events, semconv as sc
from otel_verl.demo import engine_spans_standin as standin
from otel_verl.instrumentation import hooks, llm_server
from otel_verl.instrumentation.tracing import Tracing

from demo_checks import descendants

VLLM_MODULE = llm_server.VLLM_ASYNC_LLM


class _AsyncLLM(standin.AsyncLLMStandIn):
    """What ``vllm.v1.engine.async_llm.AsyncLLM`` is in these tests."""


class _OldEngine:
    async def generate(self, prompt, sampling_params, request_id, *, lora_request=None, priority=0):
        yield request_id


@pytest.fixture
def fake_vllm():
    if VLLM_MODULE in sys.modules:
        pytest.skip("a real vLLM is imported in this process")

    def install(engine_class):
        module = types.ModuleType(VLLM_MODULE)
        module.AsyncLLM = engine_class
        sys.modules[VLLM_MODULE] = module
        hooks.install_all([h for h in llm_server.hooks(Tracing()) if h.module == VLLM_MODULE])
        return hooks.status()[f"{VLLM_MODULE}:AsyncLLM.generate"]

    yield install
    hooks.uninstall_all()
    sys.modules.pop(VLLM_MODULE, None)


def _verl_generate(engine, request_id="req-1", **extra):
    """The call verl 0.9.1's vLLMHttpServer.generate makes, iterated to the end."""
    async def run():
        outputs = []
        async for out in engine.generate(prompt={"prompt_token_ids": [1, 2, 3]}, sampling_params={"max_tokens": 2},
                                         request_id=request_id, lora_request=None, priority=0, **extra):
            outputs.append(out)
        return outputs

    return asyncio.run(run())


def _chat_headers():
    with events.trajectory("u1", "0", step=1, agent_name="a"):
        with events.llm_call([1, 2, 3], model="m") as turn:
            return turn.carrier()


def test_vllm_gets_the_turns_context_as_trace_headers(make_pipeline, fake_vllm):
    pipeline = make_pipeline()
    assert fake_vllm(_AsyncLLM)[0] == hooks.INSTALLED
    exporter = InMemorySpanExporter()
    engine = _AsyncLLM("in-memory", exporter=exporter)
    headers = _chat_headers()
    with events.llm_server_call(headers, request_id="req-1", provider="vllm"):
        [output] = _verl_generate(engine)
    _verl_generate(engine, "req-2")  # no server call: nothing to pass
    with events.llm_server_call(headers, request_id="req-3", provider="vllm"):
        _verl_generate(engine, "req-3", trace_headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
    assert output.outputs[0].token_ids == [2, 3]
    assert engine.received_trace_headers[0] == headers
    assert engine.received_trace_headers[1] is None
    assert engine.received_trace_headers[2]["traceparent"].startswith("00-" + "1" * 32)  # the caller's own wins

    engine.engine_tracer.force_flush()
    [chat] = [s for s in pipeline.spans() if s.name == sc.llm_span_name(sc.OP_CHAT, "m")]
    requests = [s for s in exporter.get_finished_spans() if s.attributes["gen_ai.request.id"] == "req-1"]
    assert len(requests) == 1 and len(exporter.get_finished_spans()) == 2  # req-2 had no headers: no span
    request = requests[0]
    assert request.name == "llm_request" and request.kind is SpanKind.SERVER
    assert request.context.trace_id == chat.context.trace_id and request.parent.span_id == chat.context.span_id
    assert request.resource.attributes["vllm.instrumenting_module_name"] == "vllm.llm_engine"
    assert "verl.run_id" not in request.resource.attributes
    assert request.attributes["gen_ai.usage.completion_tokens"] == 2


def test_vllm_with_its_tracing_off_gets_no_trace_headers(make_pipeline, fake_vllm):
    make_pipeline()
    assert fake_vllm(_AsyncLLM)[0] == hooks.INSTALLED
    engine = _AsyncLLM(None)  # no otlp_traces_endpoint
    with events.llm_server_call(_chat_headers(), request_id="r", provider="vllm"):
        _verl_generate(engine)
    assert engine.received_trace_headers == [None] and engine.engine_tracer is None


def test_an_engine_without_trace_headers_is_left_alone(make_pipeline, fake_vllm):
    make_pipeline()
    state, reason = fake_vllm(_OldEngine)
    assert state == hooks.SKIPPED and "missing trace_headers" in reason
    with events.llm_server_call(_chat_headers(), request_id="r", provider="vllm"):
        assert _verl_generate(_OldEngine()) == ["req-1"]


def test_the_sglang_stand_in_is_chosen_by_the_rollout_config():
    on = {"engine_kwargs": {"sglang": {"enable_trace": True, "otlp_traces_endpoint": "127.0.0.1:9"}}}
    assert standin.sglang_trace_settings(on) == "127.0.0.1:9"
    assert standin.sglang_trace_settings({"engine_kwargs": {"sglang": {"enable_trace": True}}}) == "localhost:4317"
    assert standin.sglang_trace_settings({"engine_kwargs": {"sglang": {}}}) is None
    assert standin.sglang_trace_settings({}) is None


@pytest.mark.verl
@pytest.mark.timeout(300)
def test_sglang_spans_nest_under_the_turn_through_verls_server(make_pipeline):
    """verl's SGLangHttpServer.generate over the stand-in engine, with otel_verl's hooks:
    the engine's request root is a child of the chat span, in the uid's trace."""
    from transformers import AutoTokenizer

    from otel_verl.demo import sglang_standin
    from otel_verl.demo.tiny_model import ensure_tiny_model

    pipeline = make_pipeline()
    exporter = InMemorySpanExporter()
    model_dir = ensure_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    manager = standin.TracingTokenizerManagerStandIn(
        tokenizer, tracer=standin.EngineTracerStandIn.sglang(exporter=exporter), model="tiny", latency_s=0.01)
    try:
        server = sglang_standin.make_sglang_server_standin(model_config=model_dir, tokenizer_manager=manager)
        hooks.install_all([h for h in llm_server.hooks(Tracing()) if h.module != VLLM_MODULE])
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}],
                                               tokenize=True, add_generation_prompt=True)["input_ids"]

        async def turn():
            with events.trajectory("u1", "0", step=1, agent_name="a"):
                with events.llm_call(prompt, model="m") as chat:
                    return await server.generate(prompt, {"temperature": 0},
                                                 carriers.tag_request_id("req-1", chat.carrier()))

        output = asyncio.run(turn())
    finally:
        hooks.uninstall_all()
        sglang_standin.uninstall()
    assert output.stop_reason == "stop"
    manager.engine_tracer.force_flush()
    engine_spans = exporter.get_finished_spans()
    [chat] = [s for s in pipeline.spans() if s.name == sc.llm_span_name(sc.OP_CHAT, "m")]
    [root] = [s for s in engine_spans if s.name == " Req req-1"]
    assert root.parent.span_id == chat.context.span_id
    assert {s.context.trace_id for s in engine_spans} == {chat.context.trace_id}
    assert root.attributes["rid"] == "req-1" and root.attributes["module"] == "sglang::request"
    assert root.attributes["gen_ai.request.id"] == "req-1" and root.attributes["gen_ai.usage.completion_tokens"] > 0
    assert root.resource.attributes["service.name"] == "sglang" and "verl.run_id" not in root.resource.attributes
    by_id = {s.context.span_id: s for s in engine_spans}
    threads = [s for s in engine_spans if s.parent.span_id == root.context.span_id]
    assert sorted(s.attributes["thread_label"] for s in threads) == ["Scheduler", "Tokenizer"]
    slices = [s.name for s in sorted(engine_spans, key=lambda s: s.start_time)
              if by_id.get(s.parent.span_id) in threads]
    assert slices == ["tokenize", "api_server_dispatch", "request_process", "prefill_waiting",
                      "prefill_forward", "decode_forward"]
    decode = [s for s in engine_spans if s.name == "decode_forward"][0]
    assert all(by_id[s.parent.span_id] is decode for s in engine_spans if s.name == "decode_loop")


# --------------------------------------------------------------------------- through the real collector


@pytest.mark.e2e
@pytest.mark.verl
@pytest.mark.timeout(300)
def test_engine_spans_reach_the_files_and_jaeger_inside_the_uids_trace(make_pipeline, fake_vllm, tmp_path):
    """The turn's spans (with verl.run_id) and both engines' spans (without) through the
    shipped otelcol-file-jaeger.yaml: the run's spans in <dir>/<run id>/, the engines' in
    <dir>/_no_run_id/, and Jaeger's trace of the uid holds all of them, each engine
    request a child of its chat span. The sglang stand-in is switched on by the same
    rollout-config keys as the real server (engine_kwargs.sglang.enable_trace,
    otlp_traces_endpoint)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from transformers import AutoTokenizer
    from verl.workers.config import RolloutConfig

    import otel_binaries as ob
    from otel_verl.demo import sglang_standin
    from otel_verl.demo.tiny_model import ensure_tiny_model
    from otel_verl.exporters.otlp_json_file import spans_from_files
    from otel_verl.ids import trace_id_for_uid

    trace_dir = tmp_path / "collector"
    jaeger = ob.start_jaeger(tmp_path / "jaeger")
    col = ob.start_otelcol(ob.CONFIG_DIR / "otelcol-file-jaeger.yaml", tmp_path, {
        "OTELCOL_FILE_DIR": str(trace_dir), "OTELCOL_JAEGER_ENDPOINT": jaeger.otlp_grpc_endpoint})
    try:
        verl_export = BatchSpanProcessor(OTLPSpanExporter(endpoint=col.otlp_grpc_endpoint, insecure=True))
        pipeline = make_pipeline([verl_export], sdk_spans=True)  # resource verl.run_id=test-run
        assert fake_vllm(_AsyncLLM)[0] == hooks.INSTALLED
        vllm_engine = _AsyncLLM(otlp_traces_endpoint=col.otlp_grpc_endpoint)
        model_dir = ensure_tiny_model()
        config = RolloutConfig(name="sglang", prompt_length=512, response_length=128, max_model_len=640,
                               tensor_model_parallel_size=1,
                               engine_kwargs={"sglang": {"enable_trace": True,
                                                         "otlp_traces_endpoint": col.otlp_grpc_endpoint}})
        server = sglang_standin.make_sglang_server_standin(config, model_config=model_dir, latency_s=0.01)
        assert isinstance(server.tokenizer_manager, standin.TracingTokenizerManagerStandIn)
        hooks.install_all([h for h in llm_server.hooks(Tracing()) if h.module != VLLM_MODULE])
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}],
                                               tokenize=True, add_generation_prompt=True)["input_ids"]

        async def trajectory():
            with events.trajectory("uid-e2e", "0", step=1, agent_name="a"):
                with events.llm_call(prompt, model="m") as chat:
                    await server.generate(prompt, {"temperature": 0}, carriers.tag_request_id("req-s", chat.carrier()))
                with events.llm_call(prompt, model="m") as chat:
                    with events.llm_server_call(chat.carrier(), request_id="req-v", provider="vllm"):
                        async for _ in vllm_engine.generate(prompt={"prompt_token_ids": prompt},
                                                            sampling_params={"max_tokens": 3}, request_id="req-v"):
                            pass

        asyncio.run(trajectory())
        assert server.tokenizer_manager.engine_tracer.force_flush() and vllm_engine.engine_tracer.force_flush()
        assert pipeline.provider.force_flush()
        hooks.uninstall_all()
        sglang_standin.uninstall()
        assert col.process.stop() == 0, col.process.log_tail()  # flushes, closes the files
        run_files = spans_from_files([str(p) for p in (trace_dir / "test-run" / "otlp").glob("*.jsonl")])
        engine_files = spans_from_files([str(p) for p in (trace_dir / "_no_run_id" / "otlp").glob("*.jsonl")])
        trace_id = format(trace_id_for_uid("uid-e2e"), "032x")
        in_jaeger = ob.flat_spans(jaeger.wait_for_trace(trace_id, min_spans=len(run_files + engine_files), raw=True))
    finally:
        hooks.uninstall_all()
        sglang_standin.uninstall()
        col.process.stop()
        jaeger.process.stop()

    assert sorted(p.name for p in trace_dir.iterdir()) == ["_no_run_id", "test-run"]
    assert {s["resource"].get("verl.run_id") for s in run_files} == {"test-run"}
    # vLLM names no service: OTEL_SERVICE_NAME, else the SDK's unknown_service:<executable>
    assert {s["resource"]["service.name"].split(":")[0] for s in engine_files} == {"sglang", "unknown_service"}
    assert not any("verl.run_id" in s["resource"] for s in engine_files)

    assert len(in_jaeger) == len(run_files + engine_files)
    for spans in (run_files + engine_files, in_jaeger):
        assert {s["traceId"] for s in spans} == {trace_id}
        chats = [s for s in spans if s["name"] == "chat m"]
        assert len(chats) == 2
        sglang_root = [s for s in spans if s["name"] == " Req req-s"]
        vllm_request = [s for s in spans if s["name"] == "llm_request"]
        assert len(sglang_root) == 1 and len(vllm_request) == 1
        assert sglang_root[0]["parentSpanId"] in {c["spanId"] for c in chats}
        assert vllm_request[0]["parentSpanId"] in {c["spanId"] for c in chats}
        assert sglang_root[0]["parentSpanId"] != vllm_request[0]["parentSpanId"]
        sglang_tree = descendants(spans, sglang_root[0])
        assert {s["name"] for s in sglang_tree} >= {"tokenize", "prefill_forward", "decode_forward", "decode_loop"}
        assert {s["resource"]["service.name"] for s in sglang_tree} == {"sglang"}


@pytest.mark.e2e
@pytest.mark.verl
@pytest.mark.timeout(900)
def test_a_demo_run_with_sglang_tracing_on_puts_engine_spans_in_each_uids_trace(tmp_path):
    """The traced demo with verl's SGLangHttpServer and the README's overrides, exporting
    to the shipped otelcol-file-jaeger.yaml: every turn's engine request is a child of its
    chat span, in the uid's trace, both in the run's own collector files (the launcher
    names the run in the engines' resource) and in Jaeger's trace of each uid."""
    import otel_binaries as ob
    from demo_process import run_in_child
    from otel_verl.exporters.otlp_json_file import spans_from_files
    from otel_verl.ids import trace_id_for_uid

    trace_dir = tmp_path / "collector"
    jaeger = ob.start_jaeger(tmp_path / "jaeger")
    col = ob.start_otelcol(ob.CONFIG_DIR / "otelcol-file-jaeger.yaml", tmp_path, {
        "OTELCOL_FILE_DIR": str(trace_dir), "OTELCOL_JAEGER_ENDPOINT": jaeger.otlp_grpc_endpoint})
    try:
        try:
            endpoint = f"127.0.0.1:{col.grpc_port}"  # sglang's form: host:port
            summary = run_in_child("demo", {
                "trace_dir": str(tmp_path / "trace"), "steps": 1, "prompts": 2, "n": 2, "agent": "single",
                "server": "sglang", "validate": False,
                "overrides": ["+actor_rollout_ref.rollout.engine_kwargs.sglang.enable_trace=true",
                              f"+actor_rollout_ref.rollout.engine_kwargs.sglang.otlp_traces_endpoint={endpoint}"],
            }, str(tmp_path / "work"), env={"OTEL_EXPORTER_OTLP_ENDPOINT": col.otlp_grpc_endpoint})
        finally:
            assert col.process.stop() == 0, col.process.log_tail()
        assert sorted(p.name for p in trace_dir.iterdir()) == [summary["run_id"]]  # no _no_run_id group
        spans = spans_from_files([str(p) for p in (trace_dir / summary["run_id"] / "otlp").glob("*.jsonl")])
        uids = {s["attributes"]["verl.uid"] for s in spans if s["name"].startswith("chat ")}
        assert len(uids) == 2
        in_files = {uid: [s for s in spans if s["traceId"] == format(trace_id_for_uid(uid), "032x")] for uid in uids}
        in_jaeger = {uid: ob.flat_spans(jaeger.wait_for_trace(format(trace_id_for_uid(uid), "032x"),
                                                              min_spans=len(in_files[uid]), raw=True))
                     for uid in uids}
    finally:
        jaeger.process.stop()

    engine_spans = [s for s in spans if s["resource"]["service.name"] == "sglang"]
    assert {s["resource"]["verl.run_id"] for s in engine_spans} == {summary["run_id"]}
    _assert_engine_requests_under_chats(spans, per_uid=2)
    for uid, trace in in_jaeger.items():
        assert {s["spanId"] for s in trace} == {s["spanId"] for s in in_files[uid]}, uid  # the whole trace
        _assert_engine_requests_under_chats(trace, per_uid=2)


def _assert_engine_requests_under_chats(spans: list, per_uid: int) -> None:
    """One sglang request root per chat span (single-turn agent), each the chat's child in
    the chat's uid's trace, with sglang's stages below it."""
    from otel_verl.ids import trace_id_for_uid

    chats = {s["spanId"]: s for s in spans if s["name"].startswith("chat ")}
    roots = [s for s in spans if s["name"].startswith(" Req ")]
    assert len(chats) == per_uid * len({c["attributes"]["verl.uid"] for c in chats.values()})
    assert len(roots) == len(chats) and {r["parentSpanId"] for r in roots} == set(chats)
    for root in roots:
        uid = chats[root["parentSpanId"]]["attributes"]["verl.uid"]
        assert root["traceId"] == format(trace_id_for_uid(uid), "032x")
        tree = descendants(spans, root)
        assert {s["name"] for s in tree} >= {"tokenize", "prefill_forward", "decode_forward"}
        assert {s["resource"]["service.name"] for s in tree} == {"sglang"}
