"""The fault harness's oracle: what the engines' logs say happened to every block, checked against
rule 1 of docs/design.md ("a block that D has freed, or will free, is never served").

It reads D's and P's JSON log lines (kvferry.testing.standins writes them with the connector's
names and fields; each engine process appends to one file across restarts):

- D ``freed retained blocks``: the retention's request id, block ids, generations after the free,
  reason, and whether the registry confirmed the end first;
- D ``kv read``: every read of D's memory (a stand-in for P's NIXL READ) with ``held``: whether the
  request named still held every block read;
- P ``kv pull``: every pull with ``content_ok`` (the KV read equals the KV of the prompt's tokens:
  the check that depends on the KV itself), ``fenced`` and ``recomputed``;
- D ``pool started`` / ``retained``: a new incarnation (its memory starts empty) and each retention.

Served-after-freed is counted twice, independently: reads D saw of blocks the named request no longer
held (also found from the order of D's own log lines: a read after that request's free), and pulls
whose KV was not the prompt's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvferry.connector.logs import FREED_LOG, RETAINED_LOG


def log_events(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON lines of a log file (other lines, e.g. a crash's traceback, are skipped)."""
    if not path.exists():
        return
    with open(path, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by kill -9
            if isinstance(event, dict):
                yield event


@dataclass
class OracleReport:
    reads: int = 0
    pulls: int = 0
    failed_pulls: int = 0
    frees: int = 0
    frees_by_reason: dict[str, int] = field(default_factory=dict)
    unconfirmed_frees: int = 0
    # Reads of blocks the named request no longer held (D's view at the read).
    reads_after_free: int = 0
    # Reads of a request D had logged as freed before (D's log order).
    reads_after_logged_free: int = 0
    # Pulls whose KV was not the KV of the prompt's tokens.
    wrong_kv_pulls: int = 0
    fenced_pulls: int = 0
    fenced_not_recomputed: int = 0
    # Retentions of D's last incarnation never freed (after the run drained).
    leaked_retentions: int = 0
    leaked_blocks: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def served_after_freed(self) -> int:
        return max(self.reads_after_free, self.reads_after_logged_free, self.wrong_kv_pulls)

    def violations(self) -> list[str]:
        problems = []
        if self.served_after_freed:
            problems.append(
                f"served after freed: {self.reads_after_free} reads of blocks no longer held, "
                f"{self.reads_after_logged_free} after a logged free, {self.wrong_kv_pulls} pulls of wrong KV"
            )
        if self.fenced_not_recomputed:
            problems.append(f"{self.fenced_not_recomputed} fenced pulls were not recomputed")
        if self.leaked_blocks or self.leaked_retentions:
            problems.append(f"leaked: {self.leaked_retentions} retentions, {self.leaked_blocks} blocks")
        return problems

    def summary(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["served_after_freed"] = self.served_after_freed
        fields["examples"] = self.examples[:5]
        return fields


def check(
    decode_logs: Iterable[Path], prefill_logs: Iterable[Path], held_blocks_at_end: int | None
) -> OracleReport:
    """Reads the logs and checks them; ``held_blocks_at_end`` is what D's memory still holds after
    the run drained (every conversation ended and its grace passed)."""
    report = OracleReport()
    live: dict[str, int] = {}
    for path in decode_logs:
        freed: set[str] = set()
        live = {}
        for event in log_events(path):
            message = event.get("msg")
            if message == "pool started":
                freed, live = set(), {}  # a new incarnation: empty memory
            elif message == RETAINED_LOG:
                live[event["request_id"]] = len(event.get("block_ids", ()))
            elif message == FREED_LOG:
                report.frees += 1
                reason = str(event.get("reason"))
                report.frees_by_reason[reason] = report.frees_by_reason.get(reason, 0) + 1
                if not event.get("confirmed", True):
                    report.unconfirmed_frees += 1
                freed.add(event["request_id"])
                live.pop(event["request_id"], None)
            elif message == "kv read":
                report.reads += 1
                if not event.get("held", True):
                    report.reads_after_free += 1
                    report.examples.append({"kind": "read of blocks not held", **_brief(event)})
                if event["request_id"] in freed:
                    report.reads_after_logged_free += 1
    for path in prefill_logs:
        for event in log_events(path):
            if event.get("msg") != "kv pull":
                continue
            report.pulls += 1
            if event.get("failed"):
                report.failed_pulls += 1
            if event.get("content_ok") is False:
                report.wrong_kv_pulls += 1
                report.examples.append({"kind": "wrong KV pulled", **_brief(event)})
            if event.get("fenced"):
                report.fenced_pulls += 1
                if not event.get("recomputed"):
                    report.fenced_not_recomputed += 1
    report.leaked_retentions = len(live)
    report.leaked_blocks = held_blocks_at_end if held_blocks_at_end is not None else sum(live.values())
    return report


def _brief(event: dict[str, Any]) -> dict[str, Any]:
    keep = ("ts", "request_id", "remote_request_id", "remote_engine_id", "block_ids", "held", "content_ok")
    return {key: event[key] for key in keep if key in event}
