"""Prometheus plumbing every service shares: serving ``/metrics`` (prometheus_client's own server), the
per-RPC histogram the server interceptor records, and the few series more than one service updates.

Each service defines its own series in its own package (``registry/metrics.py``, ...) against a
``CollectorRegistry`` it owns (one per service object: tests run several in one process).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from kvferry.v1 import resources_pb2
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

RPC_BUCKETS_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class MetricsEndpoint:
    """A registry served over HTTP from a daemon thread; from :func:`serve_metrics`."""

    server: WSGIServer
    port: int

    async def stop(self) -> None:
        # shutdown() waits for the serving thread's poll loop (up to 0.5 s): off the event loop.
        await asyncio.to_thread(self.server.shutdown)
        self.server.server_close()


async def serve_metrics(registry: CollectorRegistry, address: str = "127.0.0.1:0") -> MetricsEndpoint:
    """Serves ``registry`` at ``http://address/metrics`` (``host:port``; port 0 picks a free one, the
    bound port is on the result). prometheus_client's server runs in its own thread and renders each
    scrape there, so a scrape never stalls the event loop."""
    host, _, port_text = address.rpartition(":")
    if not port_text.isdigit():
        raise ValueError(f"metrics address {address!r} is not host:port")
    server, _ = start_http_server(int(port_text), addr=host.strip("[]") or "127.0.0.1", registry=registry)
    return MetricsEndpoint(server=server, port=int(server.server_port))


def rpc_server_histogram(registry: CollectorRegistry) -> Histogram:
    """``kvferry_rpc_server_seconds{service,method,code}``: every gRPC call a server answered."""
    return Histogram(
        "kvferry_rpc_server_seconds",
        "gRPC calls served, by service, method and status code.",
        ["service", "method", "code"],
        buckets=RPC_BUCKETS_SECONDS,
        registry=registry,
    )


def release_reason_label(reason: resources_pb2.ReleaseReason.ValueType) -> str:
    """``RELEASE_REASON_EXPIRED`` -> ``expired``: the label value for a ``ReleaseReason``."""
    return resources_pb2.ReleaseReason.Name(reason).removeprefix("RELEASE_REASON_").lower()


def releases_counter(registry: CollectorRegistry) -> Counter:
    """``kvferry_releases_total{reason}`` (registry and sidecar), every reason created at zero."""
    releases = Counter("kvferry_releases", "Retentions ended, by reason.", ["reason"], registry=registry)
    for reason in resources_pb2.ReleaseReason.values():
        if reason != resources_pb2.RELEASE_REASON_UNSPECIFIED:
            releases.labels(reason=release_reason_label(reason))
    return releases


# What a renewed lease keeps alive, as ``kind`` labels of kvferry_lease_renewals_total.
LEASE_ENGINE = "engine"
LEASE_RETENTION = "retention"
# A turn's mark kept alive while the turn runs (registry only).
LEASE_TURN = "turn"


def lease_renewals_counter(registry: CollectorRegistry) -> Counter:
    """``kvferry_lease_renewals_total{kind}`` (registry and sidecar), both kinds created at zero."""
    renewals = Counter(
        "kvferry_lease_renewals",
        "Lease renewals (heartbeats), by what the lease keeps alive.",
        ["kind"],
        registry=registry,
    )
    for kind in (LEASE_ENGINE, LEASE_RETENTION):
        renewals.labels(kind=kind)
    return renewals


def registry_errors_counter(registry: CollectorRegistry) -> Counter:
    """``kvferry_registry_errors_total{op}`` (router and sidecar): failed calls to the registry."""
    return Counter(
        "kvferry_registry_errors",
        "Failed calls to the registry service, by operation.",
        ["op"],
        registry=registry,
    )
