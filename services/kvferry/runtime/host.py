"""One lifecycle for every service: start, serve, graceful stop, signals.

A service's composition root builds its objects and, as it starts each thing that must be undone,
registers how to stop it with its :class:`ServiceHost` (the shape of grpc's
``async_greeter_server_with_graceful_shutdown.py`` example: a graceful ``server.stop(grace)`` kept as a
clean-up step). ``stop()`` runs the steps in reverse order, and a start that fails half-way runs the very
same steps for what had started, so nothing outlives it either way.

:func:`run_service` is a CLI's ``main``: it runs a service until SIGTERM/SIGINT (exit 0) or until one of
its background tasks dies (exit 2), stopping it gracefully in both cases.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health
from kvferry.runtime.deadline import finish_within
from kvferry.runtime.grpc_server import ServiceBinding, start_server
from kvferry.runtime.metrics import MetricsEndpoint, serve_metrics
from kvferry.runtime.tracing import setup_tracing, shutdown_tracing
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

StopStep = Callable[[], Awaitable[object]]

# How long a gRPC server may take to stop past its grace (cancelled calls ending) before the stop moves on.
_SERVER_STOP_SLACK_SECONDS = 5.0


@dataclass(frozen=True)
class GrpcEndpoint:
    """A started gRPC server: its bound port and its health servicer (every service starts SERVING)."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer


class ServiceHost:
    """Owns what one service started and stops it in reverse order, whether it is stopping or its start
    failed. ``failed`` resolves (with the error) when a background task ends on its own."""

    def __init__(self, name: str, *, grace_seconds: float = 2.0, task_stop_seconds: float = 5.0) -> None:
        self.name = name
        self.grace_seconds = grace_seconds
        # How long a cancelled background task may take to end before the stop gives up on it.
        self.task_stop_seconds = task_stop_seconds
        # The grace of the stop under way (a caller may ask for another than the default).
        self._grace = grace_seconds
        self._steps: list[tuple[str, StopStep]] = []
        self._stopping = False
        self._stopped = asyncio.Event()
        self.failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    def on_stop(self, what: str, step: StopStep) -> None:
        """Runs ``step`` on stop, before every step registered earlier."""
        self._steps.append((what, step))

    @contextlib.asynccontextmanager
    async def starting(self) -> AsyncIterator[ServiceHost]:
        """``async with host.starting():`` around a start; if it raises, what started is stopped."""
        try:
            yield self
        except BaseException:
            await self.stop(grace_seconds=0)
            raise

    def spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Runs a background task until stop (then it is cancelled, within ``task_stop_seconds``); one
        that ends before that resolves ``failed``."""
        task = asyncio.create_task(coroutine, name=f"kvferry-{self.name}-{name}")
        task.add_done_callback(self._task_ended)

        async def cancel() -> None:
            await _cancel_within(task, self.task_stop_seconds)

        self.on_stop(f"task {name}", cancel)
        return task

    async def serve_grpc(
        self,
        address: str,
        services: Sequence[ServiceBinding],
        *,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        options: Sequence[tuple[str, Any]] = (),
        credentials: grpc.ServerCredentials | None = None,
        serving: bool = True,
    ) -> GrpcEndpoint:
        """Starts a gRPC server (with health checking and reflection; TLS with ``credentials``); on stop
        its health turns NOT_SERVING and in-flight calls get the grace period to finish. ``serving``
        False: its health starts NOT_SERVING (the caller sets SERVING when ready)."""
        server, port, health_servicer = await start_server(
            address,
            services,
            interceptors=interceptors,
            options=options,
            credentials=credentials,
            serving=serving,
        )

        async def graceful_stop() -> None:
            await health_servicer.enter_graceful_shutdown()
            grace = self._grace
            # grpc cancels the calls still open after the grace, then waits for them to end: bounded too.
            await finish_within(
                server.stop(grace),
                (grace or 0.0) + _SERVER_STOP_SLACK_SECONDS,
                f"the gRPC server on port {port} did not stop within {_SERVER_STOP_SLACK_SECONDS} s past "
                f"its {grace} s grace (calls that did not end when cancelled?)",
                cancel=False,
            )

        self.on_stop("gRPC server", graceful_stop)
        return GrpcEndpoint(server, port, health_servicer)

    def setup_tracing(
        self, service_name: str, otlp_endpoint: str | None, exporter: SpanExporter | None = None
    ) -> trace.TracerProvider:
        """The service's tracer provider (:func:`kvferry.runtime.tracing.setup_tracing`), flushed on stop."""
        provider = setup_tracing(service_name, otlp_endpoint, exporter)

        async def flush() -> None:
            # The SDK's shutdown blocks while the exporter sends what it holds.
            await asyncio.to_thread(shutdown_tracing, provider)

        self.on_stop("tracing", flush)
        return provider

    async def serve_metrics(self, registry: CollectorRegistry, address: str) -> MetricsEndpoint:
        """Serves ``registry`` at ``http://address/metrics`` until stop."""
        endpoint = await serve_metrics(registry, address)
        self.on_stop("metrics endpoint", endpoint.stop)
        return endpoint

    async def stop(self, grace_seconds: float | None = None) -> None:
        """Runs every stop step, newest first; a failing step is logged and the rest still run.
        Idempotent: a second call waits for the first to finish."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        self._grace = self.grace_seconds if grace_seconds is None else grace_seconds
        try:
            while self._steps:
                what, step = self._steps.pop()
                try:
                    await step()
                except Exception as error:
                    # A step that did not end in time is given up on (logged); the rest still run.
                    log.log(
                        logging.ERROR if isinstance(error, TimeoutError) else logging.WARNING,
                        "stop step failed",
                        extra={"service": self.name, "step": what, "error": repr(error)},
                    )
        finally:
            self._stopped.set()

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._stopping:
            return
        error = task.exception() or RuntimeError(f"{task.get_name()} ended unexpectedly")
        log.error("background task failed", extra={"task": task.get_name(), "error": repr(error)})
        if not self.failed.done():
            self.failed.set_result(error)


async def _cancel_within(task: asyncio.Task[None], within_seconds: float) -> None:
    """Cancels ``task`` and waits for it to end, cancelling it again every second (a task may swallow
    one cancellation and run on); raises TimeoutError, naming it, if it still runs after
    ``within_seconds``. A cancellation of the caller propagates."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_seconds
    while not task.done():
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise TimeoutError(f"task {task.get_name()} still runs {within_seconds} s after it was cancelled")
        task.cancel()
        await asyncio.wait({task}, timeout=min(remaining, 1.0))


class Service(Protocol):
    """What :func:`run_service` runs: a started service that can stop and may fail."""

    @property
    def host(self) -> ServiceHost: ...

    async def stop(self) -> None: ...


async def serve_until_signal(start: Callable[[], Awaitable[Service]]) -> BaseException | None:
    """Starts a service, waits for SIGTERM/SIGINT or a failure, stops it; returns the failure if any."""
    service = await start()
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop_requested.set)
    requested = asyncio.ensure_future(stop_requested.wait())
    either: set[asyncio.Future[Any]] = {requested, service.host.failed}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        requested.cancel()
        log.info("stopping", extra={"service": service.host.name})
        await service.stop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    return service.host.failed.result() if service.host.failed.done() else None


def run_service(
    name: str,
    start: Callable[[], Awaitable[Service]],
    *,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> int:
    """``kvferry <name>``: runs the service started by ``start`` until SIGTERM/SIGINT, then stops it.

    Exit status 0 after a signal; 2 when the start is refused (bad configuration, an address taken:
    one line on stderr, no traceback) or a background task fails; 130 when interrupted while starting.
    """
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            failure = runner.run(serve_until_signal(start))
    except (ValueError, OSError) as error:
        log.error("failed to start", extra={"service": name, "error": str(error)})
        print(f"kvferry {name}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if failure is not None:
        log.error("exiting after a failure", extra={"service": name, "error": str(failure)})
        return 2
    return 0
