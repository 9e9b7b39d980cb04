"""Connector settings: defaults, parsing from kv_connector_extra_config, failures at start."""

from __future__ import annotations

import pytest
from kvferry.connector.settings import (
    KvferrySettings,
    SettingsError,
    parse_settings,
    settings_to_extra_config,
)


def test_defaults_apply_when_only_bidirectional_is_set() -> None:
    settings = parse_settings({"bidirectional_kv_xfer": True})
    assert settings == KvferrySettings()
    assert settings.max_retention_seconds == 1800.0
    assert settings.release_grace_seconds == 30.0
    assert settings.sidecar_address == ""


def test_kvferry_keys_are_read_from_their_own_object() -> None:
    settings = parse_settings(
        {
            "bidirectional_kv_xfer": True,
            "kv_recompute_threshold": 64,
            "kvferry": {
                "sidecar_address": "127.0.0.1:5000",
                "max_retention_seconds": 20,
                "lease_ttl_seconds": 9,
            },
        }
    )
    assert settings.sidecar_address == "127.0.0.1:5000"
    assert settings.max_retention_seconds == 20.0
    assert isinstance(settings.max_retention_seconds, float)
    assert settings.lease_ttl_seconds == 9


def test_bidirectional_transfer_is_required() -> None:
    with pytest.raises(SettingsError, match="bidirectional_kv_xfer"):
        parse_settings({"kvferry": {}})


def test_unknown_key_fails_with_the_known_ones_listed() -> None:
    with pytest.raises(SettingsError, match=r"unknown kvferry setting\(s\) \['max_retention'\]"):
        parse_settings({"bidirectional_kv_xfer": True, "kvferry": {"max_retention": 5}})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_retention_seconds", "20"),
        ("lease_ttl_seconds", 1.5),
        ("sidecar_address", 5),
        ("min_read_seconds", True),
    ],
)
def test_wrong_types_fail(key: str, value: object) -> None:
    with pytest.raises(SettingsError, match=key):
        parse_settings({"bidirectional_kv_xfer": True, "kvferry": {key: value}})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_retention_seconds": 0}, "max_retention_seconds"),
        ({"retained_kv_fraction": 1.5}, "retained_kv_fraction"),
        ({"release_grace_seconds": 3, "min_read_seconds": 2}, "smaller than half of release_grace_seconds"),
        ({"release_grace_seconds": 0}, "release_grace_seconds must be > 0"),
        ({"release_grace_seconds": -1.0}, "release_grace_seconds must be > 0"),
        ({"nixl_progress_delay_us": -1}, "nixl_progress_delay_us"),
        ({"fence_wait_us": -1}, "fence_wait_us"),
        ({"host_pool_blocks": -1}, "host_pool_blocks must be >= 0"),
        ({"host_pool_blocks": 64, "fence_pulls": False}, "host_pool_blocks needs fence_pulls"),
        ({"demote_after_seconds": -0.5}, "demote_after_seconds"),
        ({"demote_below_free_fraction": 1.0}, "demote_below_free_fraction"),
        ({"demote_blocks_per_step": 0}, "demote_blocks_per_step"),
    ],
)
def test_invalid_values_fail(changes: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        parse_settings({"bidirectional_kv_xfer": True, "kvferry": changes})


def test_non_object_settings_fail() -> None:
    with pytest.raises(SettingsError, match="must be an object"):
        parse_settings({"bidirectional_kv_xfer": True, "kvferry": "fast"})


def test_round_trip_through_extra_config() -> None:
    settings = KvferrySettings(sidecar_address="unix:/tmp/s.sock", release_grace_seconds=12.0)
    extra = settings_to_extra_config(settings)
    assert extra == {"sidecar_address": "unix:/tmp/s.sock", "release_grace_seconds": 12.0}
    assert parse_settings({"bidirectional_kv_xfer": True, "kvferry": extra}) == settings


def test_coalesced_pulls_are_on_by_default_and_can_be_turned_off() -> None:
    assert KvferrySettings().coalesce_pulls is True
    off = parse_settings({"bidirectional_kv_xfer": True, "kvferry": {"coalesce_pulls": False}})
    assert off.coalesce_pulls is False
    assert settings_to_extra_config(off) == {"coalesce_pulls": False}
    with pytest.raises(SettingsError, match="coalesce_pulls"):
        parse_settings({"bidirectional_kv_xfer": True, "kvferry": {"coalesce_pulls": "no"}})


def test_pull_fencing_is_on_by_default_and_can_be_turned_off() -> None:
    assert parse_settings({"bidirectional_kv_xfer": True}).fence_pulls is True
    off = parse_settings(
        {"bidirectional_kv_xfer": True, "kvferry": {"fence_pulls": False, "fence_wait_us": 0}}
    )
    assert (off.fence_pulls, off.fence_wait_us) == (False, 0)
