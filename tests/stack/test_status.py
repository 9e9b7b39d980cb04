"""``kvferry status`` against a real registry on a real etcd, with real retentions published: per
engine, the conversations it retains and their blocks (no engines needed; the whole command runs
under ``kvferry up`` in ``test_up_down.py``)."""

from __future__ import annotations

import re
import time

from kvferry.stack.etcd_process import free_port
from kvferry.stack.status import live_retentions, report, retention_lines
from kvferry.v1 import registry_service_pb2 as api
from kvferry.v1 import resources_pb2 as resources

from tests.fixtures.registry import RegistryHandle, unique
from tests.registry.builders import BLOCK_SIZE, publish, register, retention


async def test_status_lists_each_engines_retained_conversations_and_blocks(registry: RegistryHandle) -> None:
    stub = registry.stub()
    busy, idle, tenant = unique("engine"), unique("engine"), unique("tenant")
    await register(stub, busy)
    await register(stub, idle)
    first, second, released = unique("conv"), unique("conv"), unique("conv")
    await publish(stub, retention(tenant, first, busy, num_tokens=40))  # 3 blocks
    await publish(stub, retention(tenant, second, busy, num_tokens=100, turn=1))
    await publish(stub, retention(tenant, second, busy, num_tokens=200, turn=2))  # supersedes: 13 blocks
    await publish(stub, retention(tenant, released, busy, num_tokens=16))
    release = api.ReleaseRetentionRequest(tenant=tenant, conversation_id=released)
    await stub.ReleaseRetention(release, timeout=5)

    live = {r.conversation_id: r for r in await live_retentions(stub) if r.engine_id == busy}
    assert set(live) == {first, second}, "a released retention is not live; a superseded turn is gone"
    assert (live[second].turn, live[second].num_tokens) == (2, 200)

    text = await report({"registry": registry.address})
    blocks = -(-40 // BLOCK_SIZE) + -(-200 // BLOCK_SIZE)
    assert re.search(rf"^\s+{busy}\s+2 conversations, {blocks} blocks, 240 tokens$", text, re.M), text
    assert re.search(rf"^\s+{idle}\s+0 conversations, 0 blocks, 0 tokens$", text, re.M), text
    assert re.search(rf"^\s+{tenant}/{second}  turn 2  200 tokens  13 blocks  expires in \d+ s$", text, re.M)
    assert re.search(rf"^\s+{tenant}/{first}  turn 1  40 tokens  3 blocks  expires in \d+ s$", text, re.M)
    assert released not in text
    # Nothing listens on the builders' engine endpoint: the engine is listed, unhealthy.
    assert re.search(rf"^\s+{busy}\s+decode\s+\S+\s+unhealthy\s+retained blocks \d+ of 4096$", text, re.M)
    assert re.search(rf"^\s+registry\s+{registry.address} serving$", text, re.M), text


def test_a_long_list_is_cut_per_engine_saying_how_many_more() -> None:
    now = time.time()
    held = []
    for index in range(5):
        item = retention("t", f"c{index}", "decode-0", num_tokens=32)
        item.publish_time.FromNanoseconds(int((now - 100 + index) * 1e9))
        item.expire_time.FromNanoseconds(int((now + 30) * 1e9))
        held.append(item)
    lines = retention_lines(["decode-0", "prefill-0"], held, now, shown_per_engine=2)
    assert lines == [
        "  retained (registry): 5 conversations, 10 blocks",
        "    decode-0     5 conversations, 10 blocks, 160 tokens",
        "      t/c4  turn 1  32 tokens  2 blocks  expires in 30 s",
        "      t/c3  turn 1  32 tokens  2 blocks  expires in 30 s",
        "      ... and 3 more",
        "    prefill-0    0 conversations, 0 blocks, 0 tokens",
    ]


def test_retentions_in_the_host_pool_say_so() -> None:
    now = time.time()
    moved = retention("t", "moved", "decode-0", num_tokens=64)
    moved.tier = resources.MEMORY_TIER_HOST
    kept = retention("t", "kept", "decode-0", num_tokens=32)
    for index, item in enumerate((kept, moved)):
        item.publish_time.FromNanoseconds(int((now - 10 + index) * 1e9))
        item.expire_time.FromNanoseconds(int((now + 30) * 1e9))
    assert retention_lines(["decode-0"], [kept, moved], now)[1:] == [
        "    decode-0     2 conversations, 6 blocks (4 in the host pool), 96 tokens",
        "      t/moved  turn 1  64 tokens  4 blocks in the host pool  expires in 30 s",
        "      t/kept  turn 1  32 tokens  2 blocks  expires in 30 s",
    ]


async def test_status_says_when_the_registry_does_not_answer() -> None:
    text = await report({"registry": f"127.0.0.1:{free_port()}"})
    assert re.search(r"registry\s+127\.0\.0\.1:\d+ not answering \(UNAVAILABLE\)", text), text
    assert "engines: registry did not answer ListEngines: UNAVAILABLE" in text


def test_retention_lines_name_an_engine_the_registry_no_longer_lists() -> None:
    item = resources.Retention(tenant="t", conversation_id="c", engine_id="gone-0", num_tokens=8)
    item.block_ids.append(7)
    lines = retention_lines([], [item], time.time())
    assert "    gone-0       1 conversations, 1 blocks, 8 tokens" in lines
