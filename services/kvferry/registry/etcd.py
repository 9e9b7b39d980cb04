"""A thin typed gateway to etcd's v3 API over the ``aetcd`` client's connection.

``aetcd`` owns the gRPC channel and the etcd message types; this module calls etcd's KV, Lease
and Watch stubs directly so that every call carries its own deadline, transactions return
their full response (header revision, nested results), and a watch yields whole revisions
(all events of one transaction together). Every failure becomes a registry error:
``EtcdUnavailable`` for deadlines and refused connections, so callers fail fast.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aetcd
import grpc
from aetcd import rpc
from kvferry.registry.errors import EtcdFailure, EtcdUnavailable

log = logging.getLogger(__name__)

# Reconnect quickly after etcd comes back (gRPC's default backoff grows to 120 s), and notice
# a silently dead etcd on long-lived watch streams.
_CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 1,
    "grpc.max_receive_message_length": 64 * 1024 * 1024,
}

_UNAVAILABLE_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}

# etcd message types, re-exported so the store builds requests without reaching into aetcd.
RangeRequest = rpc.RangeRequest
PutRequest = rpc.PutRequest
DeleteRangeRequest = rpc.DeleteRangeRequest
RequestOp = rpc.RequestOp
TxnRequest = rpc.TxnRequest
Compare = rpc.Compare
EVENT_PUT = rpc.Event.PUT
EVENT_DELETE = rpc.Event.DELETE


class LeaseNotFound(Exception):
    """etcd no longer knows the lease (it expired or was revoked)."""


class RevisionCompacted(Exception):
    """A watch asked for history etcd has compacted away."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"etcd compacted its history up to revision {compact_revision}")
        self.compact_revision = compact_revision


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    return bytes(aetcd.utils.prefix_range_end(prefix))


# --- request builders -------------------------------------------------------------------------


def op_range(key: bytes, range_end: bytes = b"", *, limit: int = 0, keys_only: bool = False) -> Any:
    return rpc.RequestOp(
        request_range=rpc.RangeRequest(key=key, range_end=range_end, limit=limit, keys_only=keys_only)
    )


def op_put(key: bytes, value: bytes, lease: int = 0, *, prev_kv: bool = False) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease, prev_kv=prev_kv))


def op_delete(key: bytes, *, prev_kv: bool = False) -> Any:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key, prev_kv=prev_kv))


def op_txn(compare: Sequence[Any], success: Sequence[Any], failure: Sequence[Any] = ()) -> Any:
    return rpc.RequestOp(
        request_txn=rpc.TxnRequest(compare=list(compare), success=list(success), failure=list(failure))
    )


def cmp_mod_revision(key: bytes, revision: int) -> Any:
    """True when ``key`` was last modified at ``revision`` (0: the key does not exist)."""
    return rpc.Compare(key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=revision)


def cmp_lease(key: bytes, lease: int) -> Any:
    """True when ``key`` exists and is attached to ``lease``."""
    return rpc.Compare(key=key, target=rpc.Compare.LEASE, result=rpc.Compare.EQUAL, lease=lease)


def cmp_exists(key: bytes) -> Any:
    return rpc.Compare(key=key, target=rpc.Compare.VERSION, result=rpc.Compare.GREATER, version=0)


@dataclass(frozen=True)
class EtcdSettings:
    """Where etcd is and how long any single call may take."""

    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    timeout_seconds: float = 2.0


def grpc_target(endpoints: Sequence[str]) -> tuple[str, int]:
    """The (host, port) pair aetcd joins into a gRPC target.

    Several endpoints become one ``ipv4:a:1,b:2`` target (gRPC fails over between them); that
    form needs IP literals, so with host names only the first endpoint is used.
    """
    if not endpoints:
        raise ValueError("at least one etcd endpoint is required")
    parsed: list[tuple[str, int]] = []
    for endpoint in endpoints:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"etcd endpoint {endpoint!r} must be host:port")
        parsed.append((host, int(port)))
    if len(parsed) == 1:
        return parsed[0]

    def is_ip(host: str) -> bool:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return False
        return True

    if not all(is_ip(host) for host, _ in parsed):
        log.warning(
            "several etcd endpoints need IP literals; using only the first", extra={"endpoints": endpoints}
        )
        return parsed[0]
    head = ",".join(f"{host}:{port}" for host, port in parsed[:-1])
    last_host, last_port = parsed[-1]
    return f"ipv4:{head},{last_host}", last_port


class _KeepAliveStream:
    """One long-lived LeaseKeepAlive stream renewing any lease.

    etcd answers a stream's requests one by one, in order, so responses are matched to callers
    first-in first-out. Opening a stream per renewal costs about three times a read in the
    client; reusing one costs about the same as a read. A broken stream fails its waiting
    callers and is reopened by the next renewal.
    """

    def __init__(self, stub: Any, describe_error: Callable[[BaseException], Exception]) -> None:
        self._stub = stub
        self._describe_error = describe_error
        self._requests: asyncio.Queue[Any] = asyncio.Queue()
        self._waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._reader: asyncio.Task[None] | None = None

    def _ensure_open(self) -> None:
        if self._reader is not None and not self._reader.done():
            return
        requests: asyncio.Queue[Any] = asyncio.Queue()
        waiting: collections.deque[asyncio.Future[Any]] = collections.deque()

        async def outgoing() -> AsyncIterator[Any]:
            while True:
                request = await requests.get()
                if request is None:
                    return
                yield request

        call = self._stub.LeaseKeepAlive(outgoing())
        self._requests, self._waiting = requests, waiting
        self._reader = asyncio.create_task(self._read(call, waiting), name="etcd-lease-keepalive")

    async def _read(self, call: Any, waiting: collections.deque[asyncio.Future[Any]]) -> None:
        error: Exception
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    raise EtcdUnavailable("etcd closed the lease keep-alive stream")
                if waiting:
                    future = waiting.popleft()
                    if not future.done():
                        future.set_result(response)
        except asyncio.CancelledError:
            error = EtcdUnavailable("the lease keep-alive stream was closed")
            raise
        except Exception as failure:
            error = self._describe_error(failure)
        finally:
            call.cancel()
            while waiting:
                future = waiting.popleft()
                if not future.done():
                    future.set_exception(error)

    async def renew(self, lease_id: int, timeout_seconds: float) -> Any:
        self._ensure_open()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # A caller that gave up leaves its future behind: keep its failure from being reported.
        future.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._waiting.append(future)
        self._requests.put_nowait(rpc.LeaseKeepAliveRequest(ID=lease_id))
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_seconds)
        except TimeoutError:
            raise EtcdUnavailable(
                f"etcd did not renew lease {lease_id:x} within {timeout_seconds:g} s"
            ) from None

    async def close(self) -> None:
        if self._reader is not None:
            self._requests.put_nowait(None)
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
            self._reader = None


def _ignore_error(op: str) -> None:
    pass


class EtcdGateway:
    """etcd's KV, Lease and Watch calls with deadlines and registry errors.

    ``on_error(op)`` is told of every failed call (``op``: etcd's RPC name, e.g. ``txn``,
    ``lease_keepalive``); outcomes that are answers, not failures (an unknown lease, compacted
    history), are not reported.
    """

    # Renewals spread over a few keep-alive streams, since etcd serves one stream sequentially.
    KEEPALIVE_STREAMS = 4

    def __init__(self, settings: EtcdSettings, *, on_error: Callable[[str], None] = _ignore_error) -> None:
        self.settings = settings
        self._on_error = on_error
        host, port = grpc_target(settings.endpoints)
        self._client = aetcd.Client(host=host, port=port, timeout=None, options=dict(_CHANNEL_OPTIONS))
        self._kv: Any = None
        self._lease: Any = None
        self._watch: Any = None
        self._keepalives: list[_KeepAliveStream] = []
        self._next_keepalive = 0

    @property
    def endpoints_text(self) -> str:
        return ",".join(self.settings.endpoints)

    async def connect(self) -> None:
        """Builds the channel; it connects lazily and reconnects by itself when etcd returns."""
        await self._client.connect()
        self._kv = rpc.KVStub(self._client.channel)
        self._lease = rpc.LeaseStub(self._client.channel)
        self._watch = rpc.WatchStub(self._client.channel)
        self._keepalives = [
            _KeepAliveStream(self._lease, self._describe) for _ in range(self.KEEPALIVE_STREAMS)
        ]

    async def close(self) -> None:
        for stream in self._keepalives:
            await stream.close()
        await self._client.close()

    def _describe(self, error: BaseException) -> Exception:
        if isinstance(error, grpc.aio.AioRpcError):
            return self._translate(error, "a lease renewal")
        if isinstance(error, (EtcdUnavailable, EtcdFailure)):
            return error
        return EtcdFailure(f"lease renewal failed: {error!r}")

    def _translate(self, error: grpc.aio.AioRpcError, what: str) -> Exception:
        code = error.code()
        if code in _UNAVAILABLE_CODES:
            return EtcdUnavailable(
                f"etcd at {self.endpoints_text} did not answer {what} within "
                f"{self.settings.timeout_seconds:g} s ({code.name}: {error.details()}); check that etcd is "
                "running and reachable (--etcd-endpoints / KVFERRY_ETCD_ENDPOINTS), then retry"
            )
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in (error.details() or ""):
            return LeaseNotFound(error.details())
        return EtcdFailure(f"etcd refused {what}: {code.name}: {error.details()}")

    def _failed(self, op: str, error: Exception) -> Exception:
        """Counts ``error`` against ``op`` when it is a failure, and returns it for raising."""
        if isinstance(error, (EtcdUnavailable, EtcdFailure)):
            self._on_error(op)
        return error

    async def _call(self, op: str, what: str, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self.settings.timeout_seconds)
        except grpc.aio.AioRpcError as error:
            raise self._failed(op, self._translate(error, what)) from None

    # --- KV ---------------------------------------------------------------------------------

    async def range(
        self, key: bytes, range_end: bytes = b"", *, limit: int = 0, keys_only: bool = False
    ) -> Any:
        request = rpc.RangeRequest(key=key, range_end=range_end, limit=limit, keys_only=keys_only)
        return await self._call("range", "a read", self._kv.Range, request)

    async def txn(self, compare: Sequence[Any], success: Sequence[Any], failure: Sequence[Any] = ()) -> Any:
        request = rpc.TxnRequest(compare=list(compare), success=list(success), failure=list(failure))
        return await self._call("txn", "a transaction", self._kv.Txn, request)

    async def current_revision(self) -> int:
        response = await self.range(b"\0", limit=1, keys_only=True)
        return int(response.header.revision)

    async def count(self, key: bytes, range_end: bytes) -> int:
        """How many keys lie in ``[key, range_end)``; etcd counts them without sending them."""
        request = rpc.RangeRequest(key=key, range_end=range_end, count_only=True)
        response = await self._call("range", "a count", self._kv.Range, request)
        return int(response.count)

    async def compact(self, revision: int) -> None:
        """Drops history before ``revision`` (already-compacted revisions are not an error)."""
        try:
            await self._kv.Compact(
                rpc.CompactionRequest(revision=revision), timeout=self.settings.timeout_seconds
            )
        except grpc.aio.AioRpcError as rpc_error:
            error = self._translate(rpc_error, "a compaction")
            if isinstance(error, EtcdFailure) and "compacted" in str(error):
                return
            raise self._failed("compact", error) from None

    # --- leases -----------------------------------------------------------------------------

    async def grant(self, ttl_seconds: int) -> tuple[int, int]:
        """A fresh lease: (lease id, granted TTL in seconds)."""
        response = await self._call(
            "lease_grant", "a lease grant", self._lease.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl_seconds)
        )
        if response.error:
            raise self._failed(
                "lease_grant", EtcdFailure(f"etcd refused a lease of {ttl_seconds} s: {response.error}")
            )
        return int(response.ID), int(response.TTL)

    async def revoke(self, lease_id: int) -> int:
        """Revokes a lease (deleting its keys); returns the revision. Unknown leases are ignored."""
        try:
            response = await self._call(
                "lease_revoke", "a lease revoke", self._lease.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease_id)
            )
        except LeaseNotFound:
            return 0
        return int(response.header.revision)

    async def keep_alive_once(self, lease_id: int) -> tuple[int, int]:
        """Renews a lease once: (remaining TTL in seconds, revision). Raises LeaseNotFound when gone."""
        stream = self._keepalives[self._next_keepalive % len(self._keepalives)]
        self._next_keepalive += 1
        try:
            response = await stream.renew(lease_id, self.settings.timeout_seconds)
        except (EtcdUnavailable, EtcdFailure) as error:
            raise self._failed("lease_keepalive", error) from None
        if response.TTL <= 0:
            raise LeaseNotFound(f"lease {lease_id:x} not found")
        return int(response.TTL), int(response.header.revision)

    # --- watch ------------------------------------------------------------------------------

    async def watch(
        self, key: bytes, range_end: bytes, *, start_revision: int, prev_kv: bool = True
    ) -> AsyncIterator[Any]:
        """Yields etcd WatchResponses (each one whole revision or more) from ``start_revision``.

        Raises EtcdUnavailable when the stream breaks and RevisionCompacted when the history
        asked for is gone; the caller resumes from the last revision it saw.
        """
        create = rpc.WatchRequest(
            create_request=rpc.WatchCreateRequest(
                key=key, range_end=range_end, start_revision=start_revision, prev_kv=prev_kv
            )
        )
        hold_open = asyncio.Event()

        async def requests() -> AsyncIterator[Any]:
            yield create
            # Closing the request side would end the watch; wait until the consumer leaves.
            await hold_open.wait()

        call = self._watch.Watch(requests())
        try:
            while True:
                try:
                    response = await call.read()
                except grpc.aio.AioRpcError as error:
                    raise self._failed("watch", self._translate(error, "a watch")) from None
                if response is grpc.aio.EOF:
                    raise self._failed(
                        "watch", EtcdUnavailable(f"etcd at {self.endpoints_text} closed a watch stream")
                    )
                if response.compact_revision:
                    raise RevisionCompacted(int(response.compact_revision))
                if response.canceled:
                    raise self._failed(
                        "watch", EtcdFailure(f"etcd canceled a watch: {response.cancel_reason}")
                    )
                if response.events:
                    yield response
        finally:
            hold_open.set()
            call.cancel()
