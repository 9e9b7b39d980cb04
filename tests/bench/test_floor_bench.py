"""``kvferry bench floor`` at a tiny size: both figures come out, and bad counts are refused. Figures are not
checked here (benchmarks print them)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def _floor(*options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvferry.cli.main", "bench", "floor", *options],
        capture_output=True,
        text=True,
        timeout=100,
    )


def test_prints_the_relay_and_exchange_floors() -> None:
    done = _floor("--chunks", "30", "--exchanges", "30", "--rounds", "1", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    floor = json.loads(done.stdout)
    assert set(floor) == {"relay_us_per_chunk", "exchange_us", "wakeup_us"}
    assert floor["relay_us_per_chunk"] > 0 and floor["wakeup_us"] > 0


def test_refuses_a_round_count_below_one() -> None:
    done = _floor("--rounds", "0")
    assert done.returncode != 0
    assert "--rounds must be at least 1" in done.stderr
