"""``free_port``: the ports the stack and the tests hand to processes that bind them later."""

from __future__ import annotations

import socket
from pathlib import Path

from kvferry.stack.etcd_process import free_port


def test_free_ports_lie_below_the_ephemeral_range_are_bindable_and_never_handed_out_twice() -> None:
    """An engine binds its NIXL side channel a minute after its port was chosen; a port of the kernel's
    ephemeral range can be taken meanwhile by any outgoing connection (a `kvferry up` failed so, its engine's
    zmq bind 'Address already in use'), one below it cannot."""
    start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= port < start for port in ports)
    for port in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_something_listens_on_is_not_handed_out() -> None:
    taken: list[socket.socket] = []
    try:
        # A few hundred listeners just below the ephemeral range: none of 200 free ports is one of them.
        start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        for port in range(start - 300, start):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            sock.listen()
            taken.append(sock)
        listening = {sock.getsockname()[1] for sock in taken}
        assert not listening & {free_port() for _ in range(200)}
    finally:
        for sock in taken:
            sock.close()
