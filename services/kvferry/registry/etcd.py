"""The registry's one gateway to etcd: the only module that speaks ``aetcd``.

``aetcd`` owns the gRPC channel and etcd's message types; this module calls etcd's KV, Lease
and Watch stubs directly so that every call carries its own deadline, and it turns etcd's
messages into small typed values both ways:

- requests: ``Get``, ``Put``, ``Delete`` and ``Txn`` operations, guarded by ``ModRevisionIs`` and
  ``LeaseIs`` compares;
- results: ``KeyValue``, ``RangeResult``, ``PutResult``, ``DeleteResult``, ``TxnResult`` (with the
  store revision, nested results included), ``Lease``, ``LeaseRenewal``, and ``WatchEvent``s, a whole
  revision at a time (all events of one transaction together);
- errors: ``EtcdUnavailable`` for deadlines and refused connections (so callers fail fast),
  ``EtcdFailure`` for anything unexpected, ``LeaseNotFound`` and ``RevisionCompacted`` for the
  answers callers act on (``RevisionRewound`` when a watch asks for revisions etcd no longer
  reaches).

It also notices etcd going back in time (restored from an older snapshot): etcd answers
linearizably, so an answer older than one seen before its call was sent means the history went
back. That answer is refused (``EtcdUnavailable``), ``on_rewind`` runs, and until it has returned
every other call waits for it; the calls ``on_rewind`` makes itself go through.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import enum
import ipaddress
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aetcd
import grpc
from aetcd import rpc
from kvferry.registry.errors import EtcdFailure, EtcdNoSpace, EtcdUnavailable
from kvferry.runtime.backoff import BackoffPolicy
from kvferry.runtime.errors import ServiceError
from kvferry.runtime.tls import TlsFiles, open_channel

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

# Watches resume after an etcd outage: 0.1 s doubling to 2 s.
RECONNECT_BACKOFF = BackoffPolicy(initial_seconds=0.1, max_seconds=2.0, jitter=0.0)

_UNAVAILABLE_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class LeaseNotFound(Exception):
    """etcd no longer knows the lease (it expired or was revoked)."""


class RevisionCompacted(Exception):
    """A watch asked for history etcd has compacted away."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"etcd compacted its history up to revision {compact_revision}")
        self.compact_revision = compact_revision


class RevisionRewound(RevisionCompacted):
    """A watch asked to resume after a revision etcd has not reached: etcd went back in time
    (restored from an older snapshot). Handled as compacted history: what happened since is lost."""

    def __init__(self, current_revision: int, start_revision: int) -> None:
        Exception.__init__(
            self,
            f"etcd is at revision {current_revision}, behind the watch's {start_revision - 1}: it went back "
            "in time (restored from an older snapshot?)",
        )
        self.compact_revision = current_revision


# The calls whose answer's revision is evidence of etcd going back in time (see _call).
_REVISION_EVIDENCE = frozenset({"range", "txn"})

# Set in the task resolving a rewind (and the tasks it starts): its own calls do not wait for it.
_resolving_rewind: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "kvferry_etcd_resolving_rewind", default=False
)


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    return bytes(aetcd.utils.prefix_range_end(prefix))


# The values below are plain slotted dataclasses, not frozen ones: the hot paths build several
# per call, and a frozen one costs three times as much to build (1.2 µs against 0.4 µs on
# Python 3.11). Treat them as immutable all the same.

# --- what etcd holds --------------------------------------------------------------------------


@dataclass(slots=True)
class KeyValue:
    """One key as etcd holds it: the lease it lives under (0: none), the revision that last wrote it."""

    key: bytes
    value: bytes
    lease: int
    mod_revision: int


# --- compares ---------------------------------------------------------------------------------


@dataclass(slots=True)
class ModRevisionIs:
    """True when ``key`` was last written at ``revision`` (0: the key does not exist)."""

    key: bytes
    revision: int


@dataclass(slots=True)
class LeaseIs:
    """True when ``key`` exists and lives under ``lease``."""

    key: bytes
    lease: int


Compare = ModRevisionIs | LeaseIs


# --- operations -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Get:
    """Reads ``key``, or ``[key, range_end)`` when ``range_end`` is given (at most ``limit``, 0: all)."""

    key: bytes
    range_end: bytes = b""
    limit: int = 0
    keys_only: bool = False


@dataclass(slots=True)
class Put:
    """Writes ``key`` under ``lease`` (0: none); ``prev_kv`` asks for what it replaced."""

    key: bytes
    value: bytes
    lease: int = 0
    prev_kv: bool = False


@dataclass(slots=True)
class Delete:
    """Deletes ``key``, or every key in ``[key, range_end)`` when ``range_end`` is given."""

    key: bytes
    range_end: bytes = b""


@dataclass(slots=True)
class Txn:
    """If every compare holds, the ``success`` operations run, else the ``failure`` ones; atomically.

    A ``Txn`` is also an operation: nested in another, it is judged by its own compares.
    """

    compare: Sequence[Compare] = ()
    success: Sequence[Op] = ()
    failure: Sequence[Op] = ()

    def written_keys(self) -> set[bytes]:
        """The keys either branch writes (etcd refuses a transaction that writes one key twice)."""
        keys: set[bytes] = set()
        for operation in (*self.success, *self.failure):
            if isinstance(operation, (Put, Delete)):
                keys.add(operation.key)
            elif isinstance(operation, Txn):
                keys |= operation.written_keys()
        return keys

    def request_bytes(self) -> int:
        """About what it weighs on the wire (keys and values): etcd refuses requests past
        ``--max-request-bytes`` (1.5 MiB by default)."""
        size = sum(len(compare.key) for compare in self.compare)
        for operation in (*self.success, *self.failure):
            if isinstance(operation, Put):
                size += len(operation.key) + len(operation.value)
            elif isinstance(operation, Txn):
                size += operation.request_bytes()
            else:
                size += len(operation.key)
        return size


Op = Get | Put | Delete | Txn


# --- results ----------------------------------------------------------------------------------


@dataclass(slots=True)
class RangeResult:
    """What a read found (``more``: the limit cut it short; ``count``: every key in the range)."""

    kvs: list[KeyValue]
    more: bool
    count: int
    revision: int

    @property
    def first(self) -> KeyValue | None:
        return self.kvs[0] if self.kvs else None


@dataclass(slots=True)
class PutResult:
    """``previous``: what the put replaced, when asked for and the key existed."""

    previous: KeyValue | None
    revision: int


@dataclass(slots=True)
class DeleteResult:
    deleted: int
    revision: int


@dataclass(slots=True)
class TxnResult:
    """Which branch ran, the result of each of its operations in order, and the store revision."""

    succeeded: bool
    results: Sequence[OpResult]
    revision: int

    def range(self, index: int) -> RangeResult:
        return _expect(self.results[index], RangeResult)

    def put(self, index: int) -> PutResult:
        return _expect(self.results[index], PutResult)

    def txn(self, index: int) -> TxnResult:
        return _expect(self.results[index], TxnResult)


OpResult = RangeResult | PutResult | DeleteResult | TxnResult
_Result = TypeVar("_Result", RangeResult, PutResult, DeleteResult, TxnResult)


def _expect(result: OpResult, kind: type[_Result]) -> _Result:
    if not isinstance(result, kind):
        raise TypeError(f"expected a {kind.__name__} at this position of the transaction, got {result!r}")
    return result


@dataclass(slots=True)
class Lease:
    id: int
    ttl_seconds: int


@dataclass(slots=True)
class LeaseRenewal:
    """A lease keep-alive's answer: the TTL it restored, and the store revision."""

    ttl_seconds: int
    revision: int


class EventType(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(slots=True)
class WatchEvent:
    """One key's change; ``previous`` is its value before (None when it did not exist)."""

    type: EventType
    kv: KeyValue
    previous: KeyValue | None

    @property
    def revision(self) -> int:
        return self.kv.mod_revision


# --- typed values <-> etcd's messages ---------------------------------------------------------


def _compare_message(compare: Compare) -> Any:
    if isinstance(compare, ModRevisionIs):
        return rpc.Compare(
            key=compare.key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=compare.revision
        )
    return rpc.Compare(
        key=compare.key, target=rpc.Compare.LEASE, result=rpc.Compare.EQUAL, lease=compare.lease
    )


def _range_request(get: Get, *, count_only: bool = False) -> Any:
    if not (get.range_end or get.limit or get.keys_only or count_only):
        return rpc.RangeRequest(key=get.key)  # the common case (one key), a little cheaper to build
    return rpc.RangeRequest(
        key=get.key, range_end=get.range_end, limit=get.limit, keys_only=get.keys_only, count_only=count_only
    )


def _txn_request(txn: Txn) -> Any:
    return rpc.TxnRequest(
        compare=[_compare_message(compare) for compare in txn.compare],
        success=[_op_message(operation) for operation in txn.success],
        failure=[_op_message(operation) for operation in txn.failure],
    )


def _op_message(operation: Op) -> Any:
    if isinstance(operation, Put):
        return rpc.RequestOp(
            request_put=rpc.PutRequest(
                key=operation.key, value=operation.value, lease=operation.lease, prev_kv=operation.prev_kv
            )
        )
    if isinstance(operation, Get):
        return rpc.RequestOp(request_range=_range_request(operation))
    if isinstance(operation, Delete):
        return rpc.RequestOp(
            request_delete_range=rpc.DeleteRangeRequest(key=operation.key, range_end=operation.range_end)
        )
    return rpc.RequestOp(request_txn=_txn_request(operation))


def _key_value(message: Any) -> KeyValue:
    return KeyValue(message.key, message.value, int(message.lease), int(message.mod_revision))


def _present(message: Any) -> KeyValue | None:
    """A KeyValue, or None for the empty message etcd sends when there was none."""
    return _key_value(message) if message.key else None


def _range_result(response: Any, revision: int) -> RangeResult:
    return RangeResult(
        [_key_value(kv) for kv in response.kvs], bool(response.more), int(response.count), revision
    )


def _txn_result(response: Any, revision: int) -> TxnResult:
    return TxnResult(
        bool(response.succeeded), [_op_result(nested, revision) for nested in response.responses], revision
    )


def _op_result(response: Any, revision: int) -> OpResult:
    # Nested responses carry no header of their own: the transaction's revision is theirs.
    kind = response.WhichOneof("response")
    if kind == "response_range":
        return _range_result(response.response_range, revision)
    if kind == "response_put":
        return PutResult(_present(response.response_put.prev_kv), revision)
    if kind == "response_delete_range":
        return DeleteResult(int(response.response_delete_range.deleted), revision)
    return _txn_result(response.response_txn, revision)


def _watch_event(event: Any) -> WatchEvent:
    kind = EventType.DELETE if event.type == rpc.Event.DELETE else EventType.PUT
    return WatchEvent(kind, _key_value(event.kv), _present(event.prev_kv))


@dataclass(frozen=True)
class EtcdSettings:
    """Where etcd is and how long any single call may take."""

    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    timeout_seconds: float = 2.0
    # Mutual TLS to etcd (its --client-cert-auth); None: plaintext.
    tls: TlsFiles | None = None


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


async def _ignore_rewind(seen_revision: int, revision: int) -> None:
    pass


# How etcd words a write refused for its space quota (RESOURCE_EXHAUSTED).
_NOSPACE_DETAIL = "database space exceeded"
# How gRPC words a request past the server's limit (RESOURCE_EXHAUSTED, not an outage).
_TOO_LARGE_DETAIL = "larger than max"


@dataclass(frozen=True)
class EtcdStatus:
    """What one etcd member says of itself: its database size, and the space in use in it."""

    db_size: int
    db_size_in_use: int
    revision: int


class EtcdGateway:
    """etcd's KV, Lease and Watch calls with deadlines, typed values and registry errors.

    ``on_error(op)`` is told of every failed call (``op``: etcd's RPC name, e.g. ``txn``,
    ``lease_keepalive``); outcomes that are answers, not failures (an unknown lease, compacted
    history), are not reported. ``on_rewind(seen_revision, revision)`` is awaited when etcd
    answers at a revision older than one seen before (see the module docstring).
    """

    # Renewals spread over a few keep-alive streams, since etcd serves one stream sequentially.
    KEEPALIVE_STREAMS = 4

    def __init__(
        self,
        settings: EtcdSettings,
        *,
        on_error: Callable[[str], None] = _ignore_error,
        on_rewind: Callable[[int, int], Awaitable[None]] = _ignore_rewind,
    ) -> None:
        self.settings = settings
        self._on_error = on_error
        self.on_rewind = on_rewind
        # The highest store revision an answer carried, and a rewind being resolved.
        self.high_water = 0
        self._rewind: asyncio.Future[None] | None = None
        host, port = grpc_target(settings.endpoints)
        self._client = aetcd.Client(host=host, port=port, timeout=None, options=dict(_CHANNEL_OPTIONS))
        self._tls_channel: grpc.aio.Channel | None = None
        self._kv: Any = None
        self._lease: Any = None
        self._watch: Any = None
        self._maintenance: Any = None
        self._keepalives: list[_KeepAliveStream] = []
        self._next_keepalive = 0

    @property
    def endpoints_text(self) -> str:
        return ",".join(self.settings.endpoints)

    async def connect(self) -> None:
        """Builds the channel; it connects lazily and reconnects by itself when etcd returns."""
        if self.settings.tls is None:
            await self._client.connect()
            channel = self._client.channel
        else:
            # aetcd builds plaintext channels only; the gateway uses nothing of its client but the channel.
            host, port = grpc_target(self.settings.endpoints)
            channel = self._tls_channel = open_channel(
                f"{host}:{port}", self.settings.tls, options=list(_CHANNEL_OPTIONS.items())
            )
        self._kv = rpc.KVStub(channel)
        self._lease = rpc.LeaseStub(channel)
        self._watch = rpc.WatchStub(channel)
        self._maintenance = rpc.MaintenanceStub(channel)
        self._keepalives = [
            _KeepAliveStream(self._lease, self._describe) for _ in range(self.KEEPALIVE_STREAMS)
        ]

    async def close(self) -> None:
        for stream in self._keepalives:
            await stream.close()
        await self._client.close()
        if self._tls_channel is not None:
            await self._tls_channel.close()

    def _describe(self, error: BaseException) -> Exception:
        if isinstance(error, grpc.aio.AioRpcError):
            return self._translate(error, "a lease renewal")
        if isinstance(error, (EtcdUnavailable, EtcdFailure)):
            return error
        return EtcdFailure(f"lease renewal failed: {error!r}")

    def _translate(self, error: grpc.aio.AioRpcError, what: str) -> Exception:
        code = error.code()
        if _TOO_LARGE_DETAIL in (error.details() or ""):
            return EtcdFailure(
                f"etcd at {self.endpoints_text} refused {what} as too large ({error.details()}); keep "
                "requests under etcd's --max-request-bytes"
            )
        if _NOSPACE_DETAIL in (error.details() or ""):
            return EtcdNoSpace(
                f"etcd at {self.endpoints_text} refused {what}: it is out of space (NOSPACE alarm: its "
                "database reached --quota-backend-bytes) and refuses every write until an operator frees "
                "space: compact, defragment (etcdctl defrag) and disarm the alarm (etcdctl alarm disarm). "
                "Reads still work; the registry reports NOT_SERVING meanwhile"
            )
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
        if self._rewind is not None and not _resolving_rewind.get():
            await asyncio.shield(self._rewind)
        seen = self.high_water
        try:
            response = await method(request, timeout=self.settings.timeout_seconds)
        except grpc.aio.AioRpcError as error:
            raise self._failed(op, self._translate(error, what)) from None
        revision = int(response.header.revision)
        # Reads and transactions answer at the serving member's applied revision, which a
        # linearizable call never sees go back; lease calls answer from the leader, which may apply
        # a little behind another member: only the former are evidence.
        if op in _REVISION_EVIDENCE and revision < seen:
            await self._rewound(seen, revision)
            raise EtcdUnavailable(
                f"etcd at {self.endpoints_text} answered at revision {revision}, behind revision {seen} seen "
                "before: it went back in time (restored from an older snapshot?). The registry started "
                "a new epoch; retry"
            )
        if revision > self.high_water:
            self.high_water = revision
        return response

    async def _rewound(self, seen: int, revision: int) -> None:
        """Runs ``on_rewind`` once per rewind; calls meanwhile wait for it."""
        if self._rewind is not None:
            if not _resolving_rewind.get():
                await asyncio.shield(self._rewind)
            return
        self.high_water = revision
        self._rewind = asyncio.get_running_loop().create_future()
        token = _resolving_rewind.set(True)
        try:
            await self.on_rewind(seen, revision)
        except Exception:
            log.exception("resolving etcd's rewind failed", extra={"seen": seen, "revision": revision})
        finally:
            _resolving_rewind.reset(token)
            resolved, self._rewind = self._rewind, None
            resolved.set_result(None)

    # --- keys and revisions -----------------------------------------------------------------

    async def range(
        self, key: bytes, range_end: bytes = b"", *, limit: int = 0, keys_only: bool = False
    ) -> RangeResult:
        """Reads ``key``, or ``[key, range_end)`` (at most ``limit`` keys, 0: all)."""
        request = _range_request(Get(key, range_end, limit, keys_only))
        response = await self._call("range", "a read", self._kv.Range, request)
        return _range_result(response, int(response.header.revision))

    async def get(self, key: bytes) -> KeyValue | None:
        """The key, or None when it does not exist."""
        return (await self.range(key)).first

    async def scan(self, start: bytes, end: bytes, *, page_size: int) -> AsyncGenerator[RangeResult, None]:
        """Reads ``[start, end)`` in key order, ``page_size`` keys per read (each a page).

        Pages are separate reads: a key written meanwhile may or may not appear.
        """
        while True:
            page = await self.range(start, end, limit=page_size)
            yield page
            if not page.more or not page.kvs:
                return
            start = page.kvs[-1].key + b"\0"

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        """One atomic transaction: ``success`` if every compare holds, else ``failure``."""
        request = _txn_request(Txn(compare, success, failure))
        response = await self._call("txn", "a transaction", self._kv.Txn, request)
        return _txn_result(response, int(response.header.revision))

    async def current_revision(self) -> int:
        response = await self.range(b"\0", limit=1, keys_only=True)
        return response.revision

    async def count(self, key: bytes, range_end: bytes) -> int:
        """How many keys lie in ``[key, range_end)``; etcd counts them without sending them."""
        request = _range_request(Get(key, range_end), count_only=True)
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

    async def alarms(self) -> list[str]:
        """etcd's raised alarms, by name (``NOSPACE``: out of quota, every write refused)."""
        request = rpc.AlarmRequest(action=rpc.AlarmRequest.GET, memberID=0, alarm=rpc.AlarmType.NONE)
        response = await self._call("alarm", "an alarm query", self._maintenance.Alarm, request)
        return sorted({rpc.AlarmType.Name(member.alarm) for member in response.alarms})

    async def status(self) -> EtcdStatus:
        """The answering member's status (database size, space in use)."""
        response = await self._call("status", "a status query", self._maintenance.Status, rpc.StatusRequest())
        return EtcdStatus(int(response.dbSize), int(response.dbSizeInUse), int(response.header.revision))

    # --- leases -----------------------------------------------------------------------------

    async def grant(self, ttl_seconds: int) -> Lease:
        """A fresh lease; etcd may grant a longer TTL than asked (its minimum)."""
        response = await self._call(
            "lease_grant", "a lease grant", self._lease.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl_seconds)
        )
        if response.error:
            raise self._failed(
                "lease_grant", EtcdFailure(f"etcd refused a lease of {ttl_seconds} s: {response.error}")
            )
        return Lease(int(response.ID), int(response.TTL))

    async def revoke(self, lease_id: int) -> int:
        """Revokes a lease (deleting its keys); returns the revision. Unknown leases are ignored."""
        try:
            response = await self._call(
                "lease_revoke", "a lease revoke", self._lease.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease_id)
            )
        except LeaseNotFound:
            return 0
        return int(response.header.revision)

    async def revoke_quietly(self, lease_id: int, why: str) -> None:
        """Revokes a lease as a courtesy: a failure is logged, and the lease's TTL ends it anyway."""
        try:
            await self.revoke(lease_id)
        except ServiceError as error:
            log.warning(
                "lease not revoked", extra={"lease": f"{lease_id:x}", "why": why, "error": str(error)}
            )

    async def keep_alive_once(self, lease_id: int) -> LeaseRenewal:
        """Renews a lease once. Raises LeaseNotFound when it is gone."""
        stream = self._keepalives[self._next_keepalive % len(self._keepalives)]
        self._next_keepalive += 1
        try:
            response = await stream.renew(lease_id, self.settings.timeout_seconds)
        except (EtcdUnavailable, EtcdFailure) as error:
            raise self._failed("lease_keepalive", error) from None
        if response.TTL <= 0:
            raise LeaseNotFound(f"lease {lease_id:x} not found")
        return LeaseRenewal(int(response.TTL), int(response.header.revision))

    async def time_to_live(self, lease_id: int) -> int:
        """Seconds the lease has left (a read: etcd writes nothing). Raises LeaseNotFound when it is gone."""
        response = await self._call(
            "lease_time_to_live",
            "a lease time-to-live query",
            self._lease.LeaseTimeToLive,
            rpc.LeaseTimeToLiveRequest(ID=lease_id),
        )
        if response.TTL <= 0:
            raise LeaseNotFound(f"lease {lease_id:x} not found")
        return int(response.TTL)

    # --- watch ------------------------------------------------------------------------------

    async def watch(
        self, key: bytes, range_end: bytes, *, start_revision: int, prev_kv: bool = True
    ) -> AsyncGenerator[list[WatchEvent], None]:
        """Yields the events in ``[key, range_end)`` from ``start_revision``, a revision or more at once.

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
                if response.created and int(response.header.revision) < start_revision - 1:
                    raise RevisionRewound(int(response.header.revision), start_revision)
                if response.canceled:
                    raise self._failed(
                        "watch", EtcdFailure(f"etcd canceled a watch: {response.cancel_reason}")
                    )
                if response.events:
                    yield [_watch_event(event) for event in response.events]
        finally:
            hold_open.set()
            call.cancel()
