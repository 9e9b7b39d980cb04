"""Typed async client for ONE vLLM engine's HTTP API in prefill/decode (P/D) mode.

This is the one way kvferry talks to engines. It owns the wire form of vLLM's
``kv_transfer_params`` (vLLM 0.32, NixlConnector pull mode, ``bidirectional_kv_xfer`` on), so
no other module reads or writes those keys by hand.

How a turn flows (see docs/connector.md):

1. Prefill: ``POST /v1/completions`` on P with the prompt's token ids, ``max_tokens=1`` and
   ``kv_transfer_params = {"do_remote_decode": true, ...}``. When the conversation has KV
   retained on a decode engine, the params also name D's blocks (``remote_block_ids``,
   ``remote_engine_id``, ...): P pulls that prefix from D (NIXL READ) and computes only the
   suffix. P answers with :class:`KvHandoff` params pointing at P's blocks.
2. Decode: ``POST /v1/completions`` (streaming) on D with the same prompt and P's handoff
   params plus the kvferry mark. D pulls the prompt's KV from P and generates. When the
   request finishes, the kvferry connector in D retains the blocks and reports them to its
   sidecar, which publishes the retention to the registry. vLLM 0.32 does not put
   ``kv_transfer_params`` into streamed responses (only the non-streaming body has them), so
   the router learns about retentions from the registry, not from D's stream.
3. Next turn: the router turns the published retention into :class:`RetainedKv` and passes
   it to :meth:`VllmEngineClient.prefill` (step 1 with reuse).

Cancelling a streaming decode (the consumer stops iterating or its task is cancelled) closes
the HTTP connection; vLLM aborts the request when its client disconnects.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from kvferry.common.marks import MARK_KEY, ConversationMark, Mark

# Inside the kvferry object of a *prefill* request that reuses a retention: the latest time
# (unix seconds) the prefill may start reading it. The prefill engine's connector declines the
# pull (and recomputes) when less than its ``min_read_seconds`` is left. Pass
# :func:`read_deadline`: never later than the lease end, and within a read window shorter than
# the decode engine's release grace, so a retention released meanwhile is still intact (rule 1).
LEASE_EXPIRE_KEY = "lease_expire_time"

# Recommended read window (seconds); must stay below the connector's release_grace_seconds (30).
DEFAULT_READ_WINDOW_SECONDS = 10.0


def read_deadline(
    lease_expire_time: float, now: float, window_seconds: float = DEFAULT_READ_WINDOW_SECONDS
) -> float:
    """What to send as ``PrefillRequest.lease_expire_time`` for a retention handed out at ``now``."""
    return min(lease_expire_time, now + window_seconds)


class EngineHttpError(Exception):
    """The engine answered with an error (HTTP status >= 400, or an error event in a stream)."""

    def __init__(self, url: str, status_code: int, message: str) -> None:
        super().__init__(f"{url}: HTTP {status_code}: {message}")
        self.url = url
        self.status_code = status_code
        self.message = message


class EngineUnavailableError(Exception):
    """The engine could not be reached, or did not answer within the timeout."""

    def __init__(self, url: str, cause: BaseException) -> None:
        super().__init__(f"{url}: engine unreachable: {type(cause).__name__}: {cause}")
        self.url = url


@dataclass(frozen=True)
class HttpTimeouts:
    """Seconds; every call is bounded. ``read`` bounds each read, so a stream stalls at most that."""

    connect: float = 3.0
    read: float = 120.0
    write: float = 10.0
    pool: float = 10.0
    # Health and metadata calls (health, models, tokenize, metrics).
    control: float = 5.0

    def for_generation(self) -> httpx.Timeout:
        return httpx.Timeout(connect=self.connect, read=self.read, write=self.write, pool=self.pool)

    def for_control(self) -> httpx.Timeout:
        return httpx.Timeout(self.control, connect=self.connect)


# ---------------------------------------------------------------------------------------------
# kv_transfer_params: typed forms of what vLLM's NixlConnector reads and writes.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteBlocks:
    """KV blocks held by another engine, as vLLM names them in ``kv_transfer_params``."""

    engine_id: str
    request_id: str
    # One list per KV-cache group (a plain full-attention model has one group).
    block_ids: tuple[tuple[int, ...], ...]
    host: str
    port: int
    # Tokens whose KV the blocks hold (None: vLLM counts the whole prompt).
    num_tokens: int | None = None
    # vLLM's ``remote_blocks_expiry_time``: the holder's own clock, passed back unchanged.
    expiry_time: float | None = None
    tp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1

    def to_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_block_ids": [list(group) for group in self.block_ids],
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            "dcp_size": self.dcp_size,
            "pp_size": self.pp_size,
        }
        if self.num_tokens is not None:
            params["remote_num_tokens"] = self.num_tokens
        if self.expiry_time is not None:
            params["remote_blocks_expiry_time"] = self.expiry_time
        return params

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RemoteBlocks | None:
        """The remote blocks named in ``params``, or None when they name none."""
        raw_blocks = params.get("remote_block_ids")
        engine_id = params.get("remote_engine_id")
        if not raw_blocks or engine_id is None:
            return None
        try:
            groups = raw_blocks if raw_blocks and isinstance(raw_blocks[0], list) else [raw_blocks]
            return cls(
                engine_id=str(engine_id),
                request_id=str(params["remote_request_id"]),
                block_ids=tuple(tuple(int(b) for b in group) for group in groups),
                host=str(params["remote_host"]),
                port=int(params["remote_port"]),
                num_tokens=_opt_int(params.get("remote_num_tokens")),
                expiry_time=_opt_float(params.get("remote_blocks_expiry_time")),
                tp_size=int(params.get("tp_size") or 1),
                dcp_size=int(params.get("dcp_size") or 1),
                pp_size=int(params.get("pp_size") or 1),
            )
        except (KeyError, TypeError, ValueError) as bad:
            raise ValueError(f"malformed remote blocks in kv_transfer_params: {bad!r}") from None


@dataclass(frozen=True)
class KvHandoff:
    """What one engine's finished request tells the next engine (vLLM's returned params).

    From P (``do_remote_prefill``): D must pull the prompt's KV from ``blocks``.
    From D (``do_remote_decode``, non-streaming responses only): the blocks D retained.
    """

    do_remote_prefill: bool
    do_remote_decode: bool
    blocks: RemoteBlocks | None
    transfer_mode: str = "pull"

    def to_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "do_remote_prefill": self.do_remote_prefill,
            "do_remote_decode": self.do_remote_decode,
            "transfer_mode": self.transfer_mode,
        }
        if self.blocks is not None:
            params.update(self.blocks.to_params())
        return params

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> KvHandoff | None:
        if not params:
            return None
        return cls(
            do_remote_prefill=bool(params.get("do_remote_prefill")),
            do_remote_decode=bool(params.get("do_remote_decode")),
            blocks=RemoteBlocks.from_params(params),
            transfer_mode=str(params.get("transfer_mode") or "pull"),
        )


@dataclass(frozen=True)
class RetainedKv:
    """A retention on a decode engine that a prefill may pull its prompt prefix from.

    Built by the router from the registry's Retention and Engine records.
    """

    engine_id: str
    engine_request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    nixl_host: str
    nixl_port: int
    block_size: int
    # When the retention's lease ends, unix seconds.
    lease_expire_time: float

    @classmethod
    def from_decode_answer(
        cls, handoff: KvHandoff | None, *, block_size: int, lease_expire_time: float
    ) -> RetainedKv | None:
        """What a decode engine's answer offers for the next turn (None when it names no blocks)."""
        blocks = handoff.blocks if handoff is not None else None
        if blocks is None or not blocks.num_tokens:
            return None
        return cls(
            engine_id=blocks.engine_id,
            engine_request_id=blocks.request_id,
            block_ids=blocks.block_ids[0],
            num_tokens=blocks.num_tokens,
            nixl_host=blocks.host,
            nixl_port=blocks.port,
            block_size=block_size,
            lease_expire_time=lease_expire_time,
        )

    def prefix(self, num_tokens: int) -> RemoteBlocks:
        """The first ``num_tokens`` (block-aligned, at most what is retained) as pull params.

        vLLM aligns the pulled blocks to the *end* of ``remote_block_ids``, so the list must
        hold exactly the blocks of the reused prefix.
        """
        if num_tokens <= 0 or num_tokens % self.block_size:
            raise ValueError(f"reuse of {num_tokens} tokens is not a positive multiple of {self.block_size}")
        if num_tokens > self.num_tokens:
            raise ValueError(f"reuse of {num_tokens} tokens exceeds the {self.num_tokens} retained")
        num_blocks = num_tokens // self.block_size
        if num_blocks > len(self.block_ids):
            raise ValueError(f"{num_blocks} blocks needed, retention lists {len(self.block_ids)}")
        return RemoteBlocks(
            engine_id=self.engine_id,
            request_id=self.engine_request_id,
            block_ids=(tuple(self.block_ids[:num_blocks]),),
            host=self.nixl_host,
            port=self.nixl_port,
            num_tokens=num_tokens,
        )


def max_reusable_tokens(prompt_len: int, matched_tokens: int, block_size: int) -> int:
    """The longest block-aligned prefix P may pull: within the verified match, and leaving at
    least one prompt token for P to compute (vLLM needs one to produce the first token)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    limit = min(matched_tokens, prompt_len - 1)
    return max(0, limit // block_size * block_size)


def mark_params(mark: Mark | None, *, lease_expire_time: float | None = None) -> dict[str, Any]:
    """The kvferry object for ``kv_transfer_params`` (empty without a mark); a reused retention's
    lease end rides along with a conversation mark."""
    if mark is None:
        return {}
    params = mark.to_params()
    if lease_expire_time is not None and isinstance(mark, ConversationMark):
        params[MARK_KEY][LEASE_EXPIRE_KEY] = lease_expire_time
    return params


def lease_expire_time_from_params(params: Mapping[str, Any] | None) -> float | None:
    """The reused retention's lease end carried by a prefill request, if any."""
    if not params:
        return None
    raw = params.get(MARK_KEY)
    if not isinstance(raw, Mapping):
        return None
    return _opt_float(raw.get(LEASE_EXPIRE_KEY))


def prefill_transfer_params(
    mark: ConversationMark | None, reuse: RemoteBlocks | None, *, lease_expire_time: float | None
) -> dict[str, Any]:
    """``kv_transfer_params`` for a prefill request (P computes, D will pull)."""
    params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
    if reuse is not None:
        params.update(reuse.to_params())
    params.update(mark_params(mark, lease_expire_time=lease_expire_time if reuse else None))
    return params


def decode_transfer_params(handoff: KvHandoff, mark: Mark | None) -> dict[str, Any]:
    """``kv_transfer_params`` for a decode request: P's handoff plus the kvferry mark."""
    if not handoff.do_remote_prefill or handoff.blocks is None:
        raise ValueError("the prefill's handoff does not name blocks to pull (do_remote_prefill unset)")
    params = handoff.to_params()
    params.update(mark_params(mark))
    return params


# ---------------------------------------------------------------------------------------------
# Requests and results
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """Sampling options passed to the decode engine."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "ignore_eos": self.ignore_eos,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        if self.stop_token_ids:
            body["stop_token_ids"] = list(self.stop_token_ids)
        return body


@dataclass(frozen=True)
class PrefillRequest:
    token_ids: tuple[int, ...]
    mark: ConversationMark | None = None
    # Pull this prefix from a decode engine instead of computing it.
    reuse: RemoteBlocks | None = None
    # The reused retention's lease end, unix seconds (required with ``reuse`` and a mark).
    lease_expire_time: float | None = None
    # Sent as X-Request-Id; vLLM's engine request id is derived from it.
    request_id: str | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens whose KV was not computed (local prefix cache + pulled); needs the engine's
    # --enable-prompt-tokens-details, else None.
    cached_tokens: int | None = None

    @classmethod
    def from_body(cls, raw: Mapping[str, Any] | None) -> Usage | None:
        if not raw:
            return None
        details = raw.get("prompt_tokens_details") or {}
        return cls(
            prompt_tokens=int(raw.get("prompt_tokens") or 0),
            completion_tokens=int(raw.get("completion_tokens") or 0),
            cached_tokens=_opt_int(details.get("cached_tokens")),
        )


@dataclass(frozen=True)
class PrefillResult:
    handoff: KvHandoff
    first_token_ids: tuple[int, ...]
    usage: Usage | None


@dataclass(frozen=True)
class DecodeRequest:
    token_ids: tuple[int, ...]
    handoff: KvHandoff
    # A conversation mark retains the decode's blocks; a release mark frees them at the end; none
    # leaves them to vLLM (held for its decoder_kv_blocks_ttl).
    mark: Mark | None = None
    sampling: Sampling = field(default_factory=Sampling)
    request_id: str | None = None


FinishReason = Literal["stop", "length", "abort", "error"] | str


@dataclass(frozen=True)
class DecodeChunk:
    """One streamed piece of the decode: new tokens, and on the last one the finish reason."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    # Only on the trailing usage chunk (then token_ids is empty).
    usage: Usage | None = None


@dataclass(frozen=True)
class DecodeResult:
    """A non-streaming decode: D's own returned params name the blocks it retained."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None
    usage: Usage | None
    retained: KvHandoff | None


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class ModelInfo:
    id: str
    max_model_len: int | None


@dataclass(frozen=True)
class EngineMetrics:
    """Counters from the engine's Prometheus endpoint (summed over label sets)."""

    prompt_tokens_total: float
    # vllm:prompt_tokens_by_source, by ``source`` label (e.g. local_compute, local_cache_hit,
    # external_kv_transfer).
    prompt_tokens_by_source: Mapping[str, float]
    external_prefix_cache_hits: float
    external_prefix_cache_queries: float
    kv_cache_usage: float
    running_requests: float
    waiting_requests: float


# ---------------------------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------------------------


class VllmEngineClient:
    """Talks to one engine. Create once per engine and share; close with :meth:`aclose`."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        timeouts: HttpTimeouts | None = None,
        max_connections: int = 64,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeouts = timeouts or HttpTimeouts()
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=self.timeouts.for_generation(),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            transport=transport,
        )

    async def __aenter__(self) -> VllmEngineClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- control ----------------------------------------------------------------------------

    async def health(self) -> bool:
        """True when the engine answers /health with 200."""
        try:
            response = await self._http.get("/health", timeout=self.timeouts.for_control())
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def models(self) -> list[ModelInfo]:
        body = await self._get_json("/v1/models")
        return [
            ModelInfo(id=str(item["id"]), max_model_len=_opt_int(item.get("max_model_len")))
            for item in body.get("data", [])
        ]

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        body = await self._post_json(
            "/tokenize",
            {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens},
            control=True,
        )
        return [int(t) for t in body["tokens"]]

    async def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of ``messages`` rendered through the model's chat template."""
        body = await self._post_json(
            "/tokenize",
            {
                "model": self.model,
                "messages": [{"role": m.role, "content": m.content} for m in messages],
                "add_generation_prompt": add_generation_prompt,
                "continue_final_message": continue_final_message,
                "add_special_tokens": False,
            },
            control=True,
        )
        return [int(t) for t in body["tokens"]]

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        body = await self._post_json(
            "/detokenize", {"model": self.model, "tokens": list(token_ids)}, control=True
        )
        return str(body["prompt"])

    async def metrics(self) -> EngineMetrics:
        try:
            response = await self._http.get("/metrics", timeout=self.timeouts.for_control())
        except httpx.HTTPError as error:
            raise EngineUnavailableError(self.base_url, error) from error
        _raise_for_status(self.base_url, response)
        return parse_metrics(response.text)

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Aborts requests by the ids given as X-Request-Id (vLLM's external ids)."""
        await self._post("/inference/v1/abort_requests", {"request_ids": list(request_ids)}, control=True)

    # -- generation -------------------------------------------------------------------------

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Computes the prompt on a prefill engine (pulling ``reuse`` first when given)."""
        if request.reuse is not None and request.mark is not None and request.lease_expire_time is None:
            raise ValueError("a marked prefill that reuses a retention must carry its lease_expire_time")
        body = {
            "model": self.model,
            "prompt": list(request.token_ids),
            "max_tokens": 1,
            "temperature": 0.0,
            "stream": False,
            "return_token_ids": True,
            "kv_transfer_params": prefill_transfer_params(
                request.mark, request.reuse, lease_expire_time=request.lease_expire_time
            ),
        }
        answer = await self._post_json("/v1/completions", body, request_id=request.request_id)
        handoff = KvHandoff.from_params(answer.get("kv_transfer_params"))
        if handoff is None or not handoff.do_remote_prefill:
            raise EngineHttpError(
                self.base_url,
                200,
                "prefill answered without kv_transfer_params: is the engine a kvferry/Nixl prefill engine?",
            )
        choice = (answer.get("choices") or [{}])[0]
        return PrefillResult(
            handoff=handoff,
            first_token_ids=tuple(int(t) for t in choice.get("token_ids") or ()),
            usage=Usage.from_body(answer.get("usage")),
        )

    async def decode_stream(self, request: DecodeRequest) -> AsyncGenerator[DecodeChunk, None]:
        """Streams the decode engine's output. Stop iterating (or cancel) to abort it."""
        body = self._decode_body(request, stream=True)
        headers = _request_headers(request.request_id)
        try:
            async with self._http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
                if response.status_code >= 400:
                    await response.aread()
                    _raise_for_status(self.base_url, response)
                async for line in response.aiter_lines():
                    chunk = _parse_stream_line(self.base_url, line)
                    if chunk is not None:
                        yield chunk
        except httpx.HTTPError as error:
            raise EngineUnavailableError(self.base_url, error) from error

    async def decode(self, request: DecodeRequest) -> DecodeResult:
        """Non-streaming decode; its answer names the blocks D retained (``retained``)."""
        body = self._decode_body(request, stream=False)
        answer = await self._post_json("/v1/completions", body, request_id=request.request_id)
        choice = (answer.get("choices") or [{}])[0]
        return DecodeResult(
            token_ids=tuple(int(t) for t in choice.get("token_ids") or ()),
            text=str(choice.get("text") or ""),
            finish_reason=choice.get("finish_reason"),
            usage=Usage.from_body(answer.get("usage")),
            retained=KvHandoff.from_params(answer.get("kv_transfer_params")),
        )

    def _decode_body(self, request: DecodeRequest, *, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(request.token_ids),
            "stream": stream,
            "return_token_ids": True,
            "kv_transfer_params": decode_transfer_params(request.handoff, request.mark),
        }
        body.update(request.sampling.to_body())
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    # -- plumbing ---------------------------------------------------------------------------

    async def _get_json(self, path: str) -> dict[str, Any]:
        try:
            response = await self._http.get(path, timeout=self.timeouts.for_control())
        except httpx.HTTPError as error:
            raise EngineUnavailableError(self.base_url, error) from error
        _raise_for_status(self.base_url, response)
        return _json_object(self.base_url, response)

    async def _post(
        self, path: str, body: Mapping[str, Any], *, control: bool = False, request_id: str | None = None
    ) -> httpx.Response:
        timeout = self.timeouts.for_control() if control else self.timeouts.for_generation()
        try:
            response = await self._http.post(
                path, json=body, timeout=timeout, headers=_request_headers(request_id)
            )
        except httpx.HTTPError as error:
            raise EngineUnavailableError(self.base_url, error) from error
        _raise_for_status(self.base_url, response)
        return response

    async def _post_json(
        self, path: str, body: Mapping[str, Any], *, control: bool = False, request_id: str | None = None
    ) -> dict[str, Any]:
        response = await self._post(path, body, control=control, request_id=request_id)
        return _json_object(self.base_url, response)


# ---------------------------------------------------------------------------------------------
# Parsing helpers (pure; tested without an engine)
# ---------------------------------------------------------------------------------------------


def _request_headers(request_id: str | None) -> dict[str, str]:
    return {"X-Request-Id": request_id} if request_id else {}


def _raise_for_status(url: str, response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    message = response.text
    try:
        body = response.json()
        error = body.get("error", body) if isinstance(body, dict) else body
        message = str(error.get("message", error)) if isinstance(error, dict) else str(error)
    except ValueError:
        pass
    raise EngineHttpError(url, response.status_code, message[:2000])


def _json_object(url: str, response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        raise EngineHttpError(url, response.status_code, f"not JSON: {response.text[:200]!r}") from None
    if not isinstance(body, dict):
        raise EngineHttpError(url, response.status_code, f"expected a JSON object, got {type(body).__name__}")
    return body


def _parse_stream_line(url: str, line: str) -> DecodeChunk | None:
    """One SSE line of a streamed completion -> chunk (None for keep-alives and [DONE])."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if not data or data == "[DONE]":
        return None
    try:
        event = json.loads(data)
    except ValueError:
        raise EngineHttpError(url, 200, f"malformed stream event: {data[:200]!r}") from None
    if "error" in event:
        error = event["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        code = error.get("code", 500) if isinstance(error, dict) else 500
        raise EngineHttpError(url, int(code) if isinstance(code, int) else 500, str(message))
    usage = Usage.from_body(event.get("usage"))
    choices = event.get("choices") or []
    if not choices:
        return DecodeChunk(token_ids=(), text="", usage=usage) if usage else None
    choice = choices[0]
    return DecodeChunk(
        token_ids=tuple(int(t) for t in choice.get("token_ids") or ()),
        text=str(choice.get("text") or ""),
        finish_reason=choice.get("finish_reason"),
        usage=usage,
    )


def parse_metrics(text: str) -> EngineMetrics:
    """The counters kvferry reads from vLLM's Prometheus text format."""
    sums: dict[str, float] = {}
    by_source: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_and_labels, _, value_text = line.rpartition(" ")
        try:
            value = float(value_text)
        except ValueError:
            continue
        if math.isnan(value):
            continue
        name, _, labels = name_and_labels.partition("{")
        sums[name] = sums.get(name, 0.0) + value
        if name == "vllm:prompt_tokens_by_source_total":
            source = _label(labels, "source")
            if source is not None:
                by_source[source] = by_source.get(source, 0.0) + value
    return EngineMetrics(
        prompt_tokens_total=sums.get("vllm:prompt_tokens_total", 0.0),
        prompt_tokens_by_source=by_source,
        external_prefix_cache_hits=sums.get("vllm:external_prefix_cache_hits_total", 0.0),
        external_prefix_cache_queries=sums.get("vllm:external_prefix_cache_queries_total", 0.0),
        kv_cache_usage=sums.get("vllm:kv_cache_usage_perc", 0.0),
        running_requests=sums.get("vllm:num_requests_running", 0.0),
        waiting_requests=sums.get("vllm:num_requests_waiting", 0.0),
    )


def _label(labels: str, key: str) -> str | None:
    for part in labels.rstrip("}").split(","):
        name, _, value = part.partition("=")
        if name.strip() == key:
            return value.strip().strip('"')
    return None


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
