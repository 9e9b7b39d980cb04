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
- prefill engine: declines a pull whose read deadline is too near, and counts pulled versus
  computed tokens.
- both: report to the local sidecar (retentions, evictions, engine stats) from a background
  thread; NIXL's progress thread sleeps between polls instead of spinning; vLLM's READs (D->P
  and P->D pulls) are posted as the fewest, largest descriptors the block ids and KV layout
  allow (``coalesce_pulls``, kvferry.connector.nixl_pulls), each pull logged as ``kv pull``.

Unmarked requests behave exactly as with vLLM's NixlConnector.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvferry.connector import vllm_internals
from kvferry.connector.accounting import Accounting, StatsSnapshot, pull_allowed
from kvferry.connector.compat import KvLayout, kv_compatibility_hash
from kvferry.connector.keeper import RetentionKeeper
from kvferry.connector.logs import setup_logging
from kvferry.connector.nixl_pulls import PullCoalescer, PullContext, PullRecord
from kvferry.connector.retention import RetainedEntry, RetentionTable
from kvferry.connector.settings import KvferrySettings, SettingsError, parse_settings
from kvferry.connector.sidecar_link import BackgroundLoop, DueTimer, SidecarLink
from kvferry.pd import vllm_params
from kvferry.pd.digest import block_digests
from kvferry.pd.kvferry_params import (
    KVFERRY_PARAMS_VERSION,
    ConversationMark,
    Mark,
    PullOptions,
    ReleaseMark,
    lease_expire_time_from_params,
    parse_mark,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlConnectorMetadata,
    NixlPullConnector,
    NixlPullConnectorScheduler,
    NixlPullConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvferry.connector")

# Released ids stay known to the worker this long, so late read notices are still recognised.
_FORGET_AFTER_SECONDS = 600.0
# Per-request pull options the worker keeps at most (a request whose pull never starts is dropped).
_MAX_PULL_OPTIONS = 1024


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
    """vLLM's NIXL metadata plus which requests kvferry retains and per-request pull options
    (scheduler -> worker)."""

    def __init__(self) -> None:
        super().__init__()
        self.retained_added: list[str] = []
        self.retained_released: list[str] = []
        self.pull_options: dict[str, PullOptions] = {}

    @classmethod
    def extend(
        cls,
        base: NixlConnectorMetadata,
        added: list[str],
        released: list[str],
        pull_options: dict[str, PullOptions] | None = None,
    ) -> KvferryConnectorMetadata:
        meta = cls()
        meta.__dict__.update(base.__dict__)
        meta.retained_added = added
        meta.retained_released = released
        meta.pull_options = pull_options or {}
        return meta


class KvferryScheduler(NixlPullConnectorScheduler):  # type: ignore[misc]
    """Scheduler half: retention table, block holds, accounting, sidecar link."""

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
        self._waker = vllm_internals.EngineWaker(vllm_internals.find_engine_core_input_queue())
        self._loop = BackgroundLoop("kvferry-connector")
        self._timer = DueTimer(self._loop, self.table.next_due, self._waker.wake)
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
            "kvferry connector scheduler ready",
            extra={
                "engine_id": engine_id,
                "kv_role": self.kv_role,
                "kv_blocks": num_blocks,
                "retained_block_budget": self.table.budget_blocks,
                "kv_compatibility_hash": compat_hash,
                "can_wake_engine": self._waker.available,
                "kvferry_params_version": KVFERRY_PARAMS_VERSION,
            },
        )

    def bind_block_pool(self, block_pool: Any) -> None:
        self._block_pool = block_pool

    # -- prefill side -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and vllm_params.wants_remote_decode(params) and vllm_params.names_remote_blocks(params):
            deadline = lease_expire_time_from_params(params)
            if not pull_allowed(deadline, time.time(), self.settings.min_read_seconds):
                vllm_params.strip_remote_blocks(params)
                self.accounting.on_declined()
                logger.info(
                    "declined a pull: read deadline too near, recomputing",
                    extra={"request_id": request.request_id, "seconds_left": (deadline or 0) - time.time()},
                )
        count, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self.accounting.on_matched(request.request_id, request.num_prompt_tokens, num_computed_tokens)
        return count, is_async

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
            # pull fills are sorted into ascending runs, which coalesce with each other.
            vllm_internals.order_new_blocks(blocks)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        peer = (request.kv_transfer_params or {}).get(vllm_params.REMOTE_ENGINE_ID)
        self.accounting.on_allocated(
            request.request_id, num_external_tokens, time.monotonic(), peer if isinstance(peer, str) else ""
        )
        if options is not None:
            self._pull_options[request.request_id] = options

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        failed = getattr(connector_output, "failed_recving", None) or set()  # absent before vLLM 0.32
        now = time.monotonic()
        measured = False
        for request_id in connector_output.finished_recving or ():
            measured |= self.accounting.on_received(request_id, now, failed=request_id in failed)
        if measured and self._link is not None:
            self._link.rates_measured()

    # -- decode side: retention -------------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        mark = self._mark(request)
        self._pull_options.pop(request.request_id, None)
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
        entry, superseded = self.table.add(
            request_id=request_id,
            tenant=mark.tenant,
            conversation_id=mark.conversation_id,
            turn=mark.turn,
            block_ids=block_ids,
            num_tokens=num_tokens,
            block_digests=digests,
        )
        self._worker_added.append(request_id)
        for evicted in self.table.evict_over_budget():
            logger.info(
                "evicting least recently used retention (over budget); freed once the registry confirms",
                extra={"request_id": evicted.request_id, "conversation_id": evicted.conversation_id},
            )
        if self._link is not None:
            self._link.poke()
        self.accounting.set_retained_blocks(self.table.held_blocks())
        self._timer.poke()
        logger.info(
            "retained",
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
        # Options travel with the step that asks the worker to pull (reqs_to_recv).
        options = {r: self._pull_options.pop(r) for r in base.reqs_to_recv if r in self._pull_options}
        meta = KvferryConnectorMetadata.extend(base, self._worker_added, self._worker_released, options)
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
        self.accounting.set_retained_blocks(self.table.held_blocks())

    def _before_unconfirmed_free(self, entries: list[RetainedEntry]) -> None:
        """Blocks about to be freed without the registry's confirmation (it stayed unreachable past
        the hard cap), so the registry may still hand them out. Pull-time fencing hooks in here:
        it makes these blocks unpullable (bumps their generations) before vLLM can reuse them."""
        logger.warning(
            "freeing retained blocks the registry never confirmed ended (hard cap)",
            extra={
                "request_ids": [e.request_id for e in entries],
                "unconfirmed_frees_total": self.table.unconfirmed_frees,
            },
        )

    def _free(self, entry: RetainedEntry) -> None:
        blocks = self._held.pop(entry.request_id, [])
        if self._block_pool is not None and blocks:
            vllm_internals.release_blocks(self._block_pool, blocks)
        self._worker_released.append(entry.request_id)
        logger.info(
            "freed retained blocks",
            extra={
                "request_id": entry.request_id,
                "tenant": entry.tenant,
                "conversation_id": entry.conversation_id,
                "turn": entry.turn,
                "block_ids": list(entry.block_ids),
                "blocks": len(blocks),
                "reason": entry.end_reason.value if entry.end_reason else None,
                # False: freed at the hard cap without the registry confirming the end.
                "confirmed": entry.confirmed,
                "end_revision": entry.end_revision,
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
        return bool(super().has_pending_push_work())

    def shutdown(self) -> None:
        self._loop.stop()
        super().shutdown()

    def _registry_word_changed(self) -> None:
        # Called on the link's thread: a call to the sidecar may be due, or a free may have moved.
        if self._link is not None:
            self._link.poke()
        self._timer.poke()

    def _stats(self) -> tuple[int, StatsSnapshot]:
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
        agent: Any = getattr(self, "nixl_wrapper")  # noqa: B009 - set by vLLM's __init__
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
        super().start_load_kv(metadata)

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        # vLLM posts this request's READs inside: tell the coalescer whose they are.
        options = self._pull_options.get(req_id)
        local_ids, remote_ids = vllm_internals.pull_block_ids(meta)
        self.pulls.set_context(
            PullContext(
                request_id=req_id,
                coalesce=options.coalesce if options else None,
                digest=options.digest if options else False,
                local_block_ids=local_ids,
                remote_block_ids=remote_ids,
            )
        )
        try:
            super()._read_blocks_for_req(req_id, meta)
        finally:
            self.pulls.set_context(None)

    def _pulled(self, record: PullRecord) -> None:
        self._pull_options.pop(record.request_id, None)


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
            self.connector_scheduler = KvferryScheduler(
                vllm_config, self.engine_id, kv_cache_config, settings, compat_hash
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KvferryWorker(vllm_config, self.engine_id, kv_cache_config, settings)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if isinstance(self.connector_scheduler, KvferryScheduler):
            self.connector_scheduler.bind_block_pool(gpu_block_pool)


__all__ = [
    "KvferryConnector",
    "KvferryConnectorMetadata",
    "KvferryScheduler",
    "KvferryWorker",
]
