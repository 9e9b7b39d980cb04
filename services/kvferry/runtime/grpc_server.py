"""One way to build a kvferry gRPC server: health checking, reflection, a bound port, graceful stop."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError
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
    credentials: grpc.ServerCredentials | None = None,
    serving: bool = True,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Starts a grpc.aio server on ``address`` (``host:0`` picks a free port); TLS with ``credentials``
    (:func:`kvferry.runtime.tls.server_credentials`), plaintext without.

    Returns the server, the bound port and its health servicer (every service starts SERVING, or
    NOT_SERVING with ``serving`` False; callers flip statuses as their dependencies come and go).
    """
    server = grpc.aio.server(
        interceptors=[UndecodableRequestInterceptor(), *interceptors], options=list(options)
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    for add_to_server, servicer, name in services:
        add_to_server(servicer, server)
        names.append(name)
    reflection.enable_server_reflection(names, server)
    try:
        port = (
            server.add_insecure_port(address)
            if credentials is None
            else server.add_secure_port(address, credentials)
        )
    except RuntimeError as error:  # grpc raises this when the address is taken or malformed
        await server.stop(None)
        raise OSError(f"could not bind gRPC server to {address}: {error}") from error
    if port == 0:
        await server.stop(None)  # a half-built server would keep the process from exiting
        raise OSError(f"could not bind gRPC server to {address}")
    await server.start()
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    await health_servicer.set("", status)
    for _, _, name in services:
        await health_servicer.set(name, status)
    return server, port, health_servicer


class _Undecodable:
    """Stands for a request whose bytes did not decode, so the handler can refuse it."""

    def __init__(self, error: DecodeError) -> None:
        self.error = error


class UndecodableRequestInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """A unary request whose bytes are not its message is INVALID_ARGUMENT with a message the caller can
    act on (grpc itself answers UNKNOWN and logs a traceback, as if the server had failed)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        deserialize = handler.request_deserializer
        method = handler_call_details.method

        def tolerant(raw: bytes) -> object:
            try:
                return deserialize(raw)
            except DecodeError as error:
                return _Undecodable(error)

        async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
            if isinstance(request, _Undecodable):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the request's bytes are not a valid message for {method} ({request.error}); "
                    "send it with the generated client of kvferry's protos",
                )

        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def unary_unary(request: object, context: grpc.aio.ServicerContext) -> Any:
                await refuse(request, context)
                return await unary(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, tolerant, handler.response_serializer)
        streaming = handler.unary_stream
        if inspect.isasyncgenfunction(streaming):

            async def unary_stream(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await refuse(request, context)
                async for response in streaming(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, tolerant, handler.response_serializer)

        async def unary_stream_writing(request: object, context: grpc.aio.ServicerContext) -> Any:
            await refuse(request, context)
            return await streaming(request, context)

        return grpc.unary_stream_rpc_method_handler(
            unary_stream_writing, tolerant, handler.response_serializer
        )
