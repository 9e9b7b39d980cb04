"""One turn of a conversation, end to end: the router's core, free of any wire protocol.

``prepare`` (may raise a ``ServiceError`` before anything is sent to the client):
  1. resolve the model; 2. turn the prompt into token ids (the engines' own tokenizer / chat
  template) while, for a conversation, taking its turn mark in the registry (one turn in flight per
  conversation, across router replicas: a second one is refused, ABORTED / HTTP 409, naming the running
  one) and looking its retention up - in the router's retention index when it can answer, else in the
  registry; the mark's answer confirms it (the lookup opens the retention's read window:
  :class:`~kvferry.pd.reuse.ReadWindow`); 3. check the length against the model's limit. A mark still in
  flight once the prompt and the lookup are ready is not waited for here unless the lookup is a record the
  index found (which may be of an engine incarnation that is gone): ``execute`` sends P's request beside it
  and settles it before anything reaches D or the client (a refusal cancels P's request; a mark that does not
  confirm the lookup drops it and plans the turn again).
``execute`` (an async stream of :class:`TextOut`, then one :class:`TurnResult`):
  4-6. plan the attempt (:func:`kvferry.router.plan.plan_turn`: the proven prefix, pull or recompute,
  the engines); 7. run :func:`kvferry.pd.sequence.prefill_then_decode`: prefill with ``max_tokens=1``
  (pulling the prefix if chosen), then stream the decode, marked so its connector retains the
  conversation for the next turn (a streamed token-prompt turn shows P's token first and D continues
  after it: ``TurnSettings.first_token_from_prefill``); 8. wait (bounded) until the registry shows the
  new retention (seen in the router's retention index, else asked), so the next turn - on any router
  replica - finds it; 9. clear the turn's mark (renewed meanwhile), before the client has the result,
  so its next turn is never refused.
An engine failing before the first token reaches the client is retried once on other engines by
recompute, and so is a decode that fails before its own output after P's token was shown (the retry
continues after that token); after the decode's output the client gets a clear error. The retention is
renewed every turn. The engines and the registry come in through ports (:class:`EnginePort`,
:class:`RetentionPort`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from kvferry.pd.chat import ChatRequest
from kvferry.pd.engine_api import (
    ENGINE_ERRORS,
    NORMAL_FINISH_REASONS,
    EngineApi,
    EngineHttpError,
    EngineUnavailableError,
    Sampling,
)
from kvferry.pd.kvferry_params import ConversationMark, PeerAddress, ReleaseMark
from kvferry.pd.reuse import DEFAULT_READ_WINDOW_SECONDS, ReadWindow
from kvferry.pd.sequence import (
    Decoded,
    EngineTurn,
    Prefilled,
    PrefillToken,
    prefill_then_decode,
    with_first_token,
)
from kvferry.pd.sequence import TurnEvent as SequenceEvent
from kvferry.router.cost import CostSettings, Reuse
from kvferry.router.engines import EngineInfo, EngineTable, LoadTracker
from kvferry.router.limits import TenantLimits, TenantLimitSettings, TurnSlot
from kvferry.router.observe import TurnTelemetry
from kvferry.router.plan import PlanSettings, TurnPlan, hash_ahead, plan_turn
from kvferry.router.prefix import PromptDigestCache, PromptDigests
from kvferry.router.registry_client import BegunTurn, RegistryUnavailable, RetentionRecord
from kvferry.router.retention_index import RetentionIndex, RetentionLookups
from kvferry.router.summary import summary_proto
from kvferry.router.tenants import Tenant
from kvferry.runtime.errors import Aborted, InvalidArgument, NotFound, ServiceError, Unavailable
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span

log = logging.getLogger(__name__)

# How long a turn waits for its publication to show in the router's retention index before it asks the
# registry as well (a lagging index then costs registry polls, never a turn reported unpublished).
INDEX_PUBLICATION_SECONDS = 0.25


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request in OpenAI's form, served through the engines' chat endpoint (kvferry.pd.chat); its
    sampling fields are its own (the turn's :class:`SamplingOptions` give only ``max_tokens``)."""

    chat: ChatRequest


@dataclass(frozen=True)
class TokenPrompt:
    # Checked by the API that took them (kvferry.router.validation.token_ids): not again per turn (a
    # 25,000-id prompt costs ~0.3 ms a pass).
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class TextPrompt:
    text: str


Prompt = ChatPrompt | TokenPrompt | TextPrompt


@dataclass(frozen=True)
class SamplingOptions:
    # None: the router's default, capped by what the model's context has left.
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class TurnRequest:
    tenant: Tenant
    # None: a one-off turn, nothing looked up or retained.
    conversation_id: str | None
    # "" takes the only served model.
    model: str
    prompt: Prompt
    sampling: SamplingOptions = dataclasses.field(default_factory=SamplingOptions)
    retain: bool = True
    # False: the decode is not streamed: one TextOut with the whole text, or (chat) the engine's whole
    # answer in the result.
    stream: bool = True
    # When the front door had the request (``time.perf_counter``; HTTP: the handler's start, before the body
    # was read and checked), for the turn line's ``request_read_ms``; None: the turn's own start.
    received_at: float | None = None


@dataclass(frozen=True)
class TextOut:
    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ChatOut:
    """One event of a chat turn's stream, as the decode engine sent it (the JSON after ``data:``; its
    trailing usage event is not one: the turn's result reports usage)."""

    raw: bytes


TurnEvent = TextOut | ChatOut


@dataclass(frozen=True)
class TurnResult:
    """What happened in a finished turn (the gRPC TurnSummary; the HTTP usage extras)."""

    model: str
    prompt_tokens: int
    completion_tokens: int
    pulled_tokens: int
    recomputed_tokens: int
    ttft_ms: float
    prefill_ms: float
    reuse: Reuse
    prefill_engine_id: str
    decode_engine_id: str
    finish_reason: str
    # The conversation's turn now retained (0: none).
    turn: int
    request_id: str
    # Prompt tokens the retention was proven to hold (whether pulled or not).
    matched_tokens: int = 0
    # A chat turn that was not streamed: the decode engine's chat completion (kv_transfer_params removed).
    answer: Mapping[str, Any] | None = None
    # The decode engine's usage object (fields kvferry passes on, e.g. reasoning tokens).
    engine_usage: Mapping[str, Any] | None = None


@dataclass
class TurnMark:
    """The registry's mark of a turn in flight, held from ``prepare`` until the turn ends."""

    tenant: str
    conversation_id: str
    request_id: str
    ttl_seconds: int
    released: bool = False
    keeper: asyncio.Task[None] | None = None


@dataclass(frozen=True)
class PreparedTurn:
    request: TurnRequest
    request_id: str
    model: str
    token_ids: tuple[int, ...]
    sampling: Sampling
    # A chat turn's request as the engines get it (max_tokens resolved).
    chat: ChatRequest | None
    retention: RetentionRecord | None
    # False when the registry did not answer: this turn neither reuses nor retains.
    registry_ok: bool
    started: float
    # The retention's read window, opened when it was looked up (None without a retention).
    read_window: ReadWindow | None = None
    # The turn's mark in the registry (None: no conversation, or the registry did not answer).
    mark: TurnMark | None = None
    # The turn's span (ended when the turn's stream ends).
    span: Span = trace.INVALID_SPAN
    # The tenant's slot for this turn (kvferry.router.limits), given back when the turn's stream ends.
    slot: TurnSlot | None = None
    # The router's retention index's revision before the turn ran (0: no index).
    index_revision: int = 0
    # The prompt's digests for the prefix check, hashed while the mark was in flight (None: not hashed).
    prompt_digests: PromptDigests | None = None
    # The mark, still in flight when the prompt and the lookup were ready: the first attempt's P request goes
    # out beside it, and the turn settles it (``mark``, and the lookup it confirms) before anything reaches D
    # or the client. None: settled in ``prepare`` (or no conversation).
    marking: asyncio.Future[_MarkTaken | None] | None = None
    # ``retention`` is the router's index's, not yet confirmed by ``marking``: a plan that pulls it waits
    # for the mark's answer before P's request (see ``_LookedUp.from_index``).
    retention_from_index: bool = False


@dataclass(frozen=True)
class TurnSettings:
    cost: CostSettings
    # max_tokens when the request sets none (capped by the context left).
    default_max_tokens: int = 256
    # Attempts per turn: the first, plus retries by recompute on other engines.
    max_attempts: int = 2
    # How long to wait after the last token for the registry to show the new retention.
    publish_wait_seconds: float = 2.0
    # How long after looking a retention up a prefill may still start reading it; safely under the decode
    # engines' release grace (rule 1), see kvferry.pd.reuse.
    read_window_seconds: float = DEFAULT_READ_WINDOW_SECONDS
    # The lease of a turn's mark (renewed every third of it while the turn runs): how long a conversation
    # stays held after the router running its turn died.
    turn_mark_seconds: int = 5
    # Names this router in the mark (what a refused turn is told).
    holder: str = ""
    # Per-tenant caps (turns in flight, tokens per second).
    tenant_limits: TenantLimitSettings = field(default_factory=TenantLimitSettings)
    # A streamed token-prompt turn shows P's token first and D continues after it (kvferry.pd.sequence):
    # the time to the first token is P's alone.
    first_token_from_prefill: bool = True
    # What the conversations' last prompts hashed, chained on from by their next turns (PromptDigestCache).
    prompt_digest_cache_bytes: int = 32 * 2**20


class EnginePort(Protocol):
    """How a turn reaches a registered engine (:class:`~kvferry.router.engine_clients.EngineClients` over
    HTTP; fakes in tests)."""

    def get(self, engine: EngineInfo) -> EngineApi: ...


class RetentionPort(Protocol):
    """What a turn asks of the registry (:class:`~kvferry.router.registry_client.GrpcRegistry`; fakes in
    tests). A registry that does not answer raises :class:`RegistryUnavailable`."""

    async def get_retention(self, tenant: str, conversation_id: str) -> RetentionRecord | None: ...

    async def renew_retention(self, tenant: str, conversation_id: str) -> float | None: ...

    async def begin_turn(
        self, tenant: str, conversation_id: str, request_id: str, *, holder: str, ttl_seconds: int
    ) -> BegunTurn: ...

    async def end_turn(self, tenant: str, conversation_id: str, request_id: str) -> bool: ...


@dataclass(frozen=True)
class _MarkTaken:
    mark: TurnMark
    begun: BegunTurn


# Loop turns a registry call takes to reach gRPC core from its first step (dev VM: with none, the mark asked
# ahead went out only after the body's parse; with 3-6 before it).
_LOOP_TURNS_TO_SEND_A_CALL = 6


def _new_request_id() -> str:
    return f"kvf-{uuid.uuid4().hex[:20]}"


@dataclass
class MarkAhead:
    """A turn's mark asked for before its request was read whole: a header named the conversation, so the
    mark's round trip (an etcd write behind the registry) overlaps reading and checking the body (~2 ms for
    25,000 token ids). The turn prepared with it adopts the mark; a request that never becomes a turn drops
    it (:meth:`TurnRunner.mark_ahead`)."""

    tenant: str
    conversation_id: str
    request_id: str
    # When the mark was asked: a lookup it confirms opens its read window here (earlier is safe).
    asked_at: float
    marking: asyncio.Future[_MarkTaken | None]
    adopted: bool = False


class _LookedUp(NamedTuple):
    """A turn's retention lookup: the record (None: none), its read window, whether the registry answered."""

    retention: RetentionRecord | None
    window: ReadWindow | None
    registry_ok: bool
    # Found in the router's retention index: a hint until the turn's mark confirms it. The index may still
    # hold a record of an engine incarnation that is gone (the engine restarted: those block ids now hold
    # other requests' KV), which the registry would not serve; nothing pulls it before the mark's answer.
    from_index: bool = False


@dataclass(frozen=True)
class _Settlement:
    """The turn's mark (None: not taken) and the retention the turn runs with."""

    mark: TurnMark | None
    retention: RetentionRecord | None
    window: ReadWindow | None
    registry_ok: bool


@dataclass(frozen=True)
class _MarkSettled:
    """``_run`` to ``execute``: the turn's mark, still in flight when the turn was prepared, is settled (the
    turn as it runs from here)."""

    turn: PreparedTurn


@dataclass(frozen=True)
class _EngineFailure:
    """An engine failed the turn (unreachable, 5xx, a stream cut): retried by recompute before any output."""

    engine_id: str
    role: str
    cause: BaseException

    def __str__(self) -> str:
        return f"{self.role} engine {self.engine_id} failed: {self.cause}"


class TurnRunner:
    """Runs turns against the engines and the registry it is given (one per router process)."""

    def __init__(
        self,
        *,
        engines: EngineTable,
        load: LoadTracker,
        clients: EnginePort,
        registry: RetentionPort,
        settings: TurnSettings,
        telemetry: TurnTelemetry | None = None,
        clock: Callable[[], float] = time.monotonic,
        index: RetentionIndex | None = None,
    ) -> None:
        """``index``: the router's retention index, read first by lookups (None: every lookup asks the
        registry)."""
        self.telemetry = telemetry or TurnTelemetry()
        self._engines = engines
        self._load = load
        self._clients = clients
        self._registry = registry
        self._settings = settings
        self._plan_settings = PlanSettings(settings.cost, settings.read_window_seconds)
        self._prompt_digests = PromptDigestCache(settings.prompt_digest_cache_bytes)
        # Read windows are measured on the monotonic clock, never compared with another machine's.
        self._clock = clock
        self._lookups = RetentionLookups(registry, index)
        self._background: set[asyncio.Task[None]] = set()
        self.tenant_limits = TenantLimits(settings.tenant_limits, clock=clock)

    # -- prepare ------------------------------------------------------------------------------

    def resolve_model(self, requested: str, tenant: Tenant) -> str:
        served = self._engines.models()
        if not requested:
            if len(served) == 1:
                model = served[0]
            elif not served:
                raise Unavailable("no engine is registered yet: start engines (and their sidecars) first")
            else:
                raise InvalidArgument(f"model is required: this router serves {served}", param="model")
        elif requested not in served:
            raise NotFound(
                f"model {requested!r} is not served here; served models: {served}",
                param="model",
            )
        else:
            model = requested
        tenant.check_model(model)
        return model

    @contextlib.asynccontextmanager
    async def mark_ahead(self, tenant: Tenant, conversation_id: str) -> AsyncIterator[MarkAhead | None]:
        """Asks for a turn's mark now, before the request is read whole; :meth:`prepare` adopts it when the
        turn is of that conversation. Not adopted by the end of the block (the body was refused, the tenant
        went over its limit, the client went away), the mark is cleared: before the error is out, as for any
        turn refused before it ran. None (nothing asked) while the tenant is at its limit: a refused turn
        costs the registry nothing."""
        if self.tenant_limits.refuses(tenant):
            yield None
            return
        request_id = _new_request_id()
        asked_at = self._clock()
        ahead = MarkAhead(
            tenant.name,
            conversation_id,
            request_id,
            asked_at,
            asyncio.ensure_future(self._begin_turn(tenant.name, conversation_id, request_id)),
        )
        cancelled = False
        try:
            # The mark's RPC reaches gRPC core (which sends it on its own thread) only after a few turns of
            # the loop (its task, the tracing interceptor's, the call's); the body that follows is read and
            # checked without yielding (~2 ms for 25,000 ids), so let the RPC go out first.
            for _ in range(_LOOP_TURNS_TO_SEND_A_CALL):
                await asyncio.sleep(0)
            yield ahead
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            if not ahead.adopted:
                if cancelled:
                    self._spawn(self._drop_mark(ahead.marking))
                else:
                    await self._drop_mark(ahead.marking)

    async def prepare(self, request: TurnRequest, ahead: MarkAhead | None = None) -> PreparedTurn:
        """Everything before the engines: may raise a ``ServiceError``. Opens the turn's span, which
        :meth:`execute` ends. ``ahead``: the turn's mark, asked for already (:meth:`mark_ahead`)."""
        started = time.perf_counter()
        span = self.telemetry.start_turn(request.conversation_id)
        slot: TurnSlot | None = None
        try:
            slot = self.tenant_limits.admit(request.tenant)
            with trace.use_span(
                span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ):
                prepared = await self._prepare(request, started, ahead)
            slot.charge(len(prepared.token_ids))
        except BaseException as error:
            if slot is not None:
                slot.release()
            self.telemetry.turn_failed(span, error)
            span.end()
            raise
        return dataclasses.replace(prepared, span=span, slot=slot)

    async def _prepare(self, request: TurnRequest, started: float, ahead: MarkAhead | None) -> PreparedTurn:
        model = self.resolve_model(request.model, request.tenant)
        tenant, conversation_id = request.tenant.name, request.conversation_id
        # The mark, the lookup and the tokenization run together: an uncontended turn waits for none of the
        # registry calls unless they are slower than tokenizing. The read window opens before the mark is
        # asked: a lookup the mark confirms was current when the registry read the mark's transaction.
        marking: asyncio.Future[_MarkTaken | None] | None
        if ahead is not None and (ahead.tenant, ahead.conversation_id) == (tenant, conversation_id):
            ahead.adopted = True
            request_id, looked_up_at, marking = ahead.request_id, ahead.asked_at, ahead.marking
        else:
            request_id = _new_request_id()
            looked_up_at = self._clock()
            marking = (
                asyncio.ensure_future(self._begin_turn(tenant, conversation_id, request_id))
                if conversation_id
                else None
            )
        # What the router's index held before this turn ran: its publication comes after.
        index_revision = self._lookups.index.revision if self._lookups.index is not None else 0
        lookup = (
            asyncio.ensure_future(self._lookup(tenant, conversation_id, looked_up_at))
            if conversation_id
            else None
        )
        tokenizing = asyncio.ensure_future(self._tokenize(model, request.prompt))
        # The mark still in flight once the prompt and the lookup are ready: P's request goes out beside it
        # (``_run`` settles it before anything reaches D or the client).
        pending: asyncio.Future[_MarkTaken | None] | None = None
        try:
            if marking is not None:
                # A turn refused its mark fails at once, without waiting for the tokenizer.
                await asyncio.wait((marking, tokenizing), return_when=asyncio.FIRST_COMPLETED)
                if marking.done():
                    marking.result()
            token_ids = await tokenizing
            looked_up = await lookup if lookup is not None else _LookedUp(None, None, True)
            # Hashed now, while the mark may still be in flight, not after it.
            hashed = self._hash(model, token_ids, looked_up.retention)
            if marking is not None and not marking.done():
                # P's request may go out before the mark's answer, unless it pulls a record the index found
                # (``_run`` waits for the mark then).
                pending = marking
                settled = _Settlement(None, looked_up.retention, looked_up.window, looked_up.registry_ok)
            elif marking is not None:
                settled = await self._settle(tenant, conversation_id, await marking, looked_up)
            else:
                settled = _Settlement(None, looked_up.retention, looked_up.window, looked_up.registry_ok)
        except BaseException as error:
            for task in (lookup, tokenizing):
                if task is not None:
                    task.cancel()
            if marking is not None:
                if isinstance(error, asyncio.CancelledError):
                    self._spawn(self._drop_mark(marking))
                else:
                    # Before the client hears of the failure: it may send the turn again at once.
                    await self._drop_mark(marking)
            raise
        max_model_len = min(
            (e.max_model_len for e in self._model_engines(model) if e.max_model_len), default=0
        )
        try:
            max_tokens = self._check_length(len(token_ids), request.sampling.max_tokens, max_model_len, model)
        except BaseException:
            if settled.mark is not None:
                await self._release(settled.mark)
            if pending is not None:
                await self._drop_mark(pending)
            raise
        chat = None
        if isinstance(request.prompt, ChatPrompt):
            chat = request.prompt.chat
            if request.sampling.max_tokens is None:
                chat = ChatRequest({**chat.body, "max_tokens": max_tokens})
        return PreparedTurn(
            request=request,
            request_id=request_id,
            model=model,
            token_ids=token_ids,
            sampling=Sampling(**_sampling_fields(request.sampling, max_tokens)),
            chat=chat,
            retention=settled.retention,
            registry_ok=settled.registry_ok,
            started=started,
            read_window=settled.window,
            mark=settled.mark,
            marking=pending,
            retention_from_index=pending is not None and looked_up.from_index,
            index_revision=index_revision,
            prompt_digests=hashed,
        )

    async def _settle(
        self,
        tenant: str,
        conversation_id: str | None,
        taken: _MarkTaken | None,
        looked_up: _LookedUp,
    ) -> _Settlement:
        """The turn's mark and the retention it runs with, from the mark's answer and the lookup made beside
        it. Without its mark a turn runs unguarded: it neither reuses nor retains."""
        if taken is None:
            return _Settlement(None, None, None, False)
        if looked_up.registry_ok and not taken.begun.confirms(looked_up.retention):
            # The lookup is not what the registry held when the mark was taken (a turn was published or ended
            # in between, the index lags, or the record's engine left): the registry's answer now is current
            # (the mark holds the conversation still).
            looked_up = await self._lookup(tenant, conversation_id, self._clock(), from_registry=True)
        return _Settlement(taken.mark, looked_up.retention, looked_up.window, looked_up.registry_ok)

    async def _settle_marking(self, turn: PreparedTurn) -> tuple[PreparedTurn, bool]:
        """The turn once its mark in flight (``turn.marking``) answered, and whether the mark confirmed the
        lookup the turn was planned on (False: the turn runs with the registry's current answer, planned
        again)."""
        assert turn.marking is not None
        settled = await self._settle(
            turn.request.tenant.name,
            turn.request.conversation_id,
            await turn.marking,
            _LookedUp(turn.retention, turn.read_window, turn.registry_ok),
        )
        if settled.registry_ok == turn.registry_ok and _same_record(settled.retention, turn.retention):
            return dataclasses.replace(turn, mark=settled.mark, marking=None), True
        log.info(
            "the turn's mark did not confirm its lookup; planning again",
            extra={
                "request_id": turn.request_id,
                "conversation_id": turn.request.conversation_id,
                "retained_turn": settled.retention.turn if settled.retention else 0,
                "registry_ok": settled.registry_ok,
            },
        )
        changed = dataclasses.replace(
            turn,
            mark=settled.mark,
            retention=settled.retention,
            read_window=settled.window,
            registry_ok=settled.registry_ok,
            marking=None,
            prompt_digests=None,
        )
        return changed, False

    def _hash(
        self, model: str, token_ids: tuple[int, ...], retention: RetentionRecord | None
    ) -> PromptDigests | None:
        return hash_ahead(
            token_ids, retention, model=model, engines=self._engines, cache=self._prompt_digests
        )

    def _model_engines(self, model: str) -> list[EngineInfo]:
        return [e for e in self._engines.all() if e.model == model]

    def _check_length(self, prompt_len: int, max_tokens: int | None, max_model_len: int, model: str) -> int:
        if prompt_len == 0:
            raise InvalidArgument("the prompt is empty", param="prompt")
        if max_tokens is not None and max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if not max_model_len:
            return max_tokens or self._settings.default_max_tokens
        if prompt_len >= max_model_len:
            raise InvalidArgument(
                f"the prompt has {prompt_len} tokens; model {model!r} takes at most {max_model_len} "
                "tokens of prompt plus output: shorten the conversation",
                param="messages",
            )
        room = max_model_len - prompt_len
        if max_tokens is None:
            return min(self._settings.default_max_tokens, room)
        if max_tokens > room:
            raise InvalidArgument(
                f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}: together more than "
                f"model {model!r}'s limit of {max_model_len}; lower max_tokens to at most {room}",
                param="max_tokens",
            )
        return max_tokens

    async def _tokenize(self, model: str, prompt: Prompt) -> tuple[int, ...]:
        if isinstance(prompt, TokenPrompt):
            return prompt.token_ids
        # The least-loaded prefill engines first: they are idle-most, and all share the tokenizer.
        candidates = sorted(
            self._model_engines(model),
            key=lambda e: (not e.can_prefill, self._load.prefill_tokens(e.engine_id), e.engine_id),
        )
        last_error: BaseException | None = None
        for engine in candidates[:2]:
            client = self._clients.get(engine)
            try:
                if isinstance(prompt, ChatPrompt):
                    return tuple(await client.render_chat(prompt.chat))
                return tuple(await client.tokenize(prompt.text))
            except EngineHttpError as error:
                if 400 <= error.status_code < 500:
                    raise InvalidArgument(
                        f"the engine rejected the prompt: {error.message}", param="messages"
                    ) from None
                last_error = error
            except EngineUnavailableError as error:
                last_error = error
        raise Unavailable(f"no engine of model {model!r} could tokenize the prompt: {last_error}")

    async def _lookup(
        self, tenant: str, conversation_id: str | None, looked_up_at: float, *, from_registry: bool = False
    ) -> _LookedUp:
        """The conversation's retention and its read window, opened at ``looked_up_at``: *before* the
        registry is asked (the registry may end the retention right after it answered, and D's grace then
        runs from there), or before the mark that confirms an index hit is asked. ``from_registry``: not
        from the index."""
        if conversation_id is None:
            return _LookedUp(None, None, True)
        try:
            found = await self._lookups.lookup(tenant, conversation_id, from_registry=from_registry)
        except RegistryUnavailable as error:
            self.telemetry.registry_error("get_retention")
            log.warning(
                "registry unavailable: serving the turn by recompute",
                extra={"conversation_id": conversation_id, "error": str(error)},
            )
            return _LookedUp(None, None, False)
        self.telemetry.retention_lookup(found.path)
        retention = found.retention
        if retention is None:
            return _LookedUp(None, None, True)
        # D frees a retention only after the registry ended it, plus a grace of at least twice the window
        # (rule 1): the window needs no bound from the lease, which renewals move without telling anyone.
        window = ReadWindow.opened(looked_up_at, self._settings.read_window_seconds)
        return _LookedUp(retention, window, True, from_index=found.path == "index")

    async def _renew(self, tenant: str, conversation_id: str) -> None:
        try:
            await self._registry.renew_retention(tenant, conversation_id)
        except (RegistryUnavailable, ServiceError) as error:
            self.telemetry.registry_error("renew_retention")
            log.warning(
                "retention renewal failed", extra={"conversation_id": conversation_id, "error": str(error)}
            )

    async def _begin_turn(
        self, tenant: str, conversation_id: str | None, request_id: str
    ) -> _MarkTaken | None:
        """Takes the conversation's turn mark; None when the registry did not answer (the turn then runs
        without reuse or retention). Raises ``Aborted`` when another turn holds it."""
        assert conversation_id is not None
        try:
            begun = await self._ask_mark(tenant, conversation_id, request_id)
        except RegistryUnavailable as error:
            self.telemetry.registry_error("begin_turn")
            log.warning(
                "registry unavailable: the turn runs without its mark, by recompute",
                extra={"conversation_id": conversation_id, "error": str(error)},
            )
            return None
        except Aborted:
            log.info(
                "turn refused: another turn of the conversation is in flight",
                extra={"conversation_id": conversation_id, "request_id": request_id},
            )
            raise
        mark = TurnMark(tenant, conversation_id, request_id, max(1, begun.ttl_seconds))
        return _MarkTaken(mark, begun)

    async def _drop_mark(self, marking: asyncio.Future[_MarkTaken | None]) -> None:
        """Clears the mark a turn that will not run took (once the registry answered)."""
        try:
            taken = await marking
        except Exception:
            return  # not taken (refused, or the registry did not answer)
        if taken is not None:
            await self._release(taken.mark)

    async def _ask_mark(self, tenant: str, conversation_id: str, request_id: str) -> BegunTurn:
        """BeginTurn: takes the mark, or renews it when ``request_id`` holds it."""
        return await self._registry.begin_turn(
            tenant,
            conversation_id,
            request_id,
            holder=self._settings.holder,
            ttl_seconds=self._settings.turn_mark_seconds,
        )

    async def _keep_mark(self, mark: TurnMark) -> None:
        """Renews the turn's mark every third of its lease while the turn runs."""
        while True:
            await asyncio.sleep(mark.ttl_seconds / 3)
            try:
                begun = await self._ask_mark(mark.tenant, mark.conversation_id, mark.request_id)
                mark.ttl_seconds = max(1, begun.ttl_seconds)
            except (RegistryUnavailable, ServiceError) as error:
                # The turn goes on: what it publishes is still judged by the registry (an older or equal
                # turn is refused), only its exclusivity may lapse.
                self.telemetry.registry_error("begin_turn")
                log.warning(
                    "could not renew the turn's mark",
                    extra={
                        "conversation_id": mark.conversation_id,
                        "request_id": mark.request_id,
                        "error": str(error),
                    },
                )
                if isinstance(error, Aborted):
                    return

    async def _release(self, mark: TurnMark) -> None:
        """Clears the turn's mark (once); a registry that does not answer lets it expire instead."""
        if mark.released:
            return
        mark.released = True
        if mark.keeper is not None:
            mark.keeper.cancel()
        try:
            await self._registry.end_turn(mark.tenant, mark.conversation_id, mark.request_id)
        except (RegistryUnavailable, ServiceError) as error:
            self.telemetry.registry_error("end_turn")
            log.warning(
                "could not clear the turn's mark; it expires with its lease",
                extra={
                    "conversation_id": mark.conversation_id,
                    "request_id": mark.request_id,
                    "lease_seconds": mark.ttl_seconds,
                    "error": str(error),
                },
            )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- execute ------------------------------------------------------------------------------

    async def execute(self, turn: PreparedTurn) -> AsyncGenerator[TurnEvent | TurnResult, None]:
        """Streams the turn's output (:class:`TextOut`, or a chat turn's :class:`ChatOut`) and ends with its
        :class:`TurnResult`."""
        request = turn.request
        published = False
        span_context = trace.set_span_in_context(turn.span)
        if turn.mark is not None and not turn.mark.released:
            turn.mark.keeper = asyncio.ensure_future(self._keep_mark(turn.mark))
        try:
            async with aclosing(self._run(turn)) as events:
                while True:
                    # The turn's span is current while the turn's own code runs (its registry and engine
                    # calls nest under it), never across a yield into the caller's code.
                    token = otel_context.attach(span_context)
                    try:
                        event = await anext(events)
                    except StopAsyncIteration:
                        break
                    finally:
                        otel_context.detach(token)
                    if isinstance(event, _MarkSettled):
                        turn = event.turn
                        if turn.mark is not None:
                            turn.mark.keeper = asyncio.ensure_future(self._keep_mark(turn.mark))
                        continue
                    if isinstance(event, TurnResult):
                        published = event.turn > 0
                        if turn.slot is not None:
                            turn.slot.charge(event.completion_tokens)
                        self.telemetry.turn_done(
                            turn.span,
                            summary_proto(event),
                            looked_up=bool(request.conversation_id) and turn.registry_ok,
                            hit=event.matched_tokens > 0,
                        )
                    yield event
        except BaseException as error:
            if not isinstance(error, GeneratorExit | asyncio.CancelledError):
                self.telemetry.turn_failed(turn.span, error)
                if turn.mark is not None:
                    # Before the client hears of the failure: it may send the turn again at once.
                    await self._release(turn.mark)
                elif turn.marking is not None:
                    await self._drop_mark(turn.marking)
            raise
        finally:
            turn.span.end()
            if turn.slot is not None:
                turn.slot.release()
            if turn.mark is not None and not turn.mark.released:
                # The client went away (or nobody ran the turn's stream to its end).
                if turn.mark.keeper is not None:
                    turn.mark.keeper.cancel()
                self._spawn(self._release(turn.mark))
            elif turn.marking is not None:
                self._spawn(self._drop_mark(turn.marking))
            if turn.retention is not None and not published:
                # Every turn keeps the conversation's KV alive: a published turn brings a fresh lease;
                # otherwise (not retained, failed, aborted) the previous retention is renewed. Done
                # after the turn, off the time to first token.
                self._spawn(self._renew(request.tenant.name, turn.retention.conversation_id))

    async def _run(self, turn: PreparedTurn) -> AsyncGenerator[TurnEvent | TurnResult | _MarkSettled, None]:
        """The attempts: plan, then the engines' prefill-then-decode; an engine failing before any output is
        retried by recompute on other engines."""
        mark = self._mark(turn)
        failed: set[str] = set()
        retention = turn.retention
        window = turn.read_window
        # P's token already shown when the decode after it failed: the retry continues after it.
        shown: PrefillToken | None = None
        ttft_ms = 0.0
        attempt = 0
        # Requests sent: an attempt discarded when the turn's mark settled (below) is not counted as one.
        sent = 0
        while attempt < self._settings.max_attempts:
            attempt += 1
            sent += 1
            plan = plan_turn(
                turn.token_ids,
                retention,
                model=turn.model,
                engines=self._engines,
                load=self._load,
                settings=self._plan_settings,
                window=window,
                now=self._clock(),
                exclude=frozenset(failed),
                hashed=turn.prompt_digests,
            )
            if turn.marking is not None and turn.retention_from_index and plan.pull is not None:
                # A record the index found is pulled only once the mark confirmed it: the index may still
                # hold a record of an engine incarnation that is gone.
                turn, stands = await self._settle_marking(turn)
                yield _MarkSettled(turn)
                mark = self._mark(turn)
                if not stands:
                    retention, window = turn.retention, turn.read_window
                    attempt -= 1
                    sent -= 1
                    continue
            engine_turn = EngineTurn(
                token_ids=turn.token_ids if shown is None else turn.token_ids + shown.token_ids,
                sampling=turn.sampling
                if shown is None
                else dataclasses.replace(
                    turn.sampling, max_tokens=turn.sampling.max_tokens - len(shown.token_ids)
                ),
                # Unretained turns still get a mark: the engine frees their blocks at once.
                mark=mark if mark is not None else ReleaseMark(),
                pull=plan.pull,
                request_id=f"{turn.request_id}-{sent}",
                chat=turn.chat,
                first_token_from_prefill=self._settings.first_token_from_prefill and shown is None,
                decode_peer=_handshake_ahead(plan) if mark is not None else None,
            )
            computed = len(turn.token_ids) - engine_turn.offered_pull_tokens
            # Counted from the plan on (no await in between), so turns planned meanwhile see this one: P's
            # tokens until P answered, D's request until the turn ends (publication wait included).
            self._load.add_decode(plan.decode.engine_id, 1)
            self._load.add_prefill(plan.prefill.engine_id, computed)
            prefilled: Prefilled | None = None
            handed: PrefillToken | None = None
            decoded: Decoded | None = None
            # Output of this attempt's decode engine reached the client.
            emitted = False
            engines_started = time.perf_counter()
            try:
                async with aclosing(
                    prefill_then_decode(
                        self._clients.get(plan.prefill),
                        self._clients.get(plan.decode),
                        engine_turn,
                        stream=turn.request.stream,
                        clock=self._clock,
                    )
                ) as events:
                    stream: AsyncIterator[SequenceEvent] = events
                    if turn.marking is not None:
                        # P's request went out beside the mark: it is settled before anything reaches D or
                        # the client. P's request keeps going when the mark confirms the lookup it was
                        # planned on (the usual case); otherwise it is dropped (cancelled, so P aborts it, if
                        # P has not answered yet) and the turn planned again.
                        answered = asyncio.ensure_future(anext(events))
                        try:
                            turn, stands = await self._settle_marking(turn)
                        except BaseException:
                            await _dropped(answered)
                            raise
                        yield _MarkSettled(turn)
                        if not stands:
                            await _dropped(answered)
                            mark = self._mark(turn)
                            retention, window = turn.retention, turn.read_window
                            attempt -= 1
                            continue
                        stream = _Prefetched(answered, events)
                    async for event in stream:
                        if isinstance(event, Prefilled):
                            prefilled = event
                            self._load.add_prefill(plan.prefill.engine_id, -computed)
                        elif isinstance(event, PrefillToken):
                            handed = event
                            ttft_ms = (time.perf_counter() - turn.started) * 1000
                            yield TextOut(text=event.text, token_ids=event.token_ids)
                        elif isinstance(event, Decoded):
                            decoded = event if shown is None else with_first_token(shown, event)
                        elif not turn.request.stream:
                            # The whole answer at once: it is the first output.
                            emitted = True
                            ttft_ms = (time.perf_counter() - turn.started) * 1000
                            if turn.chat is None:
                                yield TextOut(text=event.text, token_ids=event.token_ids)
                        elif event.raw or event.token_ids or event.text:
                            if not emitted:
                                emitted = True
                                if not ttft_ms:
                                    ttft_ms = (time.perf_counter() - turn.started) * 1000
                            if event.raw:
                                yield ChatOut(event.raw)
                            else:
                                yield TextOut(text=event.text, token_ids=event.token_ids)
                assert prefilled is not None and decoded is not None
                before_prefill_ms = (engines_started - turn.started) * 1000
                result = await self._finish(turn, plan, mark, prefilled, decoded, ttft_ms, before_prefill_ms)
                if turn.mark is not None:
                    # Before the client has the result: its next turn must find the conversation free.
                    await self._release(turn.mark)
                yield result
                return
            except ENGINE_ERRORS as error:
                # Before P answered the error is P's, after it D's.
                engine, role = (plan.prefill, "prefill") if prefilled is None else (plan.decode, "decode")
                failure = _engine_failure(engine, role, error)
                if prefilled is not None and handed is not None and handed.finish_reason is not None:
                    # P's token was the whole answer and the client has it: the turn is done, only D's
                    # retention of it is lost (the previous one is renewed).
                    log.warning(
                        "the decode engine failed after the prefill's token ended the answer; not retained",
                        extra={
                            "request_id": turn.request_id,
                            "conversation_id": turn.request.conversation_id,
                            "engine_id": failure.engine_id,
                            "error": str(failure.cause),
                        },
                    )
                    answer = Decoded(handed.token_ids, handed.text, handed.finish_reason, None, None, 0.0)
                    before_prefill_ms = (engines_started - turn.started) * 1000
                    result = await self._finish(
                        turn, plan, None, prefilled, answer, ttft_ms, before_prefill_ms
                    )
                    if turn.mark is not None:
                        await self._release(turn.mark)
                    yield result
                    return
                if emitted or attempt == self._settings.max_attempts:
                    raise Unavailable(
                        f"{failure}"
                        + (
                            "; output was already streamed, so the turn is incomplete: resend it"
                            if emitted
                            else f"; gave up after {attempt} attempts"
                        ),
                    ) from None
                shown = shown or handed
                self._log_retry(turn, failure, shown)
                failed.add(failure.engine_id)
                if failure.role == "prefill" and plan.pull is not None and plan.holder is not None:
                    # A prefill that fails while pulling may be the holder's fault (gone, unreachable).
                    failed.add(plan.holder.engine_id)
                retention, window = None, None
            finally:
                if prefilled is None:
                    self._load.add_prefill(plan.prefill.engine_id, -computed)
                self._load.add_decode(plan.decode.engine_id, -1)

    async def _finish(
        self,
        turn: PreparedTurn,
        plan: TurnPlan,
        mark: ConversationMark | None,
        prefilled: Prefilled,
        decoded: Decoded,
        ttft_ms: float,
        before_prefill_ms: float,
    ) -> TurnResult:
        """After the last token: wait for the new retention to show in the registry; the turn's result.
        ``before_prefill_ms``: from the turn's start to P's request (lookups, mark, plan, failed attempts)."""
        retained_turn = 0
        finished = time.perf_counter()
        polls = 0
        if mark is not None and decoded.finish_reason in NORMAL_FINISH_REASONS:
            retained_turn, polls = await self._await_publication(
                mark, plan.decode.engine_id, turn.index_revision
            )
        prompt_len = len(turn.token_ids)
        pulled = prefilled.pulled_tokens
        result = TurnResult(
            model=turn.model,
            prompt_tokens=prompt_len,
            completion_tokens=decoded.completion_tokens,
            pulled_tokens=pulled,
            recomputed_tokens=prompt_len - pulled,
            ttft_ms=ttft_ms,
            prefill_ms=prefilled.seconds * 1000,
            # P may have declined the pull (read deadline too near, below its threshold).
            reuse=Reuse.RECOMPUTE if plan.choice.reuse is Reuse.PULL and not pulled else plan.choice.reuse,
            prefill_engine_id=plan.prefill.engine_id,
            decode_engine_id=plan.decode.engine_id,
            finish_reason=decoded.finish_reason,
            turn=retained_turn,
            request_id=turn.request_id,
            matched_tokens=plan.match.tokens,
            answer=decoded.body,
            engine_usage=decoded.usage.body if decoded.usage is not None else None,
        )
        log.info(
            "turn done",
            extra={
                "request_id": turn.request_id,
                "tenant": turn.request.tenant.name,
                "conversation_id": turn.request.conversation_id,
                "turn": retained_turn,
                "prompt_tokens": prompt_len,
                "matched_tokens": plan.match.tokens,
                "pulled_tokens": pulled,
                # The memory P pulled from ("device": the holder's KV cache; "host": its host pool).
                "pull_tier": plan.pull.tier if plan.pull is not None and pulled else None,
                "reuse": result.reuse.value,
                "reuse_reason": plan.choice.reason,
                "prefill_engine": plan.prefill.engine_id,
                "decode_engine": plan.decode.engine_id,
                "ttft_ms": round(ttft_ms, 2),
                # Before the turn's clock: the front door's read and check of the request (HTTP).
                "request_read_ms": (
                    round((turn.started - turn.request.received_at) * 1000, 2)
                    if turn.request.received_at is not None
                    else None
                ),
                # Where the TTFT went: before P's request, P's request, and from P's answer to the first
                # output (D's request, D's pull of the prompt from P and its first token, the relay).
                "before_prefill_ms": round(before_prefill_ms, 2),
                "prefill_ms": round(result.prefill_ms, 2),
                "after_prefill_ms": (
                    round(ttft_ms - before_prefill_ms - result.prefill_ms, 2) if ttft_ms else None
                ),
                "publish_wait_ms": round((time.perf_counter() - finished) * 1000, 2),
                "publish_polls": polls,
            },
        )
        return result

    def _log_retry(self, turn: PreparedTurn, failure: _EngineFailure, shown: PrefillToken | None) -> None:
        log.warning(
            "engine failed before its output; retrying by recompute",
            extra={
                # Tokens the client already has (P's, handed over): the retry continues after them.
                "continues_after_tokens": len(shown.token_ids) if shown is not None else 0,
                "request_id": turn.request_id,
                "conversation_id": turn.request.conversation_id,
                "engine_id": failure.engine_id,
                "role": failure.role,
                "error": str(failure.cause),
            },
        )

    def _mark(self, turn: PreparedTurn) -> ConversationMark | None:
        request = turn.request
        if not request.conversation_id or not request.retain or not turn.registry_ok:
            return None
        retained_turn = turn.retention.turn if turn.retention is not None else 0
        return ConversationMark(
            tenant=request.tenant.name, conversation_id=request.conversation_id, turn=retained_turn + 1
        )

    async def _await_publication(
        self, mark: ConversationMark, engine_id: str, index_revision: int
    ) -> tuple[int, int]:
        """The turn the registry holds once this turn's retention is published (0: not in time), and
        how many registry lookups that took. The router's retention index shows a publication as soon as
        etcd committed it (its watch is fed from etcd): while it is serving it is read first, and the
        registry asked only when it has not shown the turn within ``INDEX_PUBLICATION_SECONDS`` (and once
        before giving up). Only an index entry newer than ``index_revision`` (the index's revision before
        the turn ran) counts: an older record of the same turn number is not this turn's."""
        started = time.monotonic()
        deadline = started + self._settings.publish_wait_seconds
        polls = 0
        while True:
            indexed = self._lookups.indexed_turn(mark.tenant, mark.conversation_id, index_revision)
            if indexed is not None and indexed >= mark.turn:
                return indexed, polls
            elapsed = time.monotonic() - started
            delay = 0.003 if elapsed < 0.05 else 0.02
            last = time.monotonic() + delay > deadline
            if indexed is None or elapsed >= INDEX_PUBLICATION_SECONDS or last:
                polls += 1
                try:
                    record = await self._registry.get_retention(mark.tenant, mark.conversation_id)
                except (RegistryUnavailable, ServiceError):
                    record = None
                if record is not None and record.turn >= mark.turn:
                    return record.turn, polls
                last = time.monotonic() + delay > deadline
            if last:
                log.warning(
                    "the new retention did not appear in the registry in time; the next turn may recompute",
                    extra={
                        "conversation_id": mark.conversation_id,
                        "turn": mark.turn,
                        "engine_id": engine_id,
                        "waited_s": self._settings.publish_wait_seconds,
                    },
                )
                return 0, polls
            # Publication takes an etcd write after the engine finished: poll often at first.
            await asyncio.sleep(delay)

    async def aclose(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)


def _sampling_fields(options: SamplingOptions, max_tokens: int) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": options.temperature,
        "top_p": options.top_p or 1.0,
        "seed": options.seed,
        "ignore_eos": options.ignore_eos,
        "stop": options.stop,
    }
    return fields


def _engine_failure(engine: EngineInfo, role: str, error: Exception) -> _EngineFailure:
    """The failure to retry on; an engine's 4xx is the request's fault, raised as INVALID_ARGUMENT."""
    if isinstance(error, EngineHttpError) and 400 <= error.status_code < 500:
        raise InvalidArgument(f"the {role} engine rejected the request: {error.message}") from None
    return _EngineFailure(engine.engine_id, role, error)


def _same_record(a: RetentionRecord | None, b: RetentionRecord | None) -> bool:
    """Whether two lookups found the same retention (a renewal moves only its lease)."""
    if a is None or b is None:
        return a is b
    return (a.engine_id, a.engine_request_id, a.turn) == (b.engine_id, b.engine_request_id, b.turn)


class _Prefetched:
    """``first``'s event (fetched from ``rest`` while the turn's mark settled), then the rest of ``rest``. An
    iterator, not an async generator: nothing of its own to close (``rest``'s owner closes ``rest``)."""

    def __init__(self, first: asyncio.Future[SequenceEvent], rest: AsyncIterator[SequenceEvent]) -> None:
        self._first: asyncio.Future[SequenceEvent] | None = first
        self._rest = rest

    def __aiter__(self) -> _Prefetched:
        return self

    async def __anext__(self) -> SequenceEvent:
        first, self._first = self._first, None
        if first is not None:
            return await first
        return await anext(self._rest)


async def _dropped(request: asyncio.Future[Any]) -> None:
    """Cancels a request that will not be used (an HTTP request cancelled closes its connection: the engine
    aborts it) and waits for it to end, its outcome retrieved."""
    request.cancel()
    await asyncio.wait({request})
    if not request.cancelled():
        request.exception()


def _handshake_ahead(plan: TurnPlan) -> PeerAddress | None:
    """The decode engine of a turn it will retain, for P to start its NIXL handshake with now: the next turn
    pulls from it, and P's first pull from an engine otherwise waits for the handshake (0.7-0.9 s on an
    H100)."""
    decode = plan.decode
    if decode.engine_id == plan.prefill.engine_id or not decode.nixl_host or decode.nixl_port <= 0:
        return None
    return PeerAddress(engine_id=decode.engine_id, host=decode.nixl_host, port=decode.nixl_port)
