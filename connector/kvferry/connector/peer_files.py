"""Another process's shared-memory file, mapped into this one (no vLLM, no NIXL here).

A holder advertises its generation file and its host pool as memfds: its pid and the descriptor's number. A
peer on the same host maps the same pages through ``/proc/<pid>/fd/<fd>`` (same user, same pid namespace) and
then checks the identity the holder wrote into the file, since another process may have taken that pid and
descriptor number since (kvferry.connector.generations, kvferry.connector.host_tier).
"""

from __future__ import annotations

import mmap
import os


def map_peer_file(pid: int, fd: int, nbytes: int, *, writable: bool) -> tuple[mmap.mmap | None, str]:
    """The first ``nbytes`` of the file, mapped here; None when it cannot be (another host or pid namespace,
    the process gone, a smaller file), with why, for the log. The descriptor is closed once mapped: the map
    keeps the pages, whatever becomes of the holder."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        opened = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    except OSError as error:
        return None, f"{path}: {error.strerror}"
    try:
        if os.fstat(opened).st_size < nbytes:
            return None, f"{path} is smaller than the {nbytes} bytes advertised"
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        return mmap.mmap(opened, nbytes, access=access), ""
    except (OSError, ValueError) as error:
        return None, f"{path}: {error}"
    finally:
        os.close(opened)


__all__ = ["map_peer_file"]
