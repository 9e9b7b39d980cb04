"""What the framework adapters share: keep a conversation alive while any tool runs, close it once.

Frameworks report tool starts and ends as callbacks (possibly several tools at once, possibly an end
without a start after an error); ``ToolLease`` turns them into one ``KeepAlive`` block that runs while
at least one tool is in flight. It imports no framework, so it is tested on its own.
"""

from __future__ import annotations

import logging
from typing import Protocol

from kvferry.sdk._errors import NotFoundError, RpcError
from kvferry.sdk._keepalive import KeepAlive

_log = logging.getLogger("kvferry.sdk.adapters")


class ConversationLeases(Protocol):
    """The part of ``Client`` the adapters use (a protocol, so tests can count calls)."""

    def keep_alive(self, conversation_id: str, *, interval: float | None = None) -> KeepAlive: ...

    async def close_conversation(self, conversation_id: str) -> None: ...


class ToolLease:
    """Renews ``conversation_id`` while tools run; ``close`` releases its retained KV at the end.

    ``renewals`` counts successful renewals over every tool block; ``error`` is the last block's
    failure (the retention lost, say), which never reaches the framework: a lost retention only
    means the next turn recomputes.
    """

    def __init__(self, client: ConversationLeases, conversation_id: str, *, interval: float | None = None):
        self.client = client
        self.conversation_id = conversation_id
        self.interval = interval
        self.renewals = 0
        self.error: RpcError | None = None
        self.closed = False
        self._tools_running: set[object] = set()
        self._keep_alive: KeepAlive | None = None

    @property
    def renewing(self) -> bool:
        return self._keep_alive is not None and self._keep_alive.running

    async def tool_started(self, run_key: object) -> None:
        """A tool began (``run_key`` identifies its run, to match the end)."""
        if self.closed:
            return
        self._tools_running.add(run_key)
        if self._keep_alive is None:
            self._keep_alive = self.client.keep_alive(self.conversation_id, interval=self.interval)
            await self._keep_alive.__aenter__()

    async def tool_ended(self, run_key: object) -> None:
        """A tool finished or failed; renewing stops when no tool is left running."""
        self._tools_running.discard(run_key)
        if not self._tools_running:
            await self._stop_renewing()

    async def close(self) -> None:
        """Stops renewing and releases the conversation's retained KV (idempotent; nothing retained
        is not an error)."""
        if self.closed:
            return
        self.closed = True
        self._tools_running.clear()
        await self._stop_renewing()
        try:
            await self.client.close_conversation(self.conversation_id)
        except NotFoundError:
            pass
        except RpcError as error:
            # The retention still expires with its lease; the run's result must not be lost for this.
            _log.warning(
                "closing the conversation failed: %s", error, extra={"conversation_id": self.conversation_id}
            )

    async def _stop_renewing(self) -> None:
        keep_alive, self._keep_alive = self._keep_alive, None
        if keep_alive is None:
            return
        await keep_alive.stop()
        self.renewals += keep_alive.renewals
        self.error = keep_alive.error


class LeaseAdapter:
    """The surface both framework adapters offer over their ``ToolLease`` (a mixin: each adapter also
    derives from its framework's callback class and sets ``self.lease`` in its ``__init__``)."""

    lease: ToolLease
    close_on_end: bool

    def _start_lease(
        self,
        client: ConversationLeases,
        conversation_id: str,
        *,
        close_on_end: bool,
        interval: float | None,
    ) -> None:
        self.lease = ToolLease(client, conversation_id, interval=interval)
        self.close_on_end = close_on_end

    @property
    def conversation_id(self) -> str:
        return self.lease.conversation_id

    @property
    def renewals(self) -> int:
        """Successful renewals so far."""
        return self.lease.renewals

    @property
    def error(self) -> RpcError | None:
        """Why the last renewal block stopped early (None when it did not)."""
        return self.lease.error

    async def aclose(self) -> None:
        """Stops renewing and closes the conversation (idempotent)."""
        await self.lease.close()
