"""Stand-in prefill (P) and decode (D) engines for the fault harness: FAST STAND-INS for vLLM, but with
kvferry's REAL connector retention machinery inside.

What is real: D's retention table, keeper and sidecar link (kvferry.connector.retention / keeper /
sidecar_link, exactly what runs inside vLLM), talking to a real ``kvferry sidecar`` process, which
talks to the real registry and etcd; P's read-deadline check (kvferry.connector.accounting). What is
stood in: the model (kvferry.testing.standin_engine's byte tokenizer and deterministic generator) and the KV
memory, a :class:`BlockPool` whose blocks hold the digest of the tokens written into them and a
generation that D bumps when it frees the block (as kvferry's pull-time fencing does).

P "pulls" by reading D's blocks over HTTP (``POST /kvferry/read`` at the retention's NIXL host:port,
which D registers as its HTTP port): what it reads is whatever D's memory holds at that moment, so a
pull of blocks D has freed and reused returns another conversation's KV, as a NIXL READ would.

Both log JSON lines (kvferry.testing.oracle reads them):
- D ``retained`` / ``freed retained blocks`` (request_id, block_ids, generations, reason, confirmed),
  the same names and fields as the connector's lines, and ``kv read`` for every read of its memory
  (request_id, block_ids, held: whether that request still held every block);
- P ``kv pull`` (remote engine and request, block_ids, generations: the record's, generations_read,
  content_ok: whether the KV read equals the KV of the prompt's tokens, fenced: the generations differ,
  so the pull was dropped, recomputed).

Run one with ``python -m kvferry.testing.standins --role decode --port N --sidecar HOST:PORT ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from kvferry.connector.accounting import Accounting
from kvferry.connector.generations import random_base
from kvferry.connector.keeper import RetentionKeeper
from kvferry.connector.logs import FREED_LOG, RETAINED_LOG
from kvferry.connector.read_deadlines import pull_allowed, read_deadline, read_may_start
from kvferry.connector.retention import RetainedEntry, RetentionTable
from kvferry.connector.sidecar_link import BackgroundLoop, SidecarLink
from kvferry.pd import vllm_params
from kvferry.pd.digest import block_digests
from kvferry.pd.kvferry_params import BlockGenerations, ConversationMark, parse_mark
from kvferry.pd.vllm_params import KvHandoff, RemoteBlocks
from kvferry.runtime.logs import JsonFormatter
from kvferry.testing.standin_engine import (
    standin_detokenize,
    standin_generate,
    standin_render_chat,
    standin_tokenize,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

log = logging.getLogger("kvferry.testing.standins")

KV_HASH = "faults-standin-kv-v1"
MODEL = "faults-model"


class BlockPool:
    """D's KV memory: blocks that hold a content digest, an owner and a generation.

    Freed blocks go to the front of the free list, so they are the next ones handed out (vLLM's
    free queue also reuses recently freed blocks first): a pull of freed blocks soon reads another
    conversation's KV.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # A random base per process, as the connector's: a record of an engine that restarted never matches
        # the new one's generations.
        self.generations = [random_base()] * num_blocks
        self.contents: list[bytes] = [b""] * num_blocks
        self.owners: list[str | None] = [None] * num_blocks

    @property
    def held(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int, owner: str) -> list[int] | None:
        if count > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self.owners[block] = owner
            self.contents[block] = b""
        return blocks

    def write(self, blocks: Sequence[int], contents: Sequence[bytes]) -> None:
        for block, content in zip(blocks, contents, strict=False):
            self.contents[block] = content

    def free(self, blocks: Sequence[int], owner: str) -> list[int]:
        """Frees the blocks ``owner`` still holds (bumping their generations); returns the new ones."""
        generations = []
        for block in blocks:
            if self.owners[block] != owner:
                continue
            self.generations[block] += 1
            self.owners[block] = None
            self._free.append(block)
            generations.append(self.generations[block])
        return generations

    def held_by(self, blocks: Sequence[int], owner: str) -> bool:
        return all(0 <= b < self.num_blocks and self.owners[b] == owner for b in blocks)


@dataclass
class EngineSettings:
    role: str
    engine_id: str
    port: int
    sidecar: str | None
    num_blocks: int = 4096
    block_size: int = 16
    max_model_len: int = 8192
    grace_seconds: float = 3.0
    hard_cap_seconds: float = 20.0
    lease_ttl_seconds: int = 15
    min_read_seconds: float = 0.2
    kv_recompute_threshold: int = 16
    # A deliberately broken D for the harness's own test: it frees every retention at once, while the
    # registry still serves it (the oracle must then report served-after-freed).
    unsafe_free_at_finish: bool = False


class StandInEngine:
    """One stand-in engine (``role`` prefill or decode) serving HTTP on ``settings.port``."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.pool = BlockPool(settings.num_blocks)
        self.table = RetentionTable(
            max_retention_seconds=settings.hard_cap_seconds,
            grace_seconds=settings.grace_seconds,
            budget_blocks=int(settings.num_blocks * 0.8),
        )
        self._loop = BackgroundLoop(f"standin-{settings.role}")
        self._link: SidecarLink | None = None
        self.keeper = RetentionKeeper(
            self.table,
            engine_id=settings.engine_id,
            lease_ttl_seconds=settings.lease_ttl_seconds,
            on_change=self._poke,
        )
        self.accounting = Accounting(kv_bytes_per_token=1024)
        # Seconds added to this engine's wall clock (clock skew on P).
        self.clock_offset_seconds = 0.0
        self._http = httpx.AsyncClient(timeout=5.0)

    def _poke(self) -> None:
        if self._link is not None:
            self._link.poke()

    def now_wall(self) -> float:
        return time.time() + self.clock_offset_seconds

    # The engine's clocks as the connector reads them (kvferry.connector.retention.Clock): a skewed wall
    # clock, an unskewed monotonic one.
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return self.now_wall()

    # -- life ------------------------------------------------------------------------------------------

    async def serve(self) -> None:
        if self.settings.sidecar:
            self._link = SidecarLink(
                loop=self._loop,
                address=self.settings.sidecar,
                engine_id=self.settings.engine_id,
                listener=self.keeper,
                stats=lambda: (self.accounting.version, self.accounting.snapshot()),
                timeout_seconds=5.0,
                stats_interval_seconds=5.0,
                release_grace_seconds=self.settings.grace_seconds,
            )
            self._link.start()
        self._loop.start()
        log.info("pool started", extra={"engine_id": self.settings.engine_id, "blocks": self.pool.num_blocks})
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.settings.port))
        sock.listen(1024)
        app = Starlette(
            routes=[
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/kvferry/read", self._read, methods=["POST"]),
                Route("/kvferry/state", self._state, methods=["GET"]),
                Route("/kvferry/clock", self._clock, methods=["POST"]),
            ]
        )
        server = uvicorn.Server(
            uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, server_header=False)
        )
        steps = asyncio.create_task(self._engine_steps())
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        await stop.wait()
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serving, 5)
        steps.cancel()
        self._loop.stop()
        await self._http.aclose()

    async def _engine_steps(self) -> None:
        """What vLLM's engine core does each step for the connector: free what is due."""
        while True:
            await asyncio.sleep(0.02)
            for entry in self.keeper.collect_frees():
                self._free(entry)

    def _free(self, entry: RetainedEntry) -> None:
        generations = self.pool.free(entry.block_ids, entry.request_id)
        self.accounting.set_retained_blocks(self.table.held_blocks())
        log.info(
            FREED_LOG,
            extra={
                "request_id": entry.request_id,
                "tenant": entry.tenant,
                "conversation_id": entry.conversation_id,
                "turn": entry.turn,
                "block_ids": list(entry.block_ids),
                "generations": generations,
                "reason": entry.end_reason.value if entry.end_reason else None,
                "confirmed": entry.confirmed,
                "end_revision": entry.end_revision,
            },
        )

    # -- HTTP: what the router and sidecar use ---------------------------------------------------------

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"data": [{"id": MODEL, "max_model_len": self.settings.max_model_len}]})

    async def _tokenize(self, request: Request) -> Response:
        body = await request.json()
        if "messages" in body:
            text = standin_render_chat(body["messages"], body.get("add_generation_prompt", True))
        else:
            text = body.get("prompt", "")
        tokens = standin_tokenize(text)
        return JSONResponse(
            {"tokens": tokens, "count": len(tokens), "max_model_len": self.settings.max_model_len}
        )

    async def _state(self, request: Request) -> Response:
        return JSONResponse(
            {
                "held_blocks": self.pool.held,
                "retained_blocks": self.table.held_blocks(),
            }
        )

    async def _clock(self, request: Request) -> Response:
        body = await request.json()
        self.clock_offset_seconds = float(body.get("offset_seconds", 0.0))
        log.info("clock skew set", extra={"offset_seconds": self.clock_offset_seconds})
        return JSONResponse({"offset_seconds": self.clock_offset_seconds})

    async def _completions(self, request: Request) -> Response:
        arrival_wall = self.now_wall()  # as vLLM stamps arrival_time
        body = await request.json()
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return JSONResponse({"error": {"message": "token-id prompts only", "code": 400}}, 400)
        params = body.get("kv_transfer_params") or {}
        request_id = request.headers.get("x-request-id") or f"standin-{uuid.uuid4().hex[:12]}"
        if vllm_params.wants_remote_decode(params):
            return await self._prefill(prompt, params, request_id, arrival_wall)
        return await self._decode(prompt, params, body, request_id)

    # -- P ---------------------------------------------------------------------------------------------

    async def _prefill(
        self, prompt: list[int], params: dict[str, Any], request_id: str, arrival_wall: float
    ) -> Response:
        remote = RemoteBlocks.from_params(params)
        pulled = 0
        if remote is not None and vllm_params.names_remote_blocks(params):
            # What the connector does: the read window becomes a deadline on this engine's own clocks.
            deadline = read_deadline(params, arrival_wall, self)
            if not pull_allowed(deadline, self.monotonic(), self.settings.min_read_seconds):
                log.info(
                    "declined a pull: read deadline too near, recomputing",
                    extra={"request_id": request_id, "remote_request_id": remote.request_id},
                )
            else:
                try:
                    expected = BlockGenerations.from_params(params)
                except ValueError as bad:  # as the connector: a pull it cannot check is declined
                    log.info(
                        "declined a pull: unusable generations, recomputing",
                        extra={"request_id": request_id, "problem": str(bad)},
                    )
                else:
                    pulled = await self._pull(prompt, remote, request_id, deadline, expected)
        self.accounting.on_matched(request_id, len(prompt), 0)
        first = standin_generate(prompt, 1)
        return JSONResponse(
            {
                "id": f"cmpl-{request_id}",
                "object": "text_completion",
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "text": standin_detokenize(first),
                        "token_ids": first,
                        "finish_reason": "length",
                    }
                ],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": 1,
                    "total_tokens": len(prompt) + 1,
                    "prompt_tokens_details": {"cached_tokens": pulled},
                },
                "kv_transfer_params": KvHandoff(
                    do_remote_prefill=True,
                    do_remote_decode=False,
                    blocks=RemoteBlocks(
                        engine_id=self.settings.engine_id,
                        request_id=request_id,
                        block_ids=((0,),),
                        host="127.0.0.1",
                        port=self.settings.port,
                        num_tokens=len(prompt),
                    ),
                ).to_params(),
            }
        )

    async def _pull(
        self,
        prompt: list[int],
        remote: RemoteBlocks,
        request_id: str,
        deadline: float | None,
        expected: BlockGenerations | None,
    ) -> int:
        """Reads the retained blocks from D; returns the tokens reused (0: recomputed).

        Pull-time fencing as the connector does it (kvferry.connector.fence): the generations read with
        the blocks must equal the ones the record published (``expected``), else the pull is dropped and
        the prompt recomputed. D answers contents and generations in one go, as the data READ followed
        by the generation READ would see them."""
        block_size = self.settings.block_size
        reusable = min(remote.num_tokens or 0, len(prompt) - 1) // block_size
        block_ids = list(remote.block_ids[0][:reusable]) if remote.block_ids else []
        if reusable * block_size < self.settings.kv_recompute_threshold or not block_ids:
            return 0
        fields: dict[str, Any] = {
            "request_id": request_id,
            "remote_engine_id": remote.engine_id,
            "remote_request_id": remote.request_id,
            "block_ids": block_ids,
        }
        if not read_may_start(deadline, self.monotonic()):
            # As the connector's worker: the window closed before the READ was posted; vLLM recomputes.
            log.info(
                "kv pull",
                extra={**fields, "failed": "read window closed", "content_ok": None, "recomputed": True},
            )
            return 0
        try:
            answer = await self._http.post(
                f"http://{remote.host}:{remote.port}/kvferry/read",
                json={"request_id": remote.request_id, "block_ids": block_ids},
            )
            answer.raise_for_status()
        except httpx.HTTPError as error:
            # As a failed NIXL READ: vLLM recomputes what it could not load.
            # Never an empty "failed": a D killed mid-read ends the connection with an error whose text is ""
            # (the oracle counts a pull as failed by that field).
            failed = str(error) or type(error).__name__
            log.info("kv pull", extra={**fields, "failed": failed, "content_ok": None, "recomputed": True})
            return 0
        read = answer.json()
        expected_contents = [
            d.hex() for d in block_digests(prompt[: reusable * block_size], block_size, salt=KV_HASH)
        ]
        content_ok = read["contents"] == expected_contents
        published = list(expected.values[: len(block_ids)]) if expected is not None else None
        fenced = published is not None and read["generations"] != published
        log.info(
            "kv pull",
            extra={
                **fields,
                "generations": published,
                "generations_read": read["generations"],
                "content_ok": content_ok,
                "fenced": fenced,
                "recomputed": fenced,
            },
        )
        return 0 if fenced else reusable * block_size

    # -- D ---------------------------------------------------------------------------------------------

    async def _read(self, request: Request) -> Response:
        """The stand-in for a NIXL READ of D's memory: whatever the blocks hold now."""
        body = await request.json()
        block_ids = [int(b) for b in body["block_ids"]]
        if not all(0 <= b < self.pool.num_blocks for b in block_ids):
            return JSONResponse({"error": "no such block"}, 400)
        held = self.pool.held_by(block_ids, body["request_id"])
        log.info("kv read", extra={"request_id": body["request_id"], "block_ids": block_ids, "held": held})
        return JSONResponse(
            {
                "contents": [self.pool.contents[b].hex() for b in block_ids],
                "generations": [self.pool.generations[b] for b in block_ids],
            }
        )

    async def _decode(
        self, prompt: list[int], params: dict[str, Any], body: dict[str, Any], request_id: str
    ) -> Response:
        max_tokens = int(body.get("max_tokens") or 16)
        output = standin_generate(prompt, max_tokens)
        try:
            mark = parse_mark(params)
        except ValueError:
            mark = None
        tokens = prompt + output
        num_tokens = len(tokens) - 1  # the last sampled token has no KV yet
        blocks = self.pool.allocate(-(-num_tokens // self.settings.block_size), request_id)
        if blocks is None:
            return JSONResponse({"error": {"message": "out of KV blocks", "code": 503}}, 503)
        self.pool.write(blocks, block_digests(tokens[:num_tokens], self.settings.block_size, salt=KV_HASH))

        async def stream() -> AsyncIterator[bytes]:
            finished = False
            try:
                for index, token in enumerate(output):
                    last = index == len(output) - 1
                    yield _sse(
                        {
                            "choices": [
                                {
                                    "index": 0,
                                    "text": standin_detokenize([token]),
                                    "token_ids": [token],
                                    "finish_reason": "length" if last else None,
                                }
                            ]
                        }
                    )
                finished = True
                yield _sse(
                    {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(output)}}
                )
                yield b"data: [DONE]\n\n"
            finally:
                self._finish(request_id, mark if finished else None, blocks, num_tokens, tokens)

        if body.get("stream"):
            return StreamingResponse(stream(), media_type="text/event-stream")
        self._finish(request_id, mark, blocks, num_tokens, tokens)
        return JSONResponse(
            {
                "choices": [
                    {
                        "index": 0,
                        "text": standin_detokenize(output),
                        "token_ids": output,
                        "finish_reason": "length",
                    }
                ],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(output)},
            }
        )

    def _finish(
        self, request_id: str, mark: Any, blocks: list[int], num_tokens: int, tokens: list[int]
    ) -> None:
        """As the connector's request_finished: retain a marked turn's blocks, free the rest at once."""
        if not isinstance(mark, ConversationMark):  # none, or the release mark
            self.pool.free(blocks, request_id)
            return
        self.table.add(
            request_id=request_id,
            tenant=mark.tenant,
            conversation_id=mark.conversation_id,
            turn=mark.turn,
            block_ids=blocks,
            num_tokens=num_tokens,
            block_digests=block_digests(tokens[:num_tokens], self.settings.block_size, salt=KV_HASH),
            # Published with the record, as the connector's GenerationBook.publish does.
            block_generations=[self.pool.generations[b] for b in blocks],
        )
        self.table.evict_over_budget()
        self.accounting.set_retained_blocks(self.table.held_blocks())
        self._poke()
        if self.settings.unsafe_free_at_finish:
            self.pool.free(blocks, request_id)
        log.info(
            RETAINED_LOG,
            extra={
                "request_id": request_id,
                "tenant": mark.tenant,
                "conversation_id": mark.conversation_id,
                "turn": mark.turn,
                "block_ids": blocks,
                "generations": [self.pool.generations[b] for b in blocks],
                "num_tokens": num_tokens,
            },
        )


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvferry.testing.standins", description=__doc__)
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--sidecar", default=None, help="host:port of this engine's sidecar")
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--grace-seconds", type=float, default=3.0)
    parser.add_argument("--hard-cap-seconds", type=float, default=20.0)
    parser.add_argument("--lease-ttl-seconds", type=int, default=15)
    parser.add_argument(
        "--unsafe-free-at-finish",
        action="store_true",
        help="BROKEN ON PURPOSE: free retained blocks at once (the harness's test that its oracle sees it)",
    )
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("kvferry.connector.sidecar_link").setLevel(logging.WARNING)
    settings = EngineSettings(
        role=args.role,
        engine_id=args.engine_id,
        port=args.port,
        sidecar=args.sidecar,
        num_blocks=args.num_blocks,
        grace_seconds=args.grace_seconds,
        hard_cap_seconds=args.hard_cap_seconds,
        lease_ttl_seconds=args.lease_ttl_seconds,
        unsafe_free_at_finish=args.unsafe_free_at_finish,
    )
    log.info(
        "stand-in engine starting", extra={"role": args.role, "engine_id": args.engine_id, "pid": os.getpid()}
    )
    asyncio.run(StandInEngine(settings).serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
