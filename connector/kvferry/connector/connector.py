"""``KvferryConnector``: vLLM's NixlConnector (pull mode, bidirectional) with lease-governed retention.

Load it with ``--kv-transfer-config``::

    {"kv_connector": "KvferryConnector",
     "kv_connector_module_path": "kvferry.connector.connector",
     "kv_role": "kv_consumer",            # decode engine ("kv_producer" for prefill)
     "engine_id": "decode-0", "kv_buffer_device": "cpu",
     "kv_connector_extra_config": {"bidirectional_kv_xfer": true,
                                   "kvferry": {"sidecar_address": "127.0.0.1:50061"}}}

vLLM's role split is kept: :class:`KvferryScheduler` runs in the engine core (scheduler) process,
:class:`KvferryWorker` in the worker process, and :class:`KvferryConnectorMetadata` (vLLM's
metadata plus the retained-request ids and per-request pull options) is the only thing passed
between them. What kvferry changes:

- decode engine: a finished request marked with kvferry's mark keeps its blocks, held by the
  connector through the block pool (the request itself finishes normally, so an engine holding
  retentions idles like any idle engine), until the registry has confirmed the retention ended,
  plus a grace period, or the hard cap (kvferry.connector.retention). A prefill reading them frees
  nothing. Every free goes through ``_free_due`` and is logged as ``freed retained blocks``.
- prefill engine: declines a pull whose read window is too near its end as it schedules it, fails
  one whose window closed before the READ is posted (kvferry.connector.read_deadlines), and counts
  pulled versus computed tokens.
- pull-time fencing (``fence_pulls``): every block has a generation, bumped when a retained block
  goes back to vLLM's pool (kvferry.connector.generations); a retention publishes its blocks'
  generations, and a prefill that pulled them reads them again from the holder after the data
  arrived, reporting the pull failed (vLLM recomputes) on any difference (kvferry.connector.fence).
- both: report to the local sidecar (retentions, evictions, engine stats) from a background
  thread; NIXL's progress thread sleeps between polls instead of spinning; vLLM's READs (D->P
  and P->D pulls) are posted as the fewest, largest descriptors the block ids and KV layout
  allow (``coalesce_pulls``, kvferry.connector.nixl_pulls), each pull logged as ``kv pull``.
- prefill engine: a request naming the engine it will pull from next (``kvferry_peer``: the turn's decode
  engine) starts the NIXL handshake with that engine on vLLM's handshake thread, so the next turn's
  pull does not wait for it.

Unmarked requests behave exactly as with vLLM's NixlConnector.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from kvferry.connector import vllm_internals
from kvferry.connector.accounting import Accounting, StatsSnapshot
from kvferry.connector.compat import KvLayout, kv_compatibility_hash
from kvferry.connector.copies import ByteCopier, CopyDone, copier_for
from kvferry.connector.fence import PulledBlocks, PullFence
from kvferry.connector.generations import (
    DEMOTE_FAILED,
    DEMOTED,
    FENCED_PULLS,
    GenerationArray,
    GenerationBook,
    GenerationError,
    GenerationFile,
)
from kvferry.connector.host_tier import (
    HOST_REQUEST_SUFFIX,
    Demotion,
    Demotions,
    HostPool,
    HostPoolLayout,
    HostTierError,
    MappedHostPool,
    SlotAllocator,
    due_demotions,
    extend_remote_rows,
    next_demotion_at,
)
from kvferry.connector.keeper import RetentionKeeper
from kvferry.connector.logs import (
    BUMPED_LOG,
    COPIED_LOG,
    EVICTED_LOG,
    FREED_LOG,
    HANDSHAKE_AHEAD_LOG,
    MOVED_LOG,
    PEER_WARMED_LOG,
    POOL_FULL_LOG,
    READY_LOG,
    RETAINED_LOG,
    hand_over_held,
    setup_logging,
)
from kvferry.connector.nixl_pulls import PoolList, PullCoalescer, PullContext, PullRecord
from kvferry.connector.peers import WARM_GIVE_UP_SECONDS, WarmSteps
from kvferry.connector.read_deadlines import pull_allowed, read_deadline, read_may_start
from kvferry.connector.retention import Clock, RetainedEntry, RetentionTable, SystemClock, Tier
from kvferry.connector.settings import KvferrySettings, SettingsError, parse_settings
from kvferry.connector.sidecar_link import BackgroundLoop, DueTimer, SidecarLink
from kvferry.pd import vllm_params
from kvferry.pd.digest import block_digests
from kvferry.pd.kvferry_params import (
    GENERATIONS_KEY,
    KVFERRY_PARAMS_VERSION,
    BlockGenerations,
    ConversationMark,
    Mark,
    PeerAddress,
    PullOptions,
    ReleaseMark,
    parse_mark,
    tier_from_params,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlConnectorMetadata,
    NixlPullConnector,
    NixlPullConnectorScheduler,
    NixlPullConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvferry.connector")

# Released ids stay known to the worker this long, so late read notices are still recognised.
_FORGET_AFTER_SECONDS = 600.0
# A pool without room for a due move is asked again after this long (or as soon as slots come back).
_NO_ROOM_RETRY_SECONDS = 5.0
# How often a busy engine looks at its free blocks and idle retentions (each step would be wasteful).
_PRESSURE_CHECK_SECONDS = 0.25
# Per-request pull options the worker keeps at most (a request whose pull never starts is dropped).
_MAX_PULL_OPTIONS = 1024
# A peer's tensor-parallel size in a handshake ahead: the size routers' pulls name (RemoteBlocks.tp_size).
_PEER_TP_SIZE = 1


def engine_layout(vllm_config: VllmConfig) -> KvLayout:
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    served = model.served_model_name
    return KvLayout(
        model=str(served[0] if isinstance(served, list) else served),
        dtype=str(model.dtype),
        kv_cache_dtype=str(cache.cache_dtype),
        block_size=int(cache.block_size),
        num_layers=int(model.get_total_num_hidden_layers()),
        num_kv_heads=int(model.get_total_num_kv_heads()),
        head_size=int(model.get_head_size()),
    )


class KvferryConnectorMetadata(NixlConnectorMetadata):  # type: ignore[misc]
    """vLLM's NIXL metadata plus which requests kvferry retains, per-request pull options, the read
    deadlines of pulls and the generations each pull of a retention must find (scheduler -> worker)."""

    def __init__(self) -> None:
        super().__init__()
        self.retained_added: list[str] = []
        self.retained_released: list[str] = []
        self.pull_options: dict[str, PullOptions] = {}
        # Monotonic deadlines (one host: the engine core and its workers share CLOCK_MONOTONIC).
        self.read_deadlines: dict[str, float] = {}
        self.pull_generations: dict[str, tuple[int, ...]] = {}
        # Host-tier demotions for the worker to copy (kvferry.connector.host_tier).
        self.demotions: list[Demotion] = []
        # Engines to handshake with ahead of pulls (kvferry_params.PeerAddress), and whether the workers
        # then warm their reads from them (the scheduler knows block 0 is vLLM's null block).
        self.peers: list[PeerAddress] = []
        self.warm_peers = False

    @classmethod
    def extend(
        cls,
        base: NixlConnectorMetadata,
        added: list[str],
        released: list[str],
        pull_options: dict[str, PullOptions] | None = None,
        read_deadlines: dict[str, float] | None = None,
        pull_generations: dict[str, tuple[int, ...]] | None = None,
        demotions: list[Demotion] | None = None,
        peers: list[PeerAddress] | None = None,
        warm_peers: bool = False,
    ) -> KvferryConnectorMetadata:
        meta = cls()
        meta.__dict__.update(base.__dict__)
        meta.retained_added = added
        meta.retained_released = released
        meta.pull_options = pull_options or {}
        meta.read_deadlines = read_deadlines or {}
        meta.pull_generations = pull_generations or {}
        meta.demotions = demotions or []
        meta.peers = peers or []
        meta.warm_peers = warm_peers
        return meta


@dataclass
class KvferryHandshakePayload(NixlHandshakePayload):  # type: ignore[misc]
    """vLLM's handshake payload plus where the worker's block generations are (kvferry's fence).

    The worker hands it to its scheduler (which maps the generations to bump them) and the scheduler
    serves it on vLLM's side channel; vLLM's decoder ignores the extra field, kvferry's prefill workers
    read it (vllm_internals.fetch_handshake_payload)."""

    kvferry_generations: GenerationArray | None = None
    # The holder's host pool (kvferry.connector.host_tier); None: it has none.
    kvferry_host_pool: HostPoolLayout | None = None


class KvferryScheduler(NixlPullConnectorScheduler):  # type: ignore[misc]
    """Scheduler half: retention table, block holds, accounting, sidecar link."""

    # Read deadlines are measured on it (tests skew it).
    clock: Clock = SystemClock()

    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig,
        settings: KvferrySettings,
        compat_hash: str,
    ) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.settings = settings
        self.compat_hash = compat_hash
        self.kv_role = str(vllm_config.kv_transfer_config.kv_role) if vllm_config.kv_transfer_config else ""
        num_blocks = int(kv_cache_config.num_blocks)
        self.table = RetentionTable(
            max_retention_seconds=settings.max_retention_seconds,
            grace_seconds=settings.release_grace_seconds,
            budget_blocks=int(num_blocks * settings.retained_kv_fraction),
        )
        self.accounting = Accounting(
            kv_bytes_per_token=vllm_internals.kv_bytes_per_token(kv_cache_config, self.block_size)
        )
        self._block_pool: Any = None
        self._held: dict[str, list[Any]] = {}
        self._worker_added: list[str] = []
        self._worker_released: list[str] = []
        self._pull_options: dict[str, PullOptions] = {}
        self._read_deadlines: dict[str, float] = {}
        self._pull_generations: dict[str, tuple[int, ...]] = {}
        # Peers named since the last step (by engine id), for the workers to handshake with.
        self._peers: dict[str, PeerAddress] = {}
        # Idle steps for the workers to warm their reads from newly named peers (kvferry.connector.peers).
        self._warm_steps = WarmSteps()
        # Workers may warm into block 0 once vLLM's block pool shows it is the null block (bind_block_pool).
        self._warm_peers = False
        # Pulls of a retention under way (prefill side), until vLLM reports them received or failed.
        self._pulls: dict[str, Request] = {}
        # The host tier: pool slots are block ids num_blocks + slot (kvferry.connector.host_tier).
        self.kv_blocks = num_blocks
        self.demotions = (
            Demotions(SlotAllocator(settings.host_pool_blocks)) if settings.host_pool_blocks else None
        )
        self._host_slots: dict[str, tuple[int, ...]] = {}
        self._next_pressure_check = 0.0
        # Generations of this engine's blocks (and pool slots); mapped to the workers' files once they hand
        # them over (set_xfer_handshake_metadata), before any request runs.
        self.generations = GenerationBook(
            num_blocks + settings.host_pool_blocks, on_bump=self._generations_bumped
        )
        self._freeing: str | None = None
        self._waker = vllm_internals.EngineWaker(vllm_internals.find_engine_core_input_queue())
        self._loop = BackgroundLoop("kvferry-connector")
        self._timer = DueTimer(self._loop, self._next_due, self._waker.wake)
        self._link: SidecarLink | None = None
        self.keeper = RetentionKeeper(
            self.table,
            engine_id=engine_id,
            lease_ttl_seconds=settings.lease_ttl_seconds,
            on_change=self._registry_word_changed,
        )
        if settings.sidecar_address:
            self._link = SidecarLink(
                loop=self._loop,
                address=settings.sidecar_address,
                engine_id=engine_id,
                listener=self.keeper,
                stats=self._stats,
                timeout_seconds=settings.sidecar_timeout_seconds,
                stats_interval_seconds=settings.stats_interval_seconds,
                release_grace_seconds=settings.release_grace_seconds,
            )
            self._link.start()
        else:
            logger.warning(
                "no sidecar configured (kvferry.sidecar_address); retentions are held until the hard cap",
                extra={"engine_id": engine_id, "max_retention_seconds": settings.max_retention_seconds},
            )
        self._timer.start()
        self._loop.start()
        logger.info(
            READY_LOG,
            extra={
                "engine_id": engine_id,
                "kv_role": self.kv_role,
                "kv_blocks": num_blocks,
                "retained_block_budget": self.table.budget_blocks,
                "host_pool_blocks": settings.host_pool_blocks,
                "kv_compatibility_hash": compat_hash,
                "can_wake_engine": self._waker.available,
                "kvferry_params_version": KVFERRY_PARAMS_VERSION,
            },
        )

    def bind_block_pool(self, block_pool: Any) -> None:
        self._block_pool = block_pool
        self._warm_peers = vllm_internals.null_block_id(block_pool) == 0
        vllm_internals.watch_frees(block_pool, self.generations.on_freed)

    def set_xfer_handshake_metadata(self, metadata: dict[tuple[int, int], Any]) -> None:
        """vLLM hands over its workers' handshake payloads (then serves them to peers): kvferry's carry
        each worker's generation file, which this scheduler maps to bump generations itself."""
        super().set_xfer_handshake_metadata(metadata)
        if not self.settings.fence_pulls:
            return
        arrays = [
            payload.kvferry_generations if isinstance(payload, KvferryHandshakePayload) else None
            for payload in metadata.values()
        ]
        if not arrays or any(array is None for array in arrays):
            raise GenerationError(
                "a worker handed over no generation array although kvferry.fence_pulls is on "
                f"({sum(a is not None for a in arrays)} of {len(arrays)} ranks did)"
            )
        self.generations.attach([GenerationFile.attach(array) for array in arrays if array is not None])
        logger.info(
            "pull fencing on",
            extra={
                "engine_id": self.engine_id,
                "worker_files": len(arrays),
                "generation_base": self.generations.base,
            },
        )

    # -- prefill side -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and vllm_params.wants_remote_decode(params) and vllm_params.names_remote_blocks(params):
            self._check_read_window(request, params)
        if params and vllm_params.names_remote_blocks(params):
            if (problem := _generations_problem(params)) is not None:
                self._decline(
                    request, params, "declined a pull: unusable generations, recomputing", problem=problem
                )
        count, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if count > 0 and params and params.get(vllm_params.DO_REMOTE_PREFILL):
            count = self._loadable_from_prefill(params, num_computed_tokens, count)
            if count == 0:
                is_async = False
        self.accounting.on_matched(request.request_id, request.num_prompt_tokens, num_computed_tokens)
        return count, is_async

    def _loadable_from_prefill(self, params: dict[str, Any], num_computed_tokens: int, count: int) -> int:
        """D side: at most the tokens P computed. A decode whose prompt goes on past them (P's token, shown to
        the client first, then appended: kvferry.pd.sequence) loads those and computes the rest itself; vLLM
        alone would load the whole prompt, and one more block than P has when P's token starts a block."""
        prefilled = vllm_params.remote_num_tokens(params)
        if not prefilled:
            # A P that does not say: what its blocks can hold.
            groups = vllm_params.block_id_groups(params)
            prefilled = len(groups[0]) * self.block_size if groups else 0
        return max(0, min(count, prefilled - num_computed_tokens))

    def _check_read_window(self, request: Request, params: dict[str, Any]) -> None:
        """Declines the pull (P recomputes) when its read window has less than ``min_read_seconds`` left;
        otherwise keeps its deadline for the worker, which checks it again as it posts the READ."""
        now = self.clock.monotonic()
        try:
            deadline = read_deadline(params, float(request.arrival_time), self.clock)
        except ValueError as bad:
            self._decline(
                request, params, "declined a pull: malformed read window, recomputing", error=str(bad)
            )
            return
        if not pull_allowed(deadline, now, self.settings.min_read_seconds):
            assert deadline is not None
            self._decline(
                request,
                params,
                "declined a pull: read deadline too near, recomputing",
                seconds_left=round(deadline - now, 3),
            )
        elif deadline is not None:
            self._read_deadlines[request.request_id] = deadline

    def _decline(self, request: Request, params: dict[str, Any], message: str, **fields: Any) -> None:
        vllm_params.strip_remote_blocks(params)
        self._read_deadlines.pop(request.request_id, None)
        params.pop(GENERATIONS_KEY, None)
        self.accounting.on_declined()
        logger.info(message, extra={"request_id": request.request_id, **fields})

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        try:
            options = PullOptions.from_params(request.kv_transfer_params)
        except ValueError as bad:
            logger.warning(
                "ignoring malformed pull options", extra={"request_id": request.request_id, "error": str(bad)}
            )
            options = None
        coalesce = (
            self.settings.coalesce_pulls if options is None or options.coalesce is None else options.coalesce
        )
        if coalesce:
            # Before vLLM reads the block ids: vLLM's free queue hands recently freed blocks out in
            # reverse, so a prompt's blocks (which another engine may pull later) and the blocks a
            # pull fills are sorted into ascending runs, which coalesce with each other. Once a pull
            # is done vLLM admits the request again, its received blocks first in the list: those
            # (the computed tokens' blocks) keep their places.
            filled_blocks = -(-request.num_computed_tokens // self.block_size)
            vllm_internals.order_new_blocks(blocks, filled_blocks=filled_blocks)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        peer = (request.kv_transfer_params or {}).get(vllm_params.REMOTE_ENGINE_ID)
        self.accounting.on_allocated(
            request.request_id,
            num_external_tokens,
            time.monotonic(),
            peer if isinstance(peer, str) else "",
            self._pull_tier(request),
        )
        if options is not None:
            self._pull_options[request.request_id] = options
        self._note_peer(request)
        params = request.kv_transfer_params
        if num_external_tokens > 0 and vllm_params.wants_remote_decode(params):
            self._pulls[request.request_id] = request
            # Checked when matched: get_num_new_matched_tokens declines a pull with unusable ones.
            generations = BlockGenerations.from_params(params)
            if generations is not None:
                self._pull_generations[request.request_id] = generations.values

    def _note_peer(self, request: Request) -> None:
        """Passes the engine a request says this one will pull from next to the workers (next step)."""
        try:
            peer = PeerAddress.from_params(request.kv_transfer_params)
        except ValueError as bad:
            logger.warning(
                "ignoring a malformed peer", extra={"request_id": request.request_id, "error": str(bad)}
            )
            return
        if peer is not None and peer.engine_id != self.engine_id:
            self._peers[peer.engine_id] = peer
            if self._warm_peers and self._warm_steps.named(peer.engine_id, time.monotonic()):
                self._timer.poke()

    @staticmethod
    def _pull_tier(request: Request) -> Tier:
        """Which of the holder's tiers a pull reads, for its rate (a malformed value: the KV cache; the
        pull itself does not depend on it)."""
        try:
            return Tier(tier_from_params(request.kv_transfer_params))
        except ValueError as bad:
            logger.warning(
                "ignoring a malformed pull tier", extra={"request_id": request.request_id, "error": str(bad)}
            )
            return Tier.DEVICE

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        failed = getattr(connector_output, "failed_recving", None) or set()  # absent before vLLM 0.32
        now = time.monotonic()
        measured = False
        for request_id in connector_output.finished_recving or ():
            measured |= self.accounting.on_received(request_id, now, failed=request_id in failed)
            request = self._pulls.pop(request_id, None)
            if request is not None and request_id in failed:
                # Fenced, or the transfer failed: vLLM recomputes (kv_load_failure_policy "recompute").
                vllm_internals.compute_after_failed_pull(request)
                logger.info("pull failed; computing the prompt instead", extra={"request_id": request_id})
        if measured and self._link is not None:
            self._link.rates_measured()
        if self.demotions is not None and self.demotions.in_flight:
            self._finish_demotions()

    # -- decode side: retention -------------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        mark = self._mark(request)
        self._pull_options.pop(request.request_id, None)
        self._read_deadlines.pop(request.request_id, None)
        self._pull_generations.pop(request.request_id, None)
        self._pulls.pop(request.request_id, None)
        delay_free, params = super().request_finished(request, block_ids)
        if self.accounting.on_finished(request.request_id, time.monotonic()) and self._link is not None:
            self._link.rates_measured()
        if isinstance(mark, ReleaseMark):
            return self._release_at_finish(request, delay_free, params)
        if (
            mark is None
            or not delay_free
            or params is None
            or not vllm_params.wants_remote_decode(params)
            or self._block_pool is None
        ):
            return delay_free, params
        groups = vllm_params.block_id_groups(params)
        if len(groups) != 1:
            logger.warning(
                "not retaining: more than one KV-cache group (hybrid models are not supported)",
                extra={"request_id": request.request_id, "groups": len(groups)},
            )
            return delay_free, params
        entry = self._retain(request, mark, list(groups[0]), vllm_params.remote_num_tokens(params))
        # vLLM's own readers compare this with their clock offset to us (perf_counter domain).
        vllm_params.set_blocks_expiry_time(
            params, time.perf_counter() + (entry.free_at(self.table.max_retention_seconds) - time.monotonic())
        )
        if entry.block_generations:
            # As the registry record has them: a client pulling straight from this answer can be fenced too.
            params.update(BlockGenerations(entry.block_generations).to_params())
        return False, params

    def _release_at_finish(
        self, request: Request, delay_free: bool, params: dict[str, Any] | None
    ) -> tuple[bool, dict[str, Any] | None]:
        """A decode nothing will reuse: its blocks go back to the pool now, not after vLLM's
        decoder_kv_blocks_ttl (during which the engine would keep stepping)."""
        if not delay_free or params is None or not vllm_params.wants_remote_decode(params):
            return delay_free, params
        vllm_internals.take_out_of_send_queue(self, request.request_id)
        logger.info("released at finish", extra={"request_id": request.request_id})
        return False, None

    def _mark(self, request: Request) -> Mark | None:
        try:
            return parse_mark(request.kv_transfer_params)
        except ValueError as bad:
            logger.warning(
                "ignoring a malformed kvferry mark",
                extra={"request_id": request.request_id, "error": str(bad)},
            )
            return None

    def _retain(
        self, request: Request, mark: ConversationMark, block_ids: list[int], num_tokens: int
    ) -> RetainedEntry:
        request_id = request.request_id
        vllm_internals.take_out_of_send_queue(self, request_id)
        tokens = list(request.all_token_ids[:num_tokens])
        digests = block_digests(tokens, self.block_size, salt=self.compat_hash)
        self._held[request_id] = vllm_internals.hold_blocks(self._block_pool, block_ids)
        # Bumped when the blocks go back to the pool (GenerationBook.on_freed).
        generations = self.generations.publish(block_ids) if self.generations.enabled else []
        entry, superseded = self.table.add(
            request_id=request_id,
            tenant=mark.tenant,
            conversation_id=mark.conversation_id,
            turn=mark.turn,
            block_ids=block_ids,
            num_tokens=num_tokens,
            block_digests=digests,
            block_generations=generations,
        )
        self._worker_added.append(request_id)
        self._demote_due()
        for evicted in self.table.evict_over_budget(leaving=self._leaving()):
            logger.info(
                EVICTED_LOG,
                extra={"request_id": evicted.request_id, "conversation_id": evicted.conversation_id},
            )
        if self._link is not None:
            self._link.poke()
        self.accounting.set_retained_blocks(self.table.held_blocks(Tier.DEVICE))
        self._timer.poke()
        logger.info(
            RETAINED_LOG,
            extra={
                "request_id": request_id,
                "tenant": mark.tenant,
                "conversation_id": mark.conversation_id,
                "turn": mark.turn,
                "blocks": len(block_ids),
                "num_tokens": num_tokens,
                "superseded": [e.request_id for e in superseded],
            },
        )
        return entry

    def build_connector_meta(self, scheduler_output: Any) -> KvferryConnectorMetadata:
        base = super().build_connector_meta(scheduler_output)
        assert isinstance(base, NixlConnectorMetadata)
        self._free_due()
        # This step serves the warm steps due by now (a request's step as well as an idle one).
        self._warm_steps.stepped(time.monotonic())
        if self.demotions is not None and time.monotonic() >= self._next_pressure_check:
            # While requests run the engine never asks has_pending_push_work: the watermark is checked here.
            self._next_pressure_check = time.monotonic() + _PRESSURE_CHECK_SECONDS
            self._finish_demotions()
            self._demote_due()
        # Options, read deadlines and generations travel with the step that asks the worker to pull
        # (reqs_to_recv).
        options = {r: self._pull_options.pop(r) for r in base.reqs_to_recv if r in self._pull_options}
        deadlines = {r: self._read_deadlines.pop(r) for r in base.reqs_to_recv if r in self._read_deadlines}
        generations = {
            r: self._pull_generations.pop(r) for r in base.reqs_to_recv if r in self._pull_generations
        }
        meta = KvferryConnectorMetadata.extend(
            base,
            self._worker_added,
            self._worker_released,
            options,
            read_deadlines=deadlines,
            pull_generations=generations,
            demotions=self._demotions_for(scheduler_output),
            peers=list(self._peers.values()),
            warm_peers=self._warm_peers,
        )
        self._peers.clear()
        self._worker_added, self._worker_released = [], []
        return meta

    def _free_due(self) -> None:
        """The one path by which retained blocks go back to vLLM (the engine core's thread)."""
        due = self.keeper.collect_frees()
        if not due:
            return
        unconfirmed = [entry for entry in due if not entry.confirmed]
        if unconfirmed:
            self._before_unconfirmed_free(unconfirmed)
        for entry in due:
            self._free(entry)
        self.accounting.set_retained_blocks(self.table.held_blocks(Tier.DEVICE))

    def _before_unconfirmed_free(self, entries: list[RetainedEntry]) -> None:
        """Blocks about to be freed without the registry's confirmation (it stayed unreachable past
        the hard cap), so the registry may still hand them out. What makes them unpullable is pull-time
        fencing: each block's generation is bumped as it returns to vLLM's pool, inside the free that
        follows and before vLLM can hand it to another request (GenerationBook.on_freed); a prefill
        that pulls it under the published generation then recomputes. A block another request still
        holds (prefix caching) keeps its bytes, and its generation, until that one lets it go too."""
        logger.warning(
            "freeing retained blocks the registry never confirmed ended (hard cap)",
            extra={
                "request_ids": [e.request_id for e in entries],
                "unconfirmed_frees_total": self.table.unconfirmed_frees,
                # False: pull fencing is off on this engine, nothing stops a pull of these blocks.
                "fenced": self.generations.enabled,
            },
        )

    def _free(self, entry: RetainedEntry) -> None:
        blocks = self._held.pop(entry.request_id, [])
        slots = self._host_slots.pop(entry.request_id, ())
        self._freeing = entry.request_id  # names the free in the "generations bumped" line
        try:
            if self._block_pool is not None and blocks:
                vllm_internals.release_blocks(self._block_pool, blocks)
            if slots and self.demotions is not None:
                # Bumped before the slots can take another retention's blocks.
                self.generations.bump(self.kv_blocks + slot for slot in slots)
                self.demotions.allocator.free(slots)
                self.demotions.no_room_until = 0.0
        finally:
            self._freeing = None
        self._worker_released.append(entry.request_id)
        logger.info(
            FREED_LOG,
            extra={
                "request_id": entry.request_id,
                "tenant": entry.tenant,
                "conversation_id": entry.conversation_id,
                "turn": entry.turn,
                "block_ids": list(entry.block_ids),
                "blocks": len(blocks) + len(slots),
                "tier": entry.tier.value,
                "reason": entry.end_reason.value if entry.end_reason else None,
                # False: freed at the hard cap without the registry confirming the end.
                "confirmed": entry.confirmed,
                "end_revision": entry.end_revision,
                **self._generation_fields(entry),
            },
        )

    def _generation_fields(self, entry: RetainedEntry) -> dict[str, Any]:
        """The free line's generations: as the record published them, and right after the free (a block
        another request still holds keeps its generation; its bytes stay as published)."""
        if not entry.block_generations:
            return {}
        return {
            "generations": list(entry.block_generations),
            "generations_after": self.generations.current(entry.block_ids),
            "unix_time": time.time(),
        }

    def _generations_bumped(self, block_ids: list[int], generations: list[int]) -> None:
        # The oracle line: from now on a pull of these blocks under an older generation is fenced.
        logger.info(
            BUMPED_LOG,
            extra={
                "request_id": self._freeing,
                "block_ids": block_ids,
                "generations": generations,
                "unix_time": time.time(),
            },
        )

    def has_pending_push_work(self) -> bool:
        # The engine core asks this (through Scheduler.has_requests) on its own thread each time
        # it looks for work, also right after the connector's timer woke it: due blocks are
        # freed here, so an idle engine frees on time without taking a step (a step would make
        # vLLM's worker spin ~1 s afterwards). The worker learns of it with the next real step;
        # until then it keeps treating the request as retained, which is the safe side.
        if self.table.has_due():
            self._free_due()
        if self.demotions is not None:
            # A demotion's copy needs a step (without tokens, on an idle engine): the worker copies as
            # the step starts.
            self._finish_demotions()
            self._demote_due()
            if self.demotions.unsent:
                return True
        if self._warm_steps.due(time.monotonic()):
            # An idle step for the workers to warm their reads from a new peer (kvferry.connector.peers).
            return True
        return bool(super().has_pending_push_work())

    # -- decode side: the host tier (kvferry.connector.host_tier) ------------------------------------

    def _demotions_for(self, scheduler_output: Any) -> list[Demotion]:
        """The copies a step takes: every waiting one on an idle step, at most ``demote_blocks_per_step``
        blocks on a step that runs requests (the worker copies before the step's forward pass)."""
        if self.demotions is None or not self.demotions.unsent:
            return []
        busy = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0) > 0
        return self.demotions.take_unsent(self.settings.demote_blocks_per_step if busy else None)

    def _leaving(self) -> set[str]:
        """Retentions ordered to the host tier, not there yet: the KV-cache budget no longer counts them."""
        demotions = self.demotions
        if demotions is None:
            return set()
        return {d.request_id for d in (*demotions.unsent, *demotions.in_flight.values())}

    def _demote_due(self) -> None:
        """Orders the moves due: retentions idle ``demote_after_seconds`` since their turn finished, the
        least recently used ones over the KV cache's budget, and while the engine's free blocks are under
        ``demote_below_free_fraction``, the least recently used ones until they would not be. Only
        retentions the registry acknowledged move (a relocation replaces a published record), each once."""
        demotions = self.demotions
        if demotions is None or demotions.stopped:
            return
        now = time.monotonic()
        if now < demotions.no_room_until:
            return
        leaving = self._leaving()
        live = self.table.live_entries(Tier.DEVICE, leaving=leaving)
        due = due_demotions(
            live,
            now=now,
            demote_after_seconds=self.settings.demote_after_seconds,
            budget_blocks=self.table.budget_blocks,
            movable=self._movable,
            shortfall_blocks=self._free_block_shortfall(leaving),
        )
        for entry in due:
            if demotions.order(entry.request_id, entry.block_ids) is None:
                # Tried again once slots come back (a free), or a while later.
                demotions.no_room_until = now + _NO_ROOM_RETRY_SECONDS
                self._make_room(len(entry.block_ids))
                return

    def _free_block_shortfall(self, leaving: set[str]) -> int:
        """Blocks missing from vLLM's free queue under the watermark, less those already on their way out."""
        fraction = self.settings.demote_below_free_fraction
        if not fraction or self._block_pool is None:
            return 0
        free = vllm_internals.free_block_count(self._block_pool)
        coming = sum(len(e.block_ids) for e in (self.table.get(r) for r in leaving) if e is not None)
        return max(0, int(fraction * self.kv_blocks) - free - coming)

    def _movable(self, entry: RetainedEntry) -> bool:
        """Acknowledged by the registry (a relocation replaces a published record), held by this
        connector, and never ordered to the pool before (a refused move is not tried again)."""
        demotions = self.demotions
        return (
            demotions is not None
            and entry.published
            and entry.request_id in self._held
            and entry.request_id not in demotions.ordered
        )

    def _make_room(self, blocks: int) -> None:
        """The pool is full: evicts its least recently used retentions (slots come back once the registry
        confirmed their end, plus grace) until enough will be free."""
        assert self.demotions is not None
        coming = self.demotions.allocator.free_count + sum(
            len(e.block_ids)
            for e in (self.table.get(r) for r in self._host_slots)
            if e is not None and not e.live
        )
        for entry in self.table.live_entries(Tier.HOST):
            if coming >= blocks:
                break
            if self.table.evict(entry.request_id):
                coming += len(entry.block_ids)
                logger.info(
                    POOL_FULL_LOG,
                    extra={"request_id": entry.request_id, "conversation_id": entry.conversation_id},
                )
        if self._link is not None:
            self._link.poke()

    def _finish_demotions(self) -> None:
        """Retains what the workers copied into the pool as relocations of the KV-cache retentions; their
        publish supersedes those, whose blocks go back to vLLM a grace after it is accepted."""
        assert self.demotions is not None
        # Any worker's failed copy stops the moves; the done counter never passes it (KvferryWorker._failed).
        failed = self.generations.counter(DEMOTE_FAILED)
        done = self.demotions.completed(self.generations.counter_min(DEMOTED))
        for demotion in done:
            entry = self.table.get(demotion.request_id)
            if entry is None or not entry.live:
                # Ended while it was copied: the slots were never published.
                self.demotions.allocator.free(demotion.slots)
                continue
            block_ids = [self.kv_blocks + slot for slot in demotion.slots]
            host_id = demotion.request_id + HOST_REQUEST_SUFFIX
            self._host_slots[host_id] = demotion.slots
            self.table.add(
                request_id=host_id,
                tenant=entry.tenant,
                conversation_id=entry.conversation_id,
                turn=entry.turn,
                block_ids=block_ids,
                num_tokens=entry.num_tokens,
                block_digests=entry.block_digests,
                block_generations=self.generations.publish(block_ids),
                tier=Tier.HOST,
                relocates=entry.request_id,
            )
            self._worker_added.append(host_id)
            logger.info(
                MOVED_LOG,
                extra={
                    "request_id": host_id,
                    "relocates": entry.request_id,
                    "conversation_id": entry.conversation_id,
                    "turn": entry.turn,
                    "blocks": len(block_ids),
                    "slots": [demotion.slots[0], demotion.slots[-1]] if demotion.slots else [],
                },
            )
        if failed and not self.demotions.stopped:
            self._stop_demotions(failed)
        if done:
            self.accounting.set_retained_blocks(self.table.held_blocks(Tier.DEVICE))
            if self._link is not None:
                self._link.poke()
            self._timer.poke()

    def _stop_demotions(self, failed_sequence: int) -> None:
        """A worker failed a copy into the pool (its log says why): the orders not counted done are cancelled,
        their slots freed, and no retention moves from now on; those ordered stay in the KV cache."""
        assert self.demotions is not None
        cancelled = self.demotions.cancel()
        for demotion in cancelled:
            self.demotions.allocator.free(demotion.slots)
        logger.error(
            "a worker failed a copy into the host pool: moves to the pool stop on this engine",
            extra={"failed_order": failed_sequence, "cancelled": [d.request_id for d in cancelled]},
        )
        self._timer.poke()

    def _next_due(self) -> float | None:
        """When the engine must next be woken: the table's next change, a warm step, or the next demotion."""
        due = self.table.next_due()
        warm = self._warm_steps.next_due()
        if warm is not None:
            due = warm if due is None else min(due, warm)
        demotions = self.demotions
        if demotions is None or demotions.stopped:
            return due
        next_move = next_demotion_at(
            self.table.live_entries(Tier.DEVICE),
            demote_after_seconds=self.settings.demote_after_seconds,
            movable=self._movable,
        )
        demotable = [None if next_move is None else max(next_move, demotions.no_room_until)]
        if demotions.unsent or demotions.in_flight:
            # Sent orders: looked at again until the workers count them done (a GPU's copy ends after its
            # step; the timer wakes the engine every quarter second meanwhile, without a step).
            demotable.append(time.monotonic())
        return min([d for d in (due, *demotable) if d is not None], default=None)

    def shutdown(self) -> None:
        self._loop.stop()
        super().shutdown()

    def _registry_word_changed(self) -> None:
        # Called on the link's thread: a call to the sidecar may be due, or a free may have moved.
        if self._link is not None:
            self._link.poke()
        self._timer.poke()

    def _stats(self) -> tuple[int, StatsSnapshot]:
        self.accounting.set_fenced_pulls(self.generations.counter(FENCED_PULLS))
        return self.accounting.version, self.accounting.snapshot()


class KvferryWorker(NixlPullConnectorWorker):  # type: ignore[misc]
    """Worker half: vLLM's NIXL worker with a quiet progress thread, retained-read filtering and
    coalesced pulls (kvferry.connector.nixl_pulls)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig,
        settings: KvferrySettings,
    ) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

        with vllm_internals.nixl_progress_thread_delay(
            base_worker.NixlWrapper, settings.nixl_progress_delay_us
        ):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        self._retained: set[str] = set()
        self._released_at: dict[str, float] = {}
        self._pull_options: dict[str, PullOptions] = {}
        self._read_deadlines: dict[str, float] = {}
        # Peers this worker started a handshake ahead with, to warm reads from once it is done (engine id ->
        # give up at, monotonic).
        self._to_warm: dict[str, float] = {}
        agent: Any = getattr(self, "nixl_wrapper")  # noqa: B009 - set by vLLM's __init__
        self._kvferry_agent = agent
        # This worker's generations (peers READ them; the scheduler bumps them) and the landing slots of
        # its own fence reads (kvferry.connector.generations).
        self.generation_file: GenerationFile | None = None
        self.fence: PullFence | None = None
        # The host tier's pool, made once vLLM registered the KV cache (register_kv_caches).
        self.host_pool_slots = settings.host_pool_blocks
        self.host_pool: HostPool | None = None
        # Plans, starts and waits for a GPU's copies into the pool off the step (made at the first move); the
        # lock guards the done and failed counters. Moves are copied and counted on one thread (the step's, or
        # this one), in order, so none is counted after a failed one.
        self._mover: ThreadPoolExecutor | None = None
        self._moved_lock = threading.Lock()
        # A copy into the pool failed: no move is copied or counted done after it (Demotions.cancel).
        self._move_failed = False
        # Holders' pools on this host are mapped and copied from here (kvferry.connector.host_tier).
        self.map_host_pools = settings.map_host_pools
        self.copier: ByteCopier | None = None
        if settings.fence_pulls:
            # Pool slots have generations too: block ids num_blocks + slot.
            self.generation_file = GenerationFile.create(
                int(kv_cache_config.num_blocks) + settings.host_pool_blocks
            )
            self.fence = PullFence(agent, self.generation_file, wait_seconds=settings.fence_wait_us / 1e6)
        transfer = vllm_config.kv_transfer_config
        self.pulls = PullCoalescer(
            agent,
            enabled=settings.coalesce_pulls,
            reader_role=str(transfer.kv_role) if transfer is not None else "",
            on_pull=self._pulled,
        )
        self.nixl_wrapper: Any = vllm_internals.NotificationFilter(self.pulls, self._knows)

    def _knows(self, request_id: str) -> bool:
        return request_id in self._retained or request_id in self._released_at

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        if isinstance(metadata, KvferryConnectorMetadata):
            now = time.monotonic()
            self._retained.update(metadata.retained_added)
            for request_id in metadata.retained_released:
                self._retained.discard(request_id)
                self._released_at[request_id] = now
            if self._released_at:
                cutoff = now - _FORGET_AFTER_SECONDS
                self._released_at = {r: t for r, t in self._released_at.items() if t >= cutoff}
            self._pull_options.update(metadata.pull_options)
            while len(self._pull_options) > _MAX_PULL_OPTIONS:
                self._pull_options.pop(next(iter(self._pull_options)))
            self._read_deadlines.update(metadata.read_deadlines)
            while len(self._read_deadlines) > _MAX_PULL_OPTIONS:
                self._read_deadlines.pop(next(iter(self._read_deadlines)))
            if self.fence is not None:
                for request_id, generations in metadata.pull_generations.items():
                    self.fence.expect(request_id, generations)
            if metadata.demotions:
                self._demote(metadata.demotions)
            for peer in metadata.peers:
                if self._handshake_ahead(peer) and metadata.warm_peers:
                    self._to_warm[peer.engine_id] = now + WARM_GIVE_UP_SECONDS
            if self._to_warm:
                self._warm_handshook_peers(now)
        super().start_load_kv(metadata)

    def _handshake_ahead(self, peer: PeerAddress) -> bool:
        """Starts the NIXL handshake with an engine this one will pull from, on vLLM's handshake thread (none
        when one is done or under way). A pull from that engine meanwhile waits for this same handshake.
        True when this call started it."""
        with self._handshake_lock:
            if peer.engine_id in self._remote_agents or peer.engine_id in self._handshake_futures:
                return False
        started = time.perf_counter()
        try:
            pending = self._ensure_handshake(peer.engine_id, peer.host, peer.port, _PEER_TP_SIZE)
        except Exception as error:  # a handshake ahead only saves time: it never fails the step
            logger.warning(
                "could not start a handshake ahead; the first pull from the peer will handshake",
                extra={"peer_engine_id": peer.engine_id, "error": f"{type(error).__name__}: {error}"},
            )
            return False
        if pending is None:
            return False

        def handshook(done: Any) -> None:
            failure = done.exception()
            logger.log(
                logging.WARNING if failure is not None else logging.INFO,
                HANDSHAKE_AHEAD_LOG,
                extra={
                    "peer_engine_id": peer.engine_id,
                    "peer": f"{peer.host}:{peer.port}",
                    "ms": _ms_since(started),
                    "ok": failure is None,
                    **({"error": f"{type(failure).__name__}: {failure}"} if failure is not None else {}),
                },
            )

        pending.add_done_callback(handshook)
        return True

    def _warm_handshook_peers(self, now: float) -> None:
        """Warms the reads from peers whose handshake ahead is done (PullCoalescer.warm), on the step's
        thread like every other transfer; the scheduler asks for idle steps meanwhile
        (kvferry.connector.peers)."""
        with self._handshake_lock:
            agents = self._remote_agents
            done = {e: list(agents[e].values()) for e in self._to_warm if e in agents}
        for engine_id, give_up_at in list(self._to_warm.items()):
            if engine_id in done:
                del self._to_warm[engine_id]
                for agent_name in done[engine_id]:
                    self._warm(engine_id, agent_name)
            elif now > give_up_at:
                del self._to_warm[engine_id]

    def _warm(self, engine_id: str, agent_name: Any) -> None:
        started = time.perf_counter()
        try:
            warmed = self.pulls.warm(agent_name)
        except Exception as error:  # warming only saves time: the first pull pays as before
            logger.warning(
                PEER_WARMED_LOG,
                extra={
                    "peer_engine_id": engine_id,
                    "ok": False,
                    "ms": _ms_since(started),
                    "error": f"{type(error).__name__}: {error}",
                },
            )
            return
        logger.info(
            PEER_WARMED_LOG,
            extra={
                "peer_engine_id": engine_id,
                "ok": True,
                "ms": _ms_since(started),
                "plan_ms": round(warmed.plan_seconds * 1e3, 3),
                "transfer_ms": round(warmed.transfer_seconds * 1e3, 3),
                "descriptors": warmed.descriptors,
                "bytes": warmed.bytes,
            },
        )

    def _demote(self, demotions: list[Demotion]) -> None:
        """Copies retentions into the host pool, then tells the scheduler (shared counter) they are there."""
        pool, file = self.host_pool, self.generation_file
        if pool is None or file is None:
            logger.error(
                "demotion ordered but this worker has no host pool", extra={"orders": len(demotions)}
            )
            return
        if self._move_failed:
            return  # the scheduler cancels what it has not seen done
        started = time.perf_counter()
        if pool.copier.synchronous:
            try:
                copied = sum(pool.copy_in(d.block_ids, d.slots)[0] for d in demotions)
            except Exception:
                self._failed(demotions)
                return
            self._moved(demotions, copied, started, pool.copier.name, _ms_since(started))
            return
        # A GPU's copy runs on a stream of its own beside the step's forward pass, and the step does not even
        # plan it: a thread of this worker plans and starts the copies (after what the step queued so far),
        # waits for them, then counts the order done (the scheduler polls meanwhile).
        after = pool.copier.checkpoint()
        if self._mover is None:
            self._mover = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvferry-host-moves")
        self._mover.submit(self._move, pool, demotions, after, started, _ms_since(started))

    def _move(
        self, pool: HostPool, demotions: list[Demotion], after: object | None, started: float, step_ms: float
    ) -> None:
        if self._move_failed:
            return  # an earlier order on this thread failed after this one was handed over
        try:
            copied = 0
            copies: list[CopyDone] = []
            for demotion in demotions:
                nbytes, copy = pool.copy_in(demotion.block_ids, demotion.slots, after)
                copies.append(copy)
                copied += nbytes
            for copy in copies:
                copy.wait()
        except Exception:
            self._failed(demotions)
            return
        self._moved(demotions, copied, started, pool.copier.name, step_ms)

    def _failed(self, demotions: list[Demotion]) -> None:
        """A copy into the pool failed. The done counter says "every order up to N", so no later order may be
        counted done either: the worker copies none, and the scheduler cancels what it has not seen done
        (their retentions stay in the KV cache; the engine takes no more moves)."""
        logger.exception(
            "a copy into the host pool failed; this engine moves no more retentions to its pool",
            extra={"request_ids": [d.request_id for d in demotions]},
        )
        file = self.generation_file
        assert file is not None
        with self._moved_lock:
            self._move_failed = True
            file.counters[DEMOTE_FAILED] = max(
                int(file.counters[DEMOTE_FAILED]), *(d.sequence for d in demotions)
            )

    def _moved(
        self, demotions: list[Demotion], copied: int, started: float, copier: str, step_ms: float
    ) -> None:
        """The orders' copies are in the pool: counted done for the scheduler (shared counter)."""
        file = self.generation_file
        assert file is not None
        finished = [d.sequence for d in demotions if d.final]
        if finished:
            with self._moved_lock:
                file.counters[DEMOTED] = max(int(file.counters[DEMOTED]), *finished)
        seconds = time.perf_counter() - started
        logger.info(
            COPIED_LOG,
            extra={
                "request_ids": [d.request_id for d in demotions],
                "parts": sum(not d.final for d in demotions),
                "blocks": sum(len(d.block_ids) for d in demotions),
                "bytes": copied,
                "copy": copier,
                "copy_ms": round(seconds * 1e3, 3),
                "step_ms": step_ms,
                "gbps": round(copied / seconds / 1e9, 3) if seconds > 0 else None,
            },
        )

    def register_kv_caches(self, kv_caches: Any) -> None:
        file = self.generation_file
        if file is not None:
            # Before vLLM builds the handshake metadata: peers learn this registration with it.
            address, nbytes = file.registration()
            agent = self._kvferry_agent
            agent.register_memory(agent.get_reg_descs([(address, nbytes, 0, "")], "DRAM"))
        super().register_kv_caches(kv_caches)
        if self.host_pool_slots or self.map_host_pools:
            # The host tier's copies, by address, from or into this KV cache (kvferry.connector.copies).
            self.copier = copier_for(_kv_tensors(kv_caches))
        payload: Any = getattr(self, "xfer_handshake_metadata", None)
        agent_metadata_bytes = payload.agent_metadata_bytes if payload is not None else b""
        if self.host_pool_slots and payload is not None:
            agent_metadata_bytes = self._make_host_pool(agent_metadata_bytes)
        if file is not None and payload is not None:
            self.xfer_handshake_metadata = KvferryHandshakePayload(
                compatibility_hash=payload.compatibility_hash,
                agent_metadata_bytes=agent_metadata_bytes,
                kvferry_generations=file.describe(),
                kvferry_host_pool=self.host_pool.layout() if self.host_pool is not None else None,
            )

    def _make_host_pool(self, agent_metadata_bytes: bytes) -> bytes:
        """Lays the pool out like the KV cache vLLM just registered, registers it with NIXL and returns
        the handshake's agent metadata taken again (it carries the registrations peers READ)."""
        memory_type = str(getattr(self, "nixl_memory_type", ""))
        if missing := vllm_internals.missing_host_tier_internals():
            raise HostTierError(
                f"kvferry.host_pool_blocks needs internals this vLLM lacks: {', '.join(missing)} "
                "(docs/connector.md, Host tier)"
            )
        if memory_type not in ("DRAM", "VRAM") or self.copier is None:
            raise HostTierError(
                f"kvferry.host_pool_blocks needs the KV cache in host or GPU memory; this engine's is "
                f"{memory_type or 'unknown'}"
            )
        rows, region_num_blocks = vllm_internals.own_blocks(self)
        kv_rows = np.asarray(rows, dtype=np.uint64)
        pool = HostPool(kv_rows, region_num_blocks, self.host_pool_slots, self.copier)
        address, nbytes = pool.registration()
        agent = self._kvferry_agent
        agent.register_memory(agent.get_reg_descs([(address, nbytes, 0, "")], "DRAM"))
        self.host_pool = pool
        logger.info(
            "host pool ready",
            extra={
                "slots": pool.slots,
                "bytes": nbytes,
                "first_block_id": pool.kv_blocks,
                "copy": pool.copier.name,
                # Regions interleaved in the KV cache move as one range per run of blocks (host_tier).
                "region_groups": pool.region_groups,
            },
        )
        return vllm_internals.with_fresh_agent_metadata(agent_metadata_bytes, agent.get_agent_metadata())

    def _nixl_handshake(
        self, host: str, port: int, remote_tp_size: int, expected_engine_id: str, *args: Any, **kwargs: Any
    ) -> tuple[dict[tuple[int, int], str], float]:
        agents, clock_offset = super()._nixl_handshake(
            host, port, remote_tp_size, expected_engine_id, *args, **kwargs
        )
        for (pp_rank, tp_rank), agent_name in agents.items():
            payload = _peer_payload(host, port, pp_rank, tp_rank)
            if self.fence is not None:
                self.fence.add_peer(agent_name, _peer_generations(payload, host, port, tp_rank))
            pool = payload.kvferry_host_pool if payload is not None else None
            if pool is not None:
                self._add_host_pool(expected_engine_id, tp_rank, agent_name, pool)
        return agents, clock_offset

    def _add_host_pool(self, engine_id: str, tp_rank: int, agent_name: Any, pool: HostPoolLayout) -> None:
        """A holder with a host pool: vLLM's indices for it go on into the pool region by region, so vLLM
        pulls a pool slot as block ``first_block_id + slot`` like any block. Slots are copied from the pool
        mapped here (same host) or read over NIXL from the holder's list extended with them (a holder whose
        KV cache is host memory); kvferry.connector.host_tier."""
        try:
            if missing := vllm_internals.missing_host_tier_internals():
                raise HostTierError(f"this vLLM lacks {', '.join(missing)}")
            handle, region_num_blocks, memory_type = vllm_internals.holder_blocks(self, engine_id, tp_rank)
            mapped, why_not_mapped = (
                MappedHostPool.open(pool, self.copier)
                if self.map_host_pools and self.copier is not None
                else (None, "kvferry.map_host_pools is off")
            )
            base, lists_pool = handle, False
            if memory_type == "DRAM":
                rows = self.pulls.prepared_rows(handle)
                if rows is None:
                    raise HostTierError("its descriptor list was prepared out of kvferry's sight")
                extended, _ = extend_remote_rows(rows, region_num_blocks, pool)
                base = self.nixl_wrapper.prep_xfer_dlist(
                    agent_name, self.nixl_wrapper.get_xfer_descs(extended, memory_type)
                )
                lists_pool = True
            elif mapped is None:
                raise HostTierError(
                    f"its pool cannot be mapped here ({why_not_mapped}) and its KV cache is {memory_type}, "
                    "its pool DRAM: one NIXL list holds one type"
                )
            pool_list = PoolList(base, agent_name, region_num_blocks[0], pool, mapped, lists_pool)
            old = vllm_internals.set_holder_list(
                self, engine_id, tp_rank, pool_list, [count + pool.slots for count in region_num_blocks]
            )
            if base is not old:
                self.nixl_wrapper.release_dlist_handle(old)
        except (HostTierError, KeyError, RuntimeError) as error:
            logger.warning(
                "cannot pull from a holder's host pool; pulls of its host-tier retentions fail and recompute",
                extra={
                    "engine_id": engine_id,
                    "tp_rank": tp_rank,
                    "error": f"{type(error).__name__}: {error}",
                },
            )
            return
        logger.info(
            "holder's host pool added",
            extra={
                "engine_id": engine_id,
                "tp_rank": tp_rank,
                "slots": pool.slots,
                "first_block_id": pool.first_block_id,
                "read": "mapped" if mapped is not None else "nixl",
                "not_mapped_because": why_not_mapped or None,
            },
        )

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        done, failed = super()._pop_done_transfers(transfers)
        if transfers is not self._recving_transfers:
            return done, failed
        if not done:
            # The held lines of pulls and their verdicts (kvferry.connector.logs.log_off_path) go to the
            # logging thread at a poll that finishes no pull: never while a pull waits for data or verdict.
            hand_over_held()
        if self.fence is None:
            return done, failed
        # After the data: the pulls of retentions wait for their generations (kvferry.connector.fence).
        return self.fence.settle(done, failed, self._pulled_blocks)

    def _pulled_blocks(self, request_id: str) -> PulledBlocks | None:
        return vllm_internals.pulled_blocks(self, request_id)

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        # Called again for a request that first waited for a handshake with its remote engine: checked then.
        deadline = self._read_deadlines.get(req_id)
        now = time.monotonic()
        if not read_may_start(deadline, now):
            assert deadline is not None
            del self._read_deadlines[req_id]
            logger.warning(
                "failed a pull: its read window closed before the READ was posted, recomputing",
                extra={"request_id": req_id, "seconds_late": round(now - deadline, 3)},
            )
            vllm_internals.fail_pull(self, req_id)
            return
        local_ids, remote_ids = vllm_internals.pull_block_ids(meta)
        addressable = vllm_internals.holder_block_count(self, meta)
        if addressable is not None and remote_ids and max(remote_ids) >= addressable:
            # A host-tier record of a holder whose pool this engine could not add (the handshake's warning):
            # vLLM would read another region's blocks at those indices.
            logger.warning(
                "failed a pull: it names blocks beyond what this engine can read on its holder, recomputing",
                extra={"request_id": req_id, "block_id": max(remote_ids), "holder_blocks": addressable},
            )
            vllm_internals.fail_pull(self, req_id)
            return
        # vLLM posts this request's READs inside: tell the coalescer whose they are.
        options = self._pull_options.get(req_id)
        self.pulls.set_context(
            PullContext(
                request_id=req_id,
                coalesce=options.coalesce if options else None,
                digest=options.digest if options else False,
                local_block_ids=local_ids,
                remote_block_ids=remote_ids,
                mapped=options.mapped if options else None,
            )
        )
        try:
            super()._read_blocks_for_req(req_id, meta)
        finally:
            self.pulls.set_context(None)
        if self.fence is not None and self._recving_transfers.get(req_id):
            # The data READ is in flight: ready its fence check now, so that seeing it done costs
            # only posting the generation read and comparing (kvferry.connector.fence).
            self.fence.prepare(req_id, self._pulled_blocks(req_id))

    def _pulled(self, record: PullRecord) -> None:
        self._pull_options.pop(record.request_id, None)
        self._read_deadlines.pop(record.request_id, None)


def _generations_problem(params: dict[str, Any]) -> str | None:
    """Why a pull's generations are unusable (None: usable or absent; a pull without is not checked)."""
    try:
        generations = BlockGenerations.from_params(params)
    except ValueError as bad:
        return str(bad)
    if generations is None:
        return None
    groups = vllm_params.block_id_groups(params)
    blocks = len(groups[0]) if groups else 0
    if len(generations.values) != blocks:
        return f"{len(generations.values)} generations for {blocks} remote blocks"
    return None


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1e3, 3)


def _kv_tensors(kv_caches: Any) -> list[Any]:
    """The tensors of what vLLM hands ``register_kv_caches`` (a dict of layer name to tensor, or of lists)."""
    values = kv_caches.values() if isinstance(kv_caches, dict) else kv_caches
    tensors: list[Any] = []
    for value in values:
        tensors.extend(value if isinstance(value, list | tuple) else [value])
    return tensors


def _peer_payload(host: str, port: int, pp_rank: int, tp_rank: int) -> KvferryHandshakePayload | None:
    """A holder rank's handshake payload as kvferry reads it (None: it could not be asked)."""
    try:
        payload: KvferryHandshakePayload = vllm_internals.fetch_handshake_payload(
            host, port, pp_rank, tp_rank, KvferryHandshakePayload
        )
    except Exception as error:
        logger.warning(
            "could not ask a holder for its generation array and host pool; pulls from it will be fenced",
            extra={
                "host": host,
                "port": port,
                "tp_rank": tp_rank,
                "error": f"{type(error).__name__}: {error}",
            },
        )
        return None
    return payload


def _peer_generations(
    payload: KvferryHandshakePayload | None, host: str, port: int, tp_rank: int
) -> GenerationArray | None:
    """Where a holder's rank keeps its generations (None: it advertises none; its pulls are fenced)."""
    if payload is None:
        return None
    array: GenerationArray | None = payload.kvferry_generations
    if array is None:
        logger.warning(
            "holder advertises no generation array; pulls of its retentions will be fenced",
            extra={"host": host, "port": port, "tp_rank": tp_rank},
        )
    return array


def warn_when_fenced_pulls_fail_requests(settings: KvferrySettings, transfer: KVTransferConfig) -> None:
    """At start, on an engine whose fenced pulls would fail their requests instead of recomputing them. Only
    an engine that pulls retentions fences (a prefill: ``kv_producer``, or ``kv_both``); a decode engine's
    pulls (P->D) are never fenced, so it is not told."""
    if settings.fence_pulls and transfer.is_kv_producer and transfer.kv_load_failure_policy != "recompute":
        logger.warning(
            "a fenced pull fails its request: set kv_transfer_config.kv_load_failure_policy to "
            '"recompute" so the engine recomputes instead (docs/connector.md#pull-time-fencing)',
            extra={"kv_load_failure_policy": transfer.kv_load_failure_policy, "kv_role": transfer.kv_role},
        )


class KvferryConnector(NixlPullConnector):  # type: ignore[misc]
    """The class vLLM loads (``kv_connector: "KvferryConnector"``)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        setup_logging()
        vllm_internals.check_vllm()
        transfer = vllm_config.kv_transfer_config
        if transfer is None or transfer.engine_id is None:
            raise SettingsError("kvferry's connector needs kv_transfer_config with an engine_id")
        settings = parse_settings(transfer.kv_connector_extra_config)
        compat_hash = kv_compatibility_hash(engine_layout(vllm_config))
        if settings.kv_compatibility_hash and settings.kv_compatibility_hash != compat_hash:
            raise SettingsError(
                f"kvferry.kv_compatibility_hash {settings.kv_compatibility_hash!r} does not match this "
                f"engine's {compat_hash!r} (model, dtype, block size or layers differ from what the "
                "launcher expected)"
            )
        # NixlBaseConnector sets the common state; the halves are kvferry's subclasses of vLLM's.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        self.kvferry_settings = settings
        self.kv_compatibility_hash = compat_hash
        self.connector_scheduler: KvferryScheduler | None = None
        self.connector_worker: KvferryWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            warn_when_fenced_pulls_fail_requests(settings, transfer)
            self.connector_scheduler = KvferryScheduler(
                vllm_config, self.engine_id, kv_cache_config, settings, compat_hash
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KvferryWorker(vllm_config, self.engine_id, kv_cache_config, settings)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if isinstance(self.connector_scheduler, KvferryScheduler):
            self.connector_scheduler.bind_block_pool(gpu_block_pool)


__all__ = [
    "BUMPED_LOG",
    "FREED_LOG",
    "KvferryConnector",
    "KvferryConnectorMetadata",
    "KvferryHandshakePayload",
    "KvferryScheduler",
    "KvferryWorker",
]
