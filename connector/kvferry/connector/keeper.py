"""``RetentionKeeper``: the retention table's side of the sidecar link (kvferry.connector.sidecar_link).

It hands the link the calls to make (reports of new retentions, EndRetention for the ends this
engine starts) and turns what comes back (acknowledgements, refusals, confirmations, the release
stream's SYNC/RENEWED/ENDED with their registry revisions) into the table's transitions, logging
each one. Plain Python over the table: the connector's scheduler half owns one, tests drive one
against a real sidecar without vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
from kvferry.connector.retention import EndReason, RetainedEntry, RetentionTable
from kvferry.connector.sidecar_link import EndCall, RetentionReport

logger = logging.getLogger("kvferry.connector.keeper")

# Refusals that say the report was not published (the registry or sidecar judged it and said no).
_NOT_PUBLISHED = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)


class RetentionKeeper:
    """Implements :class:`kvferry.connector.sidecar_link.ReleaseListener` over a table.

    ``on_change`` runs after anything the registry said (on the link's thread): the owner pokes the
    link (a call may be due) and its free timer (a free may have moved).
    """

    def __init__(
        self,
        table: RetentionTable,
        *,
        engine_id: str,
        lease_ttl_seconds: int,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.table = table
        self.engine_id = engine_id
        self.lease_ttl_seconds = lease_ttl_seconds
        self._on_change = on_change

    def report(self, entry: RetainedEntry) -> RetentionReport:
        return RetentionReport(
            tenant=entry.tenant,
            conversation_id=entry.conversation_id,
            engine_id=self.engine_id,
            request_id=entry.request_id,
            block_ids=entry.block_ids,
            num_tokens=entry.num_tokens,
            block_digests=entry.block_digests,
            turn=entry.turn,
            ttl_seconds=self.lease_ttl_seconds,
            block_generations=entry.block_generations,
            tier=entry.tier,
            relocates=entry.relocates,
        )

    def collect_frees(self) -> list[RetainedEntry]:
        """What must be freed now (``confirmed`` false: at the hard cap, without the registry's word).

        Live retentions past their hard cap first ask the registry to end them (freed once it
        confirms, or a grace later without it).
        """
        capped = self.table.begin_hard_caps()
        if capped:
            logger.info(
                "hard cap reached; asking the registry to end the retentions before freeing",
                extra={"request_ids": [e.request_id for e in capped]},
            )
            self._on_change()
        return self.table.collect_due()

    # -- calls -----------------------------------------------------------------------------------

    def take_call(self) -> RetentionReport | EndCall | None:
        taken = self.table.take_call()
        if taken is None:
            return None
        kind, entry = taken
        if kind == "report":
            return self.report(entry)
        reason = entry.end_reason or EndReason.RELEASED
        return EndCall(entry.tenant, entry.conversation_id, entry.request_id, reason)

    def on_acknowledged(
        self, report: RetentionReport, lease_expire_wall: float | None, revision: int
    ) -> None:
        self.table.acknowledged(
            report.request_id,
            lease_expire_wall,
            revision,
            tenant=report.tenant,
            conversation_id=report.conversation_id,
        )
        self._on_change()

    def on_report_refused(self, report: RetentionReport, code: grpc.StatusCode, details: str) -> None:
        if code not in _NOT_PUBLISHED:
            # An internal failure may come after the publish landed: end it in the registry first.
            self.table.report_failed(report.request_id)
        restored = self.table.refused(report.request_id)
        logger.info(
            "retention refused by the registry; freed once the end is confirmed",
            extra={
                "request_id": report.request_id,
                "conversation_id": report.conversation_id,
                "turn": report.turn,
                "code": code.name,
                "details": details,
                "kept": [e.request_id for e in restored],
            },
        )
        self._on_change()

    def on_report_failed(self, report: RetentionReport) -> None:
        self.table.report_failed(report.request_id)

    def on_end_confirmed(self, call: EndCall, ended: bool, revision: int) -> None:
        if self.table.end_confirmed(call.request_id, revision):
            logger.info(
                "retention end confirmed; releasing after grace",
                extra={
                    "request_id": call.request_id,
                    "reason": call.reason.value,
                    "was_live": ended,
                    "revision": revision,
                },
            )
        self._on_change()

    def on_end_refused(self, call: EndCall, code: grpc.StatusCode, details: str) -> None:
        self.table.end_call_refused(call.request_id)
        logger.warning(
            "sidecar refused to end a retention; asking again later (the hard cap bounds the hold)",
            extra={"request_id": call.request_id, "code": code.name, "details": details},
        )

    # -- the release stream ----------------------------------------------------------------------

    def on_sync(self, live_request_ids: list[str], revision: int) -> None:
        ended = self.table.sync(live_request_ids, revision)
        if ended:
            logger.info(
                "registry no longer holds retentions; releasing after grace",
                extra={"request_ids": ended, "revision": revision},
            )
        self._on_change()

    def on_renewed(self, request_id: str, lease_expire_wall: float | None, revision: int) -> None:
        self.table.renew(request_id, lease_expire_wall, revision)
        self._on_change()

    def on_ended(self, request_id: str, reason: EndReason, revision: int) -> None:
        if self.table.end(request_id, reason, revision):
            logger.info(
                "retention ended; releasing after grace",
                extra={"request_id": request_id, "reason": reason.value, "revision": revision},
            )
        self._on_change()
