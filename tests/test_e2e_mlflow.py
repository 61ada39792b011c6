"""A real GenAI consumer reads otel_verl's spans: MLflow's tracking server ingests OTLP
(``/v1/traces``) and maps the GenAI conventions to its own span model (span types,
inputs/outputs, token usage). A tool-agent trajectory with content capture on goes
there over OTLP/HTTP, and MLflow's client API must show each span's messages.

Needs the ``mlflow`` command: ``scripts/setup-mlflow.sh`` makes a venv for it (CI does)
and prints it; set ``OTEL_VERL_TEST_MLFLOW`` to it. Skipped without it, outside CI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import otel_binaries as ob

pytestmark = pytest.mark.e2e

PYTHON = sys.executable
UID = "mlflow-u1"

# One sample whose tool-agent trajectory has two LLM calls and a tool call, the
# conversation handed over the way the agent-loop wrappers do it.
PROBE = f"""
import otel_verl
from otel_verl import bootstrap, events, health
from otel_verl.semconv import Outcome

def decode(ids, skip_special_tokens=False):
    return '<tool_call>{{"name": "calculator"}}</tool_call>' if ids[0] == 4 else "It is 5."

assert otel_verl.configure()
messages = [{{"role": "system", "content": "You add numbers."}}, {{"role": "user", "content": "What is 2+3?"}}]
events.samples_created([{UID!r}], step=1, trainer="RayPPOTrainer")
carrier = events.rollout_dispatched([{UID!r}], ["0"], [0], step=1, trainer="RayPPOTrainer")[0]
with events.trajectory({UID!r}, "0", step=1, agent_name="tool_agent", provider="sglang", parent=carrier,
                       decode=decode):
    with events.agent_run("ToolAgentLoop"):
        events.chat_messages(list(messages))
        events.chat_messages(messages)
        with events.llm_call([1, 2, 3], model="qwen", provider="sglang") as turn:
            turn.finish([4, 5], stop_reason="stop")
        messages.append({{"role": "assistant", "content": "", "tool_calls": [{{"type": "function", "id": "call_1",
                         "function": {{"name": "calculator", "arguments": {{"expr": "2+3"}}}}}}]}})
        with events.tool_call("calculator", call_id="call_1", arguments='{{"expr": "2+3"}}') as tool:
            tool.result("5")
        messages.append({{"role": "tool", "content": "5", "tool_call_id": "call_1"}})
        events.chat_messages(messages)
        with events.llm_call([1, 2, 3, 4, 5, 6], model="qwen", provider="sglang") as turn:
            turn.finish([7], stop_reason="stop")
        messages.append({{"role": "assistant", "content": "It is 5."}})
events.samples_finished([{UID!r}], Outcome.TRAINED)
assert bootstrap.flush(150)
print(health.snapshot())
bootstrap.shutdown()
"""

# Runs with the python next to the mlflow command: MLflow's client API, not its storage.
QUERY = """
import json, sys
import mlflow
mlflow.set_tracking_uri(sys.argv[1])
spans = [s for t in mlflow.search_traces(locations=["0"], return_type="list") for s in t.data.spans]
print(json.dumps([{"name": s.name, "type": s.span_type, "inputs": s.inputs, "outputs": s.outputs,
                   "tokens": s.attributes.get("mlflow.chat.tokenUsage")} for s in spans], default=str))
"""


def _mlflow() -> str:
    path = os.environ.get("OTEL_VERL_TEST_MLFLOW") or shutil.which("mlflow")
    if not path or not os.access(path, os.X_OK):
        why = ("MLflow not installed: bash scripts/setup-mlflow.sh (its own venv), then point "
               "OTEL_VERL_TEST_MLFLOW at the mlflow executable it prints")
        if ob.in_ci():  # CI installs it (.ci/run): missing there is a failure, not a skip
            pytest.fail(why)
        pytest.skip(why)
    return path


@pytest.fixture
def mlflow_server(tmp_path):
    mlflow = _mlflow()
    port = ob.free_port()
    server = ob.ManagedProcess(
        [mlflow, "server", "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
         "--default-artifact-root", str(tmp_path / "artifacts"), "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        tmp_path / "mlflow.log").start()
    try:
        ob.wait_for_http(f"http://127.0.0.1:{port}/health", timeout=240, proc=server)  # slow to start on 2 cores
        yield mlflow, f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        try:  # its uvicorn and job workers share its process group
            os.killpg(server.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _spans(mlflow: str, url: str, want: int) -> list:
    python = str(Path(mlflow).resolve().parent / "python")
    deadline = time.monotonic() + 120
    while True:
        out = subprocess.run([python, "-c", QUERY, url], capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        spans = json.loads(out.stdout.strip().splitlines()[-1])
        if len(spans) >= want or time.monotonic() > deadline:
            return spans
        time.sleep(2)


@pytest.mark.timeout(600)
def test_mlflow_shows_the_agent_llm_and_tool_messages(mlflow_server):
    mlflow, url = mlflow_server
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "VERL_TRACE_DIR"}
    env.update({
        "OTEL_VERL_ENABLED": "1", "OTEL_VERL_RUN_ID": "mlflow-run",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{url}/v1/traces",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-mlflow-experiment-id=0",  # the Default experiment
        "OTEL_EXPORTER_OTLP_TIMEOUT": "60",  # its first request is slow
        "OTEL_VERL_SHUTDOWN_TIMEOUT_S": "150",
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_ONLY",
        "PYTHONPATH": str(ob.REPO_ROOT),
    })
    out = subprocess.run([PYTHON, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'dropped': {}" in out.stdout and "'failures': {}" in out.stdout, out.stdout

    found = _spans(mlflow, url, want=6)  # sample, rollout, agent, 2 chats, tool
    spans = {s["name"]: s for s in found}
    chats = [s for s in found if s["name"] == "chat qwen"]
    agent, tool = spans["invoke_agent tool_agent"], spans["execute_tool calculator"]
    assert (agent["type"], tool["type"], [c["type"] for c in chats]) == ("AGENT", "TOOL", ["CHAT_MODEL"] * 2)

    # the agent: its conversation's start in, what it added (tool call, tool result, answer) out
    assert [m["role"] for m in agent["inputs"]] == ["system", "user"]
    assert [m["role"] for m in agent["outputs"]] == ["assistant", "tool", "assistant"]
    assert agent["outputs"][0]["parts"] == [{"type": "tool_call", "id": "call_1", "name": "calculator",
                                             "arguments": {"expr": "2+3"}}]
    assert agent["outputs"][1]["parts"] == [{"type": "tool_call_response", "id": "call_1", "response": "5"}]

    # the LLM calls: roles kept, the second call sees the tool call and its result
    first, second = sorted(chats, key=lambda c: len(c["inputs"]))
    assert [m["role"] for m in first["inputs"]] == ["system", "user"]
    assert [m["role"] for m in second["inputs"]] == ["system", "user", "assistant", "tool"]
    assert second["outputs"] == [{"role": "assistant", "parts": [{"type": "text", "content": "It is 5."}],
                                  "finish_reason": "stop"}]
    assert first["tokens"] == {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}

    # the tool: arguments in, result out
    assert tool["inputs"] == {"expr": "2+3"} and tool["outputs"] == "5"
