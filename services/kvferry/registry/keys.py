"""Where the registry keeps things in etcd (all under one operator-chosen prefix).

    {prefix}engines/{engine_id}                              Engine          engine lease
    {prefix}retention/live/{tenant}/{conversation_id}        stored record   the retention's lease
    {prefix}retention/ended/{tenant}/{conversation_id}       tombstone       the retention's lease
    {prefix}retention-holders/{tenant}/{conversation_id}     holder          the retention's lease
    {prefix}engine-retentions/{engine_id}/{tenant}/{conversation_id}
                                                             incarnation     the retention's lease
    {prefix}ended-requests/{engine_id}/{engine_request_id}   tombstone       a lease of its own
    {prefix}turns/{tenant}/{conversation_id}                 RunningTurn     a lease of its own
    {prefix}epoch                                            epoch           none

Ids are restricted to ``[A-Za-z0-9._:-]`` (kvferry.runtime.ids), so ``/`` separates fields
unambiguously. The tenant is part of every retention key: no request names another tenant's
conversation. ``live`` and ``ended`` share the ``retention/`` prefix so one watch sees a deletion
and its tombstone in the same revision.

A live record and its holder (the record's identity without its blocks, read by renewals) are
written once, by the publish, and deleted together. A renewal only keeps their lease alive: it
writes nothing to etcd and ships nothing on a watch, whatever the conversation's length.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConversationKey:
    tenant: str
    conversation_id: str

    @property
    def name(self) -> str:
        """The retention's resource name."""
        return f"tenants/{self.tenant}/conversations/{self.conversation_id}/retention"


@dataclass(frozen=True)
class KeyLayout:
    prefix: str = "/kvferry/"

    def __post_init__(self) -> None:
        if not self.prefix.endswith("/"):
            raise ValueError(f"key prefix {self.prefix!r} must end with '/'")

    @property
    def epoch(self) -> bytes:
        return f"{self.prefix}epoch".encode()

    # engines
    @property
    def engines(self) -> bytes:
        return f"{self.prefix}engines/".encode()

    def engine(self, engine_id: str) -> bytes:
        return self.engines + engine_id.encode()

    def engine_id_of(self, key: bytes) -> str:
        return key[len(self.engines) :].decode()

    # retentions
    @property
    def retention_events(self) -> bytes:
        """Covers live records and tombstones: what one retention watch follows."""
        return f"{self.prefix}retention/".encode()

    @property
    def live_retentions(self) -> bytes:
        return self.retention_events + b"live/"

    @property
    def tombstones(self) -> bytes:
        return self.retention_events + b"ended/"

    def live(self, conversation: ConversationKey) -> bytes:
        return self.live_retentions + f"{conversation.tenant}/{conversation.conversation_id}".encode()

    def tombstone(self, conversation: ConversationKey) -> bytes:
        return self.tombstones + f"{conversation.tenant}/{conversation.conversation_id}".encode()

    @property
    def holders(self) -> bytes:
        return f"{self.prefix}retention-holders/".encode()

    def holder(self, conversation: ConversationKey) -> bytes:
        return self.holders + f"{conversation.tenant}/{conversation.conversation_id}".encode()

    @staticmethod
    def _conversation(tail: bytes) -> ConversationKey:
        tenant, _, conversation_id = tail.decode().partition("/")
        return ConversationKey(tenant, conversation_id)

    def conversation_of_live(self, key: bytes) -> ConversationKey:
        return self._conversation(key[len(self.live_retentions) :])

    def conversation_of_tombstone(self, key: bytes) -> ConversationKey:
        return self._conversation(key[len(self.tombstones) :])

    # per-engine index
    @property
    def engine_indexes(self) -> bytes:
        return f"{self.prefix}engine-retentions/".encode()

    def engine_index_prefix(self, engine_id: str) -> bytes:
        return self.engine_indexes + f"{engine_id}/".encode()

    def engine_index(self, engine_id: str, conversation: ConversationKey) -> bytes:
        return (
            self.engine_index_prefix(engine_id)
            + f"{conversation.tenant}/{conversation.conversation_id}".encode()
        )

    # engine requests their engine ended: never published again
    def ended_request(self, engine_id: str, engine_request_id: str) -> bytes:
        return f"{self.prefix}ended-requests/{engine_id}/{engine_request_id}".encode()

    def index_entry_of(self, key: bytes) -> tuple[str, ConversationKey]:
        engine_id, _, tail = key[len(self.engine_indexes) :].partition(b"/")
        return engine_id.decode(), self._conversation(tail)

    # turns in flight (one per conversation)
    def turn(self, conversation: ConversationKey) -> bytes:
        return f"{self.prefix}turns/{conversation.tenant}/{conversation.conversation_id}".encode()
