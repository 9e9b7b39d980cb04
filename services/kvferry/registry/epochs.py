"""The registry's epoch: what makes a restored etcd snapshot's engines and retentions void.

Restoring etcd from an older snapshot brings back engine registrations (with their leases, which
etcd restores with a fresh TTL) and retention records whose blocks their engine freed long ago.
etcd itself cannot tell: its revision simply goes back. Whoever saw a later revision can:

- a registry: its etcd gateway refuses an answer older than one it saw (kvferry.registry.etcd);
- a sidecar: it registers again with the highest revision it saw (``seen_revision``) and the epoch
  of its previous registration, and the registry compares that revision with etcd's; or, when
  others' writes carried etcd's revision past it, with a retention its engine ended that the registry
  served again (``ended_retention``), and the registry finds that record stored as written before the
  end.

Either way the registry starts a new epoch: one etcd transaction writes ``{prefix}epoch`` and deletes
every engine registration. Every engine then registers again (a new incarnation), and the retentions
of the old incarnations are never served (rule 3) and end with ENGINE_GONE (the reaper).

An epoch is a counter and a random nonce. A detector bumps only the epoch it knew: when etcd holds
that same epoch, or an older counter (the restore brought an older epoch back). A different epoch
with a counter as high means someone else already started the new one for this restore.
"""

from __future__ import annotations

import logging
import secrets
import struct
from dataclasses import dataclass

from kvferry.registry.etcd import Delete, EtcdGateway, Get, ModRevisionIs, Put, prefix_end
from kvferry.registry.keys import KeyLayout
from kvferry.registry.metrics import RegistryMetrics
from kvferry.runtime.errors import Aborted

log = logging.getLogger(__name__)

_EPOCH = struct.Struct(">qq")


@dataclass(frozen=True, order=True)
class Epoch:
    counter: int
    nonce: int

    def __str__(self) -> str:
        return f"{self.counter}.{self.nonce:016x}"

    @classmethod
    def parse(cls, text: str) -> Epoch | None:
        counter, _, nonce = text.partition(".")
        try:
            return cls(int(counter), int(nonce, 16))
        except ValueError:
            return None

    def encode(self) -> bytes:
        return _EPOCH.pack(self.counter, self.nonce)

    @classmethod
    def decode(cls, value: bytes | None) -> Epoch:
        if not value or len(value) != _EPOCH.size:
            return NO_EPOCH
        counter, nonce = _EPOCH.unpack(value)
        return cls(counter, nonce)


# Before any epoch was written.
NO_EPOCH = Epoch(0, 0)


def needs_new_epoch(current: Epoch, known: Epoch) -> bool:
    """Whether a detector that knew ``known`` must start a new epoch, etcd holding ``current``."""
    return current == known or current.counter < known.counter


class EpochKeeper:
    """Knows the current epoch; starts a new one when etcd is found restored."""

    def __init__(
        self, etcd: EtcdGateway, layout: KeyLayout, *, metrics: RegistryMetrics | None = None
    ) -> None:
        self.etcd = etcd
        self.layout = layout
        self._metrics = metrics if metrics is not None else RegistryMetrics()
        # None until read from etcd.
        self.known: Epoch | None = None

    async def load(self) -> Epoch:
        kv = await self.etcd.get(self.layout.epoch)
        self.known = Epoch.decode(kv.value if kv is not None else None)
        return self.known

    def saw(self, value: bytes | None) -> Epoch:
        """The epoch key's value as read by some transaction (e.g. a registration)."""
        self.known = Epoch.decode(value)
        return self.known

    async def on_rewind(self, seen_revision: int, revision: int) -> None:
        """The gateway's hook: etcd answered at ``revision`` after this registry saw ``seen_revision``."""
        if self.known is None:
            log.error(
                "etcd went back in time before this registry read its epoch; the sidecars' next "
                "registrations start the new one",
                extra={"seen_revision": seen_revision, "revision": revision},
            )
            return
        await self.restored(
            self.known, f"this registry saw revision {seen_revision}, etcd now answers {revision}"
        )

    async def restored(self, known: Epoch, evidence: str) -> Epoch:
        """etcd is behind what someone saw in epoch ``known``: starts a new epoch unless one was
        started already. Returns the current epoch."""
        key = self.layout.epoch
        for _ in range(4):
            read = await self.etcd.txn([], [Get(key)])
            kv = read.range(0).first
            current = Epoch.decode(kv.value if kv is not None else None)
            if not needs_new_epoch(current, known):
                self.known = current
                return current
            new = Epoch(max(current.counter, known.counter) + 1, secrets.randbits(63))
            engines = self.layout.engines
            started = await self.etcd.txn(
                [ModRevisionIs(key, kv.mod_revision if kv is not None else 0)],
                [Put(key, new.encode()), Delete(engines, prefix_end(engines))],
            )
            if started.succeeded:
                self.known = new
                self._metrics.restore_detected()
                log.error(
                    "etcd was restored from an older snapshot: new epoch, every engine registration "
                    "before it is void (their retentions are never served and end as engine_gone)",
                    extra={"evidence": evidence, "old_epoch": str(current), "epoch": str(new)},
                )
                return new
        raise Aborted("the registry's epoch changed concurrently while starting a new one; retry")
