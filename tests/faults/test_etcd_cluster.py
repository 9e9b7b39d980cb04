"""kvferry.testing.etcd_cluster: three real etcd members; the faults the harness relies on do what
they say (a new leader after a kill or a partition, a minority member refuses reads, a restore goes
back in revisions)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kvferry.testing.etcd_cluster import EtcdCluster
from kvferry.testing.loop_thread import LoopThread

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    with LoopThread() as loop:
        cluster = EtcdCluster(tmp_path / "etcd", loop)
        cluster.start()
        try:
            yield cluster
        finally:
            cluster.stop()


def test_a_killed_leader_is_replaced_and_comes_back(cluster: EtcdCluster) -> None:
    cluster.etcdctl(None, "put", "k", "v1")
    old = cluster.kill_leader()
    new = cluster.leader()
    assert new is not old
    cluster.etcdctl(None, "put", "k", "v2")
    cluster.restart(old)
    cluster.wait_healthy()
    assert cluster.etcdctl(old, "get", "k", "--print-value-only").stdout.strip() == "v2"


def test_a_partitioned_leader_loses_quorum_until_healed(cluster: EtcdCluster) -> None:
    cluster.etcdctl(None, "put", "k", "v1")
    old = cluster.leader()
    cluster.partition(old)
    assert cluster.leader() is not old
    assert old.alive
    assert cluster.etcdctl(old, "get", "k", check=False).returncode != 0  # linearizable read: no quorum
    cluster.heal()
    cluster.wait_healthy()
    assert cluster.etcdctl(old, "get", "k", "--print-value-only").stdout.strip() == "v1"


def test_a_restore_from_an_older_snapshot_goes_back_in_revisions(
    cluster: EtcdCluster, tmp_path: Path
) -> None:
    cluster.etcdctl(None, "put", "k", "old")
    snapshot = cluster.snapshot(tmp_path / "old.db")
    at_snapshot = cluster.revision()
    for index in range(5):
        cluster.etcdctl(None, "put", "k", f"new-{index}")
    assert cluster.revision() > at_snapshot
    cluster.restore(snapshot)
    assert cluster.revision() == at_snapshot
    assert cluster.etcdctl(None, "get", "k", "--print-value-only").stdout.strip() == "old"


def test_compaction_moves_the_compacted_revision(cluster: EtcdCluster) -> None:
    for index in range(3):
        cluster.etcdctl(None, "put", "k", str(index))
    compacted = cluster.compact()
    result = cluster.etcdctl(None, "get", "k", f"--rev={compacted - 1}", check=False)
    assert result.returncode != 0 and "compacted" in result.stderr


def test_a_small_quota_fills_and_frees(tmp_path: Path) -> None:
    with LoopThread() as loop:
        cluster = EtcdCluster(tmp_path / "quota", loop, quota_backend_bytes=8 * 1024 * 1024)
        cluster.start()
        try:
            assert cluster.fill_to_quota() > 0
            refused = cluster.etcdctl(None, "put", "k", "v", check=False)
            assert refused.returncode != 0 and "space" in refused.stderr.lower()
            cluster.free_space()
            cluster.etcdctl(None, "put", "k", "v")
        finally:
            cluster.stop()
