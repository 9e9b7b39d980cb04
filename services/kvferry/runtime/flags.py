"""Command-line flags whose defaults come from environment variables, for every service CLI.

One helper, :class:`EnvFlags`: each flag names its variable(s), ``--help`` shows them with the default,
a flag given on the command line wins over the environment, and a bad environment value stops the
command with one line on stderr naming the flag and the variable, exit status 2 (no traceback, and no
usage text: the command line was not wrong). The variable is read when the command is parsed, not when
the parser is built, and only when the flag is not given.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NoReturn

LOG_LEVELS = ("debug", "info", "warning", "error")


class _FromEnvironment(str):
    """An environment variable's text used as a flag's default; remembers which variable gave it."""

    variable: str


def _env_converter(
    parser: argparse.ArgumentParser, flag: str, kind: Callable[[str], Any], choices: Collection[Any] | None
) -> Callable[[str], Any]:
    def refuse(text: _FromEnvironment, problem: str) -> NoReturn:
        parser.exit(
            2,
            f"{parser.prog}: error: argument {flag}: environment variable "
            f"{text.variable}={str(text)!r} {problem}\n",
        )

    def convert(text: str) -> Any:
        if not isinstance(text, _FromEnvironment):
            return kind(text)  # argparse words a bad command-line value itself
        try:
            value = kind(text)
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            refuse(text, f"is not a valid {_kind_name(kind)}")
        if choices is not None and value not in choices:
            refuse(text, f"is not one of {', '.join(str(c) for c in choices)}")
        return value

    # argparse names the type in its own messages ("invalid float value").
    convert.__name__ = getattr(kind, "__name__", "value")
    return convert


def _kind_name(kind: Callable[[str], Any]) -> str:
    return {"int": "integer", "float": "number"}.get(getattr(kind, "__name__", ""), "value")


class EnvFlags:
    """Adds environment-backed flags to ``parser`` (:meth:`group`: to a titled group of its flags).

    ``environ`` defaults to ``os.environ``; tests pass their own mapping.
    """

    def __init__(self, parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
        self._root = parser
        self._parser: argparse.ArgumentParser | argparse._ArgumentGroup = parser
        self._environ: Mapping[str, str] = os.environ if environ is None else environ

    def group(self, title: str) -> EnvFlags:
        """The same helper for a titled argument group (``--help`` lists the group's flags together)."""
        grouped = EnvFlags(self._root, self._environ)
        grouped._parser = self._root.add_argument_group(title)
        return grouped

    def add(
        self,
        flag: str,
        env: str | Sequence[str],
        help: str,
        *,
        type: Callable[[str], Any] = str,
        default: Any = None,
        required: bool = False,
        choices: Collection[Any] | None = None,
        metavar: str | None = None,
        switch: bool = False,
    ) -> None:
        """``flag`` with its default from the first of ``env`` that is set and not empty, else
        ``default``; ``required`` only when neither the command line nor the environment gives it.
        ``switch``: the bare flag means True (``--gpu``), a value after it still counts (``--gpu false``)."""
        variables = [env] if isinstance(env, str) else list(env)
        value: Any = default
        for variable in variables:
            text = self._environ.get(variable)
            if text:
                value = _FromEnvironment(text)
                value.variable = variable
                break
        shown = f"env {', '.join(variables)}"
        if default is not None:
            shown += f"; default: {default}"
        elif required:
            shown += "; required"
        self._parser.add_argument(
            flag,
            type=_env_converter(self._root, flag, type, choices),
            default=value,
            required=required and not isinstance(value, _FromEnvironment),
            choices=choices,
            metavar=metavar,
            nargs="?" if switch else None,
            const=True if switch else None,
            # argparse %-formats help texts.
            help=f"{help} [{shown}]".replace("%", "%%"),
        )


def add_log_level_flag(flags: EnvFlags) -> None:
    flags.add(
        "--log-level",
        "KVFERRY_LOG_LEVEL",
        "log level; logs are JSON lines on stderr",
        default="info",
        choices=LOG_LEVELS,
    )


def add_telemetry_flags(flags: EnvFlags) -> None:
    """The same ``--metrics-address`` / ``--otlp-endpoint`` flags on every service."""
    telemetry = flags.group("telemetry")
    telemetry.add(
        "--metrics-address",
        "KVFERRY_METRICS_ADDRESS",
        "host:port to serve Prometheus /metrics on (port 0: any free port); off when unset",
    )
    telemetry.add(
        "--otlp-endpoint",
        ("KVFERRY_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
        "OTLP/gRPC collector for traces (host:port or http(s)://host:port); tracing is off when unset",
    )
