"""Outputs written by an export process instead of the traced process.

A rollout worker's event loop runs every agent loop of the worker, the trainer's
training loop every step; the outputs' formatting (CSV rows, the trajectory JSONL's
decoding and ``json.dumps``), OTLP encoding and sending would each take that loop's CPU
and GIL per trajectory. With offloading (``OTEL_VERL_OFFLOAD``; by default on in rollout
workers and the trainer), the process's TracerProvider has one span processor,
:class:`~otel_verl.offload.forwarder.OffloadSpanProcessor`, that hands every span to a
child process (:mod:`otel_verl.offload.host`) running the very span processors the
process would have run (``outputs.build``), with the process's resource and
pid. :mod:`otel_verl.offload.wire` is what goes between them. An export process that dies
is replaced, a few times a minute at most; then the process writes its outputs itself
(``in_process_outputs``) or counts them lost.
"""
