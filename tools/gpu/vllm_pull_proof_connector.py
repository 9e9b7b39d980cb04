"""kvferry's connector, loadable on the vLLM the GPU test machine can install (0.25).

The H200 machine cannot install vLLM 0.32 (it pins a newer torch); 0.25 has the same NixlConnector
package (``kv_connector/v1/nixl/``) and every internal kvferry's connector checks at start
(``vllm_internals.check_vllm``), but a few of them work differently there:

- a failed receive goes into ``_failed_recv_reqs`` through ``_handle_failed_transfer(req_id, handle)``,
  which also counts a failed transfer in vLLM's stats (0.32: ``_recv_failures``, counting optional);
- ``_pop_done_transfers`` returns the done requests alone, those it failed among them (0.32: done and
  failed); ``get_finished`` adds ``_failed_recv_reqs`` to them right after;
- ``_nixl_handshake`` returns ``{tp_rank: agent}`` (0.32: ``{(pp_rank, tp_rank): agent}`` and a clock
  offset), and the side channel answers ``(GET_META_MSG, tp_rank)`` with the payload alone (0.32:
  ``(GET_META_MSG, pp_rank, tp_rank)`` with ``[payload, clock]``).

For that proof run only, this module lowers the connector's version floor and swaps in the 0.25 ways of
those four, then exposes ``KvferryConnector``: ``kv_connector_module_path`` = ``vllm_pull_proof_connector``
with ``tools/gpu`` on the engine's PYTHONPATH. On vLLM >= 0.32 it changes nothing.
"""

from __future__ import annotations

from typing import Any

import vllm
from kvferry.connector import vllm_internals

PROOF_MIN_VERSION = (0, 25)
BEFORE_0_32 = vllm_internals.parse_version(str(vllm.__version__)) < vllm_internals.SUPPORTED_MIN


def fail_pull_before_0_32(worker_half: Any, request_id: str) -> None:
    worker_half._handle_failed_transfer(request_id, None)


def fetch_handshake_payload_before_0_32(
    host: str, port: int, pp_rank: int, tp_rank: int, payload_type: type
) -> Any:
    """The payload a holder's side channel serves for ``tp_rank`` (0.25 knows one pipeline stage)."""
    import msgspec
    import zmq
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import zmq_ctx
    from vllm.utils.network_utils import make_zmq_path

    with zmq_ctx(zmq.REQ, make_zmq_path("tcp", host, port)) as sock:
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.send(msgspec.msgpack.encode((GET_META_MSG, tp_rank)))
        return msgspec.msgpack.Decoder(payload_type).decode(sock.recv())


if BEFORE_0_32:
    vllm_internals.SUPPORTED_MIN = PROOF_MIN_VERSION
    vllm_internals.FAILED_RECV_RECORD = "_failed_recv_reqs"
    vllm_internals.fail_pull = fail_pull_before_0_32
    vllm_internals.fetch_handshake_payload = fetch_handshake_payload_before_0_32

from kvferry.connector import connector  # noqa: E402 - after the floor is set
from kvferry.connector.connector import KvferryConnector, KvferryWorker  # noqa: E402


def nixl_handshake_before_0_32(
    worker: Any, host: str, port: int, remote_tp_size: int, expected_engine_id: str, *args: Any, **kwargs: Any
) -> dict[int, str]:
    agents: dict[int, str] = super(KvferryWorker, worker)._nixl_handshake(
        host, port, remote_tp_size, expected_engine_id, *args, **kwargs
    )
    for tp_rank, agent_name in agents.items():
        payload = connector._peer_payload(host, port, 0, tp_rank)
        if worker.fence is not None:
            worker.fence.add_peer(agent_name, connector._peer_generations(payload, host, port, tp_rank))
        pool = payload.kvferry_host_pool if payload is not None else None
        if pool is not None:
            worker._add_host_pool(expected_engine_id, tp_rank, agent_name, pool)
    return agents


def pop_done_transfers_before_0_32(worker: Any, transfers: dict[str, list[int]]) -> set[str]:
    done: set[str] = super(KvferryWorker, worker)._pop_done_transfers(transfers)
    if worker.fence is None or transfers is not worker._recving_transfers:
        return done
    failed = done & set(worker._failed_recv_reqs.queue)
    done, settled_failed = worker.fence.settle(done, failed, worker._pulled_blocks)
    for request_id in settled_failed - failed:
        # A fenced pull fails the 0.25 way: get_finished reports it failed in this same call.
        fail_pull_before_0_32(worker, request_id)
    return done


if BEFORE_0_32:
    # The 0.25 signatures are meant to differ from those the connector declares (0.32's).
    KvferryWorker._nixl_handshake = nixl_handshake_before_0_32  # type: ignore[method-assign,assignment]
    KvferryWorker._pop_done_transfers = pop_done_transfers_before_0_32  # type: ignore[method-assign,assignment]

__all__ = ["KvferryConnector"]
