"""One way to build a kvferry gRPC server: health checking, reflection, a bound port, graceful stop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# (add_XServicer_to_server function, servicer instance, full service name)
ServiceBinding = tuple[Callable[[Any, grpc.aio.Server], None], object, str]


async def start_server(
    address: str,
    services: Sequence[ServiceBinding],
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    options: Sequence[tuple[str, Any]] = (),
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Starts a grpc.aio server on ``address`` (``host:0`` picks a free port).

    Returns the server, the bound port and its health servicer (every service starts SERVING;
    callers flip statuses as their dependencies come and go).
    """
    server = grpc.aio.server(interceptors=list(interceptors), options=list(options))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    for add_to_server, servicer, name in services:
        add_to_server(servicer, server)
        names.append(name)
    reflection.enable_server_reflection(names, server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as error:  # grpc raises this when the address is taken or malformed
        await server.stop(None)
        raise OSError(f"could not bind gRPC server to {address}: {error}") from error
    if port == 0:
        await server.stop(None)  # a half-built server would keep the process from exiting
        raise OSError(f"could not bind gRPC server to {address}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    for _, _, name in services:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer
