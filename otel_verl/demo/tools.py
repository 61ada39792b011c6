"""A native verl ``BaseTool`` for the demo: ``calculator`` adds two numbers.

verl's ``ToolAgentLoop`` loads it from a tool-config YAML through
``verl.tools.tool_registry.initialize_tools_from_config`` (``class_name`` is this module's
FQN, ``config.type: native``), calls ``create`` / ``execute`` / ``release`` for each hermes
``<tool_call>`` the model emits, and renders the result as a ``<tool_response>`` turn.

The arithmetic is done on parsed numbers only (no ``eval``). When the tool config carries
``call_log: <path>``, every execution appends one JSON line there (pid, instance id,
arguments, result), which lets the harness and its tests check that the tool really ran
inside the AgentLoopWorker processes.

    from otel_verl.demo.tools import write_tool_config
    path = write_tool_config("/tmp/demo", call_log="/tmp/demo/tool_calls.jsonl")
    # actor_rollout_ref.rollout.multi_turn.tool_config_path=<path>
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Dict, Optional, Tuple

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

TOOL_NAME = "calculator"
TOOL_SCHEMA: Dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Add two numbers a and b and return the sum.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "number", "description": "The first number."},
                "b": {"type": "number", "description": "The second number."},
            },
            "required": ["a", "b"],
        },
    },
}


def _number(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("booleans are not numbers")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        number = float(value.strip().replace(",", ""))
    else:
        raise ValueError(f"not a number: {value!r}")
    if not math.isfinite(number):
        raise ValueError(f"not a finite number: {value!r}")
    return number


def add(a: Any, b: Any) -> str:
    """``a + b`` as text; integral results print without a decimal point ("42", not "42.0")."""
    total = _number(a) + _number(b)
    return str(int(total)) if total.is_integer() else repr(total)


class CalculatorTool(BaseTool):
    """Native verl tool ``calculator(a, b) -> a + b``."""

    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema]):
        super().__init__(config, tool_schema or OpenAIFunctionToolSchema.model_validate(TOOL_SCHEMA))
        self._instances: Dict[str, Dict[str, Any]] = {}
        self._call_log: Optional[str] = (config or {}).get("call_log")

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> Tuple[str, ToolResponse]:
        instance_id, response = await super().create(instance_id)
        create_kwargs = kwargs.get("create_kwargs") or {}
        self._instances[instance_id] = {"ground_truth": create_kwargs.get("ground_truth")}
        return instance_id, response

    async def execute(self, instance_id: str, parameters: Dict[str, Any], **kwargs) -> Tuple[ToolResponse, float, dict]:
        try:
            result = add(parameters.get("a"), parameters.get("b"))
            ok = True
        except (TypeError, ValueError) as exc:
            result = f"Error: {exc}"
            ok = False
        self._log(instance_id, parameters, result, ok)
        return ToolResponse(text=result), 0.0, {"ok": ok}

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)

    def _log(self, instance_id: str, parameters: Dict[str, Any], result: str, ok: bool) -> None:
        if not self._call_log:
            return
        line = json.dumps(
            {
                "ts": time.time(),
                "pid": os.getpid(),
                "tool": self.name,
                "instance_id": instance_id,
                "arguments": parameters,
                "result": result,
                "ok": ok,
                "ground_truth": self._instances.get(instance_id, {}).get("ground_truth"),
            }
        )
        # One short O_APPEND write per call: safe across the AgentLoopWorker processes.
        fd = os.open(self._call_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def tool_config(call_log: Optional[str] = None) -> Dict[str, Any]:
    """The tool-config document ``ToolAgentLoop`` reads (``multi_turn.tool_config_path``)."""
    config: Dict[str, Any] = {"type": "native"}
    if call_log:
        config["call_log"] = call_log
    return {"tools": [{"class_name": f"{__name__}.CalculatorTool", "config": config, "tool_schema": TOOL_SCHEMA}]}


def write_tool_config(directory: str, *, call_log: Optional[str] = None) -> str:
    """Write ``tool_config.yaml`` into ``directory`` and return its path."""
    import yaml

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "tool_config.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(tool_config(call_log), f, sort_keys=False)
    return path
