"""A GPU engine's launch settings (no engine is started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvferry.stack.engine import GPU_UCX_ENV, EngineProcess, gpu_engine_environment


def test_a_gpu_engine_keeps_its_kv_on_its_gpu_and_gets_cuda_ipc_get_zero_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    engine = EngineProcess(
        role="prefill",
        engine_id="p-0",
        log_path=tmp_path / "p.log",
        gpu=0,
        gpu_memory_utilization=0.42,
        cpu_core=1,
    )
    env = engine.environment()
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and "VLLM_CPU_OMP_THREADS_BIND" not in env
    command = engine.command()
    assert json.loads(command[command.index("--kv-transfer-config") + 1])["kv_buffer_device"] == "cuda"
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.42"


def test_an_operators_own_ucx_value_wins() -> None:
    env = gpu_engine_environment(1, {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto", "CUDA_VISIBLE_DEVICES": "3"})
    assert env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "auto"
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert set(GPU_UCX_ENV) <= set(gpu_engine_environment(0, {}))


def test_a_cpu_engine_is_unchanged(tmp_path: Path) -> None:
    engine = EngineProcess(
        role="prefill", engine_id="p-0", log_path=tmp_path / "p.log", cpu_core=1, kv_cache_gib=2
    )
    env = engine.environment()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    command = engine.command()
    assert json.loads(command[command.index("--kv-transfer-config") + 1])["kv_buffer_device"] == "cpu"
    assert "--gpu-memory-utilization" not in command
