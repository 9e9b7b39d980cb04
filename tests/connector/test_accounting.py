"""Pulled-versus-computed accounting."""

from __future__ import annotations

import dataclasses

import pytest
from kvferry.connector.accounting import PEER_WINDOW, Accounting, PeerPullRate, rates_moved
from kvferry.connector.retention import Tier


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
    # Compute starts once the pulled prefix is in (10.5 s): the pull's time is not the prefill's.
    assert snapshot.prefill_tokens_per_second == (500 - 32 - 320) / 1.0
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


def _pull(
    accounting: Accounting,
    request_id: str,
    peer: str,
    tokens: int,
    start: float,
    seconds: float,
    tier: Tier = Tier.DEVICE,
) -> bool:
    accounting.on_matched(request_id, prompt_tokens=tokens + 10, local_cached_tokens=0)
    accounting.on_allocated(
        request_id, external_tokens=tokens, now=start, peer_engine_id=peer, peer_tier=tier
    )
    measured = accounting.on_received(request_id, now=start + seconds, failed=False)
    accounting.on_finished(request_id, now=start + seconds + 0.01)
    return measured


def _handshake(accounting: Accounting, *peers: str) -> None:
    """A first pull from each peer (no sample: it waits for the NIXL handshake)."""
    for peer in peers:
        assert not _pull(accounting, f"handshake-{peer}", peer, 100, -10.0, 5.0)


def test_the_first_pull_from_a_peer_waits_for_the_handshake_and_gives_no_rate() -> None:
    accounting = Accounting(kv_bytes_per_token=1000)
    assert not _pull(accounting, "r1", "d1", 2000, 0.0, 1.4)
    assert accounting.snapshot().peer_pull_rates == ()
    assert accounting.snapshot().pulled_tokens_total == 2000
    assert _pull(accounting, "r2", "d1", 4000, 2.0, 0.008)
    (rate,) = accounting.snapshot().peer_pull_rates
    assert rate.bytes_per_second == pytest.approx(4000 * 1000 / 0.008) and rate.pulls == 1
    # Another peer has its own handshake.
    assert not _pull(accounting, "r3", "d2", 100, 3.0, 1.0)
    assert [p.peer_engine_id for p in accounting.snapshot().peer_pull_rates] == ["d1"]


def test_pull_rates_are_kept_per_peer_engine() -> None:
    accounting = Accounting(kv_bytes_per_token=1000)
    _handshake(accounting, "d-same-gpu", "d-other-gpu")
    # The same GPU: 100 tokens (100 kB) in 0.2 s; another GPU: the same in 1 ms.
    assert _pull(accounting, "r1", "d-same-gpu", 100, 0.0, 0.2)
    assert _pull(accounting, "r2", "d-other-gpu", 100, 1.0, 0.001)
    assert _pull(accounting, "r3", "d-same-gpu", 300, 2.0, 0.2)
    rates = {p.peer_engine_id: p for p in accounting.snapshot().peer_pull_rates}
    assert rates["d-same-gpu"].bytes_per_second == pytest.approx(400 * 1000 / 0.4)
    assert rates["d-same-gpu"].pulls == 2
    assert rates["d-other-gpu"].bytes_per_second == pytest.approx(100 * 1000 / 0.001)
    assert [p.peer_engine_id for p in accounting.snapshot().peer_pull_rates] == ["d-other-gpu", "d-same-gpu"]


def test_a_peers_host_pool_has_a_rate_of_its_own() -> None:
    """Pulls from a holder's host pool and from its KV cache are timed apart (the router weighs each
    retention by the tier it is in); the handshake is the peer's, paid once for both."""
    accounting = Accounting(kv_bytes_per_token=1000)
    _handshake(accounting, "d1")
    assert _pull(accounting, "r1", "d1", 100, 0.0, 0.001)
    assert _pull(accounting, "r2", "d1", 100, 1.0, 0.1, Tier.HOST)
    rates = accounting.snapshot().peer_pull_rates
    assert [(p.peer_engine_id, p.tier, p.pulls) for p in rates] == [
        ("d1", Tier.DEVICE, 1),
        ("d1", Tier.HOST, 1),
    ]
    assert rates[0].bytes_per_second == pytest.approx(100 * 1000 / 0.001)
    assert rates[1].bytes_per_second == pytest.approx(100 * 1000 / 0.1)
    # A host-pool rate that appears or moves is worth reporting at once, as a KV-cache one is.
    before = accounting.snapshot()
    assert _pull(accounting, "r3", "d1", 100, 2.0, 1.0, Tier.HOST)
    assert rates_moved(before, accounting.snapshot())


def test_a_peer_rate_follows_its_recent_pulls_and_failed_pulls_give_none() -> None:
    accounting = Accounting(kv_bytes_per_token=1)
    _handshake(accounting, "d1", "d2")
    for i in range(PEER_WINDOW):
        _pull(accounting, f"slow{i}", "d1", 1000, float(i), 1.0)
    for i in range(PEER_WINDOW):
        _pull(accounting, f"fast{i}", "d1", 1000, 100.0 + i, 0.001)
    (rate,) = accounting.snapshot().peer_pull_rates
    assert rate.bytes_per_second == pytest.approx(1e6) and rate.pulls == PEER_WINDOW
    accounting.on_matched("bad", prompt_tokens=50, local_cached_tokens=0)
    accounting.on_allocated("bad", external_tokens=32, now=0.0, peer_engine_id="d2")
    assert not accounting.on_received("bad", now=9.0, failed=True)
    assert [p.peer_engine_id for p in accounting.snapshot().peer_pull_rates] == ["d1"]


def test_rates_moved_reports_new_and_changed_rates_only() -> None:
    accounting = Accounting(kv_bytes_per_token=1000)
    empty = accounting.snapshot()
    assert not rates_moved(None, empty)
    _handshake(accounting, "d1")
    _pull(accounting, "r1", "d1", 100, 0.0, 0.2)
    first = accounting.snapshot()
    assert rates_moved(None, first) and rates_moved(empty, first)
    assert not rates_moved(first, first)
    nudged = dataclasses.replace(
        first, peer_pull_rates=(PeerPullRate("d1", first.peer_pull_rates[0].bytes_per_second * 1.1, 2),)
    )
    assert not rates_moved(first, nudged)
    halved = dataclasses.replace(
        first, peer_pull_rates=(PeerPullRate("d1", first.peer_pull_rates[0].bytes_per_second / 2, 2),)
    )
    assert rates_moved(first, halved)
    assert rates_moved(
        first, dataclasses.replace(first, prefill_tokens_per_second=first.prefill_tokens_per_second * 2)
    )
