"""CPU harness: verl's real training loop on a local Ray cluster, stand-ins only for the GPU parts.

Shared by the tests and by the ``otel-verl demo`` command. It does not use otel_verl's
tracing; a tracing layer attaches from outside (``runtime_env`` / ``on_ray_init`` of
:func:`otel_verl.demo.harness.run_v0`).

    python -m otel_verl.demo.harness --out /tmp/demo --steps 2 --prompts 4 --n 4 --agent tool

    from otel_verl.demo.harness import run_v0
    summary = run_v0("/tmp/demo", agent="tool")

Modules (importing this package imports none of them, nor verl):

* :mod:`~otel_verl.demo.harness` - ``run_v0`` and the CLI: Hydra config, Ray, the
  ``RayPPOTrainer`` subclass that wires the stand-ins in ``init_workers``, the summary.
* :mod:`~otel_verl.demo.tiny_model` - the stand-in model directory (tokenizer, chat
  template, Qwen2 config), built locally and cached by content.
* :mod:`~otel_verl.demo.data` - a GSM8K-like parquet dataset scored by verl's gsm8k reward.
* :mod:`~otel_verl.demo.tools` - the native ``calculator`` tool and its tool-config YAML.
* :mod:`~otel_verl.demo.llm_server_standin` - ``LLMServerStandIn`` (the server actor) and
  ``TokenizerManagerStandIn`` (its sglang-shaped engine, with per-request timing).
* :mod:`~otel_verl.demo.workers_standin` - stand-ins for the GPU worker groups, the rollout
  replica and the replica choice in ``LLMServerManager``.
* :mod:`~otel_verl.demo.sglang_standin` - a meta-path stand-in for ``sglang`` so verl's real
  ``SGLangHttpServer.generate`` runs over the stand-in engine.
* :mod:`~otel_verl.demo.engine_spans_standin` - the engines' own request spans, shaped as
  sglang and vLLM write them (their tracing, not otel_verl's), for the stand-in engines.
* :mod:`~otel_verl.demo.probe` - a setup hook that records which Ray processes ran it.
* :mod:`~otel_verl.demo.progress` - the phases the harness notes in a file and the driver's
  reporter that prints them, each finished step and a heartbeat (``otel-verl demo``).
"""
