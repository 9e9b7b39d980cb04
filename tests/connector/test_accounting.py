"""Pulled-versus-computed accounting."""

from __future__ import annotations

from kvferry.connector.accounting import Accounting


def test_counts_pulled_and_computed_tokens_and_rates() -> None:
    accounting = Accounting(kv_bytes_per_token=1000)
    accounting.on_matched("r1", prompt_tokens=500, local_cached_tokens=32)
    accounting.on_allocated("r1", external_tokens=320, now=10.0)
    accounting.on_received("r1", now=10.5, failed=False)
    accounting.on_finished("r1", now=11.5)
    snapshot = accounting.snapshot()
    assert snapshot.pulled_tokens_total == 320
    assert snapshot.computed_tokens_total == 500 - 32 - 320
    assert snapshot.transfer_bytes_per_second == 320 * 1000 / 0.5
    assert snapshot.prefill_tokens_per_second == (500 - 32 - 320) / 1.5
    assert snapshot.running_requests == 0


def test_a_failed_pull_counts_as_computed() -> None:
    accounting = Accounting(kv_bytes_per_token=1)
    version = accounting.version
    accounting.on_matched("r1", prompt_tokens=100, local_cached_tokens=0)
    accounting.on_allocated("r1", external_tokens=64, now=0.0)
    accounting.on_received("r1", now=1.0, failed=True)
    accounting.on_finished("r1", now=2.0)
    snapshot = accounting.snapshot()
    assert snapshot.pulled_tokens_total == 0 and snapshot.computed_tokens_total == 100
    assert accounting.version > version


def test_in_flight_requests_show_as_load() -> None:
    accounting = Accounting(kv_bytes_per_token=1)
    accounting.on_matched("r1", prompt_tokens=100, local_cached_tokens=10)
    accounting.on_declined()
    accounting.set_retained_blocks(7)
    snapshot = accounting.snapshot()
    assert snapshot.inflight_prefill_tokens == 90 and snapshot.running_requests == 1
    assert snapshot.declined_pulls_total == 1 and snapshot.retained_blocks == 7
