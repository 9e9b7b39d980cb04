"""``kvferry <subcommand>``: one console command, one subcommand per service or tool.

Each subcommand lives in its own module exposing ``configure(parser)`` and ``run(args) -> int``;
modules are imported only when their subcommand runs, so ``kvferry registry`` never imports vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# (subcommand, module, one-line help). `up`, `down` and `bench` live in the kvferry-dev distribution (dev/),
# which a checkout's tools/setup installs and the server image does not.
SUBCOMMANDS: list[tuple[str, str, str]] = [
    ("registry", "kvferry.registry.cli", "run the KV-metadata registry service (etcd-backed)"),
    ("sidecar", "kvferry.sidecar.cli", "run the sidecar beside one vLLM engine"),
    ("router", "kvferry.router.cli", "run the router: gRPC and OpenAI-compatible HTTP front door"),
    ("up", "kvferry.stack.up", "start the local stack (etcd, registry, router, engines, sidecars) + demo"),
    ("down", "kvferry.stack.down", "stop everything `kvferry up` started"),
    (
        "status",
        "kvferry.stack.status",
        "what the local stack runs: processes, health, retained KV per engine",
    ),
    ("bench", "kvferry.bench.cli", "benchmarks: registry, router, multiturn, idle"),
]


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvferry", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = argv[0] if argv else None
    for name, module_name, help_text in SUBCOMMANDS:
        child = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as error:
                if error.name not in (module_name, module_name.rsplit(".", 1)[0]):
                    raise
                parser.error(
                    f"`kvferry {name}` needs the kvferry-dev distribution (dev/; tools/setup installs it)"
                )
            module.configure(child)
            child.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_list)
    args = parser.parse_args(args_list)
    run = getattr(args, "_run")  # noqa: B009
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
