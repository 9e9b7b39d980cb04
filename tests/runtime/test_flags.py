"""Flags backed by environment variables: one helper for every service CLI."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
from kvferry.runtime.flags import EnvFlags

pytestmark = pytest.mark.timeout(60)


def _parser(environ: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvferry test")
    flags = EnvFlags(parser, environ)
    flags.add("--timeout", "T_TIMEOUT", "seconds", type=float, default=2.0)
    flags.group("engine").add("--engine-id", "T_ENGINE_ID", "engine id", required=True)
    flags.add("--policy", "T_POLICY", "policy", default="cost", choices=("cost", "never"))
    flags.add("--port", ("T_PORT", "T_FALLBACK_PORT"), "port", type=int, default=5600)
    return parser


def test_the_environment_fills_defaults_and_the_command_line_wins() -> None:
    environ = {"T_TIMEOUT": "7.5", "T_ENGINE_ID": "e1", "T_POLICY": "never", "T_FALLBACK_PORT": "5601"}
    args = _parser(environ).parse_args([])
    assert (args.timeout, args.engine_id, args.policy, args.port) == (7.5, "e1", "never", 5601)
    args = _parser(environ).parse_args(["--timeout", "1", "--engine-id", "e2", "--policy", "cost"])
    assert (args.timeout, args.engine_id, args.policy) == (1.0, "e2", "cost")
    assert _parser({"T_PORT": "1", "T_FALLBACK_PORT": "2", "T_ENGINE_ID": "e"}).parse_args([]).port == 1
    assert _parser({"T_TIMEOUT": "", "T_ENGINE_ID": "e"}).parse_args([]).timeout == 2.0, "empty is unset"


def test_a_bad_value_given_on_the_command_line_wins_over_a_bad_environment() -> None:
    args = _parser({"T_TIMEOUT": "soon", "T_ENGINE_ID": "e"}).parse_args(["--timeout", "3"])
    assert args.timeout == 3.0


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"T_TIMEOUT": "soon"}, "T_TIMEOUT='soon' is not a valid number"),
        ({"T_POLICY": "sometimes"}, "T_POLICY='sometimes' is not one of cost, never"),
        ({"T_PORT": "80x"}, "T_PORT='80x' is not a valid integer"),
    ],
)
def test_a_bad_environment_value_exits_2_naming_the_variable(
    environ: dict[str, str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        _parser({"T_ENGINE_ID": "e", **environ}).parse_args([])
    assert exited.value.code == 2
    [error_line] = capsys.readouterr().err.strip().splitlines()
    assert error_line.startswith("kvferry test: error: argument --") and named in error_line


def test_a_required_flag_is_satisfied_by_its_variable_and_missing_without_either(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _parser({"T_ENGINE_ID": "e"}).parse_args([]).engine_id == "e"
    with pytest.raises(SystemExit) as exited:
        _parser({}).parse_args([])
    assert exited.value.code == 2
    assert "--engine-id" in capsys.readouterr().err


def test_help_shows_each_variable_and_default() -> None:
    text = " ".join(_parser({}).format_help().split())
    assert "seconds [env T_TIMEOUT; default: 2.0]" in text
    assert "engine id [env T_ENGINE_ID; required]" in text
    assert "[env T_PORT, T_FALLBACK_PORT; default: 5600]" in text


@pytest.mark.parametrize(
    ("command", "variable", "value"),
    [
        ("registry", "KVFERRY_ETCD_TIMEOUT_SECONDS", "two"),
        ("registry", "KVFERRY_LOG_LEVEL", "loud"),
        ("sidecar", "KVFERRY_ENGINE_TTL_SECONDS", "ten"),
        ("router", "KVFERRY_ROUTER_MAX_ATTEMPTS", "2.5"),
        ("router", "KVFERRY_ROUTER_REUSE_POLICY", "sometimes"),
    ],
)
def test_every_service_refuses_a_bad_environment_value_in_one_line(
    command: str, variable: str, value: str
) -> None:
    environ = {**os.environ, variable: value, "KVFERRY_ENGINE_ID": "e", "KVFERRY_ENGINE_ROLE": "decode"}
    environ.update({"KVFERRY_ENGINE_URL": "http://127.0.0.1:1", "KVFERRY_KV_COMPATIBILITY_HASH": "h"})
    done = subprocess.run(
        [sys.executable, "-m", "kvferry.cli.main", command],
        env=environ,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 2
    [error_line] = done.stderr.strip().splitlines()
    assert error_line.startswith(f"kvferry {command}: error:")
    assert f"environment variable {variable}='{value}'" in error_line
