"""``kvferry up --gpu``: what it would start (no GPU needed: the engines are only configured here).

The run itself is on the GPU machine: tools/gpu/gpu_stack.sh, results in docs/calibration.md."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from kvferry.router.server import COST_PROFILES
from kvferry.stack import gpu, up
from kvferry.stack.demo import GPU_MODEL, TEST_MODEL
from kvferry.stack.engine import DEFAULT_MODEL_DIR, GPU_UCX_ENV
from kvferry.stack.engine_plan import EnginePlanError, plan_engines
from kvferry.stack.settings import StackConfig, resolve, setting_flags


def _config(*flags: str) -> StackConfig:
    parser = argparse.ArgumentParser()
    up.configure(parser)
    return resolve(parser.parse_args([*flags, "--no-demo"]), environ={})


def test_the_gpu_model_has_the_qwen3_8b_shape_and_the_repos_tokenizer(tmp_path: Path) -> None:
    model = gpu.write_gpu_model(tmp_path)
    config = json.loads((model / "config.json").read_text())
    tokenizer_config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert (
        config["num_hidden_layers"] == 36 and config["num_key_value_heads"] == 8 and config["head_dim"] == 128
    )
    assert config["vocab_size"] == tokenizer_config["vocab_size"]
    assert (model / "tokenizer.json").read_bytes() == (DEFAULT_MODEL_DIR / "tokenizer.json").read_bytes()


def test_one_gpu_holds_both_engines_two_get_one_each_more_go_round_robin() -> None:
    def places(prefill: int, decode: int, gpus: int) -> list[int | None]:
        plan = plan_engines(prefill, decode, free_port=iter(range(20000, 21000)).__next__, gpus=gpus)
        return [engine.gpu for engine in plan]

    assert places(1, 1, gpus=1) == [0, 0] and gpu.default_memory_utilization(2) == 0.45
    assert places(1, 1, gpus=4) == [0, 1] and gpu.default_memory_utilization(1) == 0.85
    assert places(2, 2, gpus=2) == [0, 1, 0, 1] and gpu.default_memory_utilization(4) == 0.225
    with pytest.raises(EnginePlanError, match="no GPU"):
        places(1, 1, gpus=0)


def test_up_gpu_configures_cuda_engines_and_the_routers_gpu_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu, "count_gpus", lambda: 1)
    config = _config("--gpu", "--connector-module", "vllm_pull_proof_connector")
    plan = up.engine_plan(config)
    assert [(e.engine_id, e.gpu, e.cpu_core) for e in plan] == [("prefill-0", 0, None), ("decode-0", 0, None)]
    engine = up.engine_processes(config, plan, tmp_path, tmp_path / "logs")[0]
    command = engine.command()
    transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert transfer["kv_buffer_device"] == "cuda"
    assert transfer["kv_connector_module_path"] == "vllm_pull_proof_connector"
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.45"
    assert command[command.index("--dtype") + 1] == "bfloat16" and "--enforce-eager" in command
    env = engine.environment()
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert all(env[k] == v for k, v in {**GPU_UCX_ENV, **gpu.GPU_VLLM_ENV}.items())
    assert up._router_gpu_args(config) == ["--cost-profile", gpu.GPU_COST_PROFILE]
    assert gpu.GPU_COST_PROFILE in COST_PROFILES
    assert up._router_gpu_args(_config()) == [] and up._router_gpu_args(_config("--gpu", "false")) == []


def test_the_gpu_settings_reach_the_detached_supervisor_and_come_back_the_same() -> None:
    """``kvferry up`` hands every setting to its ``up --foreground --no-demo`` child as flags."""
    config = _config(
        "--gpu", "--gpu-memory-utilization", "0.6", "--connector-module", "vllm_pull_proof_connector"
    )
    assert (config.gpu, config.gpu_memory_utilization, config.connector_module) == (
        True,
        0.6,
        "vllm_pull_proof_connector",
    )
    child = _config(*setting_flags(config))
    assert (child.gpu, child.gpu_memory_utilization, child.connector_module) == (
        True,
        0.6,
        "vllm_pull_proof_connector",
    )


def test_the_gpu_settings_come_from_the_environment_and_a_config_file_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFERRY_GPU", "true")
    monkeypatch.setenv("KVFERRY_GPU_MEMORY_UTILIZATION", "0.5")
    parser = argparse.ArgumentParser()
    up.configure(parser)
    from_env = resolve(parser.parse_args([]))
    assert from_env.gpu and from_env.gpu_memory_utilization == 0.5
    assert from_env.sources is not None and from_env.sources["engines.gpu"] == "env KVFERRY_GPU"
    monkeypatch.delenv("KVFERRY_GPU")
    monkeypatch.delenv("KVFERRY_GPU_MEMORY_UTILIZATION")
    config_file = tmp_path / "stack.toml"
    config_file.write_text('[engines]\ngpu = true\nconnector_module = "vllm_pull_proof_connector"\n')
    from_file = _config("--config", str(config_file))
    assert from_file.gpu and from_file.connector_module == "vllm_pull_proof_connector"
    with pytest.raises(SystemExit):
        _config("--gpu-memory-utilization", "1.5")


def test_the_demo_says_what_the_model_is() -> None:
    assert up.model_note(_config()) == TEST_MODEL and "seeded random weights" in TEST_MODEL
    assert up.model_note(_config("--gpu")) == GPU_MODEL and "dummy weights" in GPU_MODEL
    assert "noise" in TEST_MODEL and "noise" in GPU_MODEL
    own = up.model_note(_config("--model-dir", "/models/qwen3-8b"))
    assert own == "The model is the one in /models/qwen3-8b." and "noise" not in own


def test_the_conversation_table_shows_a_turn_an_arm_has_no_sample_of() -> None:
    """A turn that one arm did not reach (the run's time ran out) is a '-' in the table, not a crash that
    loses the run's files."""
    from tools.gpu.stack_conversation import Sample, table

    samples = [
        Sample(run=0, turn=1, arm="reuse", prompt_tokens=2000, client_ttft_ms=60.0, client_e2e_ms=90.0),
        Sample(run=0, turn=1, arm="vllm", prompt_tokens=2000, client_ttft_ms=70.0, client_e2e_ms=95.0),
        Sample(run=0, turn=2, arm="off", prompt_tokens=4064, client_ttft_ms=120.0, client_e2e_ms=150.0),
    ]
    rows = table(samples).splitlines()
    assert rows[2].startswith("| 1 | 2,000 | 60 | - |")
    assert rows[3].startswith("| 2 | - | - | 120 |")
    assert any(row.startswith("| 2 | - | - / 120 / - |") for row in rows)


def test_the_overhead_split_adds_up_to_each_turn_s_overhead() -> None:
    """Body read + before P + after P + outside = client TTFT minus P's call, from the router's turn line and
    the answer's usage; the vllm arm has no router and no row."""
    from tools.gpu.stack_conversation import Sample, overhead_split

    def sample(arm: str, client_ttft_ms: float, read: float | None) -> Sample:
        line = {"before_prefill_ms": 1.5, "after_prefill_ms": 0.5, "request_read_ms": read}
        usage = {"kvferry": {"ttft_ms": 102.0, "prefill_ms": 100.0}}
        return Sample(0, 1, arm, 2000, client_ttft_ms, 200.0, usage=usage, decision=line)

    samples = [sample("reuse", 106.0, 1.0), sample("off", 105.0, None), sample("vllm", 90.0, 0.0)]
    assert overhead_split(samples).splitlines()[2:] == [
        "| reuse | 1 | 6.00 | 1.00 | 1.50 | 0.50 | 3.00 |",
        "| off | 1 | 5.00 | 0.00 | 1.50 | 0.50 | 3.00 |",
    ]


def test_the_host_table_sets_the_host_arm_beside_the_reuse_arm_turn_by_turn() -> None:
    """Client TTFT of both, their ratio, the tier the router pulled and how P read it, from the samples."""
    from tools.gpu.stack_conversation import Sample, host_table

    def sample(arm: str, turn: int, ttft: float, tier: str | None, read: str) -> Sample:
        pulls = [{"read": read, "transfer_ms": 40.0, "gbps": 50.0}] if tier else []
        line = {"pull_tier": tier, "reuse": "pull" if tier else "none"}
        return Sample(0, turn, arm, 2000 * turn, ttft, 2 * ttft, decision=line, pulls=pulls)

    samples = [
        sample("reuse", 1, 60.0, None, ""),
        sample("host", 1, 62.0, None, ""),
        sample("reuse", 2, 100.0, "device", "nixl"),
        sample("host", 2, 130.0, "host", "mapped"),
    ]
    rows = host_table(samples).strip().splitlines()
    assert rows[2] == "| 1 | 2,000 | 60 / 62 | 1.03 | - none | - | - | - | - |"
    assert rows[3] == "| 2 | 4,000 | 100 / 130 | 1.30 | host pull | mapped | 40.0 | 50.0 | 50.0 |"
    assert host_table([s for s in samples if s.arm == "reuse"]) == ""


def test_a_streamed_answer_s_events_are_their_data_lines_up_to_done() -> None:
    """What the conversation's turns and the ITL probe read of vLLM's server-sent events."""
    import httpx

    from tools.gpu.stack_conversation import sse_data

    body = b'data: {"a": 1}\n\n: a comment\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    assert list(sse_data(httpx.Response(200, content=body))) == ['{"a": 1}', '{"b": 2}']


def test_the_probe_table_splits_d_s_decodes_by_its_copies_into_the_pool() -> None:
    """The ITL probe's intervals that overlap a copy (within the relay's slack) are "during", the rest
    "outside"; whole decodes split by whether a demotion ran beside them; a decode that failed is counted, a
    copy from before the probe is not."""
    from kvferry.bench.multiturn_capacity import EngineEvents, PoolCopy

    from tools.gpu.stack_conversation import ProbeDecode, probe_table

    t0 = 1_800_000_000.0
    steady = ProbeDecode(t0, [(t0 + 0.010 * i, 1) for i in range(11)])
    # Its fourth interval (30-45 ms) is 15 ms long and overlaps the copy.
    slowed = ProbeDecode(t0 + 1, [(t0 + 1 + 0.010 * i + (0.005 if i > 3 else 0.0), 1) for i in range(11)])
    failed = ProbeDecode(t0 + 2, error="503 engine busy")
    copy = PoolCopy(start=t0 + 1.036, end=t0 + 1.038, copy_ms=2.0, conversations=("c",))
    # An earlier run's copy in the same log (a workdir used again) is not the probe's.
    earlier = PoolCopy(start=t0 - 100, end=t0 - 99.99, copy_ms=10.0, conversations=("old",))
    events = EngineEvents(copies=[earlier, copy], moved=[("old", t0 - 99)])
    rows = probe_table([steady, slowed, failed], events).strip().splitlines()
    assert (
        rows[0] == "ITL probe on D: 3 decodes (1 failed) beside the host arm; D copied into its pool 1 times "
        "and moved 0 retentions."
    )
    assert rows[4] == "| intervals outside demotions | 19 | 10.00 | 10.00 | - |"
    assert rows[5] == "| intervals during a demotion | 1 | 15.00 | 15.00 | +50.0% |"
    assert rows[6] == "| ... of which during a copy | 1 | 15.00 | 15.00 | +50.0% |"
    assert rows[7] == "| whole decodes with no demotion | 1 | 10.00 | 10.00 | - |"
    assert rows[8] == "| whole decodes beside a demotion | 1 | 10.50 | 10.50 | +5.0% |"
    assert probe_table([], EngineEvents()) == ""


@pytest.mark.parametrize(
    "argv", [["--itl-probe-tokens", "-1"], ["--itl-probe-tokens", "100", "--arms", "reuse"]]
)
def test_the_itl_probe_refuses_a_negative_count_or_a_run_without_the_host_arm(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Said before any stack starts, not a probe that never runs."""
    from tools.gpu import stack_conversation

    with pytest.raises(SystemExit) as exit_info:
        stack_conversation.main(["--out", str(tmp_path), *argv])
    assert exit_info.value.code == 2
    assert "--itl-probe-tokens takes a count of tokens >= 0" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("layout", "runs"), [("blocks-first", 2), ("kv-first", 4)])
def test_the_host_tier_copies_tool_moves_and_maps_a_pool_bit_for_bit(
    tmp_path: Path, layout: str, runs: int
) -> None:
    """tools/gpu/host_tier_copies.py on a CPU (memmove): D's HostPool filled from its KV cache, P's mapped
    copy of the slots checked against D's seeded source (the same code the GPU run times). A run of blocks is
    one copy per layer where K and V interleave (blocks first), one per region where they do not."""
    from tools.gpu import host_tier_copies

    out = tmp_path / "copies.json"
    argv = ["--out", str(out), "--device", "cpu", "--shape", "tiny", "--tokens", "256", "--reps", "1"]
    assert host_tier_copies.main([*argv, "--layout", layout]) == 0
    result = json.loads(out.read_text())
    (pull,) = result["pulls"]
    assert pull["verified"] and pull["runs"] == runs  # tiny: 2 layers x K/V
    assert result["copier"] == "memmove"
