"""kvferry's agent SDK: a typed client of the router's gRPC API.

Async first (``Client``, ``Conversation``), with a blocking twin (``SyncClient``)::

    async with await Client.connect("127.0.0.1:50051", api_key="...") as client:
        async with client.conversation() as conversation:
            async for chunk in conversation.send([ChatMessage.user("hi")]):
                print(chunk.text, end="")
            async with conversation.keep_alive():
                await run_tool()

See docs/sdk.md.
"""

from kvferry.sdk._client import Client, new_conversation_id
from kvferry.sdk._config import (
    ENV_ADDRESS,
    ENV_API_KEY,
    ENV_TLS,
    ENV_TLS_CA,
    ENV_TLS_CERT,
    ENV_TLS_KEY,
    ENV_TLS_SERVER_NAME,
    ClientConfig,
    Deadlines,
    TlsConfig,
)
from kvferry.sdk._conversation import Conversation, PromptInput
from kvferry.sdk._errors import (
    AbortedError,
    AlreadyExistsError,
    CallCancelledError,
    ConfigError,
    DeadlineExceededError,
    ErrorCode,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    KvferryError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    RpcError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from kvferry.sdk._keepalive import Clock, KeepAlive, KeepAliveSettings, SystemClock
from kvferry.sdk._models import (
    ChatMessage,
    Chunk,
    ConversationInfo,
    Reply,
    ReuseDecision,
    SamplingParams,
    TurnSummary,
)
from kvferry.sdk._proto import Prompt
from kvferry.sdk._retry import RetryPolicy
from kvferry.sdk._stream import TurnStream
from kvferry.sdk._sync import SyncClient, SyncConversation, SyncKeepAlive, SyncTurnStream

__all__ = [
    "ENV_ADDRESS",
    "ENV_API_KEY",
    "ENV_TLS",
    "ENV_TLS_CA",
    "ENV_TLS_CERT",
    "ENV_TLS_KEY",
    "ENV_TLS_SERVER_NAME",
    "AbortedError",
    "AlreadyExistsError",
    "CallCancelledError",
    "ChatMessage",
    "Chunk",
    "Client",
    "ClientConfig",
    "Clock",
    "ConfigError",
    "Conversation",
    "ConversationInfo",
    "DeadlineExceededError",
    "Deadlines",
    "ErrorCode",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "KeepAlive",
    "KeepAliveSettings",
    "KvferryError",
    "NotFoundError",
    "PermissionDeniedError",
    "Prompt",
    "PromptInput",
    "Reply",
    "ResourceExhaustedError",
    "RetryPolicy",
    "ReuseDecision",
    "RpcError",
    "SamplingParams",
    "SyncClient",
    "SyncConversation",
    "SyncKeepAlive",
    "SyncTurnStream",
    "SystemClock",
    "TlsConfig",
    "TurnStream",
    "TurnSummary",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "new_conversation_id",
]
