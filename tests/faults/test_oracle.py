"""The oracle catches what it is there to catch (each violation from hand-written engine logs), and D's
stand-in memory reuses freed blocks first, as vLLM's free queue does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvferry.testing.oracle import check
from kvferry.testing.standins import BlockPool


def _write(path: Path, *events: dict[str, Any]) -> Path:
    # Ends as a kill -9 leaves a log: a line cut short.
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"msg": "kv re')
    return path


POOL = {"msg": "pool started"}


def _retained(request: str, blocks: list[int]) -> dict[str, Any]:
    return {"msg": "retained", "request_id": request, "block_ids": blocks}


def _freed(request: str, blocks: list[int], confirmed: bool = True) -> dict[str, Any]:
    return {
        "msg": "freed retained blocks",
        "request_id": request,
        "block_ids": blocks,
        "reason": "expired",
        "confirmed": confirmed,
    }


def test_clean_logs_pass(tmp_path: Path) -> None:
    decode = _write(
        tmp_path / "d.log",
        POOL,
        _retained("r1", [1, 2]),
        {"msg": "kv read", "request_id": "r1", "block_ids": [1, 2], "held": True},
        _freed("r1", [1, 2]),
    )
    prefill = _write(tmp_path / "p.log", {"msg": "kv pull", "content_ok": True, "fenced": False})
    report = check([decode], [prefill], held_blocks_at_end=0)
    assert report.violations() == []
    assert (report.reads, report.pulls, report.frees) == (1, 1, 1)


def test_a_read_after_the_free_is_served_after_freed(tmp_path: Path) -> None:
    decode = _write(
        tmp_path / "d.log",
        POOL,
        _retained("r1", [1, 2]),
        _freed("r1", [1, 2], confirmed=False),
        {"msg": "kv read", "request_id": "r1", "block_ids": [1, 2], "held": False},
    )
    report = check([decode], [], held_blocks_at_end=0)
    assert report.served_after_freed == 1
    assert report.unconfirmed_frees == 1
    assert "served after freed" in report.violations()[0]


def test_wrong_kv_and_unrecomputed_fences_and_leaks_are_violations(tmp_path: Path) -> None:
    decode = _write(tmp_path / "d.log", POOL, _retained("gone", [7]), POOL, _retained("kept", [3, 4]))
    prefill = _write(
        tmp_path / "p.log",
        {"msg": "kv pull", "remote_request_id": "x", "content_ok": False, "fenced": False},
        {"msg": "kv pull", "content_ok": True, "fenced": True, "recomputed": False},
    )
    report = check([decode], [prefill], held_blocks_at_end=None)
    assert report.wrong_kv_pulls == 1
    assert report.fenced_not_recomputed == 1
    # Only the last incarnation's retentions can leak (a killed D's memory went with it).
    assert (report.leaked_retentions, report.leaked_blocks) == (1, 2)
    assert len(report.violations()) == 3


def test_freed_blocks_are_reused_first_and_generations_move() -> None:
    pool = BlockPool(8)
    first = pool.allocate(3, "a")
    assert first is not None and pool.held == 3
    pool.write(first, [b"x", b"y", b"z"])
    assert pool.held_by(first, "a") and not pool.held_by(first, "b")
    assert pool.free(first, "b") == []  # not its blocks
    base = pool.generations[first[0]]  # random per process, as the connector's
    assert pool.free(first, "a") == [base + 1] * 3
    again = pool.allocate(3, "b")
    assert again is not None and set(again) == set(first)
    assert [pool.contents[b] for b in again] == [b"", b"", b""]
    assert pool.allocate(6, "c") is None
