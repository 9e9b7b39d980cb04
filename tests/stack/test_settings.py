"""``kvferry up``'s settings: flag > environment > config file > default, strict values, and
``--print-config`` output that loads back as a config file."""

from __future__ import annotations

import argparse
import io
import re
from dataclasses import replace
from pathlib import Path

import pytest
from kvferry.stack.console import Console
from kvferry.stack.processes import registry_command
from kvferry.stack.settings import SETTINGS, add_setting_flags, render, resolve, setting_flags


def parse(argv: list[str], environ: dict[str, str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_setting_flags(parser, environ)
    return parser.parse_args(argv)


def test_flag_beats_environment_beats_config_beats_default(tmp_path: Path) -> None:
    config = tmp_path / "stack.toml"
    config.write_text('[retention]\nttl_seconds = 30\n[router]\nhttp_listen = "127.0.0.1:9000"\n')
    env = {"KVFERRY_RETENTION_TTL": "45", "KVFERRY_ROUTER_GRPC_LISTEN": "127.0.0.1:7000"}
    resolved = resolve(parse(["--config", str(config), "--grpc-listen", "127.0.0.1:7001"], env), env)
    assert resolved.grpc_listen == "127.0.0.1:7001" and resolved.sources is not None
    assert resolved.sources["router.grpc_listen"] == "flag"
    assert resolved.retention_ttl_seconds == 45
    assert resolved.sources["retention.ttl_seconds"] == "env KVFERRY_RETENTION_TTL"
    assert resolved.http_listen == "127.0.0.1:9000"
    assert resolved.sources["router.http_listen"] == f"config {config}"
    assert resolved.api_key == "kvferry-demo-key" and resolved.tenant == "demo"
    assert resolved.sources["router.api_keys"] == "default"


def test_printed_config_loads_back_to_the_same_values(tmp_path: Path) -> None:
    env = {"KVFERRY_API_KEYS": "k1=alpha,k2=beta", "KVFERRY_EXTERNAL_ENGINES": "true"}
    first = resolve(parse(["--retention-ttl", "12"], env), env)
    printed = render(first)
    assert "ttl_seconds = 12  # flag; env KVFERRY_RETENTION_TTL" in printed
    saved = tmp_path / "printed.toml"
    saved.write_text(printed)
    again = resolve(parse(["--config", str(saved)], {}), {})
    assert (again.retention_ttl_seconds, again.api_keys, again.external_engines) == (
        12,
        "k1=alpha,k2=beta",
        True,
    )
    assert again.tenant_keys == [("k1", "alpha"), ("k2", "beta")]


@pytest.mark.parametrize(
    ("toml", "problem"),
    [
        ("[router]\nhttp_port = 1\n", "unknown keys in [router]"),
        ("[tenants]\n", "unknown sections"),
        ("[retention]\nttl_seconds = 0\n", "must be at least 1"),
        ('[engines]\nexternal = "maybe"\n', "not a boolean"),
        ('[router]\napi_keys = "no-tenant"\n', "KEY=TENANT"),
    ],
)
def test_a_bad_config_file_is_refused_with_the_key_named(tmp_path: Path, toml: str, problem: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(toml)
    with pytest.raises(ValueError, match=re.escape(problem)):
        resolve(parse(["--config", str(config)], {}), {})


def test_a_bad_environment_value_stops_parsing_with_the_variable_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse([], {"KVFERRY_EXTERNAL_ENGINES": "yes please"})
    assert "KVFERRY_EXTERNAL_ENGINES" in capsys.readouterr().err


def test_off_a_terminal_only_state_changes_are_printed() -> None:
    stream = io.StringIO()
    console = Console(stream)
    console.waiting("waiting for engine decode-0 (2 s)")
    console.event("engine decode-0: healthy after 90 s")
    console.waiting("waiting for engine decode-0 (4 s)")
    assert stream.getvalue() == "  -> engine decode-0: healthy after 90 s\n"


def test_setting_flags_give_a_child_exactly_the_same_values_whatever_its_environment() -> None:
    parent_env = {"KVFERRY_API_KEYS": "k1=alpha", "KVFERRY_EXTERNAL_ENGINES": "true", "KVFERRY_MODEL_DIR": ""}
    parent = resolve(
        parse(["--retention-ttl", "12", "--etcd-endpoints", "10.0.0.5:2379"], parent_env), parent_env
    )
    child_env = {"KVFERRY_RETENTION_TTL": "99", "KVFERRY_API_KEYS": "other=gamma"}
    child = resolve(parse(setting_flags(parent), child_env), child_env)
    assert replace(child, sources=None) == replace(parent, sources=None)


def test_the_started_registrys_address_is_a_setting_and_excludes_using_a_running_one(tmp_path: Path) -> None:
    env = {"KVFERRY_REGISTRY_LISTEN": "127.0.0.1:50051"}
    config = resolve(parse([], env), env)
    assert config.registry_listen == "127.0.0.1:50051"
    assert registry_command(["kvferry"], "127.0.0.1:2379", 60, config.registry_listen) == (
        "127.0.0.1:50051",
        [
            "kvferry",
            "registry",
            "--listen",
            "127.0.0.1:50051",
            "--etcd-endpoints",
            "127.0.0.1:2379",
            "--default-retention-ttl",
            "60",
        ],
    )
    assert registry_command(["kvferry"], "127.0.0.1:2379", 60)[0].startswith("127.0.0.1:")
    with pytest.raises(ValueError, match="exclude each other"):
        resolve(parse(["--registry-address", "10.0.0.7:50051"], env), env)


def test_etcd_ports_kv_cache_and_max_model_len_are_flags_environment_variables_and_config_keys(
    tmp_path: Path,
) -> None:
    toml = tmp_path / "stack.toml"
    toml.write_text("[etcd]\npeer_port = 23800\n[engines]\nkv_cache_gib = 3\n")
    env = {"KVFERRY_ETCD_CLIENT_PORT": "23790", "KVFERRY_MAX_MODEL_LEN": "2048"}
    config = resolve(parse(["--config", str(toml), "--kv-cache-gib", "4"], env), env)
    assert (config.etcd_client_port, config.etcd_peer_port) == (23790, 23800)
    assert (config.kv_cache_gib, config.max_model_len) == (4, 2048)
    printed = render(config)
    for line in (
        "client_port = 23790  # env KVFERRY_ETCD_CLIENT_PORT; env KVFERRY_ETCD_CLIENT_PORT",
        f"peer_port = 23800  # config {toml}; env KVFERRY_ETCD_PEER_PORT",
        "kv_cache_gib = 4  # flag; env KVFERRY_KV_CACHE_GIB",
        "max_model_len = 2048  # env KVFERRY_MAX_MODEL_LEN; env KVFERRY_MAX_MODEL_LEN",
    ):
        assert line in printed, printed
    defaults = render(resolve(parse([], {}), {}))
    for key in ("client_port", "peer_port", "kv_cache_gib", "max_model_len"):
        assert f"{key} = 0  # default" in defaults, defaults
    # The detached supervisor gets them as flags.
    child = resolve(parse(setting_flags(config), {}), {})
    assert replace(child, sources=None) == replace(config, sources=None)


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--etcd-endpoints", "10.0.0.5:2379", "--etcd-client-port", "23790"], "exclude each other"),
        (["--etcd-client-port", "23790", "--etcd-peer-port", "23790"], "set two ports"),
    ],
)
def test_contradictory_etcd_settings_are_refused(argv: list[str], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        resolve(parse(argv, {}), {})


@pytest.mark.parametrize(
    "toml",
    ["[etcd]\nclient_port = 70000\n", "[engines]\nmax_model_len = -1\n", "[engines]\nkv_cache_gib = -2\n"],
)
def test_an_out_of_range_port_or_size_is_refused(tmp_path: Path, toml: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(toml)
    with pytest.raises(ValueError, match=r"must be (a TCP port|0 \(the stack chooses\) or more)"):
        resolve(parse(["--config", str(config)], {}), {})


def test_docs_list_every_setting_with_its_flag_and_environment_variable() -> None:
    table = (Path(__file__).resolve().parents[2] / "docs" / "stack.md").read_text()
    for setting in SETTINGS:
        assert f"| `{setting.name}` | `{setting.flag}` | `{setting.env}` |" in table, setting.name
