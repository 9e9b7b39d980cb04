"""Concurrent etcd calls sent as one: fewer client calls when the registry is busy.

``ReadBatcher``: concurrent reads go out as one flat transaction of reads. etcd serves a transaction
whose operations are all reads like a read (linearizable, no raft entry, nothing in its WAL); one
that nests other transactions goes through raft like a write, so reads are never nested.

``TxnBatcher``: each call is a transaction of its own (compares, then success or failure operations). While
one batch is in flight, new calls queue; the next batch carries them all as nested
transactions of one etcd transaction, each still judged by its own compares. A lone call goes
out at once, unchanged, so an idle registry pays no delay. A gRPC call from Python costs about
0.2 ms of CPU whatever it carries, and for writes one raft entry serves the whole batch.

Two calls that write the same key never share a batch (etcd refuses that), and a batch stays
under ``MAX_BATCH_BYTES`` (etcd refuses requests past --max-request-bytes, 1.5 MiB by default;
a few 170 KB records of 128k-token conversations reach it). If etcd refuses a
batch as a whole (say a nested put names an expired lease), each call is sent again on its own,
so one caller's problem stays its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvferry.registry.errors import EtcdFailure
from kvferry.registry.etcd import Compare, EtcdGateway, Get, LeaseNotFound, Op, RangeResult, Txn, TxnResult

# Operations at one level of an etcd transaction are capped (--max-txn-ops, default 128).
MAX_BATCH = 100
MAX_TXN_OPS = 128
# Bytes of keys and values in one batch; a single larger call still goes out, alone.
MAX_BATCH_BYTES = 1024 * 1024


class TxnBatcher:
    def __init__(
        self, etcd: EtcdGateway, max_batch: int = MAX_BATCH, max_batch_bytes: int = MAX_BATCH_BYTES
    ) -> None:
        self._etcd = etcd
        self._max_batch = max_batch
        self._max_batch_bytes = max_batch_bytes
        self._pending: list[tuple[Txn, asyncio.Future[TxnResult]]] = []
        self._drainer: asyncio.Task[None] | None = None

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        """The same as ``EtcdGateway.txn``, sharing an etcd call with concurrent ones."""
        future: asyncio.Future[TxnResult] = asyncio.get_running_loop().create_future()
        self._pending.append((Txn(compare, success, failure), future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain(), name="etcd-txn-batcher")
        return await future

    async def _drain(self) -> None:
        while self._pending:
            await self._send(self._next_batch())

    def _next_batch(self) -> list[tuple[Txn, asyncio.Future[TxnResult]]]:
        """Takes pending calls in order, leaving for later any that writes a key already taken
        (etcd refuses a transaction that writes one key twice) or that would make the batch too large."""
        batch: list[tuple[Txn, asyncio.Future[TxnResult]]] = []
        deferred: list[tuple[Txn, asyncio.Future[TxnResult]]] = []
        written: set[bytes] = set()
        size = 0
        for item in self._pending:
            if len(batch) >= self._max_batch:
                deferred.append(item)
                continue
            keys = item[0].written_keys()
            weight = item[0].request_bytes()
            if keys & written or (batch and size + weight > self._max_batch_bytes):
                deferred.append(item)
                continue
            written |= keys
            size += weight
            batch.append(item)
        self._pending = deferred
        return batch

    async def _send(self, batch: list[tuple[Txn, asyncio.Future[TxnResult]]]) -> None:
        if len(batch) == 1:
            await self._send_alone(*batch[0])
            return
        try:
            response = await self._etcd.txn([], [call for call, _ in batch])
        except (LeaseNotFound, EtcdFailure):
            # No two calls of a batch write the same key, so they may go out together again.
            await asyncio.gather(*(self._send_alone(call, future) for call, future in batch))
            return
        except BaseException as error:
            _fail([future for _, future in batch], error)
            return
        for index, (_, future) in enumerate(batch):
            if not future.done():
                future.set_result(response.txn(index))

    async def _send_alone(self, call: Txn, future: asyncio.Future[TxnResult]) -> None:
        try:
            result = await self._etcd.txn(call.compare, call.success, call.failure)
        except BaseException as error:
            _fail([future], error)
            return
        if not future.done():
            future.set_result(result)


class ReadBatcher:
    """Concurrent reads sent as one flat read-only transaction (at most ``max_ops`` reads, a repeated read
    sent once); a lone read goes out at once. Every read of one batch is of the same revision."""

    def __init__(self, etcd: EtcdGateway, max_ops: int = MAX_TXN_OPS) -> None:
        self._etcd = etcd
        self._max_ops = max_ops
        self._pending: list[tuple[Sequence[Get], asyncio.Future[list[RangeResult]]]] = []
        self._drainer: asyncio.Task[None] | None = None

    async def read(self, *gets: Get) -> list[RangeResult]:
        """What each of ``gets`` found, in order, all at one revision (``RangeResult.revision``)."""
        if not 0 < len(gets) <= self._max_ops:
            raise ValueError(f"a read takes 1 to {self._max_ops} gets, not {len(gets)}")
        future: asyncio.Future[list[RangeResult]] = asyncio.get_running_loop().create_future()
        self._pending.append((gets, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain(), name="etcd-read-batcher")
        return await future

    async def _drain(self) -> None:
        while self._pending:
            batch: list[tuple[Sequence[Get], asyncio.Future[list[RangeResult]]]] = []
            positions: dict[Get, int] = {}
            while self._pending:
                gets = self._pending[0][0]
                fresh = {get for get in gets if get not in positions}
                if batch and len(positions) + len(fresh) > self._max_ops:
                    break
                for get in gets:
                    positions.setdefault(get, len(positions))
                batch.append(self._pending.pop(0))
            await self._send(batch, positions)

    async def _send(
        self, batch: list[tuple[Sequence[Get], asyncio.Future[list[RangeResult]]]], positions: dict[Get, int]
    ) -> None:
        try:
            response = await self._etcd.txn([], list(positions))
        except BaseException as error:
            _fail([future for _, future in batch], error)
            return
        for gets, future in batch:
            if not future.done():
                future.set_result([response.range(positions[get]) for get in gets])


def _fail(futures: Sequence[asyncio.Future[Any]], error: BaseException) -> None:
    """Hands ``error`` to every caller still waiting; a cancellation of the sender goes on up."""
    for future in futures:
        if not future.done():
            future.set_exception(error)
    if isinstance(error, asyncio.CancelledError):
        raise error
