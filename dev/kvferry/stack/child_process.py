"""How kvferry's dev tooling starts child processes (etcd, engines) that must not outlive it or must run
on one core.

No ``preexec_fn``: Python code between fork and exec is unsafe once the parent has started threads
(gRPC's async API runs fork handlers that can crash the child). The child's setup is done by small
util-linux programs that exec the real command instead: ``setpriv --pdeathsig`` and ``taskset``.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence


class MissingToolError(RuntimeError):
    """A util-linux program kvferry's dev tooling needs is not installed."""


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise MissingToolError(f"{name} not found on PATH; install util-linux (apt-get install util-linux)")
    return path


def child_command(
    command: Sequence[str],
    *,
    die_with_parent: bool = False,
    death_signal: str = "TERM",
    core: int | None = None,
) -> list[str]:
    """``command`` wrapped so that the child gets ``death_signal`` (SIGTERM by default) when the thread
    that starts it exits (even by SIGKILL; Linux PR_SET_PDEATHSIG, kept across exec) and, with ``core``,
    runs bound to that core (its own children inherit the binding)."""
    wrapped = list(command)
    if core is not None:
        wrapped = [_tool("taskset"), "--cpu-list", str(core), *wrapped]
    if die_with_parent:
        wrapped = [_tool("setpriv"), "--pdeathsig", death_signal, *wrapped]
    return wrapped
