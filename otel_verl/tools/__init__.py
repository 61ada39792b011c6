"""Offline tools: doctor, report, replay and their helpers (the `otel-verl` command).

A training process never imports them (tests/test_import_graph.py): they read what a
run left behind, or check a set-up before one.
"""
