"""vLLM's ``kv_transfer_params``: every key kvferry reads or writes, in one place (vLLM 0.32, NixlConnector
pull mode, ``bidirectional_kv_xfer`` on; vLLM's own definition is its ``kv_connector/v1/nixl/metadata.py``).

No other module spells these keys: requests are built from :class:`RemoteBlocks` / :class:`KvHandoff`, and
the connector, which edits vLLM's live params in place, uses the helpers below. kvferry's own keys, which
ride in the same dict, are in :mod:`kvferry.pd.kvferry_params`.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

# The request's role in a P/D pair: a prefill whose KV a decode engine will pull (set on P's request), and
# a decode that must pull its prompt's KV first (set in P's answer, passed on to D).
DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
# Where the KV to pull lives: one block-id list per KV-cache group, on the engine at host:port (its NIXL
# side channel), under the request id the holder knows it by.
REMOTE_BLOCK_IDS = "remote_block_ids"
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_REQUEST_ID = "remote_request_id"
REMOTE_HOST = "remote_host"
REMOTE_PORT = "remote_port"
# Tokens whose KV the blocks hold (absent: the whole prompt).
REMOTE_NUM_TOKENS = "remote_num_tokens"
# Until when the holder keeps the blocks, on the holder's perf_counter clock (vLLM converts with the
# handshake's clock offset).
REMOTE_BLOCKS_EXPIRY_TIME = "remote_blocks_expiry_time"
# The holder's parallel layout.
TP_SIZE = "tp_size"
DCP_SIZE = "dcp_size"
PP_SIZE = "pp_size"
# "pull" (NIXL READ by the receiver); sent for older vLLM releases, which read it.
TRANSFER_MODE = "transfer_mode"
# A chat request's prompt as token ids (vLLM >= 0.32, "decode-side token reuse"): the chat endpoint serves
# these instead of rendering the messages (unless ``echo`` is set or a message has non-text content);
# tool/reasoning parsers and structured outputs still follow the request's fields. The engine pops it
# before the request reaches its connector.
PROMPT_TOKEN_IDS = "prompt_token_ids"

# The keys that name remote blocks: removing them makes the engine compute instead of pulling.
REMOTE_BLOCK_KEYS = (
    REMOTE_BLOCK_IDS,
    REMOTE_ENGINE_ID,
    REMOTE_REQUEST_ID,
    REMOTE_HOST,
    REMOTE_PORT,
    REMOTE_NUM_TOKENS,
    REMOTE_BLOCKS_EXPIRY_TIME,
)


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
            REMOTE_ENGINE_ID: self.engine_id,
            REMOTE_REQUEST_ID: self.request_id,
            REMOTE_BLOCK_IDS: [list(group) for group in self.block_ids],
            REMOTE_HOST: self.host,
            REMOTE_PORT: self.port,
            TP_SIZE: self.tp_size,
            DCP_SIZE: self.dcp_size,
            PP_SIZE: self.pp_size,
        }
        if self.num_tokens is not None:
            params[REMOTE_NUM_TOKENS] = self.num_tokens
        if self.expiry_time is not None:
            params[REMOTE_BLOCKS_EXPIRY_TIME] = self.expiry_time
        return params

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RemoteBlocks | None:
        """The remote blocks named in ``params``, or None when they name none."""
        raw_blocks = params.get(REMOTE_BLOCK_IDS)
        engine_id = params.get(REMOTE_ENGINE_ID)
        if not raw_blocks or engine_id is None:
            return None
        try:
            return cls(
                engine_id=str(engine_id),
                request_id=str(params[REMOTE_REQUEST_ID]),
                block_ids=block_id_groups(params),
                host=str(params[REMOTE_HOST]),
                port=int(params[REMOTE_PORT]),
                num_tokens=_opt_int(params.get(REMOTE_NUM_TOKENS)),
                expiry_time=_opt_float(params.get(REMOTE_BLOCKS_EXPIRY_TIME)),
                tp_size=int(params.get(TP_SIZE) or 1),
                dcp_size=int(params.get(DCP_SIZE) or 1),
                pp_size=int(params.get(PP_SIZE) or 1),
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
            DO_REMOTE_PREFILL: self.do_remote_prefill,
            DO_REMOTE_DECODE: self.do_remote_decode,
            TRANSFER_MODE: self.transfer_mode,
        }
        if self.blocks is not None:
            params.update(self.blocks.to_params())
        return params

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> KvHandoff | None:
        if not params:
            return None
        return cls(
            do_remote_prefill=bool(params.get(DO_REMOTE_PREFILL)),
            do_remote_decode=bool(params.get(DO_REMOTE_DECODE)),
            blocks=RemoteBlocks.from_params(params),
            transfer_mode=str(params.get(TRANSFER_MODE) or "pull"),
        )


def prefill_params(pull: RemoteBlocks | None) -> dict[str, Any]:
    """vLLM's params for a prefill request (P computes, D will pull), pulling ``pull`` first when given."""
    params: dict[str, Any] = {DO_REMOTE_DECODE: True, DO_REMOTE_PREFILL: False}
    if pull is not None:
        params.update(pull.to_params())
    return params


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """A prefill request (or a decode engine's answer) whose KV another engine will pull."""
    return bool(params and params.get(DO_REMOTE_DECODE))


def names_remote_blocks(params: Mapping[str, Any] | None) -> bool:
    return bool(params and params.get(REMOTE_BLOCK_IDS))


def block_id_groups(params: Mapping[str, Any]) -> tuple[tuple[int, ...], ...]:
    """``remote_block_ids`` as one tuple per KV-cache group (a flat list is one group)."""
    raw = params.get(REMOTE_BLOCK_IDS)
    if not raw:
        return ()
    groups = raw if isinstance(raw[0], list | tuple) else [raw]
    return tuple(tuple(int(b) for b in group) for group in groups)


def remote_num_tokens(params: Mapping[str, Any]) -> int:
    """``remote_num_tokens`` (0 when absent)."""
    return int(params.get(REMOTE_NUM_TOKENS) or 0)


def strip_remote_blocks(params: MutableMapping[str, Any]) -> None:
    """Removes the remote blocks from a request's params: the engine computes instead of pulling."""
    for key in REMOTE_BLOCK_KEYS:
        params.pop(key, None)


def set_blocks_expiry_time(params: MutableMapping[str, Any], holder_perf_counter: float) -> None:
    """The holder's promise of how long it keeps the blocks, on its own perf_counter clock."""
    params[REMOTE_BLOCKS_EXPIRY_TIME] = holder_perf_counter


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
