"""Run verl's real ``SGLangHttpServer.generate`` on CPU, with sglang itself replaced.

verl 0.9.1's ``verl/workers/rollout/sglang_rollout/async_sglang_server.py`` starts with
``import sglang`` and imports a dozen names from ``sglang.srt.*``; sglang is not installed on
a CPU machine (and could not serve there). Two stand-ins make the module importable and its
``generate`` method runnable, so wrappers around it can be tested against verl's own code:

* :func:`install` puts :class:`SGLangStandInFinder` on ``sys.meta_path`` (only when no real
  sglang is importable). Every ``sglang`` / ``sglang.*`` import then yields a stand-in
  module: request types the server builds (``GenerateReqInput``,
  ``ReleaseMemoryOccupationReqInput``, ...) are keyword-attribute records, ``ServerStatus``
  is an enum, and any other name is an inert placeholder class made on first access (enough
  for imports, base classes and module-level assignments; calling into it does nothing
  useful). :func:`uninstall` removes the finder and the stand-in modules again.
* The engine front-end is :class:`otel_verl.demo.llm_server_standin.TokenizerManagerStandIn`,
  whose ``generate_request(obj, request=None)`` is an async generator yielding
  ``{"output_ids": [...], "meta_info": {"finish_reason": {"type": "stop"}, "e2e_latency",
  "completion_tokens", ...}}`` like sglang's ``TokenizerManager.generate_request``, with
  sglang 0.5.12's timing keys (``queue_time``, ``request_received_ts``,
  ``prefill_finished_time``, ...) only when the rollout config switches sglang's
  ``enable_metrics`` on as verl's ``launch_server`` reads it
  (:func:`otel_verl.demo.llm_server_standin.sglang_enable_metrics`).

:func:`make_sglang_server_standin` returns a real ``SGLangHttpServer`` instance made with
``object.__new__`` (its ``__init__`` and ``launch_server`` start sglang subprocesses and an
HTTP server, so they are bypassed) and given the attributes ``generate`` and the
sleep/weights methods read. ``await server.generate(prompt_ids, sampling_params,
request_id)`` then runs verl's method body unchanged: max-token clamping,
``GenerateReqInput``, ``RLInsightLogger.trace_state``, ``tokenizer_manager.generate_request``,
log-prob extraction and the ``TokenOutput`` it builds (which, as in verl, drops the engine
timing in ``meta_info``).

    from otel_verl.demo.sglang_standin import make_sglang_server_standin
    server = make_sglang_server_standin()                 # tiny stand-in model, hybrid mode
    out = await server.generate([1, 2, 3], {"temperature": 0}, "req-1")

For the harness (``run_v0(server="sglang")``), :func:`sglang_server_standin_class` returns
``SGLangHttpServerStandIn``, a subclass of the real ``SGLangHttpServer`` that replaces only
``__init__`` (the same attribute set-up), lets ``abort_all_requests`` take the
``reject_request`` keyword verl's ``RolloutReplica`` passes (the v1 async trainers' pause) and
adds the memory-occupation calls the worker-group stand-in makes during a weight sync;
``generate``, ``sleep``, ``set_global_steps``, the pause itself and the rest are verl's. The class is built by a function because defining it needs the stand-in
installed first; it is also reachable as ``otel_verl.demo.sglang_standin.SGLangHttpServerStandIn``
(module ``__getattr__``), so Ray pickles it by reference and a Ray worker rebuilds it on import.

Installing the stand-in is process-wide: after :func:`install` (done by the functions above),
``import sglang`` succeeds in that process until :func:`uninstall`.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any, Dict, Optional

SGLANG_STANDIN_VERSION = "0.5.6+otelverl.standin"
_DEPENDENT_PREFIX = "verl.workers.rollout.sglang_rollout"


class _Record:
    """Keyword-attribute record standing for sglang's request dataclasses."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._args = args
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None  # unset optional fields read as None, like dataclass defaults

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class _Placeholder:
    """Inert stand-in for any other sglang object (class, function, constant)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return None


class ServerStatus(enum.Enum):
    Up = "Up"
    Starting = "Starting"
    UnHealthy = "UnHealthy"
    Crashed = "Crashed"


_RECORD_NAMES = {
    "GenerateReqInput",
    "ReleaseMemoryOccupationReqInput",
    "ResumeMemoryOccupationReqInput",
    "PauseGenerationReqInput",
    "ContinueGenerationReqInput",
    "UpdateWeightsFromTensorReqInput",
    "LoadLoRAAdapterFromTensorsReqInput",
    "ServerArgs",
}


class _StandInModule(types.ModuleType):
    """A stand-in ``sglang*`` module: known names get their stand-ins, others a placeholder class."""

    __standin__ = True

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name in _RECORD_NAMES:
            value: Any = type(name, (_Record,), {"__module__": self.__name__})
        elif name == "ServerStatus":
            value = ServerStatus
        elif (self.__name__, name) == ("sglang.srt.managers.tokenizer_manager", "TokenizerManager"):
            # The engine front-end lives where sglang keeps it, so code that reaches sglang's
            # TokenizerManager by name (otel_verl's engine-timing hook) finds the stand-in.
            from otel_verl.demo.llm_server_standin import TokenizerManagerStandIn

            value = TokenizerManagerStandIn
        else:
            value = type(name, (_Placeholder,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class SGLangStandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Meta-path finder/loader that serves stand-in modules for ``sglang`` and ``sglang.*``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname == "sglang" or fullname.startswith("sglang."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []  # a package, so submodules resolve through this finder too
        if spec.name == "sglang":
            module.__version__ = SGLANG_STANDIN_VERSION
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        parent, _, child = module.__name__.rpartition(".")
        if parent and parent in sys.modules:
            setattr(sys.modules[parent], child, module)


_FINDER: Optional[SGLangStandInFinder] = None


def real_sglang_available() -> bool:
    if is_installed():
        return False
    return importlib.util.find_spec("sglang") is not None


def is_installed() -> bool:
    return _FINDER is not None and _FINDER in sys.meta_path


def install() -> bool:
    """Serve stand-in ``sglang*`` modules from now on; False (and nothing done) if real sglang exists."""
    global _FINDER
    if is_installed():
        return True
    if "sglang" in sys.modules and not getattr(sys.modules["sglang"], "__standin__", False):
        return False
    if importlib.util.find_spec("sglang") is not None:
        return False
    _FINDER = SGLangStandInFinder()
    sys.meta_path.append(_FINDER)
    return True


def uninstall(purge_dependents: bool = True) -> None:
    """Remove the finder and the stand-in modules (and, by default, verl's sglang_rollout modules)."""
    global _FINDER
    if _FINDER is not None and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    _FINDER = None
    for name in list(sys.modules):
        module = sys.modules[name]
        if (name == "sglang" or name.startswith("sglang.")) and getattr(module, "__standin__", False):
            del sys.modules[name]
        elif purge_dependents and name.startswith(_DEPENDENT_PREFIX):
            del sys.modules[name]


def import_sglang_server_module():
    """Import verl's ``async_sglang_server`` module with the stand-in installed."""
    if not install() and not real_sglang_available():
        raise RuntimeError("cannot install the sglang stand-in")
    from verl.workers.rollout.sglang_rollout import async_sglang_server

    return async_sglang_server


def _default_rollout_config(prompt_length: int = 512, response_length: int = 128) -> Any:
    from verl.workers.config import RolloutConfig

    return RolloutConfig(
        name="sglang",
        prompt_length=prompt_length,
        response_length=response_length,
        max_model_len=prompt_length + response_length,
        tensor_model_parallel_size=1,
    )


def _as_rollout_config(config: Any) -> Any:
    from omegaconf import DictConfig

    from verl.utils.config import omega_conf_to_dataclass

    if config is None:
        return _default_rollout_config()
    if isinstance(config, (dict, DictConfig)):
        return omega_conf_to_dataclass(config)
    return config


def _as_model_config(model_config: Any) -> Any:
    from omegaconf import DictConfig

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig

    if model_config is None:
        from otel_verl.demo.tiny_model import ensure_tiny_model

        return HFModelConfig(path=ensure_tiny_model())
    if isinstance(model_config, str):
        return HFModelConfig(path=model_config)
    if isinstance(model_config, (dict, DictConfig)):
        return omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
    return model_config


def init_server_attributes(
    server: Any,
    *,
    config: Any = None,
    model_config: Any = None,
    tokenizer_manager: Any = None,
    rollout_mode: Any = None,
    replica_rank: int = 0,
    node_rank: int = 0,
    global_steps: Optional[int] = None,
    server_port: Optional[int] = None,
    latency_s: float = 0.05,
    per_token_latency_s: float = 0.0005,
    preempt_every: int = 0,
) -> Any:
    """Set, on an ``SGLangHttpServer`` made without ``__init__``, what its methods read (verl 0.9.1)."""
    from verl.workers.rollout.replica import RolloutMode

    from otel_verl.demo.engine_spans_standin import tokenizer_manager_for
    from otel_verl.demo.llm_server_standin import sglang_enable_metrics

    server.config = _as_rollout_config(config)
    server.model_config = _as_model_config(model_config)
    if server.config.max_model_len is None:
        server.config.max_model_len = server.config.prompt_length + server.config.response_length
    server.rollout_mode = rollout_mode if rollout_mode is not None else RolloutMode.HYBRID
    server.workers = []
    server.replica_rank = replica_rank
    server.node_rank = node_rank
    server.nnodes = 1
    server.base_gpu_id = 0
    server.global_steps = global_steps
    server._disaggregation_role = "null"
    server._disaggregation_bootstrap_port = None
    server._pd_decode_peers = []
    server._pd_bootstrap_host = None
    server._server_address = "127.0.0.1"
    server._server_port = int(server_port if server_port is not None else 31000 + int(replica_rank))
    server._master_address = server._master_port = server._master_sock = None
    server.profiler_controller = None
    if tokenizer_manager is None:
        tokenizer = getattr(server.model_config, "tokenizer", None)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(server.model_config.path)
        # launch_server, which would start sglang with these server args, is bypassed: the
        # stand-in engine takes verl's enable_metrics decision from the same config, and
        # makes sglang-shaped engine spans when engine_kwargs.sglang.enable_trace is on
        tokenizer_manager = tokenizer_manager_for(
            server.config, tokenizer, model=str(server.model_config.path),
            latency_s=latency_s, per_token_latency_s=per_token_latency_s,
            enable_metrics=sglang_enable_metrics(server.config), preempt_every=preempt_every,
        )
    server.tokenizer_manager = tokenizer_manager
    return server


def make_sglang_server_standin(
    config: Any = None,
    model_config: Any = None,
    *,
    tokenizer_manager: Any = None,
    rollout_mode: Any = None,
    replica_rank: int = 0,
    node_rank: int = 0,
    global_steps: Optional[int] = None,
    latency_s: float = 0.05,
) -> Any:
    """A real ``SGLangHttpServer`` (``__init__`` and launch bypassed) over a stand-in engine.

    ``config``: a ``RolloutConfig`` (or its DictConfig/dict); default: sglang, prompt 512,
    response 128. ``model_config``: an ``HFModelConfig``, its DictConfig, or a model path;
    default: the tiny stand-in model. ``tokenizer_manager``: default a
    :class:`TokenizerManagerStandIn` on the model's tokenizer.
    """
    module = import_sglang_server_module()
    server = object.__new__(module.SGLangHttpServer)
    return init_server_attributes(
        server,
        config=config,
        model_config=model_config,
        tokenizer_manager=tokenizer_manager,
        rollout_mode=rollout_mode,
        replica_rank=replica_rank,
        node_rank=node_rank,
        global_steps=global_steps,
        latency_s=latency_s,
    )


_SERVER_CLASS: Optional[type] = None


def sglang_server_standin_class() -> type:
    """``SGLangHttpServerStandIn``: real ``SGLangHttpServer`` with a stand-in ``__init__`` (for Ray)."""
    global _SERVER_CLASS
    if _SERVER_CLASS is not None:
        return _SERVER_CLASS
    module = import_sglang_server_module()

    class SGLangHttpServerStandIn(module.SGLangHttpServer):
        """verl's ``SGLangHttpServer`` on a stand-in engine; only ``__init__`` is replaced.

        Constructor arguments match :class:`otel_verl.demo.llm_server_standin.LLMServerStandIn`
        so :class:`otel_verl.demo.workers_standin.RolloutReplicaStandIn` can launch either.
        """

        def __init__(
            self,
            config: Any = None,
            model_config: Any = None,
            rollout_mode: Any = None,
            replica_rank: int = 0,
            node_rank: int = 0,
            *,
            latency_s: float = 0.05,
            per_token_latency_s: float = 0.0005,
            server_port: Optional[int] = None,
            preempt_every: int = 0,
        ) -> None:
            init_server_attributes(
                self,
                config=config,
                model_config=model_config,
                rollout_mode=rollout_mode,
                replica_rank=replica_rank,
                node_rank=node_rank,
                server_port=server_port,
                latency_s=latency_s,
                per_token_latency_s=per_token_latency_s,
                preempt_every=preempt_every,
            )
            self.global_steps_history = []

        async def set_global_steps(self, global_steps: int):
            self.global_steps_history.append(global_steps)
            return await super().set_global_steps(global_steps)

        async def abort_all_requests(self, reject_request: bool = False):
            # verl 0.9.1's RolloutReplica passes reject_request, which its SGLangHttpServer
            # does not take (its own SGLangReplica drops it); the pause stays verl's. With
            # reject_request the stand-in engine fails requests arriving while paused, the
            # admission gate verl's SGLangReplica leaves as a TODO, so a replica leaving the
            # balancer sends them back to the client to retry elsewhere.
            await super().abort_all_requests()
            self.tokenizer_manager.reject_while_paused = bool(reject_request)

        # what the ServerAdapter of a real hybrid worker does over HTTP during update_weights
        async def resume_memory_occupation(self, tags=None):
            obj = module.ResumeMemoryOccupationReqInput(tags=tags or ["kv_cache", "weights"])
            await self.tokenizer_manager.resume_memory_occupation(obj, None)

        async def release_memory_occupation(self, tags=None):
            obj = module.ReleaseMemoryOccupationReqInput(tags=tags or ["kv_cache", "weights"])
            await self.tokenizer_manager.release_memory_occupation(obj, None)

        async def start_profile(self, **kwargs):
            return None

        async def stop_profile(self):
            return None

        def get_stats(self) -> Dict[str, Any]:
            tm = self.tokenizer_manager
            return {
                **getattr(tm, "stats", {}),
                "pid": os.getpid(),
                "replica_rank": self.replica_rank,
                "global_steps": self.global_steps,
                "global_steps_history": list(self.global_steps_history),
                "asleep": "weights" in getattr(tm, "released_tags", set()),
                "server_class": "SGLangHttpServer",
            }

    SGLangHttpServerStandIn.__module__ = __name__
    SGLangHttpServerStandIn.__qualname__ = "SGLangHttpServerStandIn"
    _SERVER_CLASS = SGLangHttpServerStandIn
    return SGLangHttpServerStandIn


def __getattr__(name: str) -> Any:
    # ``SGLangHttpServerStandIn`` resolves lazily (module __getattr__, PEP 562), so pickling the
    # class by reference works: unpickling in a Ray worker imports this module, then asks for
    # the name, which installs the stand-in and builds the class there.
    if name == "SGLangHttpServerStandIn":
        return sglang_server_standin_class()
    raise AttributeError(name)
