"""The registry's own errors: etcd's ways of failing, and a conversation's turn already in flight. The
rest are the kit's (``kvferry.runtime.errors``), which also turns them into statuses."""

from __future__ import annotations

from kvferry.runtime.errors import Aborted, Internal, Unavailable


class EtcdUnavailable(Unavailable):
    """etcd did not answer within the deadline or refused the connection."""


class EtcdFailure(Internal):
    """etcd answered with an error the registry does not expect (a bug or a misconfigured etcd)."""


class EtcdNoSpace(EtcdUnavailable):
    """etcd refused a write for its space quota (the NOSPACE alarm is raised): no write succeeds
    until space is freed and the alarm disarmed."""


class TurnInFlight(Aborted):
    """Another turn of the conversation is in flight (its mark is held); the message names it."""
