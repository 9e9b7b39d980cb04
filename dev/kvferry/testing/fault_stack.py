"""The whole kvferry stack as separate processes, wired through fault proxies, and the faults to inject.

::

    router ──proxy──▶ registry replica 0 ──proxies──▶ etcd0, etcd1, etcd2 (peers through proxies)
    P sidecar ─proxy─▶ registry replica 0        │
    D sidecar ─proxy─▶ registry replica 1 ──proxies──┘
    P, D: kvferry.testing.standins (real connector retention machinery, stand-in model and KV memory)

Every part is a real kvferry process (``kvferry registry|sidecar|router``) or real etcd, so every one
of them can be killed with SIGKILL. :class:`FaultStack` starts them, knows how to inject each
:class:`FaultKind` and to heal it, and where each process logs (the oracle reads those logs).
"""

from __future__ import annotations

import enum
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from kvferry.stack.etcd_process import free_port
from kvferry.testing.etcd_cluster import EtcdCluster
from kvferry.testing.fault_proxy import FaultProxy
from kvferry.testing.loop_thread import LoopThread
from kvferry.testing.processes import ManagedProcess, wait_until
from kvferry.testing.standins import KV_HASH, MODEL

# The kvferry command of this environment (its virtualenv's bin need not be on PATH).
KVFERRY = str(Path(sys.executable).with_name("kvferry"))

API_KEY = "key-faults"
TENANT = "faults"
BLOCK_SIZE = 16


class FaultKind(enum.StrEnum):
    """Every fault the harness injects (issue 13's list)."""

    ETCD_LEADER_KILL = "etcd_leader_kill"
    ETCD_PARTITION = "etcd_partition"
    REGISTRY_LATENCY = "registry_latency"
    REGISTRY_PARTITION = "registry_partition"
    CLOCK_SKEW_P = "clock_skew_p"
    CONCURRENT_TURNS = "concurrent_turns"
    SYNC_ACK_RACE = "sync_ack_race"
    COMPACTION_LAGGING_WATCH = "compaction_lagging_watch"
    ETCD_NOSPACE = "etcd_nospace"
    ETCD_RESTORE = "etcd_restore"
    KILL_D = "kill_d"
    KILL_P = "kill_p"
    KILL_SIDECAR = "kill_sidecar"
    KILL_REGISTRY = "kill_registry"
    KILL_ROUTER = "kill_router"


@dataclass
class StackSettings:
    work_dir: Path
    # D frees a retention this long after the registry confirmed its end; the router's read window
    # stays well under it.
    grace_seconds: float = 3.0
    read_window_seconds: float = 1.0
    hard_cap_seconds: float = 20.0
    retention_ttl_seconds: int = 15
    engine_ttl_seconds: int = 3
    registry_replicas: int = 2
    # etcd's space quota: small, so the NOSPACE fault fills it in seconds.
    quota_backend_bytes: int = 24 * 1024 * 1024
    # How long a fault lasts before it is healed.
    hold_seconds: float = 1.5
    # D frees retained blocks at once (broken on purpose: the harness's test of its own oracle).
    unsafe_decode: bool = False


@dataclass
class FaultStack:
    settings: StackSettings
    loop: LoopThread
    cluster: EtcdCluster = field(init=False)
    registries: list[ManagedProcess] = field(default_factory=list)
    registry_ports: list[int] = field(default_factory=list)
    # Registry replica r -> etcd member m.
    etcd_proxies: list[list[FaultProxy]] = field(default_factory=list)
    # In front of each registry replica (its clients dial these).
    registry_proxies: list[FaultProxy] = field(default_factory=list)
    engines: dict[str, ManagedProcess] = field(default_factory=dict)
    engine_ports: dict[str, int] = field(default_factory=dict)
    sidecars: dict[str, ManagedProcess] = field(default_factory=dict)
    router: ManagedProcess | None = None
    router_http_port: int = 0
    injected: dict[str, int] = field(default_factory=dict)
    _rng: random.Random = field(default_factory=lambda: random.Random(13))

    def __post_init__(self) -> None:
        self.cluster = EtcdCluster(
            self.settings.work_dir / "etcd", self.loop, quota_backend_bytes=self.settings.quota_backend_bytes
        )

    @property
    def logs(self) -> Path:
        return self.settings.work_dir / "logs"

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_http_port}"

    def engine_url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.engine_ports[role]}"

    # -- start and stop --------------------------------------------------------------------------------

    def start(self) -> None:
        if self.settings.work_dir.exists():
            shutil.rmtree(self.settings.work_dir)
        self.cluster.start()
        for replica in range(self.settings.registry_replicas):
            proxies = [
                FaultProxy(endpoint, name=f"registry{replica}-{endpoint}")
                for endpoint in self.cluster.endpoints
            ]
            for proxy in proxies:
                self.loop.run(proxy.start())
            self.etcd_proxies.append(proxies)
            port = free_port()
            self.registry_ports.append(port)
            self.registries.append(
                ManagedProcess(
                    f"registry{replica}",
                    [
                        KVFERRY,
                        "registry",
                        "--listen",
                        f"127.0.0.1:{port}",
                        "--etcd-endpoints",
                        ",".join(p.endpoint for p in proxies),
                        "--etcd-timeout",
                        "1.0",
                        "--key-prefix",
                        "/kvferry-faults/",
                        "--default-retention-ttl",
                        str(self.settings.retention_ttl_seconds),
                        "--default-engine-ttl",
                        str(self.settings.engine_ttl_seconds),
                        "--etcd-history",
                        "0",
                    ],
                    self.logs / f"registry{replica}.log",
                )
            )
            front = FaultProxy(f"127.0.0.1:{port}", name=f"registry{replica}-front")
            self.loop.run(front.start())
            self.registry_proxies.append(front)
        for registry in self.registries:
            registry.start()
        for role, replica in (("decode", 1 % self.settings.registry_replicas), ("prefill", 0)):
            self._add_engine(role, replica)
        for process in (*self.engines.values(), *self.sidecars.values()):
            process.start()
        self.router_http_port = free_port()
        self.router = ManagedProcess(
            "router",
            [
                KVFERRY,
                "router",
                "--registry",
                self.registry_proxies[0].endpoint,
                "--grpc-listen",
                f"127.0.0.1:{free_port()}",
                "--http-listen",
                f"127.0.0.1:{self.router_http_port}",
                "--api-keys",
                f"{API_KEY}={TENANT}",
                "--read-window",
                str(self.settings.read_window_seconds),
                "--min-release-grace",
                str(self.settings.grace_seconds),
                "--reuse-policy",
                "always",
                # The read window (1 s) is what limits a pull here, not the lease: pull whenever it is open.
                "--lease-margin",
                "0.2",
                "--kv-recompute-threshold",
                str(BLOCK_SIZE),
                "--registry-timeout",
                "1.0",
                "--publish-wait",
                "0.5",
                "--engine-read-timeout",
                "10",
            ],
            self.logs / "router.log",
        )
        self.router.start()
        self.wait_ready()

    def _add_engine(self, role: str, replica: int) -> None:
        engine_id = f"faults-{role}"
        port = free_port()
        sidecar_port = free_port()
        self.engine_ports[role] = port
        self.engines[role] = ManagedProcess(
            role,
            [
                sys.executable,
                "-m",
                "kvferry.testing.standins",
                "--role",
                role,
                "--engine-id",
                engine_id,
                "--port",
                str(port),
                "--sidecar",
                f"127.0.0.1:{sidecar_port}",
                "--grace-seconds",
                str(self.settings.grace_seconds),
                "--hard-cap-seconds",
                str(self.settings.hard_cap_seconds),
                "--lease-ttl-seconds",
                str(self.settings.retention_ttl_seconds),
                *(["--unsafe-free-at-finish"] if self.settings.unsafe_decode and role == "decode" else []),
            ],
            self.logs / f"{role}.log",
        )
        self.sidecars[role] = ManagedProcess(
            f"sidecar-{role}",
            [
                KVFERRY,
                "sidecar",
                "--engine-id",
                engine_id,
                "--role",
                role,
                "--engine-url",
                f"http://127.0.0.1:{port}",
                "--nixl-host",
                "127.0.0.1",
                # P reads D's stand-in memory over HTTP where a NIXL READ would go.
                "--nixl-port",
                str(port),
                "--kv-compatibility-hash",
                KV_HASH,
                "--model",
                MODEL,
                "--block-size",
                str(BLOCK_SIZE),
                "--kv-capacity-blocks",
                "4096",
                "--max-model-len",
                "8192",
                "--engine-probe-interval",
                "0.5",
                "--registry",
                self.registry_proxies[replica].endpoint,
                "--ttl-seconds",
                str(self.settings.engine_ttl_seconds),
                "--registry-timeout",
                "1.0",
                "--backoff-max",
                "0.5",
                "--listen",
                f"127.0.0.1:{sidecar_port}",
            ],
            self.logs / f"sidecar-{role}.log",
        )

    def wait_ready(self, timeout_seconds: float = 60.0) -> None:
        """Until the router knows a prefill and a decode engine."""

        def ready() -> bool:
            try:
                return httpx.get(f"{self.router_url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout_seconds, "the router seeing both engines", interval=0.2)

    def stop(self) -> None:
        processes = [self.router, *self.engines.values(), *self.sidecars.values(), *self.registries]
        for process in processes:
            if process is not None:
                process.stop()
        for proxy in [*self.registry_proxies, *(p for row in self.etcd_proxies for p in row)]:
            self.loop.run(proxy.stop())
        self.cluster.stop()

    def heal_all(self) -> None:
        """Every proxy back to normal, every process and etcd member running, P's clock right."""
        for proxy in [*self.registry_proxies, *(p for row in self.etcd_proxies for p in row)]:
            self.loop.loop.call_soon_threadsafe(proxy.heal)
        self.cluster.heal()
        for member in self.cluster.members:
            self.cluster.restart(member)
        for process in [*self.registries, *self.engines.values(), *self.sidecars.values(), self.router]:
            if process is not None:
                process.start()
        self._set_clock("prefill", 0.0)

    # -- faults ----------------------------------------------------------------------------------------

    def inject(self, kind: FaultKind, on_concurrent: Callable[[], None] | None = None) -> None:
        """Injects one fault of ``kind``, holds it ``hold_seconds`` (turns keep running), heals it."""
        hold = self.settings.hold_seconds
        self.injected[kind.value] = self.injected.get(kind.value, 0) + 1
        call = self.loop.loop.call_soon_threadsafe
        if kind is FaultKind.ETCD_LEADER_KILL:
            member = self.cluster.kill_leader()
            time.sleep(hold)
            self.cluster.restart(member)
        elif kind is FaultKind.ETCD_PARTITION:
            self.cluster.partition(self.cluster.leader())
            time.sleep(hold)
            self.cluster.heal()
        elif kind is FaultKind.REGISTRY_LATENCY:
            proxy = self._rng.choice(self.registry_proxies)
            proxy.latency_seconds = 0.3
            time.sleep(hold)
            call(proxy.heal)
        elif kind is FaultKind.REGISTRY_PARTITION:
            proxy = self._rng.choice(self.registry_proxies)
            call(proxy.blackhole)
            time.sleep(hold)
            call(proxy.heal)
        elif kind is FaultKind.CLOCK_SKEW_P:
            # Either way, by more than the read window: slow clocks read late, fast ones decline.
            self._set_clock("prefill", self._rng.choice((-2.0, 2.0)) * self.settings.grace_seconds)
            time.sleep(hold)
            self._set_clock("prefill", 0.0)
        elif kind is FaultKind.CONCURRENT_TURNS:
            if on_concurrent is not None:
                on_concurrent()
        elif kind is FaultKind.SYNC_ACK_RACE:
            # The sidecar comes back while the engine's reports are in flight: its new SYNC snapshot
            # races the acknowledgements of publishes made around the restart.
            sidecar = self.sidecars["decode"]
            sidecar.kill9()
            sidecar.start()
            time.sleep(hold)
        elif kind is FaultKind.COMPACTION_LAGGING_WATCH:
            replica = self._rng.randrange(len(self.etcd_proxies))
            for proxy in self.etcd_proxies[replica]:
                call(proxy.blackhole)
            time.sleep(hold / 2)
            self.cluster.compact()
            time.sleep(hold / 2)
            for proxy in self.etcd_proxies[replica]:
                call(proxy.heal)
        elif kind is FaultKind.ETCD_NOSPACE:
            self.cluster.fill_to_quota()
            time.sleep(hold)
            self.cluster.free_space()
        elif kind is FaultKind.ETCD_RESTORE:
            snapshot = self.cluster.snapshot(self.settings.work_dir / "etcd-snapshots" / "older.db")
            time.sleep(hold)  # turns go on and change etcd; then it goes back to the snapshot
            self.cluster.restore(snapshot)
        elif kind in (FaultKind.KILL_D, FaultKind.KILL_P):
            engine = self.engines["decode" if kind is FaultKind.KILL_D else "prefill"]
            engine.kill9()
            time.sleep(hold)
            engine.start()
        elif kind is FaultKind.KILL_SIDECAR:
            sidecar = self.sidecars[self._rng.choice(("decode", "prefill"))]
            sidecar.kill9()
            time.sleep(hold)
            sidecar.start()
        elif kind is FaultKind.KILL_REGISTRY:
            registry = self._rng.choice(self.registries)
            registry.kill9()
            time.sleep(hold)
            registry.start()
        elif kind is FaultKind.KILL_ROUTER:
            assert self.router is not None
            self.router.kill9()
            time.sleep(hold)
            self.router.start()

    def _set_clock(self, role: str, offset_seconds: float) -> None:
        try:
            httpx.post(
                f"{self.engine_url(role)}/kvferry/clock", json={"offset_seconds": offset_seconds}, timeout=2
            )
        except httpx.HTTPError:
            pass  # the engine is down (another fault): it starts with a right clock

    def held_blocks(self) -> int | None:
        """Blocks D's memory holds now (None: D does not answer)."""
        try:
            return int(
                httpx.get(f"{self.engine_url('decode')}/kvferry/state", timeout=2).json()["held_blocks"]
            )
        except httpx.HTTPError:
            return None
