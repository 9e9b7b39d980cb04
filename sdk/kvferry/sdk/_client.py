"""The async client: one channel to the router, typed calls with deadlines, retries and auth."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar

import grpc
from kvferry.sdk._config import ClientConfig, Deadlines, TlsConfig
from kvferry.sdk._conversation import Conversation, PromptInput, normalize_prompt
from kvferry.sdk._errors import ErrorCode, error_from_rpc, make_error
from kvferry.sdk._ids import check_id
from kvferry.sdk._keepalive import Clock, KeepAlive, KeepAliveSettings
from kvferry.sdk._models import ConversationInfo, Reply, SamplingParams
from kvferry.sdk._proto import (
    conversation_info_from_proto,
    generate_request_to_proto,
    timestamp_from_proto,
)
from kvferry.sdk._retry import RetryPolicy
from kvferry.sdk._stream import TurnStream
from kvferry.sdk._tracing import trace_headers
from kvferry.v1 import router_service_pb2 as router_pb
from kvferry.v1 import router_service_pb2_grpc as router_grpc

_log = logging.getLogger("kvferry.sdk")

_T = TypeVar("_T")

USER_AGENT = "kvferry-sdk-python/0.1"
_SERVICE = "kvferry.v1.RouterService"


def new_conversation_id() -> str:
    """A fresh conversation id (valid for the router: [A-Za-z0-9._:-], at most 128 characters)."""
    return f"conv-{uuid.uuid4().hex}"


def open_channel(config: ClientConfig) -> grpc.aio.Channel:
    """A grpc.aio channel to the router, TLS when configured."""
    options: list[tuple[str, Any]] = [("grpc.primary_user_agent", USER_AGENT)]
    if config.tls is None:
        return grpc.aio.insecure_channel(config.address, options=options)
    tls: TlsConfig = config.tls
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.root_certificates,
        private_key=tls.private_key,
        certificate_chain=tls.certificate_chain,
    )
    return grpc.aio.secure_channel(config.address, credentials, options=options)


class Client:
    """Async client of the kvferry router (``RouterService``).

    ``await Client.connect(...)`` builds one from arguments and the environment; ``conversation()``
    starts a ``Conversation``. Every call carries a deadline (``Deadlines``) and the API key as
    ``authorization: Bearer <key>``; failures raise the SDK's typed ``RpcError`` subclasses.
    """

    def __init__(
        self,
        config: ClientConfig,
        channel: grpc.aio.Channel,
        *,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self._channel = channel
        self._stub: Any = router_grpc.RouterServiceStub(channel)
        self._clock = clock
        self._auth_metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {config.api_key}"),) if config.api_key else ()
        )

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        # The caller's OpenTelemetry span (if any) becomes the parent of the router's spans.
        return self._auth_metadata + tuple(trace_headers().items())

    @classmethod
    async def connect(
        cls,
        address: str | None = None,
        *,
        api_key: str | None = None,
        tls: bool | TlsConfig | None = None,
        retry: RetryPolicy | None = None,
        deadlines: Deadlines | None = None,
        keep_alive: KeepAliveSettings | None = None,
        config: ClientConfig | None = None,
        environ: Mapping[str, str] | None = None,
        wait_ready_seconds: float | None = None,
    ) -> Client:
        """A client for the router at ``address`` (else KVFERRY_ADDRESS).

        The API key and TLS come from the arguments, else KVFERRY_API_KEY and KVFERRY_TLS /
        KVFERRY_TLS_CA / KVFERRY_TLS_CERT / KVFERRY_TLS_KEY / KVFERRY_TLS_SERVER_NAME. A ready-made
        ``config`` replaces all of them. The channel connects lazily; ``wait_ready_seconds`` waits
        for the connection instead (raising ``UnavailableError`` when it does not come up).
        """
        resolved = config or ClientConfig.load(
            address,
            api_key=api_key,
            tls=tls,
            retry=retry,
            deadlines=deadlines,
            keep_alive=keep_alive,
            environ=environ,
        )
        client = cls(resolved, open_channel(resolved))
        if wait_ready_seconds is not None:
            try:
                await asyncio.wait_for(client._channel.channel_ready(), wait_ready_seconds)
            except TimeoutError:
                await client.close()
                raise make_error(
                    ErrorCode.UNAVAILABLE,
                    f"no connection to the router at {resolved.address} within {wait_ready_seconds}s; "
                    "is it running (`kvferry up`) and is the address right?",
                ) from None
        return client

    async def close(self) -> None:
        """Closes the channel (conversations are not closed: their KV stays until released or expired)."""
        await self._channel.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    # Conversations

    def conversation(
        self,
        id: str | None = None,
        *,
        history: PromptInput | None = None,
        keep_history: bool = True,
        model: str = "",
        sampling: SamplingParams | None = None,
    ) -> Conversation:
        """A conversation handle (a fresh id when ``id`` is None). Nothing is sent until ``send``."""
        conversation_id = id if id is not None else new_conversation_id()
        problem = check_id("conversation_id", conversation_id)
        if problem:
            raise ValueError(problem)
        return Conversation(
            self,
            conversation_id,
            history=history,
            keep_history=keep_history,
            model=model,
            sampling=sampling,
        )

    def keep_alive(self, conversation_id: str, *, interval: float | None = None) -> KeepAlive:
        """A keep-alive block for ``conversation_id`` (see ``Conversation.keep_alive``)."""
        return KeepAlive(
            conversation_id,
            lambda deadline_seconds: self._renew_once(conversation_id, deadline_seconds),
            settings=self.config.keep_alive,
            interval=interval,
            clock=self._clock,
        )

    # The RPCs

    def generate(
        self,
        conversation_id: str,
        prompt: PromptInput,
        *,
        sampling: SamplingParams | None = None,
        model: str = "",
        retain: bool | None = None,
        deadline_seconds: float | None = None,
        on_finish: Callable[[Reply], None] | None = None,
    ) -> TurnStream:
        """One turn with the whole ``prompt`` (no history kept; ``Conversation.send`` keeps it)."""
        request = generate_request_to_proto(
            conversation_id,
            normalize_prompt(prompt),
            sampling or SamplingParams(),
            model=model,
            retain=retain,
        )

        def open_call(seconds: float) -> Any:
            return self._stub.Generate(request, timeout=seconds, metadata=self._metadata())

        return TurnStream(
            conversation_id,
            open_call,
            retry=self.config.retry,
            timeout_seconds=(
                deadline_seconds if deadline_seconds is not None else self.config.deadlines.generate_seconds
            ),
            on_finish=on_finish,
        )

    async def renew_conversation(self, conversation_id: str) -> datetime:
        """Extends the conversation's retention; returns the lease's new end (UTC)."""
        request = router_pb.RenewConversationRequest(conversation_id=conversation_id)
        response = await self._unary("RenewConversation", self._stub.RenewConversation, request)
        return _expire_time(response)

    async def close_conversation(self, conversation_id: str) -> None:
        """Releases the conversation's retained KV at once."""
        request = router_pb.CloseConversationRequest(conversation_id=conversation_id)
        await self._unary("CloseConversation", self._stub.CloseConversation, request)

    async def get_conversation(self, conversation_id: str) -> ConversationInfo:
        """What is retained for the conversation; ``NotFoundError`` when nothing is."""
        request = router_pb.GetConversationRequest(conversation_id=conversation_id)
        response = await self._unary("GetConversation", self._stub.GetConversation, request)
        return conversation_info_from_proto(response)

    async def _renew_once(self, conversation_id: str, deadline_seconds: float | None) -> datetime:
        # The keep-alive schedules its own retries and deadlines against the lease's end.
        request = router_pb.RenewConversationRequest(conversation_id=conversation_id)
        response = await self._unary(
            "RenewConversation",
            self._stub.RenewConversation,
            request,
            retry=RetryPolicy(max_attempts=1),
            deadline_seconds=deadline_seconds,
        )
        return _expire_time(response)

    async def _unary(
        self,
        name: str,
        method: Callable[..., Awaitable[_T]],
        request: object,
        *,
        retry: RetryPolicy | None = None,
        deadline_seconds: float | None = None,
    ) -> _T:
        """One unary call within the control deadline, retried on UNAVAILABLE (these calls are idempotent)."""
        policy = retry or self.config.retry
        full_name = f"{_SERVICE}/{name}"
        seconds = self.config.deadlines.control_seconds
        if deadline_seconds is not None:
            seconds = min(seconds, deadline_seconds)
        deadline = time.monotonic() + seconds
        failed = 0
        while True:
            try:
                return await method(
                    request, timeout=max(deadline - time.monotonic(), 0.001), metadata=self._metadata()
                )
            except grpc.aio.AioRpcError as rpc_error:
                failed += 1
                error = error_from_rpc(rpc_error, method=full_name)
                delay = policy.retry_delay(
                    error,
                    failed_attempts=failed,
                    seconds_left=deadline - time.monotonic(),
                    unit_random=random.random(),
                )
                if delay is None:
                    raise error from rpc_error
            _log.info("%s unavailable, retrying in %.2fs", full_name, delay, extra={"attempt": failed})
            await asyncio.sleep(delay)


def _expire_time(response: router_pb.RenewConversationResponse) -> datetime:
    expire = timestamp_from_proto(response.expire_time, response.HasField("expire_time"))
    if expire is None:
        raise make_error(
            ErrorCode.INTERNAL,
            "the router renewed the conversation but sent no expire_time",
            method=f"{_SERVICE}/RenewConversation",
        )
    return expire
