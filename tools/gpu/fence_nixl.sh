#!/usr/bin/env bash
# The pull-time fence against a 16k-token pull on one GPU (issue 13's 2 % target), with no engines:
# `python -m kvferry.bench.fence_nixl` (two processes, NIXL over UCX, Qwen3-8B's KV layout in GPU memory,
# the generations in host memory as in an engine). Needs torch (CUDA), numpy and nixl (+ nixl-cu13), and
# python-json-logger for the connector's log lines. Writes OUT/env.txt, summary.txt, ucx-info.txt, fence-*.txt
# (four) and fence-cuda.json: eight files, as many as the device machine sends back.
# On the device machine: bash .gpu-carry/device.sh run tools/gpu/fence_nixl.sh $OUT (tools/gpu/device_carry.sh).
set -uo pipefail
out=${1:?usage: fence_nixl.sh OUT [RUNS]}
runs=${2:-15}
export PYTHONPATH=$PWD/connector:$PWD/pd:$PWD/dev${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# As kvferry's GPU engines run (kvferry.stack.engine.GPU_UCX_ENV): two processes on one GPU need it.
export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc
  python3 -c 'import sys, torch, numpy, nixl; print(sys.version.split()[0], torch.__version__, numpy.__version__)'
  python3 -m pip list 2>/dev/null | grep -i -E '^(nixl|python-json-logger)'
} >"$out/env.txt" 2>&1
bench() {
  local name=$1
  shift
  echo "== $name: $*" | tee -a "$out/summary.txt"
  timeout 240 python3 -m kvferry.bench.fence_nixl --runs "$runs" "$@" >"$out/fence-$name.txt" 2>&1
  grep -v 'NIXL INFO' "$out/fence-$name.txt" | tail -n 2 | tee -a "$out/summary.txt"
}
bench cuda --device cuda --json "$out/fence-cuda.json"
# Which UCX transports carry the data and the generations (UCX's own report, one short run).
UCX_LOG_LEVEL=info timeout 120 python3 -m kvferry.bench.fence_nixl --runs 2 --device cuda \
  >"$out/ucx-info.txt" 2>&1
grep -E 'intra-node|self cfg' "$out/ucx-info.txt" | sed -E 's/^\[[^]]*\] +\[[^]]*\] +//' | sort | uniq -c |
  tee -a "$out/summary.txt"
# The log line's worst case (every block its own generation) and the check prepared only once the data is
# done (what PullFence.prepare saves).
bench cuda-gen1 --device cuda --generation-run-blocks 1
bench cuda-at-done --device cuda --prepare-at-done
bench cpu --device cpu
