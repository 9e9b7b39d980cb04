"""The registry's own errors: etcd's ways of failing. The rest are the kit's
(``kvferry.runtime.errors``), which also turns them into statuses."""

from __future__ import annotations

from kvferry.runtime.errors import Internal, Unavailable


class EtcdUnavailable(Unavailable):
    """etcd did not answer within the deadline or refused the connection."""


class EtcdFailure(Internal):
    """etcd answered with an error the registry does not expect (a bug or a misconfigured etcd)."""


class EtcdNoSpace(EtcdUnavailable):
    """etcd refused a write for its space quota (the NOSPACE alarm is raised): no write succeeds
    until space is freed and the alarm disarmed."""
