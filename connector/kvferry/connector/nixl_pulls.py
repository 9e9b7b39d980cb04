"""Coalesced KV pulls: the one place where kvferry's connector posts NIXL transfers itself.

vLLM's pull worker builds each READ as two index lists into descriptor lists it prepared at
start (local) and at handshake (remote), and calls ``make_prepped_xfer``. :class:`PullCoalescer`
wraps vLLM's NIXL agent (the worker's ``nixl_wrapper``) and changes only that call: it looks up
the descriptors behind both index lists, plans the same bytes as the fewest, largest descriptors
(:func:`kvferry.connector.coalesce.plan_pull`) and posts them with ``initialize_xfer``. The
handle it returns is an ordinary NIXL transfer handle, so vLLM posts, polls, reads telemetry
and releases it as its own. Everything else passes through unchanged.

To know the descriptors behind vLLM's handles the coalescer watches three calls it forwards:
``get_reg_descs`` / ``register_memory`` (the local registered ranges: a descriptor never spans
two), ``get_xfer_descs`` (the rows of a list about to be prepared) and ``prep_xfer_dlist`` (the
handle those rows got, and the agent they belong to). A pull whose handles it did not see, a
plan it cannot make safely, or a NIXL error while building the request falls back to vLLM's
own call: the worst case is vLLM's behaviour, never different bytes.

Remote ranges are not known on this side; a run that is contiguous on both sides and lies in
one local registered range is assumed to lie in one remote range too (the two engines share
vLLM version, layout and KV config, so both group their regions into registrations alike). If
that ever failed, NIXL rejects the request (a descriptor must lie in one registration) and the
pull falls back as above.

Each finished pull is reported (``kv pull`` log line, counters): descriptors vLLM listed,
descriptors posted, descriptors NIXL used after its own merging (telemetry), bytes, time, rate.

A holder with a host pool (kvferry.connector.host_tier) is a :class:`PoolList` in vLLM's tables: vLLM
indexes its pool slots after each region's KV-cache blocks. The coalescer answers for it: KV-cache
blocks are read from the NIXL list beneath, and pool slots of a holder whose pool is mapped into this
process (same host) are copied by this engine itself (:class:`MappedRead`, a handle vLLM posts, polls
and releases like a NIXL one; the holder gets the READ's notification when the copy is done).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
from kvferry.connector.coalesce import (
    LENGTH,
    BlockRuns,
    DescriptorList,
    PlanError,
    block_runs,
    first_block_pairs,
    plan_pull,
    segments_of,
)
from kvferry.connector.copies import CopyDone, merge_runs
from kvferry.connector.host_tier import HostPoolLayout, MappedHostPool
from kvferry.connector.logs import log_off_path

logger = logging.getLogger("kvferry.connector.pulls")

# How vLLM names the local side when it prepares a list (NIXL takes str or bytes names).
LOCAL_AGENT_NAMES = frozenset({"NIXL_INIT_AGENT", "", b"NIXL_INIT_AGENT", b""})
# Rows of lists handed to get_xfer_descs and not yet prepared (vLLM prepares right away).
_MAX_PENDING_LISTS = 8


@dataclass(frozen=True)
class PullContext:
    """What the worker knows about the pull it is about to post (set around vLLM's read call)."""

    request_id: str
    # Per-request override of the engine's setting (None: the setting decides).
    coalesce: bool | None = None
    # Hash the received bytes when the pull is done (tests compare pulls with it).
    digest: bool = False
    local_block_ids: Sequence[int] = ()
    remote_block_ids: Sequence[int] = ()
    # Per-request override: False reads a mapped host pool over NIXL all the same (tests of that path).
    mapped: bool | None = None


@dataclass
class PullRecord:
    """One posted pull, reported when NIXL says it is done."""

    request_id: str
    remote_request_id: str
    coalesced: bool
    listed_descriptors: int
    posted_descriptors: int
    total_bytes: int
    runs: BlockRuns | None
    started: float
    plan_seconds: float
    digest: bool = False
    # vLLM's listed destination rows, in vLLM's order (kept only for digests).
    destination_rows: npt.NDArray[np.uint64] | None = None
    # The blocks the pull filled, in the order of the request's tokens (logged with digests: tests
    # check that they still hold those tokens' places afterwards).
    local_block_ids: tuple[int, ...] = ()
    memory_type: str = ""
    fallback_reason: str | None = None
    nixl_descriptors: int | None = None
    # Wall time from posting to NIXL's DONE as vLLM polls it (once per engine step).
    transfer_seconds: float | None = None
    # NIXL's own telemetry: time to post the request, and from the start of posting to done.
    nixl_post_seconds: float | None = None
    nixl_transfer_seconds: float | None = None
    received_digest: str | None = None
    # How the bytes came: "nixl" (a READ) or "mapped" (copied from a holder's pool mapped here).
    read: str = "nixl"

    def fields(self) -> dict[str, Any]:
        seconds = self.nixl_transfer_seconds or self.transfer_seconds or 0.0
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "remote_request_id": self.remote_request_id,
            "coalesced": self.coalesced,
            "listed_descriptors": self.listed_descriptors,
            "posted_descriptors": self.posted_descriptors,
            "nixl_descriptors": self.nixl_descriptors,
            "bytes": self.total_bytes,
            "plan_ms": round(self.plan_seconds * 1e3, 3),
            "wall_ms": round((self.transfer_seconds or 0.0) * 1e3, 3),
            "post_ms": None if self.nixl_post_seconds is None else round(self.nixl_post_seconds * 1e3, 3),
            "transfer_ms": round(seconds * 1e3, 3),
            "gbps": round(self.total_bytes / seconds / 1e9, 3) if seconds > 0 else None,
            "read": self.read,
        }
        if self.runs is not None:
            out.update(
                blocks=self.runs.blocks,
                block_runs_as_listed=self.runs.runs_as_listed,
                block_runs_sorted=self.runs.runs_sorted,
            )
        if self.fallback_reason:
            out["fallback_reason"] = self.fallback_reason
        if self.received_digest:
            out["digest"] = self.received_digest
            out["local_block_ids"] = list(self.local_block_ids)
        return out


@dataclass(frozen=True)
class WarmRead:
    """A READ of each region's first block from a peer, posted before its first pull (see
    :meth:`PullCoalescer.warm`)."""

    descriptors: int
    bytes: int
    # Building the planner's views of both lists, and NIXL's request (its first with that peer).
    plan_seconds: float
    transfer_seconds: float


@dataclass
class PullCounters:
    pulls: int = 0
    coalesced_pulls: int = 0
    fallbacks: int = 0
    listed_descriptors: int = 0
    posted_descriptors: int = 0
    nixl_descriptors: int = 0
    bytes: int = 0
    transfer_seconds: float = 0.0


@dataclass(frozen=True)
class _Prepped:
    rows: npt.NDArray[np.uint64]
    memory_type: str
    # As vLLM passed it: nixl's add_remote_agent returns the remote's name as bytes.
    agent_name: str | bytes

    @property
    def local(self) -> bool:
        return self.agent_name in LOCAL_AGENT_NAMES


@dataclass(eq=False)
class PoolList:
    """A holder's list as vLLM indexes it once its host pool is known: each region's KV-cache blocks, then
    its pool slots (``kv_blocks + slots`` indices a region). Never handed to NIXL (module doc)."""

    # The list prepared with NIXL for the holder: its KV cache, and its pool too when ``base_lists_pool``.
    base: Any
    agent_name: str | bytes
    kv_blocks: int
    layout: HostPoolLayout
    # The pool mapped into this process (a holder on this host), or None.
    mapped: MappedHostPool | None
    base_lists_pool: bool


@dataclass(eq=False)
class MappedRead:
    """A pull of pool slots this engine copies from a mapped pool; vLLM holds it as a transfer handle."""

    record: PullRecord
    mapped: MappedHostPool
    runs: list[tuple[int, int, int]]
    agent_name: str | bytes
    notif_msg: bytes
    copy: CopyDone | None = None
    notified: bool = False


@dataclass
class _Registry:
    """Handles and rows this coalescer has seen (guarded by the coalescer's lock)."""

    pending_lists: dict[int, tuple[Any, npt.NDArray[np.uint64], str]] = field(default_factory=dict)
    pending_registrations: dict[int, tuple[Any, list[tuple[int, int]]]] = field(default_factory=dict)
    registered: list[tuple[int, int]] = field(default_factory=list)
    prepped: dict[int, tuple[Any, _Prepped]] = field(default_factory=dict)
    lists: dict[int, DescriptorList] = field(default_factory=dict)
    pulls: dict[int, tuple[Any, PullRecord]] = field(default_factory=dict)


class PullCoalescer:
    """Proxy of vLLM's NIXL agent that posts READs as coalesced descriptors (see module doc)."""

    def __init__(
        self,
        agent: Any,
        *,
        enabled: bool,
        reader_role: str = "",
        on_pull: Callable[[PullRecord], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._agent = agent
        self.enabled = enabled
        self.reader_role = reader_role
        self._on_pull = on_pull
        self._clock = clock
        self._lock = threading.Lock()
        self._seen = _Registry()
        self._local = threading.local()
        self.counters = PullCounters()
        self._warned: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    # -- context from the worker --------------------------------------------------------------------

    def set_context(self, context: PullContext | None) -> None:
        self._local.context = context

    def _context(self) -> PullContext | None:
        return getattr(self._local, "context", None)

    # -- watching what vLLM prepares ---------------------------------------------------------------

    def get_reg_descs(self, descs: Any, mem_type: str | None = None) -> Any:
        result = self._agent.get_reg_descs(descs, mem_type)
        ranges = _ranges_of(descs)
        if ranges is not None and result is not None:
            with self._lock:
                self._seen.pending_registrations[id(result)] = (result, ranges)
        return result

    def register_memory(self, descs: Any, *args: Any, **kwargs: Any) -> Any:
        result = self._agent.register_memory(descs, *args, **kwargs)
        with self._lock:
            entry = self._seen.pending_registrations.pop(id(descs), None)
            ranges = entry[1] if entry is not None else _ranges_of(descs)
            if ranges:
                self._seen.registered.extend(ranges)
                # Segments of local lists depend on the registrations: recompute lazily.
                self._seen.lists.clear()
        return result

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> Any:
        result = self._agent.get_xfer_descs(descs, mem_type)
        rows = _rows_of(descs)
        if rows is not None and result is not None:
            with self._lock:
                pending = self._seen.pending_lists
                pending[id(result)] = (result, rows, mem_type or "")
                while len(pending) > _MAX_PENDING_LISTS:
                    pending.pop(next(iter(pending)))
        return result

    def prep_xfer_dlist(self, agent_name: str | bytes, xfer_list: Any, *args: Any, **kwargs: Any) -> Any:
        handle = self._agent.prep_xfer_dlist(agent_name, xfer_list, *args, **kwargs)
        with self._lock:
            entry = self._seen.pending_lists.pop(id(xfer_list), None)
            rows: npt.NDArray[np.uint64] | None
            if entry is not None:
                rows, mem_type = entry[1], entry[2]
            else:
                rows = _rows_of(xfer_list)
                mem_type = str(kwargs.get("mem_type") or (args[0] if args else "") or "")
            if rows is not None and rows.ndim == 2 and rows.shape[1] == 3:
                self._seen.prepped[id(handle)] = (handle, _Prepped(rows, mem_type, agent_name))
        return handle

    def prepared_rows(self, handle: Any) -> npt.NDArray[np.uint64] | None:
        """The rows of a list vLLM prepared through this proxy (None: not seen)."""
        with self._lock:
            entry = self._seen.prepped.get(id(handle))
        return entry[1].rows if entry is not None else None

    def release_dlist_handle(self, handle: Any) -> Any:
        if isinstance(handle, PoolList):
            handle = handle.base
        with self._lock:
            self._seen.prepped.pop(id(handle), None)
            self._seen.lists.pop(id(handle), None)
        return self._agent.release_dlist_handle(handle)

    # -- posting ------------------------------------------------------------------------------------

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: Any,
        local_indices: Any,
        remote_xfer_side: Any,
        remote_indices: Any,
        notif_msg: bytes = b"",
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if isinstance(remote_xfer_side, PoolList):
            return self._post_to_pool_list(
                operation,
                local_xfer_side,
                local_indices,
                remote_xfer_side,
                remote_indices,
                notif_msg,
                *args,
                **kwargs,
            )
        context = self._context()
        wanted = self.enabled if context is None or context.coalesce is None else context.coalesce
        started = self._clock()
        record = self._record(context, notif_msg, local_indices, wanted)
        local = remote = None
        if operation == "READ":
            with self._lock:
                local = self._seen.prepped.get(id(local_xfer_side))
                remote = self._seen.prepped.get(id(remote_xfer_side))
            if local is not None and record.digest:
                record.destination_rows = local[1].rows[np.asarray(local_indices, dtype=np.int64)]
                record.memory_type = local[1].memory_type
        plain = not args and not kwargs.get("backends") and not kwargs.get("skip_desc_merge")
        if wanted and operation == "READ" and plain:
            reason = self._why_not(local, remote)
            if reason is None:
                assert local is not None and remote is not None
                handle = self._post_coalesced(
                    operation, local, remote, local_indices, remote_indices, notif_msg, record, started
                )
                if handle is not None:
                    return handle
            else:
                record.fallback_reason = reason
        handle = self._agent.make_prepped_xfer(
            operation,
            local_xfer_side,
            local_indices,
            remote_xfer_side,
            remote_indices,
            notif_msg,
            *args,
            **kwargs,
        )
        record.plan_seconds = self._clock() - started
        record.started = self._clock()
        self._track(handle, record)
        return handle

    def _post_to_pool_list(
        self,
        operation: str,
        local_xfer_side: Any,
        local_indices: Any,
        pool_list: PoolList,
        remote_indices: Any,
        notif_msg: bytes,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """A read from a holder with a host pool: pool slots copied from its mapped pool, else the NIXL list
        beneath with vLLM's indices (translated when that list holds the KV cache alone)."""
        indices = np.asarray(remote_indices, dtype=np.int64)
        regions, blocks = np.divmod(indices, pool_list.kv_blocks + pool_list.layout.slots)
        in_pool = blocks >= pool_list.kv_blocks
        context = self._context()
        wants_mapped = context is None or context.mapped is not False
        if (
            operation == "READ"
            and pool_list.mapped is not None
            and wants_mapped
            and in_pool.size
            and bool(in_pool.all())
        ):
            return self._post_mapped(
                local_xfer_side,
                local_indices,
                pool_list,
                pool_list.mapped,
                regions,
                blocks - pool_list.kv_blocks,
                notif_msg,
            )
        if pool_list.base_lists_pool:
            beneath = indices
        elif bool(in_pool.any()):
            # One NIXL list holds one memory type: a GPU holder's pool is read only where it is mapped.
            raise RuntimeError(
                "this engine cannot read the holder's host pool: it is not mapped here (another host, or "
                "its file could not be opened) and the holder's KV cache is not host memory"
            )
        else:
            beneath = regions * pool_list.kv_blocks + blocks
        return self.make_prepped_xfer(
            operation, local_xfer_side, local_indices, pool_list.base, beneath, notif_msg, *args, **kwargs
        )

    def _post_mapped(
        self,
        local_xfer_side: Any,
        local_indices: Any,
        pool_list: PoolList,
        mapped: MappedHostPool,
        regions: npt.NDArray[np.int64],
        slots: npt.NDArray[np.int64],
        notif_msg: bytes,
    ) -> MappedRead:
        started = self._clock()
        record = self._record(self._context(), notif_msg, local_indices, True)
        with self._lock:
            local = self._seen.prepped.get(id(local_xfer_side))
        if local is None:
            raise RuntimeError("this engine's descriptor list was prepared out of kvferry's sight")
        local_rows = local[1].rows[np.asarray(local_indices, dtype=np.int64)]
        holder = pool_list.layout.slot_addresses(regions, slots)
        if not np.array_equal(holder[:, 1], local_rows[:, 1]):
            raise RuntimeError("the holder's pool slots and this engine's blocks differ in size")
        sources = mapped.local(holder[:, 0])
        # In address order, regions that interleave on both sides (a layer's K and V halves) join up.
        runs = merge_runs(local_rows[:, 0], sources, local_rows[:, 1])
        if record.digest:
            record.destination_rows = local_rows
            record.memory_type = local[1].memory_type
        record.read = "mapped"
        record.coalesced = True
        record.posted_descriptors = len(runs)
        record.total_bytes = int(local_rows[:, 1].sum())
        record.plan_seconds = self._clock() - started
        handle = MappedRead(record, mapped, runs, pool_list.agent_name, bytes(notif_msg or b""))
        self._track(handle, record)
        return handle

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(handle, MappedRead):
            handle.record.started = self._clock()
            handle.copy = handle.mapped.copier.start(handle.runs)
            return "PROC"
        return self._agent.transfer(handle, *args, **kwargs)

    def check_xfer_state(self, handle: Any) -> Any:
        if not isinstance(handle, MappedRead):
            return self._agent.check_xfer_state(handle)
        if handle.copy is None:
            return "ERR"
        if not handle.copy.done():
            return "PROC"
        if not handle.notified:
            # As a READ's notification: the holder counts the read (vLLM's notice, "<request id>:<readers>").
            handle.notified = True
            try:
                self._agent.send_notif(handle.agent_name, handle.notif_msg)
            except Exception as error:
                self._warn_once("send_notif", "could not notify a holder of a mapped pool read", error)
        return "DONE"

    def warm(self, agent_name: str | bytes, *, timeout_seconds: float = 1.0) -> WarmRead:
        """READs each region's first block from the peer ``agent_name`` into this engine's null block
        (coalesce.first_block_pairs), without a notification, and waits for it.

        A peer's first pull pays once for NIXL's first request to that peer and for UCX opening the
        peer's memory (on an H100 about 50 ms); this moves both off the turn that pulls, and builds the
        planner's views of both lists on the way. Raises ``PlanError`` when the lists do not allow it,
        ``TimeoutError`` or NIXL's error when the READ fails; nothing a request reads is touched.
        """
        started = self._clock()
        with self._lock:
            remote = next(
                (e for e in reversed(self._seen.prepped.values()) if e[1].agent_name == agent_name), None
            )
            locals_ = [e for e in self._seen.prepped.values() if e[1].local]
            registered = list(self._seen.registered)
        if remote is None:
            raise PlanError("no descriptor list of that peer was prepared")
        same_type = [e for e in locals_ if e[1].memory_type == remote[1].memory_type]
        if not same_type:
            raise PlanError(f"no local descriptor list of memory type {remote[1].memory_type!r}")
        local = max(same_type, key=lambda e: len(e[1].rows))
        local_list, remote_list = self._list(local, local=True), self._list(remote)
        local_rows, remote_rows = first_block_pairs(local_list, registered, remote_list)
        local_descs = self._agent.get_xfer_descs(local_rows, local[1].memory_type)
        remote_descs = self._agent.get_xfer_descs(remote_rows, remote[1].memory_type)
        handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, agent_name, b"")
        try:
            posted = self._clock()
            state = self._agent.transfer(handle)
            deadline = posted + timeout_seconds
            while state != "DONE":
                if state == "ERR":
                    raise RuntimeError("NIXL reported the READ failed")
                if self._clock() > deadline:
                    raise TimeoutError(f"the READ was not done after {timeout_seconds} s")
                time.sleep(0.0005)
                state = self._agent.check_xfer_state(handle)
            done = self._clock()
        finally:
            self._agent.release_xfer_handle(handle)
        return WarmRead(
            descriptors=len(local_rows),
            bytes=int(local_rows[:, LENGTH].sum()),
            plan_seconds=posted - started,
            transfer_seconds=done - posted,
        )

    def _why_not(self, local: tuple[Any, _Prepped] | None, remote: tuple[Any, _Prepped] | None) -> str | None:
        if local is None or remote is None:
            return "descriptor lists not seen at preparation"
        if not local[1].local or remote[1].local:
            return "unexpected list roles"
        if not local[1].memory_type or not remote[1].memory_type:
            return "unknown memory type"
        return None

    def _post_coalesced(
        self,
        operation: str,
        local: tuple[Any, _Prepped],
        remote: tuple[Any, _Prepped],
        local_indices: Any,
        remote_indices: Any,
        notif_msg: bytes,
        record: PullRecord,
        started: float,
    ) -> Any | None:
        try:
            plan = plan_pull(self._list(local, local=True), local_indices, self._list(remote), remote_indices)
            local_descs = self._agent.get_xfer_descs(plan.local, local[1].memory_type)
            remote_descs = self._agent.get_xfer_descs(plan.remote, remote[1].memory_type)
            handle = self._agent.initialize_xfer(
                operation, local_descs, remote_descs, remote[1].agent_name, notif_msg
            )
        except PlanError as bad:
            record.fallback_reason = f"plan: {bad}"
            return None
        except Exception as error:  # a NIXL refusal: vLLM's own descriptors still work
            record.fallback_reason = f"nixl: {type(error).__name__}: {error}"
            self._warn_once("initialize_xfer", "coalesced request refused by NIXL; posting vLLM's", error)
            return None
        record.coalesced = True
        record.posted_descriptors = plan.descriptors
        record.total_bytes = plan.total_bytes
        record.plan_seconds = self._clock() - started
        record.started = self._clock()
        self._track(handle, record)
        return handle

    def _list(self, prepped: tuple[Any, _Prepped], *, local: bool = False) -> DescriptorList:
        """The planner's view of a prepared list, built once per handle (columns are cached)."""
        handle, rows = prepped
        with self._lock:
            known = self._seen.lists.get(id(handle))
            if known is None:
                registered = list(self._seen.registered) if local else []
                segments = segments_of(rows.rows, registered) if registered else None
                known = DescriptorList(rows.rows, segments)
                self._seen.lists[id(handle)] = known
        return known

    def _record(
        self, context: PullContext | None, notif_msg: bytes, local_indices: Any, wanted: bool
    ) -> PullRecord:
        notice = bytes(notif_msg or b"").decode("utf-8", errors="replace")
        remote_request_id = notice.rsplit(":", 1)[0] if ":" in notice else notice
        listed = int(np.asarray(local_indices).size)
        runs = None
        if context is not None and context.local_block_ids:
            local_ids = list(context.local_block_ids)
            remote_ids = list(context.remote_block_ids)[-len(local_ids) :]
            if len(remote_ids) == len(local_ids):
                runs = block_runs(local_ids, remote_ids)
        return PullRecord(
            request_id=context.request_id if context else "",
            remote_request_id=remote_request_id,
            coalesced=False,
            listed_descriptors=listed,
            posted_descriptors=listed,
            total_bytes=0,
            runs=runs,
            started=0.0,
            plan_seconds=0.0,
            digest=bool(context and context.digest),
            local_block_ids=tuple(context.local_block_ids) if context is not None else (),
            fallback_reason=None if wanted else "off",
        )

    def _track(self, handle: Any, record: PullRecord) -> None:
        with self._lock:
            self._seen.pulls[id(handle)] = (handle, record)

    # -- completion ---------------------------------------------------------------------------------

    def get_xfer_telemetry(self, handle: Any) -> Any:
        telemetry = (
            self._mapped_telemetry(handle)
            if isinstance(handle, MappedRead)
            else self._agent.get_xfer_telemetry(handle)
        )
        with self._lock:
            entry = self._seen.pulls.pop(id(handle), None)
        if entry is not None:
            self._finish(entry[1], telemetry)
        return telemetry

    def _mapped_telemetry(self, handle: MappedRead) -> Any:
        """What NIXL's telemetry says of a READ (vLLM records it), for a mapped copy."""
        record = handle.record
        return SimpleNamespace(
            # As NIXL times a READ: from the start of posting (here, planning the copies) to done.
            xferDuration=(record.plan_seconds + self._clock() - record.started) * 1e6,
            postDuration=record.plan_seconds * 1e6,
            totalBytes=record.total_bytes,
            descCount=len(handle.runs),
        )

    def release_xfer_handle(self, handle: Any) -> Any:
        with self._lock:
            self._seen.pulls.pop(id(handle), None)
        if isinstance(handle, MappedRead):
            return None
        return self._agent.release_xfer_handle(handle)

    def _finish(self, record: PullRecord, telemetry: Any) -> None:
        record.transfer_seconds = self._clock() - record.started
        if telemetry is not None:
            record.nixl_descriptors = int(getattr(telemetry, "descCount", 0) or 0) or None
            telemetry_bytes = int(getattr(telemetry, "totalBytes", 0) or 0)
            if telemetry_bytes:
                record.total_bytes = telemetry_bytes
            post_us = float(getattr(telemetry, "postDuration", 0) or 0)
            xfer_us = float(getattr(telemetry, "xferDuration", 0) or 0)
            if post_us or xfer_us:
                # NIXL times the transfer from the start of posting to the status check that saw
                # it done (so it includes posting); the post itself is reported apart.
                record.nixl_post_seconds = post_us / 1e6
                record.nixl_transfer_seconds = max(xfer_us, post_us) / 1e6
        if record.digest and record.destination_rows is not None:
            record.received_digest = digest_rows(record.destination_rows, record.memory_type)
        record.destination_rows = None
        with self._lock:
            c = self.counters
            c.pulls += 1
            c.coalesced_pulls += int(record.coalesced)
            c.fallbacks += int(bool(record.fallback_reason) and record.fallback_reason != "off")
            c.listed_descriptors += record.listed_descriptors
            c.posted_descriptors += record.posted_descriptors
            c.nixl_descriptors += record.nixl_descriptors or 0
            c.bytes += record.total_bytes
            c.transfer_seconds += record.transfer_seconds
        # Its line is made on the logging thread after vLLM's next poll that finishes no pull: made or
        # formatted now, it would hold the GIL (there or here) while this pull's fence posts its read.
        log_off_path(logger, logging.INFO, "kv pull", partial(self._line, record, time.time()))
        if self._on_pull is not None:
            self._on_pull(record)

    def _line(self, record: PullRecord, unix_time: float) -> tuple[float, dict[str, Any]]:
        return unix_time, {"reader_role": self.reader_role, **record.fields()}

    def _warn_once(self, key: str, message: str, error: BaseException) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        logger.warning(message, extra={"error": f"{type(error).__name__}: {error}"})


def digest_rows(rows: npt.NDArray[np.uint64], memory_type: str) -> str | None:
    """SHA-256 of the bytes the descriptor rows point at, in row order (host memory only)."""
    if memory_type.upper() != "DRAM":
        return None
    sha = hashlib.sha256()
    for address, length, _device in rows.tolist():
        sha.update(ctypes.string_at(int(address), int(length)))
    return sha.hexdigest()


def _rows_of(descs: Any) -> npt.NDArray[np.uint64] | None:
    """Nx3 rows from what vLLM hands NIXL (numpy array or list of 3-tuples); None otherwise."""
    try:
        if isinstance(descs, np.ndarray):
            rows = descs
        elif isinstance(descs, list | tuple) and descs and isinstance(descs[0], tuple | list):
            if len(descs[0]) != 3:
                return None
            rows = np.asarray(descs, dtype=np.uint64)
        else:
            return None
    except (TypeError, ValueError):
        return None
    if rows.ndim != 2 or rows.shape[1] != 3:
        return None
    return np.ascontiguousarray(rows, dtype=np.uint64)


def _ranges_of(descs: Any) -> list[tuple[int, int]] | None:
    """(start, length) of each range in a registration list (tuples or Nx3 array)."""
    try:
        if isinstance(descs, np.ndarray) and descs.ndim == 2 and descs.shape[1] >= 2:
            return [(int(a), int(n)) for a, n in descs[:, :2].tolist()]
        if isinstance(descs, list | tuple) and descs and isinstance(descs[0], tuple | list):
            return [(int(d[0]), int(d[1])) for d in descs]
    except (TypeError, ValueError, IndexError):
        return None
    return None
