"""otel_verl's own counters: what is lost is counted and shows in the log while it goes on."""

from __future__ import annotations

from otel_verl import health


def test_losses_are_logged_again_while_they_go_on(monkeypatch, caplog):
    monkeypatch.setattr(health, "REPORT_INTERVAL_S", 0.0)
    with caplog.at_level("WARNING", logger="otel_verl"):
        health.record_dropped("csv", 2, "disk full")  # the first loss: its own line
        health.record_dropped("csv", 3, "disk full")  # later: the totals so far
    assert "could not write 2 item(s): disk full" in caplog.records[0].getMessage()
    assert caplog.records[1].getMessage() == "otel_verl: losses so far: dropped={'csv': 5} failures={}"


def test_a_note_is_logged_once_and_counted_apart_from_losses(monkeypatch, caplog):
    monkeypatch.setattr(health, "REPORT_INTERVAL_S", 0.0)
    with caplog.at_level("WARNING", logger="otel_verl"):
        for _ in range(3):
            health.record_note("engine.timing_missing", "the engine reports no timing: switch it on")
    assert [r.getMessage() for r in caplog.records] == [
        "otel_verl: the engine reports no timing: switch it on "
        "(counted as engine.timing_missing in otel_verl.health.notes())"]
    assert health.notes() == {"engine.timing_missing": 3}
    assert health.snapshot() == {"failures": {}, "dropped": {}}  # no loss
    health.reset()
    assert health.notes() == {}
