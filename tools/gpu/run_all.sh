#!/usr/bin/env bash
# Reproduces every figure of docs/calibration.md on a machine with two H200s (or any two NVIDIA GPUs).
# Usage, from the repository root:  tools/gpu/run_all.sh OUT_DIR
# Needs python3 with torch (CUDA) and numpy; nixl-cu13==1.5.1 and nixl==1.5.1 either installed or as wheels in
# .whl/ (pip download --no-deps ... -d .whl nixl-cu13==1.5.1 nixl==1.5.1), which this script installs into
# /tmp/site without touching the system packages.
set -uo pipefail
out=${1:?usage: tools/gpu/run_all.sh OUT_DIR}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
export PYTHONUNBUFFERED=1
# Multicast can take the host's GPUs down for others; the machines here require it off.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if ! python3 -c 'import nixl' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$repo"/.whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

{
  date -u
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit \
    --format=csv
  nvidia-smi topo -m
  python3 -c 'import torch, numpy, nixl; print("torch", torch.__version__, "cuda", torch.version.cuda,
    "numpy", numpy.__version__, "nixl", nixl.__file__, "gpus", torch.cuda.device_count())'
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

status=0
# 1. NIXL pulls, per-block and coalesced, both shapes, 1k-32k tokens; fragmented block ids at 8k; torch copies.
# Each step has its own time limit so that a hang in one still leaves the others' figures.
timeout "${TRANSFER_LIMIT_S:-300}" python3 "$here/nixl_kv_transfer.py" --out "$out/transfer.json" || status=1
# 1b. The same again: a second sample of every pull, for the run-to-run spread.
timeout "${TRANSFER_LIMIT_S:-300}" python3 "$here/nixl_kv_transfer.py" --fragmented-tokens "" --no-torch \
  --out "$out/transfer_repeat.json" || status=1
# 2. Prefill cost on GPU 0, every layer of both shapes; suffix prefills after cached prefixes.
timeout "${PREFILL_LIMIT_S:-200}" python3 "$here/prefill_cost.py" --out "$out/prefill.json" || status=1
# 3. The same pulls with one GPU visible per process (CUDA_VISIBLE_DEVICES), as vLLM engines are started.
timeout "${ISOLATED_LIMIT_S:-60}" python3 "$here/nixl_kv_transfer.py" --isolate --shapes qwen3-8b --tokens 1024,8192,32768 --fragmented-tokens "" \
  --no-torch --out "$out/transfer_isolated.json" || status=1
# 4. Fit, crossover and the tables.
PYTHONPATH="$repo/services${PYTHONPATH:+:$PYTHONPATH}" python3 "$here/analyze.py" "$out" >"$out/analysis.md" || status=1
cat "$out/analysis.md"
exit $status
