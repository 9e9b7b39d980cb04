"""Engine counts in ``kvferry up``: N prefill and M decode engines, each on a core of its own with its own
id, ports and sidecar socket; refused before anything starts when the cores do not suffice, unless told
to share them. Nothing is started here (two cores hold one engine pair; ``test_up_down.py`` runs it)."""

from __future__ import annotations

import argparse
import itertools
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from kvferry.connector.settings import KvferrySettings
from kvferry.stack import up
from kvferry.stack.engine_plan import EnginePlanError, PlannedEngine, plan_engines
from kvferry.stack.settings import StackConfig, render, resolve, setting_flags


def ports(start: int = 30000) -> Callable[[], int]:
    return itertools.count(start).__next__


def _parse(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    # The parser folds the environment into flag defaults when it is built: build it under `environ`.
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("KVFERRY_")]:
            patch.delenv(name)
        for name, value in (environ or {}).items():
            patch.setenv(name, value)
        parser = argparse.ArgumentParser()
        up.configure(parser)
        return parser.parse_args(argv)


def _config(argv: list[str], environ: dict[str, str] | None = None) -> StackConfig:
    return resolve(_parse(argv, environ), environ or {})


def _summary(plan: tuple[PlannedEngine, ...]) -> list[tuple[str, str, int | None]]:
    return [(engine.engine_id, engine.role, engine.cpu_core) for engine in plan]


def test_the_default_is_one_prefill_and_one_decode_engine_on_cores_of_their_own() -> None:
    config = _config([])
    assert (config.prefill_engines, config.decode_engines, config.share_cores) == (1, 1, False)
    plan = plan_engines(1, 1, free_port=ports(), cores=[0, 1])
    assert _summary(plan) == [("prefill-0", "prefill", 0), ("decode-0", "decode", 1)]
    assert [engine.place for engine in plan] == ["core 0", "core 1"]


def test_more_engines_get_their_own_ids_cores_and_ports() -> None:
    # The cores this process may use need not start at 0 nor be contiguous.
    plan = plan_engines(2, 3, free_port=ports(), cores=[11, 3, 5, 7, 9, 13])
    assert _summary(plan) == [
        ("prefill-0", "prefill", 3),
        ("prefill-1", "prefill", 5),
        ("decode-0", "decode", 7),
        ("decode-1", "decode", 9),
        ("decode-2", "decode", 11),
    ]
    all_ports = [port for engine in plan for port in (engine.http_port, engine.side_channel_port)]
    assert len(set(all_ports)) == 10


def test_ports_are_distinct_and_clear_of_the_routers_even_when_the_source_repeats() -> None:
    repeating = iter([8080, 40000, 40000, 40001, 50052, 40001, 40002, 40003]).__next__
    plan = plan_engines(1, 1, free_port=repeating, cores=[0, 1], reserved_ports=[8080, 50052])
    assert [(e.http_port, e.side_channel_port) for e in plan] == [(40000, 40001), (40002, 40003)]
    with pytest.raises(EnginePlanError, match="no free port"):
        plan_engines(1, 1, free_port=lambda: 8080, cores=[0, 1], reserved_ports=[8080])


def test_fewer_cores_than_engines_is_refused_saying_what_to_change() -> None:
    with pytest.raises(EnginePlanError) as refused:
        plan_engines(2, 2, free_port=ports(), cores=[0, 1])
    message = str(refused.value)
    for words in ("4 engines (2 prefill + 2 decode)", "need 4 CPU cores", "may use 2 (cores 0,1)"):
        assert words in message
    for flag in ("--prefill-engines", "--decode-engines", "--share-cores"):
        assert flag in message


def test_shared_cores_when_asked_for_go_round_robin() -> None:
    plan = plan_engines(2, 2, free_port=ports(), cores=[0, 1], share_cores=True)
    assert [engine.cpu_core for engine in plan] == [0, 1, 0, 1]
    assert len({engine.engine_id for engine in plan}) == 4


def test_each_role_needs_at_least_one_engine() -> None:
    with pytest.raises(EnginePlanError, match="at least one prefill and one decode engine"):
        plan_engines(0, 1, free_port=ports(), cores=[0, 1])
    with pytest.raises(SystemExit):
        _parse(["--decode-engines", "0"])


def test_engine_counts_are_a_flag_an_environment_variable_and_a_config_key(tmp_path: Path) -> None:
    assert _config(["--prefill-engines", "2"]).prefill_engines == 2
    from_env = _config([], {"KVFERRY_DECODE_ENGINES": "3", "KVFERRY_SHARE_CORES": "true"})
    assert (from_env.decode_engines, from_env.share_cores) == (3, True)
    assert from_env.sources is not None
    assert from_env.sources["engines.decode"] == "env KVFERRY_DECODE_ENGINES"
    toml = tmp_path / "stack.toml"
    toml.write_text("[engines]\nprefill = 2\ndecode = 2\nshare_cores = true\n")
    from_file = _config(["--config", str(toml)])
    assert (from_file.prefill_engines, from_file.decode_engines, from_file.share_cores) == (2, 2, True)
    printed = render(from_file)
    assert re.search(r"^prefill = 2  # config .*; env KVFERRY_PREFILL_ENGINES$", printed, re.M), printed
    assert re.search(r"^decode = 2  # config ", printed, re.M) and "share_cores = true" in printed
    # The detached supervisor gets the same counts as flags.
    child = _config(setting_flags(from_file))
    assert (child.prefill_engines, child.decode_engines, child.share_cores) == (2, 2, True)


def test_up_builds_one_engine_with_its_own_sidecar_socket_per_planned_one(tmp_path: Path) -> None:
    config = _config(["--prefill-engines", "2", "--decode-engines", "2", "--retention-ttl", "30"])
    plan = plan_engines(2, 2, free_port=ports(), cores=[0, 1], share_cores=True)
    engines = up.engine_processes(config, plan, tmp_path, tmp_path / "logs")
    assert [(e.engine_id, e.role, e.cpu_core) for e in engines] == _summary(plan)
    assert [(e.http_port, e.side_channel_port) for e in engines] == [
        (p.http_port, p.side_channel_port) for p in plan
    ]
    assert [e.environment()["VLLM_CPU_OMP_THREADS_BIND"] for e in engines] == ["0", "1", "0", "1"]
    sockets = {e.settings.sidecar_address for e in engines}
    assert sockets == {f"unix:{tmp_path}/sidecar-{p.engine_id}.sock" for p in plan}
    assert {e.settings.lease_ttl_seconds for e in engines} == {30}
    assert len({e.log_path for e in engines}) == 4
    sidecar = engines[3].sidecar_args("127.0.0.1:1", engines[3].settings.sidecar_address)
    assert sidecar[sidecar.index("--engine-id") + 1] == "decode-1"
    assert sidecar[sidecar.index("--engine-url") + 1] == engines[3].http_url


def test_the_host_tier_settings_reach_the_decode_engine_s_connector(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--host-pool-blocks, --demote-after-seconds and KVFERRY_DEMOTE_BLOCKS_PER_STEP become the decode
    engine's connector settings (a prefill engine gets no pool); parts of 0 blocks are refused at once."""
    config = _config(
        ["--host-pool-blocks", "64", "--demote-after-seconds", "3"], {"KVFERRY_DEMOTE_BLOCKS_PER_STEP": "8"}
    )
    plan = plan_engines(1, 1, free_port=ports(), cores=[0, 1], share_cores=False)
    prefill, decode = up.engine_processes(config, plan, tmp_path, tmp_path / "logs")
    assert (decode.settings.host_pool_blocks, decode.settings.demote_after_seconds) == (64, 3.0)
    assert decode.settings.demote_blocks_per_step == 8 and prefill.settings.host_pool_blocks == 0
    assert _config([]).demote_blocks_per_step == KvferrySettings().demote_blocks_per_step
    with pytest.raises(SystemExit):
        _config([], {"KVFERRY_DEMOTE_BLOCKS_PER_STEP": "0"})
    assert "KVFERRY_DEMOTE_BLOCKS_PER_STEP" in capsys.readouterr().err


def test_up_refuses_more_engines_than_cores_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cores = len(os.sched_getaffinity(0))
    args = _parse(["--workdir", str(tmp_path), "--prefill-engines", str(cores), "--no-demo"])
    assert up.run(args) == 2
    error = capsys.readouterr().err
    assert f"{cores + 1} engines ({cores} prefill + 1 decode) need {cores + 1} CPU cores" in error
    assert "--share-cores" in error
    assert list(tmp_path.iterdir()) == [], "kvferry up started something before refusing"


def test_engine_ports_keep_clear_of_every_port_the_settings_name(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(
        [
            "--grpc-listen",
            "127.0.0.1:40000",
            "--http-listen",
            "127.0.0.1:40001",
            "--registry-listen",
            "127.0.0.1:40002",
            "--metrics-port",
            "40003",  # registry 40003, router 40004, sidecars 40005 and 40006
        ]
    )
    monkeypatch.setattr(up, "free_port", ports(40000))
    plan = up.engine_plan(config)
    assert [(e.http_port, e.side_channel_port) for e in plan] == [(40007, 40008), (40009, 40010)]


def test_the_engines_get_the_kv_cache_and_max_model_len_the_settings_name(tmp_path: Path) -> None:
    plan = plan_engines(1, 1, free_port=ports(), cores=[0, 1])

    def launch(config: StackConfig) -> list[tuple[str, str | None, str | None]]:
        """Each engine's --max-model-len, its CPU KV cache (GiB) and its GPU one (bytes)."""
        found = []
        for engine in up.engine_processes(config, plan_for(config), tmp_path, tmp_path / "logs"):
            command = engine.command()
            gpu_kv = (
                command.index("--kv-cache-memory-bytes") + 1 if "--kv-cache-memory-bytes" in command else 0
            )
            found.append(
                (
                    command[command.index("--max-model-len") + 1],
                    engine.environment().get("VLLM_CPU_KVCACHE_SPACE"),
                    command[gpu_kv] if gpu_kv else None,
                )
            )
        return found

    def plan_for(config: StackConfig) -> tuple[PlannedEngine, ...]:
        return plan_engines(1, 1, free_port=ports(), gpus=1) if config.gpu else plan

    assert launch(_config([])) == [("8192", "1", None)] * 2
    assert (
        launch(_config(["--max-model-len", "2048"], {"KVFERRY_KV_CACHE_GIB": "3"}))
        == [("2048", "3", None)] * 2
    )
    # A GPU engine's KV cache: what --gpu-memory-utilization leaves, unless the setting sizes it.
    assert launch(_config(["--gpu"])) == [("40960", None, None)] * 2
    sized = _config(["--gpu", "--kv-cache-gib", "20", "--max-model-len", "16384"])
    assert launch(sized) == [("16384", None, str(20 * 2**30))] * 2


def test_up_starts_etcd_on_the_ports_the_settings_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(["--etcd-client-port", "40000"], {"KVFERRY_ETCD_PEER_PORT": "40001"})
    etcd = up.etcd_process(config, tmp_path, tmp_path / "logs")
    command = etcd.command()
    for flag in ("--listen-client-urls", "--advertise-client-urls"):
        assert f"{flag}=http://127.0.0.1:40000" in command
    for flag in ("--listen-peer-urls", "--initial-advertise-peer-urls"):
        assert f"{flag}=http://127.0.0.1:40001" in command
    assert etcd.endpoint == "127.0.0.1:40000"
    # The engines' ports keep clear of them.
    monkeypatch.setattr(up, "free_port", ports(40000))
    assert [(e.http_port, e.side_channel_port) for e in up.engine_plan(config)] == [
        (40002, 40003),
        (40004, 40005),
    ]
    # Unset: etcd picks free ports when it starts (and keeps them across its restarts).
    default = up.etcd_process(_config([]), tmp_path, tmp_path / "logs")
    assert (default.client_port, default.peer_port) == (0, 0)
